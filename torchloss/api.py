"""Public functions of ``torchloss`` (SPEC section 3) and their autograd Functions.

Each call: validates its options and inputs with :mod:`lossspec` (the same errors and messages
as ``jaxloss`` and the oracle), builds the per-token weights and the gradient coefficient
``coef = weight / D`` (``weight`` for ``"none"``) in fp32, and runs one autograd Function whose
forward computes the loss *and* the gradient in one read of the logits (the torch path or the
Triton kernel); its backward multiplies that gradient by the upstream gradient in place (fp32/fp64
logits, and ``inplace=True``), or, for bf16/fp16 logits and an upstream gradient that is not
exactly 1, recomputes it from the saved inputs with ``coef`` times the upstream gradient, so that
it is rounded once (SPEC section 6).

Numbers: ``loss = sum_i w_i l_i / D`` (a 0-d fp32 tensor), or the per-token ``w_i l_i`` with the
labels' shape for ``normalization="none"``; ``dloss/dlogits = coef * c * dl/dz`` with
``c = logit_scale / temperature``, rounded once to the logits' dtype. fp64 logits are computed
(and the loss returned) in fp64.
"""

from __future__ import annotations

import math
import numbers
from types import ModuleType
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

import lossspec
from lossspec import LossConfig

from . import _torch

__all__ = [
    "cross_entropy",
    "soft_cross_entropy",
    "forward_kl",
    "reverse_kl",
    "count_denominator",
    "CrossEntropyFunction",
    "SoftCrossEntropyFunction",
    "ForwardKLFunction",
    "ReverseKLFunction",
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
    ``inplace``) the forward also saves ``logits``, ``target`` and ``coef``, and a non-unit
    upstream gradient rewrites the buffer from them instead (:func:`_recomputed_grad`): one
    rounding, as SPEC section 6 requires. With ``inplace=True`` the logits are gone and the
    16-bit buffer is scaled (at most one more rounding, documented). The backward is not
    differentiable itself (``once_differentiable``: no double backward).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        coef: Tensor,
        config: LossConfig,
        backend: ModuleType,
        need_grad: bool,
        inplace: bool,
    ) -> Tensor:
        per_token, grad = backend.forward(
            config, logits, target, coef, need_grad=need_grad, out=logits if (inplace and need_grad) else None
        )
        if inplace and need_grad:
            # The Triton kernel writes behind autograd's back: bump the version counter so that
            # any other use of these logits in the graph fails loudly instead of reading garbage.
            torch.autograd.graph.increment_version(logits)
        ctx.grad = grad
        ctx.reduced = config.normalization != "none"
        # 16-bit logits: a non-unit upstream gradient makes backward recompute the gradient from
        # the saved inputs (rounded once from fp32), which inplace=True has overwritten.
        ctx.recompute = need_grad and not inplace and logits.dtype in (torch.bfloat16, torch.float16)
        if ctx.recompute:
            ctx.config, ctx.backend = config, backend
            ctx.save_for_backward(logits, target, coef)
        contribution = torch.where(coef != 0, coef * per_token, 0.0)
        return contribution.sum() if ctx.reduced else contribution

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad = ctx.grad
        if ctx.recompute:
            return (_recomputed_grad(ctx, grad_loss), None, None, None, None, None, None)
        # Scalar or per-token upstream gradient, multiplied in the compute dtype, rounded once.
        upstream = grad_loss if ctx.reduced else grad_loss.reshape(-1, 1)
        if _graph_is_kept():
            # retain_graph=True / gradcheck: another backward may follow, keep our buffer intact.
            return grad * upstream, None, None, None, None, None, None
        # The graph is freed after this call: scale the buffer in place and drop our reference,
        # so that autograd takes it as the gradient without a copy (no second [N, V] buffer).
        ctx.grad = None
        if _is_unit(upstream):
            pass  # loss.backward(): multiplying by exactly 1 would change no bit, skip the pass
        elif ctx.reduced:
            grad.mul_(upstream)
        else:
            _torch.scale_rows_(grad, upstream)
        return grad, None, None, None, None, None, None


