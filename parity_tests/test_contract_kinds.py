"""Contract, SPEC section 1 (loss kinds, per token) and the shapes of section 3, on every backend
(parity_tests/support/backends.py) against the float64 oracle.

Every kind of ``lossspec.KIND_SPECS`` with its default options and with all of its options
together; ``-inf`` logits (probability 0, gradient exactly 0); NaN / ``+inf`` in a valid row (a
NaN loss and gradient row, never a plausible number) next to a masked row of garbage (no leak);
``jensen_shannon``'s end points (``beta`` 0 / 1 are the KL kinds); logits ``[V]`` and several
leading axes. Soft caps: test_contract_softcap.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import lossspec
from lossspec import ALL_KINDS, KIND_SPECS, make_case

from parity_tests.support.backends import VOCAB, Backend, check, over_backends, sample_options, xla_cover

# Scenarios with a boolean mask (one compile per kind and option set in JAX): moderate, confident
# (q_y > 0.999), |x| up to 1e4, -inf columns, ~90% masked.
SCENARIOS = ("random", "confident", "huge", "neg_inf", "heavy_mask")


@over_backends("kind,with_options", [(k, w) for k in ALL_KINDS for w in (False, True)],
               ids=[f"{k}-{'options' if w else 'defaults'}" for k in ALL_KINDS for w in (False, True)],
               cover=lambda kind, with_options: with_options or kind == ALL_KINDS[0],
               xla_fast=lambda kind, with_options: kind in xla_cover() and (with_options or kind == ALL_KINDS[0]))
def test_kind_matches_oracle(backend: Backend, kind: str, with_options: bool) -> None:
    """SPEC section 1's table: the loss and gradient of every kind, with all its options (scales,
    temperature, label smoothing, z-loss, beta) or none, at the bounds of section 6. With label
    smoothing a ``-inf`` logit makes the true loss ``+inf``: that is what must come back."""
    options = sample_options(kind) if with_options else {}
    for seed, scenario in enumerate(SCENARIOS):
        check(backend, make_case(kind, scenario, lead_shape=backend.lead, vocab=VOCAB, seed=seed), **options)


@over_backends("kind", ALL_KINDS, xla_fast=lambda kind: kind == xla_cover()[-1])
def test_neg_inf_logits_get_zero_gradient(backend: Backend, kind: str) -> None:
    """``-inf`` logits (padded or banned vocabulary; the teacher's too) are legal: probability 0,
    a gradient of exactly 0 there, a finite loss (every option but label smoothing, which makes
    the true loss ``+inf`` and gives every entry ``-eps / V``: test_kind_matches_oracle)."""
    case = make_case(kind, "neg_inf", lead_shape=backend.lead, vocab=VOCAB, seed=1)
    options = {name: value for name, value in sample_options(kind).items() if name != "label_smoothing"}
    out = check(backend, case, normalization="none", **options)
    banned = np.isneginf(case.logits)
    assert banned.any() and np.all(out.grad[banned] == 0.0)
    assert np.all(np.isfinite(out.loss)) and np.all(np.isfinite(out.grad))


def _poisoned(kind: str, lead: tuple[int, ...]) -> tuple[lossspec.Case, list[int], int]:
    """Rows (of the flattened leading shape): NaN in row 1, ``+inf`` in row 3, NaN in the
    teacher's row 5 (kinds with a teacher), row 6 masked and full of NaN / ``+inf`` garbage."""
    case = make_case(kind, "no_mask", lead_shape=lead, vocab=VOCAB, seed=3)
    logits = case.logits.reshape(-1, VOCAB).copy()
    logits[1, 10] = np.nan
    logits[3, 20] = np.inf
    logits[6, :] = np.nan
    logits[6, 3] = np.inf
    bad = [1, 3]
    target = case.target
    if KIND_SPECS[kind].has_labels:  # no ignored label on the rows that must come out NaN
        target = np.where(np.arange(target.size).reshape(target.shape) < 6, np.abs(target) % VOCAB, target)
    if KIND_SPECS[kind].has_teacher:
        target = target.reshape(-1, VOCAB).copy()
        target[5, 30] = np.nan
        target = target.reshape(case.target.shape)
        bad.append(5)
    mask = np.ones(logits.shape[0], bool)
    mask[6] = False
    return dataclasses.replace(case, logits=logits.reshape(case.logits.shape), target=target, loss_mask=mask.reshape(lead)), bad, 6


@over_backends("kind", ALL_KINDS, xla_fast=lambda kind: kind in xla_cover())
def test_nan_and_inf_rows(backend: Backend, kind: str) -> None:
    """``+inf`` or NaN in a valid row (student, or teacher) gives that row a NaN loss and an
    all-NaN gradient row; a masked row of garbage leaks nothing (loss 0, gradient exactly 0); the
    other rows are the oracle's. Reduced, the loss is NaN."""
    case, bad, masked = _poisoned(kind, backend.lead)
    rows = case.logits.reshape(-1, VOCAB).shape[0]
    good = [i for i in range(rows) if i not in bad and i != masked]
    options = sample_options(kind)
    for normalization in ("none", "valid_tokens"):
        out = backend.run(kind, case.logits, case.target, case.loss_mask, normalization=normalization, **options)
        ref = case.reference(normalization=normalization, **options)
        grad = out.grad.reshape(rows, VOCAB)
        assert np.all(np.isnan(grad[bad])), f"{normalization}: a NaN row with a finite gradient"
        assert np.all(grad[masked] == 0.0), f"{normalization}: the masked row's gradient"
        lossspec.compare_grad(grad[good], ref.grad.reshape(rows, VOCAB)[good], "float32", ref.g0, "grad of the good rows").check()
        if normalization == "none":
            loss = out.loss.reshape(rows)
            assert np.all(np.isnan(loss[bad])) and loss[masked] == 0.0
            lossspec.compare_loss(loss[good], ref.loss.reshape(rows)[good], "loss of the good rows").check()
        else:
            assert np.isnan(out.loss) and np.isnan(ref.loss)


# The kinds with a ``beta`` (the mixture kinds), and their end points as the table's config names them.
BETA_KINDS = [kind for kind, spec in KIND_SPECS.items() if "beta" in spec.option_names]
END_POINTS = [(kind, beta) for kind in BETA_KINDS for beta in (0.0, 1.0)]


@over_backends("kind,beta", END_POINTS, ids=[f"{k}-beta{b:g}" for k, b in END_POINTS], xla_fast=lambda kind, beta: beta == 1.0)
def test_beta_end_points_are_the_kl_kinds(backend: Backend, kind: str, beta: float) -> None:
    """``beta = 0`` is forward KL and ``beta = 1`` reverse KL (the limits TRL's GKD and
    Liger-Kernel define): the oracle of that KL kind, computed without a mixture (no ``log 0``),
    on ``-inf`` columns too."""
    end_point = lossspec.make_config(kind, beta=beta).formula
    assert end_point != kind and KIND_SPECS[end_point].target == KIND_SPECS[kind].target
    for seed, scenario in enumerate(("random", "neg_inf")):
        case = make_case(kind, scenario, lead_shape=backend.lead, vocab=VOCAB, seed=seed)
        out = backend.run(kind, case.logits, case.target, case.loss_mask, beta=beta, temperature=1.5)
        ref = dataclasses.replace(case, kind=end_point).reference(temperature=1.5)
        lossspec.assert_close_to_oracle(out.loss, out.grad, ref.loss, ref.grad, dtype="float32", g0=ref.g0,
                                        what=f"{backend.id} {kind} beta={beta} as {end_point}")


# Logits [V] (one token: labels [], loss of "none" of shape ()), a vocabulary of 1, several
# leading axes; each shape with another kind (JAX compiles per shape).
SHAPES = [((), 50), ((5,), 1), ((2, 1, 3), VOCAB), ((1, 1, 5), 33)]


@over_backends("lead,vocab", SHAPES, ids=["V-only", "V1", "2x1x3", "1x1x5x33"], cover=lambda lead, vocab: vocab == 1 or len(lead) == 3,
               xla_fast=lambda lead, vocab: len(lead) == 3 and vocab == VOCAB)
def test_leading_shapes(backend: Backend, lead: tuple[int, ...], vocab: int) -> None:
    """``logits [..., V]`` with any leading shape, the target and mask of that leading shape."""
    kind = ALL_KINDS[SHAPES.index((lead, vocab)) % len(ALL_KINDS)]
    case = make_case(kind, "no_mask", lead_shape=lead or (1,), vocab=vocab, seed=4)
    if not lead:  # a single token: logits [V], labels [] (or teacher [V])
        case = dataclasses.replace(case, logits=case.logits[0], target=None if case.target is None else case.target[0])
    for normalization in ("valid_tokens", "none"):
        check(backend, case, normalization=normalization)
