"""Public functions of ``jaxloss`` (SPEC section 3) and their argument handling.

Every function computes, per token ``i`` of the flattened leading shape, the loss ``l_i`` of
its kind (SPEC section 1) and returns ``sum_i w_i l_i / D`` (fp32 scalar) or, for
``normalization="none"``, the per-token ``w_i l_i`` with the labels' shape (SPEC section 2).

Flow of one call:

1. options -> :func:`lossspec.make_config`, shapes/dtypes -> :func:`lossspec.check_inputs`;
   value checks (labels in range, weights, denominator) only for concrete inputs (not JAX
   tracers), so un-traced calls raise and traced ones stay free of host synchronisation;
2. ``_prepare`` (jitted): with ``causal_shift`` the ``[..., T]`` labels, mask and host flags
   shifted left by one (weight 0 at the last position; never the logits, ``lossspec.causal``);
   ``valid``, fp32 ``weight``, ``D`` and the per-token coefficient
   ``coef = where(D > 0, weight / D, 0)`` (``weight`` for ``"none"``), the safe labels
   ``where(valid, labels, 0)`` and a flag for bad values seen under tracing;
3. ``_tokens`` (jitted ``custom_vjp``): the kernel (XLA or Pallas) computes the per-token loss
   and, in the same pass, ``grad = coef * c * dl/dz`` in the logits' dtype, the only residual;
   the backward multiplies it by the upstream gradient. The kernel is compiled per kind,
   options, shapes and impl, never per normalisation or denominator;
4. ``_finish`` (jitted): sum or reshape; NaN when a traced call saw a bad value.

Rules shared with ``torchloss`` (the ``lossspec`` docstrings hold the exact conditions):

- ``loss_mask`` and ``denominator`` are data, like the labels: no gradient flows to them
  (``jax.lax.stop_gradient``; ``jax.grad`` w.r.t. them is exactly 0). ``count_denominator``
  likewise.
- Weights are used in float32: besides NaN / inf / negative weights, a positive weight below
  the smallest normal float32, a weight above the float32 range and a weight set whose sum
  overflows float32 are rejected (:func:`lossspec.check_weights`); a denominator must be 0 or a
  normal float32 number (:func:`lossspec.check_denominator_value`). Under tracing the same
  conditions make the loss (and ``count_denominator``) NaN, and every gradient NaN.
- Labels are compared with ``ignore_index`` and with ``[0, V)`` exactly, in their own dtype:
  no wrapping (a ``uint32`` label ``2**32 - 100`` is an out-of-range label, not ``-100``), and
  an ``ignore_index`` the labels' dtype cannot hold masks nothing.
- Derivatives: first-order reverse mode (``jax.grad``, ``jax.vjp``, ``jax.value_and_grad``)
  everywhere. Higher order (grad of grad, ``jax.hessian``, ``jax.jvp`` of a gradient) only with
  ``impl="xla"``, float32/float64 logits and no ``vocab_parallel``; elsewhere a
  ``NotImplementedError`` that says so. Forward mode on the loss itself (``jax.jvp``,
  ``jax.jacfwd``, ``jax.linearize``) is not supported (the losses are ``jax.custom_vjp``s):
  eager calls raise ``NotImplementedError``; inside ``jit`` JAX reports "can't apply
  forward-mode autodiff (jvp) to a custom_vjp function".
"""

from __future__ import annotations

import dataclasses
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
FORWARD_MODE_MESSAGE = (
    "jaxloss: forward-mode differentiation of the loss (jax.jvp, jax.jacfwd, jax.linearize) is not supported: "
    "the losses are jax.custom_vjp functions, differentiated in reverse mode (jax.grad, jax.vjp, "
    "jax.value_and_grad, jax.jacrev). For second derivatives use forward-over-reverse (jax.hessian, or "
    "jax.jvp of jax.grad) with impl='xla' and float32 logits."
)
VOCAB_PARALLEL_HIGHER_ORDER_MESSAGE = (
    "jaxloss: higher-order derivatives (grad of grad, jax.hessian, jax.jvp of a gradient) are not supported "
    "with vocab_parallel: the shards' statistics are combined with explicit pmax/psum collectives, which are "
    "never differentiated. Compute them on the whole vocabulary (vocab_parallel=None) with impl='xla' and "
    "float32 logits."
)

