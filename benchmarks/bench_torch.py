"""Benchmark: torchloss's torch path against ``F.cross_entropy`` on the CPU, forward + backward.

    .venv/bin/python benchmarks/bench_torch.py            # N=4096, V=32768, fp32 and bf16

For each dtype and each variant (``torchloss.cross_entropy(impl="torch")`` and
``F.cross_entropy(..., ignore_index=-100)``, the same mean over non-ignored tokens, ~30% of the
tokens ignored) it reports:

* time: the median of ``--reps`` forward+backward steps after ``--warmup`` steps, each step
  ``logits.grad = None; loss = f(logits, labels); loss.backward()``; both variants run in one
  process per dtype, alternating step by step, so that a machine shared with other work slows
  both alike;
* peak extra memory: in a second fresh process, after one warm-up step, the peak resident set
  size during one step minus the resident set size before it (``VmHWM`` after resetting it with
  ``/proc/self/clear_refs``). Everything the step allocates counts, the ``[N, V]`` gradient left
  in ``logits.grad`` included (both variants leave one). glibc is told to serve every allocation
  of 64 KiB or more with ``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so freed buffers leave the RSS at
  once and do not hide in the heap: the RSS then follows the live buffers of both variants.

A table goes to stdout and the numbers to ``benchmarks/results/bench_torch.json``.
Targets: torchloss at most 0.6x the time and at most 0.5x the peak extra memory of F.cross_entropy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("torchloss", "F.cross_entropy")


def _status(key: str) -> int:
    """A field of /proc/self/status in bytes."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:  # pragma: no cover - not Linux
        raise RuntimeError(f"/proc/self/status has no {key}")
    return int(match.group(1)) * 1024


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    import torchloss

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=gen, dtype=dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), generator=gen)
    labels[torch.rand(args.rows, generator=gen) < args.ignored] = -100

    loss_fns = {
        "torchloss": lambda: torchloss.cross_entropy(logits, labels, impl="torch"),
        "F.cross_entropy": lambda: F.cross_entropy(logits, labels, ignore_index=-100),
    }

    def step(variant: str) -> float:
        logits.grad = None
        loss = loss_fns[variant]()
        loss.backward()
        return loss.item()

    if args.measure == "time":
        for _ in range(args.warmup):
            for variant in VARIANTS:
                step(variant)
        times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        losses = {}
        for _ in range(args.reps):
            for variant in VARIANTS:
                start = time.perf_counter()
                losses[variant] = step(variant)
                times[variant].append(time.perf_counter() - start)
        return {"times_s": times, "loss": losses, "threads": torch.get_num_threads()}
    step(args.variant)
    logits.grad = None
    gc.collect()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    loss = step(args.variant)
    peak = _status("VmHWM")
    after = _status("VmRSS")
    return {"peak_extra_bytes": peak - before, "kept_bytes": after - before, "loss": loss}


def _run_child(args: argparse.Namespace, dtype: str, variant: str | None, measure: str) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--child", "--dtype", dtype, "--variant", variant or VARIANTS[0], "--measure", measure,
        "--rows", str(args.rows), "--vocab", str(args.vocab), "--ignored", str(args.ignored),
        "--reps", str(args.reps), "--warmup", str(args.warmup),
    ]  # fmt: skip
    env = dict(os.environ)
    if args.thp:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    if measure == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} {dtype} {measure} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--ignored", type=float, default=0.3, help="fraction of tokens with label -100")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--thp", action="store_true", help="THP_MEM_ALLOC_ENABLE=1 for both variants (huge pages)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/bench_torch[_thp].json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--measure", choices=("time", "memory"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    if args.out is None:
        args.out = ROOT / "benchmarks" / "results" / ("bench_torch_thp.json" if args.thp else "bench_torch.json")

    results: dict[str, Any] = {
        "config": {
            "rows": args.rows, "vocab": args.vocab, "ignored_fraction": args.ignored, "reps": args.reps,
            "warmup": args.warmup, "step": "forward + backward", "baseline": "F.cross_entropy(logits, labels, ignore_index=-100)",
            "ours": "torchloss.cross_entropy(logits, labels, impl='torch')",
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, python {platform.python_version()}",
            "THP_MEM_ALLOC_ENABLE": bool(args.thp),
            "load_average_before": os.getloadavg(),
        },
        "dtypes": {},
    }  # fmt: skip
    rows = []
    for dtype in args.dtypes:
        entry: dict[str, Any] = {}
        timing = _run_child(args, dtype, None, "time")
        for variant in VARIANTS:
            memory = _run_child(args, dtype, variant, "memory")
            entry[variant] = {
                "median_s": statistics.median(timing["times_s"][variant]),
                "times_s": timing["times_s"][variant],
                "peak_extra_MiB": memory["peak_extra_bytes"] / 2**20,
                "kept_MiB": memory["kept_bytes"] / 2**20,
                "loss": timing["loss"][variant],
                "threads": timing["threads"],
            }
        ours, ref = entry["torchloss"], entry["F.cross_entropy"]
        entry["time_ratio"] = ours["median_s"] / ref["median_s"]
        entry["memory_ratio"] = ours["peak_extra_MiB"] / ref["peak_extra_MiB"]
        entry["loss_rel_diff"] = abs(ours["loss"] - ref["loss"]) / abs(ref["loss"])
        results["dtypes"][dtype] = entry
        rows.append((dtype, ours, ref, entry))

    results["config"]["load_average_after"] = os.getloadavg()
    print(
        f"forward+backward, N={args.rows}, V={args.vocab}, {args.ignored:.0%} ignored, median of {args.reps} after "
        f"{args.warmup} warm-up{', THP_MEM_ALLOC_ENABLE=1' if args.thp else ''}; load average "
        f"{results['config']['load_average_before'][0]:.1f} -> {results['config']['load_average_after'][0]:.1f}"
    )
    header = f"{'dtype':9s} {'variant':16s} {'time (s)':>9s} {'peak extra (MiB)':>17s}"
    print(header)
    print("-" * len(header))
    for dtype, ours, ref, entry in rows:
        print(f"{dtype:9s} {'torchloss':16s} {ours['median_s']:9.3f} {ours['peak_extra_MiB']:17.0f}")
        print(f"{dtype:9s} {'F.cross_entropy':16s} {ref['median_s']:9.3f} {ref['peak_extra_MiB']:17.0f}")
        print(
            f"{dtype:9s} {'ratio':16s} {entry['time_ratio']:8.2f}x {entry['memory_ratio']:16.2f}x"
            f"   (targets <= 0.6x, <= 0.5x; loss rel. diff {entry['loss_rel_diff']:.1e})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
