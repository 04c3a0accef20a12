"""Exact global normalisation in JAX: global denominators and micro-batch accumulation.

The two-pass step of SPEC section 4::

    D = psum(sum_k count_denominator(microbatch_k), data_axes)      # pass 1: count
    loss, grads = sum_k value_and_grad(loss_fn)(params, microbatch_k, D)  # pass 2: compute
    loss, grads = psum((loss, grads), data_axes)                    # sum, never average

gives the loss and gradients of the whole batch on one device, whatever the split into
micro-batches and data-parallel replicas (uneven valid counts, empty micro-batches and all-masked
replicas included). Tensor/vocab-parallel axes are never part of ``data_axes``: their replicas
hold the same tokens and would be counted twice.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import lossspec
from lossspec.accumulation import check_accumulation  # noqa: F401 - the hand-written loop's check, re-exported

from ._block import varying_axes
from .api import count_denominator

AxisNames = str | Sequence[str] | None
LossFn = Callable[[Any, Any, Any], jax.Array]


def _axes(data_axes: AxisNames) -> tuple[str, ...]:
    if data_axes is None:
        return ()
    return (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)


def _varying_axes(value: jax.Array) -> frozenset[str]:
    """The mesh axes ``value`` varies over inside ``shard_map`` (empty under ``pmap``, where
    JAX does not track them)."""
    return varying_axes(value)


def _sum_over_replicas(loss: jax.Array, grads: Any, axes: tuple[str, ...]) -> tuple[jax.Array, Any]:
    """Sum the loss and gradients over the data axes, once.

    Inside ``shard_map`` (with its varying-axes checks) the gradient of a replicated parameter
    is already summed over the axes by autodiff (the transpose of the implicit broadcast is a
    psum), so only values that still vary over an axis are summed. Under ``pmap`` nothing is
    summed by autodiff, and everything is psum-ed explicitly.
    """
    loss_axes = _varying_axes(loss)
    if not loss_axes or not set(axes) & loss_axes:
        return jax.lax.psum((loss, grads), axes)

    def total(value: jax.Array) -> jax.Array:
        varying = tuple(axis for axis in axes if axis in _varying_axes(value))
        return jax.lax.psum(value, varying) if varying else value

    return total(loss), jax.tree_util.tree_map(total, grads)


def global_denominator(
    labels: jax.Array | None = None,
    loss_mask: jax.Array | None = None,
    *,
    normalization: str = "valid_tokens",
    ignore_index: int = -100,
    data_axes: AxisNames = None,
    causal_shift: bool = False,
    segment_ids: jax.Array | None = None,
    sequence_parallel: AxisNames = None,
) -> jax.Array:
    """``D`` of the global batch: the count of every token given (any stacked leading
    micro-batch axes count too, since counts add up), ``psum``-ed over ``data_axes`` (names of
    data-parallel mesh/pmap axes; call inside ``shard_map``/``pmap``). fp32 scalar.

    ``"valid_tokens"``: sum of the weights of valid tokens; ``"tokens"``: number of positions;
    ``"sequence_mean"`` / ``"sequence_sum"``: ``S``, the number of sequences.
    ``causal_shift``, ``segment_ids``, ``sequence_parallel``: as in :func:`jaxloss.count_denominator`;
    with ``sequence_parallel`` the count is this replica's share and ``data_axes`` must hold the
    sequence axes too (every axis over which the tokens differ).
    """
    count = count_denominator(
        labels,
        loss_mask,
        normalization=normalization,
        ignore_index=ignore_index,
        causal_shift=causal_shift,
        segment_ids=segment_ids,
        sequence_parallel=sequence_parallel,
    )
    axes = _axes(data_axes)
    return jax.lax.psum(count, axes) if axes else count


def _batch_rows(batch: Any) -> int:
    """The common leading size ``B`` of every leaf (``lossspec.batch_rows``' errors otherwise)."""
    return lossspec.batch_rows(tuple(jnp.shape(leaf)) for leaf in jax.tree_util.tree_leaves(batch))


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every leaf ``[B, ...]`` of ``batch`` (a pytree) into ``num_microbatches``
    contiguous micro-batches, as ``torchloss.distributed.split_microbatches`` does: sizes by
    ``lossspec.microbatch_sizes`` (as ``numpy.array_split``: the first ``B % K`` micro-batches get
    one more row; 10 rows in 4: 3, 3, 2, 2). Returns the list of ``K`` micro-batch pytrees."""
    lossspec.check_num_microbatches(num_microbatches)
    sizes = lossspec.microbatch_sizes(_batch_rows(batch), num_microbatches)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [
        jax.tree_util.tree_map(lambda leaf, a=int(a), b=int(b): jnp.asarray(leaf)[a:b], batch)
        for a, b in zip(starts[:-1], starts[1:])
    ]


def _stacked_groups(batch: Any, num_microbatches: int) -> list[Any]:
    """The micro-batches of :func:`split_microbatches`, stacked for ``lax.scan`` (equal shapes):
    the first ``r = B % K`` of ``q + 1`` rows as one pytree of leaves ``[r, q + 1, ...]``, the
    other ``K - r`` of ``q`` rows as ``[K - r, q, ...]`` (only the groups that exist; empty
    micro-batches, ``K > B``, hold no token and are left out). No padding: every row is real."""
    lossspec.check_num_microbatches(num_microbatches)
    rows = _batch_rows(batch)
    quotient, remainder = divmod(rows, num_microbatches)
    split = remainder * (quotient + 1)
    groups = []
    if remainder:
        groups.append((0, split, remainder, quotient + 1))
    if quotient or not remainder:
        groups.append((split, rows, num_microbatches - remainder, quotient))

    def stack(leaf: Any, start: int, stop: int, count: int, size: int) -> jax.Array:
        leaf = jnp.asarray(leaf)
        return leaf[start:stop].reshape((count, size) + leaf.shape[1:])

    return [jax.tree_util.tree_map(lambda leaf, g=g: stack(leaf, *g), batch) for g in groups]


def _default_count_fn(
    normalization: str,
    ignore_index: int,
    labels_key: str,
    mask_key: str,
    causal_shift: bool = False,
    segment_ids_key: str = "segment_ids",
    sequence_parallel: AxisNames = None,
) -> Callable[[Any], jax.Array]:
    def count(microbatch: Any) -> jax.Array:
        if not isinstance(microbatch, dict):
            raise TypeError("accumulate needs count_fn= unless the batch is a dict with labels/loss_mask entries")
        labels, mask, ids = microbatch.get(labels_key), microbatch.get(mask_key), microbatch.get(segment_ids_key)
        if labels is None and mask is None:
            raise ValueError(f"the batch has neither {labels_key!r} nor {mask_key!r}; pass count_fn= to count it")
        if causal_shift:
            lossspec.check_shifted_microbatch(tuple(jnp.shape(labels if labels is not None else mask)))
        return count_denominator(
            labels,
            mask,
            normalization=normalization,
            ignore_index=ignore_index,
            causal_shift=causal_shift,
            segment_ids=ids,
            sequence_parallel=sequence_parallel,
        )

    return count


def accumulate(
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    *,
    num_microbatches: int,
    normalization: str = "valid_tokens",
    ignore_index: int = -100,
    count_fn: Callable[[Any], jax.Array] | None = None,
    data_axes: AxisNames = None,
    labels_key: str = "labels",
    mask_key: str = "loss_mask",
    causal_shift: bool = False,
    segment_ids_key: str = "segment_ids",
    sequence_parallel: AxisNames = None,
    check: str = "off",
) -> tuple[jax.Array, Any]:
    """One optimizer step's loss and gradients, split into micro-batches (and replicas).

    Args:
      loss_fn: ``loss_fn(params, microbatch, denominator) -> scalar``: the user's model and loss,
        which passes ``denominator=denominator`` to a ``jaxloss`` loss (with the same
        ``normalization``).
      params: the pytree to differentiate.
      batch: a pytree whose leaves have a common leading batch axis ``B``.
      num_microbatches: ``K``; the micro-batches are :func:`split_microbatches`' (``B`` need not
        divide by ``K``: the first ``B % K`` micro-batches get one more row).
      normalization: ``"valid_tokens"`` or ``"tokens"`` (counted over the global batch),
        ``"sequence_mean"`` / ``"sequence_sum"`` (``S`` counted over the global batch; micro-batches
        split rows, so a sequence never spans two) or ``"sum"`` (``D = 1``). ``"none"`` has no
        scalar loss to differentiate.
      count_fn: ``count_fn(microbatch) -> count``; default: ``count_denominator`` of the
        ``labels_key``/``mask_key``/``segment_ids_key`` entries of a dict batch (the ids if present).
      segment_ids_key: the dict entry of the packed documents' ids (``lossspec.sequences``), if any.
      sequence_parallel: the mesh axis name(s) splitting the time axis (context parallelism), for
        the default count: each replica counts its share. The ``loss_fn`` passes
        ``sequence_parallel=`` to its loss itself, and ``data_axes`` must hold these axes too: the
        counts, the losses (each replica's share) and the gradients are summed over them.
      causal_shift: the default count counts the shifted positions (``labels[..., 1:]``,
        ``loss_mask[..., 1:]``), as the losses of a ``loss_fn`` that passes ``causal_shift=True``
        score them (e.g. ``labels=input_ids``); the labels/mask need ``[B, ..., T]``. The
        ``loss_fn`` passes ``causal_shift=True`` to its loss itself; a ``count_fn`` counts on its own.
      data_axes: data-parallel axis name(s) when called inside ``shard_map``/``pmap``: the count,
        the loss and the gradients are ``psum``-ed over them.
      check: ``"off"`` (default), ``"warn"`` or ``"raise"``: check the step's loss and count calls
        for the mistakes that give a plausible but wrong result (``lossspec.accumulation``): a loss
        called without ``denominator=`` (each micro-batch normalised locally: about ``K`` times too
        large), a count whose ``causal_shift`` or normalisation differs from the loss's. Warns
        (``RuntimeWarning``) or raises a ``ValueError`` naming each one.

    Returns:
      ``(loss, grads)``: the full-batch loss (fp32; the sum over micro-batches and replicas,
      not a mean of means) and gradients (summed in fp32, cast back to each parameter's dtype).

    Pass 1 counts every micro-batch (cheap: labels and masks only); pass 2 sums
    ``value_and_grad(loss_fn)`` over the micro-batches with ``lax.scan`` (equal shapes): one scan
    when ``K`` divides ``B``, else one over the ``B % K`` micro-batches of ``q + 1`` rows and one
    over those of ``q`` rows (``loss_fn`` is traced once per size; no padding rows). Works under
    ``jit``, ``shard_map`` and ``pmap``.
    """
    lossspec.check_normalization(normalization)
    causal_shift = lossspec.check_causal_shift(causal_shift)
    # Checked: the step's loss and count calls recorded (at trace time under jit) and read at the end.
    return lossspec.accumulation.run_checked(
        lambda: _accumulate(
            loss_fn, params, batch, num_microbatches, normalization, ignore_index, count_fn, data_axes,
            labels_key, mask_key, causal_shift, segment_ids_key, sequence_parallel,
        ),
        check, normalization, "accumulate",
    )


def _accumulate(
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    num_microbatches: int,
    normalization: str,
    ignore_index: int,
    count_fn: Callable[[Any], jax.Array] | None,
    data_axes: AxisNames,
    labels_key: str,
    mask_key: str,
    causal_shift: bool,
    segment_ids_key: str,
    sequence_parallel: Any,
) -> tuple[jax.Array, Any]:
    """The body of :func:`accumulate` (arguments checked)."""
    if normalization == "none":
        raise ValueError("accumulate needs a scalar loss: normalization must be 'valid_tokens', 'tokens' or 'sum', not 'none'")
    axes = _axes(data_axes)
    groups = _stacked_groups(batch, num_microbatches)
    if normalization in lossspec.COUNTED_NORMALIZATIONS:
        count = count_fn or _default_count_fn(
            normalization, ignore_index, labels_key, mask_key, causal_shift, segment_ids_key, sequence_parallel
        )
        denominator = sum(jnp.sum(jax.vmap(count)(group)).astype(jnp.float32) for group in groups)
        if axes:
            denominator = jax.lax.psum(denominator, axes)
    else:
        denominator = jnp.float32(1.0)

    grad_fn = jax.value_and_grad(loss_fn)

    def microbatch_grads(microbatch: Any) -> tuple[jax.Array, Any]:
        loss, grads = grad_fn(params, microbatch, denominator)
        return loss.astype(jnp.float32), jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)

    def step(carry: tuple[jax.Array, Any], microbatch: Any) -> tuple[tuple[jax.Array, Any], None]:
        loss, grads = microbatch_grads(microbatch)
        return jax.tree_util.tree_map(jnp.add, carry, (loss, grads)), None

    # The first micro-batch seeds the fp32 accumulators (rather than zeros), so the carry has the
    # exact type of a micro-batch's result, varying mesh axes included (inside shard_map).
    first = jax.tree_util.tree_map(lambda leaf: leaf[0], groups[0])
    carry = microbatch_grads(first)
    for index, group in enumerate(groups):
        rest = jax.tree_util.tree_map(lambda leaf: leaf[1:], group) if index == 0 else group
        if jax.tree_util.tree_leaves(rest)[0].shape[0]:
            carry, _ = jax.lax.scan(step, carry, rest)
    loss, grads = carry
    if axes:
        loss, grads = _sum_over_replicas(loss, grads, axes)
    grads = jax.tree_util.tree_map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
    return loss, grads