__all__ = [
    "cross_entropy",
    "soft_cross_entropy",
    "forward_kl",
    "reverse_kl",
    "entropy",
    "jensen_shannon",
    "count_denominator",
    "resolve_impl",
]


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _masked_loss(kind: str, **args: Any) -> Array:
    """Body of the public functions (their signatures: ``lossspec.KIND_SPECS``)."""
    spec = lossspec.KIND_SPECS[kind]
    options = {name: args[name] for name in spec.option_names}
    config = lossspec.make_config(kind, normalization=args["normalization"], **options)
    target = args[spec.target] if spec.target is not None else None
    return _loss(
        config,
        args["logits"],
        target,
        args["loss_mask"],
        args["segment_ids"],
        args["denominator"],
        args["vocab_parallel"],
        args["sequence_parallel"],
        args["impl"],
    )


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
        (
            "sequence_parallel",
            None,
            "``None``, or the mesh axis name (or a tuple of names) over which the time axis (the last leading axis) is "
            "split, inside ``shard_map`` / ``pmap`` (context parallelism): each replica holds its contiguous time slice "
            "(in axis-index order, equal lengths) of the logits, labels, mask and ``segment_ids``. The ``[..., T]`` "
            "labels, mask and ids are all-gathered (never the logits), so ``n_s``, ``D`` / ``S`` and the causal shift "
            "are those of the whole rows. The loss is this replica's share (``psum`` it over the axis for the whole "
            "rows' loss; ``accumulate`` does with ``data_axes`` holding the axis); the gradient is exact "
            "(lossspec.sequences).",
        ),
        (
            "impl",
            "auto",
            '``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``. Higher-order derivatives '
            'need ``"xla"`` with float32/float64 logits and no ``vocab_parallel`` (others raise a clear error).',
        ),
    )
)


def _public(kind: str) -> Any:
    return lossspec.public_function(lossspec.KIND_SPECS[kind], FRAMEWORK_ARGS, _masked_loss, __name__)


cross_entropy = _public("cross_entropy")
soft_cross_entropy = _public("soft_cross_entropy")
forward_kl = _public("forward_kl")
reverse_kl = _public("reverse_kl")
entropy = _public("entropy")
jensen_shannon = _public("jensen_shannon")


def count_denominator(
    labels: Any = None,
    loss_mask: Any = None,
    *,
    normalization: str = "valid_tokens",
    ignore_index: int = -100,
    causal_shift: bool = False,
    segment_ids: Any = None,
    sequence_parallel: Any = None,
) -> Array:
    """The denominator ``D`` of one (micro-)batch as an fp32 scalar array (SPEC section 4).

    ``"valid_tokens"``: sum of the weights of valid tokens (mask non-zero, segment id ``>= 0``
    and, when labels are given, label ``!= ignore_index``); ``"tokens"``: the number of token
    positions; ``"sequence_mean"`` / ``"sequence_sum"``: ``S``, the number of sequences (rows, or
    ``(row, segment id)`` pairs) with a positive weight sum (:mod:`lossspec.sequences`).
    Counts add up over micro-batches and data-parallel replicas (``jax.lax.psum``).
    ``"sum"`` and ``"none"`` have no count and raise ``ValueError``. ``causal_shift=True``
    counts the positions the shifted losses score (:mod:`lossspec.causal`): ``labels[..., 1:]``
    and ``loss_mask[..., 1:]`` (``"tokens"``: ``prod(lead[:-1]) * (T - 1)``), and the sequences
    of the scored segment ids (never across a document boundary). ``sequence_parallel``: the
    mesh axis name(s) splitting the time axis, as in the losses: the result is this replica's
    share (a sequence is counted by the replica holding its first scored position, a token by
    the one holding it), so ``psum`` over the data and sequence axes gives the whole count.

    Labels are compared with ``ignore_index`` exactly (an ``ignore_index`` that the labels'
    dtype cannot hold matches no label). The weights are checked as in the losses
    (:func:`lossspec.check_weights`: ``ValueError`` for concrete inputs, a NaN count under
    tracing). The count is data: no gradient flows to ``loss_mask``.
    """
    lossspec.accumulation.record("count_denominator", normalization, causal_shift)  # accumulate(check=...)
    labels = None if labels is None else _as_array(labels)
    loss_mask = None if loss_mask is None else _as_array(loss_mask)
    segment_ids = None if segment_ids is None else _as_array(segment_ids)
    lossspec.check_count_args(
        normalization,
        None if labels is None else _meta(labels),
        None if loss_mask is None else _meta(loss_mask),
        causal_shift,
        None if segment_ids is None else _meta(segment_ids),
    )
    axes = None if sequence_parallel is None else _sequence_axes(sequence_parallel)
    config = lossspec.make_config("cross_entropy", ignore_index=ignore_index, normalization=normalization, causal_shift=causal_shift)
    loss_mask = _broadcast_mask(loss_mask, tuple(next(a for a in (labels, segment_ids, loss_mask) if a is not None).shape))
    if loss_mask is not None and _concrete(loss_mask):
        # With causal_shift only loss_mask[..., 1:] is ever read (lossspec.causal).
        lossspec.check_weights(np.asarray(loss_mask)[..., 1:] if causal_shift else np.asarray(loss_mask))
    ref = next(a for a in (labels, loss_mask, segment_ids) if a is not None)
    if normalization == "tokens" and axes is None:
        return jnp.asarray(float(lossspec.scored_positions(tuple(ref.shape), causal_shift)), F32)
    ignored = None
    if isinstance(labels, np.ndarray):
        # NumPy labels may not fit JAX's int32 (x64 off: int64 / uint64 would wrap on the way,
        # and 2**32 - 100 would become -100): compare them with ignore_index here, exactly.
        ignored, labels = labels == config.ignore_index, None
    return _count(
        config,
        axes,
        tuple(ref.shape),
        None if labels is None else _device(labels),
        None if loss_mask is None else _device(loss_mask),
        _device_ids(segment_ids, axes),
        None if ignored is None else _device(ignored),
    )


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


