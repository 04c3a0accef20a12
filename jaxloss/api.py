"""Public functions of ``jaxloss`` (SPEC section 3) and their argument handling.

Every function computes, per token ``i`` of the flattened leading shape, the loss ``l_i`` of
its kind (SPEC section 1) and returns ``sum_i w_i l_i / D`` (fp32 scalar) or, for
``normalization="none"``, the per-token ``w_i l_i`` with the labels' shape (SPEC section 2).

Flow of one call:

1. options -> :func:`lossspec.make_config`, shapes/dtypes -> :func:`lossspec.check_inputs`;
   value checks (labels in range, weights, denominator) only for concrete inputs (not JAX
   tracers), so un-traced calls raise and traced ones stay free of host synchronisation;
2. ``_prepare`` (jitted): ``valid``, fp32 ``weight``, ``D`` and the per-token coefficient
   ``coef = where(D > 0, weight / D, 0)`` (``weight`` for ``"none"``), the safe labels
   ``where(valid, labels, 0)`` and a flag for bad values seen under tracing;
3. ``_tokens`` (jitted ``custom_vjp``): the kernel (XLA or Pallas) computes the per-token loss
   and, in the same pass, ``grad = coef * c * dl/dz`` in the logits' dtype, the only residual;
   the backward multiplies it by the upstream gradient. The kernel is compiled per kind,
   options, shapes and impl, never per normalisation or denominator;
4. ``_finish`` (jitted): sum or reshape; NaN when a traced call saw a bad value.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import lossspec
from lossspec import LossConfig

from . import _pallas, _vocab_parallel, _xla
from ._xla import KernelConfig

Array = jax.Array
F32 = jnp.float32
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

__all__ = ["cross_entropy", "soft_cross_entropy", "forward_kl", "reverse_kl", "count_denominator", "resolve_impl"]


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _masked_loss(kind: str, **args: Any) -> Array:
    """Body of the four public functions (their signatures: ``lossspec.KIND_SPECS``)."""
    spec = lossspec.KIND_SPECS[kind]
    options = {name: args[name] for name in spec.option_names}
    config = lossspec.make_config(kind, normalization=args["normalization"], **options)
    return _loss(config, args["logits"], args[spec.target], args["loss_mask"], args["denominator"], args["vocab_parallel"], args["impl"])


FRAMEWORK_ARGS = lossspec.FrameworkArgs(
    (
        (
            "vocab_parallel",
            None,
            "``None``, or the mesh axis name (or a tuple of names) over which the vocabulary is split, "
            "inside ``shard_map`` / ``pmap``: ``logits`` is this replica's contiguous slice ``[..., V_local]`` "
            "(shards in axis-index order, ``V = V_local * P``), labels are global ids. The loss is the same on "
            "every replica and the gradient is the replica's slice; the statistics are combined with explicit "
            "collectives.",
        ),
        ("impl", "auto", '``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``.'),
    )
)


def _public(kind: str) -> Any:
    return lossspec.public_function(lossspec.KIND_SPECS[kind], FRAMEWORK_ARGS, _masked_loss, __name__)


cross_entropy = _public("cross_entropy")
soft_cross_entropy = _public("soft_cross_entropy")
forward_kl = _public("forward_kl")
reverse_kl = _public("reverse_kl")


def count_denominator(
    labels: Any = None,
    loss_mask: Any = None,
    *,
    normalization: str = "valid_tokens",
    ignore_index: int = -100,
) -> Array:
    """The denominator ``D`` of one (micro-)batch as an fp32 scalar array (SPEC section 4).

    ``"valid_tokens"``: sum of the weights of valid tokens (mask non-zero and, when labels
    are given, label ``!= ignore_index``); ``"tokens"``: the number of token positions.
    Counts add up over micro-batches and data-parallel replicas (``jax.lax.psum``).
    ``"sum"`` and ``"none"`` have no count and raise ``ValueError``.
    """
    labels = None if labels is None else _as_array(labels)
    loss_mask = None if loss_mask is None else _as_array(loss_mask)
    lossspec.check_count_args(
        normalization,
        None if labels is None else _meta(labels),
        None if loss_mask is None else _meta(loss_mask),
    )
    if loss_mask is not None and _concrete(loss_mask):
        lossspec.check_weights(np.asarray(loss_mask))
    ref = labels if labels is not None else loss_mask
    if normalization == "tokens":
        return jnp.asarray(float(np.prod(ref.shape, dtype=np.int64)), F32)
    config = LossConfig(kind="cross_entropy", ignore_index=int(ignore_index))
    return _count(config, _device(labels) if labels is not None else None, _device(loss_mask) if loss_mask is not None else None)


def resolve_impl(impl: str) -> str:
    """``"auto"`` -> ``"pallas"`` on a GPU backend, else ``"xla"``; other values unchanged."""
    lossspec.check_impl(impl, lossspec.JAX_IMPLS)
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


# --------------------------------------------------------------------------------------------
# Argument handling
# --------------------------------------------------------------------------------------------


def _as_array(value: Any) -> Any:
    """Arrays (NumPy, JAX, tracers) stay as they are; anything else becomes a JAX array."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return value
    return jnp.asarray(value)


