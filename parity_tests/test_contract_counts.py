"""Contract, SPEC section 4 (global normalisation: the two-pass step), on every backend
(parity_tests/support/backends.py) against the float64 oracle.

``count_denominator`` (one per framework: it has no ``impl=``) against ``lossspec.count_denominator``
for every counted mode, with and without the causal shift, ``segment_ids`` and masks that
broadcast; and the step itself: rows split into micro-batches (uneven, one empty), each counted,
the counts summed, each micro-batch's loss called with that ``denominator=``, the losses and
gradients summed: the full batch's loss and gradient within the bounds of section 6. The
helpers that do the whole step (``accumulate``, data parallelism) are framework-specific:
test_accumulate_split.py, test_distributed_*.py.
"""

from __future__ import annotations

import numpy as np

import lossspec
from lossspec import ALL_KINDS, COUNTED_NORMALIZATIONS, KIND_SPECS

from parity_tests.support.backends import Backend, over_backends, over_frameworks, sample_options
from parity_tests.support.packed_problem import BATCH, TIME, packed_case


@over_frameworks("normalization", COUNTED_NORMALIZATIONS, xla_fast=lambda normalization: normalization == "valid_tokens")
def test_count_denominator_matches_oracle(backend: Backend, normalization: str) -> None:
    """``D`` (or ``S``) of one batch: labels and mask, mask only, labels only; boolean and float
    masks, a mask that broadcasts (``[T]``); ``causal_shift=True`` counts ``labels[..., 1:]`` /
    ``loss_mask[..., 1:]``; ``segment_ids``. Integer counts exactly, weight sums within the loss
    bound (a float32 sum)."""
    case, ids = packed_case(ALL_KINDS[0], float_weights=True)
    labels, weights = case.target, case.loss_mask
    # (labels, loss_mask, causal_shift, segment_ids): each argument in two forms (JAX compiles per call form)
    calls = [(labels, weights != 0, False, None), (None, weights, True, ids), (labels, weights[0].copy(), True, None), (labels, None, False, ids)]
    for count_labels, mask, shift, segment_ids in calls:
        options = dict(normalization=normalization, causal_shift=shift, segment_ids=segment_ids)
        want = lossspec.count_denominator(count_labels, mask, **options)
        got = backend.count_denominator(count_labels, mask, **options)
        what = f"{backend.framework} count {normalization} shift={shift} ids={segment_ids is not None} mask={None if mask is None else mask.shape}"
        if mask is None or mask.dtype == bool:
            assert got == want, f"{what}: {got} != {want}"
        else:
            lossspec.compare_loss(got, want, what).check()


# Rows of each micro-batch: two halves (uneven valid counts) and an empty one between them
# (two shapes: JAX compiles per shape).
def _splits(rows: int) -> list[slice]:
    half = rows // 2
    return [slice(0, half), slice(half, half), slice(half, rows)]


STEP_MODES = COUNTED_NORMALIZATIONS + ("sum",)


@over_backends("normalization", STEP_MODES, cover=lambda normalization: normalization in ("valid_tokens", "sequence_mean"),
               xla_fast=lambda normalization: normalization == "valid_tokens")
def test_two_pass_step_equals_full_batch(backend: Backend, normalization: str) -> None:
    """Pass 1 counts every micro-batch (``count_denominator``, summed; ``"sum"`` has no count:
    ``D = 1``), pass 2 calls each micro-batch with ``denominator=D``; the summed losses and the
    micro-batches' gradients are the full batch's (causal shift, ``segment_ids``, float weights,
    every option of the kind)."""
    kind = ALL_KINDS[STEP_MODES.index(normalization) % len(ALL_KINDS)]
    case, ids = packed_case(kind, float_weights=True, lead=backend.sized((BATCH, TIME), (4, TIME // 2)))
    options = dict(sample_options(kind), causal_shift=True)
    labels = case.target if KIND_SPECS[kind].has_labels else None
    parts = _splits(case.logits.shape[0])
    if normalization == "sum":
        denominator = None
    else:
        denominator = sum(backend.count_denominator(None if labels is None else labels[part], case.loss_mask[part],
                                                    normalization=normalization, causal_shift=True, segment_ids=ids[part])
                          for part in parts)
    loss, grads = 0.0, []
    for part in parts:
        target = None if case.target is None else case.target[part]
        out = backend.run(kind, case.logits[part], target, case.loss_mask[part], normalization=normalization,
                          denominator=denominator, segment_ids=ids[part], **options)
        loss += float(out.loss)
        grads.append(out.grad)
    ref = case.reference(normalization=normalization, segment_ids=ids, **options)
    lossspec.assert_close_to_oracle(np.float64(loss), np.concatenate(grads), ref.loss, ref.grad, dtype="float32", g0=ref.g0,
                                    what=f"{backend.id} {kind} {normalization} in {len(parts)} micro-batches")
