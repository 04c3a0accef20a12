"""The losses as ``torch.library`` custom ops for ``torch.compile`` (no jaxloss twin: ``jax.jit`` traces api.py itself).

Eager calls go through the autograd Functions of :mod:`torchloss.api` (they hand the gradient
buffer to autograd without a copy, and ``inplace=True`` writes it into the logits); code traced
by Dynamo calls these ops instead, which the compiler sees as two opaque nodes with known output
shapes, so a compiled model keeps the loss in its graph (``fullgraph=True`` works). Both run
the same backend functions (the ``forward`` and ``regrad_`` of the impl's kernels, ``torchloss.backends``):
the numbers are the eager numbers.

Ops (``config`` is the :class:`lossspec.LossConfig` flattened into ``kind, normalization,
ignore_index, options``, see :func:`config_args`: the float options travel as the values of a
float64 tensor ``options`` :data:`OPTION_FIELDS` (``None`` as NaN), runtime data rather than
float arguments, which a graph would have to specialise to each value (an option that changes
every call would recompile every call); ``impl`` is ``"torch"`` or ``"triton"``; ``tuning`` is the :class:`lossspec.Tuning`
fields the torch backends read, :data:`TUNING_FIELDS`, as a list of ints (0 for ``None``),
constants of the graph like the kind: a new tuning recompiles, as a new kind does)::

    loss, grad, final = torchloss::masked_loss(logits [N, V], target, coef [N], *config, impl, need_grad, tuning)
        loss  = sum_i where(coef_i != 0, coef_i l_i, 0)   0-d (reduced modes) or [N] ("none"),
                in the compute dtype (fp32; fp64 for fp64 logits)
        grad  = coef * c * dl/dz  [N, V] in the logits' dtype, rounded once ([0, V] without
                need_grad)
        final = the rows' final statistics [len(lossspec.FINAL_STATS), N] in the compute dtype,
                where the impl's kernels keep them for the 16-bit backward (``KEEPS_FINAL``:
                Triton) and the gradient of 16-bit logits is computed; [0, N] otherwise
    torchloss::masked_loss_regrad_(logits, target, coef, upstream [1] or [N], grad, final, *config, impl, tuning)
        rewrites grad as the gradient for ``coef * upstream`` (formed in the compute dtype,
        rounded once): the backward of 16-bit logits.

Backward of ``masked_loss`` (``dlogits`` for the upstream gradient ``g`` of ``loss``):

- fp32 / fp64 logits: ``grad * g`` (``g`` a scalar, or per token ``g[:, None]`` for
  ``"none"``), the product the eager backward forms in place;
- bf16 / fp16 logits: ``masked_loss_regrad_`` with ``upstream = g``, i.e. the gradient
  recomputed from the saved logits (and ``final``: the Triton kernels then run the gradient pass
  alone) and ``coef * g`` and rounded once (SPEC section 6), as the eager backward does whenever
  ``g`` is not known to be exactly 1. Compiled code never knows
  (``g`` is a traced value), so it always recomputes; for ``g == 1`` the recomputation gives
  the forward's bits again.

Target and ``coef`` get no gradient (the teacher and the mask are data). First order only.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import Tensor

from lossspec import FINAL_STATS, LossConfig, Tuning

from .backends import IMPLEMENTATIONS
from ._block import compute_dtype

__all__ = ["CONFIG_FIELDS", "masked_loss", "config_args"]

# The LossConfig fields passed to the ops, in order: three primitives (str, str, int), then the
# float options (float or None) as one float64 tensor.
OPTION_FIELDS: tuple[str, ...] = (
    "label_smoothing",
    "z_loss",
    "logit_scale",
    "teacher_logit_scale",
    "temperature",
    "beta",
    "logit_softcap",
    "teacher_logit_softcap",
)
CONFIG_FIELDS: tuple[str, ...] = ("kind", "normalization", "ignore_index") + OPTION_FIELDS
# The lossspec.Tuning fields the torch path and the Triton kernels read (the ops' ``tuning``).
TUNING_FIELDS: tuple[str, ...] = ("vocab_block", "cpu_tile_elements", "num_warps", "num_stages", "programs")
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def config_args(config: LossConfig) -> tuple[Any, ...]:
    """``config`` as the ops' arguments ``(kind, normalization, ignore_index, options)``, with
    ``options`` the float64 CPU tensor of :data:`OPTION_FIELDS` (``None``, an absent soft cap, as
    NaN: a cap is finite). Traced by Dynamo, an option that changes between calls is a symbolic
    float that becomes the tensor's value: one graph for every value."""
    values = [float("nan") if getattr(config, name) is None else getattr(config, name) for name in OPTION_FIELDS]
    return config.kind, config.normalization, config.ignore_index, torch.tensor(values, dtype=torch.float64)


