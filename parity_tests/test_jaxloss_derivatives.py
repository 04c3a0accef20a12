"""Derivatives beyond first-order reverse mode.

- ``impl="xla"`` with float32 logits: second derivatives (``jax.jvp`` of ``jax.grad``,
  ``jax.grad`` of a gradient, ``jax.hessian``) are correct: a Hessian-vector product equals the
  central finite difference of the float64 oracle's gradient.
- Where they would be wrong or fail obscurely, a ``NotImplementedError`` that says what to do:
  ``impl="pallas"`` (a bare AssertionError from Pallas before), bfloat16 / float16 logits on
  the XLA path (silently 0 before: the logits travel as raw bits), ``vocab_parallel`` (pmax has
  no derivative rule), and forward mode on the loss itself (``jax.jvp``, ``jax.jacfwd``: the
  losses are ``custom_vjp``s).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxloss
import lossspec

N, V = 5, 12
RNG = np.random.default_rng(21)
X = RNG.normal(size=(N, V)).astype(np.float32) * 2
DIRECTION = RNG.normal(size=(N, V)).astype(np.float32)
LABELS = RNG.integers(0, V, N)
LABELS[3] = -100
TEACHER = RNG.normal(size=(N, V)).astype(np.float32) * 2
MASK = np.array([1.0, 0.5, 0.0, 2.0, 1.0], np.float32)
UPSTREAM = np.linspace(0.5, 1.5, N).astype(np.float32)
FNS = {"cross_entropy": jaxloss.cross_entropy, "soft_cross_entropy": jaxloss.soft_cross_entropy,
       "forward_kl": jaxloss.forward_kl, "reverse_kl": jaxloss.reverse_kl}
CASES = [
    ("cross_entropy", {}),
    ("cross_entropy", {"label_smoothing": 0.1, "z_loss": 1e-2, "logit_scale": 1.5, "normalization": "none"}),
    ("soft_cross_entropy", {"temperature": 2.0}),
    ("forward_kl", {"temperature": 0.7, "teacher_logit_scale": 1.2}),
    ("reverse_kl", {"temperature": 1.3, "logit_scale": 0.8}),
    ("reverse_kl", {"normalization": "none"}),
]


def _target(kind: str) -> np.ndarray:
    return LABELS if kind == "cross_entropy" else TEACHER


def _objective(kind: str, options: dict[str, Any], impl: str = "xla", teacher: Any = None):
    """A scalar: the loss, or the per-token losses weighted by a non-unit upstream gradient."""
    target = _target(kind) if teacher is None else teacher

    def f(x: jax.Array) -> jax.Array:
        loss = FNS[kind](x, target, MASK, impl=impl, **options)
        return jnp.sum(loss * UPSTREAM) if options.get("normalization") == "none" else loss

    return f


def _oracle_hvp(kind: str, options: dict[str, Any], h: float = 1e-4) -> np.ndarray:
    """``H v`` from the float64 oracle: central difference of its analytic gradient."""
    opts = dict(options)
    if opts.get("normalization") == "none":
        opts["grad_output"] = UPSTREAM.astype(np.float64)
    x, v = X.astype(np.float64), DIRECTION.astype(np.float64)
    plus = lossspec.oracle(kind, x + h * v, _target(kind), MASK, **opts)[1]
    minus = lossspec.oracle(kind, x - h * v, _target(kind), MASK, **opts)[1]
    return (plus - minus) / (2 * h)


def _assert_close(got: Any, ref: np.ndarray, what: str) -> None:
    got = np.asarray(got, np.float64)
    scale = np.max(np.abs(ref))
    assert scale > 1e-3, what  # a real second derivative, not a cancelled one
    err = np.max(np.abs(got - ref)) / scale
    # float32 second derivatives against an O(h^2) central difference (observed ~3e-7).
    assert err < 1e-5, f"{what}: max error {err:.3g} of max |Hv| {scale:.3g}"


@pytest.mark.parametrize("kind,options", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_xla_second_order_matches_oracle(kind: str, options: dict[str, Any]) -> None:
    f = _objective(kind, options)
    ref = _oracle_hvp(kind, options)
    x, v = jnp.asarray(X), jnp.asarray(DIRECTION)
    forward_over_reverse = jax.jit(lambda x: jax.jvp(jax.grad(f), (x,), (v,))[1])(x)
    _assert_close(forward_over_reverse, ref, "jvp(grad)")
    reverse_over_reverse = jax.grad(lambda x: jnp.vdot(jax.grad(f)(x), v))(x)  # H symmetric: H v
    _assert_close(reverse_over_reverse, ref, "grad(grad . v)")


def test_xla_hessian_matches_oracle() -> None:
    kind, options = "forward_kl", {"temperature": 1.5}
    x = jnp.asarray(X[:2, :6])
    teacher = TEACHER[:2, :6]
    hess = np.asarray(jax.hessian(lambda x: jaxloss.forward_kl(x, teacher, impl="xla", **options))(x), np.float64)
    assert hess.shape == (2, 6, 2, 6)
    h = 1e-4
    for i, j in [(0, 0), (1, 3), (0, 5)]:
        e = np.zeros((2, 6))
        e[i, j] = 1.0
        x64 = np.asarray(x, np.float64)
        column = (lossspec.oracle(kind, x64 + h * e, teacher, **options)[1] - lossspec.oracle(kind, x64 - h * e, teacher, **options)[1]) / (2 * h)
        _assert_close(hess[:, :, i, j], column, f"hessian column {(i, j)}")
    np.testing.assert_allclose(hess.reshape(12, 12), hess.reshape(12, 12).T, atol=1e-6)


def test_xla_second_order_with_a_bfloat16_teacher() -> None:
    """Only the student's dtype matters: a 16-bit teacher gets no derivative anyway."""
    kind, options = "reverse_kl", {"temperature": 1.3, "logit_scale": 0.8}
    teacher16 = jnp.asarray(TEACHER).astype(jnp.bfloat16)
    f = _objective(kind, options, teacher=teacher16)
    got = jax.jvp(jax.grad(f), (jnp.asarray(X),), (jnp.asarray(DIRECTION),))[1]
    h = 1e-4
    t64 = np.asarray(teacher16.astype(jnp.float32), np.float64)
    x, v = X.astype(np.float64), DIRECTION.astype(np.float64)
    ref = (lossspec.oracle(kind, x + h * v, t64, MASK, **options)[1] - lossspec.oracle(kind, x - h * v, t64, MASK, **options)[1]) / (2 * h)
    _assert_close(got, ref, "jvp(grad), bf16 teacher")