def _broadcast_mask(loss_mask: Any, lead: tuple[int, ...]) -> Any:
    """A ``loss_mask`` that broadcasts to the leading shape ``lead`` (``[T]``, ``[B, T, 1]``;
    ``lossspec.mask_broadcasts``, checked before) with that shape: a NumPy view for a NumPy mask
    (its values are still checked on the host), ``jnp.broadcast_to`` otherwise (tracers too)."""
    if loss_mask is None or tuple(loss_mask.shape) == lead:
        return loss_mask
    if isinstance(loss_mask, np.ndarray):
        return lossspec.broadcast_mask(loss_mask, lead)
    return jnp.broadcast_to(jnp.reshape(loss_mask, lossspec.squeezed_mask_shape(tuple(loss_mask.shape), lead)), lead)


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


def _device_ids(segment_ids: Any, axes: Optional[tuple]) -> Any:
    """Segment ids for the device: NumPy ids as int32 with the same sequences
    (:func:`lossspec.compact_segment_ids`: 64-bit ids would wrap without x64); others as they
    are. Under ``sequence_parallel`` ids stay as given (ranks must agree on them), cast to int32
    where x64 is off, as JAX does."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, np.ndarray) and axes is None:
        return jnp.asarray(lossspec.compact_segment_ids(segment_ids))
    return _device(segment_ids)


def _sequence_axes(sequence_parallel: Any) -> tuple:
    """``sequence_parallel`` as a tuple of bound axis names; a ``TypeError`` / ``ValueError`` that
    names the argument otherwise."""
    names = tuple(sequence_parallel) if isinstance(sequence_parallel, (tuple, list)) else (sequence_parallel,)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise TypeError(
            "sequence_parallel must be a mesh axis name (str) or a tuple of them, used inside shard_map or pmap; "
            f"got {sequence_parallel!r}"
        )
    for name in names:
        try:
            jax.lax.axis_size(name)
        except NameError as err:
            raise ValueError(
                f"sequence_parallel={name!r} is not a bound axis here: call the loss inside shard_map (a mesh with that "
                "axis name) or pmap(axis_name=...)"
            ) from err
    return names


def _host_labels(labels: np.ndarray, ignore_index: int, vocab: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """NumPy labels, compared on the host: ``(safe int32 labels, (ignored, out_of_range))``.

    NumPy compares exactly, whatever the dtype; JAX without x64 would narrow int64 / uint64
    labels to 32 bits on the way (``2**40 -> 0``, ``2**32 - 100 -> -100``, the ignore_index).
    So the device gets int32 labels (0 where ignored or out of range) and the two flags; it
    combines them with the mask (which may be traced) as it would the labels themselves."""
    ignored = labels == ignore_index
    out_of_range = (labels < 0) | (labels >= vocab)
    safe = np.where(ignored | out_of_range, 0, labels).astype(np.int32)
    return safe, (ignored, out_of_range)


def _checked_denominator(denominator: Any) -> Any:
    """``denominator=`` checked (shape; value where concrete) as a 0-d array, or ``None``."""
    if denominator is None:
        return None
    if isinstance(denominator, (jax.Array, np.ndarray)):
        lossspec.check_denominator_type(denominator, _meta(denominator))
    else:  # a Python / NumPy number; a string, a list or True is a TypeError
        lossspec.check_denominator_type(denominator)
    host = not isinstance(denominator, jax.Array)  # a Python / NumPy number: check it as given
    denominator = np.asarray(denominator) if host else denominator
    lossspec.check_denominator_shape(tuple(denominator.shape))
    concrete = _concrete(denominator)
    if concrete:
        lossspec.check_denominator_value(np.asarray(denominator))
    if concrete or denominator.dtype != jnp.float64:
        # Always the same abstract value (fp32, not weak): any number reuses one
        # compilation. (A traced float64 denominator, x64 on, is checked before its
        # conversion in _prepare: a value that float32 flushes to 0 must not pass as 0.)
        denominator = jnp.asarray(denominator, F32)
    return denominator.reshape(())


def _loss(
    config: LossConfig,
    logits: Any,
    target: Any,
    loss_mask: Any,
    segment_ids: Any,
    denominator: Any,
    vocab_parallel: Any,
    sequence_parallel: Any,
    impl: str,
) -> Array:
    impl = resolve_impl(impl)
    logits = _as_array(logits)
    if target is None:
        # No target (entropy): an empty [..., 0] stand-in carries the leading shape through the
        # shared preparation at no cost; the kernels never read it.
        target = jnp.zeros(tuple(logits.shape[:-1]) + (0,), F32)
        target_meta = None
    else:
        target = _as_array(target)
        target_meta = _meta(target)
    loss_mask = None if loss_mask is None else _as_array(loss_mask)
    segment_ids = None if segment_ids is None else _as_array(segment_ids)
    lossspec.check_inputs(
        config, _meta(logits), target_meta, None if loss_mask is None else _meta(loss_mask), None if segment_ids is None else _meta(segment_ids)
    )
    loss_mask = _broadcast_mask(loss_mask, tuple(logits.shape[:-1]))
    lossspec.check_denominator_allowed(config, denominator)
    time_axes = None
    if sequence_parallel is not None:
        lossspec.check_sequence_parallel_axis(tuple(logits.shape[:-1]))
        time_axes = _sequence_axes(sequence_parallel)
    denominator = _checked_denominator(denominator)
    if loss_mask is not None and _concrete(loss_mask):
        # With causal_shift only loss_mask[..., 1:] is ever read (lossspec.causal).
        lossspec.check_weights(np.asarray(loss_mask)[..., 1:] if config.causal_shift else np.asarray(loss_mask))
    lead, vocab = tuple(logits.shape[:-1]), int(logits.shape[-1])
    axes = None
    if vocab_parallel is not None:
        axes = _vocab_parallel.axis_names(vocab_parallel)
        vocab = vocab * _vocab_parallel.axis_size(axes)  # the global V (labels are global ids)
    host_flags = None
    concrete_ids = segment_ids is None or _concrete(segment_ids)
    if config.has_labels and time_axes is None and _concrete(target) and (loss_mask is None or _concrete(loss_mask)) and concrete_ids:
        labels_host = np.asarray(target)
        mask_host = None if loss_mask is None else np.asarray(loss_mask)
        ids_host = None if segment_ids is None else lossspec.scored_segment_ids(np.asarray(segment_ids), lead, config.causal_shift)
        if config.causal_shift:
            labels_host, mask_host = lossspec.shift_targets(labels_host, mask_host, lead)
        valid, _ = lossspec.token_weights(config, labels_host, mask_host, lead, ids_host)
        lossspec.check_labels(labels_host, valid, vocab, config.causal_shift)
    if config.has_labels and isinstance(target, np.ndarray):
        target, host_flags = _host_labels(target, config.ignore_index, vocab)
    if config.is_distill:  # teacher logits are data: no gradient
        target = jax.lax.stop_gradient(_device(target))
    # Only what the coefficients depend on is static here: a new option value (label
    # smoothing, temperature, ...) does not recompile this part.
    counting = LossConfig(
        kind=config.kind, normalization=config.normalization, ignore_index=config.ignore_index, causal_shift=config.causal_shift
    )
    coef, safe_target, bad = _prepare(
        counting,
        vocab,
        time_axes,
        _device(target),
        None if loss_mask is None else _device(loss_mask),
        _device_ids(segment_ids, time_axes),
        None if denominator is None else _device(denominator),
        host_flags,
    )
    formula = config.kernel_config()  # jensen_shannon at beta = 0 / 1: the KL kinds, exactly
    kcfg = KernelConfig.of(formula)
    tuning = _xla.TUNING if impl == "xla" else _pallas.TUNING
    try:
        if axes is None:
            tokens = _tokens(Spec(kcfg, impl, tuning), _device(logits), safe_target, coef)
        else:
            tokens = _tokens_vocab_parallel(VpSpec(kcfg, impl, tuning, axes, vocab), _device(logits), safe_target, coef)
    except TypeError as err:
        if "forward-mode" not in str(err):
            raise
        raise NotImplementedError(FORWARD_MODE_MESSAGE) from err
    return _finish(config.normalization, lead, tokens, bad)


# --------------------------------------------------------------------------------------------
# Traced pieces
# --------------------------------------------------------------------------------------------


def _ignored(labels: Array, ignore_index: int) -> Array:
    """``labels == ignore_index``, exactly: compared in the labels' own dtype, and all False
    when that dtype cannot hold ``ignore_index`` (no wrapping, no overflow)."""
    if not lossspec.ignore_index_in_dtype(ignore_index, labels.dtype):
        return jnp.zeros(labels.shape, bool)
    return labels == jnp.asarray(ignore_index, labels.dtype)


def _out_of_range(labels: Array, vocab: int) -> Array:
    """``(labels < 0) | (labels >= vocab)``, exactly, in the labels' own dtype."""
    info = jnp.iinfo(labels.dtype)
    out = jnp.zeros(labels.shape, bool)
    if int(info.min) < 0:
        out = out | (labels < 0)
    if vocab <= int(info.max):
        out = out | (labels >= jnp.asarray(vocab, labels.dtype))
    return out


