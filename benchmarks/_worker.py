"""One benchmark process: ``python benchmarks/_worker.py '<json list of specs>'``.

The specs are the contenders of one cell (one framework, shape, dtype and loss kind; every
backend, at each masked fraction, and the speed-of-light pass). They share the inputs. The
process

1. builds every contender and warms it up (``warmup`` calls; the first one compiles);
2. memory, one contender after the other: frees the previous outputs, hands freed heap pages back
   to the system (``malloc_trim``), records the resident set (``VmRSS``), resets the peak
   (``/proc/self/clear_refs`` <- 5 resets ``VmHWM``), runs one forward+backward and reads the
   peak (``VmHWM``): the extra memory of one call, its outputs (the gradient) included. On a GPU:
   torch's ``max_memory_allocated`` after ``reset_peak_memory_stats``; JAX's compiled
   ``memory_analysis()`` (temp + output bytes);
3. time: ``reps`` rounds; each round runs every contender once (the speed-of-light pass
   ``sol_reps`` times), in an order rotated from round to round, so that a load that comes and
   goes slows every contender alike. Each call is blocked on its results; the clock is the host's
   wall clock (the CPU; JAX on a GPU, around ``jax.block_until_ready``), or CUDA events for torch
   on a GPU. A contender that writes its gradient into the logits (Liger's cross-entropy, our
   ``inplace=True``) gets fresh logits before every call, copied from the pristine ones outside
   the timed region (:class:`FreshLogits`). The JSON keeps every repetition (and every
   repetition's loss); the report shows min / median / max.

The speed-of-light pass writes into a buffer faulted in beforehand (torch ``out=``, a donated
buffer in JAX), while every contender returns a fresh gradient: with the best of its many
repetitions it is a floor, not an estimate.

Prints one ``RESULT {json}`` line per spec (in the order given), after all rounds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
import lossspec  # noqa: E402
from benchmarks._registry import DISTILL, Spec  # noqa: E402

JSD_BETA = 0.5  # jensen_shannon's default beta: the peers' expressions and ours compute the same loss

BLOCK_ROWS = 256  # inputs are a random [256, V] block tiled over the N rows (cheap at 16384 x 131072)


class Unavailable(Exception):
    """The backend's package is not installed here (reported, not an error)."""


# ----------------------------------------------------------------------------------------------
# Inputs (identical values in both frameworks)
# ----------------------------------------------------------------------------------------------


def numpy_inputs(spec: Spec) -> dict[str, np.ndarray]:
    """The cell's inputs: labels, logits (or hidden states and head weight), teacher. The same
    seed gives the same values in both frameworks and for every contender."""
    rng = np.random.default_rng(spec.seed)
    rows = min(spec.n, BLOCK_ROWS)
    out: dict[str, np.ndarray] = {}
    out["labels"] = rng.integers(0, spec.v, spec.n, dtype=np.int64)
    if spec.info.group == "head":
        out["hidden"] = rng.normal(0.0, 1.0, (spec.n, spec.hidden)).astype(np.float32)
        out["weight"] = rng.normal(0.0, 2.0 / math.sqrt(spec.hidden), (spec.v, spec.hidden)).astype(np.float32)
    else:
        out["logits_block"] = rng.normal(0.0, 2.0, (rows, spec.v)).astype(np.float32)
        if spec.kind in DISTILL:
            out["teacher_block"] = rng.normal(0.0, 2.0, (rows, spec.v)).astype(np.float32)
    return out


def token_mask(n: int, masked: float | None, seed: int) -> np.ndarray:
    """[n] bool, True = counted: exactly round(masked * n) tokens masked, at random places."""
    mask = np.ones(n, dtype=bool)
    if masked:
        rng = np.random.default_rng(seed + 1)
        mask[rng.permutation(n)[: int(round(masked * n))]] = False
    return mask


# ----------------------------------------------------------------------------------------------
# Memory probes
# ----------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)