def _second_orders(f, x: jax.Array) -> dict[str, Any]:
    v = jnp.ones_like(x)
    return {
        "grad(grad)": lambda: jax.grad(lambda x: jnp.sum(jax.grad(f)(x).astype(jnp.float32) ** 2))(x),
        "jvp(grad)": lambda: jax.jvp(jax.grad(f), (x,), (v,)),
        "jit(jvp(grad))": lambda: jax.jit(lambda x: jax.jvp(jax.grad(f), (x,), (v,)))(x),
        "hessian": lambda: jax.hessian(f)(x),
    }


@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
def test_pallas_second_order_raises_a_clear_error(kind: str) -> None:
    f = _objective(kind, {}, impl="pallas")
    jax.grad(f)(jnp.asarray(X))  # first order works
    for name, run in _second_orders(f, jnp.asarray(X)).items():
        with pytest.raises(NotImplementedError, match=r"impl='pallas' supports first-order.*use impl='xla'"):
            run()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_xla_second_order_of_16bit_logits_raises(dtype: str) -> None:
    """16-bit logits travel as raw bits: the second derivative was silently 0."""
    f = _objective("cross_entropy", {"label_smoothing": 0.1})
    x = jnp.asarray(X).astype(dtype)
    jax.grad(f)(x)  # first order works
    for name, run in _second_orders(f, x).items():
        with pytest.raises(NotImplementedError, match=r"need float32 or float64 logits.*astype\(jnp.float32\)"):
            run()
    # The advertised way out: cast to float32 in front of the loss.
    got = jax.jvp(jax.grad(lambda x: f(x.astype(jnp.float32))), (x,), (jnp.asarray(DIRECTION).astype(dtype),))[1]
    assert np.all(np.isfinite(np.asarray(got, np.float32))) and np.any(np.asarray(got, np.float32) != 0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_vocab_parallel_second_order_raises(impl: str) -> None:
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))

    def local(x: jax.Array) -> jax.Array:
        return jaxloss.cross_entropy(x, LABELS, MASK, vocab_parallel="model", impl=impl)

    f = jax.shard_map(local, mesh=mesh, in_specs=P(None, "model"), out_specs=P())
    x = jnp.asarray(X)
    lossspec.compare_loss(jax.jit(f)(x), lossspec.oracle("cross_entropy", X, LABELS, MASK)[0]).check()
    for name in ("jvp(grad)", "jit(jvp(grad))", "hessian"):
        with pytest.raises(NotImplementedError, match=r"not supported with vocab_parallel.*vocab_parallel=None"):
            _second_orders(f, x)[name]()


