"""One benchmark process: ``python benchmarks/_worker.py '<json list of specs>'``.

For each spec it builds the inputs, compiles and warms up the backend, then

1. memory: records the resident set (``VmRSS``) with the warm-up's outputs freed, resets the
   peak (``/proc/self/clear_refs`` <- 5 resets ``VmHWM``), runs one forward+backward and reads
   the peak (``VmHWM``): the extra memory of one call, its outputs (the gradient) included.
   On a GPU: torch's ``max_memory_allocated`` after ``reset_peak_memory_stats``; JAX's compiled
   ``memory_analysis()`` (temp + output bytes).
2. time: that call plus more, as many as fit ``rep_seconds`` (between ``min_reps`` and
   ``max_reps``), each blocked on its results; the median is the figure.

Prints one ``RESULT {json}`` line per spec. The runner starts one process per spec, so that
each memory figure starts from a clean heap.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._registry import DISTILL, MASKED_FRACTION, Spec  # noqa: E402

BLOCK_ROWS = 256  # inputs are a random [256, V] block tiled over the N rows (cheap at 16384 x 131072)


class Unavailable(Exception):
    """The backend's package is not installed here (reported, not an error)."""


# ----------------------------------------------------------------------------------------------
# Inputs (identical values in both frameworks)
# ----------------------------------------------------------------------------------------------


