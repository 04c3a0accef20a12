"""Launch-shape sweep of the Pallas loss kernels on a GPU (run by ``benchmarks/gpu_check.sh``, full mode).

The JAX twin of :mod:`benchmarks.gpu_triton_sweep`: for each loss kind, times
``jax.value_and_grad(jaxloss.<kind>(..., impl="pallas", tuning=...))`` (jitted; a compile per
configuration, before the timing) at N x V (default 16384 x 131072, bf16 logits, 30% of the
tokens masked), medians of wall-clock calls each ended by ``block_until_ready``, and checks that
every configuration gives the default configuration's loss and gradient up to fp32 reassociation
(the summation order follows the vocabulary block). Two grids (``--grid``):

* ``programs`` (first): at the default block shape, ``Tuning(programs=...)`` one program per
  block of rows (the default) or 1, 2, 4 x the GPU's multiprocessor count, each taking every
  ``programs``-th block of rows (fewer rows in flight: more of the second read from L2);
* ``shapes``: ``block_rows`` x ``vocab_block`` x ``num_warps`` (the defaults, 1 x 4096 with 4 warps,
  8 with a teacher, 16 with a soft cap, chosen offline from scripts/pallas_aot_report.py's counts, were
  never timed; issue 32 asks the Pallas kernels to come within 1.1x of Triton).

Prints a line per configuration and writes JSON::

    python -m benchmarks.gpu_pallas_sweep [--n 16384] [--v 131072] [--reps 10] [--kinds K1,K2] [--grid all|programs|shapes]
                                          [--max-seconds S] [--json PATH]

On a CPU the kernels run in Pallas interpret mode: a smoke test of the script only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxloss
import lossspec

from ._sweep import sweep_kind

ROWS = (1, 2, 4, 8)
BLOCKS = (1024, 2048, 4096)
WARPS = (4, 8)
PROGRAMS_PER_SM = (None, 1, 2, 4)  # None: one program per block of rows (the default)


def configs(grid: str, multiprocessors: int) -> list[dict[str, Any]]:
    """The :class:`lossspec.Tuning` fields of each configuration of ``grid`` (``"programs"``,
    ``"shapes"`` or ``"all"``, the programs grid first); ``{}`` is the default."""
    out: list[dict[str, Any]] = []
    if grid in ("programs", "all"):
        out += [{} if per_sm is None else {"programs": per_sm * multiprocessors} for per_sm in PROGRAMS_PER_SM]
    if grid in ("shapes", "all"):
        out += [{"block_rows": rows, "vocab_block": block, "num_warps": warps} for rows in ROWS for block in BLOCKS for warps in WARPS]
    return out


def multiprocessor_count() -> int:
    """The GPU's multiprocessors (``core_count`` of JAX's device), 2 where JAX does not say (CPU)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 2)


def _time(step: Callable[[], Any], reps: int) -> list[float]:
    """Milliseconds of ``reps`` calls after 2 warm-ups, each ended by ``block_until_ready``."""
    for _ in range(2):
        jax.block_until_ready(step())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step())
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--v", type=int, default=131072)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--kinds", default="cross_entropy,reverse_kl")
    parser.add_argument("--grid", choices=("all", "programs", "shapes"), default="all")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop starting configurations after this long")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    n, v = args.n, args.v
    key_x, key_t, key_y, key_m = jax.random.split(jax.random.key(0), 4)
    logits = (jax.random.normal(key_x, (n, v)) * 2).astype(jnp.bfloat16)
    teacher = (jax.random.normal(key_t, (n, v)) * 2).astype(jnp.bfloat16)
    labels = jax.random.randint(key_y, (n,), 0, v)
    mask = jax.random.uniform(key_m, (n,)) >= 0.3
    multiprocessors = multiprocessor_count()
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    print(f"Pallas sweep: N={n} V={v} bf16, 30% masked, {args.reps} reps, {jax.devices()[0].device_kind}, "
          f"{multiprocessors} multiprocessors", flush=True)
    for kind in args.kinds.split(","):
        fn = getattr(jaxloss, kind)
        spec = lossspec.KIND_SPECS[kind]
        target = labels if spec.has_labels else teacher
        def measure(fields: dict[str, Any]) -> tuple[float, np.ndarray, list[float], dict[str, Any]]:
            tuning = lossspec.Tuning(**fields)

            def loss_of(x: jax.Array) -> jax.Array:
                if spec.has_teacher or spec.has_labels:
                    return fn(x, target, mask, impl="pallas", tuning=tuning)
                return fn(x, mask, impl="pallas", tuning=tuning)

            step = jax.jit(jax.value_and_grad(loss_of))
            compile_start = time.perf_counter()
            loss, grad = jax.block_until_ready(step(logits))  # compiles
            compile_s = time.perf_counter() - compile_start
            return float(loss), np.asarray(grad.astype(jnp.float32)), _time(lambda: step(logits), args.reps), {"compile_s": compile_s}

        rows += sweep_kind(kind, configs(args.grid, multiprocessors), measure,
                           lambda grad, ref: (float(np.abs(grad - ref).max()), float(np.abs(ref).max())),
                           started=t0, max_seconds=args.max_seconds)
    if args.json:
        args.json.write_text(json.dumps({"n": n, "v": v, "reps": args.reps, "jax": jax.__version__,
                                         "device": jax.devices()[0].device_kind, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