def _recomputed_grad(ctx: Any, grad_loss: Tensor) -> Tensor:
    """The gradient of 16-bit logits for the upstream gradient ``g``: ``coef * g * c * dl/dz``
    formed in fp32 and rounded once (scaling the forward's already rounded buffer would round
    twice, beyond SPEC section 6's one ulp).

    ``g == 1`` (``loss.backward()``) is the forward's buffer as it is. Where that is known for free
    (a CPU tensor) the buffer is handed out; otherwise ``backend.regrad_`` rewrites the buffer
    from the saved logits, target and ``coef * g`` without a host synchronisation: the Triton
    kernel reads ``g`` on the device and leaves the rows with ``g == 1`` alone, the torch path
    recomputes every row. With ``retain_graph=True`` a copy is rewritten instead.
    """
    grad = ctx.grad
    if not _graph_is_kept():
        ctx.grad = None  # the graph is freed after this call: hand our buffer out, no copy
    elif grad is not None:
        grad = grad.clone()
    logits, target, coef = ctx.saved_tensors
    upstream = grad_loss.detach().to(coef.dtype).reshape(-1)  # 1 value, or 1 per token
    if _is_unit(upstream):
        return grad
    return ctx.backend.regrad_(ctx.config, logits, target, coef, upstream, grad)


def _is_unit(upstream: Tensor) -> bool:
    """Whether the upstream gradient is exactly 1, asked only where the answer is free: a CPU
    tensor outside tracing (no device to synchronise with). Elsewhere the multiplication runs."""
    if upstream.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return bool(torch.all(upstream == 1))


def _graph_is_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); True if unknown.

    The same private query AOTAutograd makes before freeing saved tensors in its backward."""
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


_FUNCTIONS: dict[str, type[_MaskedLossFunction]] = {
    f.kind: f for f in (CrossEntropyFunction, SoftCrossEntropyFunction, ForwardKLFunction, ReverseKLFunction)
}


# ----------------------------------------------------------------------------------------------
# Argument handling
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


def _host_readable(*tensors: Tensor | None) -> bool:
    """Values can be read without a device synchronisation: CPU tensors, outside tracing."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _numpy(tensor: Tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()  # numpy has no bfloat16; the conversion is exact
    return tensor.numpy()


def _check_device(name: str, tensor: Tensor | None, device: torch.device) -> None:
    if tensor is not None and tensor.device != device:
        raise ValueError(f"{name} must be on the device of logits ({device}); got {tensor.device}")


def _resolve_impl(impl: str, logits: Tensor) -> ModuleType:
    lossspec.check_impl(impl, lossspec.TORCH_IMPLS)
    if impl == "auto":
        impl = "triton" if logits.is_cuda else "torch"
    if impl == "torch":
        return _torch
    try:
        from . import _triton
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError(
            "impl='triton' needs the triton package (pip install triton); impl='torch' works without it"
        ) from err
    return _triton


def _check_process_group(group: Any) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            "vocab_parallel must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD or dist.new_group(...)); "
            f"got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError("vocab_parallel needs an initialised default process group (dist.init_process_group)")


def _denominator_tensor(denominator: Denominator, acc: torch.dtype, device: torch.device) -> Tensor | float:
    if isinstance(denominator, Tensor):
        return denominator.detach().to(device=device, dtype=acc).reshape(())
    assert denominator is not None
    return float(denominator)


