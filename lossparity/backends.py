"""The backends that the parity matrix compares: the float64 oracle, JAX (XLA, Pallas) and torch
(torch path, Triton). Each backend is a function ``run(kind, inputs, options, grad_output)``
returning ``(loss, grad_logits)`` as float64 NumPy arrays; frameworks are imported lazily so
that a missing one only disables its own backends."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

import lossspec

if TYPE_CHECKING:  # torch is imported lazily (a missing framework only disables its backends)
    import torch

BackendFn = Callable[[str, "Inputs", dict[str, Any], Any], tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass
class Inputs:
    """One batch: ``logits [..., V]`` (float32/float64 values exactly representable in ``dtype``),
    ``target`` (labels ``[...]``, teacher logits ``[..., V]``, or None for ``entropy``),
    ``loss_mask [...]`` and ``segment_ids [...]`` (packed documents, ids < 0 padding; None: each
    row one sequence, lossspec.sequences); ``dtype`` is the logits' dtype each framework casts
    to (``float32``, ``bfloat16``, ``float16``)."""

    logits: np.ndarray
    target: np.ndarray | None
    loss_mask: np.ndarray | None
    dtype: str
    segment_ids: np.ndarray | None = None


@dataclasses.dataclass
class Backend:
    name: str
    framework: str  # "oracle" | "jax" | "torch"
    run: BackendFn
    kernel: bool = False  # a kernel, interpreted on CPU-only machines: slow there, keep shapes small


def _oracle(kind: str, inputs: Inputs, options: dict[str, Any], grad_output: Any) -> tuple[np.ndarray, np.ndarray]:
    loss, grad = lossspec.oracle(kind, inputs.logits, inputs.target, inputs.loss_mask, grad_output=grad_output,
                                 segment_ids=inputs.segment_ids, **options)
    return np.asarray(loss, np.float64), grad


def _jax(impl: str) -> BackendFn:
    def run(kind: str, inputs: Inputs, options: dict[str, Any], grad_output: Any) -> tuple[np.ndarray, np.ndarray]:
        import jax
        import jax.numpy as jnp

        import jaxloss

        dtype = jnp.dtype(inputs.dtype)
        logits = jnp.asarray(inputs.logits, dtype)
        targets: tuple = ()  # entropy has no target argument
        if lossspec.KIND_SPECS[kind].has_labels:
            targets = (jnp.asarray(inputs.target.astype(np.int32)),)
        elif lossspec.KIND_SPECS[kind].target is not None:
            targets = (jnp.asarray(inputs.target, dtype),)
        mask = None if inputs.loss_mask is None else jnp.asarray(inputs.loss_mask)
        # NumPy ids as given: jaxloss compacts 64-bit ids itself (lossspec.compact_segment_ids).
        ids = inputs.segment_ids
        loss_fn = getattr(jaxloss, kind)
        loss, vjp = jax.vjp(lambda x: loss_fn(x, *targets, mask, impl=impl, segment_ids=ids, **options), logits)
        cotangent = jnp.ones_like(loss) if grad_output is None else jnp.asarray(grad_output, loss.dtype) * jnp.ones_like(loss)
        (grad,) = vjp(cotangent)
        return np.asarray(loss, np.float64), np.asarray(grad.astype(jnp.float32), np.float64)

    return run


def torch_device(impl: str) -> "torch.device":
    """Where the torch backend of ``impl`` puts its tensors. The Triton kernels run compiled on
    CUDA tensors where CUDA is available (compiled kernels take nothing else), else through the
    Triton interpreter on CPU tensors (torchloss enables it without CUDA); the torch path stays
    on the CPU."""
    import torch

    return torch.device("cuda" if impl == "triton" and torch.cuda.is_available() else "cpu")


def _torch(impl: str) -> BackendFn:
    def run(kind: str, inputs: Inputs, options: dict[str, Any], grad_output: Any) -> tuple[np.ndarray, np.ndarray]:
        import torch

        import torchloss

        device = torch_device(impl)
        # Made on the host exactly as before, then moved (the same values on every device).
        host = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        dtype = getattr(torch, inputs.dtype)
        logits = host(inputs.logits).to(dtype).to(device).requires_grad_(True)
        targets: tuple = ()  # entropy has no target argument
        if lossspec.KIND_SPECS[kind].has_labels:
            targets = (host(inputs.target.astype(np.int64)).to(device),)
        elif lossspec.KIND_SPECS[kind].target is not None:
            targets = (host(inputs.target).to(dtype).to(device),)
        mask = None if inputs.loss_mask is None else host(inputs.loss_mask).to(device)
        ids = None if inputs.segment_ids is None else host(inputs.segment_ids).to(device)
        loss = getattr(torchloss, kind)(logits, *targets, mask, impl=impl, segment_ids=ids, **options)
        if grad_output is None:
            upstream = torch.ones_like(loss)
        else:
            upstream = torch.as_tensor(grad_output, dtype=loss.dtype).to(device).expand_as(loss)
        loss.backward(upstream)
        # .cpu() also waits for the device's kernels, so the caller's timing covers them.
        return loss.detach().cpu().double().numpy(), logits.grad.cpu().double().numpy()

    return run


BACKENDS: dict[str, Backend] = {
    "oracle": Backend("oracle", "oracle", _oracle),
    "jax-xla": Backend("jax-xla", "jax", _jax("xla")),
    "jax-pallas": Backend("jax-pallas", "jax", _jax("pallas"), kernel=True),
    "torch": Backend("torch", "torch", _torch("torch")),
    "torch-triton": Backend("torch-triton", "torch", _torch("triton"), kernel=True),
}
# Pairs that must agree with each other (besides each against the oracle): the same algorithm
# in the two frameworks.
CROSS_PAIRS: tuple[tuple[str, str], ...] = (("jax-xla", "torch"), ("jax-pallas", "torch-triton"), ("jax-xla", "torch-triton"))


def available(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The backends of ``names`` whose framework imports, and why the others are unavailable."""
    ok, missing = [], {}
    for name in names:
        framework = BACKENDS[name].framework
        try:
            if framework == "jax":
                import jaxloss  # noqa: F401
            elif framework == "torch":
                import torchloss  # noqa: F401
        except ImportError as error:  # pragma: no cover - depends on the installation
            missing[name] = f"{framework} unavailable: {error}"
            continue
        ok.append(name)
    return ok, missing
