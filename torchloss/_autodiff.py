"""The losses' autograd Functions: the forward computes the loss *and* ``grad = coef * c * dl/dz``
in one read of the logits (the torch path, the Triton kernel, or their vocab-parallel twin); the
backward multiplies that gradient by the upstream gradient (or, for bf16/fp16 logits and an
upstream gradient that is not exactly 1, recomputes it with ``coef`` times the upstream gradient,
so that it is rounded once). A ``create_graph=True`` gradient is tied to its inputs through a node
whose backward raises (first order only). The twin of ``jaxloss._autodiff``."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lossspec import LossConfig, Tuning

from .backends import cpu_tiles as _cpu



# ----------------------------------------------------------------------------------------------
# Autograd Functions
# ----------------------------------------------------------------------------------------------


class MaskedLossFunction(torch.autograd.Function):
    """Shared forward/backward of the four losses (``config.kind`` selects the loss).

    ``forward(logits [N, V], target, coef [N], config, backend, need_grad, inplace, anchor, tuning)`` returns
    the loss (0-d, or ``[N]`` for ``"none"``) in the compute dtype and keeps the gradient
    ``coef * c * dl/dz`` (logits' dtype, written into ``logits`` when ``inplace``) on ``ctx``.
    ``backward`` scales that buffer by the upstream gradient in place and hands it out: no
    second ``[N, V]`` buffer, no host synchronisation (with ``retain_graph=True`` it returns a
    scaled copy instead, so that backward can run again). For bf16/fp16 logits (not
    ``inplace``) a non-unit upstream gradient rewrites the buffer from the saved inputs instead
    (:func:`_recomputed_grad`): one rounding, as SPEC section 6 requires. First order only: a
    gradient taken with ``create_graph=True`` raises a clear error if it is differentiated.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        coef: Tensor,
        config: LossConfig,
        backend: Any,
        need_grad: bool,
        inplace: bool,
        anchor: Optional[Tensor] = None,
        tuning: Optional[Tuning] = None,
    ) -> Tensor:
        write_inplace = inplace and need_grad
        ctx.anchor, ctx.tuning = anchor, tuning
        ctx.recompute = need_grad and not inplace and logits.dtype in (torch.bfloat16, torch.float16)
        # Kernels that keep the rows' final statistics (KEEPS_FINAL: Triton) fill this buffer, so
        # that a recompute in the backward runs the gradient pass alone.
        keep = {"final": backend.final_buffer(logits)} if ctx.recompute and backend.KEEPS_FINAL else {}
        per_token, grad = backend.forward(config, logits, target, coef, need_grad=need_grad, out=logits if write_inplace else None, tuning=tuning,
                                          **keep)
        ctx.keep = keep
        if write_inplace:
            # The kernel wrote behind autograd's back: bump the version counter so that any other
            # use of these logits in the graph fails loudly instead of reading the gradient.
            torch.autograd.graph.increment_version(logits)
        ctx.grad = grad
        ctx.reduced = config.normalization != "none"
        if ctx.recompute:
            ctx.config, ctx.backend = config, backend
            ctx.save_for_backward(logits, target, coef)
        contribution = torch.where(coef != 0, coef * per_token, 0.0)
        return contribution.sum() if ctx.reduced else contribution

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        create_graph = torch.is_grad_enabled()  # backward(create_graph=True)
        with torch.no_grad():
            if ctx.recompute:
                grad = _recomputed_grad(ctx, grad_loss)
            else:
                grad = _scaled_grad(ctx, grad_loss)
        if create_graph:
            grad = first_order_only(grad, ctx.anchor)
        return (grad, None, None, None, None, None, None, None, None)


def _scaled_grad(ctx: Any, grad_loss: Tensor) -> Tensor:
    """The forward's buffer times the upstream gradient (scalar, or per token for ``"none"``),
    in place when the graph is freed after this call."""
    grad = ctx.grad
    upstream = grad_loss if ctx.reduced else grad_loss.reshape(-1, 1)
    if graph_is_kept():
        return grad * upstream  # retain_graph=True / gradcheck: keep our buffer for the next one
    ctx.grad = None  # hand our buffer out: autograd takes it without a copy
    if _is_unit(upstream):
        return grad  # loss.backward(): multiplying by exactly 1 would change no bit
    if ctx.reduced:
        return grad.mul_(upstream)
    return _cpu.scale_rows_(grad, upstream, ctx.tuning)