def _masked_loss(
    config: LossConfig,
    logits: Any,
    target: Any,
    loss_mask: Any,
    denominator: Denominator,
    vocab_parallel: Any,
    impl: str,
    inplace: bool,
) -> Tensor:
    """Validate, build weights and ``coef``, run the kind's autograd Function.

    The public functions are ``torch.compiler.disable``d: under ``torch.compile`` each loss call
    is one graph break and runs eagerly (its own kernels are already fused, and its Python-level
    checks would break the graph anyway); everything before and after it compiles.
    """
    is_ce = config.kind == "cross_entropy"
    target_name = "labels" if is_ce else "teacher_logits"
    lossspec.check_impl(impl, lossspec.TORCH_IMPLS)
    logits = _require_tensor("logits", logits)
    target = _require_tensor(target_name, target)
    if loss_mask is not None:
        loss_mask = _require_tensor("loss_mask", loss_mask)
    lossspec.check_inputs(config, _meta(logits), _meta(target), None if loss_mask is None else _meta(loss_mask))
    lossspec.check_denominator_allowed(config, denominator)
    if isinstance(denominator, Tensor):
        lossspec.check_denominator_shape(tuple(denominator.shape))
    elif denominator is not None and (isinstance(denominator, bool) or not isinstance(denominator, numbers.Real)):
        raise TypeError(f"denominator must be a number or a 0-d tensor; got {type(denominator).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool; got {type(inplace).__name__}")
    device = logits.device
    _check_device(target_name, target, device)
    _check_device("loss_mask", loss_mask, device)
    if isinstance(denominator, Tensor) and denominator.device != device and denominator.device.type != "cpu":
        raise ValueError(f"denominator must be on the device of logits ({device}) or the CPU; got {denominator.device}")
    backend: Any = _resolve_impl(impl, logits)

    lead, vocab = tuple(logits.shape[:-1]), int(logits.shape[-1])
    width = vocab  # this call's own vocabulary entries (the shard's, for vocab-parallel)
    offset = 0
    if vocab_parallel is not None:
        # Vocab-parallel (SPEC section 3): this rank holds the global ids [offset, offset + V_local).
        # The kernel (torch path, or Triton's statistics / gradient modes) runs the two passes of
        # the shard; the collectives in between are explicit all_reduce calls (_torch.combine_shards).
        _check_process_group(vocab_parallel)
        offset, vocab = _torch.shard_offset(vocab, vocab_parallel, device)
        backend = _torch.VocabParallel(vocab_parallel, offset, vocab, kernel=None if backend is _torch else backend)
    rows = math.prod(lead)
    acc = _torch.compute_dtype(logits.dtype)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    if inplace and need_grad:
        if logits.is_leaf:
            raise ValueError(
                "inplace=True writes the gradient into the logits' buffer, so logits must be the output of an "
                "operation (e.g. the LM head), not a leaf tensor that requires grad"
            )
        if not logits.is_contiguous():
            raise ValueError("inplace=True needs contiguous logits (their buffer receives the gradient)")

    # Valid tokens and weights (DESIGN.md): valid = mask != 0 [& label != ignore_index].
    labels = target.to(torch.int64) if is_ce else None
    valid = torch.ones(lead, dtype=torch.bool, device=device)
    if loss_mask is not None:
        valid = valid & (loss_mask != 0)
    if labels is not None:
        valid = valid & (labels != config.ignore_index)
    float_mask = loss_mask is not None and loss_mask.dtype != torch.bool
    weight = torch.where(valid, loss_mask.detach().to(acc), 0.0) if float_mask else valid.to(acc)

    # Value checks where they are free (SPEC section 5), in the oracle's order; elsewhere a bad
    # value turns the loss into NaN below (no device synchronisation).
    host = _host_readable(logits, target, loss_mask, denominator if isinstance(denominator, Tensor) else None)
    if denominator is not None and (host or not isinstance(denominator, Tensor)):
        lossspec.check_denominator_value(_numpy(denominator) if isinstance(denominator, Tensor) else denominator)
    if host and float_mask:
        lossspec.check_weights(_numpy(loss_mask))
    in_range = None
    if labels is not None:
        in_range = (labels >= 0) & (labels < vocab)
        if host:
            lossspec.check_labels(_numpy(labels), _numpy(valid), vocab)
    bad = None
    if not host:
        bad = torch.zeros((), dtype=torch.bool, device=device)
        if in_range is not None:
            bad = bad | (valid & ~in_range).any()
        if float_mask:
            w = loss_mask.detach()
            bad = bad | (~torch.isfinite(w) | (w < 0)).any()
    safe_labels = torch.where(valid & in_range, labels, 0) if labels is not None and in_range is not None else None

    # Denominator and per-token coefficient: the only place D enters (DESIGN.md).
    if config.normalization == "none":
        coef = weight
    else:
        if denominator is not None:
            denom: Tensor | float = _denominator_tensor(denominator, acc, device)
        elif config.normalization == "valid_tokens":
            denom = weight.sum()
        elif config.normalization == "tokens":
            denom = float(rows)
        else:
            denom = 1.0
        if isinstance(denom, Tensor):
            coef = torch.where(denom > 0, weight / denom, 0.0)
            if bad is not None and denominator is not None:
                bad = bad | ~torch.isfinite(denom) | (denom < 0)
        else:
            coef = weight / denom if denom > 0 else torch.zeros_like(weight)

    x2d = logits.reshape(rows, width)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if is_ce:
        assert safe_labels is not None
        tgt = safe_labels.reshape(rows)
    else:
        tgt = target.detach().reshape(rows, width)  # the teacher gets no gradient
        if tgt.stride(-1) != 1:
            tgt = tgt.contiguous()
    loss = _FUNCTIONS[config.kind].apply(x2d, tgt, coef.reshape(rows), config, backend, need_grad, inplace)
    if bad is not None:
        loss = loss + torch.where(bad, float("nan"), 0.0).to(loss.dtype)
    return loss if config.normalization != "none" else loss.reshape(lead)


