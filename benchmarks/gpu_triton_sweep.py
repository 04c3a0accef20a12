"""Launch-shape sweep of the Triton loss kernels on a GPU (run by ``benchmarks/gpu_check.sh``).

For each loss kind, times ``torchloss.<kind>(..., impl="triton")`` forward + backward at
N x V (default 16384 x 131072, bf16 logits, 30% of the tokens masked) for each configuration,
medians of CUDA-event timings, and checks that every configuration gives the default
configuration's loss and gradient up to fp32 reassociation (the summation order follows the
block). Two grids (``--grid``):

* ``pipeline`` (first): at the default block and warps, the loops' software pipelining
  (``Tuning(num_stages=1, 2, 3)``) times the persistent programs of the fused and regrad kernels
  (``Tuning(programs=None``, one per row, or 1, 2, 4 x the multiprocessor count): fewer rows in
  flight, so that more of each row's second read (walked last block first) comes from L2;
* ``shapes``: each vocabulary block (``Tuning(vocab_block=...)``) x warp count (``num_warps``).

Besides, per kind, the default launch with a non-unit upstream gradient (``(0.5 * loss).backward()``):
the 16-bit backward then rewrites every valid row from the statistics the forward kept
(``regrad_kernel``, pass 2 alone), against the same call's unit-upstream time (``"upstream"`` rows).

Prints a table and writes JSON::

    python -m benchmarks.gpu_triton_sweep [--n 16384] [--v 131072] [--reps 20] [--kinds K1,K2] [--grid all|pipeline|shapes]
                                          [--max-seconds S] [--json PATH]

The defaults of ``torchloss.backends.triton`` (``DEFAULTS.vocab_block``, ``num_warps``) are chosen from this
sweep; the kernels' correctness at every block size is the test suite's business.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import lossspec
import torchloss
from torchloss.backends import triton as _triton

from ._sweep import sweep_kind

KINDS = ("cross_entropy", "soft_cross_entropy", "forward_kl", "reverse_kl")
BLOCKS = (2048, 4096, 8192, 16384, 32768)  # 32768 x 16-32 warps: the peers' (Liger) blocks
WARPS = (8, 16, 32)
STAGES = (1, 2, 3)
PROGRAMS_PER_SM = (None, 1, 2, 4)  # None: one program per row (the default)


def configs(grid: str, multiprocessors: int) -> list[dict[str, Any]]:
    """The :class:`lossspec.Tuning` fields of each configuration of ``grid`` (``"pipeline"``,
    ``"shapes"`` or ``"all"``, the pipeline grid first); ``{}`` is the default."""
    out: list[dict[str, Any]] = []
    if grid in ("pipeline", "all"):
        for per_sm in PROGRAMS_PER_SM:
            for stages in STAGES:
                fields: dict[str, Any] = {} if stages == 1 else {"num_stages": stages}
                if per_sm is not None:
                    fields["programs"] = per_sm * multiprocessors
                out.append(fields)
    if grid in ("shapes", "all"):
        out += [{"vocab_block": block, "num_warps": warps} for block in BLOCKS for warps in WARPS]
    return out


def _time(step: Callable[[], Any], reps: int, cuda: bool) -> list[float]:
    """Milliseconds of ``reps`` calls after 3 warm-ups (CUDA events; the wall clock on the CPU,
    where the interpreter makes this a smoke test only)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        if not cuda:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _head_kernels(reps: int, cuda: bool, n: int = 2048, hidden: int = 2048, vocab: int = 32768) -> list[dict[str, Any]]:
    """The fused head's torch path (exact and ``precision="tensor"``) against the three bf16
    matmuls alone, cross-entropy at a small bf16 shape (the head's Triton kernels, which this
    timed too, were retired after it measured them: docs/linear_head.md)."""
    device = "cuda" if cuda else "cpu"
    gen = torch.Generator(device=device).manual_seed(1)
    h = (torch.randn((n, hidden), generator=gen, device=device)).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn((vocab, hidden), generator=gen, device=device) * 0.02).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), generator=gen, device=device)
    mask = torch.rand((n,), generator=gen, device=device) >= 0.3
    out = []

    def fused(precision: str) -> Callable[[], Any]:
        def step() -> Any:
            h.grad = w.grad = None
            loss = torchloss.linear_cross_entropy(h, w, labels, mask, precision=precision)
            loss.backward()
            return loss
        return step

    def matmuls() -> Any:
        with torch.no_grad():
            z = h @ w.t()
            return z @ w, z.t() @ h

    for name, step in (("linear_cross_entropy exact", fused("exact")), ("linear_cross_entropy tensor", fused("tensor")),
                       ("three bf16 matmuls", matmuls)):
        try:
            loss = step()
            times = _time(step, max(3, reps // 4), cuda)
            row = {"what": name, "n": n, "h": hidden, "v": vocab, "median_ms": statistics.median(times), "min_ms": min(times)}
            if name.startswith("linear"):
                row["loss"] = float(loss.detach().double())
        except Exception as exc:  # noqa: BLE001
            row = {"what": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        out.append(row)
        print(f"head N={n} H={hidden} V={vocab} bf16 {name:34}: " + (row["error"] if "error" in row else f"{row['median_ms']:8.2f} ms median"
              + (f", loss {row['loss']:.6f}" if "loss" in row else "")), flush=True)
    return out


def _upstream_row(kind: str, fn: Callable[..., Any], logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, reps: int,
                  cuda: bool) -> dict[str, Any]:
    """Forward + backward at the default launch with the upstream gradient 1 and 0.5: the second
    runs the 16-bit backward's recompute of every valid row (pass 2 from the kept statistics)."""
    row: dict[str, Any] = {"kind": kind}
    for name, scale in (("unit_ms", 1.0), ("half_ms", 0.5)):
        def step() -> Any:
            logits.grad = None
            loss = fn(logits, target, mask, impl="triton")
            (loss * scale if scale != 1.0 else loss).backward()
            return loss
        row[name] = statistics.median(_time(step, reps, cuda))
    print(f"{kind:20} bf16 forward + backward, upstream 1: {row['unit_ms']:8.2f} ms, upstream 0.5 (regrad): {row['half_ms']:8.2f} ms median",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--v", type=int, default=131072)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--kinds", default="cross_entropy,reverse_kl")
    parser.add_argument("--grid", choices=("all", "pipeline", "shapes"), default="all")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop starting configurations after this long")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--head", action="store_true", help="also time the fused head's torch path (small shape)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    n, v = args.n, args.v
    logits = (torch.randn((n, v), generator=gen, device=device) * 2).to(torch.bfloat16).requires_grad_(True)
    teacher = (torch.randn((n, v), generator=gen, device=device) * 2).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=gen, device=device)
    mask = torch.rand((n,), generator=gen, device=device) >= 0.3
    default_block, default_warps = _triton.DEFAULTS.vocab_block, _triton.num_warps
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 2
    rows: list[dict[str, Any]] = []
    upstream: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    print(f"Triton sweep: N={n} V={v} bf16, 30% masked, {args.reps} reps; default vocab_block={default_block}, "
          f"num_warps(block)={default_warps(min(default_block, v))}, {multiprocessors} multiprocessors", flush=True)
    for kind in args.kinds.split(","):
        fn = getattr(torchloss, kind)
        target = labels if lossspec.KIND_SPECS[kind].has_labels else teacher

        def step(tuning: lossspec.Tuning) -> torch.Tensor:
            logits.grad = None
            loss = fn(logits, target, mask, impl="triton", tuning=tuning)
            loss.backward()
            return loss

        def measure(fields: dict[str, Any]) -> tuple[float, torch.Tensor, list[float], dict[str, Any]]:
            tuning = lossspec.Tuning(**fields)  # every job's launches
            loss = step(tuning).detach().double().item()
            grad = logits.grad.detach().float()
            return loss, grad, _time(lambda: step(tuning), args.reps, cuda), {}

        rows += sweep_kind(kind, configs(args.grid, multiprocessors), measure,
                           lambda grad, ref: (float((grad - ref).abs().max()), float(ref.abs().max())),
                           started=t0, max_seconds=args.max_seconds)
        upstream.append(_upstream_row(kind, fn, logits, target, mask, args.reps, cuda))
    head = _head_kernels(args.reps, cuda) if args.head else []
    if args.json:
        args.json.write_text(json.dumps({"n": n, "v": v, "reps": args.reps, "torch": torch.__version__,
                                         "gpu": torch.cuda.get_device_name(0) if cuda else None, "rows": rows, "upstream": upstream,
                                         "head": head}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
