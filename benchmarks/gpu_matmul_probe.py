"""The fused head's matmuls on their own: which bf16 matmul with an fp32 result is fast on this GPU.

``precision="tensor"`` (docs/linear_head.md) needs bf16 x bf16 products accumulated in fp32 with
an fp32 result; torch offers it as ``mm(out_dtype=torch.float32)`` (once measured at ~20 TFLOP/s
on an H200 with torch 2.11, no faster than fp32) and as our Triton kernel
(``torchloss.backends.triton_matmul``), JAX as ``dot_general(preferred_element_type=float32)``.
This times each of the head's three shapes, for a chunk of ``--rows`` tokens of an ``H x V`` head:

    logits   z = h W^T        [R, H] x [H, V]
    grad_h   dh = G W         [R, V] x [V, H]
    grad_w   dW += G^T h      [V, R] x [R, H]

with bf16 -> bf16 cuBLAS (the speed to match: its result is rounded, which the head cannot use),
``mm(out_dtype=float32)``, the Triton kernel (bf16 operands, one term), fp32 ``mm`` (TF32 off)
and JAX's dot. Medians of ``--reps`` CUDA-event timed calls, in ms and TFLOP/s; ``--json`` writes
them. Without a GPU it says so and exits 0 (``--cpu`` runs the same calls on the CPU at a small
shape: a check that the script works, not a measurement).

    python -m benchmarks.gpu_matmul_probe [--rows 2048] [--hidden 4096] [--vocab 131072] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable


def _timer(device: str) -> Callable[[Callable[[], Any], int], list[float]]:
    import torch

    def cuda(fn: Callable[[], Any], reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times

    def host(fn: Callable[[], Any], reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times

    return cuda if device == "cuda" else host


def torch_cases(rows: int, hidden: int, vocab: int, device: str) -> dict[str, dict[str, Callable[[], Any]]]:
    """``{shape: {method: call}}`` for the head's three matmuls in torch."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the script's own process: fp32 means fp32
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn((rows, hidden), device=device, generator=gen).bfloat16()
    w = torch.randn((vocab, hidden), device=device, generator=gen).bfloat16()
    g = torch.randn((rows, vocab), device=device, generator=gen).bfloat16()
    operands = {"logits": (h, w.t()), "grad_h": (g, w), "grad_w": (g.t(), h)}
    cases: dict[str, dict[str, Callable[[], Any]]] = {}
    for shape, (a, b) in operands.items():
        a32, b32 = a.float(), b.float()
        methods: dict[str, Callable[[], Any]] = {
            "bf16->bf16 mm": lambda a=a, b=b: torch.mm(a, b),
            "fp32 mm": lambda a32=a32, b32=b32: torch.mm(a32, b32),
        }
        try:
            torch.mm(a[:16, :16], b[:16, :16], out_dtype=torch.float32)
            methods["mm(out_dtype=fp32)"] = lambda a=a, b=b: torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
        if device == "cuda":
            try:
                from torchloss.backends import triton_matmul

                methods["triton matmul_f32"] = lambda a=a, b=b: triton_matmul.matmul_f32(a, b, split_terms=1)
            except ImportError:
                pass
        cases[shape] = methods
    return cases


def jax_cases(rows: int, hidden: int, vocab: int) -> dict[str, dict[str, Callable[[], Any]]]:
    """JAX's ``dot_general`` with bf16 operands and fp32 results, for the same three shapes."""
    try:
        import jax
        import jax.numpy as jnp
        from jax import lax
    except ImportError:
        return {}
    keys = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(keys[0], (rows, hidden)).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (vocab, hidden)).astype(jnp.bfloat16)
    g = jax.random.normal(keys[2], (rows, vocab)).astype(jnp.bfloat16)

    def dot(contract: tuple[int, int]) -> Any:
        dims = (((contract[0],), (contract[1],)), ((), ()))
        return jax.jit(lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=jnp.float32))

    calls = {"logits": (dot((1, 1)), h, w), "grad_h": (dot((1, 0)), g, w), "grad_w": (dot((0, 0)), g, h)}
    return {shape: {"jax dot bf16->fp32": (lambda f=f, a=a, b=b: f(a, b).block_until_ready())} for shape, (f, a, b) in calls.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048, help="tokens of one chunk (R)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="run on the CPU at the given (small) shape: a check of the script")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (pass --cpu to check the script on the CPU)")
        return 0
    timer = _timer(device)
    flops = 2.0 * args.rows * args.hidden * args.vocab
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"R={args.rows} H={args.hidden} V={args.vocab} ({flops / 1e12:.3f} TFLOP per matmul)", flush=True)
    results: list[dict[str, Any]] = []
    groups = [torch_cases(args.rows, args.hidden, args.vocab, device), jax_cases(args.rows, args.hidden, args.vocab)]
    for group in groups:
        for shape, methods in group.items():
            for method, call in methods.items():
                try:
                    call()  # compile / warm up
                    if device == "cuda":
                        torch.cuda.synchronize()
                    median = statistics.median(timer(call, args.reps))
                    row = {"shape": shape, "method": method, "median_ms": median * 1e3, "tflops": flops / median / 1e12}
                    print(f"{shape:8s} {method:22s} {row['median_ms']:9.3f} ms  {row['tflops']:7.1f} TFLOP/s", flush=True)
                except Exception as error:  # noqa: BLE001  (a method this build lacks: reported, not fatal)
                    row = {"shape": shape, "method": method, "error": f"{type(error).__name__}: {error}"[:300]}
                    print(f"{shape:8s} {method:22s} failed: {row['error']}", flush=True)
                results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": args.rows, "hidden": args.hidden, "vocab": args.vocab, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
