"""Contract, SPEC sections 2, 3 and 7 on masks and labels, on every backend
(parity_tests/support/backends.py) against the float64 oracle.

Valid tokens (``loss_mask`` non-zero and, for the kinds with labels, ``label != ignore_index``);
labels of masked tokens are never read (any value is legal there); labels are compared with
``ignore_index`` and ``[0, V)`` in their own dtype; a ``loss_mask`` that broadcasts to the
leading shape (``[T]``, ``[1, T]``, ``[B, 1]``, ``[B, T, 1]``) is the expanded mask. The errors for
bad labels and masks: test_contract_errors.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import lossspec
from lossspec import KIND_SPECS, make_case

from parity_tests.support.backends import VOCAB, Backend, check, kinds_by_target, over_backends, sample_options

LABEL_KINDS = tuple(kind for kind, spec in KIND_SPECS.items() if spec.has_labels)


@over_backends("kind", LABEL_KINDS)
def test_ignore_index(backend: Backend, kind: str) -> None:
    """A label equal to ``ignore_index`` (here 5) makes its token invalid: weight 0, out of ``D``."""
    case = make_case(kind, "random", lead_shape=backend.lead, vocab=VOCAB, seed=6)
    labels = np.where(case.target == -100, 7, case.target)  # -100 is a label out of range now
    labels.reshape(-1)[np.flatnonzero(case.loss_mask)[::3]] = 5
    case = dataclasses.replace(case, target=labels)
    for normalization in ("valid_tokens", "none"):
        check(backend, case, normalization=normalization, ignore_index=5, **sample_options(kind))


@over_backends("kind", LABEL_KINDS)
def test_masked_labels_are_never_read(backend: Backend, kind: str) -> None:
    """Any label value is legal on a masked or ignored token: out of range, negative, the int32
    extremes; no error, and the loss and gradient of the valid tokens."""
    case = make_case(kind, "random", lead_shape=backend.lead, vocab=VOCAB, seed=7)
    garbage = np.array([-1, VOCAB, 10**6, -(2**31), 2**31 - 1, -101])
    labels = np.where(case.loss_mask != 0, case.target, garbage[np.arange(case.target.size).reshape(case.target.shape) % garbage.size])
    assert np.any(labels >= VOCAB) and np.any((labels < 0) & (labels != -100))
    check(backend, dataclasses.replace(case, target=labels.astype(np.int64)), **sample_options(kind))


LABEL_DTYPES = ("int32", "int64", "uint8", "uint32")


@over_backends("dtype", LABEL_DTYPES, cover=lambda dtype: dtype.startswith("u"), xla_fast=lambda dtype: dtype == "uint32")
def test_labels_of_every_integer_dtype(backend: Backend, dtype: str) -> None:
    """Labels of any integer dtype, compared in their own dtype: with unsigned labels the default
    ``ignore_index`` (-100) matches nothing (every masked-in token counts), and an
    ``ignore_index`` the dtype cannot hold (2**40 for 32-bit labels) matches no label either."""
    kind = LABEL_KINDS[0]
    case = make_case(kind, "random", lead_shape=backend.lead, vocab=VOCAB, seed=8)
    valid_labels = np.where(case.loss_mask != 0, np.abs(case.target) % VOCAB, 0).astype(dtype)
    case = dataclasses.replace(case, target=valid_labels)
    check(backend, case)
    check(backend, case, ignore_index=2**40)


# For logits [B, T, V]: the shapes that broadcast to the leading shape [B, T].
def mask_shapes(lead: tuple[int, int]) -> list[tuple[int, ...]]:
    batch, time = lead
    return [(time,), (1, time), (batch, 1), (batch, time, 1)]


SHAPE_NAMES = ("T", "1xT", "Bx1", "BxTx1")
BROADCAST = [(name, kind) for name in SHAPE_NAMES for kind in kinds_by_target()]


@over_backends("shape,kind", BROADCAST, cover=lambda shape, kind: SHAPE_NAMES.index(shape) % 3 == kinds_by_target().index(kind),
               xla_fast=lambda shape, kind: shape == SHAPE_NAMES[-1])
def test_broadcast_mask_is_the_expanded_mask(backend: Backend, shape: str, kind: str) -> None:
    """A mask that broadcasts (one axis more with a last axis of 1 is dropped first, then NumPy's
    rules without growing the leading shape) gives exactly the result of the expanded mask: the
    weights, ``D`` and the value checks count each weight once per token it covers."""
    lead = backend.lead
    mask_shape = mask_shapes(lead)[SHAPE_NAMES.index(shape)]
    case = make_case(kind, "random", lead_shape=lead, vocab=VOCAB, seed=9)
    rng = np.random.default_rng(SHAPE_NAMES.index(shape))
    mask = np.where(rng.random(mask_shape) < 0.7, rng.uniform(0.5, 2.0, mask_shape), 0.0).astype(np.float32)
    mask.flat[0] = 1.5
    expanded = lossspec.broadcast_mask(mask, lead).copy()
    case = dataclasses.replace(case, loss_mask=mask)
    if KIND_SPECS[kind].has_labels:  # labels of tokens the expanded mask masks are garbage, never read
        case = dataclasses.replace(case, target=np.where(expanded != 0, np.abs(case.target) % VOCAB, 10**6))
    for normalization in ("valid_tokens", "none"):
        check(backend, case, reference_mask=expanded, normalization=normalization)
