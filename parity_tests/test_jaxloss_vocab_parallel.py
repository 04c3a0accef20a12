"""Vocab-parallel jaxloss (SPEC section 3): ``vocab_parallel=<axis name>`` inside ``shard_map``
(P = 2 and P = 4 shards of V = 100) and ``pmap``, against the
float64 oracle of the whole vocabulary at the SPEC bounds.

Every kind x normalisation {valid_tokens, none (non-unit upstream gradient)} x dtype
{float32, bfloat16} x case {random, huge, neg_inf} x options runs on the XLA path, and every kind
with "tokens", "sum" and ``denominator=`` (a constant and a traced value) on masked and
float-weighted batches; the Pallas kernels' "stats" / "grad" modes (interpreted on the CPU:
slow) on a subset, the XLA path's gradient beside them. The mirror of
test_torchloss_vocab_parallel.py.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxloss
import lossspec

try:
    from jax import shard_map
except ImportError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map

KINDS = ("cross_entropy", "soft_cross_entropy", "forward_kl", "reverse_kl")
NORMALIZATIONS = ("valid_tokens", "none")
DTYPES = ("float32", "bfloat16")
SCENARIOS = ("random", "huge", "neg_inf")
VOCAB = 100  # P = 2: 50 + 50, P = 4: 25 x 4
LEAD = (4, 6)
PALLAS_CONFIGS = {
    ("cross_entropy", "valid_tokens", "bfloat16", "huge", "smooth_z"),
    ("cross_entropy", "tokens", "float32", "random", "plain"),
    ("soft_cross_entropy", "none", "float32", "random", "temp"),
    ("forward_kl", "valid_tokens", "float32", "neg_inf", "temp"),
    ("reverse_kl", "none", "bfloat16", "huge", "temp"),
    ("reverse_kl", "sum", "float32", "random", "temp"),
}
# The reduced modes beside valid_tokens, and denominator= (SPEC section 2): (scenario, dtype,
# normalization, denominator, options); "traced" passes D = 7.5 as a runtime (traced) scalar.
REDUCED_CONFIGS = (
    ("random", "float32", "tokens", None, "plain"),
    ("float_weights", "float32", "tokens", None, "opts"),
    ("float_weights", "float32", "sum", None, "plain"),
    ("random", "float32", "sum", None, "opts"),
    ("random", "float32", "valid_tokens", 3.0, "opts"),
    ("float_weights", "float32", "valid_tokens", "traced", "plain"),
    ("float_weights", "float32", "tokens", 40.0, "plain"),
    ("random", "bfloat16", "tokens", "traced", "opts"),
    ("float_weights", "bfloat16", "sum", 2.5, "opts"),
)
FNS = {"cross_entropy": jaxloss.cross_entropy, "soft_cross_entropy": jaxloss.soft_cross_entropy,
       "forward_kl": jaxloss.forward_kl, "reverse_kl": jaxloss.reverse_kl}
JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def options_for(kind: str, scenario: str) -> dict[str, dict[str, Any]]:
    if kind == "cross_entropy":
        if scenario == "neg_inf":
            return {"plain": {}, "z": {"z_loss": 1e-3}}
        return {"plain": {}, "smooth_z": {"label_smoothing": 0.1, "z_loss": 1e-3}}
    return {"plain": {}, "temp": {"temperature": 1.7, "logit_scale": 1.3, "teacher_logit_scale": 0.8}}


def _configs() -> list[tuple[str, str, str, str, str, dict[str, Any]]]:
    out = []
    for kind, norm, dtype, scenario in itertools.product(KINDS, NORMALIZATIONS, DTYPES, SCENARIOS):
        for opt_name, options in options_for(kind, scenario).items():
            out.append((kind, norm, dtype, scenario, opt_name, options))
    return out


def _case(kind: str, scenario: str, dtype: str) -> lossspec.Case:
    return lossspec.make_case(kind, scenario, lead_shape=LEAD, vocab=VOCAB, dtype=dtype, seed=7)


def _upstream(norm: str) -> np.ndarray | None:
    """A non-unit per-token upstream gradient for "none" (exercises the 16-bit recompute)."""
    if norm != "none":
        return None
    return np.random.default_rng(3).uniform(0.5, 2.0, size=LEAD).astype(np.float32)


def _reference(case: lossspec.Case, norm: str, options: dict[str, Any]) -> Any:
    opts = dict(options, normalization=norm)
    upstream = _upstream(norm)
    if upstream is not None:
        opts["grad_output"] = upstream
    return case.reference(**opts)


def _inputs(case: lossspec.Case, dtype: str) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    logits = jnp.asarray(case.logits, jnp.float32).astype(JNP_DTYPES[dtype])
    if case.kind == "cross_entropy":
        target = jnp.asarray(np.where(case.loss_mask != 0, case.target, -100) if case.loss_mask is not None else case.target,
                             jnp.int32)
    else:
        target = jnp.asarray(case.target, jnp.float32).astype(JNP_DTYPES[dtype])
    mask = jnp.ones(LEAD, bool) if case.loss_mask is None else jnp.asarray(case.loss_mask)
    upstream = _upstream("none")
    return logits, target, mask, jnp.asarray(upstream)


def _loss_and_grad(kind: str, norm: str, options: dict[str, Any], impl: str, axis: str):
    """``(loss, dloss/dlogits_local)`` of one replica's slice; for "none" the summed per-token
    losses weighted by the upstream gradient."""

    def objective(x, target, mask, upstream):
        loss = FNS[kind](x, target, mask, normalization=norm, vocab_parallel=axis, impl=impl, **options)
        return jnp.sum(loss * upstream) if norm == "none" else loss, loss

    def run(x, target, mask, upstream):
        (_, loss), grad = jax.value_and_grad(objective, has_aux=True)(x, target, mask, upstream)
        return loss, grad

    return run


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, norm: str, options: tuple[tuple[str, Any], ...], impl: str, shards: int):
    """One jitted shard_map per (kind, normalisation, options, path, P): the scenarios and dtypes
    of a config reuse its traces (a fresh closure per call compiled every case anew)."""
    mesh = Mesh(np.array(jax.devices()[:shards]), ("model",))
    vocab_spec = P(None, None, "model")
    target_spec = P() if kind == "cross_entropy" else vocab_spec
    # Pallas interpret mode (the CPU stand-in for the GPU kernel) needs check_vma=False in JAX
    # 0.10.2 (see test_jaxloss_transforms); the GPU lowering is checked with it on in
    # test_jaxloss_kernels.
    run = _loss_and_grad(kind, norm, dict(options), impl, "model")
    return jax.jit(shard_map(run, mesh=mesh, in_specs=(vocab_spec, target_spec, P(), P()), out_specs=(P(), vocab_spec),
                             check_vma=impl != "pallas"))


def _shard_map_call(case, dtype, kind, norm, options, impl, shards):
    return _compiled(kind, norm, tuple(sorted(options.items())), impl, shards)(*_inputs(case, dtype))


def _check(kind, norm, dtype, scenario, options, loss, grad, what):
    case = _case(kind, scenario, dtype)
    ref = _reference(case, norm, options)
    lossspec.assert_close_to_oracle(np.asarray(loss, np.float64), np.asarray(jnp.asarray(grad, jnp.float32), np.float64),
                                    ref.loss, ref.grad, dtype=dtype, g0=ref.g0, what=what)


@pytest.mark.parametrize("shards", (2, 4))
@pytest.mark.parametrize("kind", KINDS)
def test_vocab_parallel_shard_map_matches_oracle(kind: str, shards: int) -> None:
    checked = 0
    for k, norm, dtype, scenario, opt_name, options in _configs():
        if k != kind or (shards == 4 and dtype != "float32"):  # P = 4: fp32 only (compile time)
            continue
        case = _case(kind, scenario, dtype)
        loss, grad = _shard_map_call(case, dtype, kind, norm, options, "xla", shards)
        assert grad.shape == case.logits.shape and grad.dtype == JNP_DTYPES[dtype]
        _check(kind, norm, dtype, scenario, options, loss, grad, f"P={shards}/{kind}/{norm}/{dtype}/{scenario}/{opt_name}")
        checked += 1
    assert checked >= (24 if shards == 2 else 12)


@pytest.mark.parametrize("kind", KINDS)
def test_vocab_parallel_reduced_modes_and_denominator_match_oracle(kind: str) -> None:
    """"tokens", "sum" and ``denominator=`` (constant, or traced inside the shard_map) over P = 2
    shards, against the oracle with the same normalisation and denominator."""
    shards = 2
    mesh = Mesh(np.array(jax.devices()[:shards]), ("model",))
    vocab_spec = P(None, None, "model")
    target_spec = P() if kind == "cross_entropy" else vocab_spec
    options_of = {"plain": {}, "opts": options_for(kind, "random")["smooth_z" if kind == "cross_entropy" else "temp"]}
    for scenario, dtype, norm, denominator, opt_name in REDUCED_CONFIGS:
        case = _case(kind, scenario, dtype)
        logits, target, mask, _ = _inputs(case, dtype)
        options = dict(options_of[opt_name])
        traced = denominator == "traced"
        if denominator is not None and not traced:
            options["denominator"] = denominator
        ref_denominator = 7.5 if traced else denominator

        def run(x, t, m, d, options=options, norm=norm, traced=traced):
            def objective(x):
                extra = {"denominator": d} if traced else {}
                return FNS[kind](x, t, m, normalization=norm, vocab_parallel="model", impl="xla", **options, **extra)

            return jax.value_and_grad(objective)(x)

        fn = shard_map(run, mesh=mesh, in_specs=(vocab_spec, target_spec, P(), P()), out_specs=(P(), vocab_spec))
        loss, grad = jax.jit(fn)(logits, target, mask, jnp.float32(7.5))
        assert grad.shape == case.logits.shape and grad.dtype == JNP_DTYPES[dtype]
        ref_options = {k: v for k, v in options.items() if k != "denominator"}
        if ref_denominator is not None:
            ref_options["denominator"] = ref_denominator
        ref = case.reference(normalization=norm, **ref_options)
        lossspec.assert_close_to_oracle(np.asarray(loss, np.float64), np.asarray(grad.astype(jnp.float32), np.float64),
                                        ref.loss, ref.grad, dtype=dtype, g0=ref.g0,
                                        what=f"P=2/{kind}/{norm}/D={denominator}/{dtype}/{scenario}/{opt_name}")


@pytest.mark.parametrize("config", sorted(PALLAS_CONFIGS), ids=lambda c: "/".join(c))
def test_vocab_parallel_pallas_matches_oracle(config: tuple[str, ...]) -> None:
    kind, norm, dtype, scenario, opt_name = config
    options = options_for(kind, scenario)[opt_name]
    case = _case(kind, scenario, dtype)
    loss, grad = _shard_map_call(case, dtype, kind, norm, options, "pallas", 2)
    _check(kind, norm, dtype, scenario, options, loss, grad, "pallas/" + "/".join(config))
    # The XLA path on the same call: its loss and gradient against the oracle too, and the loss
    # the same as the kernel's (both use the same algebra, in the same order per block).
    loss_xla, grad_xla = _shard_map_call(case, dtype, kind, norm, options, "xla", 2)
    _check(kind, norm, dtype, scenario, options, loss_xla, grad_xla, "xla beside pallas/" + "/".join(config))
    np.testing.assert_allclose(np.asarray(loss), np.asarray(loss_xla), rtol=lossspec.LOSS_RTOL, atol=0)


@pytest.mark.parametrize("kind", ("cross_entropy", "reverse_kl"))
def test_vocab_parallel_pallas_masked_garbage_row_stays_zero(kind: str) -> None:
    """The Pallas "grad" mode runs several rows a program (8 interpreted) against the rows' global
    statistics, which the "stats" mode computed for every row, masked or not: a masked row of NaN /
    ``+inf`` garbage has NaN statistics, so 0 times its gradient would be NaN. It must come out
    exactly 0, and the call the oracle's (of the same batch without the garbage)."""
    norm, dtype = "valid_tokens", "float32"
    case = _case(kind, "random", dtype)
    mask = np.ones(LEAD, bool) if case.loss_mask is None else np.asarray(case.loss_mask) != 0
    mask[1, 2] = False
    logits = np.array(case.logits)
    logits[1, 2, :] = np.nan
    logits[1, 2, 7] = np.inf
    clean = dataclasses.replace(case, loss_mask=mask)
    loss, grad = _compiled(kind, norm, (), "pallas", 2)(*_inputs(dataclasses.replace(clean, logits=logits), dtype))
    grad = np.asarray(grad, np.float64)
    assert np.all(grad[1, 2] == 0.0), grad[1, 2]
    ref = clean.reference(normalization=norm)
    lossspec.assert_close_to_oracle(np.asarray(loss, np.float64), grad, ref.loss, ref.grad, dtype=dtype, g0=ref.g0,
                                    what=f"pallas/{kind}/masked garbage row")


