"""The torch cross-entropy on a quiet and on a busy CPU: does it degrade more than PyTorch's own?

On a shared or oversubscribed machine the torch path's CPU worker pool (``torchloss/backends/cpu_tiles.py``)
must slow down no more than ``F.cross_entropy`` does. For each shape (``--shapes``: a small one,
where per-op overhead and OpenMP barriers dominate, and a large one, where memory and page
faults do) this times forward+backward of

- ``torchloss``: ``torchloss.cross_entropy(impl="torch")`` (its tiles on the CPU worker pool);
- ``F.cross_entropy``: PyTorch's eager op (one OpenMP parallel region per kernel),

in one process, in interleaved rounds: each round runs every contender once quiet and once busy
(the order of the two conditions and of the contenders rotated from round to round), so that load
from elsewhere that comes and goes slows both conditions alike. *Busy* is ``--busy N`` spinning
subprocesses started by this script for that half of the round and stopped after it; each one also
ends itself after ``--busy-seconds`` (a hard limit, should this process die first). *Quiet* means
no spinner of ours: other people's processes on a shared machine still run (the load averages are
recorded). Writes ``<out-dir>/<name>.json`` (every repetition) and ``<name>.md``.

    python -m benchmarks.busy --busy 2 --name cpu_busy   # 256x4096 and 4096x32768 fp32, 7 rounds (~1-3 min)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._registry import MASKED_FRACTION, MIN_REPS, parse_shape  # noqa: E402
from benchmarks.run import RESULTS, describe_machine, machine_info  # noqa: E402
from benchmarks.spinners import Spinners  # noqa: E402

CONTENDERS = ("torchloss", "F.cross_entropy")
SHAPES = "256x4096,4096x32768"
def contenders(n: int, v: int, dtype: str, masked: float, seed: int = 0) -> dict[str, Callable[[], None]]:
    """Forward+backward closures over shared inputs (labels with ``masked`` of them ``-100``)."""
    import torch
    import torch.nn.functional as F

    import torchloss

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen) * 2.0).to(getattr(torch, dtype))
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.randperm(n, generator=gen)[: int(round(masked * n))]] = -100

    def ours() -> None:
        x = logits.detach().requires_grad_()
        torchloss.cross_entropy(x, labels, impl="torch").backward()

    def eager() -> None:
        x = logits.detach().requires_grad_()
        F.cross_entropy(x, labels, ignore_index=-100).backward()

    return {"torchloss": ours, "F.cross_entropy": eager}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds per shape; returns the JSON record."""
    shapes = [parse_shape(shape) for shape in args.shapes.split(",")]
    machine = machine_info("cpu")  # before the rounds: the commit and tree measured, not edits made meanwhile
    load_before = os.getloadavg()
    started = time.time()
    runs = []
    for n, v in shapes:
        calls = contenders(n, v, args.dtype, args.masked)
        for call in calls.values():  # warm-up (first-call allocations, the pool's threads)
            call()
        times: dict[str, dict[str, list[float]]] = {cond: {name: [] for name in calls} for cond in ("quiet", "busy")}
        names = list(calls)
        repeat = args.calls or (20 if n * v < 1 << 22 else 1)  # small calls: several per half-round
        for rnd in range(args.reps):
            conditions = ("quiet", "busy") if rnd % 2 == 0 else ("busy", "quiet")
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            for cond in conditions:
                with Spinners(args.busy if cond == "busy" else 0, args.busy_seconds):
                    for name in order:
                        for _ in range(repeat):
                            t0 = time.perf_counter()
                            calls[name]()
                            times[cond][name].append(time.perf_counter() - t0)
            print(f"  {n}x{v} round {rnd + 1}/{args.reps}: load {os.getloadavg()[0]:.1f}", flush=True)
        runs.append({"shape": [n, v], "calls": repeat, "times_s": times})
    return {
        "command": "python -m benchmarks.busy " + " ".join(sys.argv[1:]),
        "started": _dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "dtype": args.dtype, "masked": args.masked, "busy": args.busy, "reps": args.reps,
        "machine": machine,
        "runs": runs,
    }


