"""Public functions of ``torchloss`` (SPEC section 3) and their autograd Functions.

The four losses are built from ``lossspec``'s per-kind table (the signatures and docstrings of
``jaxloss``' twins). Flow of one call, as in ``jaxloss.api``:

1. :func:`_validate`: options -> :func:`lossspec.make_config`, tensors, shapes, dtypes,
   devices, ``inplace``; value checks (labels in range, weights, denominator) where they are
   free (CPU tensors outside tracing), so a CUDA call never synchronises with the host;
2. :func:`_prepare`: ``valid``, the weights, ``D`` and the per-token coefficient
   ``coef = where(D > 0, weight / D, 0)`` (``weight`` for ``"none"``), the safe labels
   ``where(valid, labels, 0)`` and a flag for bad values that could not be checked eagerly;
3. :func:`_apply`: the kind's autograd Function: its forward computes the loss *and*
   ``grad = coef * c * dl/dz`` in one read of the logits (the torch path, the Triton kernel,
   or their vocab-parallel twin); its backward multiplies that gradient by the upstream
   gradient (or, for bf16/fp16 logits and an upstream gradient that is not exactly 1,
   recomputes it with ``coef`` times the upstream gradient, so that it is rounded once);
4. :func:`_finish`: NaN when a value check was deferred and failed; per-token shape for
   ``"none"``.

Under ``torch.compile`` Dynamo traces the same steps (the shape/dtype checks run at trace time,
the value checks become on-device flags) and step 3 calls the custom op
``torchloss::masked_loss`` of :mod:`torchloss._ops` instead of the autograd Function: the same
backend code, no graph break. Calls with ``inplace=True`` or ``vocab_parallel=`` run eagerly
behind one graph break (:func:`_loss_call`).

Numbers: ``loss = sum_i w_i l_i / D`` (a 0-d fp32 tensor), or per-token ``w_i l_i`` for
``normalization="none"``; ``dloss/dlogits = coef * c * dl/dz`` with ``c = logit_scale /
temperature``, rounded once to the logits' dtype. fp64 logits are computed in fp64.
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor

import lossspec
from lossspec import LossConfig

from . import _cpu, _ops, _torch, _vocab_parallel
from ._stats import compute_dtype

__all__ = [
    "cross_entropy",
    "soft_cross_entropy",
    "forward_kl",
    "reverse_kl",
    "entropy",
    "jensen_shannon",
    "count_denominator",
    "CrossEntropyFunction",
    "SoftCrossEntropyFunction",
    "ForwardKLFunction",
    "ReverseKLFunction",
    "EntropyFunction",
    "JensenShannonFunction",
]

Denominator = Union[int, float, Tensor, None]

_UNSIGNED = {torch.uint8, getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None)}


# ----------------------------------------------------------------------------------------------
# Autograd Functions
# ----------------------------------------------------------------------------------------------


class _MaskedLossFunction(torch.autograd.Function):
    """Shared forward/backward of the four losses (``config.kind`` selects the loss).

    ``forward(logits [N, V], target, coef [N], config, backend, need_grad, inplace)`` returns
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
    ) -> Tensor:
        write_inplace = inplace and need_grad
        ctx.anchor = anchor
        per_token, grad = backend.forward(config, logits, target, coef, need_grad=need_grad, out=logits if write_inplace else None)
        if write_inplace:
            # The kernel wrote behind autograd's back: bump the version counter so that any other
            # use of these logits in the graph fails loudly instead of reading the gradient.
            torch.autograd.graph.increment_version(logits)
        ctx.grad = grad
        ctx.reduced = config.normalization != "none"
        ctx.recompute = need_grad and not inplace and logits.dtype in (torch.bfloat16, torch.float16)
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
            grad = _first_order_only(grad, ctx.anchor)
        return (grad, None, None, None, None, None, None, None)


def _scaled_grad(ctx: Any, grad_loss: Tensor) -> Tensor:
    """The forward's buffer times the upstream gradient (scalar, or per token for ``"none"``),
    in place when the graph is freed after this call."""
    grad = ctx.grad
    upstream = grad_loss if ctx.reduced else grad_loss.reshape(-1, 1)
    if _graph_is_kept():
        return grad * upstream  # retain_graph=True / gradcheck: keep our buffer for the next one
    ctx.grad = None  # hand our buffer out: autograd takes it without a copy
    if _is_unit(upstream):
        return grad  # loss.backward(): multiplying by exactly 1 would change no bit
    if ctx.reduced:
        return grad.mul_(upstream)
    return _cpu.scale_rows_(grad, upstream)