@pytest.mark.parametrize("kind", KINDS)
def test_vocab_parallel_pmap_matches_oracle(kind: str) -> None:
    scenario, dtype, norm = "random", "float32", "valid_tokens"
    options = options_for(kind, scenario)["plain" if kind == "cross_entropy" else "temp"]
    case = _case(kind, scenario, dtype)
    logits, target, mask, upstream = _inputs(case, dtype)
    shards = 2
    split = lambda a: jnp.moveaxis(a.reshape(*LEAD, shards, VOCAB // shards), -2, 0)  # noqa: E731
    fn = jax.pmap(_loss_and_grad(kind, norm, options, "xla", "model"), axis_name="model",
                  in_axes=(0, None if kind == "cross_entropy" else 0, None, None))
    loss, grad = fn(split(logits), target if kind == "cross_entropy" else split(target), mask, upstream)
    assert np.array_equal(np.asarray(loss[0]), np.asarray(loss[1])), "replicas disagree on the loss"
    full_grad = jnp.concatenate(list(grad), axis=-1)
    _check(kind, norm, dtype, scenario, options, loss[0], full_grad, f"pmap/{kind}")


def test_vocab_parallel_loss_is_identical_on_every_shard() -> None:
    """The loss leaves shard_map unreplicated (out_specs P("model")): all 4 copies bit-identical."""
    case = _case("reverse_kl", "huge", "float32")
    logits, target, mask, _ = _inputs(case, "float32")
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))

    def per_shard(x, t, m):
        return jaxloss.reverse_kl(x, t, m, vocab_parallel="model")[None]

    spec = P(None, None, "model")
    losses = shard_map(per_shard, mesh=mesh, in_specs=(spec, spec, P()), out_specs=P("model"))(logits, target, mask)
    assert losses.shape == (4,) and len(set(np.asarray(losses).tolist())) == 1
    # ... and the value those copies agree on is the oracle's.
    lossspec.compare_loss(np.asarray(losses)[0], _reference(case, "valid_tokens", {}).loss, "every shard's loss").check()