def _recomputed_grad(ctx: Any, grad_loss: Tensor) -> Tensor:
    """The gradient of 16-bit logits for the upstream gradient ``g``: ``coef * g * c * dl/dz``
    formed in fp32 and rounded once (scaling the forward's already rounded buffer would round
    twice, beyond SPEC section 6's one ulp). ``g == 1`` where that is known for free (a CPU
    tensor) hands the forward's buffer out; otherwise ``backend.regrad_`` rewrites it from the
    saved logits, target and ``coef * g`` (and the forward's final statistics, where the kernels
    keep them) without a host synchronisation."""
    grad, keep = ctx.grad, ctx.keep
    if not graph_is_kept():
        ctx.grad, ctx.keep = None, {}  # the kept statistics go with the buffer
    elif grad is not None:
        grad = grad.clone()
    logits, target, coef = ctx.saved_tensors
    upstream = grad_loss.detach().to(coef.dtype).reshape(-1)  # 1 value, or 1 per token
    if _is_unit(upstream):
        return grad
    return ctx.backend.regrad_(ctx.config, logits, target, coef, upstream, grad, tuning=ctx.tuning, **keep)


_SECOND_ORDER = (
    "torchloss losses are differentiable once: their gradient is computed in the forward and is not itself "
    "differentiable (double backward / create_graph=True through the loss is not supported). Differentiate "
    "the loss once, or use an unfused reference (torch.nn.functional) for higher-order derivatives"
)


class _SecondOrderError(torch.autograd.Function):
    """The identity on gradients formed in a forward pass, whose backward raises
    :data:`_SECOND_ORDER`. Its inputs also hold an :func:`second_order_anchor` of the inputs
    those gradients belong to, so that the node lies on *every* route from the gradients back
    to the inputs: ``.backward()``, ``torch.autograd.grad(..., inputs=weight)`` and
    ``gradgradcheck`` alike. (A node fed by a detached copy of the gradient, as
    ``once_differentiable`` makes, is reached by ``.backward()`` only: ``autograd.grad`` with
    ``inputs=`` prunes it and returns ``None``, a zero Hessian.)"""

    @staticmethod
    def forward(ctx: Any, count: int, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        return tensors[:count]  # the gradients themselves (autograd makes views), the anchor dropped

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        raise RuntimeError(_SECOND_ORDER)


def second_order_anchor(*inputs: Optional[Tensor]) -> Optional[Tensor]:
    """A 0-element tensor that autograd's graph connects to each of ``inputs`` requiring grad
    (an empty slice of each, concatenated: the graph keeps their shapes, none of their memory),
    or ``None``; made in the forward for :func:`first_order_only`."""
    live = [t for t in inputs if t is not None and t.requires_grad]
    if not live:
        return None
    return torch.cat([t.narrow(-1, 0, 0).reshape(0) for t in live])


def first_order_only(grads: Any, anchor: Optional[Tensor]) -> Any:
    """With ``create_graph=True``: the gradients (one tensor or a tuple, ``None`` entries kept)
    through :class:`_SecondOrderError`, tied to ``anchor`` (the inputs'
    :func:`second_order_anchor`), so that differentiating them raises a clear error (autograd
    would otherwise treat them as constants)."""
    single = not isinstance(grads, tuple)
    items = (grads,) if single else grads
    present = [g for g in items if g is not None]
    if not present or anchor is None:
        return grads
    wrapped = iter(_SecondOrderError.apply(len(present), *present, anchor))
    out = tuple(None if g is None else next(wrapped) for g in items)
    return out[0] if single else out


def _is_unit(upstream: Tensor) -> bool:
    """Whether the upstream gradient is exactly 1, asked only where the answer is free: a CPU
    tensor outside tracing. Elsewhere the multiplication runs."""
    if upstream.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return bool(torch.all(upstream == 1))


def graph_is_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); True if unknown."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


class CrossEntropyFunction(MaskedLossFunction):
    """Autograd Function of :func:`cross_entropy` (labels ``[N]``)."""

    kind = "cross_entropy"


class SoftCrossEntropyFunction(MaskedLossFunction):
    """Autograd Function of :func:`soft_cross_entropy` (teacher logits ``[N, V]``, no gradient)."""

    kind = "soft_cross_entropy"


class ForwardKLFunction(MaskedLossFunction):
    """Autograd Function of :func:`forward_kl` (teacher logits ``[N, V]``, no gradient)."""

    kind = "forward_kl"


class ReverseKLFunction(MaskedLossFunction):
    """Autograd Function of :func:`reverse_kl` (teacher logits ``[N, V]``, no gradient)."""

    kind = "reverse_kl"


class EntropyFunction(MaskedLossFunction):
    """Autograd Function of :func:`entropy` (no target: an empty ``[N, 0]`` stand-in)."""

    kind = "entropy"


class JensenShannonFunction(MaskedLossFunction):
    """Autograd Function of :func:`jensen_shannon` (teacher logits ``[N, V]``, no gradient)."""

    kind = "jensen_shannon"


FUNCTIONS: dict[str, type[MaskedLossFunction]] = {
    f.kind: f
    for f in (
        CrossEntropyFunction,
        SoftCrossEntropyFunction,
        ForwardKLFunction,
        ReverseKLFunction,
        EntropyFunction,
        JensenShannonFunction,
    )
}
