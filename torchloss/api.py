"""Public functions of ``torchloss`` (SPEC section 3) and their autograd Functions.

The four losses are built from ``lossspec``'s per-kind table (the signatures and docstrings of
``jaxloss``' twins). Flow of one call, as in ``jaxloss.api``:

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

from typing import Any, Optional

import torch
from torch import Tensor

import lossspec

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
        return _ops.masked_loss(x2d, prepared.target, prepared.coef, call.config, call.backend.name, call.need_grad)
    function = FUNCTIONS[call.config.kind]
    # The anchor ties a create_graph=True gradient to the logits (First order only, docs/DESIGN.md).
    anchor = second_order_anchor(x2d) if call.need_grad else None
    return function.apply(x2d, prepared.target, prepared.coef, call.config, call.kernels, call.need_grad, call.inplace, anchor)


def _masked_loss(kind: str, **args: Any) -> Tensor:
    """Body of the four public functions (their signatures: ``lossspec.KIND_SPECS``)."""
    spec = lossspec.KIND_SPECS[kind]
    options = {name: args[name] for name in spec.option_names}
    # jensen_shannon at beta = 0 / 1 is computed as forward / reverse KL, exactly (LossConfig.formula).
    config = lossspec.make_config(kind, normalization=args["normalization"], **options).kernel_config()
    target = args[spec.target] if spec.target is not None else None
    backend = backends.resolve(args["impl"], args["logits"])  # the one resolution of this call's impl
    call = validate(
        config,
        args["logits"],
        target,
        args["loss_mask"],
        args["segment_ids"],
        args["denominator"],
        args["vocab_parallel"],
        args["sequence_parallel"],
        backend,
        args["inplace"],
    )
    prepared = prepare(call)
    return finish(call, prepared, _apply(call, prepared))


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
