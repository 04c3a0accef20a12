"""Forward + backward time of ``jaxloss.cross_entropy(impl="xla")`` against optax.

Both sides are ``jax.jit(jax.value_and_grad(loss))`` of the mean cross-entropy over the
unmasked tokens, with labels and mask passed as arguments of the jitted step (as in training, so
XLA cannot constant-fold anything that depends on them): ours with ``loss_mask`` (normalization ``"valid_tokens"``), optax's
``softmax_cross_entropy_with_integer_labels(logits, labels, where=mask)`` summed and divided by
the number of valid tokens. N = 4096 tokens, V = 32768, ~30% of the tokens masked, fp32 and
bf16 logits (optax computes in the logits' dtype, ours in fp32 with a bf16 gradient).

Timings are medians over interleaved repetitions after warm-up (compile + two calls), so a
transient load on the machine hits both sides alike. A third contender, ``x * 2`` (read the
logits, write one logits-sized buffer), is the speed of light of any fused forward+backward: on
the CPU most of it is the kernel faulting in the fresh pages of the returned gradient, a cost
every contender pays. Prints a table and writes ``benchmarks/results/bench_jax_xla.json``.

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


# Labels and mask are arguments of the jitted step (as in training), not constants XLA could fold.
Step = Callable[[jax.Array, jax.Array, jax.Array], Any]


def ours() -> Step:
    def loss(x: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
        return jaxloss.cross_entropy(x, labels, mask, impl="xla")

    return jax.jit(jax.value_and_grad(loss))


def reference() -> Step:
    def loss(x: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
        per_token = optax.softmax_cross_entropy_with_integer_labels(x, labels, where=mask)
        return jnp.sum(per_token) / jnp.sum(mask)

    return jax.jit(jax.value_and_grad(loss))


def speed_of_light() -> Step:
    return jax.jit(lambda x, labels, mask: x * 2)


def time_pair(fns: dict[str, Step], args: tuple[jax.Array, ...], reps: int) -> dict[str, list[float]]:
    for fn in fns.values():  # compile, then warm caches and allocator
        for _ in range(3):
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path, default=RESULTS)
    cli = parser.parse_args()

    load_start = os.getloadavg()
    rows = []
    for dtype in cli.dtypes.split(","):
        x, labels, mask = make_inputs(cli.tokens, cli.vocab, dtype)
        args = (x, labels, mask)
        fns = {"jaxloss_xla": ours(), "optax": reference(), "x*2": speed_of_light()}
        (loss_ours, grad_ours), (loss_ref, grad_ref) = fns["jaxloss_xla"](*args), fns["optax"](*args)
        max_grad_diff = float(jnp.max(jnp.abs(grad_ours.astype(jnp.float32) - grad_ref.astype(jnp.float32))))
        times = time_pair(fns, args, cli.reps)
        t_ours, t_ref = statistics.median(times["jaxloss_xla"]), statistics.median(times["optax"])
        t_sol = statistics.median(times["x*2"])
        rows.append(
            {
                "dtype": dtype,
                "tokens": cli.tokens,
                "vocab": cli.vocab,
                "jaxloss_xla_s": t_ours,
                "optax_s": t_ref,
                "ratio": t_ours / t_ref,
                "speed_of_light_s": t_sol,
                "jaxloss_xla_all_s": times["jaxloss_xla"],
                "optax_all_s": times["optax"],
                "speed_of_light_all_s": times["x*2"],
                "loss_jaxloss": float(loss_ours),
                "loss_optax": float(loss_ref),
                "max_abs_grad_diff": max_grad_diff,
            }
        )
        del x, args, grad_ours, grad_ref

    print(f"forward+backward, N={cli.tokens}, V={cli.vocab}, median of {cli.reps} (backend {jax.default_backend()})")
    print(
        f"{'dtype':<10} {'jaxloss xla (s)':>16} {'optax (s)':>10} {'ratio':>7} {'x*2 (s)':>9}"
        f"  {'loss ours':>10} {'loss optax':>10}"
    )
    for row in rows:
        print(
            f"{row['dtype']:<10} {row['jaxloss_xla_s']:>16.4f} {row['optax_s']:>10.4f} {row['ratio']:>7.3f}"
            f" {row['speed_of_light_s']:>9.4f}  {row['loss_jaxloss']:>10.5f} {row['loss_optax']:>10.5f}"
        )
    print(f"ratio = jaxloss / optax (target <= 0.6); x*2 = read the logits + write one logits-sized buffer")
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "jax": jax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "target_ratio": 0.6,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
    }
    cli.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"wrote {cli.out}")


if __name__ == "__main__":
    main()