# ----------------------------------------------------------------------------------------------
# Public functions (SPEC section 3)
# ----------------------------------------------------------------------------------------------


@torch.compiler.disable
def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    loss_mask: Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_scale: float = 1.0,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    vocab_parallel: Any = None,
    impl: str = "auto",
    inplace: bool = False,
) -> Tensor:
    """Masked cross-entropy with label smoothing and z-loss.

    Per token, with ``z = logit_scale * x``, ``lse = log sum_v exp(z_v)``, ``q = softmax(z)``::

        l = lse - (1 - eps) z_y - (eps / V) sum_v z_v + lam lse^2
        dl/dz = (1 + 2 lam lse) q - (1 - eps) onehot(y) - eps / V

    Args:
      logits: ``[..., V]`` float (fp32/bf16/fp16, or fp64 computed in fp64).
      labels: ``[...]`` integer; labels of invalid tokens are never read as indices.
      loss_mask: ``[...]`` bool or float weights ``>= 0``, or ``None``.
      ignore_index: label value of ignored tokens.
      label_smoothing: ``eps`` in ``[0, 1]``.
      z_loss: ``lam >= 0``.
      logit_scale: ``> 0``, multiplies the logits before the softmax.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``.
      denominator: the global ``D`` (number or 0-d tensor, ``>= 0``) overriding ``D`` of the
        reduced modes (``"valid_tokens"``, ``"tokens"``, ``"sum"``); ``None`` counts this call's
        own tokens (``D = 1`` for ``"sum"``). Not accepted with ``"none"``.
      vocab_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the vocabulary is split,
        or ``None``. Each rank passes its contiguous shard ``logits[..., V_local]`` (shards in rank
        order, sizes may differ, each ``>= 1``) and the *global* labels; the returned loss is the
        same on every rank and the gradient is the rank's own slice. Collectives are explicit
        ``all_reduce`` calls in the forward (never autograd through a collective), so every rank
        of the group must make the call. ``D`` is not reduced over this group (same tokens).
      impl: ``"auto"`` (Triton on CUDA tensors, the torch path elsewhere), ``"torch"`` or
        ``"triton"``.
      inplace: write the gradient into the logits' buffer (see the README for the constraints).

    Returns:
      The loss ``sum_i w_i l_i / D``, a 0-d fp32 tensor; or ``[...]`` per-token ``w_i l_i``
      for ``"none"`` (0 at masked tokens).
    """
    config = lossspec.make_config(
        "cross_entropy",
        normalization=normalization,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        logit_scale=logit_scale,
    )
    return _masked_loss(config, logits, labels, loss_mask, denominator, vocab_parallel, impl, inplace)


def _distill(
    kind: str,
    logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Tensor | None,
    temperature: float,
    logit_scale: float,
    teacher_logit_scale: float,
    normalization: str,
    denominator: Denominator,
    vocab_parallel: Any,
    impl: str,
    inplace: bool,
) -> Tensor:
    config = lossspec.make_config(
        kind,
        normalization=normalization,
        temperature=temperature,
        logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale,
    )
    return _masked_loss(config, logits, teacher_logits, loss_mask, denominator, vocab_parallel, impl, inplace)


_DISTILL_ARGS = """
    Notation: ``z = logit_scale * x / T``, ``q = softmax(z)`` (student),
    ``p = softmax(teacher_logit_scale * t / T)`` (teacher, no gradient), ``T = temperature``
    (no ``T**2`` factor: multiply the loss by ``T**2`` for Hinton's scaling).

    Args:
      logits: student ``[..., V]`` float.
      teacher_logits: ``[..., V]`` float, same shape; gets no gradient.
      loss_mask: ``[...]`` bool or float weights ``>= 0``, or ``None``.
      temperature, logit_scale, teacher_logit_scale: ``> 0``.
      normalization, denominator, vocab_parallel, impl, inplace: as in :func:`cross_entropy`.

    Returns:
      ``sum_i w_i l_i / D`` (0-d fp32), or per-token ``w_i l_i`` ``[...]`` for ``"none"``.
"""


