"""Contract, SPEC section 2 (weights and the token-level normalisations) and section 7's
``denominator=``, on every backend (parity_tests/support/backends.py) against the float64 oracle.

``loss = sum_i w_i l_i / D`` for ``"valid_tokens"``, ``"tokens"``, ``"sum"`` and the per-token
``"none"``, with boolean, float and no masks (every kind with all its options); ``denominator=`` (a number, a NumPy scalar, a 0-d
array of the framework) overriding ``D`` of every reduced mode; ``D == 0`` gives loss 0 and a
gradient of exactly 0, whatever the masked rows hold. The per-sequence modes, ``segment_ids`` and
the causal shift: test_contract_sequences.py; masks that broadcast and ``ignore_index``:
test_contract_masks.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lossspec import ALL_KINDS, NORMALIZATIONS, make_case

from parity_tests.support.backends import VOCAB, Backend, check, over_backends, sample_options, xla_cover

# A boolean mask (~30% masked, ignored labels), float weights in [0, 2) (some 0), no mask.
MASK_SCENARIOS = ("random", "float_weights", "no_mask")
REDUCED = tuple(n for n in NORMALIZATIONS if n != "none")
MODE_KINDS = [(n, k) for n in NORMALIZATIONS for k in ALL_KINDS]


def _cover(normalization: str, kind: str) -> bool:
    """Every kind once, every mode at least once (JAX and the kernels; the torch path runs all)."""
    return (ALL_KINDS.index(kind) - NORMALIZATIONS.index(normalization)) % len(NORMALIZATIONS) == 0


@over_backends("normalization,kind", MODE_KINDS, cover=_cover, xla_fast=lambda normalization, kind: kind in xla_cover())
def test_normalization_matches_oracle(backend: Backend, normalization: str, kind: str) -> None:
    """``D`` is the valid weight sum (``"valid_tokens"``), the number of positions, masked ones
    included (``"tokens"``), 1 (``"sum"``); ``"none"`` returns ``w_i l_i`` with the labels' shape,
    0 at masked tokens."""
    for seed, scenario in enumerate(MASK_SCENARIOS):
        case = make_case(kind, scenario, lead_shape=backend.lead, vocab=VOCAB, seed=seed)
        out = check(backend, case, normalization=normalization, **sample_options(kind))
        if normalization == "none" and case.loss_mask is not None:
            assert np.all(out.loss[case.loss_mask == 0] == 0.0), "a masked token's loss is not 0"


# Python int and float, a NumPy scalar, 0-d arrays (the framework's own, float32 and int32).
DENOMINATORS = (37, 17.5, np.float32(40.0), np.array(2.25, np.float32), np.array(11, np.int32))


@over_backends("normalization", REDUCED, cover=lambda normalization: normalization == "tokens")
def test_denominator_overrides_d(backend: Backend, normalization: str) -> None:
    """``denominator=`` replaces ``D`` of every reduced mode (``"sum"``'s 1 too), as a number or a
    0-d array (each mode with two kinds); ``denominator=0`` gives loss 0 and gradient 0, never NaN."""
    index = REDUCED.index(normalization)
    for kind in (ALL_KINDS[index], ALL_KINDS[-1 - index]):
        case = make_case(kind, "float_weights", lead_shape=backend.lead, vocab=VOCAB, seed=2)
        options = sample_options(kind)
        for denominator in DENOMINATORS:
            check(backend, case, normalization=normalization, denominator=denominator, **options)
        for zero in (0.0, np.array(0.0, np.float32)):
            out = backend.run(kind, case.logits, case.target, case.loss_mask, normalization=normalization, denominator=zero, **options)
            assert out.loss == 0.0 and np.all(out.grad == 0.0), (kind, zero)


@over_backends("normalization,kind", MODE_KINDS, cover=lambda normalization, kind: kind in xla_cover() and xla_cover().index(kind) == NORMALIZATIONS.index(normalization),
               xla_fast=lambda normalization, kind: kind == ALL_KINDS[0])
def test_everything_masked_gives_zero(backend: Backend, normalization: str, kind: str) -> None:
    """Nothing valid (``D == 0``): loss 0 and a gradient of exactly 0, even with NaN and ``+inf``
    in the masked rows."""
    case = make_case(kind, "random", lead_shape=backend.lead, vocab=VOCAB, seed=5)
    logits = case.logits.copy()
    logits[..., 0, 3] = np.nan
    logits[..., -1, 5] = np.inf
    case = dataclasses.replace(case, logits=logits, loss_mask=np.zeros(backend.lead, bool))
    out = backend.run(kind, case.logits, case.target, case.loss_mask, normalization=normalization, **sample_options(kind))
    assert np.all(out.loss == 0.0) and np.all(out.grad == 0.0)