def _malloc_trim() -> None:
    """Hands the heap's free pages back to the system (glibc), so that an earlier contender's
    freed memory is not in the resident set when the next one's baseline is read (it would be
    reused uncounted). Large buffers are mmapped and unmapped on free anyway."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


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
        _malloc_trim()
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
    # Run before every call, outside its timed region and before its memory baseline: an in-place
    # contender's fresh logits (FreshLogits.restore); nothing for the others.
    prepare: Callable[[], None] = staticmethod(lambda: None)
    # Times one call of step(): (its output, seconds). The host's wall clock (the call blocks on
    # its results), or CUDA events for torch on a GPU (CudaEventClock).
    clock: Callable[[Callable[[], Any]], tuple[Any, float]] = staticmethod(lambda step: wall_clock(step))
    # Waits for the device (torch on a GPU: its steps do not synchronise, the clock does).
    sync: Callable[[], None] = staticmethod(lambda: None)


def wall_clock(step: Callable[[], Any]) -> tuple[Any, float]:
    """The host's wall clock around a call that blocks on its results (the CPU; JAX on a GPU,
    whose steps end in ``jax.block_until_ready``)."""
    t0 = time.perf_counter()
    out = step()
    return out, time.perf_counter() - t0


WALL_CLOCK = "host wall clock (time.perf_counter) around the blocked call"


class CudaEventClock:
    """torch on a GPU: CUDA events recorded on the stream before and after the call's work (the
    copy that restores an in-place contender's logits was queued before the first, so it is not
    counted; nor is the host's wait after the second)."""

    method = "CUDA events (torch.cuda.Event(enable_timing=True)) around the call"

    def __init__(self, torch: Any) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, step: Callable[[], Any]) -> tuple[Any, float]:
        self.start.record()
        out = step()
        self.end.record()
        self.end.synchronize()
        return out, self.start.elapsed_time(self.end) / 1e3


class FreshLogits:
    """The logits of a contender that writes its gradient into them (Liger's cross-entropy, our
    ``inplace=True``): :meth:`restore` makes a fresh copy of the pristine logits before each call
    (``Bench.prepare``: outside the timed region and before the memory baseline), so every timed
    repetition computes on the cell's inputs and not on the previous call's gradient. ``leaf``: a
    leaf that requires grad (Liger); else the output of an operation (a ``clone`` of the pristine
    leaf), as our ``inplace=True`` requires (it refuses a leaf, whose values it would overwrite)."""

    def __init__(self, pristine: Any, leaf: bool) -> None:
        self.pristine = pristine  # the cell's shared logits (a leaf that requires grad): never written
        self.leaf = leaf
        self.current: Any = None

    def restore(self) -> None:
        self.current = None  # the last copy (the last gradient) is freed before the next is made
        self.current = self.pristine.detach().clone().requires_grad_(True) if self.leaf else self.pristine.clone()

    def __call__(self) -> Any:
        return self.current