def summary(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Per contender: median quiet and busy (ms), busy/quiet, and ours/F.cross_entropy per condition."""
    out: dict[str, dict[str, float]] = {}
    for name in times["quiet"]:
        quiet, busy = (statistics.median(times[c][name]) * 1e3 for c in ("quiet", "busy"))
        out[name] = {"quiet_ms": quiet, "busy_ms": busy, "busy_over_quiet": busy / quiet}
    for name, row in out.items():
        row["quiet_vs_eager"] = row["quiet_ms"] / out["F.cross_entropy"]["quiet_ms"]
        row["busy_vs_eager"] = row["busy_ms"] / out["F.cross_entropy"]["busy_ms"]
    return out


def markdown(record: dict[str, Any]) -> str:
    git = record["machine"]["git"]
    lines = [
        f"# Torch cross-entropy on a quiet and a busy CPU ({record['dtype']}, {record['masked']:.0%} masked)",
        "",
        f"Machine: {describe_machine(record['machine'])}",
        "",
        f"Command: `{record['command']}`; commit `{git['commit']}` ({'changed tree' if git['dirty'] else 'clean tree'}); "
        f"started {record['started']}, {record['seconds']:.0f} s; load average {tuple(round(x, 2) for x in record['load_before'])}"
        f" -> {tuple(round(x, 2) for x in record['load_after'])}",
        "",
        f"Busy: {record['busy']} spinning subprocesses during that half of each round; quiet: none of ours "
        "(other processes on the machine still ran: see the load averages). Forward+backward, ms, "
        f"min / median / max over {record['reps']} interleaved rounds (calls per contender and half-round: "
        + ", ".join(f"{run['calls']} at {run['shape'][0]}x{run['shape'][1]}" for run in record["runs"]) + ").",
        "",
        "| shape | contender | quiet ms | busy ms | busy / quiet (medians) | / F.cross_entropy quiet | / F.cross_entropy busy |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for run in record["runs"]:
        n, v = run["shape"]
        times = run["times_s"]
        rows = summary(times)
        for name, row in rows.items():
            spread = {c: "/".join(f"{f(times[c][name]) * 1e3:.1f}" for f in (min, statistics.median, max)) for c in times}
            lines.append(f"| {n}x{v} | {name} | {spread['quiet']} | {spread['busy']} | {row['busy_over_quiet']:.2f} | "
                         f"{row['quiet_vs_eager']:.2f} | {row['busy_vs_eager']:.2f} |")
        ours, eager = rows["torchloss"]["busy_over_quiet"], rows["F.cross_entropy"]["busy_over_quiet"]
        verdicts.append(f"{n}x{v}: torchloss slows down {ours:.2f}x under the load, F.cross_entropy {eager:.2f}x "
                        f"({'no worse' if ours <= eager else 'WORSE'} than PyTorch's own op); busy, torchloss takes "
                        f"{rows['torchloss']['busy_vs_eager']:.2f}x F.cross_entropy's time.")
    lines += [""] + verdicts
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.busy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=2, help="spinning subprocesses in the busy condition (default 2)")
    parser.add_argument("--busy-seconds", type=float, default=120.0,
                        help="hard limit of each spinner's life in seconds (default 120; each is stopped after its half-round anyway)")
    parser.add_argument("--shapes", default=SHAPES, help=f"comma-separated NxV (default {SHAPES})")
    parser.add_argument("--calls", type=int, default=0,
                        help="timed calls per contender and half-round (default: 20 below 2**22 logits, else 1)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--masked", type=float, default=MASKED_FRACTION, help="fraction of masked tokens (default 0.3)")
    parser.add_argument("--reps", type=int, default=MIN_REPS, help=f"interleaved rounds (default {MIN_REPS})")
    parser.add_argument("--name", default="cpu_busy", help="file name of the results (default cpu_busy)")
    parser.add_argument("--out-dir", default=str(RESULTS), help="folder of the results (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.busy < 1 or args.reps < 1 or args.calls < 0:
        parser.error("--busy and --reps must be at least 1, --calls at least 0")
    record = measure(args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    text = markdown(record)
    (out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