def _recomputed_grad(ctx: Any, grad_loss: Tensor) -> Tensor:
    """The gradient of 16-bit logits for the upstream gradient ``g``: ``coef * g * c * dl/dz``
    formed in fp32 and rounded once (scaling the forward's already rounded buffer would round
    twice, beyond SPEC section 6's one ulp). ``g == 1`` where that is known for free (a CPU
    tensor) hands the forward's buffer out; otherwise ``backend.regrad_`` rewrites it from the
    saved logits, target and ``coef * g`` without a host synchronisation."""
    grad = ctx.grad
    if not _graph_is_kept():
        ctx.grad = None
    elif grad is not None:
        grad = grad.clone()
    logits, target, coef = ctx.saved_tensors
    upstream = grad_loss.detach().to(coef.dtype).reshape(-1)  # 1 value, or 1 per token
    if _is_unit(upstream):
        return grad
    return ctx.backend.regrad_(ctx.config, logits, target, coef, upstream, grad)


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
    or ``None``; made in the forward for :func:`_first_order_only`."""
    live = [t for t in inputs if t is not None and t.requires_grad]
    if not live:
        return None
    return torch.cat([t.narrow(-1, 0, 0).reshape(0) for t in live])


def _first_order_only(grads: Any, anchor: Optional[Tensor]) -> Any:
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


def _graph_is_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); True if unknown."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


class CrossEntropyFunction(_MaskedLossFunction):
    """Autograd Function of :func:`cross_entropy` (labels ``[N]``)."""

    kind = "cross_entropy"


class SoftCrossEntropyFunction(_MaskedLossFunction):
    """Autograd Function of :func:`soft_cross_entropy` (teacher logits ``[N, V]``, no gradient)."""

    kind = "soft_cross_entropy"


class ForwardKLFunction(_MaskedLossFunction):
    """Autograd Function of :func:`forward_kl` (teacher logits ``[N, V]``, no gradient)."""

    kind = "forward_kl"


class ReverseKLFunction(_MaskedLossFunction):
    """Autograd Function of :func:`reverse_kl` (teacher logits ``[N, V]``, no gradient)."""

    kind = "reverse_kl"


class EntropyFunction(_MaskedLossFunction):
    """Autograd Function of :func:`entropy` (no target: an empty ``[N, 0]`` stand-in)."""

    kind = "entropy"


class JensenShannonFunction(_MaskedLossFunction):
    """Autograd Function of :func:`jensen_shannon` (teacher logits ``[N, V]``, no gradient)."""

    kind = "jensen_shannon"


_FUNCTIONS: dict[str, type[_MaskedLossFunction]] = {
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


# ----------------------------------------------------------------------------------------------
# 1. Validation
# ----------------------------------------------------------------------------------------------


def _dtype_kind(dtype: torch.dtype) -> str:
    """numpy's ``dtype.kind`` of a torch dtype (what :func:`lossspec.meta` expects)."""
    if dtype == torch.bool:
        return "b"
    if dtype.is_complex:
        return "c"
    if dtype.is_floating_point:
        return "f"
    return "u" if dtype in _UNSIGNED else "i"


def _meta(tensor: Tensor) -> lossspec.ArrayMeta:
    return lossspec.meta(tensor.shape, _dtype_kind(tensor.dtype), str(tensor.dtype).removeprefix("torch."))