def _subnormal(values: Array) -> Array:
    """Non-zero values with a zero exponent field, read from the bits (a device that flushes
    subnormals to zero still sees them)."""
    dtype = jnp.dtype(values.dtype)
    nbits = dtype.itemsize * 8
    mant = (1 << int(jnp.finfo(dtype).nmant)) - 1
    expo = ((1 << (nbits - 1)) - 1) & ~mant
    bits = jax.lax.bitcast_convert_type(values, jnp.dtype(f"uint{nbits}"))
    return ((bits & expo) == 0) & ((bits & mant) != 0)


def _bad_weights(loss_mask: Array, weight: Array) -> Array:
    """The traced twin of :func:`lossspec.check_weights` on ``loss_mask`` and its float32
    ``weight``: any weight NaN, infinite (also after the float32 conversion), negative,
    positive but below the smallest normal float32, or a float32 sum that is not finite."""
    bad = ~(jnp.isfinite(weight) & (weight >= 0))
    if jnp.issubdtype(loss_mask.dtype, jnp.floating):
        # Positive weights below the smallest normal float32: subnormal in float32, lost in
        # the conversion (float64), or subnormal in a dtype of float32's exponent range.
        bad = bad | _subnormal(weight) | ((loss_mask != 0) & (weight == 0))
        if jnp.finfo(loss_mask.dtype).minexp <= jnp.finfo(F32).minexp:
            bad = bad | _subnormal(loss_mask)
    return jnp.any(bad) | ~jnp.isfinite(jnp.sum(weight))