HEAD_H = RNG.normal(size=(N, 4)).astype(np.float32)
HEAD_W = (RNG.normal(size=(V, 4)) * 0.7).astype(np.float32)
HEAD_B = (RNG.normal(size=V) * 0.5).astype(np.float32)
HEAD_DIRECTION = RNG.normal(size=(V, 4)).astype(np.float32)


def _head(recompute: bool, impl: str = "xla", hidden: Any = HEAD_H, bias: Any = HEAD_B):
    """The fused head's cross-entropy as a function of the weight."""
    return lambda w: jaxloss.linear_cross_entropy(hidden, w, LABELS, MASK, bias=bias, label_smoothing=0.1, impl=impl, recompute_logits=recompute)


@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute_logits"])
def test_xla_head_second_order_matches_oracle(recompute: bool) -> None:
    """The fused head on the XLA path with float32 inputs keeps correct second derivatives, as
    the losses: ``H v`` w.r.t. the weight (forward over reverse, reverse over reverse) and the
    mixed route (the hidden states' derivative of the weight gradient) against central
    differences of the float64 head oracle's gradients."""
    from lossspec import linear as spec_linear

    step = 1e-4
    h64, w64, v64, b64 = (a.astype(np.float64) for a in (HEAD_H, HEAD_W, HEAD_DIRECTION, HEAD_B))

    def oracle_grads(hidden: np.ndarray, weight: np.ndarray) -> dict[str, np.ndarray]:
        return spec_linear.oracle_head("cross_entropy", hidden, weight, LABELS, MASK, bias=b64, label_smoothing=0.1)[1]

    ref = (oracle_grads(h64, w64 + step * v64)["weight"] - oracle_grads(h64, w64 - step * v64)["weight"]) / (2 * step)
    f, w, v = _head(recompute), jnp.asarray(HEAD_W), jnp.asarray(HEAD_DIRECTION)
    _assert_close(jax.jvp(jax.grad(f), (w,), (v,))[1], ref, "head jvp(grad)")
    _assert_close(jax.grad(lambda w: jnp.vdot(jax.grad(f)(w), v))(w), ref, "head grad(grad . v)")
    # d/dh <dL/dW, v>: a central difference over h of the oracle's weight gradient, one column at a time
    mixed = jax.grad(lambda h: jnp.vdot(jax.grad(_head(recompute, hidden=h))(w), v))(jnp.asarray(HEAD_H))
    ref_mixed = np.zeros_like(h64)
    for index in np.ndindex(*h64.shape):
        e = np.zeros_like(h64)
        e[index] = step
        ref_mixed[index] = np.vdot(oracle_grads(h64 + e, w64)["weight"] - oracle_grads(h64 - e, w64)["weight"], v64) / (2 * step)
    _assert_close(mixed, ref_mixed, "head d/dh <grad_w, v>")


@pytest.mark.parametrize("case", ["bfloat16", "bfloat16-recompute_logits"])
def test_head_second_order_raises_where_it_would_be_wrong(case: str) -> None:
    """16-bit inputs travel as raw bits (the head's Hessian w.r.t. a bf16 weight was silently
    wrong with recompute_logits, the mixed hidden/weight route silently 0). Each route now raises
    the documented NotImplementedError."""
    impl, dtype = "xla", jnp.bfloat16
    hidden, w = jnp.asarray(HEAD_H).astype(dtype), jnp.asarray(HEAD_W).astype(dtype)
    recompute = case.endswith("recompute_logits")
    f = _head(recompute, impl, hidden=hidden, bias=None)
    jax.grad(f)(w)  # first order works
    match = r"fused head need float32 or float64 hidden states"
    routes = dict(_second_orders(f, w))
    routes["d/dh grad_w"] = lambda: jax.grad(lambda h: jnp.sum(jax.grad(_head(recompute, impl, hidden=h, bias=None))(w).astype(jnp.float32) ** 2))(hidden)
    for name, run in routes.items():
        with pytest.raises(NotImplementedError, match=match):
            run()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_forward_mode_on_the_loss_raises_a_clear_error(impl: str) -> None:
    f = _objective("soft_cross_entropy", {}, impl=impl)
    x = jnp.asarray(X)
    for run in (lambda: jax.jvp(f, (x,), (x,)), lambda: jax.jacfwd(f)(x)):
        with pytest.raises(NotImplementedError, match=r"forward-mode differentiation of the loss.*jax.grad.*jax.hessian"):
            run()
    # Inside an outer jit JAX raises its own error first (no hook for it): still an error.
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x)