def _dtype_kind(dtype: Any) -> str:
    """NumPy's ``dtype.kind``, but ``"f"`` for bfloat16 and the other ml_dtypes floats (whose
    NumPy kind is ``"V"``)."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return "f"
    if dtype == np.bool_:
        return "b"
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return "i"
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return "u"
    return dtype.kind


def _meta(array: Any) -> lossspec.ArrayMeta:
    return lossspec.meta(array.shape, _dtype_kind(array.dtype), np.dtype(array.dtype).name)


def _concrete(value: Any) -> bool:
    """Whether reading the value costs no tracing break: not a tracer, and fully on this host."""
    if isinstance(value, jax.core.Tracer):
        return False
    return bool(getattr(value, "is_fully_addressable", True))


def _device(value: Any) -> Any:
    """NumPy inputs become JAX arrays (int64 labels narrow to int32 without x64)."""
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return jnp.asarray(value)
    return value


def _loss(
    config: LossConfig,
    logits: Any,
    target: Any,
    loss_mask: Any,
    denominator: Any,
    vocab_parallel: Any,
    impl: str,
) -> Array:
    impl = resolve_impl(impl)
    logits = _as_array(logits)
    target = _as_array(target)
    loss_mask = None if loss_mask is None else _as_array(loss_mask)
    lossspec.check_inputs(config, _meta(logits), _meta(target), None if loss_mask is None else _meta(loss_mask))
    lossspec.check_denominator_allowed(config, denominator)
    if denominator is not None:
        denominator = _as_array(denominator)
        lossspec.check_denominator_shape(tuple(denominator.shape))
        if _concrete(denominator):
            lossspec.check_denominator_value(np.asarray(denominator))
        # Always the same abstract value (fp32, not weak): any number reuses one compilation.
        denominator = jnp.asarray(denominator, F32).reshape(())
    if loss_mask is not None and _concrete(loss_mask):
        lossspec.check_weights(np.asarray(loss_mask))
    lead, vocab = tuple(logits.shape[:-1]), int(logits.shape[-1])
    axes = None
    if vocab_parallel is not None:
        axes = _vocab_parallel.axis_names(vocab_parallel)
        vocab = vocab * _vocab_parallel.axis_size(axes)  # the global V (labels are global ids)
    if config.kind == "cross_entropy" and _concrete(target) and (loss_mask is None or _concrete(loss_mask)):
        labels_host = np.asarray(target)
        mask_host = None if loss_mask is None else np.asarray(loss_mask)
        valid, _ = lossspec.token_weights(config, labels_host, mask_host, lead)
        lossspec.check_labels(labels_host, valid, vocab)
        if isinstance(target, np.ndarray) and _INT32_MIN <= config.ignore_index <= _INT32_MAX:
            # Masked labels may hold any value, also one outside int32 (x64 off): never send
            # them. ignore_index keeps the tokens it masks invalid on the device side.
            target = np.where(valid, labels_host, config.ignore_index)
    if config.kind != "cross_entropy":
        target = jax.lax.stop_gradient(_device(target))
    # Only what the coefficients depend on is static here: a new option value (label
    # smoothing, temperature, ...) does not recompile this part.
    counting = LossConfig(kind=config.kind, normalization=config.normalization, ignore_index=config.ignore_index)
    coef, safe_target, bad = _prepare(
        counting,
        vocab,
        _device(target),
        None if loss_mask is None else _device(loss_mask),
        None if denominator is None else _device(denominator),
    )
    kcfg = KernelConfig(
        kind=config.kind,
        scale=config.student_scale,
        teacher_scale=config.teacher_scale,
        label_smoothing=config.label_smoothing,
        z_loss=config.z_loss,
    )
    tuning = _xla.TUNING if impl == "xla" else _pallas.TUNING
    if axes is None:
        tokens = _tokens((kcfg, impl, tuning), _device(logits), safe_target, coef)
    else:
        tokens = _tokens_vocab_parallel((kcfg, impl, tuning, axes, vocab), _device(logits), safe_target, coef)
    return _finish(config.normalization, lead, tokens, bad)


# --------------------------------------------------------------------------------------------
# Traced pieces
# --------------------------------------------------------------------------------------------


def _labels_int(labels: Array) -> Array:
    """Labels in a signed type wide enough to compare with ``ignore_index`` (int32, or
    int64 under x64)."""
    if labels.dtype == jnp.int64:
        return labels
    return labels.astype(jnp.int32)


def _weights(config: LossConfig, labels: Optional[Array], loss_mask: Optional[Array], lead: tuple[int, ...]) -> tuple[Array, Array, Array]:
    """``(valid, weight, bad_weight)``: valid tokens, fp32 weights (0 where invalid), and
    whether any weight is negative or non-finite (under tracing: makes the loss NaN)."""
    valid = jnp.ones(lead, bool)
    weight = jnp.ones(lead, F32)
    bad = jnp.zeros((), bool)
    if loss_mask is not None:
        valid = loss_mask != 0
        weight = loss_mask.astype(F32)
        if loss_mask.dtype != jnp.bool_:
            bad = jnp.any(~(jnp.isfinite(weight) & (weight >= 0)))
    if labels is not None:
        valid = valid & (_labels_int(labels) != config.ignore_index)
    return valid, jnp.where(valid, weight, 0.0), bad


@functools.partial(jax.jit, static_argnums=(0,))
def _count(config: LossConfig, labels: Optional[Array], loss_mask: Optional[Array]) -> Array:
    lead = (labels if labels is not None else loss_mask).shape
    _, weight, bad = _weights(config, labels, loss_mask, lead)
    return jnp.sum(weight) + jnp.where(bad, jnp.nan, 0.0)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _prepare(
    config: LossConfig, vocab: int, target: Array, loss_mask: Optional[Array], denominator: Optional[Array]
) -> tuple[Array, Array, Array]:
    """``(coef [N], target, bad)``: the per-token coefficient, the safe target (labels 0 where
    invalid, int32, flattened; teacher ``[N, V]``) and the bad-value flag."""
    ce = config.kind == "cross_entropy"
    lead = target.shape if ce else target.shape[:-1]
    n = int(np.prod(lead, dtype=np.int64))
    valid, weight, bad = _weights(config, target if ce else None, loss_mask, lead)
    if ce:
        labels = _labels_int(target)
        bad = bad | jnp.any(valid & ((labels < 0) | (labels >= vocab)))
        target = jnp.where(valid, labels, 0).astype(jnp.int32).reshape(n)
    else:
        target = target.reshape(n, target.shape[-1])  # this replica's slice under vocab_parallel
    weight = weight.reshape(n)
    if config.normalization == "none":
        return weight, target, bad
    if denominator is not None:
        denom = jnp.asarray(denominator, F32).reshape(())
        bad = bad | ~(jnp.isfinite(denom) & (denom >= 0))
    elif config.normalization == "valid_tokens":
        denom = jnp.sum(weight)
    elif config.normalization == "tokens":
        denom = jnp.asarray(float(n), F32)
    else:  # "sum"
        denom = jnp.ones((), F32)
    # The only place D enters: runtime data for the kernels. D == 0 gives loss 0, grad 0.
    coef = jnp.where(denom > 0, weight / jnp.where(denom > 0, denom, 1.0), 0.0)
    return coef, target, bad


@functools.partial(jax.jit, static_argnums=(0, 1))
def _finish(normalization: str, lead: tuple[int, ...], tokens: Array, bad: Array) -> Array:
    nan_if_bad = jnp.where(bad, jnp.nan, 0.0).astype(F32)
    if normalization == "none":
        return tokens.reshape(lead) + nan_if_bad
    return jnp.sum(tokens) + nan_if_bad


Spec = tuple  # (KernelConfig, impl, tuning): static, hashable


def _kernel(spec: Spec, x: Array, target: Array, coef: Array, with_grad: bool) -> tuple[Array, Optional[Array]]:
    cfg, impl, tuning = spec
    if impl == "pallas":
        return _pallas.fused(cfg, x, target, coef, with_grad=with_grad, tuning=tuning)
    return _xla.fused(cfg, x, target, coef, with_grad=with_grad, tuning=tuning)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weighted_loss(spec: Spec, x: Array, target: Array, coef: Array) -> Array:
    """Per-token ``coef_i * l_i`` ``[N]`` (0 where ``coef == 0``) of logits ``x`` ``[N, V]``."""
    loss, _ = _kernel(spec, x, target, coef, with_grad=False)
    return jnp.where(coef != 0, coef * loss, 0.0)


def _weighted_loss_fwd(spec: Spec, x: Array, target: Array, coef: Array) -> tuple[Array, tuple[Array, ...]]:
    loss, grad = _kernel(spec, x, target, coef, with_grad=True)
    # Residuals: the gradient (one logits-sized buffer, logits' dtype), [N] vectors, and a
    # reference to the logits (no copy) for the 16-bit recompute below.
    return jnp.where(coef != 0, coef * loss, 0.0), (grad, loss, coef, target, x)


def _weighted_loss_bwd(spec: Spec, res: tuple[Array, ...], g: Array) -> tuple[Any, Any, Array]:
    grad, loss, coef, target, x = res
    return _backward(grad, loss, coef, target, g, lambda scaled: _kernel(spec, x, target, scaled, with_grad=True)[1])


def _backward(
    grad: Array, loss: Array, coef: Array, target: Array, g: Array, recompute: Any
) -> tuple[Array, Any, Array]:
    """Cotangents of ``(x, target, coef)`` from the forward's gradient buffer ``grad`` and the
    upstream ``g`` ``[N]``; ``recompute(coef')`` recomputes the gradient with coefficient ``coef'``."""
    if jnp.dtype(grad.dtype).itemsize >= 4:
        # fp32/fp64: one more rounding stays far inside the 4e-6 bound (exact when g == 1).
        dx = (grad.astype(F32) * g[:, None]).astype(grad.dtype)
    else:
        # 16-bit logits: scaling an already rounded gradient would round twice (up to ~1.5
        # ulp). Where the upstream gradient is not exactly 1, recompute with coef * g in fp32
        # and round once; the common g == 1 case reuses the forward's buffer.
        unit = jnp.all(jnp.where(coef != 0, g == 1, True))
        dx = jax.lax.cond(unit, lambda: grad, lambda: recompute(jnp.where(coef != 0, coef * g, 0.0)))
    if jnp.issubdtype(target.dtype, jnp.integer):
        dtarget = np.zeros(target.shape, dtype=jax.dtypes.float0)
    else:
        dtarget = jnp.zeros_like(target)  # the teacher gets no gradient
    dcoef = jnp.where(coef != 0, loss * g, 0.0)
    return dx, dtarget, dcoef


_weighted_loss.defvjp(_weighted_loss_fwd, _weighted_loss_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _tokens(spec: Spec, logits: Array, target: Array, coef: Array) -> Array:
    vocab = logits.shape[-1]
    return _weighted_loss(spec, logits.reshape(-1, vocab), target, coef)


# Vocab-parallel: the same contract, the statistics combined over the mesh axis in the forward.
VpSpec = tuple  # (KernelConfig, impl, tuning, axis names, global V): static, hashable


def _vp_losses(spec: VpSpec, x: Array, target: Array, coef: Array, with_grad: bool) -> tuple[Array, Optional[Array], Any]:
    cfg, impl, tuning, axes, vocab = spec
    return _vocab_parallel.losses(cfg, x, target, coef, axes=axes, vocab=vocab, impl=impl, tuning=tuning, with_grad=with_grad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weighted_loss_vp(spec: VpSpec, x: Array, target: Array, coef: Array) -> Array:
    """:func:`_weighted_loss` of this replica's vocabulary slice ``x`` ``[N, V_local]``
    (``target``: labels shifted to the slice's column ids, or the teacher's slice)."""
    loss, _, _ = _vp_losses(spec, x, target, coef, with_grad=False)
    return jnp.where(coef != 0, coef * loss, 0.0)


def _weighted_loss_vp_fwd(spec: VpSpec, x: Array, target: Array, coef: Array) -> tuple[Array, tuple[Any, ...]]:
    loss, grad, fin = _vp_losses(spec, x, target, coef, with_grad=True)
    # The global statistics ([N] vectors) are kept: a 16-bit recompute needs no collective.
    return jnp.where(coef != 0, coef * loss, 0.0), (grad, loss, coef, target, x, fin)


def _weighted_loss_vp_bwd(spec: VpSpec, res: tuple[Any, ...], g: Array) -> tuple[Any, Any, Array]:
    grad, loss, coef, target, x, fin = res
    cfg, impl, tuning, _, vocab = spec

    def recompute(scaled: Array) -> Array:
        return _vocab_parallel.shard_grad(cfg, fin, x, target, scaled, vocab=vocab, impl=impl, tuning=tuning)

    return _backward(grad, loss, coef, target, g, recompute)


_weighted_loss_vp.defvjp(_weighted_loss_vp_fwd, _weighted_loss_vp_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _tokens_vocab_parallel(spec: VpSpec, logits: Array, target: Array, coef: Array) -> Array:
    vocab_local = logits.shape[-1]
    if spec[0].is_ce:
        target = _vocab_parallel.shift_labels(target, vocab_local, spec[3])
    return _weighted_loss_vp(spec, logits.reshape(-1, vocab_local), target, coef)
