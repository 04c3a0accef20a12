"""``lossparity``: prove that every backend computes the same masked losses and gradients.

With no arguments it runs the built-in matrix (kinds x normalisations x dtypes x scenarios) on
the fast backends (``jax-xla``, ``torch``; ``--full`` adds the Pallas and Triton kernels, which
run in their interpreters without a GPU), shows its progress on stderr, prints every failing
case in full and, at the end, one table of the worst error (in units of the bound) per kind and
backend; ``--verbose`` prints every case's line (the oracle's loss, each backend's loss and its
error), ``--quiet`` only a one-line summary and the failures. It writes ``parity_report.json``
and ``parity_report.png`` (every comparison, whatever is printed) and exits with a status from
``EXIT``. ``--inputs FILE`` checks the backends on a user's own batch instead.

Arguments, the file and ``--out`` are all checked, with NumPy alone, before JAX and torch are
imported: a bad one costs a one-line error, not the seconds of those imports.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import math
import platform
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

# Several JAX CPU devices (for the replica scenarios) and the Triton interpreter on CPU-only
# machines; both must be set before JAX and Triton initialise.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

import lossspec  # noqa: E402

from .backends import BACKENDS, Inputs, available, torch_device  # noqa: E402
from .inputs import InputError, found_keys, read_inputs  # noqa: E402
from .matrix import STATUSES, CaseSpec, Result, builtin_cases, run_matrix  # noqa: E402

# The default run: the two fast paths (the built-in matrix in about a minute on 2 cores). The
# kernels (jax-pallas, torch-triton) run in their interpreters on a CPU-only machine, about four
# times that: --full (or --backends all) adds them.
DEFAULT_BACKENDS = ["jax-xla", "torch"]
ALL_BACKENDS = ["jax-xla", "jax-pallas", "torch", "torch-triton"]
DEFAULT_DTYPES = ["float32", "bfloat16", "float16"]
EXIT = {"pass": 0, "fail": 1, "usage": 2, "nonfinite": 3}
# The loss options of --inputs runs and their defaults (those of the public functions,
# lossspec.KIND_SPECS, which also says which kinds take each).
FILE_OPTIONS: dict[str, Any] = {name: default for spec in lossspec.KIND_SPECS.values()
                                for name, default in spec.options if name != "causal_shift"}
# The array a file needs for each kind (entropy: the logits alone).
TARGET_KEY: dict[str, str | None] = {kind: lossspec.KIND_SPECS[kind].target for kind in lossspec.ALL_KINDS}
BUILTIN_SHAPE = ((2, 9), 300)
# --shape's limit on the logits' elements (leading dims x vocabulary): every case of the matrix
# holds several arrays of that size in float64 on each backend, the kernels interpreted on CPU.
MAX_BUILTIN_ELEMENTS = 2**24
MAX_SEED = 2**63 - 1  # --seed: NumPy's generators take non-negative seeds; any int64 one is plenty


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump, no traceback
        raise InputError(message)


def _csv(allowed: Sequence[str], what: str, everything: Sequence[str] | None = None):
    """A comma list of ``allowed`` names; ``all`` stands for ``everything`` when that is given."""
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if everything is not None and items == ["all"]:
            return list(everything)
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            choices = ", ".join([*allowed, *(["all"] if everything is not None else [])])
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {choices}")
        return items

    return parse


def _shape(text: str) -> tuple[tuple[int, ...], int]:
    try:
        dims = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like 2x9x300 (leading dims x vocabulary); got {text!r}") from None
    if len(dims) < 2 or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"shape needs at least one leading dim and a vocabulary, all > 0; got {text!r}")
    if math.prod(dims) > MAX_BUILTIN_ELEMENTS:
        raise argparse.ArgumentTypeError(f"shape {text!r} has {math.prod(dims)} logits; the built-in matrix takes at most "
                                         f"{MAX_BUILTIN_ELEMENTS} (leading dims x vocabulary)")
    return dims[:-1], dims[-1]


def _seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seed must be an integer; got {text!r}") from None
    if not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2**63 - 1]; got {seed}")
    return seed


def build_parser() -> argparse.ArgumentParser:
    """The options; those whose use depends on the run (``--inputs`` or not, the kinds checked)
    default to None so that an explicit one that does not apply can be warned about."""
    parser = _Parser(
        prog="lossparity",
        description=__doc__.split("\n\n")[0] + " Exit status: 0 all pass; 1 a comparison failed; 2 bad arguments, "
                    "file or --out (one line, before any work); 3 non-finite values that match the oracle's "
                    "(NaN or +inf in the inputs) and no failure.",
    )
    parser.add_argument("--kinds", type=_csv(lossspec.ALL_KINDS, "kind"), default=None,
                        help="comma list of loss kinds (default: all six; with --inputs, those the file has arrays "
                             "for: entropy needs the logits alone)")
    parser.add_argument("--backends", type=_csv(list(BACKENDS), "backend", ALL_BACKENDS), default=None,
                        help=f"comma list of backends to compare with the oracle, or 'all' ({','.join(ALL_BACKENDS)}) "
                             f"(default: {','.join(DEFAULT_BACKENDS)}, the fast ones)")
    parser.add_argument("--full", action="store_true",
                        help="every backend, the Pallas and Triton kernels too (--backends all; without a GPU they run in "
                             "their interpreters: minutes)")
    parser.add_argument("--dtypes", type=_csv(DEFAULT_DTYPES, "dtype"), default=None,
                        help="logit dtypes of the built-in matrix (default: float32,bfloat16,float16); with --inputs, "
                             "the one dtype to run the file's logits in (default: the file's own)")
    parser.add_argument("--normalizations", type=_csv(lossspec.ALL_NORMALIZATIONS, "normalization"), default=None,
                        help="only cases with these normalisations (default: all, the per-sequence sequence_mean and "
                             "sequence_sum included)")
    parser.add_argument("--shape", type=_shape, default=None, metavar="AxBx...xV",
                        help="built-in matrix only: leading shape and vocabulary (default: 2x9x300)")
    parser.add_argument("--seed", type=_seed, default=None, help="built-in matrix only: seed of the generated inputs (default: 0)")
    parser.add_argument("--inputs", metavar="FILE",
                        help="check every backend on your own batch: .npz or .safetensors with 'logits', optional "
                             "'labels' and/or 'teacher_logits', 'loss_mask', 'segment_ids'")
    with_inputs = "with --inputs only (the built-in matrix runs its own variants)"
    parser.add_argument("--ignore-index", type=int, default=None, help=f"cross_entropy, {with_inputs} (default: -100)")
    parser.add_argument("--label-smoothing", type=float, default=None, help=f"cross_entropy, {with_inputs} (default: 0)")
    parser.add_argument("--z-loss", type=float, default=None, help=f"cross_entropy, {with_inputs} (default: 0)")
    parser.add_argument("--logit-scale", type=float, default=None, help=f"every kind, {with_inputs} (default: 1)")
    parser.add_argument("--temperature", type=float, default=None,
                        help=f"every kind but cross_entropy, {with_inputs} (default: 1)")
    parser.add_argument("--teacher-logit-scale", type=float, default=None,
                        help=f"the kinds with teacher logits, {with_inputs} (default: 1)")
    parser.add_argument("--beta", type=float, default=None, help=f"jensen_shannon, {with_inputs} (default: 0.5)")
    parser.add_argument("--logit-softcap", type=float, default=None,
                        help=f"every kind: cap * tanh(x / cap) before the scale, {with_inputs} (default: off)")
    parser.add_argument("--teacher-logit-softcap", type=float, default=None,
                        help=f"the kinds with teacher logits, {with_inputs} (default: off)")
    parser.add_argument("--out", default=".", help="folder for parity_report.json and parity_report.png, created if "
                                                   "missing; must not be a file (default: .)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    printing = parser.add_mutually_exclusive_group()
    printing.add_argument("--verbose", action="store_true",
                          help="print every case's line (losses and errors per backend) and the tables per backend and "
                               "per normalisation")
    printing.add_argument("--quiet", action="store_true",
                          help="no progress and no table: a one-line summary, and the failing and non-finite cases")
    return parser


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def _given(args: argparse.Namespace, options: dict[str, Any]) -> list[str]:
    """The options of ``options`` set on the command line."""
    return [option for option in options if getattr(args, option) is not None]


def _value(args: argparse.Namespace, option: str) -> Any:
    value = getattr(args, option)
    return FILE_OPTIONS[option] if value is None else value


def _kinds_taking(option: str) -> list[str]:
    return [kind for kind in lossspec.ALL_KINDS if option in lossspec.KIND_SPECS[kind].option_names]


def check_out(text: str) -> Path:
    """``--out`` as a Path, checked without creating anything: not a file, and a file can be
    created in it or, when it does not exist yet, in its nearest existing parent folder."""
    out = Path(text)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; --out names the folder for parity_report.json and parity_report.png")
    existing = out
    while not existing.exists():  # Path(".").parent is ".", which exists: the loop ends
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"--out {out}: cannot write there ({existing} is a file)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise InputError(f"--out {out}: cannot write there ({error.strerror or error})") from None
    return out


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a new file beside it, renamed over ``path``: whatever
    ``path`` was (a file, or a symbolic link planted there) is replaced, never written through,
    and a reader never sees half a report."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: a fresh file, never an existing one or the target of a link of that name.
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _builtin_cases(args: argparse.Namespace) -> tuple[list[CaseSpec], list[str]]:
    """The built-in matrix, and a warning per loss option given (they apply to --inputs runs)."""
    lead, vocab = args.shape or BUILTIN_SHAPE
    specs = builtin_cases(args.kinds or list(lossspec.ALL_KINDS), args.dtypes or DEFAULT_DTYPES, lead, vocab,
                          0 if args.seed is None else args.seed)
    if args.normalizations:
        specs = [s for s in specs if s.normalization in args.normalizations]
    warnings = [f"{_flag(option)} applies only with --inputs; ignored (the built-in matrix runs its own option variants)"
                for option in _given(args, FILE_OPTIONS)]
    return specs, warnings


def _file_warnings(args: argparse.Namespace, kinds: list[str]) -> list[str]:
    """One line per option given that this --inputs run does not use."""
    checks = ", ".join(kinds)
    warnings = []
    for option in _given(args, FILE_OPTIONS):
        takers = _kinds_taking(option)
        if not set(kinds) & set(takers):
            warnings.append(f"{_flag(option)} applies only to {', '.join(takers)}; ignored (this run checks {checks})")
    warnings += [f"{_flag(o)} applies only to the built-in matrix; ignored with --inputs"
                 for o in ("shape", "seed") if getattr(args, o) is not None]
    if args.dtypes and len(args.dtypes) > 1:
        warnings.append(f"--dtypes: with --inputs the file runs in one dtype; using {args.dtypes[0]}, "
                        f"ignoring {', '.join(args.dtypes[1:])}")
    return warnings


def _missing_arrays(kinds: list[str]) -> str:
    """``"cross_entropy needs 'labels'"``, ``"forward_kl, reverse_kl need 'teacher_logits'"``, one
    part per missing array, for kinds the file lacks the arrays of."""
    parts = []
    for key in dict.fromkeys(TARGET_KEY[kind] for kind in kinds):
        group = [kind for kind in kinds if TARGET_KEY[kind] == key]
        parts.append(f"{', '.join(group)} {'needs' if len(group) == 1 else 'need'} {key!r}")
    return "; ".join(parts)


def _file_normalizations(args: argparse.Namespace, lead_shape: tuple[int, ...]) -> list[str]:
    """``--normalizations``, or every one the file's shape allows: the per-sequence modes need a
    time axis (lossspec.check_sequence_time_axis), so a file of single tokens (logits ``[V]``)
    leaves them out by default; asked for by name, lossspec's error says why."""
    if args.normalizations:
        return list(args.normalizations)
    return [n for n in lossspec.ALL_NORMALIZATIONS if lead_shape or n not in lossspec.SEQUENCE_NORMALIZATIONS]