def _require_tensor(name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    return value


def _host_readable(*tensors: Optional[Tensor]) -> bool:
    """Values can be read without a device synchronisation: CPU tensors, outside tracing."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _numpy(tensor: Tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()  # numpy has no bfloat16; the conversion is exact
    return tensor.numpy()


def _broadcast_mask(loss_mask: Optional[Tensor], lead: tuple[int, ...]) -> Optional[Tensor]:
    """A ``loss_mask`` that broadcasts to the leading shape ``lead`` (``[T]``, ``[B, T, 1]``;
    ``lossspec.mask_broadcasts``, checked before) as a view of that shape (no copy)."""
    if loss_mask is None or tuple(loss_mask.shape) == lead:
        return loss_mask
    return loss_mask.reshape(lossspec.squeezed_mask_shape(tuple(loss_mask.shape), lead)).expand(lead)


def _check_device(name: str, tensor: Optional[Tensor], device: torch.device) -> None:
    if tensor is not None and tensor.device != device:
        raise ValueError(f"{name} must be on the device of logits ({device}); got {tensor.device}")


def _backend(impl: str, logits: Tensor) -> ModuleType:
    if impl == "auto":
        impl = "triton" if logits.is_cuda else "torch"
    if impl == "torch":
        return _torch
    try:
        from . import _triton
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError("impl='triton' needs the triton package (pip install triton); impl='torch' works without it") from err
    return _triton


def _check_process_group(group: Any, name: str = "vocab_parallel") -> None:
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"{name} must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD or dist.new_group(...)); "
            f"got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(f"{name} needs an initialised default process group (dist.init_process_group)")


def _check_no_functorch(*tensors: Optional[Tensor]) -> None:
    """torch.func transforms (grad, vmap, jacrev, ...) wrap tensors in a way the fused kernels
    cannot read: a clear error instead of 'Cannot access data pointer'. Not asked while Dynamo
    traces (the query is opaque to it; compiled code calls the custom op, not the kernels)."""
    if torch.compiler.is_compiling():
        return
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    if wrapped is not None and any(t is not None and wrapped(t) for t in tensors):
        raise NotImplementedError(
            "torchloss losses do not support torch.func transforms (torch.func.grad, vmap, jacrev, ...): their "
            "gradient is computed by a fused kernel in the forward. Use loss.backward() or torch.autograd.grad, "
            "and a Python loop (or a batch dimension) instead of vmap"
        )


def _check_inplace(logits: Tensor, need_grad: bool) -> None:
    """``inplace=True`` overwrites the logits with their gradient: never a leaf's storage."""
    if not need_grad:
        return
    base = logits
    while base is not None:
        if base.is_leaf and base.requires_grad:
            what = "a leaf tensor" if base is logits else "a view of a leaf tensor"
            raise ValueError(
                f"inplace=True writes the gradient into the logits' buffer, but logits is {what} that requires grad "
                "(its values would be overwritten); pass the output of an operation (e.g. the LM head) instead"
            )
        base = base._base
    if not logits.is_contiguous():
        raise ValueError("inplace=True needs contiguous logits (their buffer receives the gradient)")


@dataclasses.dataclass
class _Call:
    """One validated call."""

    config: LossConfig
    logits: Tensor
    target: Tensor
    loss_mask: Optional[Tensor]
    segment_ids: Optional[Tensor]
    denominator: Denominator
    sequence_parallel: Any  # a ProcessGroup splitting the time axis, or None
    backend: Any
    vocab: int  # the global vocabulary (labels are global ids)
    host: bool  # values readable without a synchronisation
    need_grad: bool
    inplace: bool


def _validate(
    config: LossConfig,
    logits: Any,
    target: Any,
    loss_mask: Any,
    segment_ids: Any,
    denominator: Denominator,
    vocab_parallel: Any,
    sequence_parallel: Any,
    impl: str,
    inplace: bool,
) -> _Call:
    is_ce = config.has_labels
    target_name = "labels" if is_ce else "teacher_logits"
    lossspec.check_impl(impl, lossspec.TORCH_IMPLS)
    logits = _require_tensor("logits", logits)
    if config.has_target:
        target = _require_tensor(target_name, target)
        target_meta: Optional[lossspec.ArrayMeta] = _meta(target)
    else:
        # No target (entropy): an empty [..., 0] stand-in carries the leading shape through the
        # shared steps at no cost; the backends never read it.
        target = logits.new_empty(tuple(logits.shape[:-1]) + (0,)).detach()
        target_meta = None
    if loss_mask is not None:
        loss_mask = _require_tensor("loss_mask", loss_mask)
    if segment_ids is not None:
        segment_ids = _require_tensor("segment_ids", segment_ids)
    lossspec.check_inputs(
        config, _meta(logits), target_meta, None if loss_mask is None else _meta(loss_mask), None if segment_ids is None else _meta(segment_ids)
    )
    loss_mask = _broadcast_mask(loss_mask, tuple(logits.shape[:-1]))
    lossspec.check_denominator_allowed(config, denominator)
    if isinstance(denominator, Tensor):
        lossspec.check_denominator_type(denominator, _meta(denominator))  # not bool, not complex
        lossspec.check_denominator_shape(tuple(denominator.shape))
    elif denominator is not None:
        lossspec.check_denominator_type(denominator)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool; got {type(inplace).__name__}")
    _check_no_functorch(logits, target, loss_mask)
    device = logits.device
    _check_device(target_name, target, device)
    _check_device("loss_mask", loss_mask, device)
    _check_device("segment_ids", segment_ids, device)
    if isinstance(denominator, Tensor) and denominator.device != device and denominator.device.type != "cpu":
        raise ValueError(f"denominator must be on the device of logits ({device}) or the CPU; got {denominator.device}")
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    if inplace:
        _check_inplace(logits, need_grad)
    backend: Any = _backend(impl, logits)
    vocab = int(logits.shape[-1])
    if vocab_parallel is not None:
        _check_process_group(vocab_parallel)
        offset, vocab = _vocab_parallel.shard_offset(vocab, vocab_parallel, device)
        backend = _vocab_parallel.VocabParallel(vocab_parallel, offset, vocab, kernel=None if backend is _torch else backend)
    if sequence_parallel is not None:
        _check_process_group(sequence_parallel, "sequence_parallel")
        lossspec.check_sequence_parallel_axis(tuple(logits.shape[:-1]))
    host = _host_readable(logits, target, loss_mask, segment_ids, denominator if isinstance(denominator, Tensor) else None)
    return _Call(
        config, logits, target, loss_mask, segment_ids, denominator, sequence_parallel, backend, vocab, host, need_grad, inplace
    )


# ----------------------------------------------------------------------------------------------
# 2. Weights, denominator, coefficients
# ----------------------------------------------------------------------------------------------


def _weights(
    config: LossConfig,
    labels: Optional[Tensor],
    loss_mask: Optional[Tensor],
    lead: tuple[int, ...],
    device: torch.device,
    acc: torch.dtype,
    segment_ids: Optional[Tensor] = None,
    ignore_matches: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(valid, weight)``: valid tokens (mask non-zero, segment id ``>= 0`` and label !=
    ignore_index, where the labels' dtype can hold it: ``ignore_matches``) and their weights in
    ``acc`` (0 where invalid). The mask is data: no gradient flows to it."""
    valid = torch.ones(lead, dtype=torch.bool, device=device)
    if loss_mask is not None:
        valid = valid & (loss_mask != 0)
    if labels is not None and ignore_matches:
        valid = valid & (labels != config.ignore_index)
    if segment_ids is not None:
        valid = valid & (segment_ids >= 0)
    if loss_mask is not None and loss_mask.dtype != torch.bool:
        return valid, torch.where(valid, loss_mask.detach().to(acc), 0.0)
    return valid, valid.to(acc)


def _bad_weights(loss_mask: Tensor) -> Tensor:
    """On-device twin of ``lossspec.check_weights`` (0-d bool): a negative, non-finite,
    non-finite-in-float32 or subnormal weight, or float32 weights whose sum (in float64)
    overflows float32."""
    w = loss_mask.detach().to(torch.float64)
    w32 = loss_mask.detach().to(torch.float32).to(torch.float64)
    bad = (~torch.isfinite(w) | (w < 0) | ~torch.isfinite(w32) | ((w32 > 0) & (w32 < lossspec.FP32_TINY))).any()
    return bad | (w32.sum() > lossspec.FP32_MAX)


_UINT64 = getattr(torch, "uint64", None)


def _labels_int64(labels: Tensor) -> Tensor:
    """Labels as int64 for comparisons. ATen has no uint64 comparison on the CPU, so uint64
    labels are their bits read as int64: values from 2**63 read negative, out of ``[0, V)``
    either way, and the host check reads them back as uint64 (:func:`_ignore_matches` keeps a
    negative ``ignore_index`` from matching them: no wrapping)."""
    if labels.dtype == _UINT64:
        return labels.view(torch.int64)
    return labels.to(torch.int64)


def _ignore_matches(labels: Optional[Tensor], ignore_index: int) -> bool:
    """Whether a label of ``labels``' dtype can equal ``ignore_index`` after
    :func:`_labels_int64` (``lossspec.ignore_index_in_dtype``; only uint64's int64 view could
    otherwise match a negative one)."""
    return labels is None or labels.dtype != _UINT64 or lossspec.ignore_index_in_dtype(ignore_index, "uint64")


@dataclasses.dataclass
class _Prepared:
    target: Tensor  # safe labels [N] int64 / teacher logits [N, V]
    coef: Tensor  # [N] in the compute dtype
    bad: Optional[Tensor]  # deferred value check failed (0-d bool), None where checked eagerly


def _shift_left(values: Tensor, fill: Union[int, float, bool]) -> Tensor:
    """``out[..., t] = values[..., t + 1]``, ``out[..., T - 1] = fill`` (``lossspec.shift_left``)."""
    pad = values.new_full(tuple(values.shape[:-1]) + (min(values.shape[-1], 1),), fill)
    return torch.cat([values[..., 1:], pad], dim=-1)


def _scored_targets(
    causal_shift: bool, labels: Optional[Tensor], loss_mask: Optional[Tensor], lead: tuple[int, ...], device: torch.device
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(labels, loss_mask)`` of the scored positions: as given, or with ``causal_shift`` both
    shifted left by one along time with a weight-0 last position (``lossspec.causal``). Only
    these ``[..., T]`` tensors are shifted, never the logits."""
    if not causal_shift:
        return labels, loss_mask
    if loss_mask is None:
        loss_mask = torch.ones(lead, dtype=torch.bool, device=device)
    return (None if labels is None else _shift_left(labels, 0)), _shift_left(loss_mask.detach(), 0)


def _scored_segment_ids(
    config: LossConfig, segment_ids: Optional[Tensor], lead: tuple[int, ...], device: torch.device
) -> Optional[Tensor]:
    """The int64 ids of the scored positions (``lossspec.scored_segment_ids``): as given (zeros,
    one sequence per row, for the sequence modes without ids), or with ``causal_shift``
    ``ids[t + 1]`` where ``ids[t] == ids[t + 1]``, else -1 (never across a document boundary).
    ``None`` when neither given nor needed."""
    if segment_ids is None:
        if not config.per_sequence:
            return None
        segment_ids = torch.zeros(lead, dtype=torch.int64, device=device)
    ids = _signed_ids(segment_ids.detach())
    if not config.causal_shift:
        return ids
    following = _shift_left(ids, -1)
    return torch.where(ids == following, following, -1)


def _signed_ids(ids: Tensor) -> Tensor:
    """``ids`` as int64 with the same sequences and padding (``lossspec.signed_segment_ids``):
    as they are, except uint64 ids, which int64 would wrap (``2**63`` and up would become
    padding): those are their ranks among the tensor's distinct ids (sort-based, on the device;
    an unsigned id is never padding)."""
    if ids.dtype != getattr(torch, "uint64", None):
        return ids.to(torch.int64)
    # Flipping the sign bit maps uint64 onto int64 in order (sorts of int64 run on every device).
    flat = ids.reshape(-1).view(torch.int64) ^ torch.iinfo(torch.int64).min
    sorted_ids, order = torch.sort(flat, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    ranks = torch.empty_like(flat).scatter_(0, order, torch.cumsum(starts, dim=0) - 1)
    return ranks.reshape(ids.shape)


def _sequence_sums(weight: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(n, first)`` ``[..., T]``: per token, the weight sum ``n_s`` of its sequence (the
    ``(row, id)`` pair; ``lossspec.sequence_weight_sums``), and whether it is the first position
    of its sequence (id ``>= 0``). Sort-based, no host synchronisation: the ids of each row are
    sorted (stably), numbered by group, and the weights summed per group with ``scatter_add``
    (each sum rounds like a plain sum of the sequence's weights, whatever the row's total)."""
    shape, time = weight.shape, weight.shape[-1]
    rows_w, rows_ids = weight.reshape(-1, time), ids.reshape(-1, time)
    sorted_ids, order = torch.sort(rows_ids, dim=-1, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    inverse = torch.argsort(order, dim=-1)
    group = (torch.cumsum(starts, dim=-1) - 1).gather(1, inverse)  # the sequence's number in its row
    sums = torch.zeros_like(rows_w).scatter_add_(1, group, rows_w)
    first = starts.gather(1, inverse) & (rows_ids >= 0)  # stable sort: the group's first is its earliest position
    return sums.gather(1, group).reshape(shape), first.reshape(shape)


def _sequence_count(weight: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(n, counted)``: :func:`_sequence_sums`' ``n`` and, per position, whether it counts a
    sequence in ``S`` (its first position, for sequences with ``n_s > 0``)."""
    n, first = _sequence_sums(weight, ids)
    return n, first & (n > 0)


@dataclasses.dataclass(frozen=True)
class _TimeWindow:
    """This rank's slice ``[offset, offset + length)`` of the time axis of ``total`` positions."""

    offset: int
    length: int
    total: int

    def take(self, values: Tensor) -> Tensor:
        return values[..., self.offset : self.offset + self.length]


def _time_window(group: Any, length: int, device: torch.device) -> tuple[_TimeWindow, list[int]]:
    """This rank's window and every rank's slice length (an ``all_gather`` of the lengths; one
    host read, as for the vocabulary shards). Slices are contiguous, in rank order; lengths may differ."""
    import torch.distributed as dist

    mine = torch.tensor([length], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, mine, group=group)
    lengths = [int(size.item()) for size in sizes]
    rank = dist.get_rank(group)
    return _TimeWindow(sum(lengths[:rank]), length, sum(lengths)), lengths


def _gather_time(values: Optional[Tensor], group: Any, lengths: list[int]) -> Optional[Tensor]:
    """``[..., T_local]`` -> ``[..., T]``: the group's slices concatenated along time, in rank
    order (padded to the longest slice for the ``all_gather``). Booleans travel as uint8 and
    float weights as float64 (exact); the values come back in their dtype."""
    import torch.distributed as dist

    if values is None:
        return None
    values = values.detach()
    dtype = values.dtype
    wire = values.to(torch.uint8) if dtype == torch.bool else values.to(torch.float64) if dtype.is_floating_point else values
    longest = max(lengths)
    padded = torch.nn.functional.pad(wire, (0, longest - wire.shape[-1])) if wire.shape[-1] < longest else wire.contiguous()
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded, group=group)
    full = torch.cat([part[..., :length] for part, length in zip(parts, lengths)], dim=-1)
    return full.to(dtype)


def _full_rows(
    group: Any, arrays: tuple[Optional[Tensor], ...], lead: tuple[int, ...], device: torch.device
) -> tuple[tuple[Optional[Tensor], ...], tuple[int, ...], Optional[_TimeWindow]]:
    """Under ``sequence_parallel`` the ``[..., T_local]`` ``arrays`` (labels, mask, ids) of the
    whole rows, the rows' leading shape and this rank's window; otherwise as given (window None)."""
    if group is None:
        return arrays, lead, None
    window, lengths = _time_window(group, lead[-1], device)
    return tuple(_gather_time(a, group, lengths) for a in arrays), lead[:-1] + (window.total,), window


def _denominator(config: LossConfig, denominator: Denominator, weight: Tensor, counted: Optional[Tensor], lead: tuple[int, ...], acc: torch.dtype) -> Union[Tensor, float]:
    """``D`` (``S`` for the sequence modes): the given one, else this call's own count."""
    if isinstance(denominator, Tensor):
        return denominator.detach().to(device=weight.device, dtype=acc).reshape(())
    if denominator is not None:
        return float(denominator)
    if config.normalization == "valid_tokens":
        return weight.sum()
    if config.normalization == "tokens":
        return float(lossspec.scored_positions(lead, config.causal_shift))
    if config.per_sequence:
        assert counted is not None
        return counted.sum().to(acc)
    return 1.0


def _coefficients(config: LossConfig, weight: Tensor, n: Optional[Tensor], denom: Union[Tensor, float]) -> Tensor:
    """``coef = where(D > 0, weight / D, 0)``; ``"sequence_mean"`` divides by ``n_s`` too
    (``w_t / (n_s D)``, 0 where ``w_t == 0``). The only place ``D`` and ``n_s`` enter: runtime data
    for the kernels. ``D == 0`` gives loss 0 and gradient 0."""
    if config.normalization == "sequence_mean":
        assert n is not None
        weight = torch.where(weight > 0, weight / torch.where(n > 0, n, 1.0), 0.0)
    if isinstance(denom, Tensor):
        return torch.where(denom > 0, weight / torch.where(denom > 0, denom, 1.0), 0.0)
    return weight / denom if denom > 0 else torch.zeros_like(weight)


def _prepare(call: _Call) -> _Prepared:
    config, logits = call.config, call.logits
    is_ce = config.has_labels
    lead = tuple(logits.shape[:-1])
    rows = math.prod(lead)
    acc = compute_dtype(logits.dtype)
    device = logits.device
    # Under sequence_parallel: the whole rows' labels, mask and ids (lossspec.sequences); the
    # coefficients are computed on them and this rank keeps its window.
    (labels, loss_mask, segment_ids), full_lead, window = _full_rows(
        call.sequence_parallel, (_labels_int64(call.target) if is_ce else None, call.loss_mask, call.segment_ids), lead, device
    )
    labels, loss_mask = _scored_targets(config.causal_shift, labels, loss_mask, full_lead, device)
    ids = _scored_segment_ids(config, segment_ids, full_lead, device)
    ignore_matches = _ignore_matches(call.target if is_ce else None, config.ignore_index)
    valid, weight = _weights(config, labels, loss_mask, full_lead, device, acc, ids, ignore_matches)
    float_mask = loss_mask is not None and loss_mask.dtype != torch.bool
    denominator = call.denominator
    if denominator is not None and not isinstance(denominator, Tensor) and torch.compiler.is_compiling():
        # Traced, a Python number that changes between calls is a symbolic float: reading it on
        # the host (the value check's np.asarray) would specialise the graph to each value (a
        # recompile per value, FailOnRecompileLimitHit under fullgraph=True). As a 0-d float64
        # tensor it is runtime data, checked on the device like a denominator tensor (NaN loss).
        denominator = torch.full((), denominator, dtype=torch.float64, device=device)
    # Value checks where they are free (SPEC section 5), in the oracle's order.
    if denominator is not None and (call.host or not isinstance(denominator, Tensor)):
        lossspec.check_denominator_value(_numpy(denominator) if isinstance(denominator, Tensor) else denominator)
    if call.host and float_mask:
        lossspec.check_weights(_numpy(loss_mask))
    in_range = None
    if labels is not None:
        in_range = (labels >= 0) & (labels < call.vocab)
        if call.host:
            host_labels = _numpy(labels)
            if call.target.dtype == _UINT64:
                host_labels = host_labels.view(np.uint64)  # the given values, not their int64 view
            lossspec.check_labels(host_labels, _numpy(valid), call.vocab, config.causal_shift)
    bad = None
    if not call.host:
        bad = torch.zeros((), dtype=torch.bool, device=device)
        if in_range is not None:
            bad = bad | (valid & ~in_range).any()
        if float_mask:
            bad = bad | _bad_weights(loss_mask)
    if config.normalization == "none":
        coef = weight
    else:
        n, counted = _sequence_count(weight, ids) if config.per_sequence else (None, None)  # type: ignore[arg-type]
        denom = _denominator(config, denominator, weight, counted, full_lead, acc)
        if isinstance(denom, Tensor) and isinstance(denominator, Tensor) and bad is not None:
            # the on-device twin of lossspec.check_denominator_value, on the value as given (a
            # float64 one below the float32 range must not pass as 0) and as used in float32
            given = denominator.detach().reshape(()).to(device)
            out_of_range = (given != 0) & ((given < lossspec.FP32_TINY) | (given > lossspec.FP32_MAX))
            bad = bad | ~torch.isfinite(denom) | ~(given >= 0) | out_of_range
        coef = _coefficients(config, weight, n, denom)
    if bad is not None:
        # A value that could not be checked on the host and is bad makes every coefficient NaN:
        # the loss and the whole gradient are NaN (as in JAX under jit), never a plausible
        # gradient that a step using only the gradient would train on.
        coef = torch.where(bad, float("nan"), coef)
    if window is not None:
        coef, valid = window.take(coef), window.take(valid)
        labels = None if labels is None else window.take(labels)
        in_range = None if in_range is None else window.take(in_range)
    vocab_local = int(logits.shape[-1])
    if is_ce:
        assert labels is not None and in_range is not None
        target = torch.where(valid & in_range, labels, 0).reshape(rows)
    else:
        # The teacher gets no gradient (entropy's stand-in is [..., 0]).
        target = call.target.detach().reshape(rows, int(call.target.shape[-1]))
        if target.stride(-1) != 1:
            target = target.contiguous()
    return _Prepared(target, coef.reshape(rows), bad)


# ----------------------------------------------------------------------------------------------
# 3. Apply, 4. finish
# ----------------------------------------------------------------------------------------------


def _apply(call: _Call, prepared: _Prepared) -> Tensor:
    """The loss through the kind's autograd Function (eager), or through the custom op
    ``torchloss::masked_loss`` while Dynamo traces (:mod:`torchloss._ops`); both run the same
    backend code. Compiled calls never carry ``inplace=True`` or a vocab-parallel backend
    (:func:`_loss_call` runs those eagerly)."""
    logits = call.logits
    x2d = logits.reshape(-1, logits.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if torch.compiler.is_compiling():
        return _ops.masked_loss(x2d, prepared.target, prepared.coef, call.config, _impl_name(call.backend), call.need_grad)
    function = _FUNCTIONS[call.config.kind]
    # The anchor ties a create_graph=True gradient to the logits (First order only, docs/DESIGN.md).
    anchor = second_order_anchor(x2d) if call.need_grad else None
    return function.apply(x2d, prepared.target, prepared.coef, call.config, call.backend, call.need_grad, call.inplace, anchor)


def _impl_name(backend: Any) -> str:
    """The ``impl`` name of a single-device backend module (what the custom op takes)."""
    if backend is _torch:
        return "torch"
    if getattr(backend, "__name__", "") == "torchloss._triton":
        return "triton"
    raise NotImplementedError(f"torchloss: no custom op for the backend {backend!r} (vocab_parallel runs eagerly)")


def _finish(call: _Call, prepared: _Prepared, loss: Tensor) -> Tensor:
    if prepared.bad is not None:
        loss = loss + torch.where(prepared.bad, float("nan"), 0.0).to(loss.dtype)
    if call.config.normalization == "none":
        return loss.reshape(call.logits.shape[:-1])
    return loss


def _masked_loss(kind: str, **args: Any) -> Tensor:
    """Body of the four public functions (their signatures: ``lossspec.KIND_SPECS``)."""
    spec = lossspec.KIND_SPECS[kind]
    options = {name: args[name] for name in spec.option_names}
    # jensen_shannon at beta = 0 / 1 is computed as forward / reverse KL, exactly (LossConfig.formula).
    config = lossspec.make_config(kind, normalization=args["normalization"], **options).kernel_config()
    target = args[spec.target] if spec.target is not None else None
    call = _validate(
        config,
        args["logits"],
        target,
        args["loss_mask"],
        args["segment_ids"],
        args["denominator"],
        args["vocab_parallel"],
        args["sequence_parallel"],
        args["impl"],
        args["inplace"],
    )
    prepared = _prepare(call)
    return _finish(call, prepared, _apply(call, prepared))


# ----------------------------------------------------------------------------------------------
# Public functions (SPEC section 3)
# ----------------------------------------------------------------------------------------------

FRAMEWORK_ARGS = lossspec.FrameworkArgs(
    (
        (
            "vocab_parallel",
            None,
            "a ``torch.distributed`` ``ProcessGroup`` over which the vocabulary is split, or ``None``. Each rank "
            "passes its contiguous shard ``logits[..., V_local]`` (shards in rank order, sizes may differ, each "
            ">= 1) and the *global* labels; the loss is the same on every rank and the gradient is the rank's own "
            "slice. Collectives are explicit ``all_reduce`` calls in the forward, so every rank of the group must "
            "make the call. ``D`` is not reduced over this group (same tokens).",
        ),
        (
            "sequence_parallel",
            None,
            "a ``torch.distributed`` ``ProcessGroup`` over which the time axis (the last leading axis) is split "
            "(context parallelism), or ``None``. Each rank passes its contiguous time slice (in rank order; lengths "
            "may differ) of the logits, labels, mask and ``segment_ids``; the ``[..., T]`` labels, mask and ids are "
            "all-gathered (never the logits) so that ``n_s``, ``D`` / ``S`` and the causal shift are those of the whole "
            "rows. The loss is this rank's share (sum it over the group for the whole rows' loss); the gradient is "
            "exact. Every rank of the group must make the call (lossspec.sequences).",
        ),
        ("impl", "auto", '``"auto"`` (Triton on CUDA tensors, the torch path elsewhere), ``"torch"`` or ``"triton"``.'),
        (
            "inplace",
            False,
            "write the gradient into the logits' buffer (logits must be the non-leaf output of an operation, "
            "contiguous, and not used elsewhere in the graph; see docs/torchloss.md).",
        ),
    )
)


_EAGER_UNDER_COMPILE = (
    "torchloss: a loss call with vocab_parallel= or sequence_parallel= (collectives made from Python) or inplace=True (writes the "
    "gradient into the logits' buffer, which a compiled graph cannot express) runs eagerly under torch.compile: "
    "one graph break, so fullgraph=True refuses it. Drop inplace=True / call the vocab-parallel loss outside "
    "the compiled region to keep one graph"
)


@torch.compiler.disable(reason=_EAGER_UNDER_COMPILE)
def _eager_loss_call(kind: str, **args: Any) -> Tensor:
    """:func:`_masked_loss` behind a graph break (see :data:`_EAGER_UNDER_COMPILE`)."""
    return _masked_loss(kind, **args)


def _loss_call(kind: str, **args: Any) -> Tensor:
    """Body of the public functions. Eagerly and under ``torch.compile`` alike:
    :func:`_masked_loss` (traced by Dynamo: the checks become guards and on-device flags, the
    kernel call the custom op of :mod:`torchloss._ops`), except that under ``torch.compile``
    calls with ``vocab_parallel=``, ``sequence_parallel=`` or ``inplace=True`` run eagerly behind a graph break."""
    collectives = args["vocab_parallel"] is not None or args["sequence_parallel"] is not None
    if torch.compiler.is_compiling() and (collectives or args["inplace"] is not False):
        return _eager_loss_call(kind, **args)
    return _masked_loss(kind, **args)


def _public(kind: str) -> Any:
    return lossspec.public_function(lossspec.KIND_SPECS[kind], FRAMEWORK_ARGS, _loss_call, __name__)


cross_entropy = _public("cross_entropy")
soft_cross_entropy = _public("soft_cross_entropy")
forward_kl = _public("forward_kl")
reverse_kl = _public("reverse_kl")
entropy = _public("entropy")
jensen_shannon = _public("jensen_shannon")


def count_denominator(
    labels: Optional[Tensor] = None,
    loss_mask: Optional[Tensor] = None,
    *,
    normalization: str = "valid_tokens",
    ignore_index: int = -100,
    causal_shift: bool = False,
    segment_ids: Optional[Tensor] = None,
    sequence_parallel: Any = None,
) -> Tensor:
    """The denominator ``D`` of one micro-batch as a 0-d fp32 tensor (SPEC sections 2 and 4).

    ``"valid_tokens"``: the sum of the weights of valid tokens (mask non-zero, segment id ``>= 0``
    and, when labels are given, label != ``ignore_index``); ``"tokens"``: the number of token
    positions; ``"sequence_mean"`` / ``"sequence_sum"``: ``S``, the number of sequences (rows, or
    ``(row, segment id)`` pairs) with a positive weight sum (``lossspec.sequences``). Counts add
    up over micro-batches and data-parallel replicas (``dist.all_reduce(D, SUM)``); pass the sum
    as ``denominator=`` to every micro-batch's loss. ``"sum"``/``"none"`` have no count (a
    ``ValueError``). Bad weights raise on CPU tensors and make ``D`` NaN elsewhere.
    ``causal_shift=True`` counts the positions the shifted losses score (``lossspec.causal``):
    ``labels[..., 1:]`` and ``loss_mask[..., 1:]`` (``"tokens"``: ``prod(lead[:-1]) * (T - 1)``),
    and the sequences of the scored segment ids (never across a document boundary).
    ``sequence_parallel``: the ``ProcessGroup`` splitting the time axis, as in the losses: the
    result is this rank's share (a sequence is counted by the rank holding its first scored
    position, a token by the rank holding it), so the shares add up over that group too
    (all-reduce over the data-parallel and sequence-parallel ranks together).
    """
    lossspec.accumulation.record("count_denominator", normalization, causal_shift)  # accumulate(check=...)
    if labels is not None:
        labels = _require_tensor("labels", labels)
    if loss_mask is not None:
        loss_mask = _require_tensor("loss_mask", loss_mask)
    if segment_ids is not None:
        segment_ids = _require_tensor("segment_ids", segment_ids)
    lossspec.check_count_args(
        normalization,
        None if labels is None else _meta(labels),
        None if loss_mask is None else _meta(loss_mask),
        causal_shift,
        None if segment_ids is None else _meta(segment_ids),
    )
    config = lossspec.make_config("cross_entropy", ignore_index=ignore_index, normalization=normalization, causal_shift=causal_shift)
    loss_mask = _broadcast_mask(loss_mask, tuple(next(t for t in (labels, segment_ids, loss_mask) if t is not None).shape))
    ref = next(t for t in (labels, loss_mask, segment_ids) if t is not None)
    device = ref.device
    _check_device("loss_mask", loss_mask, device)
    _check_device("segment_ids", segment_ids, device)
    if sequence_parallel is not None:
        _check_process_group(sequence_parallel, "sequence_parallel")
    lead = tuple(ref.shape)
    ignore_matches = _ignore_matches(labels, config.ignore_index)
    (labels, loss_mask, segment_ids), full_lead, window = _full_rows(
        sequence_parallel, (None if labels is None else _labels_int64(labels), loss_mask, segment_ids), lead, device
    )
    if normalization == "tokens":
        scored = torch.ones(full_lead, dtype=torch.float32, device=device)
        if causal_shift:  # the last position of each row is not scored
            scored = _shift_left(scored, 0.0)
        return (scored if window is None else window.take(scored)).sum()
    host = _host_readable(labels, loss_mask, segment_ids)
    float_mask = loss_mask is not None and loss_mask.dtype != torch.bool
    if host and float_mask:
        lossspec.check_weights(_numpy(loss_mask[..., 1:] if causal_shift else loss_mask))
    bad = _bad_weights(loss_mask[..., 1:] if causal_shift else loss_mask) if float_mask and not host else None
    labels, loss_mask = _scored_targets(causal_shift, labels, loss_mask, full_lead, device)
    ids = _scored_segment_ids(config, segment_ids, full_lead, device)
    _, weight = _weights(config, labels, loss_mask, full_lead, device, torch.float32, ids, ignore_matches)
    if config.per_sequence:
        _, counted = _sequence_count(weight, ids)  # type: ignore[arg-type]
        weight = counted.to(torch.float32)
    count = (weight if window is None else window.take(weight)).sum()
    if bad is not None:
        count = count + torch.where(bad, float("nan"), 0.0)
    return count