def numpy_inputs(spec: Spec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    rows = min(spec.n, BLOCK_ROWS)
    out: dict[str, np.ndarray] = {}
    out["labels"] = rng.integers(0, spec.v, spec.n, dtype=np.int64)
    mask = np.ones(spec.n, dtype=bool)
    mask[rng.permutation(spec.n)[: int(round(MASKED_FRACTION * spec.n))]] = False
    out["mask"] = mask
    if spec.info.group == "head":
        out["hidden"] = rng.normal(0.0, 1.0, (spec.n, spec.hidden)).astype(np.float32)
        out["weight"] = rng.normal(0.0, 2.0 / math.sqrt(spec.hidden), (spec.v, spec.hidden)).astype(np.float32)
    else:
        out["logits_block"] = rng.normal(0.0, 2.0, (rows, spec.v)).astype(np.float32)
        if spec.kind in DISTILL:
            out["teacher_block"] = rng.normal(0.0, 2.0, (rows, spec.v)).astype(np.float32)
    return out


# ----------------------------------------------------------------------------------------------
# Memory probes
# ----------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class HostMemory:
    """Peak resident-set growth of one call: VmHWM after the call minus VmRSS before it."""

    method = "VmHWM - VmRSS (peak resident set, reset through /proc/self/clear_refs)"

    def __init__(self) -> None:
        try:
            _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.ok = True
        except OSError:
            self.ok = False

    def start(self) -> None:
        gc.collect()
        if self.ok:
            self.base = _status_kib("VmRSS") * 1024
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def stop(self) -> int | None:
        return _status_kib("VmHWM") * 1024 - self.base if self.ok else None

    def baseline(self) -> int | None:
        return self.base if self.ok else None


class TorchCudaMemory:
    method = "torch.cuda.max_memory_allocated - memory_allocated before the call"

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def start(self) -> None:
        gc.collect()
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self.base = self.torch.cuda.memory_allocated()

    def stop(self) -> int:
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated() - self.base

    def baseline(self) -> int:
        return self.base


class JaxDeviceMemory:
    """JAX on a GPU cannot reset its peak counter: the compiled program's memory_analysis (temp +
    output) is the figure; the allocator's peak since start is kept as an upper bound."""

    method = "XLA memory_analysis: temp + output bytes (allocator peak kept as an upper bound)"

    def __init__(self, device: Any) -> None:
        self.device = device

    def _stats(self) -> dict[str, int]:
        return self.device.memory_stats() or {}

    def start(self) -> None:
        gc.collect()
        self.base = self._stats().get("bytes_in_use", 0)

    def stop(self) -> int | None:
        peak = self._stats().get("peak_bytes_in_use")
        return None if peak is None else peak - self.base

    def baseline(self) -> int:
        return self.base


# ----------------------------------------------------------------------------------------------
# JAX backends
# ----------------------------------------------------------------------------------------------


class Bench:
    """A ready-to-time backend: ``step()`` runs one blocked forward+backward and returns what
    ``loss_value`` turns into a float (None for the speed-of-light passes)."""

    step: Callable[[], Any]
    loss_value: Callable[[Any], float | None]
    memory: Any
    release: Callable[[Any], None] = staticmethod(lambda out: None)
    compile_s: float | None = None
    analysis: dict[str, int] | None = None
    reset: Callable[[], None] = staticmethod(lambda: None)


def jax_bench(spec: Spec) -> Bench:
    import jax
    import jax.numpy as jnp

    bench = Bench()
    device = jax.devices()[0]
    dtype = jnp.dtype(spec.dtype)
    raw = numpy_inputs(spec)
    n, rows = spec.n, raw["logits_block"].shape[0]
    copies = -(-n // rows)
    tile = jax.jit(lambda b: jnp.tile(b.astype(dtype), (copies, 1))[:n])
    x = tile(raw["logits_block"])
    teacher = tile(raw["teacher_block"]) if spec.kind in DISTILL else None
    labels = jnp.asarray(raw["labels"].astype(np.int32))
    mask = jnp.asarray(raw["mask"])
    del raw
    target = labels if spec.kind == "cross_entropy" else teacher

    if spec.backend in ("jaxloss-xla", "jaxloss-pallas"):
        import jaxloss

        impl = spec.backend.split("-")[1]
        fn = getattr(jaxloss, spec.kind)

        def loss(x: Any, target: Any, mask: Any) -> Any:
            return fn(x, target, mask, impl=impl)

        program, args = jax.value_and_grad(loss), (x, target, mask)
    elif spec.backend == "optax":
        import optax

        def masked_mean(per_token: Any, mask: Any) -> Any:
            return jnp.sum(jnp.where(mask, per_token, 0.0).astype(jnp.float32)) / jnp.sum(mask)

        def loss(x: Any, target: Any, mask: Any) -> Any:
            if spec.kind == "cross_entropy":
                per_token = optax.softmax_cross_entropy_with_integer_labels(x, target)
            elif spec.kind == "soft_cross_entropy":
                per_token = optax.softmax_cross_entropy(x, jax.nn.softmax(target, axis=-1))
            elif spec.kind == "forward_kl":  # KL(p || q): targets p (teacher), log-predictions log q
                per_token = optax.kl_divergence(jax.nn.log_softmax(x, axis=-1), jax.nn.softmax(target, axis=-1))
            else:  # KL(q || p): targets q (student, differentiated), log-predictions log p
                per_token = optax.kl_divergence(jax.nn.log_softmax(target, axis=-1), jax.nn.softmax(x, axis=-1))
            return masked_mean(per_token, mask)

        program, args = jax.value_and_grad(loss), (x, target, mask)
    elif spec.backend == "jax-sol":
        if spec.kind in DISTILL:
            program, args = (lambda x, t: x + t), (x, teacher)
        else:
            program, args = (lambda x: x * jnp.asarray(2, x.dtype)), (x,)
    else:
        raise ValueError(f"unknown JAX backend {spec.backend}")

    start = time.perf_counter()
    compiled = jax.jit(program).lower(*args).compile()
    bench.compile_s = time.perf_counter() - start
    try:
        stats = compiled.memory_analysis()
        bench.analysis = {
            "temp_bytes": int(stats.temp_size_in_bytes),
            "output_bytes": int(stats.output_size_in_bytes),
            "argument_bytes": int(stats.argument_size_in_bytes),
        }
    except Exception:  # noqa: BLE001 - not every backend reports it
        bench.analysis = None

    def step() -> Any:
        return jax.block_until_ready(compiled(*args))

    def release(out: Any) -> None:
        # JAX frees a dropped array's buffer asynchronously: delete it now, so that it is not
        # still resident when the baseline is read (and reused, uncounted, by the measured call).
        for leaf in jax.tree_util.tree_leaves(out):
            leaf.delete()

    bench.step = step
    bench.release = release
    bench.loss_value = (lambda out: None) if spec.info.role == "sol" else (lambda out: float(out[0]))
    bench.memory = HostMemory() if device.platform == "cpu" else JaxDeviceMemory(device)
    return bench


# ----------------------------------------------------------------------------------------------
# torch backends
# ----------------------------------------------------------------------------------------------


def _load_flash_attn_ce() -> Callable[..., Any]:
    """flash-attn's Triton cross-entropy: the installed package, else the single file that
    ``gpu_check.sh`` extracts from the sdist (``FLASH_ATTN_CE_FILE``; the package's CUDA
    extension takes hours to build and this kernel does not need it)."""
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

        return cross_entropy_loss
    except Exception as error:  # noqa: BLE001
        path = os.environ.get("FLASH_ATTN_CE_FILE")
        if not path or not Path(path).exists():
            raise Unavailable(f"flash-attn not installed ({type(error).__name__}) and FLASH_ATTN_CE_FILE unset") from None
        import importlib.util

        module_spec = importlib.util.spec_from_file_location("flash_attn_triton_cross_entropy", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module.cross_entropy_loss


def _liger() -> Any:
    try:
        from liger_kernel.transformers import functional
    except Exception as error:  # noqa: BLE001
        raise Unavailable(f"liger-kernel not importable: {type(error).__name__}: {error}") from None
    return functional


def torch_bench(spec: Spec) -> Bench:
    import torch
    import torch.nn.functional as F

    bench = Bench()
    gpu = spec.device == "gpu"
    device = torch.device("cuda" if gpu else "cpu")
    dtype = getattr(torch, spec.dtype)
    raw = numpy_inputs(spec)
    labels = torch.from_numpy(raw["labels"]).to(device)
    mask = torch.from_numpy(raw["mask"]).to(device)
    labels_ignore = torch.where(mask, labels, -100)
    weight = mask.to(torch.float32)
    count = weight.sum()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    leaves: list[Any] = []

    def tiled(block: np.ndarray) -> Any:
        small = torch.from_numpy(block).to(device=device, dtype=dtype)
        out = torch.empty((spec.n, block.shape[1]), dtype=dtype, device=device)
        for start in range(0, spec.n, small.shape[0]):
            stop = min(spec.n, start + small.shape[0])
            out[start:stop] = small[: stop - start]
        return out

    forward: Callable[[], Any]
    if spec.info.group == "head":
        h = torch.from_numpy(raw["hidden"]).to(device=device, dtype=dtype).requires_grad_(True)
        w = torch.from_numpy(raw["weight"]).to(device=device, dtype=dtype).requires_grad_(True)
        leaves += [h, w]
        if spec.backend == "head-torchloss":
            import torchloss

            def forward() -> Any:
                return torchloss.cross_entropy(F.linear(h, w), labels, mask, inplace=True)
        elif spec.backend == "head-eager":

            def forward() -> Any:
                return F.cross_entropy(F.linear(h, w), labels_ignore)
        elif spec.backend == "head-linear_ce":
            options = torch.nn.LinearCrossEntropyOptions()

            def forward() -> Any:
                return F.linear_cross_entropy(h, w, labels_ignore, ignore_index=-100, options=options)
        elif spec.backend == "head-liger":
            functional = _liger()

            def forward() -> Any:
                return functional.liger_fused_linear_cross_entropy(h, w, labels_ignore)
        elif spec.backend == "head-matmul-sol":
            hd, wd = h.detach(), w.detach()

            def sol_step() -> Any:
                with torch.no_grad():
                    logits = F.linear(hd, wd)  # [N, V], stands in for the gradient of the logits too
                    grad_h = logits @ wd
                    grad_w = logits.t() @ hd
                sync()
                return grad_h, grad_w

            forward = None  # type: ignore[assignment]
        else:
            raise ValueError(f"unknown head backend {spec.backend}")
    else:
        x = tiled(raw["logits_block"]).requires_grad_(True)
        teacher = tiled(raw["teacher_block"]) if spec.kind in DISTILL else None
        leaves.append(x)
        target = labels if spec.kind == "cross_entropy" else teacher

        def eager(x: Any, teacher: Any, labels_ignore: Any, weight: Any, count: Any) -> Any:
            if spec.kind == "cross_entropy":
                return F.cross_entropy(x, labels_ignore)
            if spec.kind == "soft_cross_entropy":
                per_token = F.cross_entropy(x, F.softmax(teacher, dim=-1), reduction="none")
            elif spec.kind == "forward_kl":  # kl_div(input=log q, target=log p) = p (log p - log q)
                per_token = F.kl_div(F.log_softmax(x, -1), F.log_softmax(teacher, -1), reduction="none", log_target=True).sum(-1)
            else:  # kl_div(input=log p, target=log q) = q (log q - log p), differentiated through q
                per_token = F.kl_div(F.log_softmax(teacher, -1), F.log_softmax(x, -1), reduction="none", log_target=True).sum(-1)
            return (per_token * weight).sum() / count

        if spec.backend in ("torchloss", "torchloss-triton"):
            import torchloss

            impl = "triton" if spec.backend == "torchloss-triton" else "torch"
            fn = getattr(torchloss, spec.kind)

            def forward() -> Any:
                return fn(x, target, mask, impl=impl)
        elif spec.backend == "torch-eager":

            def forward() -> Any:
                return eager(x, teacher, labels_ignore, weight, count)
        elif spec.backend == "torch-compile":
            compiled = torch.compile(eager)

            def forward() -> Any:
                return compiled(x, teacher, labels_ignore, weight, count)
        elif spec.backend == "liger":
            functional = _liger()
            if spec.kind == "cross_entropy":  # note: Liger writes the gradient into the logits' buffer

                def forward() -> Any:
                    return functional.liger_cross_entropy(x, labels_ignore)
            else:
                valid = mask.nonzero().squeeze(1)

                def forward() -> Any:  # batchmean over the valid rows = sum / count
                    log_q = F.log_softmax(x[valid], -1)
                    log_p = F.log_softmax(teacher[valid], -1)
                    return functional.liger_kl_div(log_q, log_p, reduction="batchmean", log_target=True)
        elif spec.backend == "flash-attn-ce":
            ce = _load_flash_attn_ce()

            def forward() -> Any:
                losses, _ = ce(x, labels_ignore)
                return losses.sum() / count
        elif spec.backend == "torch-sol":
            xd = x.detach()

            def sol_step() -> Any:
                out = torch.add(xd, teacher) if teacher is not None else torch.mul(xd, 2.0)
                sync()
                return out

            forward = None  # type: ignore[assignment]
        else:
            raise ValueError(f"unknown torch backend {spec.backend}")

    def reset() -> None:
        for leaf in leaves:
            leaf.grad = None

    if spec.info.role == "sol":
        bench.step = sol_step
        bench.loss_value = lambda out: None
    else:

        def step() -> Any:
            reset()
            loss = forward()
            loss.backward()
            sync()
            return loss.detach()

        bench.step = step
        bench.loss_value = lambda out: float(out)
    bench.reset = reset
    bench.memory = TorchCudaMemory(torch) if gpu else HostMemory()
    return bench


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------


def measure(spec: Spec) -> dict[str, Any]:
    result: dict[str, Any] = {"spec": spec.to_json(), "status": "ok", "pid": os.getpid()}
    start = time.perf_counter()
    try:
        bench = jax_bench(spec) if spec.info.framework == "jax" else torch_bench(spec)
    except Unavailable as reason:
        return dict(result, status="unavailable", error=str(reason))
    result["setup_s"] = time.perf_counter() - start
    result["compile_s"] = bench.compile_s
    result["xla_memory_analysis"] = bench.analysis

    # Warm-up: the first call compiles (torch.compile, the Triton/Pallas kernels) and faults pages in.
    warm: list[float] = []
    loss = None
    for i in range(max(1, spec.warmup)):
        t0 = time.perf_counter()
        out = bench.step()
        warm.append(time.perf_counter() - t0)
        if i == 0:
            loss = bench.loss_value(out)
        bench.release(out)
        del out
    result["first_call_s"] = warm[0]
    result["loss"] = loss

    # Memory of one call (its time is the first timed repetition).
    bench.reset()
    time.sleep(0.2)  # let frees still in flight (allocator threads, munmap) land before the baseline
    bench.memory.start()
    t0 = time.perf_counter()
    out = bench.step()
    times = [time.perf_counter() - t0]
    extra = bench.memory.stop()
    bench.release(out)
    del out
    result["mem_method"] = bench.memory.method
    result["mem_baseline_bytes"] = bench.memory.baseline()
    if isinstance(bench.memory, JaxDeviceMemory) and bench.analysis is not None:
        result["mem_peak_upper_bound_bytes"] = extra
        extra = bench.analysis["temp_bytes"] + bench.analysis["output_bytes"]
    result["mem_extra_bytes"] = extra

    estimate = statistics.median(warm[1:] + times) if len(warm) > 1 else times[0]
    reps = int(min(spec.max_reps, max(spec.min_reps, math.ceil(spec.rep_seconds / max(estimate, 1e-9)))))
    for _ in range(reps - 1):
        t0 = time.perf_counter()
        out = bench.step()
        times.append(time.perf_counter() - t0)
        bench.release(out)
        del out
    result["times_s"] = times
    result["time_s"] = statistics.median(times)
    result["reps"] = len(times)
    result["total_s"] = time.perf_counter() - start
    return result


def main() -> None:
    specs = [Spec(**item) for item in json.loads(sys.argv[1])]
    for spec in specs:
        try:
            result = measure(spec)
        except Exception as error:  # noqa: BLE001 - reported per measurement, the run goes on
            result = {"spec": spec.to_json(), "status": "error", "error": f"{type(error).__name__}: {error}",
                      "traceback": traceback.format_exc(limit=6)}
        result["host"] = platform.node()
        print("RESULT " + json.dumps(result), flush=True)
        gc.collect()


if __name__ == "__main__":
    main()