def _file_cases(args: argparse.Namespace) -> tuple[list[CaseSpec], list[str]]:
    """The cases of a user's file (every kind it has arrays for, or those of --kinds, under every
    normalisation or those of --normalizations; its ``segment_ids`` in every case when it has
    them), each checked by the oracle's own argument checks, and the warnings of the run."""
    arrays, dtypes = read_inputs(args.inputs)
    requested = args.kinds or list(lossspec.ALL_KINDS)
    kinds = [kind for kind in requested if TARGET_KEY[kind] is None or TARGET_KEY[kind] in arrays]
    skipped = [kind for kind in requested if kind not in kinds]
    found = f"(found: {found_keys(arrays)})"
    if not kinds:  # every requested kind lacks its array
        raise InputError(f"{args.inputs}: {_missing_arrays(skipped)} {found}")
    warnings = []
    if skipped and args.kinds:  # by default a file checks the kinds it has arrays for, silently
        keys = {TARGET_KEY[kind] for kind in skipped}
        why = (f"{'it needs' if len(skipped) == 1 else 'they need'} {keys.pop()!r}" if len(keys) == 1
               else _missing_arrays(skipped))
        warnings.append(f"skipping {', '.join(skipped)}: {why} {found}")
    warnings += _file_warnings(args, kinds)

    dtype = (args.dtypes or [None])[0] or {"float64": "float32"}.get(dtypes["logits"], dtypes["logits"])
    logits = lossspec.round_to_dtype(arrays["logits"], dtype)
    mask, ids = arrays.get("loss_mask"), arrays.get("segment_ids")
    label = Path(args.inputs).name
    specs = []
    for kind in kinds:
        key = TARGET_KEY[kind]
        target = None if key is None else arrays[key] if key == "labels" else lossspec.round_to_dtype(arrays[key], dtype)
        options = {o: _value(args, o) for o in lossspec.KIND_SPECS[kind].option_names if o in FILE_OPTIONS}
        inputs = Inputs(logits, target, mask, dtype, ids)
        for normalization in _file_normalizations(args, logits.shape[:-1]):
            spec = CaseSpec(kind, label, inputs, normalization, options)
            try:  # the file's shapes, dtypes and values, checked once, with lossspec's messages
                lossspec.oracle(kind, logits, target, mask, segment_ids=ids, **spec.call_options())
            except (TypeError, ValueError) as error:
                raise InputError(f"{args.inputs}: {error}") from None
            specs.append(spec)
    return specs, warnings


