"""jaxloss under JAX transformations, and the behaviours of SPEC sections 1-2 and 6 that are not
a plain oracle comparison: determinism, stop-gradient on the teacher, untouched inputs, no
recompilation for a new denominator, NaN rows, ``D == 0``, and no gradient w.r.t. the weights."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxloss
import lossspec
from lossspec import KINDS, assert_close_to_oracle, compare_grad, compare_loss, make_case

IMPLS = ("xla", "pallas")
FNS = {
    "cross_entropy": jaxloss.cross_entropy,
    "soft_cross_entropy": jaxloss.soft_cross_entropy,
    "forward_kl": jaxloss.forward_kl,
    "reverse_kl": jaxloss.reverse_kl,
}
VOCAB = 130  # two vocabulary blocks of the interpreted kernel, the second ragged


def arrays(case: lossspec.Case) -> tuple[jax.Array, Any, Any]:
    x = jnp.asarray(case.logits).astype(case.dtype)
    target = jnp.asarray(case.target) if case.kind == "cross_entropy" else jnp.asarray(case.target).astype(case.dtype)
    mask = None if case.loss_mask is None else jnp.asarray(case.loss_mask)
    return x, target, mask


def close(case: lossspec.Case, loss: Any, grad: Any, what: str, **options: Any) -> None:
    ref = case.reference(**options)
    assert_close_to_oracle(
        np.asarray(loss), np.asarray(jnp.asarray(grad).astype(jnp.float32)), ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0, what=what
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_jit_grad_value_and_grad(kind: str, impl: str) -> None:
    case = make_case(kind, "float_weights", lead_shape=(3, 4), vocab=VOCAB)
    x, target, mask = arrays(case)
    fn = partial(FNS[kind], impl=impl)

    def loss_fn(logits: jax.Array) -> jax.Array:
        return fn(logits, target, mask)

    loss, grad = jax.jit(jax.value_and_grad(loss_fn))(x)
    close(case, loss, grad, "jit(value_and_grad)")
    close(case, loss_fn(x), jax.grad(loss_fn)(x), "eager loss / grad")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_vmap(kind: str, impl: str) -> None:
    """``vmap`` over a leading batch axis: each example is normalised by its own count."""
    case = make_case(kind, "random", lead_shape=(3, 5), vocab=VOCAB, seed=5)
    x, target, mask = arrays(case)
    fn = partial(FNS[kind], impl=impl)
    batched = jax.vmap(lambda x, t, m: fn(x, t, m))
    losses = batched(x, target, mask)
    grads = jax.grad(lambda x: jnp.sum(batched(x, target, mask)))(x)
    assert losses.shape == (3,)
    for b in range(3):
        sub = lossspec.Case(kind, "random", case.dtype, case.logits[b], case.target[b], case.loss_mask[b])
        close(sub, losses[b], grads[b], f"vmap example {b}")
    # vmap of the per-token mode, too.
    per_token = jax.vmap(lambda x, t, m: fn(x, t, m, normalization="none"))(x, target, mask)
    ref = case.reference(normalization="none")
    compare_loss(np.asarray(per_token), ref.loss, "vmap none").check()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_shard_map_global_denominator(kind: str, impl: str) -> None:
    """Data parallel in ``shard_map``: the two-pass step of SPEC section 4 (``count_denominator``
    summed with ``psum``, then ``denominator=D``) gives the full-batch loss and gradient; one
    replica is entirely masked."""
    case = make_case(kind, "float_weights", lead_shape=(8, 3), vocab=VOCAB, seed=6)
    case.loss_mask[2:4] = 0.0  # replica 1 holds no valid token
    x, target, mask = arrays(case)
    mesh = jax.make_mesh((4,), ("data",))
    ce = kind == "cross_entropy"

    def local(x: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        count = jaxloss.count_denominator(t if ce else None, m)
        denominator = jax.lax.psum(count, "data")
        return jax.lax.psum(FNS[kind](x, t, m, denominator=denominator, impl=impl), "data")

    # The default check_vma=True, for Pallas interpret mode too (test_jaxloss_shard_map.py).
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data"), P("data")), out_specs=P())
    x, target, mask = jax.device_put((x, target, mask), jax.sharding.NamedSharding(mesh, P("data")))
    loss, grad = jax.jit(jax.value_and_grad(sharded))(x, target, mask)
    close(case, loss, grad, "shard_map")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_pmap_global_denominator(kind: str, impl: str) -> None:
    case = make_case(kind, "random", lead_shape=(4, 2, 3), vocab=VOCAB, seed=7)
    x, target, mask = arrays(case)
    ce = kind == "cross_entropy"
    count = jax.pmap(lambda t, m: jax.lax.psum(jaxloss.count_denominator(t if ce else None, m), "i"), axis_name="i")
    denominators = count(target, mask)

    def local(x: jax.Array, t: jax.Array, m: jax.Array, d: jax.Array) -> jax.Array:
        return FNS[kind](x, t, m, denominator=d, impl=impl)

    losses, grads = jax.pmap(jax.value_and_grad(local), axis_name="i")(x, target, mask, denominators)
    close(case, jnp.sum(losses), grads, "pmap")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_teacher_and_inputs(kind: str, impl: str) -> None:
    """Bit-identical outputs run after run (eager and jit), zero teacher gradient, inputs
    (NumPy arrays) untouched."""
    case = make_case(kind, "huge", lead_shape=(9,), vocab=VOCAB, seed=8)
    logits, target, mask = case.logits.copy(), case.target.copy(), case.loss_mask.copy()
    fn = partial(FNS[kind], impl=impl)
    vg = jax.value_and_grad(lambda x, t: fn(x, t, case.loss_mask), argnums=(0, 1) if kind != "cross_entropy" else 0)
    first = vg(case.logits, case.target)
    second = vg(case.logits, case.target)
    jitted = jax.jit(vg)
    third, fourth = jitted(case.logits, case.target), jitted(case.logits, case.target)
    for other in (second, third, fourth):
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(other)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    if kind != "cross_entropy":
        (_, (_, teacher_grad)) = first
        assert np.all(np.asarray(teacher_grad) == 0.0)
    np.testing.assert_array_equal(case.logits, logits)
    np.testing.assert_array_equal(case.target, target)
    np.testing.assert_array_equal(case.loss_mask, mask)


@pytest.mark.parametrize("impl", IMPLS)
def test_denominator_does_not_recompile(impl: str) -> None:
    case = make_case("cross_entropy", "random", lead_shape=(6,), vocab=VOCAB)
    x, labels, mask = arrays(case)
    traces = []

    @jax.jit
    def step(x: jax.Array, denominator: jax.Array) -> tuple[jax.Array, jax.Array]:
        traces.append(1)  # runs once per trace
        return jax.value_and_grad(lambda x: jaxloss.cross_entropy(x, labels, mask, denominator=denominator, impl=impl))(x)

    for denominator in (3.0, 5.0, 11.0):
        loss, grad = step(x, jnp.float32(denominator))
        close(case, loss, grad, f"jit D={denominator}", denominator=denominator)
    assert len(traces) == 1
    # Eager calls: a new denominator reuses the compiled kernel and preparation.
    jaxloss.cross_entropy(x, labels, mask, denominator=2.0, impl=impl)
    sizes = (jaxloss._autodiff.loss_tokens._cache_size(), jaxloss._prepare.prepare._cache_size())
    for denominator in (4.0, np.float32(6.0), jnp.asarray(8.0)):
        loss = jaxloss.cross_entropy(x, labels, mask, denominator=denominator, impl=impl)
        compare_loss(loss, case.reference(denominator=float(denominator)).loss).check()
    assert (jaxloss._autodiff.loss_tokens._cache_size(), jaxloss._prepare.prepare._cache_size()) == sizes


def test_teacher_kinds_and_new_options_share_the_preparation() -> None:
    """The coefficients are compiled per counting config (``LossConfig.counting_config``): every
    teacher kind, at any temperature, reuses the first one's compiled ``prepare``, and each
    loss still matches the oracle (a counting config that lost a field the weights depend on
    would not)."""
    teacher_kinds = [kind for kind, spec in lossspec.KIND_SPECS.items() if spec.has_teacher]
    first = make_case(teacher_kinds[0], "random", lead_shape=(2, 5), vocab=VOCAB, seed=4)
    sizes = None
    for kind in teacher_kinds:
        for temperature in (1.0, 2.5):
            case = make_case(kind, "random", lead_shape=(2, 5), vocab=VOCAB, seed=4)
            for normalization in ("valid_tokens", "sequence_mean"):
                loss = getattr(jaxloss, kind)(jnp.asarray(case.logits), jnp.asarray(first.target), jnp.asarray(case.loss_mask), impl="xla",
                                 temperature=temperature, normalization=normalization, causal_shift=True)
                ref = lossspec.oracle(kind, case.logits, first.target, case.loss_mask, temperature=temperature,
                                      normalization=normalization, causal_shift=True)
                compare_loss(loss, ref[0]).check()
            if sizes is None:
                sizes = jaxloss._prepare.prepare._cache_size()
    assert jaxloss._prepare.prepare._cache_size() == sizes  # two counting configs, compiled by the first kind


def test_reduced_modes_share_the_finishing_program() -> None:
    """Eager calls: the last step (sum, or reshape for ``normalization="none"``) is compiled once
    for every reduced mode and leading shape of the same token count, and once per leading shape
    for "none" (it was keyed on the mode's name: one compile per mode); each loss still matches
    the oracle."""
    finish = jaxloss._prepare.finish
    sizes = []
    for lead_shape in ((2, 5), (10,)):
        case = make_case("cross_entropy", "random", lead_shape=lead_shape, vocab=VOCAB, seed=3)
        x, labels, mask = arrays(case)
        for normalization in ("valid_tokens", "tokens", "sum", "none"):
            loss = jaxloss.cross_entropy(x, labels, mask, normalization=normalization, impl="xla")
            ref = case.reference(normalization=normalization)
            assert loss.shape == (lead_shape if normalization == "none" else ())
            compare_loss(np.asarray(loss), ref.loss).check()
            sizes.append(finish._cache_size())
    first = sizes[0]
    assert sizes == [first, first, first, first + 1, first + 1, first + 1, first + 1, first + 2], sizes


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_inf_rows(kind: str, impl: str) -> None:
    """``+inf`` or NaN anywhere in a valid row: NaN loss (and a NaN gradient row), never a
    plausible number; in a masked row: no effect at all."""
    case = make_case(kind, "random", lead_shape=(12,), vocab=VOCAB, seed=9)
    ce = kind == "cross_entropy"
    valid, _ = lossspec.token_weights(lossspec.make_config(kind), case.target if ce else None, case.loss_mask, (12,))
    rows_valid = np.flatnonzero(valid)
    rows_masked = np.flatnonzero(~valid)
    assert len(rows_valid) >= 3 and len(rows_masked) >= 1
    x = case.logits.copy()
    x[rows_valid[0], 7] = np.inf
    x[rows_valid[1], 100] = np.nan
    x[rows_masked[0], 3] = np.nan
    target = case.target.copy()
    if not ce:
        target[rows_valid[2], 129] = np.nan  # a bad teacher row
    fn = partial(FNS[kind], impl=impl)
    per_token, grad = jax.value_and_grad(lambda x: jnp.sum(fn(x, target, case.loss_mask, normalization="none")))(jnp.asarray(x))
    tokens = np.asarray(fn(jnp.asarray(x), target, case.loss_mask, normalization="none"))
    bad = [rows_valid[0], rows_valid[1]] + ([] if ce else [rows_valid[2]])
    assert np.all(np.isnan(tokens[bad]))
    assert np.all(np.isnan(np.asarray(grad)[bad]))
    good = np.setdiff1d(np.arange(12), bad)
    clean = case.logits.copy()
    clean[rows_masked[0]] = 0.0
    ref = lossspec.oracle(kind, clean, case.target, case.loss_mask, normalization="none")
    compare_loss(tokens[good], ref[0][good]).check()
    compare_grad(np.asarray(grad)[good], ref[1][good], "float32", g0=1.0).check()
    assert np.isnan(float(fn(jnp.asarray(x), target, case.loss_mask)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_denominator(kind: str, impl: str) -> None:
    """``D == 0`` (everything masked, or ``denominator=0``): loss 0 and gradient exactly 0."""
    case = make_case(kind, "all_masked", lead_shape=(5,), vocab=VOCAB)
    x, target, mask = arrays(case)
    fn = partial(FNS[kind], impl=impl)
    for kwargs in ({}, {"normalization": "tokens", "denominator": 0.0}):
        loss, grad = jax.value_and_grad(lambda x: fn(x, target, mask, **kwargs))(x)
        assert float(loss) == 0.0 and not np.any(np.asarray(grad))
    live = make_case(kind, "random", lead_shape=(5,), vocab=VOCAB)
    x, target, mask = arrays(live)
    loss, grad = jax.value_and_grad(lambda x: fn(x, target, mask, denominator=0.0))(x)
    assert float(loss) == 0.0 and not np.any(np.asarray(grad))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_no_gradient_to_weights_or_denominator(kind: str, impl: str) -> None:
    """``loss_mask`` and ``denominator`` are data, like the labels (the rule torch shares):
    ``jax.grad`` w.r.t. float weights and a traced denominator is exactly 0, eagerly and under
    ``jit``, while the gradient w.r.t. the logits is the oracle's."""
    case = make_case(kind, "float_weights", lead_shape=(7,), vocab=VOCAB)
    x, target, mask = arrays(case)
    fn = partial(FNS[kind], impl=impl)
    denominator = 5.5
    vg = jax.value_and_grad(lambda x, w, d: fn(x, target, w, denominator=d), argnums=(0, 1, 2))
    for run in (jax.jit(vg),) if impl == "pallas" else (vg, jax.jit(vg)):  # (interpret mode is slow)
        loss, (dx, dw, dd) = run(x, mask, jnp.float32(denominator))
        assert np.all(np.asarray(dw) == 0.0) and dw.shape == mask.shape and dw.dtype == mask.dtype
        assert float(dd) == 0.0
        close(case, loss, dx, "grad w.r.t. logits, mask and D as arguments", denominator=denominator)
    if impl == "pallas":
        return
    # Per-token losses ("none") and the count: no gradient to the weights either.
    dw = jax.grad(lambda w: jnp.sum(fn(x, target, w, normalization="none") * jnp.arange(7.0)))(mask)
    assert np.all(np.asarray(dw) == 0.0)
    ce = kind == "cross_entropy"
    dw = jax.grad(lambda w: jaxloss.count_denominator(target if ce else None, w))(mask)
    assert np.all(np.asarray(dw) == 0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_traced_bad_values_give_nan(kind: str) -> None:
    """Under ``jit`` nothing is read on the host: a valid label outside ``[0, V)``, a negative
    or non-finite weight, or a negative denominator make the loss NaN."""
    case = make_case(kind, "float_weights", lead_shape=(6,), vocab=VOCAB)
    x, target, mask = arrays(case)
    fn = jax.jit(lambda x, t, m, d: FNS[kind](x, t, m, denominator=d))
    assert np.isfinite(float(fn(x, target, mask, jnp.float32(4.0))))
    assert np.isnan(float(fn(x, target, mask.at[1].set(-1.0), jnp.float32(4.0))))
    assert np.isnan(float(fn(x, target, mask.at[1].set(jnp.inf), jnp.float32(4.0))))
    assert np.isnan(float(fn(x, target, mask, jnp.float32(-4.0))))
    assert np.isnan(float(fn(x, target, mask, jnp.float32(jnp.nan))))
    # Weights and D are used in float32: a weight set whose float32 sum overflows, positive
    # weights below the smallest normal float32 (also bfloat16 subnormals), a subnormal D.
    assert np.isnan(float(fn(x, target, mask.at[0].set(3e38).at[1].set(3e38), jnp.float32(4.0))))
    assert np.isnan(float(fn(x, target, mask.at[1].set(1e-40), jnp.float32(4.0))))
    assert np.isnan(float(fn(x, target, mask.at[1].set(1e-45), None if kind == "cross_entropy" else jnp.float32(4.0))))
    assert np.isnan(float(fn(x, target, mask.astype(jnp.bfloat16).at[1].set(1e-40), jnp.float32(4.0))))
    assert np.isnan(float(fn(x, target, mask, jnp.float32(1e-40))))
    assert np.isfinite(float(fn(x, target, mask.at[1].set(float(np.finfo(np.float32).tiny)), jnp.float32(4.0))))
    if kind == "cross_entropy":
        valid = np.flatnonzero((np.asarray(mask) != 0) & (np.asarray(target) != -100))
        for bad_label in (VOCAB, -1, 10**6):
            assert np.isnan(float(fn(x, target.at[valid[0]].set(bad_label), mask, jnp.float32(4.0))))
        per_token = jax.jit(lambda x, t: jaxloss.cross_entropy(x, t, normalization="none"))(x, target.at[valid[0]].set(VOCAB))
        assert np.all(np.isnan(np.asarray(per_token)))
