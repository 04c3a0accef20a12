"""Every bad input of SPEC section 5 raises before any kernel runs, with the error type and
message of ``lossspec`` (the oracle raises the very same error on the same NumPy inputs)."""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxloss
import lossspec
from jaxloss.nnx import CrossEntropyLoss, ForwardKLLoss

FNS = {
    "cross_entropy": jaxloss.cross_entropy,
    "soft_cross_entropy": jaxloss.soft_cross_entropy,
    "forward_kl": jaxloss.forward_kl,
    "reverse_kl": jaxloss.reverse_kl,
}
N, V = 4, 10
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, V)).astype(np.float32)
T = RNG.normal(size=(N, V)).astype(np.float32)
Y = RNG.integers(0, V, size=N).astype(np.int32)
M = np.array([1.0, 0.5, 0.0, 2.0], np.float32)


def raised(fn: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def assert_same_error(ours: Callable[[], Any], reference: Callable[[], Any]) -> None:
    """Both raise, with the same type and message; the message names an argument."""
    got, want = raised(ours), raised(reference)
    assert isinstance(want, (TypeError, ValueError)), want
    assert type(got) is type(want), (got, want)
    assert str(got) == str(want)


# (id, kind, logits, target, loss_mask, options): each must fail in the oracle and in jaxloss.
BAD_CALLS = [
    ("labels-shape", "cross_entropy", X, Y[:3], None, {}),
    ("labels-2d", "cross_entropy", X, Y[:, None], None, {}),
    ("mask-shape", "cross_entropy", X, Y, M[:3], {}),
    ("teacher-shape", "forward_kl", X, T[:, :5], None, {}),
    ("teacher-mask-shape", "reverse_kl", X, T, M[None], {}),
    ("integer-logits", "cross_entropy", X.astype(np.int32), Y, None, {}),
    ("integer-logits-distill", "soft_cross_entropy", X.astype(np.int32), T, None, {}),
    ("float-labels", "cross_entropy", X, Y.astype(np.float32), None, {}),
    ("bool-labels", "cross_entropy", X, Y > 3, None, {}),
    ("integer-teacher", "forward_kl", X, Y[:, None].repeat(V, 1), None, {}),
    ("complex-mask", "cross_entropy", X, Y, M.astype(np.complex64), {}),
    ("scalar-logits", "cross_entropy", np.float32(1.0), np.int32(0), None, {}),
    ("empty-vocab", "cross_entropy", X[:, :0], Y, None, {}),
    ("empty-vocab-distill", "reverse_kl", X[:, :0], T[:, :0], None, {}),
    ("normalization", "cross_entropy", X, Y, None, {"normalization": "mean"}),
    ("normalization-distill", "forward_kl", X, T, None, {"normalization": "batch"}),
    ("negative-weight", "cross_entropy", X, Y, np.array([1.0, -0.5, 0.0, 1.0], np.float32), {}),
    ("nan-weight", "soft_cross_entropy", X, T, np.array([1.0, np.nan, 0.0, 1.0], np.float32), {}),
    ("inf-weight", "reverse_kl", X, T, np.array([1.0, np.inf, 0.0, 1.0], np.float32), {}),
    ("label-smoothing-negative", "cross_entropy", X, Y, None, {"label_smoothing": -0.1}),
    ("label-smoothing-above-one", "cross_entropy", X, Y, None, {"label_smoothing": 1.5}),
    ("label-smoothing-nan", "cross_entropy", X, Y, None, {"label_smoothing": float("nan")}),
    ("z-loss-negative", "cross_entropy", X, Y, None, {"z_loss": -1e-4}),
    ("logit-scale-zero", "cross_entropy", X, Y, None, {"logit_scale": 0.0}),
    ("logit-scale-inf", "forward_kl", X, T, None, {"logit_scale": float("inf")}),
    ("temperature-zero", "forward_kl", X, T, None, {"temperature": 0.0}),
    ("temperature-negative", "soft_cross_entropy", X, T, None, {"temperature": -2.0}),
    ("teacher-scale-negative", "reverse_kl", X, T, None, {"teacher_logit_scale": -1.0}),
    # Every float option a normal float32 number (lossspec.config.check_fp32_normal).
    ("logit-scale-above-float32", "cross_entropy", X, Y, None, {"logit_scale": 1e300}),
    ("temperature-subnormal", "forward_kl", X, T, None, {"temperature": 1e-300}),
    ("temperature-beyond-float", "reverse_kl", X, T, None, {"temperature": 10**400}),
    ("softcap-tiny", "cross_entropy", X, Y, None, {"logit_softcap": 1e-300}),
    ("teacher-scale-over-temperature", "soft_cross_entropy", X, T, None, {"teacher_logit_scale": 1e20, "temperature": 1e-20}),
    ("option-bool", "cross_entropy", X, Y, None, {"z_loss": True}),
    # Validation gaps: fp8 logits, integer masks, denominators that are not real numbers.
    ("fp8-logits", "cross_entropy", X.astype(jnp.float8_e4m3fn), Y, None, {}),
    ("fp8-teacher", "reverse_kl", X, T.astype(jnp.float8_e4m3fn), None, {}),
    ("integer-mask", "cross_entropy", X, Y, np.array([1, 0, 2, 1], np.int32), {}),
    ("denominator-string", "cross_entropy", X, Y, None, {"denominator": "5"}),
    ("denominator-bool", "forward_kl", X, T, None, {"denominator": True}),
    ("denominator-list", "cross_entropy", X, Y, None, {"denominator": [5.0]}),
    ("denominator-complex", "cross_entropy", X, Y, None, {"denominator": np.array(5 + 0j, np.complex64)}),
    ("option-string", "forward_kl", X, T, None, {"temperature": "2"}),
    ("ignore-index-float", "cross_entropy", X, Y, None, {"ignore_index": 1.5}),
    ("label-too-large", "cross_entropy", X, np.array([1, V, 2, 3], np.int32), None, {}),
    ("label-negative", "cross_entropy", X, np.array([1, 2, -1, 3], np.int32), None, {}),
    ("label-masked-ok-but-other-bad", "cross_entropy", X, np.array([V, 2, 99, 3], np.int32), M, {}),
    ("denominator-none", "forward_kl", X, T, None, {"normalization": "none", "denominator": 3.0}),
    ("denominator-negative", "cross_entropy", X, Y, None, {"denominator": -1.0}),
    ("denominator-nan", "reverse_kl", X, T, None, {"denominator": float("nan")}),
    ("denominator-inf", "cross_entropy", X, Y, M, {"normalization": "tokens", "denominator": float("inf")}),
    # Weights and D are used in float32 (lossspec.check_weights / check_denominator_value).
    ("weight-sum-overflows-float32", "cross_entropy", X, Y, np.array([3e38, 3e38, 0.0, 1.0], np.float32), {}),
    ("weight-sum-overflows-float32-distill", "forward_kl", X, T, np.array([3e38, 0.0, 3e38, 1.0], np.float32), {"normalization": "sum"}),
    ("weight-subnormal", "cross_entropy", X, Y, np.array([1.0, 1e-40, 0.0, 1.0], np.float32), {}),
    ("weight-subnormal-distill", "reverse_kl", X, T, np.array([1e-45, 1.0, 0.0, 1.0], np.float32), {"normalization": "none"}),
    ("denominator-subnormal", "cross_entropy", X, Y, None, {"denominator": 1e-40}),
    ("denominator-above-float32", "soft_cross_entropy", X, T, None, {"denominator": 1e39}),
    # Labels and ignore_index are compared exactly (no wrapping).
    ("label-uint32-near-2**32", "cross_entropy", X, np.array([1, 2**32 - 100, 2, 3], np.uint32), None, {}),
    ("ignore-index-beyond-int64", "cross_entropy", X, Y, None, {"ignore_index": 2**64}),
    ("ignore-index-bool", "cross_entropy", X, Y, None, {"ignore_index": True}),
    ("ignore-index-integral-float", "cross_entropy", X, Y, None, {"ignore_index": np.float64(-100.0)}),
]


def _jax(array: Any) -> Any:
    return array if array is None else jnp.asarray(array)


@pytest.mark.parametrize("as_jax", [False, True], ids=["numpy", "jax"])
@pytest.mark.parametrize("name,kind,logits,target,mask,options", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_matches_lossspec(name: str, kind: str, logits: Any, target: Any, mask: Any, options: dict, as_jax: bool) -> None:
    wrap = _jax if as_jax else (lambda a: a)
    for impl in ("xla", "pallas"):
        assert_same_error(
            lambda: FNS[kind](wrap(logits), wrap(target), wrap(mask), impl=impl, **options),
            lambda: lossspec.oracle(kind, logits, target, mask, **options),
        )


def test_denominator_must_be_a_scalar() -> None:
    assert_same_error(
        lambda: jaxloss.cross_entropy(X, Y, denominator=jnp.ones(2)),
        lambda: lossspec.check_denominator_shape((2,)),
    )


@pytest.mark.parametrize("kind", list(FNS))
def test_unknown_impl(kind: str) -> None:
    target = Y if kind == "cross_entropy" else T
    for impl in ("cuda", "triton", "torch", ""):
        assert_same_error(lambda: FNS[kind](X, target, impl=impl), lambda: lossspec.check_impl(impl, lossspec.JAX_IMPLS))


def test_options_of_the_other_kind_are_rejected() -> None:
    with pytest.raises(TypeError, match="temperature"):
        jaxloss.cross_entropy(X, Y, temperature=2.0)
    for fn in (jaxloss.soft_cross_entropy, jaxloss.forward_kl, jaxloss.reverse_kl):
        for option in ("label_smoothing", "z_loss", "ignore_index"):
            with pytest.raises(TypeError, match=option):
                fn(X, T, **{option: 0.1})


def test_vocab_parallel_bad_axis() -> None:
    # Not an axis name: a TypeError up front (the functions and the NNX modules alike).
    for bad in (3, "", ("model", 1), ()):
        with pytest.raises(TypeError, match="vocab_parallel must be a mesh axis name"):
            jaxloss.cross_entropy(X, Y, vocab_parallel=bad)
    with pytest.raises(TypeError, match="vocab_parallel must be a mesh axis name"):
        ForwardKLLoss(vocab_parallel=7)
    # A name with no shard_map / pmap around it: a ValueError that says where to call it.
    with pytest.raises(ValueError, match="vocab_parallel='model' is not a bound axis here"):
        jaxloss.reverse_kl(X, T, vocab_parallel="model")
    with pytest.raises(ValueError, match="vocab_parallel='model' is not a bound axis here"):
        jax.jit(lambda x: jaxloss.cross_entropy(x, Y, vocab_parallel="model"))(X)


def test_errors_come_before_any_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checks run on the host before the kernels are even traced."""

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a kernel ran on bad input")

    # The backends' modules are imported when first used: import them so that they can be patched
    # whichever test ran before (run alone, this one found no jaxloss.backends.pallas).
    import jaxloss.backends.pallas
    import jaxloss.backends.xla

    monkeypatch.setattr(jaxloss.backends.xla, "fused", boom)
    monkeypatch.setattr(jaxloss.backends.pallas, "fused", boom)
    for _, kind, logits, target, mask, options in BAD_CALLS:
        for impl in ("xla", "pallas"):
            with pytest.raises((TypeError, ValueError)):
                FNS[kind](logits, target, mask, impl=impl, **options)


def test_masked_labels_are_never_checked_or_read() -> None:
    """Any label value is legal on a masked (or ignored) token, out-of-int32 ones included."""
    labels = np.array([3, 2**40, -(2**35), 7], np.int64)
    mask = np.array([True, False, False, True])
    for impl in ("xla", "pallas"):
        loss = jaxloss.cross_entropy(X, labels, mask, impl=impl)
        ref, _ = lossspec.oracle("cross_entropy", X, labels, mask)
        lossspec.compare_loss(loss, ref).check()


BAD_COUNTS = [
    ("sum", dict(labels=Y, normalization="sum")),
    ("none", dict(loss_mask=M, normalization="none")),
    ("unknown", dict(labels=Y, normalization="mean")),
    ("nothing", dict()),
    ("float-labels", dict(labels=Y.astype(np.float32))),
    ("complex-mask", dict(loss_mask=M.astype(np.complex64))),
    ("shape", dict(labels=Y, loss_mask=M[:3])),
    ("negative-weight", dict(loss_mask=np.array([1.0, -1.0], np.float32))),
    ("nan-weight", dict(labels=Y[:2], loss_mask=np.array([1.0, np.nan], np.float32))),
    ("weight-sum-overflows-float32", dict(loss_mask=np.array([3e38, 3e38], np.float32))),
    ("weight-subnormal", dict(labels=Y[:2], loss_mask=np.array([1e-40, 1.0], np.float32))),
    ("weight-float64-beyond-float32", dict(loss_mask=np.array([1.0, 1e39]))),
    ("ignore-index-beyond-int64", dict(labels=Y, ignore_index=-(2**63) - 1)),
    ("ignore-index-float", dict(labels=Y, ignore_index=-100.0)),
]


@pytest.mark.parametrize("name,kwargs", BAD_COUNTS, ids=[c[0] for c in BAD_COUNTS])
def test_count_denominator_bad_input(name: str, kwargs: dict) -> None:
    assert_same_error(lambda: jaxloss.count_denominator(**kwargs), lambda: lossspec.count_denominator(**kwargs))


def test_count_denominator_values() -> None:
    labels = np.array([[1, -100, 3], [4, 5, 7]], np.int32)
    mask = np.array([[1.0, 1.0, 0.0], [0.5, 2.0, 1.0]], np.float32)
    cases = [
        dict(labels=labels),
        dict(loss_mask=mask),
        dict(labels=labels, loss_mask=mask),
        dict(labels=labels, loss_mask=mask > 0),
        dict(labels=labels, ignore_index=5),
        dict(labels=labels, normalization="tokens"),
        dict(loss_mask=mask, normalization="tokens"),
    ]
    for kwargs in cases:
        got = jaxloss.count_denominator(**kwargs)
        assert got.dtype == jnp.float32 and got.shape == ()
        assert float(got) == lossspec.count_denominator(**kwargs)
        traced = jax.jit(lambda **kw: jaxloss.count_denominator(**kw), static_argnames=("normalization", "ignore_index"))(**kwargs)
        assert float(traced) == float(got)
    # Under jit a bad weight cannot raise: the count is NaN instead of a plausible number.
    bad = jax.jit(jaxloss.count_denominator)(None, jnp.array([1.0, -2.0]))
    assert np.isnan(float(bad))
    for weights in ([3e38, 3e38, 1.0], [1.0, 1e-40, 1.0], [1e-45, 0.0, 0.0]):
        assert np.isnan(float(jax.jit(jaxloss.count_denominator)(labels[0], jnp.array(weights, jnp.float32))))
    assert np.isnan(float(jax.jit(jaxloss.count_denominator)(None, jnp.array([1e-40, 1.0], jnp.bfloat16))))


def test_float64_weights_are_checked_as_float32() -> None:
    """NumPy float64 weights that float32 turns into inf or (nearly) 0: lossspec's error."""
    for weights in (np.array([1.0, 1e39, 0.0, 1.0]), np.array([1.0, 1e-50, 0.0, 1.0]), np.array([1e-40, 1.0, 0.0, 1.0])):
        for kind, fn in FNS.items():
            target = Y if kind == "cross_entropy" else T
            for impl in ("xla", "pallas"):
                assert_same_error(lambda: fn(X, target, weights, impl=impl), lambda: lossspec.oracle(kind, X, target, weights))
        assert_same_error(lambda: jaxloss.count_denominator(Y, weights), lambda: lossspec.count_denominator(Y, weights))


def test_bfloat16_subnormal_weight_is_rejected() -> None:
    weights = jnp.array([1.0, 1e-40, 0.0, 1.0], jnp.bfloat16)
    assert float(weights[1]) > 0  # a bfloat16 subnormal, not 0
    with pytest.raises(ValueError, match="loss_mask weights must be 0 or at least 1.1754944e-38"):
        jaxloss.cross_entropy(X, Y, weights)
    with pytest.raises(ValueError, match="loss_mask weights must be 0 or at least 1.1754944e-38"):
        jaxloss.count_denominator(Y, weights)


def test_module_options_are_checked_on_construction() -> None:
    assert_same_error(lambda: CrossEntropyLoss(label_smoothing=2.0), lambda: lossspec.make_config("cross_entropy", label_smoothing=2.0))
    assert_same_error(lambda: ForwardKLLoss(temperature=0.0), lambda: lossspec.make_config("forward_kl", temperature=0.0))
    assert_same_error(lambda: CrossEntropyLoss(normalization="mean"), lambda: lossspec.make_config("cross_entropy", normalization="mean"))
    assert_same_error(lambda: CrossEntropyLoss(impl="torch"), lambda: lossspec.check_impl("torch", lossspec.JAX_IMPLS))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reduction_says_what_to_write(reduction: str) -> None:
    """torch's and Liger-Kernel's ``reduction=``: a TypeError naming the ``normalization=`` to
    write, from the functions, the fused heads and the modules (lossspec's hint, as in torch)."""
    hint = lossspec.foreign_keyword_hint({"reduction"}, {"reduction": reduction})
    expected = {"mean": "valid_tokens", "sum": "sum", "none": "none"}[reduction]
    assert f"write normalization='{expected}' instead of reduction='{reduction}'" in hint
    message = f"cross_entropy(): got an unexpected keyword argument 'reduction'; {hint}"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        jaxloss.cross_entropy(X, Y, reduction=reduction)
    with pytest.raises(TypeError, match=re.escape(f"linear_cross_entropy(): got an unexpected keyword argument 'reduction'; {hint}")):
        jaxloss.linear_cross_entropy(X, X, Y, reduction=reduction)
    with pytest.raises(TypeError, match=re.escape(f"CrossEntropyLoss got unexpected option(s) reduction; {hint}; it accepts")):
        CrossEntropyLoss(reduction=reduction)


def test_class_axis_second_layout_gets_the_hint() -> None:
    """F.cross_entropy's [B, V, T] logits: lossspec's message, with the hint to move the class axis last."""
    logits = np.zeros((2, V, 3), np.float32)
    labels = np.zeros((2, 3), np.int32)
    assert_same_error(lambda: jaxloss.cross_entropy(jnp.asarray(logits), jnp.asarray(labels)),
                      lambda: lossspec.oracle("cross_entropy", logits, labels))
    with pytest.raises(ValueError, match=r"the class axis goes last.*jnp\.moveaxis\(logits, 1, -1\)"):
        jaxloss.cross_entropy(jnp.asarray(logits), jnp.asarray(labels))
def _bad_values(kind: str) -> list[tuple[str, Any, Any, Any]]:
    """``(what, target, mask, denominator)``, each with one bad value that only a host check
    sees: a label outside ``[0, V)`` (cross-entropy), a negative or NaN weight, a negative
    denominator."""
    target = Y if kind == "cross_entropy" else T
    calls: list[tuple[str, Any, Any, Any]] = [
        ("negative weight", target, np.array([1.0, -0.5, 0.0, 2.0], np.float32), None),
        ("NaN weight", target, np.array([1.0, np.nan, 0.0, 2.0], np.float32), None),
        ("negative denominator", target, M, np.float32(-1.0)),
    ]
    if kind == "cross_entropy":
        calls += [("label V", np.array([1, V, 2, 3], np.int32), M, None), ("label -1", np.array([1, 2, 3, -1], np.int32), M, None)]
    return calls


@pytest.mark.parametrize("normalization", ["valid_tokens", "none"])
@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
def test_jitted_bad_values_give_nan_gradient(kind: str, normalization: str) -> None:
    """Under jit (values not on the host) a bad label, weight or denominator makes the loss NaN
    and the whole gradient NaN too: a step that uses only the gradient never trains on a
    plausible one. Good inputs: the oracle's loss and gradient."""

    @jax.jit
    def loss_and_grad(x: Any, target: Any, mask: Any, denominator: Any) -> Any:
        def objective(x: Any) -> Any:
            loss = FNS[kind](x, target, mask, normalization=normalization, denominator=denominator)
            return jnp.sum(loss), loss

        (_, loss), grad = jax.value_and_grad(objective, has_aux=True)(x)
        return loss, grad

    target = Y if kind == "cross_entropy" else T
    loss, grad = loss_and_grad(jnp.asarray(X), jnp.asarray(target), jnp.asarray(M), None)
    ref_loss, ref_grad = lossspec.oracle(kind, X, target, M, normalization=normalization)
    lossspec.compare_loss(np.asarray(loss), ref_loss).check()
    lossspec.compare_grad(np.asarray(grad), ref_grad, "float32", float(np.abs(ref_grad).max())).check()
    for what, bad_target, bad_mask, denominator in _bad_values(kind):
        if normalization == "none" and denominator is not None:
            continue
        loss, grad = loss_and_grad(jnp.asarray(X), jnp.asarray(bad_target), jnp.asarray(bad_mask), denominator)
        assert np.all(np.isnan(np.asarray(loss))), what
        assert np.all(np.isnan(np.asarray(grad))), f"{what}: a NaN loss with a finite gradient"


def test_jitted_head_bad_label_gives_nan_gradient() -> None:
    """The fused head under jit: an out-of-range label makes every gradient (hidden, weight) NaN."""
    hidden = jnp.asarray(RNG.normal(size=(N, 3)).astype(np.float32))
    weight = jnp.asarray(RNG.normal(size=(V, 3)).astype(np.float32))
    grads = jax.jit(jax.grad(lambda h, w, y: jaxloss.linear_cross_entropy(h, w, y), argnums=(0, 1)))(hidden, weight, jnp.asarray([1, V, 2, 3], jnp.int32))
    assert all(np.all(np.isnan(np.asarray(g))) for g in grads)


def test_integer_mask_and_jax_denominators_are_refused() -> None:
    """``entropy(logits, labels)`` (labels where the mask goes) and jax-array denominators of a
    bool / complex dtype: lossspec's TypeError."""
    for call, reference in (
        (lambda: jaxloss.entropy(jnp.asarray(X), jnp.asarray(Y)), lambda: lossspec.oracle("entropy", X, None, Y)),
        (lambda: jaxloss.cross_entropy(jnp.asarray(X), jnp.asarray(Y), denominator=jnp.asarray(5 + 0j, jnp.complex64)),
         lambda: lossspec.oracle("cross_entropy", X, Y, denominator=np.array(5 + 0j, np.complex64))),
        (lambda: jaxloss.cross_entropy(jnp.asarray(X), jnp.asarray(Y), denominator=jnp.asarray(True)),
         lambda: lossspec.oracle("cross_entropy", X, Y, denominator=np.array(True))),
        (lambda: jaxloss.count_denominator(jnp.asarray(Y), jnp.asarray(Y)), lambda: lossspec.count_denominator(Y, Y)),
    ):
        assert_same_error(call, reference)