def jax_inputs(spec: Spec) -> dict[str, Any]:
    """The cell's JAX arrays: logits ``x`` [N, V], ``teacher`` [N, V] (distillation), int32
    labels [N]; masks are made per contender (:func:`token_mask`)."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(spec.dtype)
    raw = numpy_inputs(spec)
    if spec.info.group == "head":
        return {"h": jnp.asarray(raw["hidden"], dtype), "w": jnp.asarray(raw["weight"], dtype),
                "labels": jnp.asarray(raw["labels"].astype(np.int32)), "teacher": None, "x": None}
    n, rows = spec.n, raw["logits_block"].shape[0]
    copies = -(-n // rows)
    tile = jax.jit(lambda b: jnp.tile(b.astype(dtype), (copies, 1))[:n])
    shared = {"x": tile(raw["logits_block"]), "labels": jnp.asarray(raw["labels"].astype(np.int32))}
    shared["teacher"] = tile(raw["teacher_block"]) if spec.kind in DISTILL else None
    return shared


def jax_bench(spec: Spec, shared: dict[str, Any]) -> Bench:
    import jax
    import jax.numpy as jnp

    bench = Bench()
    device = jax.devices()[0]
    x, teacher, labels = shared["x"], shared["teacher"], shared["labels"]
    mask = jnp.asarray(token_mask(spec.n, spec.masked, spec.seed))
    target_kind = lossspec.KIND_SPECS[spec.kind].target  # "labels", "teacher_logits" or None
    target = labels if target_kind == "labels" else teacher
    donate: tuple[int, ...] = ()

    if spec.backend in ("jaxloss-xla", "jaxloss-pallas", "jaxloss-pallas-inplace"):
        import jaxloss

        options = {"impl": spec.backend.split("-")[1], "inplace": spec.backend.endswith("-inplace")}
        fn = getattr(jaxloss, spec.kind)

        def loss(x: Any, target: Any, mask: Any) -> Any:
            return fn(x, mask, **options) if target_kind is None else fn(x, target, mask, **options)

        program, args = jax.value_and_grad(loss), (x, target, mask)
        if options["inplace"]:
            donate = (0,)  # the logits die at the call: the kernel's gradient takes their buffer
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
            elif spec.kind == "reverse_kl":  # KL(q || p): targets q (student, differentiated), log-predictions log p
                per_token = optax.kl_divergence(jax.nn.log_softmax(target, axis=-1), jax.nn.softmax(x, axis=-1))
            elif spec.kind == "entropy":  # H(q) = cross-entropy of q with itself, differentiated through both
                per_token = optax.softmax_cross_entropy(x, jax.nn.softmax(x, axis=-1))
            else:  # jensen_shannon: beta KL(p || M) + (1 - beta) KL(q || M), M = beta p + (1 - beta) q
                log_q, log_p = jax.nn.log_softmax(x, axis=-1), jax.nn.log_softmax(target, axis=-1)
                log_m = jnp.logaddexp(log_p + jnp.log(JSD_BETA), log_q + jnp.log(1.0 - JSD_BETA))
                per_token = (JSD_BETA * optax.losses.kl_divergence_with_log_targets(log_m, log_p)
                             + (1.0 - JSD_BETA) * optax.losses.kl_divergence_with_log_targets(log_m, log_q))
            return masked_mean(per_token, mask)

        program, args = jax.value_and_grad(loss), (x, target, mask)
    elif spec.backend in ("head-jaxloss-fused", "head-jaxloss-fused-bf16mm", "head-jaxloss-fused-tensor", "head-jaxloss-fused-recompute", "head-jaxloss"):
        import jaxloss

        h, w = shared["h"], shared["w"]
        if spec.backend == "head-jaxloss-fused":

            def head_loss(h: Any, w: Any, labels: Any, mask: Any) -> Any:
                return jaxloss.linear_cross_entropy(h, w, labels, mask)
        elif spec.backend == "head-jaxloss-fused-bf16mm":

            def head_loss(h: Any, w: Any, labels: Any, mask: Any) -> Any:
                # opted in for this contender's calls only (the default contender shares the process)
                tuning = lossspec.HeadTuning(bf16_matmul_devices=("cuda",))
                return jaxloss.linear_cross_entropy(h, w, labels, mask, tuning=tuning)
        elif spec.backend == "head-jaxloss-fused-tensor":

            def head_loss(h: Any, w: Any, labels: Any, mask: Any) -> Any:
                return jaxloss.linear_cross_entropy(h, w, labels, mask, precision="tensor")
        elif spec.backend == "head-jaxloss-fused-recompute":

            def head_loss(h: Any, w: Any, labels: Any, mask: Any) -> Any:
                return jaxloss.linear_cross_entropy(h, w, labels, mask, recompute_logits=True)
        else:

            def head_loss(h: Any, w: Any, labels: Any, mask: Any) -> Any:
                return jaxloss.cross_entropy(jnp.dot(h, w.T), labels, mask)

        program, args = jax.value_and_grad(head_loss, argnums=(0, 1)), (h, w, labels, mask)
    elif spec.backend == "head-tokamax":
        try:
            import tokamax
        except Exception as error:  # noqa: BLE001
            raise Unavailable(f"tokamax not importable: {type(error).__name__}: {error}") from None
        h, w = shared["h"], shared["w"]

        def head_loss(h: Any, w: Any, labels: Any) -> Any:
            # its XLA implementation (the Pallas one is for TPUs); weights [H, V]; no mask
            return tokamax.linear_softmax_cross_entropy_loss(h, labels, w.T, reduction="mean", implementation="xla")

        program, args = jax.value_and_grad(head_loss, argnums=(0, 1)), (h, w, labels)
    elif spec.backend == "head-jax-matmul-sol":
        from jax import lax

        h, w = shared["h"], shared["w"]
        outs = (jnp.zeros((spec.n, spec.v), jnp.float32), jnp.zeros_like(h), jnp.zeros_like(w))

        def dot(a: Any, b: Any, contract: tuple[int, int]) -> Any:
            # Products accumulated in fp32: for bf16 inputs XLA's CPU dot is ~4x faster with an fp32
            # result than with a bf16 one, so the floor takes the faster form.
            return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)

        def program(h: Any, w: Any, logits: Any, grad_h: Any, grad_w: Any) -> Any:
            z = dot(h, w, (1, 1))  # fp32 logits; in h's dtype it stands in for their gradient too
            g = z.astype(h.dtype)
            return z, dot(g, w, (1, 0)).astype(h.dtype), dot(g, h, (0, 0)).astype(w.dtype)

        args = (h, w, *outs)
        donate = (2, 3, 4)
    elif spec.backend == "jax-sol":
        # The output goes into a donated buffer that already holds pages (XLA aliases it to the
        # result; keep_unused stops jit from dropping the unread argument): no allocation and no
        # page faults, unlike every contender's fresh gradient. Each call donates the last result.
        out = jnp.zeros_like(x)
        if spec.kind in DISTILL:
            program, args = (lambda x, t, out: x + t), (x, teacher, out)
        else:
            program, args = (lambda x, out: x * jnp.asarray(2, x.dtype)), (x, out)
        donate = (len(args) - 1,)
    else:
        raise ValueError(f"unknown JAX backend {spec.backend}")

    start = time.perf_counter()
    compiled = jax.jit(program, donate_argnums=donate, keep_unused=bool(donate)).lower(*args).compile()
    bench.compile_s = time.perf_counter() - start
    try:
        stats = compiled.memory_analysis()
        bench.analysis = {
            "temp_bytes": int(stats.temp_size_in_bytes),
            "output_bytes": int(stats.output_size_in_bytes),
            "argument_bytes": int(stats.argument_size_in_bytes),
            # Outputs written into a donated argument (the speed-of-light pass) take no new memory.
            "alias_bytes": int(getattr(stats, "alias_size_in_bytes", 0) or 0),
        }
    except Exception:  # noqa: BLE001 - not every backend reports it
        bench.analysis = None

    if spec.info.writes_logits(spec.kind):
        # Each call consumes (donates) its logits: a fresh copy of the cell's before every call,
        # outside the timed region (Bench.prepare), as FreshLogits does for torch.
        state = list(args)

        def prepare() -> None:
            state[0] = None
            state[0] = jax.block_until_ready(jnp.copy(x))

        def step() -> Any:
            return jax.block_until_ready(compiled(*state))

        bench.prepare = prepare
    elif donate:
        state = list(args)

        def step() -> Any:
            result = jax.block_until_ready(compiled(*state))  # the results are the next call's buffers
            results = result if isinstance(result, tuple) else (result,)
            for index, value in zip(donate, results):
                state[index] = value
            return None

    else:

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


def torch_inputs(spec: Spec) -> dict[str, Any]:
    """The cell's torch tensors: logits ``x`` [N, V] (requires grad; or hidden states ``h`` [N, H]
    and head weight ``w`` [V, H]), ``teacher`` [N, V] (distillation), labels [N] (int64)."""
    import torch

    device = torch.device("cuda" if spec.device == "gpu" else "cpu")
    dtype = getattr(torch, spec.dtype)
    raw = numpy_inputs(spec)
    shared: dict[str, Any] = {"labels": torch.from_numpy(raw["labels"]).to(device), "teacher": None}

    def tiled(block: np.ndarray) -> Any:
        small = torch.from_numpy(block).to(device=device, dtype=dtype)
        out = torch.empty((spec.n, block.shape[1]), dtype=dtype, device=device)
        for start in range(0, spec.n, small.shape[0]):
            stop = min(spec.n, start + small.shape[0])
            out[start:stop] = small[: stop - start]
        return out

    if spec.info.group == "head":
        shared["h"] = torch.from_numpy(raw["hidden"]).to(device=device, dtype=dtype).requires_grad_(True)
        shared["w"] = torch.from_numpy(raw["weight"]).to(device=device, dtype=dtype).requires_grad_(True)
    else:
        shared["x"] = tiled(raw["logits_block"]).requires_grad_(True)
        if spec.kind in DISTILL:
            shared["teacher"] = tiled(raw["teacher_block"])
    return shared


def torch_bench(spec: Spec, shared: dict[str, Any]) -> Bench:
    import torch
    import torch.nn.functional as F

    bench = Bench()
    gpu = spec.device == "gpu"
    device = torch.device("cuda" if gpu else "cpu")
    labels, teacher = shared["labels"], shared["teacher"]
    mask = torch.from_numpy(token_mask(spec.n, spec.masked, spec.seed)).to(device)
    labels_ignore = torch.where(mask, labels, -100)
    weight = mask.to(torch.float32)
    count = weight.sum()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    leaves: list[Any] = []
    fresh: FreshLogits | None = None

    forward: Callable[[], Any]
    if spec.info.group == "head":
        h, w = shared["h"], shared["w"]
        leaves += [h, w]
        if spec.backend == "head-torchloss-fused":
            import torchloss

            def forward() -> Any:
                return torchloss.linear_cross_entropy(h, w, labels, mask)
        elif spec.backend == "head-torchloss-fused-bf16mm":
            import torchloss

            def forward() -> Any:
                # opted in for this contender's calls only (the head's gradients are formed in its forward)
                return torchloss.linear_cross_entropy(h, w, labels, mask, tuning=lossspec.HeadTuning(bf16_matmul_devices=("cuda",)))
        elif spec.backend == "head-torchloss-fused-tensor":
            import torchloss

            def forward() -> Any:
                return torchloss.linear_cross_entropy(h, w, labels, mask, precision="tensor")
        elif spec.backend == "head-torchloss-fused-recompute":
            import torchloss

            def forward() -> Any:
                return torchloss.linear_cross_entropy(h, w, labels, mask, recompute_logits=True)
        elif spec.backend == "head-torchloss":
            import torchloss

            def forward() -> Any:
                return torchloss.cross_entropy(F.linear(h, w), labels, mask, inplace=True)
        elif spec.backend == "head-eager":

            def forward() -> Any:
                return F.cross_entropy(F.linear(h, w), labels_ignore)
        elif spec.backend == "head-linear_ce":
            if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
                raise Unavailable(f"torch {torch.__version__} has no F.linear_cross_entropy (new in 2.13)")
            options = torch.nn.LinearCrossEntropyOptions()

            def forward() -> Any:
                return F.linear_cross_entropy(h, w, labels_ignore, ignore_index=-100, options=options)
        elif spec.backend == "head-cce":
            try:
                import cut_cross_entropy
            except Exception as error:  # noqa: BLE001
                raise Unavailable(f"cut-cross-entropy not importable: {type(error).__name__}: {error}") from None
            impl = "cce" if gpu else "torch_compile"

            def forward() -> Any:
                return cut_cross_entropy.linear_cross_entropy(h, w, labels_ignore, filter_eps=None, impl=impl)
        elif spec.backend == "head-liger":
            functional = _liger()

            def forward() -> Any:
                return functional.liger_fused_linear_cross_entropy(h, w, labels_ignore)
        elif spec.backend == "head-matmul-sol":
            hd, wd = h.detach(), w.detach()
            # Outputs faulted in beforehand (zeros), as for the loss group's pass.
            logits, grad_h, grad_w = (torch.zeros(shape, dtype=hd.dtype, device=device)
                                      for shape in ((spec.n, spec.v), tuple(hd.shape), tuple(wd.shape)))

            def sol_step() -> Any:
                with torch.no_grad():
                    torch.mm(hd, wd.t(), out=logits)  # [N, V], stands in for the gradient of the logits too
                    torch.mm(logits, wd, out=grad_h)
                    torch.mm(logits.t(), hd, out=grad_w)
                return None

            forward = None  # type: ignore[assignment]
        else:
            raise ValueError(f"unknown head backend {spec.backend}")
    else:
        if spec.info.writes_logits(spec.kind):
            # Liger takes a leaf; our inplace=True the output of an operation
            fresh = FreshLogits(shared["x"], leaf=spec.info.role == "peer")
            X = fresh
        else:
            leaves.append(shared["x"])
            X = lambda: shared["x"]  # noqa: E731 - the contenders that do not write the logits share them
        target_kind = lossspec.KIND_SPECS[spec.kind].target  # "labels", "teacher_logits" or None
        target = labels if target_kind == "labels" else teacher

        def eager(x: Any, teacher: Any, labels_ignore: Any, weight: Any, count: Any) -> Any:
            if spec.kind == "cross_entropy":
                return F.cross_entropy(x, labels_ignore)
            if spec.kind == "soft_cross_entropy":
                per_token = F.cross_entropy(x, F.softmax(teacher, dim=-1), reduction="none")
            elif spec.kind == "forward_kl":  # kl_div(input=log q, target=log p) = p (log p - log q)
                per_token = F.kl_div(F.log_softmax(x, -1), F.log_softmax(teacher, -1), reduction="none", log_target=True).sum(-1)
            elif spec.kind == "reverse_kl":  # kl_div(input=log p, target=log q) = q (log q - log p), differentiated through q
                per_token = F.kl_div(F.log_softmax(teacher, -1), F.log_softmax(x, -1), reduction="none", log_target=True).sum(-1)
            elif spec.kind == "entropy":  # H(q) = -sum q log q
                log_q = F.log_softmax(x, -1)
                per_token = -(log_q.exp() * log_q).sum(-1)
            else:  # jensen_shannon: beta KL(p || M) + (1 - beta) KL(q || M), M = beta p + (1 - beta) q
                log_q, log_p = F.log_softmax(x, -1), F.log_softmax(teacher, -1)
                log_m = torch.logaddexp(log_p + math.log(JSD_BETA), log_q + math.log(1.0 - JSD_BETA))
                per_token = (JSD_BETA * F.kl_div(log_m, log_p, reduction="none", log_target=True).sum(-1)
                             + (1.0 - JSD_BETA) * F.kl_div(log_m, log_q, reduction="none", log_target=True).sum(-1))
            return (per_token * weight).sum() / count

        if spec.backend in ("torchloss", "torchloss-triton", "torchloss-triton-inplace"):
            import torchloss

            impl = "torch" if spec.backend == "torchloss" else "triton"
            fn = getattr(torchloss, spec.kind)
            options = {"impl": impl, "inplace": spec.backend.endswith("-inplace")}

            def forward() -> Any:
                return fn(X(), mask, **options) if target_kind is None else fn(X(), target, mask, **options)
        elif spec.backend == "torch-eager":

            def forward() -> Any:
                return eager(X(), teacher, labels_ignore, weight, count)
        elif spec.backend == "torch-compile":
            compiled = torch.compile(eager)

            def forward() -> Any:
                return compiled(X(), teacher, labels_ignore, weight, count)
        elif spec.backend == "liger":
            functional = _liger()
            if spec.kind == "cross_entropy":  # note: Liger writes the gradient into the logits' buffer

                def forward() -> Any:
                    return functional.liger_cross_entropy(X(), labels_ignore)
            else:
                valid = mask.nonzero().squeeze(1)

                def forward() -> Any:  # batchmean over the valid rows = sum / count
                    log_q = F.log_softmax(X()[valid], -1)
                    log_p = F.log_softmax(teacher[valid], -1)
                    return functional.liger_kl_div(log_q, log_p, reduction="batchmean", log_target=True)
        elif spec.backend == "flash-attn-ce":
            ce = _load_flash_attn_ce()

            def forward() -> Any:
                losses, _ = ce(X(), labels_ignore)
                return losses.sum() / count
        elif spec.backend == "torch-sol":
            xd = X().detach()
            out = torch.zeros_like(xd)  # faulted in now: the pass only reads and writes memory

            def sol_step() -> Any:
                if teacher is not None:
                    torch.add(xd, teacher, out=out)
                else:
                    torch.mul(xd, 2.0, out=out)
                return None

            forward = None  # type: ignore[assignment]
        else:
            raise ValueError(f"unknown torch backend {spec.backend}")

    def reset() -> None:
        for leaf in leaves:
            leaf.grad = None

    if spec.info.role == "sol":
        bench.step = sol_step
        bench.loss_value = lambda out: None
    elif fresh is not None:

        def step() -> Any:
            logits = fresh()
            loss = forward()
            # The gradient of the call's own copy (autograd.grad: nothing accumulates into the
            # pristine leaf that the copy was cloned from, nor is copied there).
            (grad,) = torch.autograd.grad(loss, logits)
            del grad
            return loss.detach()

        bench.step = step
        bench.prepare = fresh.restore
        bench.loss_value = lambda out: float(out)
    else:

        def step() -> Any:
            reset()
            loss = forward()
            loss.backward()
            return loss.detach()

        bench.step = step
        bench.loss_value = lambda out: float(out)
    bench.reset = reset
    bench.sync = sync
    if gpu:
        bench.clock = CudaEventClock(torch)
    bench.memory = TorchCudaMemory(torch) if gpu else HostMemory()
    return bench


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------


def _call(bench: Bench) -> tuple[float, float | None]:
    """One timed call; its outputs freed at once. ``bench.prepare()`` (an in-place contender's
    fresh logits) runs first, outside the timed region. Returns the seconds it took and its loss
    (None for the speed-of-light passes), read after the clock stopped."""
    bench.prepare()
    out, seconds = bench.clock(bench.step)
    loss = bench.loss_value(out)
    bench.release(out)
    del out
    return seconds, loss


def round_order(count: int, round_index: int) -> list[int]:
    """The contenders' order in one round: rotated by one each round, so that each runs first,
    second, ... in turn (a contender that always followed a slow one would inherit its heat)."""
    return [(round_index + k) % count for k in range(count)]


def spread(times: list[float]) -> dict[str, float]:
    """min / median / max of the repetitions (the figures of the report)."""
    return {"min_s": min(times), "time_s": statistics.median(times), "max_s": max(times)}


def measure_cell(specs: list[Spec]) -> list[dict[str, Any]]:
    """Builds, warms up, measures the memory of and times every contender of one cell (the
    module docstring has the method). A contender that fails is reported and left out; the
    others go on."""
    results = [{"spec": s.to_json(), "status": "ok", "pid": os.getpid()} for s in specs]
    start = time.perf_counter()
    first = specs[0]
    shared = jax_inputs(first) if first.info.framework == "jax" else torch_inputs(first)
    benches: dict[int, Bench] = {}
    for i, spec in enumerate(specs):
        t0 = time.perf_counter()
        try:
            benches[i] = jax_bench(spec, shared) if spec.info.framework == "jax" else torch_bench(spec, shared)
        except Unavailable as reason:
            results[i].update(status="unavailable", error=str(reason))
            continue
        except Exception as error:  # noqa: BLE001 - reported per contender, the cell goes on
            _fail(results[i], error)
            continue
        results[i]["setup_s"] = time.perf_counter() - t0
        results[i]["compile_s"] = benches[i].compile_s
        results[i]["xla_memory_analysis"] = benches[i].analysis

    def attempt(i: int, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as error:  # noqa: BLE001
            _fail(results[i], error)
            del benches[i]
            return None

    # Warm-up: the first call compiles (torch.compile, the Triton/Pallas kernels, XLA).
    for i in list(benches):
        bench = benches[i]

        def warm_up() -> None:
            bench.prepare()
            t0 = time.perf_counter()
            out = bench.step()
            bench.sync()
            results[i]["first_call_s"] = time.perf_counter() - t0
            results[i]["loss"] = bench.loss_value(out)
            bench.release(out)
            for _ in range(specs[i].warmup - 1):
                _call(bench)

        attempt(i, warm_up)

    # Memory of one call per contender, one after the other, from a trimmed heap.
    for i in list(benches):
        bench = benches[i]

        def memory() -> None:
            bench.reset()
            bench.prepare()  # an in-place contender's fresh logits are an input, not the call's memory
            time.sleep(0.2)  # let frees still in flight (allocator threads, munmap) land before the baseline
            bench.memory.start()
            out = bench.step()
            extra = bench.memory.stop()
            bench.release(out)
            results[i]["mem_method"] = bench.memory.method
            results[i]["mem_baseline_bytes"] = bench.memory.baseline()
            if isinstance(bench.memory, JaxDeviceMemory) and bench.analysis is not None:
                results[i]["mem_peak_upper_bound_bytes"] = extra
                extra = bench.analysis["temp_bytes"] + bench.analysis["output_bytes"] - bench.analysis["alias_bytes"]
            results[i]["mem_extra_bytes"] = extra

        attempt(i, memory)

    # Time: interleaved rounds.
    times: dict[int, list[float]] = {i: [] for i in benches}
    losses: dict[int, list[float | None]] = {i: [] for i in benches}
    rounds = max(s.reps for s in specs)
    for r in range(rounds):
        order = list(benches)
        for k in round_order(len(order), r):
            i = order[k]
            calls = specs[i].sol_reps if specs[i].info.role == "sol" else 1
            for _ in range(calls):
                timed = attempt(i, lambda: _call(benches[i]))
                if timed is None:
                    break
                times[i].append(timed[0])
                losses[i].append(timed[1])
    for i in benches:
        results[i]["times_s"] = times[i]
        results[i].update(spread(times[i]))
        results[i]["reps"] = len(times[i])
        results[i]["rounds"] = rounds
        results[i]["timer"] = getattr(benches[i].clock, "method", WALL_CLOCK)
        if specs[i].info.role != "sol":
            # every repetition's loss: the same inputs give the same loss (an in-place contender
            # run on its last gradient would not; the report flags any that moves)
            results[i]["rep_losses"] = losses[i]
    wall = time.perf_counter() - start
    for r in results:
        r["cell_s"] = wall
    return results


def _fail(result: dict[str, Any], error: BaseException) -> None:
    result.update(status="error", error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(limit=6))


def main() -> None:
    specs = [Spec(**item) for item in json.loads(sys.argv[1])]
    for result in measure_cell(specs):
        result["host"] = platform.node()
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
