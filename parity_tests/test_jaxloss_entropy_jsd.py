"""jaxloss ``entropy`` and ``jensen_shannon`` against the float64 oracle at the SPEC bounds.

XLA: both kinds x every scenario x {float32, bfloat16}, the normalisations rotated through (every
kind x dtype x normalisation is covered), options, beta (the end points run the KL formulas),
the blocked-vocabulary driver (JSD's extra pass), NaN / +inf rows, the NNX modules. Pallas
(interpret mode) and ``vocab_parallel`` (``shard_map`` over 2 / 4 host devices): slow.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxloss
import lossspec

KINDS = lossspec.ENTROPY_JSD_KINDS
DTYPES = ("float32", "bfloat16")
NORMALIZATIONS = lossspec.NORMALIZATIONS
FNS = {"entropy": jaxloss.entropy, "jensen_shannon": jaxloss.jensen_shannon}
OPTIONS = {
    "entropy": {"temperature": 1.6, "logit_scale": 1.2},
    "jensen_shannon": {"beta": 0.3, "temperature": 1.4, "logit_scale": 0.9, "teacher_logit_scale": 1.2},
}


def _case(kind: str, scenario: str, dtype: str = "float32", **kwargs: Any) -> lossspec.Case:
    return lossspec.make_case(kind, scenario, dtype=dtype, **kwargs)


def _call(kind: str, logits: Any, target: Any, mask: Any, **options: Any) -> jax.Array:
    if kind == "entropy":
        return FNS[kind](logits, mask, **options)
    return FNS[kind](logits, target, mask, **options)


def run(case: lossspec.Case, impl: str = "xla", grad_output: Optional[np.ndarray] = None, tuning: Optional[lossspec.Tuning] = None,
        **options: Any) -> tuple[np.ndarray, np.ndarray]:
    x = jnp.asarray(case.logits).astype(case.dtype)
    target = None if case.target is None else jnp.asarray(case.target).astype(case.dtype)
    loss, vjp = jax.vjp(lambda z: _call(case.kind, z, target, case.loss_mask, impl=impl, tuning=tuning, **options), x)
    (grad,) = vjp(jnp.ones_like(loss) if grad_output is None else jnp.asarray(grad_output, jnp.float32))
    assert loss.dtype == jnp.float32 and grad.dtype == x.dtype
    return np.asarray(loss), np.asarray(grad.astype(jnp.float32))


def check(case: lossspec.Case, impl: str = "xla", grad_output: Optional[np.ndarray] = None, tuning: Optional[lossspec.Tuning] = None,
          **options: Any) -> None:
    loss, grad = run(case, impl, grad_output, tuning, **options)
    ref_options = dict(options)
    if grad_output is not None:
        ref_options["grad_output"] = grad_output
    ref = case.reference(**ref_options)
    lossspec.assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0, what=f"{impl} {case.name} {options}")


MATRIX = [
    (kind, scenario, dtype, NORMALIZATIONS[(i + j + k) % len(NORMALIZATIONS)])
    for (i, kind), (j, scenario), (k, dtype) in itertools.product(enumerate(KINDS), enumerate(lossspec.SCENARIOS), enumerate(DTYPES))
]


def test_matrix_covers_every_mode() -> None:
    assert {(k, d, n) for k, _, d, n in MATRIX} == set(itertools.product(KINDS, DTYPES, NORMALIZATIONS))


@pytest.mark.parametrize("kind,scenario,dtype,normalization", MATRIX)
def test_xla_matrix(kind: str, scenario: str, dtype: str, normalization: str) -> None:
    check(_case(kind, scenario, dtype), normalization=normalization)


@pytest.mark.parametrize("scenario", ("random", "huge", "neg_inf", "confident"))
@pytest.mark.parametrize("kind", KINDS)
def test_xla_options(kind: str, scenario: str) -> None:
    check(_case(kind, scenario, "bfloat16" if scenario == "huge" else "float32"), **OPTIONS[kind])


@pytest.mark.parametrize("beta", (0.0, 0.05, 0.5, 0.95, 1.0))
def test_xla_beta(beta: float) -> None:
    """Every beta against the oracle; 0 and 1 are the KL kinds' numbers exactly."""
    case = _case("jensen_shannon", "neg_inf")
    check(case, normalization="none", beta=beta)
    if beta in (0.0, 1.0):
        kl = "forward_kl" if beta == 0.0 else "reverse_kl"
        x, t = jnp.asarray(case.logits), jnp.asarray(case.target)
        got = jaxloss.jensen_shannon(x, t, case.loss_mask, beta=beta, normalization="none")
        want = getattr(jaxloss, kl)(x, t, case.loss_mask, normalization="none")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kind", KINDS)