def tuning_args(tuning: Tuning) -> list[int]:
    """``tuning`` as the ops' ``tuning`` argument: its :data:`TUNING_FIELDS`, 0 for ``None`` (a
    set size is >= 1)."""
    return [getattr(tuning, name) or 0 for name in TUNING_FIELDS]


@functools.lru_cache(maxsize=64)
def _tuning(values: tuple[int, ...]) -> Tuning:
    """The :class:`lossspec.Tuning` of the ops' ``tuning`` argument (:func:`tuning_args`)."""
    return Tuning(**{name: value or None for name, value in zip(TUNING_FIELDS, values)})


def _config(kind: str, normalization: str, ignore_index: int, options: Tensor) -> LossConfig:
    """The :class:`LossConfig` of the ops' arguments (:func:`config_args`)."""
    values = [None if value != value else value for value in options.tolist()]  # NaN: None
    return _cached_config(kind, normalization, ignore_index, *values)


@functools.lru_cache(maxsize=256)
def _cached_config(*values: Any) -> LossConfig:
    """The :class:`LossConfig` of primitive values (validated once per value set)."""
    return LossConfig(**dict(zip(CONFIG_FIELDS, values)))


def _keeps_final(impl: str, logits: Tensor, need_grad: bool) -> bool:
    """Whether the forward fills a ``final`` buffer: the impl's kernels keep the final statistics
    (``KEEPS_FINAL``) and the gradient of 16-bit logits may be recomputed by the backward."""
    return need_grad and logits.dtype in _SIXTEEN_BIT and _backend(impl).KEEPS_FINAL


def _final_shape(impl: str, logits: Tensor, need_grad: bool) -> tuple[int, int]:
    return (len(FINAL_STATS) if _keeps_final(impl, logits, need_grad) else 0, logits.shape[0])


def _backend(impl: str) -> Any:
    """The loss kernels of ``impl``, a resolved name of :data:`torchloss.backends.IMPLEMENTATIONS`
    (``"auto"`` is resolved by the caller, so that eager and compiled calls pick the same one)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"torchloss ops take impl {' or '.join(map(repr, sorted(IMPLEMENTATIONS)))}; got {impl!r}")
    return IMPLEMENTATIONS[impl].kernels()


# ----------------------------------------------------------------------------------------------
# Forward: loss and gradient in one pass
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("torchloss::masked_loss", mutates_args=())
def _masked_loss_op(
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    kind: str,
    normalization: str,
    ignore_index: int,
    options: Tensor,
    impl: str,
    need_grad: bool,
    tuning: Optional[list[int]] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, grad, final)`` of one call (module docstring); the body of the eager Function's forward."""
    config = _config(kind, normalization, ignore_index, options)
    kernels = _backend(impl)
    final = logits.new_empty(_final_shape(impl, logits, need_grad), dtype=compute_dtype(logits.dtype))
    keep = {"final": final} if final.shape[0] else {}
    per_token, grad = kernels.forward(config, logits, target, coef, need_grad=need_grad, tuning=_tuning(tuple(tuning or ())), **keep)
    contribution = torch.where(coef != 0, coef * per_token, 0.0)
    loss = contribution.sum() if normalization != "none" else contribution
    if grad is None:
        grad = logits.new_empty((0, logits.shape[1]))
    return loss, grad, final


