"""Public functions of ``jaxloss`` (SPEC section 3) and their argument handling.

Every function computes, per token ``i`` of the flattened leading shape, the loss ``l_i`` of
its kind (SPEC section 1) and returns ``sum_i w_i l_i / D`` (fp32 scalar) or, for
``normalization="none"``, the per-token ``w_i l_i`` with the labels' shape (SPEC section 2).

Flow of one call:

1. options -> :func:`lossspec.make_config`, shapes/dtypes -> :func:`lossspec.check_inputs`;
   value checks (labels in range, weights, denominator) only for concrete inputs (not JAX
   tracers), so un-traced calls raise and traced ones stay free of host synchronisation;
2. ``prepare`` (jitted): with ``causal_shift`` the ``[..., T]`` labels, mask and host flags
   shifted left by one (weight 0 at the last position; never the logits, ``lossspec.causal``);
   ``valid``, fp32 ``weight``, ``D`` and the per-token coefficient
   ``coef = where(D > 0, weight / D, 0)`` (``weight`` for ``"none"``), the safe labels
   ``where(valid, labels, 0)`` and a flag for bad values seen under tracing;
3. ``loss_tokens`` (jitted ``custom_vjp``): the kernel (XLA or Pallas) computes the per-token loss
   and, in the same pass, ``grad = coef * c * dl/dz`` in the logits' dtype, the only residual;
   the backward multiplies it by the upstream gradient. The kernel is compiled per kind,
   options, shapes and impl, never per normalisation or denominator;
4. ``finish`` (jitted): sum or reshape; NaN when a traced call saw a bad value.

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

from collections.abc import Sequence
from typing import Any, Never, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

import lossspec
from lossspec import LossConfig

from . import backends
from .backends import vocab_parallel as _vocab_parallel
from ._autodiff import Spec, VpSpec, loss_tokens, loss_tokens_vocab_parallel
from ._prepare import (
    array_meta,
    as_array,
    broadcast_mask,
    checked_denominator,
    count_tokens,
    device_ids,
    finish,
    host_labels,
    is_concrete,
    prepare,
    sequence_axes,
    to_device,
)
from .backends.xla import KernelConfig

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
#: a mesh axis name, or a sequence of them (``vocab_parallel=``, ``sequence_parallel=``)
AxisNames = Union[str, Sequence[str]]
F32 = jnp.float32
FORWARD_MODE_MESSAGE = (
    "jaxloss: forward-mode differentiation of the loss (jax.jvp, jax.jacfwd, jax.linearize) is not supported: "
    "the losses are jax.custom_vjp functions, differentiated in reverse mode (jax.grad, jax.vjp, "
    "jax.value_and_grad, jax.jacrev). For second derivatives use forward-over-reverse (jax.hessian, or "
    "jax.jvp of jax.grad) with impl='xla' and float32 logits."
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


def cross_entropy(
    logits: ArrayLike,
    labels: ArrayLike,
    loss_mask: Optional[ArrayLike] = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[ArrayLike] = None,
    segment_ids: Optional[ArrayLike] = None,
    vocab_parallel: Optional[AxisNames] = None,
    sequence_parallel: Optional[AxisNames] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Array:
    """Masked cross-entropy with integer labels, label smoothing and z-loss.

    Per token, with ``z = logit_scale * x``, ``lse = log sum_v exp(z_v)``, ``q = softmax(z)``,
    ``eps = label_smoothing``, ``lam = z_loss``::

        l = lse - (1 - eps) z_y - (eps / V) sum_v z_v + lam lse^2
        dl/dz = (1 + 2 lam lse) q - (1 - eps) onehot(y) - eps / V

    Args:
      logits: ``[..., V]`` floating point (computed in fp32; fp64 in fp64 where the framework can).
      labels: ``[...]`` integers; labels of masked tokens are never read as indices (any value is legal there).
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      ignore_index: label value of ignored tokens: an ``int`` in the int64 range, compared exactly (a label equals it
        only if the labels' dtype can hold it).
      label_smoothing: ``eps`` in ``[0, 1]``.
      z_loss: ``lam >= 0``.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the vocabulary is split, inside
        ``shard_map`` / ``pmap``: ``logits`` is this replica's contiguous slice ``[..., V_local]`` (shards in axis-index
        order, ``V = V_local * P``), labels are global ids. The loss is the same on every replica and the gradient is
        the replica's slice; the statistics are combined with explicit collectives.
      sequence_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the time axis (the last
        leading axis) is split, inside ``shard_map`` / ``pmap`` (context parallelism): each replica holds its contiguous
        time slice (in axis-index order, equal lengths) of the logits, labels, mask and ``segment_ids``. The
        ``[..., T]`` labels, mask and ids are all-gathered (never the logits), so ``n_s``, ``D`` / ``S`` and the causal
        shift are those of the whole rows. The loss is this replica's share (``psum`` it over the axis for the whole
        rows' loss; ``accumulate`` does with ``data_axes`` holding the axis); the gradient is exact
        (lossspec.sequences).
      impl: ``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``. Higher-order derivatives need
        ``"xla"`` with float32/float64 logits and no ``vocab_parallel`` (others raise a clear error).
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and chunk sizes of the kernels.
        ``impl="xla"`` reads ``vocab_block``, ``single_block_vocab`` and ``chunk_elements``, ``"pallas"``
        ``block_rows``, ``vocab_block``, ``num_warps``, ``num_stages``, ``programs``, ``interpret`` and ``debug`` (a ``None``
        field: the backend's default, :mod:`lossspec.tuning`). Static: a new value compiles anew. It changes how rows
        are split into blocks, which may move the result by a rounding, never what is computed.
      inplace: let the gradient take the logits' buffer: the Pallas kernel's gradient aliases the logits
        (``input_output_aliases``), and the logits are not kept for the backward (16-bit logits with a non-unit
        upstream gradient: one more rounding, as with torchloss's). A logits-sized buffer is saved only where the
        logits die at the call (an intermediate inside ``jax.jit``, such as the LM head's output, or a donated
        argument); elsewhere XLA copies them first (the same numbers). The XLA path aliases nothing. See
        docs/jaxloss.md.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
    """
    lossspec.begin_call("cross_entropy", unexpected, normalization, causal_shift, denominator)
    config = lossspec.make_config(
        "cross_entropy",
        normalization=normalization,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
        causal_shift=causal_shift,
    )
    return _loss(config, logits, labels, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace)


def soft_cross_entropy(
    logits: ArrayLike,
    teacher_logits: ArrayLike,
    loss_mask: Optional[ArrayLike] = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[ArrayLike] = None,
    segment_ids: Optional[ArrayLike] = None,
    vocab_parallel: Optional[AxisNames] = None,
    sequence_parallel: Optional[AxisNames] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Array:
    """Masked cross-entropy against the teacher's distribution p.

    Per token, with ``z = logit_scale * x / T``, ``q = softmax(z)`` (student),
    ``p = softmax(teacher_logit_scale * t / T)`` (teacher, no gradient), ``T = temperature``,
    ``lse = log sum_v exp(z_v)`` (no ``T**2`` factor: multiply the loss by ``T**2`` for
    Hinton's scaling)::

        l = lse - sum_v p_v z_v
        dl/dz = q - p

    Args:
      logits: ``[..., V]`` floating point (computed in fp32; fp64 in fp64 where the framework can).
      teacher_logits: ``[..., V]`` floating point, the shape of ``logits``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the vocabulary is split, inside
        ``shard_map`` / ``pmap``: ``logits`` is this replica's contiguous slice ``[..., V_local]`` (shards in axis-index
        order, ``V = V_local * P``), labels are global ids. The loss is the same on every replica and the gradient is
        the replica's slice; the statistics are combined with explicit collectives.
      sequence_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the time axis (the last
        leading axis) is split, inside ``shard_map`` / ``pmap`` (context parallelism): each replica holds its contiguous
        time slice (in axis-index order, equal lengths) of the logits, labels, mask and ``segment_ids``. The
        ``[..., T]`` labels, mask and ids are all-gathered (never the logits), so ``n_s``, ``D`` / ``S`` and the causal
        shift are those of the whole rows. The loss is this replica's share (``psum`` it over the axis for the whole
        rows' loss; ``accumulate`` does with ``data_axes`` holding the axis); the gradient is exact
        (lossspec.sequences).
      impl: ``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``. Higher-order derivatives need
        ``"xla"`` with float32/float64 logits and no ``vocab_parallel`` (others raise a clear error).
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and chunk sizes of the kernels.
        ``impl="xla"`` reads ``vocab_block``, ``single_block_vocab`` and ``chunk_elements``, ``"pallas"``
        ``block_rows``, ``vocab_block``, ``num_warps``, ``num_stages``, ``programs``, ``interpret`` and ``debug`` (a ``None``
        field: the backend's default, :mod:`lossspec.tuning`). Static: a new value compiles anew. It changes how rows
        are split into blocks, which may move the result by a rounding, never what is computed.
      inplace: let the gradient take the logits' buffer: the Pallas kernel's gradient aliases the logits
        (``input_output_aliases``), and the logits are not kept for the backward (16-bit logits with a non-unit
        upstream gradient: one more rounding, as with torchloss's). A logits-sized buffer is saved only where the
        logits die at the call (an intermediate inside ``jax.jit``, such as the LM head's output, or a donated
        argument); elsewhere XLA copies them first (the same numbers). The XLA path aliases nothing. See
        docs/jaxloss.md.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
    """
    lossspec.begin_call("soft_cross_entropy", unexpected, normalization, causal_shift, denominator)
    config = lossspec.make_config(
        "soft_cross_entropy",
        normalization=normalization,
        temperature=temperature,
        logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap,
        causal_shift=causal_shift,
    )
    return _loss(config, logits, teacher_logits, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace)


def forward_kl(
    logits: ArrayLike,
    teacher_logits: ArrayLike,
    loss_mask: Optional[ArrayLike] = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[ArrayLike] = None,
    segment_ids: Optional[ArrayLike] = None,
    vocab_parallel: Optional[AxisNames] = None,
    sequence_parallel: Optional[AxisNames] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Array:
    """Masked forward KL, KL(p || q), of the student q from the teacher p (mean seeking).

    Per token, with ``z = logit_scale * x / T``, ``q = softmax(z)`` (student),
    ``p = softmax(teacher_logit_scale * t / T)`` (teacher, no gradient), ``T = temperature``,
    ``lse = log sum_v exp(z_v)`` (no ``T**2`` factor: multiply the loss by ``T**2`` for
    Hinton's scaling)::

        l = sum_v p_v (log p_v - log q_v)
        dl/dz = q - p

    Args:
      logits: ``[..., V]`` floating point (computed in fp32; fp64 in fp64 where the framework can).
      teacher_logits: ``[..., V]`` floating point, the shape of ``logits``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the vocabulary is split, inside
        ``shard_map`` / ``pmap``: ``logits`` is this replica's contiguous slice ``[..., V_local]`` (shards in axis-index
        order, ``V = V_local * P``), labels are global ids. The loss is the same on every replica and the gradient is
        the replica's slice; the statistics are combined with explicit collectives.
      sequence_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the time axis (the last
        leading axis) is split, inside ``shard_map`` / ``pmap`` (context parallelism): each replica holds its contiguous
        time slice (in axis-index order, equal lengths) of the logits, labels, mask and ``segment_ids``. The
        ``[..., T]`` labels, mask and ids are all-gathered (never the logits), so ``n_s``, ``D`` / ``S`` and the causal
        shift are those of the whole rows. The loss is this replica's share (``psum`` it over the axis for the whole
        rows' loss; ``accumulate`` does with ``data_axes`` holding the axis); the gradient is exact
        (lossspec.sequences).
      impl: ``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``. Higher-order derivatives need
        ``"xla"`` with float32/float64 logits and no ``vocab_parallel`` (others raise a clear error).
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and chunk sizes of the kernels.
        ``impl="xla"`` reads ``vocab_block``, ``single_block_vocab`` and ``chunk_elements``, ``"pallas"``
        ``block_rows``, ``vocab_block``, ``num_warps``, ``num_stages``, ``programs``, ``interpret`` and ``debug`` (a ``None``
        field: the backend's default, :mod:`lossspec.tuning`). Static: a new value compiles anew. It changes how rows
        are split into blocks, which may move the result by a rounding, never what is computed.
      inplace: let the gradient take the logits' buffer: the Pallas kernel's gradient aliases the logits
        (``input_output_aliases``), and the logits are not kept for the backward (16-bit logits with a non-unit
        upstream gradient: one more rounding, as with torchloss's). A logits-sized buffer is saved only where the
        logits die at the call (an intermediate inside ``jax.jit``, such as the LM head's output, or a donated
        argument); elsewhere XLA copies them first (the same numbers). The XLA path aliases nothing. See
        docs/jaxloss.md.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
    """
    lossspec.begin_call("forward_kl", unexpected, normalization, causal_shift, denominator)
    config = lossspec.make_config(
        "forward_kl",
        normalization=normalization,
        temperature=temperature,
        logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap,
        causal_shift=causal_shift,
    )
    return _loss(config, logits, teacher_logits, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace)


def reverse_kl(
    logits: ArrayLike,
    teacher_logits: ArrayLike,
    loss_mask: Optional[ArrayLike] = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[ArrayLike] = None,
    segment_ids: Optional[ArrayLike] = None,
    vocab_parallel: Optional[AxisNames] = None,
    sequence_parallel: Optional[AxisNames] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Array:
    """Masked reverse KL, KL(q || p), of the student q from the teacher p (mode seeking).

    Per token, with ``z = logit_scale * x / T``, ``q = softmax(z)`` (student),
    ``p = softmax(teacher_logit_scale * t / T)`` (teacher, no gradient), ``T = temperature``,
    ``lse = log sum_v exp(z_v)`` (no ``T**2`` factor: multiply the loss by ``T**2`` for
    Hinton's scaling)::

        l = sum_v q_v (log q_v - log p_v)
        dl/dz = q (log q - log p - l)   (0 where q == 0)

    Args:
      logits: ``[..., V]`` floating point (computed in fp32; fp64 in fp64 where the framework can).
      teacher_logits: ``[..., V]`` floating point, the shape of ``logits``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the vocabulary is split, inside
        ``shard_map`` / ``pmap``: ``logits`` is this replica's contiguous slice ``[..., V_local]`` (shards in axis-index
        order, ``V = V_local * P``), labels are global ids. The loss is the same on every replica and the gradient is
        the replica's slice; the statistics are combined with explicit collectives.
      sequence_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the time axis (the last
        leading axis) is split, inside ``shard_map`` / ``pmap`` (context parallelism): each replica holds its contiguous
        time slice (in axis-index order, equal lengths) of the logits, labels, mask and ``segment_ids``. The
        ``[..., T]`` labels, mask and ids are all-gathered (never the logits), so ``n_s``, ``D`` / ``S`` and the causal
        shift are those of the whole rows. The loss is this replica's share (``psum`` it over the axis for the whole
        rows' loss; ``accumulate`` does with ``data_axes`` holding the axis); the gradient is exact
        (lossspec.sequences).
      impl: ``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``. Higher-order derivatives need
        ``"xla"`` with float32/float64 logits and no ``vocab_parallel`` (others raise a clear error).
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and chunk sizes of the kernels.
        ``impl="xla"`` reads ``vocab_block``, ``single_block_vocab`` and ``chunk_elements``, ``"pallas"``
        ``block_rows``, ``vocab_block``, ``num_warps``, ``num_stages``, ``programs``, ``interpret`` and ``debug`` (a ``None``
        field: the backend's default, :mod:`lossspec.tuning`). Static: a new value compiles anew. It changes how rows
        are split into blocks, which may move the result by a rounding, never what is computed.
      inplace: let the gradient take the logits' buffer: the Pallas kernel's gradient aliases the logits
        (``input_output_aliases``), and the logits are not kept for the backward (16-bit logits with a non-unit
        upstream gradient: one more rounding, as with torchloss's). A logits-sized buffer is saved only where the
        logits die at the call (an intermediate inside ``jax.jit``, such as the LM head's output, or a donated
        argument); elsewhere XLA copies them first (the same numbers). The XLA path aliases nothing. See
        docs/jaxloss.md.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
    """
    lossspec.begin_call("reverse_kl", unexpected, normalization, causal_shift, denominator)
    config = lossspec.make_config(
        "reverse_kl",
        normalization=normalization,
        temperature=temperature,
        logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap,
        causal_shift=causal_shift,
    )
    return _loss(config, logits, teacher_logits, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace)


def entropy(
    logits: ArrayLike,
    loss_mask: Optional[ArrayLike] = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[ArrayLike] = None,
    segment_ids: Optional[ArrayLike] = None,
    vocab_parallel: Optional[AxisNames] = None,
    sequence_parallel: Optional[AxisNames] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Array:
    """Masked entropy of the student's distribution q (the entropy regulariser of policy-gradient trainers).

    Per token, with ``z = logit_scale * x / T``, ``q = softmax(z)`` (the student's distribution),
    ``T = temperature``::

        l = -sum_v q_v log q_v
        dl/dz = -q (log q + l)   (0 where q == 0)

    Args:
      logits: ``[..., V]`` floating point (computed in fp32; fp64 in fp64 where the framework can).
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the vocabulary is split, inside
        ``shard_map`` / ``pmap``: ``logits`` is this replica's contiguous slice ``[..., V_local]`` (shards in axis-index
        order, ``V = V_local * P``), labels are global ids. The loss is the same on every replica and the gradient is
        the replica's slice; the statistics are combined with explicit collectives.
      sequence_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the time axis (the last
        leading axis) is split, inside ``shard_map`` / ``pmap`` (context parallelism): each replica holds its contiguous
        time slice (in axis-index order, equal lengths) of the logits, labels, mask and ``segment_ids``. The
        ``[..., T]`` labels, mask and ids are all-gathered (never the logits), so ``n_s``, ``D`` / ``S`` and the causal
        shift are those of the whole rows. The loss is this replica's share (``psum`` it over the axis for the whole
        rows' loss; ``accumulate`` does with ``data_axes`` holding the axis); the gradient is exact
        (lossspec.sequences).
      impl: ``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``. Higher-order derivatives need
        ``"xla"`` with float32/float64 logits and no ``vocab_parallel`` (others raise a clear error).
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and chunk sizes of the kernels.
        ``impl="xla"`` reads ``vocab_block``, ``single_block_vocab`` and ``chunk_elements``, ``"pallas"``
        ``block_rows``, ``vocab_block``, ``num_warps``, ``num_stages``, ``programs``, ``interpret`` and ``debug`` (a ``None``
        field: the backend's default, :mod:`lossspec.tuning`). Static: a new value compiles anew. It changes how rows
        are split into blocks, which may move the result by a rounding, never what is computed.
      inplace: let the gradient take the logits' buffer: the Pallas kernel's gradient aliases the logits
        (``input_output_aliases``), and the logits are not kept for the backward (16-bit logits with a non-unit
        upstream gradient: one more rounding, as with torchloss's). A logits-sized buffer is saved only where the
        logits die at the call (an intermediate inside ``jax.jit``, such as the LM head's output, or a donated
        argument); elsewhere XLA copies them first (the same numbers). The XLA path aliases nothing. See
        docs/jaxloss.md.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
    """
    lossspec.begin_call("entropy", unexpected, normalization, causal_shift, denominator)
    config = lossspec.make_config(
        "entropy",
        normalization=normalization,
        temperature=temperature,
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
        causal_shift=causal_shift,
    )
    return _loss(config, logits, None, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace)


def jensen_shannon(
    logits: ArrayLike,
    teacher_logits: ArrayLike,
    loss_mask: Optional[ArrayLike] = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[ArrayLike] = None,
    segment_ids: Optional[ArrayLike] = None,
    vocab_parallel: Optional[AxisNames] = None,
    sequence_parallel: Optional[AxisNames] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Array:
    """Masked generalised Jensen-Shannon divergence of the student q and the teacher p (on-policy distillation).

    Per token, with ``z = logit_scale * x / T``, ``q = softmax(z)`` (student),
    ``p = softmax(teacher_logit_scale * t / T)`` (teacher, no gradient), ``T = temperature``,
    ``lse = log sum_v exp(z_v)`` (no ``T**2`` factor: multiply the loss by ``T**2`` for
    Hinton's scaling)::

        l = beta KL(p || M) + (1 - beta) KL(q || M),  M = beta p + (1 - beta) q;
        beta = 0: KL(p || q) (forward KL), beta = 1: KL(q || p) (reverse KL), computed as those kinds
        dl/dz = (1 - beta) q (log q - log M - KL(q || M))   (0 where q == 0; the KL kinds' at beta = 0, 1)

    Args:
      logits: ``[..., V]`` floating point (computed in fp32; fp64 in fp64 where the framework can).
      teacher_logits: ``[..., V]`` floating point, the shape of ``logits``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      beta: ``beta`` in ``[0, 1]``, the teacher's share of the mixture ``M = beta p + (1 - beta) q`` (TRL's GKD and
        Liger-Kernel's JSD): 0.5 the symmetric JSD, 0 forward KL ``KL(p || q)``, 1 reverse KL ``KL(q || p)``.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the vocabulary is split, inside
        ``shard_map`` / ``pmap``: ``logits`` is this replica's contiguous slice ``[..., V_local]`` (shards in axis-index
        order, ``V = V_local * P``), labels are global ids. The loss is the same on every replica and the gradient is
        the replica's slice; the statistics are combined with explicit collectives.
      sequence_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the time axis (the last
        leading axis) is split, inside ``shard_map`` / ``pmap`` (context parallelism): each replica holds its contiguous
        time slice (in axis-index order, equal lengths) of the logits, labels, mask and ``segment_ids``. The
        ``[..., T]`` labels, mask and ids are all-gathered (never the logits), so ``n_s``, ``D`` / ``S`` and the causal
        shift are those of the whole rows. The loss is this replica's share (``psum`` it over the axis for the whole
        rows' loss; ``accumulate`` does with ``data_axes`` holding the axis); the gradient is exact
        (lossspec.sequences).
      impl: ``"auto"`` (Pallas on a GPU, XLA elsewhere), ``"xla"`` or ``"pallas"``. Higher-order derivatives need
        ``"xla"`` with float32/float64 logits and no ``vocab_parallel`` (others raise a clear error).
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and chunk sizes of the kernels.
        ``impl="xla"`` reads ``vocab_block``, ``single_block_vocab`` and ``chunk_elements``, ``"pallas"``
        ``block_rows``, ``vocab_block``, ``num_warps``, ``num_stages``, ``programs``, ``interpret`` and ``debug`` (a ``None``
        field: the backend's default, :mod:`lossspec.tuning`). Static: a new value compiles anew. It changes how rows
        are split into blocks, which may move the result by a rounding, never what is computed.
      inplace: let the gradient take the logits' buffer: the Pallas kernel's gradient aliases the logits
        (``input_output_aliases``), and the logits are not kept for the backward (16-bit logits with a non-unit
        upstream gradient: one more rounding, as with torchloss's). A logits-sized buffer is saved only where the
        logits die at the call (an intermediate inside ``jax.jit``, such as the LM head's output, or a donated
        argument); elsewhere XLA copies them first (the same numbers). The XLA path aliases nothing. See
        docs/jaxloss.md.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
    """
    lossspec.begin_call("jensen_shannon", unexpected, normalization, causal_shift, denominator)
    config = lossspec.make_config(
        "jensen_shannon",
        normalization=normalization,
        beta=beta,
        temperature=temperature,
        logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale,
        logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap,
        causal_shift=causal_shift,
    )
    return _loss(config, logits, teacher_logits, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace)


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
    labels = None if labels is None else as_array(labels)
    loss_mask = None if loss_mask is None else as_array(loss_mask)
    segment_ids = None if segment_ids is None else as_array(segment_ids)
    lossspec.check_count_args(
        normalization,
        None if labels is None else array_meta(labels),
        None if loss_mask is None else array_meta(loss_mask),
        causal_shift,
        None if segment_ids is None else array_meta(segment_ids),
    )
    axes = None if sequence_parallel is None else sequence_axes(sequence_parallel)
    config = lossspec.make_config("cross_entropy", ignore_index=ignore_index, normalization=normalization, causal_shift=causal_shift)
    loss_mask = broadcast_mask(loss_mask, tuple(next(a for a in (labels, segment_ids, loss_mask) if a is not None).shape))
    if loss_mask is not None and is_concrete(loss_mask):
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
    return count_tokens(
        config,
        axes,
        tuple(ref.shape),
        None if labels is None else to_device(labels),
        None if loss_mask is None else to_device(loss_mask),
        device_ids(segment_ids, axes),
        None if ignored is None else to_device(ignored),
    )


def resolve_impl(impl: str) -> str:
    """``"auto"`` -> ``"pallas"`` on a GPU backend, else ``"xla"``; other values unchanged
    (the losses' rule of :func:`jaxloss.backends.resolve`)."""
    return backends.resolve(impl).name


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
    tuning: Optional[lossspec.Tuning],
    inplace: bool = False,
) -> Array:
    backend = backends.resolve(impl)  # the one resolution of this call's impl
    tuning = lossspec.check_tuning(tuning)
    lossspec.check_inplace(inplace)
    logits = as_array(logits)
    if target is None:
        # No target (entropy): an empty [..., 0] stand-in carries the leading shape through the
        # shared preparation at no cost; the kernels never read it.
        target = jnp.zeros(tuple(logits.shape[:-1]) + (0,), F32)
        target_meta = None
    else:
        target = as_array(target)
        target_meta = array_meta(target)
    loss_mask = None if loss_mask is None else as_array(loss_mask)
    segment_ids = None if segment_ids is None else as_array(segment_ids)
    lossspec.check_inputs(
        config, array_meta(logits), target_meta, None if loss_mask is None else array_meta(loss_mask), None if segment_ids is None else array_meta(segment_ids)
    )
    loss_mask = broadcast_mask(loss_mask, tuple(logits.shape[:-1]))
    lossspec.check_denominator_allowed(config, denominator)
    time_axes = None
    if sequence_parallel is not None:
        lossspec.check_sequence_parallel_axis(tuple(logits.shape[:-1]))
        time_axes = sequence_axes(sequence_parallel)
    denominator = checked_denominator(denominator)
    if loss_mask is not None and is_concrete(loss_mask):
        # With causal_shift only loss_mask[..., 1:] is ever read (lossspec.causal).
        lossspec.check_weights(np.asarray(loss_mask)[..., 1:] if config.causal_shift else np.asarray(loss_mask))
    lead, vocab = tuple(logits.shape[:-1]), int(logits.shape[-1])
    axes = None
    if vocab_parallel is not None:
        axes = _vocab_parallel.axis_names(vocab_parallel)
        vocab = vocab * _vocab_parallel.axis_size(axes)  # the global V (labels are global ids)
    host_flags = None
    concrete_ids = segment_ids is None or is_concrete(segment_ids)
    if config.has_labels and time_axes is None and is_concrete(target) and (loss_mask is None or is_concrete(loss_mask)) and concrete_ids:
        labels_host = np.asarray(target)
        mask_host = None if loss_mask is None else np.asarray(loss_mask)
        ids_host = None if segment_ids is None else lossspec.scored_segment_ids(np.asarray(segment_ids), lead, config.causal_shift)
        if config.causal_shift:
            labels_host, mask_host = lossspec.shift_targets(labels_host, mask_host, lead)
        valid, _ = lossspec.token_weights(config, labels_host, mask_host, lead, ids_host)
        lossspec.check_labels(labels_host, valid, vocab, config.causal_shift)
    if config.has_labels and isinstance(target, np.ndarray):
        target, host_flags = host_labels(target, config.ignore_index, vocab)
    if config.is_distill:  # teacher logits are data: no gradient
        target = jax.lax.stop_gradient(to_device(target))
    # Only what the coefficients depend on is static here: a new option value (label
    # smoothing, temperature, ...) or another kind with the same target form does not
    # recompile this part.
    coef, safe_target, bad = prepare(
        config.counting_config(),
        vocab,
        time_axes,
        to_device(target),
        None if loss_mask is None else to_device(loss_mask),
        device_ids(segment_ids, time_axes),
        None if denominator is None else to_device(denominator),
        host_flags,
    )
    formula = config.kernel_config()  # jensen_shannon at beta = 0 / 1: the KL kinds, exactly
    kcfg = KernelConfig.of(formula)
    try:
        if axes is None:
            tokens = loss_tokens(Spec(kcfg, backend.name, tuning, inplace), to_device(logits), safe_target, coef)
        else:
            spec = VpSpec(kcfg, backend.name, tuning, inplace, axes=axes, vocab=vocab)
            tokens = loss_tokens_vocab_parallel(spec, to_device(logits), safe_target, coef)
    except TypeError as err:
        if "forward-mode" not in str(err):
            raise
        raise NotImplementedError(FORWARD_MODE_MESSAGE) from err
    return finish(lead if config.normalization == "none" else None, tokens, bad)