def test_xla_blocked_vocabulary(kind: str) -> None:
    """Vocabularies above one block: online statistics, JSD's mixture pass block by block (a
    ragged last block overlapping the one before), then the gradient pass; a non-unit upstream."""
    tuning = lossspec.Tuning(chunk_elements=6 * 48, single_block_vocab=64, vocab_block=48)
    case = _case(kind, "neg_inf", vocab=157, lead_shape=(3, 5))
    upstream = np.random.default_rng(0).uniform(0.5, 2.0, (3, 5)).astype(np.float32)
    check(case, normalization="none", grad_output=upstream, tuning=tuning, **OPTIONS[kind])
    check(dataclasses_replace_dtype(case, "bfloat16"), normalization="valid_tokens", tuning=tuning)


def dataclasses_replace_dtype(case: lossspec.Case, dtype: str) -> lossspec.Case:
    import dataclasses

    round_ = lossspec.round_to_dtype
    target = None if case.target is None else round_(case.target, dtype)
    return dataclasses.replace(case, dtype=dtype, logits=round_(case.logits, dtype), target=target)


def _poisoned(kind: str) -> tuple[lossspec.Case, list[int]]:
    import dataclasses

    case = _case(kind, "no_mask", vocab=40, lead_shape=(8,))
    logits = case.logits.copy()
    logits[2, 10] = np.nan
    logits[5, 20] = np.inf
    logits[6, :] = np.nan  # masked below: leaks nothing
    target = None if case.target is None else case.target.copy()
    bad = [2, 5]
    if target is not None:
        target[4, 3] = np.nan
        bad.append(4)
    mask = np.ones(8, bool)
    mask[6] = False
    return dataclasses.replace(case, logits=logits, target=target, loss_mask=mask), bad


@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_inf_rows(kind: str) -> None:
    """A NaN / +inf in a valid row: NaN loss and a NaN gradient row; a masked row of NaN leaks
    nothing; the other rows match the oracle."""
    case, bad = _poisoned(kind)
    good = [i for i in range(8) if i not in bad and i != 6]
    loss, grad = run(case, normalization="none")
    ref = case.reference(normalization="none")
    assert np.all(np.isnan(loss[bad])) and np.all(np.isnan(grad[bad]))
    assert loss[6] == 0.0 and np.all(grad[6] == 0.0)
    lossspec.compare_loss(loss[good], ref.loss[good]).check()
    lossspec.compare_grad(grad[good], ref.grad[good], "float32", ref.g0).check()


@pytest.mark.parametrize("kind", KINDS)
def test_nnx_module(kind: str) -> None:
    from jaxloss import nnx

    case = _case(kind, "random")
    module = {"entropy": nnx.EntropyLoss, "jensen_shannon": nnx.JensenShannonLoss}[kind](**OPTIONS[kind])
    x = jnp.asarray(case.logits)
    args = (x, case.loss_mask) if kind == "entropy" else (x, jnp.asarray(case.target), case.loss_mask)
    ref = case.reference(**OPTIONS[kind])
    lossspec.compare_loss(np.asarray(module(*args)), ref.loss).check()
    with pytest.raises(ValueError, match="beta must be in"):
        nnx.JensenShannonLoss(beta=2.0)
    with pytest.raises(TypeError, match="unexpected option"):
        nnx.EntropyLoss(teacher_logit_scale=1.0)


def test_signatures() -> None:
    import inspect

    assert list(inspect.signature(jaxloss.entropy).parameters)[:3] == ["logits", "loss_mask", "temperature"]
    assert "beta" in inspect.signature(jaxloss.jensen_shannon).parameters
    assert "M = beta p + (1 - beta) q" in jaxloss.jensen_shannon.__doc__