def _weights(
    config: LossConfig,
    labels: Optional[Array],
    loss_mask: Optional[Array],
    lead: tuple[int, ...],
    ignored: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
) -> tuple[Array, Array, Array]:
    """``(valid, weight, bad_weight)``: valid tokens (mask non-zero, segment id ``>= 0``, label
    not ``ignore_index``), fp32 weights (0 where invalid), and whether any weight breaks
    :func:`lossspec.check_weights` (under tracing: makes the loss NaN). The mask is data:
    ``stop_gradient``, no gradient flows to it. ``ignored``: labels equal to ``ignore_index``,
    compared on the host (then ``labels`` is not read)."""
    valid = jnp.ones(lead, bool)
    weight = jnp.ones(lead, F32)
    bad = jnp.zeros((), bool)
    if loss_mask is not None:
        loss_mask = jax.lax.stop_gradient(loss_mask)
        valid = loss_mask != 0
        weight = loss_mask.astype(F32)
        if loss_mask.dtype != jnp.bool_:
            bad = _bad_weights(loss_mask, weight)
    if ignored is not None:
        valid = valid & ~ignored
    elif labels is not None:
        valid = valid & ~_ignored(labels, config.ignore_index)
    if segment_ids is not None:
        valid = valid & (segment_ids >= 0)
    return valid, jnp.where(valid, weight, 0.0), bad


def _shift_left(values: Array, fill: Any) -> Array:
    """``out[..., t] = values[..., t + 1]``, ``out[..., T - 1] = fill`` (``lossspec.shift_left``)."""
    pad = jnp.full(values.shape[:-1] + (min(values.shape[-1], 1),), fill, values.dtype)
    return jnp.concatenate([values[..., 1:], pad], axis=-1)


def _scored_segment_ids(config: LossConfig, segment_ids: Optional[Array], lead: tuple[int, ...]) -> Optional[Array]:
    """The ids of the scored positions (:func:`lossspec.scored_segment_ids`): as given (zeros,
    one sequence per row, for the sequence modes without ids), or with ``causal_shift``
    ``ids[t + 1]`` where ``ids[t] == ids[t + 1]``, else -1 (never across a document boundary).
    ``None`` when neither given nor needed."""
    if segment_ids is None:
        if not config.per_sequence:
            return None
        segment_ids = jnp.zeros(lead, jnp.int32)
    ids = _signed_ids(jax.lax.stop_gradient(segment_ids))
    if not config.causal_shift:
        return ids
    following = _shift_left(ids, -1)
    return jnp.where(ids == following, following, -1)


def _signed_ids(ids: Array) -> Array:
    """``ids`` in a signed dtype with the same sequences and padding (``-1`` marks padding after
    the shift; ``lossspec.signed_segment_ids``): signed ids as they are; unsigned ids (never
    padding) as int32 (int64 with x64) where it holds every value of their dtype, else (uint32
    without x64, uint64) their ranks among the array's distinct ids: a cast would wrap ids from
    ``2**31`` (``2**63``) on to negative ids, i.e. padding."""
    if not jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
        return ids
    signed = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    if jnp.iinfo(ids.dtype).max <= jnp.iinfo(signed).max:
        return ids.astype(signed)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    starts = jnp.ones(sorted_ids.shape, bool).at[1:].set(sorted_ids[1:] != sorted_ids[:-1])
    ranks = jnp.zeros(flat.shape, signed).at[order].set(jnp.cumsum(starts, dtype=signed) - 1)
    return ranks.reshape(ids.shape)


