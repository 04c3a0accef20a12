"""Public functions of ``torchloss`` (SPEC section 3) and their autograd Functions.

The six losses are written out with the signatures of ``lossspec``'s per-kind table
(:func:`lossspec.kinds.parameters`: those of ``jaxloss``' twins, plus ``inplace``). Flow of one
call, as in ``jaxloss.api``:

1. :func:`validate`: options -> :func:`lossspec.make_config`, tensors, shapes, dtypes,
   devices, ``inplace``; value checks (labels in range, weights, denominator) where they are
   free (CPU tensors outside tracing), so a CUDA call never synchronises with the host;
2. :func:`prepare`: ``valid``, the weights, ``D`` and the per-token coefficient
   ``coef = where(D > 0, weight / D, 0)`` (``weight`` for ``"none"``), the safe labels
   ``where(valid, labels, 0)`` and a flag for bad values that could not be checked eagerly;
3. :func:`_apply`: the kind's autograd Function (:mod:`torchloss._autodiff`): its forward computes the loss *and*
   ``grad = coef * c * dl/dz`` in one read of the logits (the torch path, the Triton kernel,
   or their vocab-parallel twin); its backward multiplies that gradient by the upstream
   gradient (or, for bf16/fp16 logits and an upstream gradient that is not exactly 1,
   recomputes it with ``coef`` times the upstream gradient, so that it is rounded once);
4. :func:`finish`: NaN when a value check was deferred and failed; per-token shape for
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

from typing import TYPE_CHECKING, Any, Never, Optional

import torch
from torch import Tensor

import lossspec
from lossspec import LossConfig

from . import _ops, _prepare, backends
from ._autodiff import (  # noqa: F401  (the Function classes are public here)
    FUNCTIONS,
    CrossEntropyFunction,
    EntropyFunction,
    ForwardKLFunction,
    JensenShannonFunction,
    MaskedLossFunction,
    ReverseKLFunction,
    SoftCrossEntropyFunction,
    second_order_anchor,
)
from ._prepare import (
    Call,
    Denominator,  # noqa: F401  (the type of denominator= in linear.py and nn.py)
    Prepared,
    array_meta,
    bad_weights,
    broadcast_mask,
    check_device,
    check_process_group,
    finish,
    full_rows,
    ignore_index_matches,
    labels_int64,
    prepare,
    require_tensor,
    scored_segment_ids,
    scored_targets,
    sequence_count,
    shift_left,
    to_numpy,
    validate,
    weights_of,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

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


# ----------------------------------------------------------------------------------------------
# 3. Apply, 4. finish
# ----------------------------------------------------------------------------------------------


def _apply(call: Call, prepared: Prepared) -> Tensor:
    """The loss through the kind's autograd Function (eager), or through the custom op
    ``torchloss::masked_loss`` while Dynamo traces (:mod:`torchloss._ops`); both run the same
    backend code. Compiled calls never carry ``inplace=True`` or a vocab-parallel backend
    (:func:`_loss_call` runs those eagerly)."""
    logits = call.logits
    x2d = logits.reshape(-1, logits.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if torch.compiler.is_compiling():
        # The custom op takes the impl's name (vocab-parallel calls never get here: _loss_call).
        return _ops.masked_loss(x2d, prepared.target, prepared.coef, call.config, call.backend.name, call.need_grad, call.tuning)
    function = FUNCTIONS[call.config.kind]
    # The anchor ties a create_graph=True gradient to the logits (First order only, docs/DESIGN.md).
    anchor = second_order_anchor(x2d) if call.need_grad else None
    return function.apply(x2d, prepared.target, prepared.coef, call.config, call.kernels, call.need_grad, call.inplace, anchor, call.tuning)


def _masked_loss(
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
    inplace: bool,
) -> Tensor:
    """Steps 1-4 of one call with the validated ``config`` (the body of the public functions)."""
    # jensen_shannon at beta = 0 / 1 is computed as forward / reverse KL, exactly (LossConfig.formula).
    backend = backends.resolve(impl, logits)  # the one resolution of this call's impl
    call = validate(
        config.kernel_config(), logits, target, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, backend, inplace, tuning
    )
    prepared = prepare(call)
    return finish(call, prepared, _apply(call, prepared))


# ----------------------------------------------------------------------------------------------
# Public functions (SPEC section 3)
# ----------------------------------------------------------------------------------------------

_EAGER_UNDER_COMPILE = (
    "torchloss: a loss call with vocab_parallel= or sequence_parallel= (collectives made from Python) or inplace=True (writes the "
    "gradient into the logits' buffer, which a compiled graph cannot express) runs eagerly under torch.compile: "
    "one graph break, so fullgraph=True refuses it. Drop inplace=True / call the vocab-parallel loss outside "
    "the compiled region to keep one graph"
)


@torch.compiler.disable(reason=_EAGER_UNDER_COMPILE)
def _eager_loss_call(*args: Any) -> Tensor:
    """:func:`_masked_loss` behind a graph break (see :data:`_EAGER_UNDER_COMPILE`)."""
    return _masked_loss(*args)


def _loss_call(
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
    inplace: bool,
) -> Tensor:
    """Body of the public functions. Eagerly and under ``torch.compile`` alike:
    :func:`_masked_loss` (traced by Dynamo: the checks become guards and on-device flags, the
    kernel call the custom op of :mod:`torchloss._ops`), except that under ``torch.compile``
    calls with ``vocab_parallel=``, ``sequence_parallel=`` or ``inplace=True`` run eagerly behind a graph break."""
    args = (config, logits, target, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace)
    collectives = vocab_parallel is not None or sequence_parallel is not None
    if torch.compiler.is_compiling() and (collectives or inplace is not False):
        return _eager_loss_call(*args)
    return _masked_loss(*args)


def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    segment_ids: Optional[Tensor] = None,
    vocab_parallel: Optional[ProcessGroup] = None,
    sequence_parallel: Optional[ProcessGroup] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Tensor:
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
      vocab_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the vocabulary is split, or ``None``. Each
        rank passes its contiguous shard ``logits[..., V_local]`` (shards in rank order, sizes may differ, each >= 1)
        and the *global* labels; the loss is the same on every rank and the gradient is the rank's own slice.
        Collectives are explicit ``all_reduce`` calls in the forward, so every rank of the group must make the call.
        ``D`` is not reduced over this group (same tokens).
      sequence_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the time axis (the last leading axis) is
        split (context parallelism), or ``None``. Each rank passes its contiguous time slice (in rank order; lengths may
        differ) of the logits, labels, mask and ``segment_ids``; the ``[..., T]`` labels, mask and ids are all-gathered
        (never the logits) so that ``n_s``, ``D`` / ``S`` and the causal shift are those of the whole rows. The loss is
        this rank's share (sum it over the group for the whole rows' loss); the gradient is exact. Every rank of the
        group must make the call (lossspec.sequences).
      impl: ``"auto"`` (Triton on CUDA tensors, the torch path elsewhere), ``"torch"`` or ``"triton"``.
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and tile sizes of the kernels.
        ``impl="torch"`` reads ``vocab_block`` and ``cpu_tile_elements``, ``"triton"`` ``vocab_block``,
        ``num_warps``, ``num_stages`` and ``programs`` (a ``None`` field: the backend's default, :mod:`lossspec.tuning`). Under ``torch.compile``
        its fields are constants of the graph (a new value recompiles). It changes how rows are split into blocks,
        which may move the result by a rounding, never what is computed.
      inplace: write the gradient into the logits' buffer (logits must be the non-leaf output of an operation,
        contiguous, and not used elsewhere in the graph; see docs/torchloss.md).
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
    return _loss_call(
        config, logits, labels, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace
    )


def soft_cross_entropy(
    logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    segment_ids: Optional[Tensor] = None,
    vocab_parallel: Optional[ProcessGroup] = None,
    sequence_parallel: Optional[ProcessGroup] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Tensor:
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
      vocab_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the vocabulary is split, or ``None``. Each
        rank passes its contiguous shard ``logits[..., V_local]`` (shards in rank order, sizes may differ, each >= 1)
        and the *global* labels; the loss is the same on every rank and the gradient is the rank's own slice.
        Collectives are explicit ``all_reduce`` calls in the forward, so every rank of the group must make the call.
        ``D`` is not reduced over this group (same tokens).
      sequence_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the time axis (the last leading axis) is
        split (context parallelism), or ``None``. Each rank passes its contiguous time slice (in rank order; lengths may
        differ) of the logits, labels, mask and ``segment_ids``; the ``[..., T]`` labels, mask and ids are all-gathered
        (never the logits) so that ``n_s``, ``D`` / ``S`` and the causal shift are those of the whole rows. The loss is
        this rank's share (sum it over the group for the whole rows' loss); the gradient is exact. Every rank of the
        group must make the call (lossspec.sequences).
      impl: ``"auto"`` (Triton on CUDA tensors, the torch path elsewhere), ``"torch"`` or ``"triton"``.
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and tile sizes of the kernels.
        ``impl="torch"`` reads ``vocab_block`` and ``cpu_tile_elements``, ``"triton"`` ``vocab_block``,
        ``num_warps``, ``num_stages`` and ``programs`` (a ``None`` field: the backend's default, :mod:`lossspec.tuning`). Under ``torch.compile``
        its fields are constants of the graph (a new value recompiles). It changes how rows are split into blocks,
        which may move the result by a rounding, never what is computed.
      inplace: write the gradient into the logits' buffer (logits must be the non-leaf output of an operation,
        contiguous, and not used elsewhere in the graph; see docs/torchloss.md).
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
    return _loss_call(
        config, logits, teacher_logits, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace
    )


def forward_kl(
    logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    segment_ids: Optional[Tensor] = None,
    vocab_parallel: Optional[ProcessGroup] = None,
    sequence_parallel: Optional[ProcessGroup] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Tensor:
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
      vocab_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the vocabulary is split, or ``None``. Each
        rank passes its contiguous shard ``logits[..., V_local]`` (shards in rank order, sizes may differ, each >= 1)
        and the *global* labels; the loss is the same on every rank and the gradient is the rank's own slice.
        Collectives are explicit ``all_reduce`` calls in the forward, so every rank of the group must make the call.
        ``D`` is not reduced over this group (same tokens).
      sequence_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the time axis (the last leading axis) is
        split (context parallelism), or ``None``. Each rank passes its contiguous time slice (in rank order; lengths may
        differ) of the logits, labels, mask and ``segment_ids``; the ``[..., T]`` labels, mask and ids are all-gathered
        (never the logits) so that ``n_s``, ``D`` / ``S`` and the causal shift are those of the whole rows. The loss is
        this rank's share (sum it over the group for the whole rows' loss); the gradient is exact. Every rank of the
        group must make the call (lossspec.sequences).
      impl: ``"auto"`` (Triton on CUDA tensors, the torch path elsewhere), ``"torch"`` or ``"triton"``.
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and tile sizes of the kernels.
        ``impl="torch"`` reads ``vocab_block`` and ``cpu_tile_elements``, ``"triton"`` ``vocab_block``,
        ``num_warps``, ``num_stages`` and ``programs`` (a ``None`` field: the backend's default, :mod:`lossspec.tuning`). Under ``torch.compile``
        its fields are constants of the graph (a new value recompiles). It changes how rows are split into blocks,
        which may move the result by a rounding, never what is computed.
      inplace: write the gradient into the logits' buffer (logits must be the non-leaf output of an operation,
        contiguous, and not used elsewhere in the graph; see docs/torchloss.md).
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
    return _loss_call(
        config, logits, teacher_logits, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace
    )


def reverse_kl(
    logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    segment_ids: Optional[Tensor] = None,
    vocab_parallel: Optional[ProcessGroup] = None,
    sequence_parallel: Optional[ProcessGroup] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Tensor:
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
      vocab_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the vocabulary is split, or ``None``. Each
        rank passes its contiguous shard ``logits[..., V_local]`` (shards in rank order, sizes may differ, each >= 1)
        and the *global* labels; the loss is the same on every rank and the gradient is the rank's own slice.
        Collectives are explicit ``all_reduce`` calls in the forward, so every rank of the group must make the call.
        ``D`` is not reduced over this group (same tokens).
      sequence_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the time axis (the last leading axis) is
        split (context parallelism), or ``None``. Each rank passes its contiguous time slice (in rank order; lengths may
        differ) of the logits, labels, mask and ``segment_ids``; the ``[..., T]`` labels, mask and ids are all-gathered
        (never the logits) so that ``n_s``, ``D`` / ``S`` and the causal shift are those of the whole rows. The loss is
        this rank's share (sum it over the group for the whole rows' loss); the gradient is exact. Every rank of the
        group must make the call (lossspec.sequences).
      impl: ``"auto"`` (Triton on CUDA tensors, the torch path elsewhere), ``"torch"`` or ``"triton"``.
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and tile sizes of the kernels.
        ``impl="torch"`` reads ``vocab_block`` and ``cpu_tile_elements``, ``"triton"`` ``vocab_block``,
        ``num_warps``, ``num_stages`` and ``programs`` (a ``None`` field: the backend's default, :mod:`lossspec.tuning`). Under ``torch.compile``
        its fields are constants of the graph (a new value recompiles). It changes how rows are split into blocks,
        which may move the result by a rounding, never what is computed.
      inplace: write the gradient into the logits' buffer (logits must be the non-leaf output of an operation,
        contiguous, and not used elsewhere in the graph; see docs/torchloss.md).
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
    return _loss_call(
        config, logits, teacher_logits, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace
    )


def entropy(
    logits: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    segment_ids: Optional[Tensor] = None,
    vocab_parallel: Optional[ProcessGroup] = None,
    sequence_parallel: Optional[ProcessGroup] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Tensor:
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
      vocab_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the vocabulary is split, or ``None``. Each
        rank passes its contiguous shard ``logits[..., V_local]`` (shards in rank order, sizes may differ, each >= 1)
        and the *global* labels; the loss is the same on every rank and the gradient is the rank's own slice.
        Collectives are explicit ``all_reduce`` calls in the forward, so every rank of the group must make the call.
        ``D`` is not reduced over this group (same tokens).
      sequence_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the time axis (the last leading axis) is
        split (context parallelism), or ``None``. Each rank passes its contiguous time slice (in rank order; lengths may
        differ) of the logits, labels, mask and ``segment_ids``; the ``[..., T]`` labels, mask and ids are all-gathered
        (never the logits) so that ``n_s``, ``D`` / ``S`` and the causal shift are those of the whole rows. The loss is
        this rank's share (sum it over the group for the whole rows' loss); the gradient is exact. Every rank of the
        group must make the call (lossspec.sequences).
      impl: ``"auto"`` (Triton on CUDA tensors, the torch path elsewhere), ``"torch"`` or ``"triton"``.
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and tile sizes of the kernels.
        ``impl="torch"`` reads ``vocab_block`` and ``cpu_tile_elements``, ``"triton"`` ``vocab_block``,
        ``num_warps``, ``num_stages`` and ``programs`` (a ``None`` field: the backend's default, :mod:`lossspec.tuning`). Under ``torch.compile``
        its fields are constants of the graph (a new value recompiles). It changes how rows are split into blocks,
        which may move the result by a rounding, never what is computed.
      inplace: write the gradient into the logits' buffer (logits must be the non-leaf output of an operation,
        contiguous, and not used elsewhere in the graph; see docs/torchloss.md).
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
    return _loss_call(
        config, logits, None, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace
    )


def jensen_shannon(
    logits: Tensor,
    teacher_logits: Tensor,
    loss_mask: Optional[Tensor] = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Denominator = None,
    segment_ids: Optional[Tensor] = None,
    vocab_parallel: Optional[ProcessGroup] = None,
    sequence_parallel: Optional[ProcessGroup] = None,
    impl: str = "auto",
    tuning: Optional[lossspec.Tuning] = None,
    inplace: bool = False,
    **unexpected: Never,
) -> Tensor:
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
      vocab_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the vocabulary is split, or ``None``. Each
        rank passes its contiguous shard ``logits[..., V_local]`` (shards in rank order, sizes may differ, each >= 1)
        and the *global* labels; the loss is the same on every rank and the gradient is the rank's own slice.
        Collectives are explicit ``all_reduce`` calls in the forward, so every rank of the group must make the call.
        ``D`` is not reduced over this group (same tokens).
      sequence_parallel: a ``torch.distributed`` ``ProcessGroup`` over which the time axis (the last leading axis) is
        split (context parallelism), or ``None``. Each rank passes its contiguous time slice (in rank order; lengths may
        differ) of the logits, labels, mask and ``segment_ids``; the ``[..., T]`` labels, mask and ids are all-gathered
        (never the logits) so that ``n_s``, ``D`` / ``S`` and the causal shift are those of the whole rows. The loss is
        this rank's share (sum it over the group for the whole rows' loss); the gradient is exact. Every rank of the
        group must make the call (lossspec.sequences).
      impl: ``"auto"`` (Triton on CUDA tensors, the torch path elsewhere), ``"torch"`` or ``"triton"``.
      tuning: ``None`` (the defaults) or a :class:`lossspec.Tuning`: the block and tile sizes of the kernels.
        ``impl="torch"`` reads ``vocab_block`` and ``cpu_tile_elements``, ``"triton"`` ``vocab_block``,
        ``num_warps``, ``num_stages`` and ``programs`` (a ``None`` field: the backend's default, :mod:`lossspec.tuning`). Under ``torch.compile``
        its fields are constants of the graph (a new value recompiles). It changes how rows are split into blocks,
        which may move the result by a rounding, never what is computed.
      inplace: write the gradient into the logits' buffer (logits must be the non-leaf output of an operation,
        contiguous, and not used elsewhere in the graph; see docs/torchloss.md).
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
    return _loss_call(
        config, logits, teacher_logits, loss_mask, segment_ids, denominator, vocab_parallel, sequence_parallel, impl, tuning, inplace
    )


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
        labels = require_tensor("labels", labels)
    if loss_mask is not None:
        loss_mask = require_tensor("loss_mask", loss_mask)
    if segment_ids is not None:
        segment_ids = require_tensor("segment_ids", segment_ids)
    lossspec.check_count_args(
        normalization,
        None if labels is None else array_meta(labels),
        None if loss_mask is None else array_meta(loss_mask),
        causal_shift,
        None if segment_ids is None else array_meta(segment_ids),
    )
    config = lossspec.make_config("cross_entropy", ignore_index=ignore_index, normalization=normalization, causal_shift=causal_shift)
    loss_mask = broadcast_mask(loss_mask, tuple(next(t for t in (labels, segment_ids, loss_mask) if t is not None).shape))
    ref = next(t for t in (labels, loss_mask, segment_ids) if t is not None)
    device = ref.device
    check_device("loss_mask", loss_mask, device)
    check_device("segment_ids", segment_ids, device)
    if sequence_parallel is not None:
        check_process_group(sequence_parallel, "sequence_parallel")
    lead = tuple(ref.shape)
    ignore_matches = ignore_index_matches(labels, config.ignore_index)
    (labels, loss_mask, segment_ids), full_lead, window = full_rows(
        sequence_parallel, (None if labels is None else labels_int64(labels), loss_mask, segment_ids), lead, device
    )
    if normalization == "tokens":
        scored = torch.ones(full_lead, dtype=torch.float32, device=device)
        if causal_shift:  # the last position of each row is not scored
            scored = shift_left(scored, 0.0)
        return (scored if window is None else window.take(scored)).sum()
    host = _prepare.host_readable(labels, loss_mask, segment_ids)  # a module attribute: tests turn it off
    float_mask = loss_mask is not None and loss_mask.dtype != torch.bool
    if host and float_mask:
        lossspec.check_weights(to_numpy(loss_mask[..., 1:] if causal_shift else loss_mask))
    bad = bad_weights(loss_mask[..., 1:] if causal_shift else loss_mask) if float_mask and not host else None
    labels, loss_mask = scored_targets(causal_shift, labels, loss_mask, full_lead, device)
    ids = scored_segment_ids(config, segment_ids, full_lead, device)
    _, weight = weights_of(config, labels, loss_mask, full_lead, device, torch.float32, ids, ignore_matches)
    if config.per_sequence:
        _, counted = sequence_count(weight, ids)  # type: ignore[arg-type]
        weight = counted.to(torch.float32)
    count = (weight if window is None else window.take(weight)).sum()
    if bad is not None:
        count = count + torch.where(bad, float("nan"), 0.0)
    return count
