"""Contract, SPEC section 2's per-sequence normalisation (``segment_ids``, ``"sequence_mean"``,
``"sequence_sum"``) and causal-LM shift (``causal_shift=True``), on every backend
(parity_tests/support/backends.py) against the float64 oracle.

Packed rows (parity_tests/support/packed_problem.py: documents of 1 to 12 tokens, padding ids
``< 0`` whose mask is 1, ids reused across rows, large and interleaved ids, an all-masked document
and row). The counts of these modes (``count_denominator``) and the two-pass step:
test_contract_counts.py; sequence parallelism: test_sequence_parallel.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import lossspec
from lossspec import ALL_KINDS, KIND_SPECS, NORMALIZATIONS, SEQUENCE_NORMALIZATIONS, make_case

from parity_tests.support.backends import VOCAB, Backend, check, kinds_by_target, never, over_backends, sample_options
from parity_tests.support.packed_problem import BATCH, TIME, packed_case

MODE_KINDS = [(mode, kind) for mode in SEQUENCE_NORMALIZATIONS for kind in ALL_KINDS]


def _packed(backend: Backend, kind: str, **kwargs: object) -> tuple[lossspec.Case, np.ndarray]:
    return packed_case(kind, lead=backend.sized((BATCH, TIME), (4, TIME)), **kwargs)  # type: ignore[arg-type]


def _cover(mode: str, kind: str) -> bool:
    """JAX's and the kernels' rotation (the sequence rules are the prepare stage's, the kind's
    only through its target): each mode, each type of target."""
    return kind in kinds_by_target() and kinds_by_target().index(kind) % 2 == SEQUENCE_NORMALIZATIONS.index(mode)


@over_backends("mode,kind", MODE_KINDS, cover=_cover, xla_fast=lambda mode, kind: kind == ALL_KINDS[0])
def test_sequence_modes_match_oracle(backend: Backend, mode: str, kind: str) -> None:
    """``"sequence_mean"``: ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i``; ``"sequence_sum"``:
    ``(1/S) sum_s sum_{i in s} w_i l_i``; ``S`` the sequences with ``n_s > 0``; padding ids weigh
    0 (gradient exactly 0 there). With the causal shift a position is scored only if the next
    token is of its document (never across a boundary)."""
    options = sample_options(kind)
    for float_weights, shift in ((False, False), (True, True)):
        case, ids = _packed(backend, kind, float_weights=float_weights)
        out = check(backend, case, normalization=mode, segment_ids=ids, causal_shift=shift, **options)
        assert np.all(out.grad[ids < 0] == 0.0), "a gradient at padding"
        if shift:  # position t predicts t + 1: not scored where the next token is another document's
            crossing = np.zeros(ids.shape, bool)
            crossing[:, :-1] = ids[:, :-1] != ids[:, 1:]
            assert np.all(out.grad[crossing] == 0.0), "scored across a document boundary"


@over_backends("mode", SEQUENCE_NORMALIZATIONS, cover=lambda mode: mode == SEQUENCE_NORMALIZATIONS[-1], xla_fast=never)
def test_rows_are_the_sequences_without_segment_ids(backend: Backend, mode: str) -> None:
    """Without ``segment_ids`` each row of the leading shape is one sequence."""
    kind = ALL_KINDS[-1 - SEQUENCE_NORMALIZATIONS.index(mode)]
    case, ids = _packed(backend, kind, float_weights=True, seed=1)
    if KIND_SPECS[kind].has_labels:  # every position is read without ids: no garbage labels there
        case = dataclasses.replace(case, target=np.where(ids < 0, 0, case.target))
    check(backend, case, normalization=mode, **sample_options(kind))


@over_backends("normalization", NORMALIZATIONS, cover=lambda normalization: normalization == "none", xla_fast=never)
def test_segment_ids_in_token_modes(backend: Backend, normalization: str) -> None:
    """Padding ids (``< 0``) weigh 0 in the token modes too, with and without the shift (each
    mode with another kind)."""
    kind = ALL_KINDS[NORMALIZATIONS.index(normalization)]
    case, ids = _packed(backend, kind, float_weights=True, seed=2)
    for shift in (False, True):
        out = check(backend, case, normalization=normalization, segment_ids=ids, causal_shift=shift, **sample_options(kind))
        assert np.all(out.grad[ids < 0] == 0.0)


@over_backends("mode", SEQUENCE_NORMALIZATIONS, xla_fast=never)
def test_denominator_replaces_the_sequence_count(backend: Backend, mode: str) -> None:
    """``denominator=`` overrides ``S`` (not ``n_s``); 0 gives loss 0 and gradient 0."""
    kind = ALL_KINDS[SEQUENCE_NORMALIZATIONS.index(mode)]
    case, ids = _packed(backend, kind, float_weights=True, seed=3)
    options = sample_options(kind)
    check(backend, case, normalization=mode, segment_ids=ids, denominator=5.5, **options)
    out = backend.run(kind, case.logits, case.target, case.loss_mask, normalization=mode, segment_ids=ids, denominator=0.0, **options)
    assert out.loss == 0.0 and np.all(out.grad == 0.0)


SHIFT_SCENARIOS = ("random", "heavy_mask", "confident")  # boolean masks (a compile per mask type)


@over_backends("kind", ALL_KINDS, xla_fast=lambda kind: kind == ALL_KINDS[0])
def test_causal_shift_matches_oracle(backend: Backend, kind: str) -> None:
    """Position ``t`` is scored against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``;
    the teacher is not shifted; the last position of each row has weight 0 (loss 0, gradient
    exactly 0); ``labels[..., 0]`` is never read; ``"tokens"`` counts the scored positions."""
    normalization = NORMALIZATIONS[ALL_KINDS.index(kind) % len(NORMALIZATIONS)]
    for seed, scenario in enumerate(SHIFT_SCENARIOS):
        case = make_case(kind, scenario, lead_shape=backend.lead, vocab=VOCAB, seed=seed)
        if KIND_SPECS[kind].has_labels:
            labels = case.target.copy()
            labels[..., 0] = 10**6  # never a target
            case = dataclasses.replace(case, target=labels)
        for mode in dict.fromkeys((normalization, "none")):
            out = check(backend, case, normalization=mode, causal_shift=True, **sample_options(kind))
            assert np.all(out.grad[..., -1, :] == 0.0), "a gradient at the last position"
            if mode == "none":
                assert np.all(out.loss[..., -1] == 0.0)


@over_backends("normalization", ("tokens", "valid_tokens"), cover=lambda normalization: normalization == "tokens", xla_fast=never)
def test_causal_shift_with_several_leading_axes(backend: Backend, normalization: str) -> None:
    """``[..., T, V]``: the last leading axis is time; ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)``;
    ``denominator=`` works as without the shift."""
    kind = ALL_KINDS[-1]
    case = make_case(kind, "float_weights", lead_shape=(2, 3, 5), vocab=VOCAB, seed=4)
    check(backend, case, normalization=normalization, causal_shift=True, **sample_options(kind))
    check(backend, case, normalization=normalization, causal_shift=True, denominator=7.5, **sample_options(kind))
