"""The prepare stage of every ``jaxloss`` loss and of the fused head (``jaxloss.head``): argument
handling on the host (arrays, metadata, concrete values, the denominator, labels held in NumPy),
then, jitted, the shifted targets, segment ids and sequence-parallel window, ``valid`` and the fp32
weights, ``D``, the per-token coefficient ``coef = where(D > 0, weight / D, 0)``, the safe labels
and the flag for bad values seen under tracing; and :func:`finish` (sum or reshape, NaN on a bad
value). The twin of ``torchloss._prepare``; the rules are lossspec's (docs/DESIGN.md)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import lossspec
from lossspec import LossConfig

Array = jax.Array
F32 = jnp.float32


# --------------------------------------------------------------------------------------------
# Argument handling
# --------------------------------------------------------------------------------------------


def as_array(value: Any) -> Any:
    """Arrays (NumPy, JAX, tracers) stay as they are; anything else becomes a JAX array."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return value
    return jnp.asarray(value)


def broadcast_mask(loss_mask: Any, lead: tuple[int, ...]) -> Any:
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


def array_meta(array: Any) -> lossspec.ArrayMeta:
    return lossspec.meta(array.shape, _dtype_kind(array.dtype), np.dtype(array.dtype).name)


def is_concrete(value: Any) -> bool:
    """Whether reading the value costs no tracing break: not a tracer, and fully on this host."""
    if isinstance(value, jax.core.Tracer):
        return False
    return bool(getattr(value, "is_fully_addressable", True))


def to_device(value: Any) -> Any:
    """NumPy inputs become JAX arrays (int64 labels narrow to int32 without x64)."""
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return jnp.asarray(value)
    return value


def device_ids(segment_ids: Any, axes: Optional[tuple]) -> Any:
    """Segment ids for the device: NumPy ids as int32 with the same sequences
    (:func:`lossspec.compact_segment_ids`: 64-bit ids would wrap without x64); others as they
    are. Under ``sequence_parallel`` ids stay as given (ranks must agree on them), cast to int32
    where x64 is off, as JAX does."""
    if segment_ids is None:
        return None
    if isinstance(segment_ids, np.ndarray) and axes is None:
        return jnp.asarray(lossspec.compact_segment_ids(segment_ids))
    return to_device(segment_ids)


def sequence_axes(sequence_parallel: Any) -> tuple:
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


def host_labels(labels: np.ndarray, ignore_index: int, vocab: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """NumPy labels, compared on the host: ``(safe int32 labels, (ignored, out_of_range))``.

    NumPy compares exactly, whatever the dtype; JAX without x64 would narrow int64 / uint64
    labels to 32 bits on the way (``2**40 -> 0``, ``2**32 - 100 -> -100``, the ignore_index).
    So the device gets int32 labels (0 where ignored or out of range) and the two flags; it
    combines them with the mask (which may be traced) as it would the labels themselves."""
    ignored = labels == ignore_index
    out_of_range = (labels < 0) | (labels >= vocab)
    safe = np.where(ignored | out_of_range, 0, labels).astype(np.int32)
    return safe, (ignored, out_of_range)


def checked_denominator(denominator: Any) -> Any:
    """``denominator=`` checked (shape; value where concrete) as a 0-d array, or ``None``."""
    if denominator is None:
        return None
    if isinstance(denominator, (jax.Array, np.ndarray)):
        lossspec.check_denominator_type(denominator, array_meta(denominator))
    else:  # a Python / NumPy number; a string, a list or True is a TypeError
        lossspec.check_denominator_type(denominator)
    host = not isinstance(denominator, jax.Array)  # a Python / NumPy number: check it as given
    denominator = np.asarray(denominator) if host else denominator
    lossspec.check_denominator_shape(tuple(denominator.shape))
    concrete = is_concrete(denominator)
    if concrete:
        lossspec.check_denominator_value(np.asarray(denominator))
    if concrete or denominator.dtype != jnp.float64:
        # Always the same abstract value (fp32, not weak): any number reuses one
        # compilation. (A traced float64 denominator, x64 on, is checked before its
        # conversion in prepare: a value that float32 flushes to 0 must not pass as 0.)
        denominator = jnp.asarray(denominator, F32)
    return denominator.reshape(())


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
def count_tokens(
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
def prepare(
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
    ``(ignored, out_of_range)`` of NumPy labels, compared on the host (:func:`host_labels`).
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
    # NaN (also finish's flag) and so is the whole gradient, never a plausible one that a step
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


@functools.partial(jax.jit, static_argnums=(0,))
def finish(lead: Optional[tuple[int, ...]], tokens: Array, bad: Array) -> Array:
    """The loss from the weighted per-token losses ``tokens [N]``: reshaped to ``lead`` (the
    leading shape, ``normalization="none"``), or summed (``lead`` None: every other mode), NaN
    where ``bad``. Static only in what changes the program: the reduced modes and leading shapes
    share one compiled program per ``N`` (an eager call with another mode compiles nothing new)."""
    nan_if_bad = jnp.where(bad, jnp.nan, 0.0).astype(F32)
    if lead is not None:
        return tokens.reshape(lead) + nan_if_bad
    return jnp.sum(tokens) + nan_if_bad