def _name(result: Result) -> str:
    return result.backend if result.reference == "oracle" else f"{result.backend}~{result.reference}"


def row_status(row: list[Result]) -> str:
    """FAIL if any comparison failed, else NONFINITE if any is non-finite, else PASS."""
    statuses = {r.status for r in row}
    return "FAIL" if "fail" in statuses else "NONFINITE" if "nonfinite" in statuses else "PASS"


def _format_row(spec: CaseSpec, row: list[Result], oracle_loss: float) -> str:
    """``STATUS case  oracle loss=L  backend loss=L err=E ...  twin~twin err=E``: losses to 9
    digits (for "none", the sum over tokens), errors in units of the bound; ``!`` marks a
    failed comparison, ``(non-finite)`` a non-finite one that matches its reference."""
    what = "sum(loss)" if spec.normalization == "none" else "loss"
    cells = [f"oracle {what}={oracle_loss:.9g}"]
    for result in row:
        mark = {"pass": "", "fail": "!", "nonfinite": " (non-finite)"}[result.status]
        worst = max(result.loss_error, result.grad_error)
        if result.reference != "oracle":
            cells.append(f"{_name(result)} err={worst:.2g}{mark}")
        elif result.loss is None:
            cells.append(f"{result.backend} crashed!")
        else:
            cells.append(f"{result.backend} {what}={result.loss:.9g} err={worst:.2g}{mark}")
    return f"{row_status(row)} {spec.name}  " + "  ".join(cells)


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as the strings "nan", "inf", "-inf": strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, np.generic):
        return json_safe(value.item())
    return value