# --------------------------------------------------------------------------------------------
# Pallas (interpret mode) and vocab-parallel: slow
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_pallas_matches_oracle(kind: str, dtype: str) -> None:
    """Interpret mode with 2 rows x 32 columns a block: several vocabulary blocks, a ragged tail,
    a row count that is not a multiple of the row block."""
    tuning = lossspec.Tuning(block_rows=2, vocab_block=32)
    case = _case(kind, "neg_inf", dtype, vocab=75, lead_shape=(5,))
    check(case, "pallas", normalization="valid_tokens", tuning=tuning, **OPTIONS[kind])
    check(case, "pallas", normalization="none", grad_output=np.linspace(0.5, 2.0, 5).astype(np.float32), tuning=tuning)
    poisoned, bad = _poisoned(kind)
    loss, grad = run(poisoned, "pallas", normalization="none", tuning=tuning)
    assert np.all(np.isnan(loss[bad])) and np.all(np.isnan(grad[bad])) and np.all(grad[6] == 0.0)


VP_LEAD = (4, 6)


def _vp_run(kind: str, case: lossspec.Case, shards: int, impl: str, norm: str, options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    logits = jnp.asarray(case.logits).astype(case.dtype)
    target = jnp.zeros(VP_LEAD + (case.logits.shape[-1],), case.dtype) if case.target is None else jnp.asarray(case.target).astype(case.dtype)
    mask = jnp.ones(VP_LEAD, bool) if case.loss_mask is None else jnp.asarray(case.loss_mask)
    upstream = jnp.asarray(np.random.default_rng(3).uniform(0.5, 2.0, VP_LEAD).astype(np.float32))

    def body(x, t, m, up):
        def objective(x):
            loss = _call(kind, x, t, m, normalization=norm, vocab_parallel="model", impl=impl, **options)
            return (jnp.sum(loss * up) if norm == "none" else loss), loss

        (_, loss), grad = jax.value_and_grad(objective, has_aux=True)(x)
        return loss, grad

    mesh = Mesh(np.array(jax.devices()[:shards]), ("model",))
    spec = P(None, None, "model")
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, P(), P()), out_specs=(P(), spec), check_vma=impl != "pallas")
    loss, grad = jax.jit(fn)(logits, target, mask, upstream)
    return np.asarray(loss), np.asarray(jnp.asarray(grad, jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("shards", (2, 4))
@pytest.mark.parametrize("kind", KINDS)
def test_vocab_parallel_matches_oracle(kind: str, shards: int) -> None:
    upstream = np.random.default_rng(3).uniform(0.5, 2.0, VP_LEAD).astype(np.float32)
    for scenario, dtype, norm, opts in (
        ("random", "float32", "valid_tokens", {}),
        ("huge", "bfloat16", "none", OPTIONS[kind]),
        ("neg_inf", "float32", "none", OPTIONS[kind]),
        ("float_weights", "float32", "sum", OPTIONS[kind]),
    ):
        case = _case(kind, scenario, dtype, vocab=100, lead_shape=VP_LEAD, seed=7)
        loss, grad = _vp_run(kind, case, shards, "xla", norm, opts)
        ref = case.reference(normalization=norm, grad_output=upstream if norm == "none" else None, **opts)
        lossspec.assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype=dtype, g0=ref.g0,
                                        what=f"vp{shards} {case.name} {norm} {opts}")


@pytest.mark.parametrize("kind", KINDS)
def test_vocab_parallel_pallas_matches_oracle(kind: str) -> None:
    case = _case(kind, "neg_inf", "float32", vocab=100, lead_shape=VP_LEAD, seed=7)
    loss, grad = _vp_run(kind, case, 2, "pallas", "valid_tokens", OPTIONS[kind])
    ref = case.reference(normalization="valid_tokens", **OPTIONS[kind])
    lossspec.assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=f"vp pallas {case.name}")


@pytest.mark.parametrize("kind", KINDS)
def test_nnx_module_takes_packed_documents(kind: str) -> None:
    """The module forms pass ``segment_ids`` on (entropy's targetless call too): per-sequence
    normalisation of packed documents against the oracle."""
    from jaxloss import nnx

    from parity_tests.support.packed_problem import packed_case

    case, ids = packed_case(kind)
    module = {"entropy": nnx.EntropyLoss, "jensen_shannon": nnx.JensenShannonLoss}[kind](normalization="sequence_mean", **OPTIONS[kind])
    x = jnp.asarray(case.logits)
    args = (x, case.loss_mask) if kind == "entropy" else (x, jnp.asarray(case.target), case.loss_mask)
    loss, grad = jax.value_and_grad(lambda x: module(x, *args[1:], segment_ids=ids))(x)
    ref = case.reference(normalization="sequence_mean", segment_ids=ids, **OPTIONS[kind])
    lossspec.assert_close_to_oracle(loss, np.asarray(grad), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=f"nnx:{kind}")