def _sequence_count(weight: Array, ids: Array) -> tuple[Array, Array]:
    """``(n, counted)`` ``[..., T]``: per token, the weight sum ``n_s`` of its sequence (the
    ``(row, id)`` pair; :func:`lossspec.sequence_weight_sums`), and whether the position counts a
    sequence in ``S`` (its first position, id ``>= 0``, ``n_s > 0``). Sort-based: each row's ids
    are sorted (stably), numbered by group, and the weights summed per group with a scatter-add
    (each sum rounds like a plain sum of the sequence's weights, whatever the row's total)."""
    shape, time = weight.shape, weight.shape[-1]
    rows_w, rows_ids = weight.reshape(-1, time), ids.reshape(-1, time)
    order = jnp.argsort(rows_ids, axis=-1, stable=True)
    sorted_ids = jnp.take_along_axis(rows_ids, order, axis=-1)
    starts = jnp.ones(sorted_ids.shape, bool).at[:, 1:].set(sorted_ids[:, 1:] != sorted_ids[:, :-1])
    inverse = jnp.argsort(order, axis=-1)
    group = jnp.take_along_axis(jnp.cumsum(starts, axis=-1) - 1, inverse, axis=-1)  # the sequence's number in its row
    row = jnp.arange(rows_w.shape[0])[:, None]
    sums = jnp.zeros_like(rows_w).at[row, group].add(rows_w)
    n = jnp.take_along_axis(sums, group, axis=-1)
    first = jnp.take_along_axis(starts, inverse, axis=-1) & (rows_ids >= 0)  # stable sort: the earliest position
    return n.reshape(shape), (first & (n > 0)).reshape(shape)


def _gather_time(values: Optional[Array], axes: tuple) -> Optional[Array]:
    """``[..., T_local]`` -> ``[..., T]``: the slices of the ``sequence_parallel`` axes
    concatenated along time, in axis-index order."""
    if values is None:
        return None
    return jax.lax.all_gather(values, axes, axis=values.ndim - 1, tiled=True)


def _axes_size(axes: tuple) -> int:
    """The number of replicas along the ``sequence_parallel`` axes (static)."""
    return int(np.prod([jax.lax.axis_size(name) for name in axes], dtype=np.int64))


def _take_window(values: Array, axes: tuple, length: int) -> Array:
    """This replica's slice ``[index * length, (index + 1) * length)`` of the time axis."""
    offset = jax.lax.axis_index(axes) * length
    return jax.lax.dynamic_slice_in_dim(values, offset, length, axis=values.ndim - 1)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _count(
    config: LossConfig,
    axes: Optional[tuple],
    lead: tuple[int, ...],
    labels: Optional[Array],
    loss_mask: Optional[Array],
    segment_ids: Optional[Array],
    ignored: Optional[Array] = None,
) -> Array:
    """``count_denominator`` on the device: the scored weights (or positions, or the sequences'
    first positions) summed; under ``sequence_parallel`` (``axes``) on the whole rows, this
    replica's window."""
    local = lead[-1] if lead else 0
    if axes is not None:
        labels, loss_mask, segment_ids, ignored = (_gather_time(a, axes) for a in (labels, loss_mask, segment_ids, ignored))
        lead = lead[:-1] + (local * _axes_size(axes),)
    if config.causal_shift:
        loss_mask = _shift_left(jnp.ones(lead, bool) if loss_mask is None else loss_mask, 0)
        labels = None if labels is None else _shift_left(labels, 0)
        ignored = None if ignored is None else _shift_left(ignored, False)
    ids = _scored_segment_ids(config, segment_ids, lead)
    _, weight, bad = _weights(config, labels, loss_mask, lead, ignored, ids)
    if config.normalization == "tokens":
        weight = jnp.ones(lead, F32) if not config.causal_shift else _shift_left(jnp.ones(lead, F32), 0.0)
    elif config.per_sequence:
        weight = _sequence_count(weight, ids)[1].astype(F32)
    if axes is not None:
        weight = _take_window(weight, axes, local)
    return jnp.sum(weight) + jnp.where(bad, jnp.nan, 0.0)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _prepare(
    config: LossConfig,
    vocab: int,
    axes: Optional[tuple],
    target: Array,
    loss_mask: Optional[Array],
    segment_ids: Optional[Array],
    denominator: Optional[Array],
    host_flags: Optional[tuple[Array, Array]] = None,
) -> tuple[Array, Array, Array]:
    """``(coef [N], target, bad)``: the per-token coefficient, the safe target (labels 0 where
    invalid, int32, flattened; teacher ``[N, V]``) and the bad-value flag. ``host_flags``:
    ``(ignored, out_of_range)`` of NumPy labels, compared on the host (:func:`_host_labels`).
    ``axes``: the ``sequence_parallel`` axes; then the ``[..., T]`` labels, mask, ids and flags
    of the whole rows are gathered, everything below runs on them, and this replica keeps its
    window of the coefficients and labels (lossspec.sequences)."""
    ce = config.has_labels
    local_lead = target.shape if ce else target.shape[:-1]
    n = int(np.prod(local_lead, dtype=np.int64))
    ignored, out_of_range = host_flags if host_flags is not None else (None, None)
    labels = target if ce else None
    lead = local_lead
    if axes is not None:
        labels, loss_mask, segment_ids, ignored, out_of_range = (
            _gather_time(a, axes) for a in (labels, loss_mask, segment_ids, ignored, out_of_range)
        )
        lead = local_lead[:-1] + (local_lead[-1] * _axes_size(axes),)
    if config.causal_shift:
        # Shift the [..., T] labels, mask and flags (never the logits): position t takes
        # index t + 1, the last position gets mask 0 (lossspec.causal).
        loss_mask = _shift_left(jnp.ones(lead, bool) if loss_mask is None else loss_mask, 0)
        if ce:
            labels = _shift_left(labels, 0)
        if host_flags is not None:
            ignored, out_of_range = _shift_left(ignored, False), _shift_left(out_of_range, False)
    ids = _scored_segment_ids(config, segment_ids, lead)
    valid, weight, bad = _weights(config, labels, loss_mask, lead, ignored, ids)
    if ce:
        # Exact, in the labels' dtype: a uint32 2**32 - 100 is out of range, never -100.
        if out_of_range is None:
            out_of_range = _out_of_range(labels, vocab)
        bad = bad | jnp.any(valid & out_of_range)
        labels = jnp.where(valid, labels, 0).astype(jnp.int32)
    if config.normalization == "none":
        coef = weight
    else:
        coef, bad = _coefficients(config, weight, ids, denominator, lead, bad)
    # A bad value that could not raise (traced inputs) makes every coefficient NaN: the loss is
    # NaN (also _finish's flag) and so is the whole gradient, never a plausible one that a step
    # using only the gradient would train on. Nothing changes where bad is False.
    coef = jnp.where(bad, jnp.nan, coef)
    if axes is not None:
        coef = _take_window(coef, axes, local_lead[-1])
        labels = None if labels is None else _take_window(labels, axes, local_lead[-1])
    target = labels.reshape(n) if ce else target.reshape(n, target.shape[-1])  # the teacher: this replica's slice
    return coef.reshape(n), target, bad