def _environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                            "processor": platform.processor(), "cpus": os.cpu_count(), "numpy": np.__version__}
    for module in ("jax", "jaxlib", "flax", "torch", "triton"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - a missing framework is reported, not fatal
            info[module] = None
    # Whether torch-triton's kernels ran compiled ("cuda") or in the Triton interpreter ("cpu").
    info["torch_triton_device"] = str(torch_device("triton")) if info["torch"] is not None else None
    return info


def write_plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({_name(r) for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    floor = 1e-4
    for ax, field, title in ((axes[0], "loss_error", "loss"), (axes[1], "grad_error", "gradient")):
        for i, name in enumerate(names):
            values = [max(getattr(r, field), floor) for r in results if _name(r) == name]
            jitter = np.random.default_rng(i).uniform(-0.25, 0.25, len(values))
            ax.scatter(np.full(len(values), i) + jitter, values, s=10, alpha=0.6)
        ax.axhline(1.0, color="red", linestyle="--", label="SPEC bound")
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(f"{title} error / bound (<= 1 passes; floor {floor:g})")
        ax.legend(loc="upper left")
    axes[0].set_ylabel("error in units of the bound")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    replace_file(path, image.getvalue())


def _group_summary(rows: list[Result], count: str = "cases") -> dict[str, Any]:
    """Counts and worst errors of ``rows`` (the comparisons of one backend: one per case, or of
    one normalisation: ``count`` names the first number)."""
    return {count: len(rows), "failed": sum(r.status == "fail" for r in rows),
            "nonfinite": sum(r.status == "nonfinite" for r in rows),
            "max_loss_error": max(r.loss_error for r in rows), "max_grad_error": max(r.grad_error for r in rows),
            "seconds": round(sum(r.seconds for r in rows), 3)}


def _summary(results: list[Result]) -> dict[str, dict[str, Any]]:
    """Per backend (``name``) or twin pair (``name~twin``)."""
    return {name: _group_summary([r for r in results if _name(r) == name]) for name in sorted({_name(r) for r in results})}


def normalization_group(result: Result) -> str:
    """``normalization``, with ``+segment_ids`` when the case passed segment ids."""
    return result.normalization + ("+segment_ids" if result.segment_ids else "")


def _summary_by_normalization(results: list[Result]) -> dict[str, dict[str, Any]]:
    """Per normalisation, cases with and without segment ids apart, in lossspec's order."""
    order = {name: i for i, name in enumerate(lossspec.ALL_NORMALIZATIONS)}
    groups = sorted({normalization_group(r) for r in results}, key=lambda g: (order[g.split("+")[0]], g))
    return {group: _group_summary([r for r in results if normalization_group(r) == group], "comparisons") for group in groups}


def _print_table(title: str, summary: dict[str, dict[str, Any]], count: str = "cases") -> None:
    print(f"\n{title:32s} {count:>11s}  failed  nonfinite  max loss err  max grad err")
    for name, row in summary.items():
        print(f"{name:32s} {row[count]:11d}  {row['failed']:6d}  {row['nonfinite']:9d}  "
              f"{row['max_loss_error']:12.3g}  {row['max_grad_error']:12.3g}")


def _backends(args: argparse.Namespace) -> list[str]:
    """The backends to run: ``--backends``, every one with ``--full``, else the fast ones."""
    if args.full and args.backends is not None:
        raise InputError("--full runs every backend (--backends all); give --full or --backends, not both")
    return list(ALL_BACKENDS) if args.full else list(args.backends or DEFAULT_BACKENDS)


class Progress:
    """Progress on stderr while the cases run: on a terminal one line rewritten in place
    (``\r``); elsewhere (a log, a pipe) one line per kind when its last case is done. Failing
    and non-finite cases are printed in full on stdout as they come (every case with
    ``verbose``); ``quiet`` prints neither progress nor passing cases."""

    def __init__(self, specs: list[CaseSpec], verbose: bool, quiet: bool, stream: Any = None) -> None:
        self.total, self.done, self.verbose, self.quiet = len(specs), 0, verbose, quiet
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) and not quiet
        self.width = len(str(self.total))
        self.kinds = list(dict.fromkeys(spec.kind for spec in specs))
        self.remaining = {kind: sum(spec.kind == kind for spec in specs) for kind in self.kinds}
        self.per_kind: dict[str, list[Result]] = {kind: [] for kind in self.kinds}
        self.start = time.perf_counter()
        self.shown = 0  # characters of the in-place line on the terminal

    def _clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.stream.flush()
            self.shown = 0

    def __call__(self, spec: CaseSpec, row: list[Result], oracle_loss: float) -> None:
        self.done += 1
        line = _format_row(spec, row, oracle_loss)
        if self.verbose or row_status(row) != "PASS":
            self._clear()
            print(f"[{self.done:>{self.width}}/{self.total}] {line}", flush=True)
        self.per_kind[spec.kind] += row
        self.remaining[spec.kind] -= 1
        if self.quiet:
            return
        seconds = time.perf_counter() - self.start
        if self.tty:
            text = f"lossparity: [{self.done:>{self.width}}/{self.total}] {spec.name} ({seconds:.0f} s)"
            text = text[: max(20, shutil.get_terminal_size((100, 20)).columns - 1)]
            self.stream.write("\r" + text.ljust(self.shown))
            self.stream.flush()
            self.shown = len(text)
        elif not self.remaining[spec.kind]:
            rows = self.per_kind[spec.kind]
            bad = sum(r.status != "pass" for r in rows)
            verdict = f"{bad} not passing" if bad else "all pass"
            print(f"lossparity: [{self.done:>{self.width}}/{self.total}] {spec.kind}: {len(rows)} comparisons, {verdict} "
                  f"({seconds:.0f} s)", file=self.stream, flush=True)

    def finish(self) -> None:
        self._clear()


def _cell(rows: list[Result]) -> str:
    """Worst error of ``rows`` in units of the bound; ``!`` if one failed, ``~`` if one is
    non-finite (and none failed)."""
    if not rows:
        return "-"
    worst = max(max(r.loss_error, r.grad_error) for r in rows)
    mark = "!" if any(r.status == "fail" for r in rows) else "~" if any(r.status == "nonfinite" for r in rows) else ""
    return f"{worst:.2g}{mark}"


def _summary_by_kind(results: list[Result]) -> dict[str, dict[str, Any]]:
    """Per kind, per backend or twin pair: :func:`_group_summary` of its comparisons."""
    kinds = list(dict.fromkeys(r.kind for r in results))
    names = list(dict.fromkeys(_name(r) for r in results))
    return {kind: {name: _group_summary(rows) for name in names
                   if (rows := [r for r in results if r.kind == kind and _name(r) == name])}
            for kind in kinds}


def _print_kind_table(results: list[Result]) -> None:
    """Kinds x backends (and twin pairs): the worst error in units of the bound (<= 1 passes),
    and each kind's verdict."""
    kinds = list(dict.fromkeys(r.kind for r in results))
    names = list(dict.fromkeys(_name(r) for r in results))
    widths = [max(len(name), 6) for name in names]
    print(f"\n{'worst error / bound':20s} " + "  ".join(f"{n:>{w}s}" for n, w in zip(names, widths)) + "  verdict")
    for kind in kinds:
        rows = [r for r in results if r.kind == kind]
        cells = [_cell([r for r in rows if _name(r) == name]) for name in names]
        failed, nonfinite = sum(r.status == "fail" for r in rows), sum(r.status == "nonfinite" for r in rows)
        verdict = f"FAIL ({failed})" if failed else f"NONFINITE ({nonfinite})" if nonfinite else "pass"
        print(f"{kind:20s} " + "  ".join(f"{c:>{w}s}" for c, w in zip(cells, widths)) + f"  {verdict}")
    print("(<= 1 passes; ! a failed comparison, ~ non-finite values that match the reference's)")


def _one_line(status: str, results: list[Result], cases: int, backends: list[str], seconds: float, json_path: Path) -> str:
    worst = max((max(r.loss_error, r.grad_error) for r in results), default=0.0)
    counts = {name: sum(r.status == name for r in results) for name in STATUSES}
    what = f"{len(results)} comparisons ({cases} cases x {', '.join(backends)} and twins)"
    if status == "pass":
        verdict = f"PASS: all {what} within the SPEC bounds, worst {worst:.2g} of the bound"
    elif status == "fail":
        verdict = f"FAIL: {counts['fail']} of {what} failed"
    else:
        verdict = f"NONFINITE: {counts['nonfinite']} of {what} non-finite (no failure)"
    return f"lossparity: {verdict} ({seconds:.0f} s; report {json_path})"


def main(argv: Sequence[str] | None = None) -> int:
    start = time.perf_counter()
    try:  # everything the user gave, checked with NumPy only: no JAX or torch import yet
        args = build_parser().parse_args(argv)
        requested = _backends(args)
        out = check_out(args.out)
        specs, warnings = _file_cases(args) if args.inputs else _builtin_cases(args)
    except InputError as error:
        print(f"lossparity: error: {error}", file=sys.stderr)
        return EXIT["usage"]
    for warning in warnings:
        print(f"lossparity: warning: {warning}", file=sys.stderr)
    backends, missing = available(requested)  # imports jaxloss / torchloss
    for name, why in missing.items():
        print(f"lossparity: skipping {name}: {why}", file=sys.stderr)
    if not [name for name in backends if name != "oracle"]:
        # Zero comparisons would "pass" and prove nothing.
        print("lossparity: error: no backend to compare with the oracle (--backends "
              f"{','.join(requested)}; install jax or torch, or name jax-xla/jax-pallas/torch/torch-triton)", file=sys.stderr)
        return EXIT["usage"]

    if not args.quiet:
        left_out = [name for name in ALL_BACKENDS if name not in requested]
        print(f"lossparity: {len(specs)} cases x {len(backends)} backends ({', '.join(backends)})"
              + (f"; --full adds {', '.join(left_out)}" if left_out and args.backends is None else "")
              + ("; losses to 9 digits, errors in units of the SPEC bound, <= 1 passes" if args.verbose else ""), flush=True)
    progress = Progress(specs, args.verbose, args.quiet)
    try:
        results = run_matrix(specs, backends, on_result=progress)
    finally:
        progress.finish()
    failures = [r for r in results if r.status == "fail"]
    nonfinite = [r for r in results if r.status == "nonfinite"]
    status = "fail" if failures else "nonfinite" if nonfinite else "pass"
    summary = _summary(results)
    report = {
        "passed": status == "pass",
        "status": status,
        "exit_status": EXIT[status],
        "bounds": {"LOSS_RTOL": lossspec.LOSS_RTOL, "GRAD_RTOL": lossspec.GRAD_RTOL, "GRAD_ULPS_16BIT": lossspec.GRAD_ULPS_16BIT},
        "environment": _environment(),
        "inputs": args.inputs,
        "backends": backends,
        "summary": summary,
        "summary_by_kind": _summary_by_kind(results),
        "summary_by_normalization": _summary_by_normalization(results),
        "results": [r.__dict__ for r in results],
        "seconds": round(time.perf_counter() - start, 2),
    }
    json_path = out / "parity_report.json"
    try:  # checked before the run; this only fails if the folder changed meanwhile
        out.mkdir(parents=True, exist_ok=True)
        replace_file(json_path, json.dumps(json_safe(report), indent=1, allow_nan=False).encode())
    except OSError as error:
        print(f"lossparity: error: --out {out}: cannot write there ({error.strerror or error})", file=sys.stderr)
        return EXIT["usage"]
    if not args.no_plot:
        write_plot(results, out / "parity_report.png")
    if args.verbose:
        _print_table("backend (vs reference)", summary)
        _print_table("normalisation (+segment ids)", report["summary_by_normalization"], "comparisons")
    if not args.quiet:
        _print_kind_table(results)
        print(f"wrote {json_path}" + ("" if args.no_plot else f" and {out / 'parity_report.png'}"))
    if failures:
        print(f"\nFAILED: {len(failures)} comparison(s):", file=sys.stderr)
        for failure in failures:
            print(f"  {failure.case} [{failure.backend} vs {failure.reference}]: {failure.message}", file=sys.stderr)
    if nonfinite:
        print(f"\nNONFINITE: {len(nonfinite)} comparison(s) with NaN or inf that the reference has too (not a pass: "
              "those values prove nothing; look for NaN or +inf in the inputs):", file=sys.stderr)
        for flagged in nonfinite:
            print(f"  {flagged.case} [{flagged.backend} vs {flagged.reference}]: {flagged.message}", file=sys.stderr)
    print(_one_line(status, results, len(specs), backends, time.perf_counter() - start, json_path))
    return EXIT[status]


if __name__ == "__main__":
    sys.exit(main())