@_masked_loss_op.register_fake
def _masked_loss_fake(logits: Tensor, target: Tensor, coef: Tensor, kind: str, normalization: str, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Shapes and dtypes: loss ``[]`` or ``[N]`` in the compute dtype, grad ``[N, V]`` (or
    ``[0, V]`` without ``need_grad``) in the logits' dtype, final ``[len(FINAL_STATS), N]`` or
    ``[0, N]`` (:func:`_final_shape`) in the compute dtype."""
    impl, need_grad = args[2], args[3]  # after ignore_index, options
    rows, vocab = logits.shape
    acc = compute_dtype(logits.dtype)
    loss = logits.new_empty((), dtype=acc) if normalization != "none" else logits.new_empty((rows,), dtype=acc)
    grad = logits.new_empty((rows if need_grad else 0, vocab))
    return loss, grad, logits.new_empty(_final_shape(impl, logits, need_grad), dtype=acc)


# ----------------------------------------------------------------------------------------------
# The 16-bit backward: recompute the gradient for coef * upstream, rounded once
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("torchloss::masked_loss_regrad_", mutates_args=("grad",))
def _regrad_op(
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    upstream: Tensor,
    grad: Tensor,
    final: Tensor,
    kind: str,
    normalization: str,
    ignore_index: int,
    options: Tensor,
    impl: str,
    tuning: Optional[list[int]] = None,
) -> None:
    """Rewrite ``grad`` in place for ``coef * upstream`` (``backend.regrad_``, the eager
    backward's call), from the forward's ``final`` where it kept one (``[0, N]``: not kept)."""
    config = _config(kind, normalization, ignore_index, options)
    keep = {"final": final} if final.shape[0] else {}
    _backend(impl).regrad_(config, logits, target, coef, upstream, grad, tuning=_tuning(tuple(tuning or ())), **keep)


@_regrad_op.register_fake
def _regrad_fake(*args: Any) -> None:
    return None


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    logits, target, coef, kind, normalization, ignore_index, options, impl, need_grad, *rest = inputs
    _, grad, final = output
    ctx.config, ctx.impl, ctx.tuning = (kind, normalization, ignore_index), impl, (rest[0] if rest else None)
    ctx.reduced = normalization != "none"
    ctx.recompute = bool(need_grad) and logits.dtype in _SIXTEEN_BIT
    ctx.need_grad = bool(need_grad)
    if ctx.recompute:
        ctx.save_for_backward(grad, logits, target, coef, options, final)
    else:
        ctx.save_for_backward(grad)


def _backward(ctx: Any, grad_loss: Tensor, _grad_of_grad: Any, _grad_of_final: Any) -> tuple[Any, ...]:
    """``dlogits`` for the upstream gradient of ``loss`` (module docstring); no gradient for the
    target, ``coef`` and the primitive arguments."""
    nones = (None,) * (2 + 4 + 3)  # target, coef, the config's four, impl, need_grad, tuning
    if not ctx.need_grad:
        return (None, *nones)
    if ctx.recompute:
        grad, logits, target, coef, options, final = ctx.saved_tensors
        upstream = grad_loss.to(coef.dtype).reshape(-1)  # 1 value, or 1 per token
        grad = grad.clone()  # the saved buffer stays intact (the compiler may drop the copy)
        torch.ops.torchloss.masked_loss_regrad_(logits, target, coef, upstream, grad, final, *ctx.config, options, ctx.impl, ctx.tuning)
        return (grad, *nones)
    (grad,) = ctx.saved_tensors
    upstream = grad_loss if ctx.reduced else grad_loss.reshape(-1, 1)
    return (grad * upstream, *nones)


_masked_loss_op.register_autograd(_backward, setup_context=_setup_context)


def masked_loss(logits: Tensor, target: Tensor, coef: Tensor, config: LossConfig, impl: str, need_grad: bool, tuning: Tuning) -> Tensor:
    """The loss (0-d, or ``[N]`` for ``"none"``) through ``torchloss::masked_loss``: the
    compiled twin of ``torchloss._autodiff.MaskedLossFunction.apply``."""
    loss, _, _ = _masked_loss_op(logits, target, coef, *config_args(config), impl, need_grad, tuning_args(tuning))
    return loss