def _coefficients(
    config: LossConfig, weight: Array, ids: Optional[Array], denominator: Optional[Array], lead: tuple[int, ...], bad: Array
) -> tuple[Array, Array]:
    """``(coef, bad)``: ``coef = where(D > 0, weight / D, 0)``, ``D`` the given denominator or
    this call's count (``S`` for the sequence modes); ``"sequence_mean"`` divides by ``n_s`` too
    (``w_t / (n_s D)``). The only place ``D`` and ``n_s`` enter: runtime data for the kernels.
    ``D == 0`` gives loss 0, gradient 0."""
    n = counted = None
    if config.per_sequence:
        n, counted = _sequence_count(weight, ids)
    if denominator is not None:
        # Data, like the mask: no gradient. 0 or a normal float32 number (lossspec's
        # check_denominator_value), else NaN: also a value that float32 turns into 0 or inf.
        given = jax.lax.stop_gradient(denominator).reshape(())
        denom = given.astype(F32)
        bad = bad | ~(jnp.isfinite(denom) & (denom >= 0)) | _subnormal(denom) | ((given != 0) & (denom == 0))
    elif config.normalization == "valid_tokens":
        denom = jnp.sum(weight)
    elif config.normalization == "tokens":
        denom = jnp.asarray(float(lossspec.scored_positions(lead, config.causal_shift)), F32)
    elif counted is not None:
        denom = jnp.sum(counted.astype(F32))
    else:  # "sum"
        denom = jnp.ones((), F32)
    if n is not None and config.normalization == "sequence_mean":
        weight = jnp.where(weight > 0, weight / jnp.where(n > 0, n, 1.0), 0.0)
    return jnp.where(denom > 0, weight / jnp.where(denom > 0, denom, 1.0), 0.0), bad


