"""``lossparity``: prove that every backend computes the same masked losses and gradients.

With no arguments it runs the built-in matrix (kinds x normalisations x dtypes x scenarios x
backends), prints one line per case as it goes, writes ``parity_report.json`` and
``parity_report.png`` and exits 1 if any comparison exceeds its SPEC bound. ``--inputs FILE``
checks every backend on a user's own batch instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

# Several JAX CPU devices (for the replica scenarios) and the Triton interpreter on CPU-only
# machines; both must be set before JAX and Triton initialise.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

import lossspec  # noqa: E402

from .backends import BACKENDS, Inputs, available  # noqa: E402
from .inputs import InputError, read_inputs  # noqa: E402
from .matrix import CaseSpec, Result, builtin_cases, run_matrix  # noqa: E402

DEFAULT_BACKENDS = ["jax-xla", "jax-pallas", "torch", "torch-triton"]
DEFAULT_DTYPES = ["float32", "bfloat16", "float16"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump, no traceback
        raise InputError(message)


def _csv(allowed: Sequence[str], what: str):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {', '.join(allowed)}")
        return items

    return parse


def _shape(text: str) -> tuple[tuple[int, ...], int]:
    try:
        dims = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like 2x9x300 (leading dims x vocabulary); got {text!r}") from None
    if len(dims) < 2 or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"shape needs at least one leading dim and a vocabulary, all > 0; got {text!r}")
    return dims[:-1], dims[-1]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lossparity",
        description=__doc__.split("\n\n")[0] + " Exit status: 0 all pass, 1 a comparison failed, 2 bad arguments or file.",
    )
    parser.add_argument("--kinds", type=_csv(lossspec.KINDS, "kind"), default=list(lossspec.KINDS),
                        help="comma list of loss kinds (default: all four)")
    parser.add_argument("--backends", type=_csv(list(BACKENDS), "backend"), default=DEFAULT_BACKENDS,
                        help=f"comma list of backends to compare with the oracle (default: {','.join(DEFAULT_BACKENDS)})")
    parser.add_argument("--dtypes", type=_csv(DEFAULT_DTYPES, "dtype"), default=None,
                        help="logit dtypes of the built-in matrix (default: float32,bfloat16,float16); with --inputs, "
                             "the dtype to run the file's logits in (default: the file's own)")
    parser.add_argument("--normalizations", type=_csv(lossspec.NORMALIZATIONS, "normalization"), default=None,
                        help="only cases with these normalisations (default: all)")
    parser.add_argument("--shape", type=_shape, default=((2, 9), 300), metavar="AxBx...xV",
                        help="leading shape and vocabulary of the built-in cases (default: 2x9x300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated inputs")
    parser.add_argument("--inputs", metavar="FILE",
                        help="check every backend on your own batch: .npz or .safetensors with 'logits', 'labels' "
                             "and/or 'teacher_logits', optional 'loss_mask'")
    parser.add_argument("--ignore-index", type=int, default=-100)
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--z-loss", type=float, default=0.0)
    parser.add_argument("--logit-scale", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--teacher-logit-scale", type=float, default=1.0)
    parser.add_argument("--out", default=".", help="folder for parity_report.json and parity_report.png (default: .)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    parser.add_argument("--quiet", action="store_true", help="print only failures and the summary")
    return parser


def _file_cases(args: argparse.Namespace) -> list[CaseSpec]:
    arrays, dtypes = read_inputs(args.inputs)
    dtype = (args.dtypes or [None])[0] or {"float64": "float32"}.get(dtypes["logits"], dtypes["logits"])
    logits = lossspec.round_to_dtype(arrays["logits"], dtype)
    mask = arrays.get("loss_mask")
    label = Path(args.inputs).name
    normalizations = args.normalizations or list(lossspec.NORMALIZATIONS)
    specs = []
    for kind in args.kinds:
        if kind == "cross_entropy":
            if "labels" not in arrays:
                continue
            target = arrays["labels"]
            options = {"ignore_index": args.ignore_index, "label_smoothing": args.label_smoothing,
                       "z_loss": args.z_loss, "logit_scale": args.logit_scale}
        else:
            if "teacher_logits" not in arrays:
                continue
            target = lossspec.round_to_dtype(arrays["teacher_logits"], dtype)
            options = {"temperature": args.temperature, "logit_scale": args.logit_scale,
                       "teacher_logit_scale": args.teacher_logit_scale}
        inputs = Inputs(logits, target, mask, dtype)
        for normalization in normalizations:
            spec = CaseSpec(kind, label, inputs, normalization, options)
            try:  # the file's shapes, dtypes and values, checked once, with lossspec's messages
                lossspec.oracle(kind, logits, target, mask, **spec.call_options())
            except (TypeError, ValueError) as error:
                raise InputError(f"{args.inputs}: {error}") from None
            specs.append(spec)
    if not specs:
        raise InputError(f"{args.inputs}: nothing to check for kinds {', '.join(args.kinds)}")
    return specs


def _format_row(spec: CaseSpec, row: list[Result]) -> str:
    cells = []
    for result in row:
        name = result.backend if result.reference == "oracle" else f"{result.backend}~{result.reference}"
        worst = max(result.loss_error, result.grad_error)
        cells.append(f"{name} {worst:.2g}" + ("" if result.ok else "!"))
    status = "PASS" if all(r.ok for r in row) else "FAIL"
    return f"{status} {spec.name}  " + "  ".join(cells)


def _environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                            "processor": platform.processor(), "cpus": os.cpu_count(), "numpy": np.__version__}
    for module in ("jax", "jaxlib", "flax", "torch", "triton"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - a missing framework is reported, not fatal
            info[module] = None
    return info


def write_plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r.backend if r.reference == "oracle" else f"{r.backend}~{r.reference}" for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    floor = 1e-4
    for ax, field, title in ((axes[0], "loss_error", "loss"), (axes[1], "grad_error", "gradient")):
        for i, name in enumerate(names):
            values = [max(getattr(r, field), floor) for r in results
                      if (r.backend if r.reference == "oracle" else f"{r.backend}~{r.reference}") == name]
            jitter = np.random.default_rng(i).uniform(-0.25, 0.25, len(values))
            ax.scatter(np.full(len(values), i) + jitter, values, s=10, alpha=0.6)
        ax.axhline(1.0, color="red", linestyle="--", label="SPEC bound")
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(f"{title} error / bound (<= 1 passes; floor {floor:g})")
        ax.legend(loc="upper left")
    axes[0].set_ylabel("error in units of the bound")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    start = time.perf_counter()
    try:
        args = build_parser().parse_args(argv)
        backends, missing = available(args.backends)
        for name, why in missing.items():
            print(f"lossparity: skipping {name}: {why}", file=sys.stderr)
        if args.inputs:
            specs = _file_cases(args)
        else:
            lead, vocab = args.shape
            specs = builtin_cases(args.kinds, args.dtypes or DEFAULT_DTYPES, lead, vocab, args.seed)
            if args.normalizations:
                specs = [s for s in specs if s.normalization in args.normalizations]
    except InputError as error:
        print(f"lossparity: error: {error}", file=sys.stderr)
        return 2

    print(f"lossparity: {len(specs)} cases x {len(backends)} backends ({', '.join(backends)}); "
          f"errors in units of the SPEC bound, <= 1 passes")
    counter = {"done": 0}

    def progress(spec: CaseSpec, row: list[Result]) -> None:
        counter["done"] += 1
        line = _format_row(spec, row)
        if not args.quiet or not line.startswith("PASS"):
            print(f"[{counter['done']:>{len(str(len(specs)))}}/{len(specs)}] {line}", flush=True)

    results = run_matrix(specs, backends, on_result=progress)
    failures = [r for r in results if not r.ok]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in sorted({r.backend if r.reference == "oracle" else f"{r.backend}~{r.reference}" for r in results}):
        rows = [r for r in results if (r.backend if r.reference == "oracle" else f"{r.backend}~{r.reference}") == name]
        summary[name] = {"cases": len(rows), "failed": sum(not r.ok for r in rows),
                         "max_loss_error": max(r.loss_error for r in rows), "max_grad_error": max(r.grad_error for r in rows),
                         "seconds": round(sum(r.seconds for r in rows), 3)}
    report = {
        "passed": not failures,
        "bounds": {"LOSS_RTOL": lossspec.LOSS_RTOL, "GRAD_RTOL": lossspec.GRAD_RTOL, "GRAD_ULPS_16BIT": lossspec.GRAD_ULPS_16BIT},
        "environment": _environment(),
        "inputs": args.inputs,
        "summary": summary,
        "results": [r.__dict__ for r in results],
        "seconds": round(time.perf_counter() - start, 2),
    }
    json_path = out / "parity_report.json"
    json_path.write_text(json.dumps(report, indent=1, default=float))
    print("\nbackend (vs reference)          cases  failed  max loss err  max grad err")
    for name, row in summary.items():
        print(f"{name:32s} {row['cases']:5d}  {row['failed']:6d}  {row['max_loss_error']:12.3g}  {row['max_grad_error']:12.3g}")
    if not args.no_plot:
        write_plot(results, out / "parity_report.png")
        print(f"wrote {json_path} and {out / 'parity_report.png'}")
    else:
        print(f"wrote {json_path}")
    if failures:
        print(f"\nFAILED: {len(failures)} comparison(s):", file=sys.stderr)
        for failure in failures[:20]:
            print(f"  {failure.case} [{failure.backend} vs {failure.reference}]: {failure.message}", file=sys.stderr)
        return 1
    print(f"all {len(results)} comparisons within the SPEC bounds ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
