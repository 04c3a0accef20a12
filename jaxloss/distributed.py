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

import lossspec

from ._stats import varying_axes
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
) -> jax.Array:
    """``D`` of the global batch: the count of every token given (any stacked leading
    micro-batch axes count too, since counts add up), ``psum``-ed over ``data_axes`` (names of
    data-parallel mesh/pmap axes; call inside ``shard_map``/``pmap``). fp32 scalar.

    ``"valid_tokens"``: sum of the weights of valid tokens; ``"tokens"``: number of positions.
    """
    count = count_denominator(labels, loss_mask, normalization=normalization, ignore_index=ignore_index)
    axes = _axes(data_axes)
    return jax.lax.psum(count, axes) if axes else count


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Reshape every leaf ``[B, ...]`` to ``[K, B / K, ...]`` (``B`` divisible by ``K``)."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int; got {num_microbatches!r}")

    def split(leaf: jax.Array) -> jax.Array:
        leaf = jnp.asarray(leaf)
        if leaf.ndim == 0 or leaf.shape[0] % num_microbatches:
            raise ValueError(
                f"every batch leaf needs a leading batch axis divisible by num_microbatches={num_microbatches}; "
                f"got shape {tuple(leaf.shape)}"
            )
        return leaf.reshape((num_microbatches, leaf.shape[0] // num_microbatches) + leaf.shape[1:])

    return jax.tree_util.tree_map(split, batch)


def _default_count_fn(normalization: str, ignore_index: int, labels_key: str, mask_key: str) -> Callable[[Any], jax.Array]:
    def count(microbatch: Any) -> jax.Array:
        if not isinstance(microbatch, dict):
            raise TypeError("accumulate needs count_fn= unless the batch is a dict with labels/loss_mask entries")
        labels, mask = microbatch.get(labels_key), microbatch.get(mask_key)
        if labels is None and mask is None:
            raise ValueError(f"the batch has neither {labels_key!r} nor {mask_key!r}; pass count_fn= to count it")
        return count_denominator(labels, mask, normalization=normalization, ignore_index=ignore_index)

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
) -> tuple[jax.Array, Any]:
    """One optimizer step's loss and gradients, split into micro-batches (and replicas).

    Args:
      loss_fn: ``loss_fn(params, microbatch, denominator) -> scalar``: the user's model and loss,
        which passes ``denominator=denominator`` to a ``jaxloss`` loss (with the same
        ``normalization``).
      params: the pytree to differentiate.
      batch: a pytree whose leaves have a leading batch axis ``B`` divisible by ``num_microbatches``.
      num_microbatches: ``K``; micro-batch ``k`` holds rows ``[k B/K, (k+1) B/K)``.
      normalization: ``"valid_tokens"`` or ``"tokens"`` (counted over the global batch) or
        ``"sum"`` (``D = 1``). ``"none"`` has no scalar loss to differentiate.
      count_fn: ``count_fn(microbatch) -> count``; default: ``count_denominator`` of the
        ``labels_key``/``mask_key`` entries of a dict batch.
      data_axes: data-parallel axis name(s) when called inside ``shard_map``/``pmap``: the count,
        the loss and the gradients are ``psum``-ed over them.

    Returns:
      ``(loss, grads)``: the full-batch loss (fp32; the sum over micro-batches and replicas,
      not a mean of means) and gradients (summed in fp32, cast back to each parameter's dtype).

    Pass 1 counts every micro-batch (cheap: labels and masks only); pass 2 is a ``lax.scan``
    that sums ``value_and_grad(loss_fn)`` over the micro-batches. Works under ``jit``,
    ``shard_map`` and ``pmap``.
    """
    lossspec.check_normalization(normalization)
    if normalization == "none":
        raise ValueError("accumulate needs a scalar loss: normalization must be 'valid_tokens', 'tokens' or 'sum', not 'none'")
    axes = _axes(data_axes)
    microbatches = split_microbatches(batch, num_microbatches)
    if normalization in lossspec.COUNTED_NORMALIZATIONS:
        count = count_fn or _default_count_fn(normalization, ignore_index, labels_key, mask_key)
        denominator = jnp.sum(jax.vmap(count)(microbatches)).astype(jnp.float32)
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
    first = jax.tree_util.tree_map(lambda leaf: leaf[0], microbatches)
    rest = jax.tree_util.tree_map(lambda leaf: leaf[1:], microbatches)
    (loss, grads), _ = jax.lax.scan(step, microbatch_grads(first), rest)
    if axes:
        loss, grads = _sum_over_replicas(loss, grads, axes)
    grads = jax.tree_util.tree_map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
    return loss, grads