@functools.partial(jax.jit, static_argnums=(0, 1))
def _finish(normalization: str, lead: tuple[int, ...], tokens: Array, bad: Array) -> Array:
    nan_if_bad = jnp.where(bad, jnp.nan, 0.0).astype(F32)
    if normalization == "none":
        return tokens.reshape(lead) + nan_if_bad
    return jnp.sum(tokens) + nan_if_bad


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the loss's ``custom_vjp`` takes as static (hashable): the kernel's config, the
    resolved impl and its tuning."""

    config: KernelConfig
    impl: str
    tuning: Any


@dataclasses.dataclass(frozen=True)
class VpSpec(Spec):
    """:class:`Spec` of a vocab-parallel call, with the mesh axis names and the global ``V``."""

    axes: tuple = ()
    vocab: int = 0


def _kernel(spec: Spec, x: Array, target: Array, coef: Array, with_grad: bool) -> tuple[Array, Optional[Array]]:
    if spec.impl == "pallas":
        return _pallas.fused(spec.config, x, target, coef, with_grad=with_grad, tuning=spec.tuning)
    return _xla.fused(spec.config, x, target, coef, with_grad=with_grad, tuning=spec.tuning)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weighted_loss(spec: Spec, x: Array, target: Array, coef: Array) -> Array:
    """Per-token ``coef_i * l_i`` ``[N]`` (0 where ``coef == 0``) of logits ``x`` ``[N, V]``."""
    loss, _ = _kernel(spec, x, target, coef, with_grad=False)
    return jnp.where(coef != 0, coef * loss, 0.0)


def _weighted_loss_fwd(spec: Spec, x: Array, target: Array, coef: Array) -> tuple[Array, tuple[Array, ...]]:
    loss, grad = _kernel(spec, x, target, coef, with_grad=True)
    # Residuals: the gradient (one logits-sized buffer, logits' dtype), [N] vectors, and a
    # reference to the logits (no copy) for the 16-bit recompute below.
    return jnp.where(coef != 0, coef * loss, 0.0), (grad, coef, target, x)


def _weighted_loss_bwd(spec: Spec, res: tuple[Array, ...], g: Array) -> tuple[Any, Any, Any]:
    grad, coef, target, x = res
    return _backward(grad, coef, g, lambda scaled: _kernel(spec, x, target, scaled, with_grad=True)[1])


def _backward(grad: Array, coef: Array, g: Array, recompute: Any) -> tuple[Array, None, None]:
    """Cotangents of ``(x, target, coef)`` from the forward's gradient buffer ``grad`` and the
    upstream ``g`` ``[N]``; ``recompute(coef')`` recomputes the gradient with coefficient ``coef'``.

    The target (labels, or the teacher: stop-gradient) and ``coef`` (from the mask and the
    denominator, which are data: stop-gradient) get no cotangent (``None``: zero)."""
    if jnp.dtype(grad.dtype).itemsize >= 4:
        # fp32/fp64: one more rounding stays far inside the 4e-6 bound (exact when g == 1).
        dx = (grad.astype(F32) * g[:, None]).astype(grad.dtype)
    else:
        # 16-bit logits: scaling an already rounded gradient would round twice (up to ~1.5
        # ulp). Where the upstream gradient is not exactly 1, recompute with coef * g in fp32
        # and round once; the common g == 1 case reuses the forward's buffer.
        unit = jnp.all(jnp.where(coef != 0, g == 1, True))
        dx = jax.lax.cond(unit, lambda: grad, lambda: recompute(jnp.where(coef != 0, coef * g, 0.0)))
    return dx, None, None


_weighted_loss.defvjp(_weighted_loss_fwd, _weighted_loss_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _tokens(spec: Spec, logits: Array, target: Array, coef: Array) -> Array:
    vocab = logits.shape[-1]
    return _weighted_loss(spec, logits.reshape(-1, vocab), target, coef)


# Vocab-parallel: the same contract, the statistics combined over the mesh axis in the forward.
def _vp_losses(spec: VpSpec, x: Array, target: Array, coef: Array, with_grad: bool) -> tuple[Array, Optional[Array], Any]:
    cfg, impl, tuning, axes, vocab = spec.config, spec.impl, spec.tuning, spec.axes, spec.vocab

    def losses(x: Array, target: Array, coef: Array) -> tuple[Array, Optional[Array], Any]:
        return _vocab_parallel.losses(cfg, x, target, coef, axes=axes, vocab=vocab, impl=impl, tuning=tuning, with_grad=with_grad)

    # Higher-order derivatives would differentiate pmax (no rule in JAX) and psum: refuse clearly.
    return _xla.no_derivatives(losses, VOCAB_PARALLEL_HIGHER_ORDER_MESSAGE)(x, target, coef)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _weighted_loss_vp(spec: VpSpec, x: Array, target: Array, coef: Array) -> Array:
    """:func:`_weighted_loss` of this replica's vocabulary slice ``x`` ``[N, V_local]``
    (``target``: labels shifted to the slice's column ids, or the teacher's slice)."""
    loss, _, _ = _vp_losses(spec, x, target, coef, with_grad=False)
    return jnp.where(coef != 0, coef * loss, 0.0)


def _weighted_loss_vp_fwd(spec: VpSpec, x: Array, target: Array, coef: Array) -> tuple[Array, tuple[Any, ...]]:
    loss, grad, fin = _vp_losses(spec, x, target, coef, with_grad=True)
    # The global statistics ([N] vectors) are kept: a 16-bit recompute needs no collective.
    return jnp.where(coef != 0, coef * loss, 0.0), (grad, coef, target, x, fin)


def _weighted_loss_vp_bwd(spec: VpSpec, res: tuple[Any, ...], g: Array) -> tuple[Any, Any, Any]:
    grad, coef, target, x, fin = res
    cfg, impl, tuning, vocab = spec.config, spec.impl, spec.tuning, spec.vocab

    def recompute(scaled: Array) -> Array:
        return _vocab_parallel.shard_grad(cfg, fin, x, target, scaled, vocab=vocab, impl=impl, tuning=tuning)

    return _backward(grad, coef, g, recompute)


_weighted_loss_vp.defvjp(_weighted_loss_vp_fwd, _weighted_loss_vp_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _tokens_vocab_parallel(spec: VpSpec, logits: Array, target: Array, coef: Array) -> Array:
    vocab_local = logits.shape[-1]
    if spec.config.is_ce:
        target = _vocab_parallel.shift_labels(target, vocab_local, spec.axes)
    return _weighted_loss_vp(spec, logits.reshape(-1, vocab_local), target, coef)
