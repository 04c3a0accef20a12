"""Contract, SPEC section 1's soft caps (``logit_softcap``, ``teacher_logit_softcap``: ``x -> cap *
tanh(x / cap)`` on the raw logits, before the scales and the temperature), on every backend
(parity_tests/support/backends.py) against the float64 oracle.

Every kind with its caps (the teacher's where the kind has a teacher: the kind table) and all its
other options, on the curved part of tanh, far past the cap (the slope ``1 - tanh^2`` keeps its
relative precision) and at Gemma's cap 30; infinite entries are not capped. The caps' option
errors: test_contract_errors.py. The fused head, vocab-parallel, ``torch.compile`` and the shared
``tanh`` itself: test_softcap.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import lossspec
from lossspec import ALL_KINDS, KIND_SPECS, make_case

from parity_tests.support.backends import VOCAB, Backend, check, never, over_backends, sample_options

FAST_KIND = next(kind for kind, spec in KIND_SPECS.items() if spec.mixture_pass)  # XLA's fast-lane cover


def cap_options(kind: str, **caps: Any) -> dict[str, Any]:
    """Every option of ``kind`` at its sample value, caps included (3.5 for the student's, 5 for the
    teacher's, on N(0, 2) logits: mostly the curved part of tanh), ``caps`` overriding them."""
    options = sample_options(kind, skip=("ignore_index", "causal_shift"))
    options.update({name: value for name, value in caps.items() if name in KIND_SPECS[kind].option_names})
    return options


def _saturated(kind: str, lead: tuple[int, ...]) -> lossspec.Case:
    """``|x|`` log-uniform in ``[1, 100]`` of both signs (up to 28 times the cap of 3.5: slopes down
    to ``e^-57``), the teacher N(0, 300) (past its cap of 5)."""
    case = make_case(kind, "random", lead_shape=lead, vocab=VOCAB, seed=11)
    rng = np.random.default_rng([11, ALL_KINDS.index(kind)])
    shape = case.logits.shape
    logits = (rng.choice([-1.0, 1.0], shape) * 10 ** rng.uniform(0.0, 2.0, shape)).astype(np.float32)
    target = case.target
    if KIND_SPECS[kind].has_teacher:
        target = rng.normal(0.0, 300.0, shape).astype(np.float32)
    return dataclasses.replace(case, scenario="saturated", logits=logits, target=target)


@over_backends("kind", ALL_KINDS, xla_fast=lambda kind: kind == FAST_KIND)
def test_softcap_matches_oracle(backend: Backend, kind: str) -> None:
    """The capped loss and its gradient through the cap, on moderate, confident, ``-inf`` and
    saturated rows (with label smoothing a ``-inf`` logit makes the true loss ``+inf``)."""
    options = cap_options(kind)
    for seed, scenario in enumerate(("random", "confident", "neg_inf")):
        check(backend, make_case(kind, scenario, lead_shape=backend.lead, vocab=VOCAB, seed=seed), **options)
    check(backend, _saturated(kind, backend.lead), **options)


@over_backends("kind", ALL_KINDS, cover=lambda kind: kind in (ALL_KINDS[0], FAST_KIND), xla_fast=never)
def test_gemma_cap(backend: Backend, kind: str) -> None:
    """Gemma 2's cap 30 (the teacher's too) on logits up to about the cap (N(0, 8)) and far
    beyond it (N(0, 32))."""
    options = cap_options(kind, logit_softcap=30.0, teacher_logit_softcap=30.0)
    case = make_case(kind, "random", lead_shape=backend.lead, vocab=VOCAB, seed=12)
    for factor in (4.0, 16.0):
        target = case.target if not KIND_SPECS[kind].has_teacher else case.target * factor
        check(backend, dataclasses.replace(case, logits=case.logits * factor, target=target), **options)


@over_backends("kind", ALL_KINDS, xla_fast=lambda kind: kind == FAST_KIND)
def test_infinite_entries_are_not_capped(backend: Backend, kind: str) -> None:
    """``+inf`` or NaN in a valid row still makes its loss and gradient row NaN (a cap does not
    turn ``+inf`` into a plausible number); ``-inf`` keeps probability 0 and gradient 0; a masked
    row of garbage leaks nothing; the other rows are the oracle's."""
    case = make_case(kind, "no_mask", lead_shape=backend.lead, vocab=VOCAB, seed=13)
    logits = case.logits.reshape(-1, VOCAB).copy()
    logits[1, 10] = np.nan
    logits[3, 20] = np.inf
    logits[6, :] = np.nan
    logits[7, 3] = -np.inf
    bad = [1, 3]
    mask = np.ones(logits.shape[0], bool)
    mask[6] = False
    target = case.target
    if KIND_SPECS[kind].has_labels:  # no ignored label on the rows that must come out NaN
        target = np.where(np.arange(target.size).reshape(target.shape) < 6, np.abs(target) % VOCAB, target)
    case = dataclasses.replace(case, logits=logits.reshape(case.logits.shape), target=target, loss_mask=mask.reshape(backend.lead))
    options = dict(cap_options(kind), normalization="none")
    out = backend.run(kind, case.logits, case.target, case.loss_mask, **options)
    ref = case.reference(**options)
    loss, grad = out.loss.reshape(-1), out.grad.reshape(-1, VOCAB)
    good = [i for i in range(mask.size) if i not in bad and mask[i]]
    assert np.all(np.isnan(loss[bad])) and np.all(np.isnan(grad[bad]))
    assert loss[6] == 0.0 and np.all(grad[6] == 0.0) and grad[7, 3] == 0.0
    lossspec.compare_loss(loss[good], ref.loss.reshape(-1)[good]).check()
    lossspec.compare_grad(grad[good], ref.grad.reshape(-1, VOCAB)[good], "float32", ref.g0).check()