@torch.compiler.disable
def soft_cross_entropy(
    logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    vocab_parallel: Any = None,
    impl: str = "auto",
    inplace: bool = False,
) -> Tensor:
    return _distill(
        "soft_cross_entropy", logits, teacher_logits, loss_mask, temperature, logit_scale, teacher_logit_scale,
        normalization, denominator, vocab_parallel, impl, inplace,
    )


@torch.compiler.disable
def forward_kl(
    logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    vocab_parallel: Any = None,
    impl: str = "auto",
    inplace: bool = False,
) -> Tensor:
    return _distill(
        "forward_kl", logits, teacher_logits, loss_mask, temperature, logit_scale, teacher_logit_scale,
        normalization, denominator, vocab_parallel, impl, inplace,
    )


@torch.compiler.disable
def reverse_kl(
    logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    vocab_parallel: Any = None,
    impl: str = "auto",
    inplace: bool = False,
) -> Tensor:
    return _distill(
        "reverse_kl", logits, teacher_logits, loss_mask, temperature, logit_scale, teacher_logit_scale,
        normalization, denominator, vocab_parallel, impl, inplace,
    )


soft_cross_entropy.__doc__ = (
    "Masked soft cross-entropy against a teacher: ``l = lse - sum_v p_v z_v``, ``dl/dz = q - p``.\n" + _DISTILL_ARGS
)
forward_kl.__doc__ = (
    "Masked forward KL(p || q): ``l = sum_v p_v (log p_v - log q_v)``, ``dl/dz = q - p``.\n" + _DISTILL_ARGS
)
reverse_kl.__doc__ = (
    "Masked reverse KL(q || p): ``l = sum_v q_v (log q_v - log p_v)``, ``dl/dz = q (log q - log p - l)``.\n"
    + _DISTILL_ARGS
)


@torch.compiler.disable
def count_denominator(
    labels: Tensor | None = None,
    loss_mask: Tensor | None = None,
    *,
    normalization: str = "valid_tokens",
    ignore_index: int = -100,
) -> Tensor:
    """The denominator ``D`` of one micro-batch as a 0-d fp32 tensor (SPEC sections 2 and 4).

    ``"valid_tokens"``: the sum of the weights of valid tokens (mask non-zero and, when labels
    are given, label != ``ignore_index``); ``"tokens"``: the number of token positions. Counts add
    up over micro-batches and data-parallel replicas (``dist.all_reduce(D, SUM)``); pass the sum
    as ``denominator=`` to every micro-batch's loss. ``"sum"``/``"none"`` have no count (a
    ``ValueError``). Negative or non-finite weights raise on CPU tensors and make ``D`` NaN
    elsewhere.
    """
    if labels is not None:
        labels = _require_tensor("labels", labels)
    if loss_mask is not None:
        loss_mask = _require_tensor("loss_mask", loss_mask)
    lossspec.check_count_args(
        normalization, None if labels is None else _meta(labels), None if loss_mask is None else _meta(loss_mask)
    )
    config = lossspec.make_config("cross_entropy", ignore_index=ignore_index)
    ref = labels if labels is not None else loss_mask
    assert ref is not None
    device = ref.device
    _check_device("loss_mask", loss_mask if labels is not None else None, device)
    if normalization == "tokens":
        return torch.tensor(float(ref.numel()), dtype=torch.float32, device=device)
    float_mask = loss_mask is not None and loss_mask.dtype != torch.bool
    host = _host_readable(labels, loss_mask)
    if host and float_mask:
        lossspec.check_weights(_numpy(loss_mask))
    valid = torch.ones(ref.shape, dtype=torch.bool, device=device)
    if loss_mask is not None:
        valid = valid & (loss_mask != 0)
    if labels is not None:
        valid = valid & (labels.to(torch.int64) != config.ignore_index)
    weight = torch.where(valid, loss_mask.detach().to(torch.float32), 0.0) if float_mask else valid.to(torch.float32)
    count = weight.sum()
    if float_mask and not host:
        w = loss_mask.detach()
        count = count + torch.where((~torch.isfinite(w) | (w < 0)).any(), float("nan"), 0.0)
    return count
