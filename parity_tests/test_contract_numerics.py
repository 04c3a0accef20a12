"""Contract, SPEC section 6 (numerics: what "identical" means) and section 2's dtypes, on every
backend (parity_tests/support/backends.py) against the float64 oracle.

bf16 / fp16 logits: the loss is fp32, the gradient has the logits' dtype and lies within one
16-bit ulp of the oracle plus ``4e-6 S``, on confident rows and huge logits too; a non-unit
upstream gradient (a scalar, per token for ``"none"``) on fp32 and 16-bit logits (where the
backward recomputes the gradient and rounds it once); the same call gives bit-identical results.
That a 16-bit gradient is the oracle's *rounded to nearest* (tighter than the ulp bound):
test_rounding_16bit.py; micro-batch invariance: test_contract_counts.py.
"""

from __future__ import annotations

import numpy as np

from lossspec import ALL_KINDS, make_case

from parity_tests.support.backends import VOCAB, Backend, check, never, over_backends, sample_options, xla_cover

SIXTEEN_BIT = ("bfloat16", "float16")
KIND_DTYPES = [(kind, dtype) for kind in ALL_KINDS for dtype in SIXTEEN_BIT]
SCENARIOS = ("random", "confident", "huge", "neg_inf")


def _fast(kind: str, dtype: str) -> bool:
    """XLA's fast-lane cover (a compile per kind and dtype): one."""
    return (kind, dtype) == (ALL_KINDS[0], "bfloat16")


def _cover(kind: str, dtype: str) -> bool:
    """JAX's and the kernels' rotation (a compile per kind and dtype): the cover's kinds, each
    16-bit dtype twice."""
    return kind in xla_cover() and xla_cover().index(kind) % 2 == SIXTEEN_BIT.index(dtype)


@over_backends("kind,dtype", KIND_DTYPES, cover=_cover, xla_fast=_fast)
def test_16bit_logits(backend: Backend, kind: str, dtype: str) -> None:
    """The loss is fp32 whatever the logits' dtype; the gradient has their dtype and meets the
    16-bit bound of section 6 (one ulp plus ``4e-6 S``), every option of the kind set."""
    options = sample_options(kind)
    for seed, scenario in enumerate(SCENARIOS):
        case = make_case(kind, scenario, lead_shape=backend.lead, vocab=VOCAB, dtype=dtype, seed=seed)
        out = check(backend, case, **options)
        assert out.loss_dtype == "float32" and out.grad_dtype == dtype, (out.loss_dtype, out.grad_dtype)


UPSTREAM_DTYPES = ("float32", "bfloat16")
KIND_UPSTREAM = [(kind, dtype) for kind in ALL_KINDS for dtype in UPSTREAM_DTYPES]


def _upstream_cover(kind: str, dtype: str) -> bool:
    """JAX's and the kernels' rotation: the cover's kinds, each with one dtype, each dtype twice."""
    return kind in xla_cover() and xla_cover().index(kind) % 2 == UPSTREAM_DTYPES.index(dtype)


@over_backends("kind,dtype", KIND_UPSTREAM, cover=_upstream_cover, xla_fast=never)
def test_upstream_gradient(backend: Backend, kind: str, dtype: str) -> None:
    """``d(sum(loss * g)) / d logits`` for an upstream gradient ``g`` that is not 1: a scalar for
    the reduced modes, per token for ``"none"`` (arbitrary values, exact 1s, 0s, negatives), on
    fp32 and 16-bit logits (recomputed in the backward and rounded once: still the bound)."""
    options = sample_options(kind)
    rng = np.random.default_rng(15)
    per_token = rng.uniform(-3.0, 3.0, backend.lead).astype(np.float32)
    per_token.reshape(-1)[[1, 4]] = 1.0
    per_token.reshape(-1)[6] = 0.0
    case = make_case(kind, "float_weights", lead_shape=backend.lead, vocab=VOCAB, dtype=dtype, seed=15)
    for scalar in (0.37, -1.9):
        check(backend, case, grad_output=np.float32(scalar), **options)
    check(backend, case, grad_output=per_token, normalization="none", **options)


@over_backends("kind", ALL_KINDS, cover=lambda kind: kind in xla_cover(), xla_fast=lambda kind: kind == ALL_KINDS[-1])
def test_deterministic(backend: Backend, kind: str) -> None:
    """The same call on the same inputs gives bit-identical loss and gradient, run after run."""
    case = make_case(kind, "random", lead_shape=backend.lead, vocab=VOCAB, seed=16)
    options = sample_options(kind)
    first = backend.run(kind, case.logits, case.target, case.loss_mask, **options)
    for _ in range(2):
        again = backend.run(kind, case.logits, case.target, case.loss_mask, **options)
        assert np.array_equal(again.loss, first.loss) and np.array_equal(again.grad, first.grad)
