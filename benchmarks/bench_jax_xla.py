"""Forward + backward time of ``jaxloss.cross_entropy(impl="xla")`` against optax.

Both sides are ``jax.jit(jax.value_and_grad(loss))`` of the mean cross-entropy over the
unmasked tokens: ours with ``loss_mask`` (normalization ``"valid_tokens"``), optax's
``softmax_cross_entropy_with_integer_labels(logits, labels, where=mask)`` summed and divided by
the number of valid tokens. N = 4096 tokens, V = 32768, ~30% of the tokens masked, fp32 and
bf16 logits (optax computes in the logits' dtype, ours in fp32 with a bf16 gradient).

Timings are medians over interleaved repetitions after warm-up (compile + two calls), so a
transient load on the machine hits both sides alike. Prints a table and writes
``benchmarks/results/bench_jax_xla.json``.

Usage: ``python benchmarks/bench_jax_xla.py [--tokens 4096] [--vocab 32768] [--reps 7]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jaxloss  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_jax_xla.json"


def make_inputs(tokens: int, vocab: int, dtype: str, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(0.0, 2.0, size=(tokens, vocab)).astype(np.float32)).astype(dtype)
    labels = jnp.asarray(rng.integers(0, vocab, size=tokens).astype(np.int32))
    mask = jnp.asarray(rng.random(tokens) >= 0.3)  # ~30% masked
    return logits, labels, mask


def ours(labels: jax.Array, mask: jax.Array) -> Callable[[jax.Array], Any]:
    def loss(x: jax.Array) -> jax.Array:
        return jaxloss.cross_entropy(x, labels, mask, impl="xla")

    return jax.jit(jax.value_and_grad(loss))


def reference(labels: jax.Array, mask: jax.Array) -> Callable[[jax.Array], Any]:
    def loss(x: jax.Array) -> jax.Array:
        per_token = optax.softmax_cross_entropy_with_integer_labels(x, labels, where=mask)
        return jnp.sum(per_token) / jnp.sum(mask)

    return jax.jit(jax.value_and_grad(loss))


def time_pair(fns: dict[str, Callable[[jax.Array], Any]], x: jax.Array, reps: int) -> dict[str, list[float]]:
    for fn in fns.values():  # compile, then warm caches and allocator
        for _ in range(3):
            jax.block_until_ready(fn(x))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    rows = []
    for dtype in args.dtypes.split(","):
        x, labels, mask = make_inputs(args.tokens, args.vocab, dtype)
        fns = {"jaxloss_xla": ours(labels, mask), "optax": reference(labels, mask)}
        (loss_ours, grad_ours), (loss_ref, grad_ref) = (fn(x) for fn in fns.values())
        max_grad_diff = float(jnp.max(jnp.abs(grad_ours.astype(jnp.float32) - grad_ref.astype(jnp.float32))))
        times = time_pair(fns, x, args.reps)
        t_ours, t_ref = statistics.median(times["jaxloss_xla"]), statistics.median(times["optax"])
        rows.append(
            {
                "dtype": dtype,
                "tokens": args.tokens,
                "vocab": args.vocab,
                "jaxloss_xla_s": t_ours,
                "optax_s": t_ref,
                "ratio": t_ours / t_ref,
                "jaxloss_xla_all_s": times["jaxloss_xla"],
                "optax_all_s": times["optax"],
                "loss_jaxloss": float(loss_ours),
                "loss_optax": float(loss_ref),
                "max_abs_grad_diff": max_grad_diff,
            }
        )
        del x, grad_ours, grad_ref

    print(f"forward+backward, N={args.tokens}, V={args.vocab}, median of {args.reps} (backend {jax.default_backend()})")
    print(f"{'dtype':<10} {'jaxloss xla (s)':>16} {'optax (s)':>10} {'ratio':>7}  {'loss ours':>10} {'loss optax':>10}")
    for row in rows:
        print(
            f"{row['dtype']:<10} {row['jaxloss_xla_s']:>16.4f} {row['optax_s']:>10.4f} {row['ratio']:>7.3f}"
            f"  {row['loss_jaxloss']:>10.5f} {row['loss_optax']:>10.5f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "jax": jax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "target_ratio": 0.6,
    }
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
