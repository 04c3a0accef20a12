"""Bad inputs (SPEC section 5), tolerances and generators of lossspec."""

from __future__ import annotations

import numpy as np
import pytest

import lossspec
from lossspec import oracle

X = np.zeros((2, 3, 5), dtype=np.float32)
LABELS = np.zeros((2, 3), dtype=np.int64)


@pytest.mark.parametrize(
    "kind, target, mask, options, error, match",
    [
        ("cross_entropy", LABELS, None, {"normalization": "mean"}, ValueError, "normalization must be one of"),
        ("cross_entropy", LABELS, None, {"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\]"),
        ("cross_entropy", LABELS, None, {"label_smoothing": -0.1}, ValueError, r"label_smoothing must be in \[0, 1\]"),
        ("cross_entropy", LABELS, None, {"z_loss": -1e-4}, ValueError, "z_loss must be >= 0"),
        ("cross_entropy", LABELS, None, {"logit_scale": 0.0}, ValueError, "logit_scale must be > 0"),
        ("cross_entropy", LABELS, None, {"logit_scale": float("nan")}, ValueError, "logit_scale must be finite"),
        ("cross_entropy", LABELS, None, {"temperature": 2.0}, TypeError, "unexpected option"),
        ("cross_entropy", LABELS, None, {"ignore_index": 1.5}, TypeError, "ignore_index must be an int"),
        ("forward_kl", X, None, {"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ("reverse_kl", X, None, {"temperature": -1.0}, ValueError, "temperature must be > 0"),
        ("soft_cross_entropy", X, None, {"label_smoothing": 0.1}, TypeError, "unexpected option"),
        ("forward_kl", X, None, {"teacher_logit_scale": -1.0}, ValueError, "teacher_logit_scale must be > 0"),
        ("cross_entropy", LABELS[:, :2], None, {}, ValueError, "labels must have the leading shape"),
        ("cross_entropy", LABELS.astype(np.float32), None, {}, TypeError, "labels must be an integer array"),
        ("cross_entropy", LABELS, np.ones((3, 2), bool), {}, ValueError, "loss_mask must have the leading shape"),
        ("cross_entropy", LABELS, np.ones((2, 3), np.complex64), {}, TypeError, "loss_mask must be boolean or floating"),
        ("forward_kl", X[..., :4], None, {}, ValueError, "teacher_logits must have the shape of logits"),
        ("forward_kl", LABELS, None, {}, TypeError, "teacher_logits must be a floating-point array"),
        ("cross_entropy", LABELS, -np.ones((2, 3), np.float32), {}, ValueError, "weights must be >= 0"),
        ("cross_entropy", LABELS, np.full((2, 3), np.inf, np.float32), {}, ValueError, "weights must be finite"),
        ("cross_entropy", LABELS, None, {"normalization": "none", "denominator": 3.0}, ValueError, "denominator= is not used with normalization 'none'"),
        ("cross_entropy", LABELS, None, {"denominator": -1.0}, ValueError, "denominator must be a finite number >= 0"),
        ("cross_entropy", LABELS, None, {"denominator": float("inf")}, ValueError, "denominator must be a finite number"),
    ],
)
def test_bad_options_and_shapes(kind, target, mask, options, error, match) -> None:
    with pytest.raises(error, match=match):
        oracle(kind, X, target, mask, **options)


def _fp32_message(name: str, value: str, zero: bool = False) -> str:
    return (f"{name} must be {'0 or ' if zero else ''}a normal float32 number, magnitude in [1.1754944e-38, 3.4028235e+38] "
            f"(it is used in float32); got {value}")


FP32_OPTION_CASES = [
    # (kind, options, message): every float option a normal float32 number (SPEC section 5)
    ("entropy", {"logit_softcap": 1e-300}, _fp32_message("logit_softcap", "1e-300")),
    ("forward_kl", {"teacher_logit_softcap": 1e300}, _fp32_message("teacher_logit_softcap", "1e+300")),
    ("cross_entropy", {"logit_scale": 1e300}, _fp32_message("logit_scale", "1e+300")),
    ("reverse_kl", {"teacher_logit_scale": 1e-45}, _fp32_message("teacher_logit_scale", "1e-45")),
    ("soft_cross_entropy", {"temperature": 1e-300}, _fp32_message("temperature", "1e-300")),
    ("jensen_shannon", {"beta": 1e-40}, _fp32_message("beta", "1e-40", zero=True)),
    ("cross_entropy", {"label_smoothing": 1e-40}, _fp32_message("label_smoothing", "1e-40", zero=True)),
    ("cross_entropy", {"z_loss": 1e39}, _fp32_message("z_loss", "1e+39", zero=True)),
    ("cross_entropy", {"z_loss": 1e-39}, _fp32_message("z_loss", "1e-39", zero=True)),
    # the factors used in fp32: each option normal, their ratio not
    ("forward_kl", {"logit_scale": 1e30, "temperature": 1e-30}, _fp32_message("logit_scale / temperature", "1e+60")),
    ("entropy", {"temperature": 1e30, "logit_scale": 1e-30}, _fp32_message("logit_scale / temperature", repr(1e-30 / 1e30))),
    ("reverse_kl", {"temperature": 1e-20, "teacher_logit_scale": 1e20}, _fp32_message("teacher_logit_scale / temperature", "1e+40")),
    # beyond the float range: a ValueError naming the option, not float()'s OverflowError
    ("forward_kl", {"temperature": 10**400}, "temperature must be finite, got an integer of 1329 bits (beyond the float range)"),
    ("cross_entropy", {"logit_softcap": -(10**400)}, "logit_softcap must be finite, got an integer of 1329 bits (beyond the float range)"),
]


@pytest.mark.parametrize("kind, options, message", FP32_OPTION_CASES)
def test_options_outside_float32_are_rejected(kind: str, options: dict, message: str) -> None:
    """Options that fp32 cannot hold (NaN gradients, NaN losses or an OverflowError before) raise
    a ValueError naming the option, from make_config and the oracle alike."""
    for call in (lambda: lossspec.make_config(kind, **options), lambda: oracle(kind, X, LABELS if kind == "cross_entropy" else X, None, **options)):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == message


def test_float32_edges_of_the_options_are_accepted() -> None:
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    assert lossspec.make_config("entropy", logit_softcap=tiny).logit_softcap == tiny
    assert lossspec.make_config("forward_kl", teacher_logit_softcap=big).teacher_logit_softcap == big
    config = lossspec.make_config("forward_kl", logit_scale=1e-30, temperature=1e-30, teacher_logit_scale=1e-30)
    assert config.student_scale == config.teacher_scale == 1.0
    assert lossspec.make_config("cross_entropy", label_smoothing=0.0, z_loss=0.0).z_loss == 0.0
    assert lossspec.make_config("jensen_shannon", beta=0.0).beta == 0.0


def test_bad_logits() -> None:
    with pytest.raises(TypeError, match="logits must be a floating-point array"):
        oracle("cross_entropy", X.astype(np.int32), LABELS)
    with pytest.raises(ValueError, match="non-empty vocabulary axis"):
        oracle("cross_entropy", X[..., :0], LABELS)
    with pytest.raises(ValueError, match="at least one dimension"):
        oracle("cross_entropy", np.float32(1.0), np.int64(0))
    with pytest.raises(ValueError, match="kind must be one of"):
        oracle("kl", X, X)


def test_label_out_of_range_only_for_valid_tokens() -> None:
    labels = np.array([[0, 5, 1], [2, -3, 4]])
    mask = np.array([[1, 0, 1], [1, 0, 1]], dtype=bool)
    oracle("cross_entropy", X, labels, mask)  # out-of-range labels are masked: fine
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\).*got 5 at position \(0, 1\)"):
        oracle("cross_entropy", X, labels)
    labels[0, 1] = -100
    with pytest.raises(ValueError, match=r"got -3 at position \(1, 1\)"):
        oracle("cross_entropy", X, labels)


def test_inputs_are_not_modified() -> None:
    case = lossspec.make_case("reverse_kl", "random")
    copies = [case.logits.copy(), case.target.copy(), case.loss_mask.copy()]
    oracle("reverse_kl", case.logits, case.target, case.loss_mask)
    for before, after in zip(copies, [case.logits, case.target, case.loss_mask]):
        np.testing.assert_array_equal(before, after)


def test_ulp_and_rounding() -> None:
    assert lossspec.ulp(1.0, "bfloat16") == 2.0**-7
    assert lossspec.ulp(1.5, "float16") == 2.0**-10
    assert lossspec.ulp(-0.75, "bfloat16") == 2.0**-8
    assert lossspec.ulp(0.0, "float16") == 2.0**-24
    assert lossspec.ulp(1e-30, "bfloat16") == 2.0**-107
    assert lossspec.ulp(1e-40, "bfloat16") == 2.0**-133  # subnormal range
    values = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    rounded = lossspec.round_to_dtype(values, "bfloat16")
    assert np.all(np.abs(rounded - values) <= 0.5 * lossspec.ulp(values, "bfloat16") * (1 + 1e-6))
    assert np.all(rounded.view(np.uint32) & 0xFFFF == 0)  # exactly representable in bf16
    np.testing.assert_array_equal(lossspec.round_to_dtype(values, "float16"), values.astype(np.float16))
    assert lossspec.round_to_dtype(np.float32(1.0 + 2.0**-8), "bfloat16") == 1.0  # ties to even


def test_comparisons_report_units_of_the_bound() -> None:
    cmp = lossspec.compare_loss(1.0 + 2e-6, 1.0)
    assert cmp.ok and abs(cmp.error_units - 0.5) < 1e-6
    assert not lossspec.compare_loss(10.0 + 1e-4, 10.0).ok
    with pytest.raises(AssertionError, match=r"loss: worst error 2\.5x its bound"):
        lossspec.compare_loss(10.0 + 1e-4, 10.0).check()
    assert lossspec.compare_loss(np.nan, np.nan).ok
    assert not lossspec.compare_loss(np.nan, 1.0).ok
    assert not lossspec.compare_loss(1.0, np.nan).ok
    ref = np.array([0.5, -0.25, 1e-9])
    # fp32: 4e-6 * S with S = max(0.5, G0).
    assert lossspec.compare_grad(ref + 1.9e-6, ref, "float32", g0=0.1).ok
    assert not lossspec.compare_grad(ref + 2.1e-6, ref, "float32", g0=0.1).ok
    assert lossspec.compare_grad(ref + 2.1e-6, ref, "float32", g0=1.0).ok
    # bf16: one ulp of each reference element on top.
    off_by_one_ulp = ref + lossspec.ulp(ref, "bfloat16")
    assert lossspec.compare_grad(off_by_one_ulp, ref, "bfloat16", g0=0.0).ok
    assert not lossspec.compare_grad(ref + 2 * lossspec.ulp(ref, "bfloat16"), ref, "bfloat16", g0=0.0).ok
    # An all-zero reference with G0 == 0 (D == 0) must be matched exactly.
    assert lossspec.compare_grad(np.zeros(3), np.zeros(3), "float32", g0=0.0).ok
    assert not lossspec.compare_grad(np.full(3, 1e-30), np.zeros(3), "float32", g0=0.0).ok


def test_compare_loss_exactly_at_the_bound_and_at_opposite_infinities() -> None:
    """SPEC section 6 says ``<=``: an error of exactly the bound passes and the next float past it
    fails. Infinities match only the same infinity: ``-inf`` against ``+inf`` is the largest
    error there is, not a match (every parity test and lossparity rely on this comparison)."""
    bound = lossspec.LOSS_RTOL  # |ref| <= 1: the bound is LOSS_RTOL * 1, exactly
    at = lossspec.compare_loss(bound, 0.0)
    assert at.error_units == 1.0 and at.ok
    at.check()
    assert not lossspec.compare_loss(np.nextafter(bound, 1.0), 0.0).ok
    assert lossspec.compare_loss(np.array([bound, -bound]), np.zeros(2)).ok  # per token ("none")
    inf = np.inf
    for actual, reference in ((-inf, inf), (inf, -inf), (inf, 1.0), (1.0, -inf)):
        assert not lossspec.compare_loss(actual, reference).ok, (actual, reference)
    assert not lossspec.compare_loss(np.array([1.0, -inf]), np.array([1.0, inf])).ok
    assert lossspec.compare_loss(inf, inf).ok and lossspec.compare_loss(-inf, -inf).ok


@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_generators(kind: str) -> None:
    confident = lossspec.make_case(kind, "confident", vocab=1000, lead_shape=(8,))
    if kind == "cross_entropy":
        x = confident.logits.astype(np.float64)
        q = np.exp(x - x.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        valid = confident.loss_mask
        q_y = np.take_along_axis(q, np.clip(confident.target, 0, 999)[:, None], -1)[:, 0]
        assert np.all(q_y[valid] > 0.999)
    huge = lossspec.make_case(kind, "huge", dtype="bfloat16")
    assert np.abs(huge.logits).max() > 5e3
    assert np.all(huge.logits.view(np.uint32) & 0xFFFF == 0)
    neg_inf = lossspec.make_case(kind, "neg_inf")
    assert np.isneginf(neg_inf.logits).any()
    assert lossspec.make_case(kind, "all_masked").loss_mask.sum() == 0
    assert lossspec.make_case(kind, "empty").logits.shape == (0, 100)
    heavy = lossspec.make_case(kind, "heavy_mask", lead_shape=(100,))
    assert 0 < heavy.loss_mask.mean() < 0.25
    weights = lossspec.make_case(kind, "float_weights").loss_mask
    assert weights.dtype == np.float32 and (weights == 0).any() and (weights > 1).any()
    # Seeded: the same call gives the same arrays.
    again = lossspec.make_case(kind, "random", seed=3)
    np.testing.assert_array_equal(again.logits, lossspec.make_case(kind, "random", seed=3).logits)
    assert not np.array_equal(again.logits, lossspec.make_case(kind, "random", seed=4).logits)


def test_masked_labels_are_garbage_in_generated_cases() -> None:
    case = lossspec.make_case("cross_entropy", "random", lead_shape=(200,))
    masked = case.target[case.loss_mask == 0]
    assert ((masked < 0) | (masked >= 100)).any()  # they must never be read as indices
    case.reference()  # and the oracle does not trip on them


def test_numpy_meta_counts_ml_dtypes_floats_as_floats() -> None:
    """bfloat16 (ml_dtypes, NumPy kind "V") is a float for the checks, as in JAX and torch."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes comes with JAX")
    logits = np.zeros((3, 5), ml_dtypes.bfloat16)
    assert lossspec.numpy_meta(logits).kind == "f"
    assert lossspec.numpy_meta(np.zeros((3,), np.float32)).kind == "f"
    assert lossspec.numpy_meta(np.zeros((3,), np.int64)).kind == "i"
    with pytest.raises(TypeError):
        # A void (record) dtype is still no float.
        lossspec.check_inputs(lossspec.make_config("cross_entropy"), lossspec.numpy_meta(np.zeros((3, 5), "V2")),
                              lossspec.numpy_meta(np.zeros((3,), np.int64)), None)
    lossspec.check_inputs(lossspec.make_config("cross_entropy"), lossspec.numpy_meta(logits),
                          lossspec.numpy_meta(np.zeros((3,), np.int64)), None)


# --------------------------------------------------------------------------------------------
# Weights and denominators are used in float32 (the rules both frameworks share).
# --------------------------------------------------------------------------------------------

TINY = float(np.finfo(np.float32).tiny)
FMAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    "weights, match",
    [
        (np.array([3e38, 3e38, 1.0], np.float32), r"loss_mask weights must have a sum that is finite in float32 \(at most 3.4028235e\+38\); got a sum of 6e\+38"),
        (np.array([1.0, 1e-40, 0.0], np.float32), r"loss_mask weights must be 0 or at least 1.1754944e-38 \(the smallest normal float32"),
        (np.array([1.0, 1e-50], np.float64), r"loss_mask weights must be 0 or at least 1.1754944e-38.*got 1e-50"),
        (np.array([1.0, 1e39], np.float64), r"loss_mask weights must be finite in float32 \(at most 3.4028235e\+38\); got 1e\+39"),
        (np.array([1.0, np.nan], np.float64), r"loss_mask weights must be finite; got NaN or inf"),
        (np.array([1.0, -TINY / 4], np.float32), r"loss_mask weights must be >= 0"),
    ],
)
def test_check_weights_float32_rules(weights: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lossspec.check_weights(weights)
    # The oracle (and so every framework, which raises lossspec's error) applies it too.
    with pytest.raises(ValueError, match=match):
        oracle("cross_entropy", np.zeros((len(weights), 3), np.float32), np.zeros(len(weights), np.int64), weights)
    with pytest.raises(ValueError, match=match):
        lossspec.count_denominator(loss_mask=weights)


def test_check_weights_accepts_the_float32_edges() -> None:
    lossspec.check_weights(np.array([TINY, 0.0, 1.0], np.float32))  # the smallest normal float32
    lossspec.check_weights(np.array([FMAX, 0.0], np.float32))  # a sum of exactly float32 max
    lossspec.check_weights(np.array([2**62, 3], np.int64))  # integer weights
    lossspec.check_weights(np.array([True, False]))


def test_check_denominator_value_float32_rules() -> None:
    for bad in (1e-40, TINY / 2, 1e39, 2 * FMAX):
        with pytest.raises(ValueError, match=r"denominator must be 0 or a normal float32 number in \[1.1754944e-38, 3.4028235e\+38\]"):
            lossspec.check_denominator_value(bad)
        with pytest.raises(ValueError, match="denominator must be 0 or a normal float32 number"):
            oracle("forward_kl", X, X, denominator=bad)
    for good in (0.0, TINY, 1.0, FMAX, np.float32(3.0)):
        lossspec.check_denominator_value(good)


def test_ignore_index_is_an_int64_int() -> None:
    for value in (-100, 0, 2**40, -(2**63), 2**63 - 1, np.int64(7), np.uint32(5)):
        assert lossspec.make_config("cross_entropy", ignore_index=value).ignore_index == int(value)
    for value in (2**63, -(2**63) - 1, 2**64):
        with pytest.raises(ValueError, match=r"ignore_index must be an integer in the int64 range"):
            lossspec.make_config("cross_entropy", ignore_index=value)
    for value in (True, np.bool_(False), 1.0, np.float64(-100.0), "x", None):
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            lossspec.make_config("cross_entropy", ignore_index=value)
    with pytest.raises(ValueError, match="ignore_index must be an integer in the int64 range"):
        lossspec.count_denominator(LABELS, ignore_index=2**64)


def test_ignore_index_is_compared_exactly() -> None:
    assert lossspec.ignore_index_in_dtype(-100, np.int32)
    assert not lossspec.ignore_index_in_dtype(-100, np.uint32)
    assert not lossspec.ignore_index_in_dtype(2**40, "int32")
    assert lossspec.ignore_index_in_dtype(2**40, "int64")
    assert not lossspec.ignore_index_in_dtype(2**63 - 1, np.uint8)
    # The oracle never wraps: uint32 2**32 - 100 is a (bad) label, not -100.
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\).*got 4294967196"):
        oracle("cross_entropy", X[0], np.array([0, 2**32 - 100, 1], np.uint32))
    assert lossspec.count_denominator(np.array([1, 2**32 - 100], np.uint32)) == 2.0
    assert lossspec.count_denominator(np.array([1, 2**40], np.int64), ignore_index=2**40) == 1.0
    assert lossspec.count_denominator(np.array([1, -100], np.int32), ignore_index=2**40) == 2.0


@pytest.mark.parametrize("reduction, normalization", [("mean", "valid_tokens"), ("sum", "sum"), ("none", "none"), ("batchmean", "tokens")])
def test_reduction_hint_names_the_normalization(reduction: str, normalization: str) -> None:
    """torch's / Liger-Kernel's ``reduction=`` gets the exact ``normalization=`` to write."""
    hint = lossspec.foreign_keyword_hint({"reduction"}, {"reduction": reduction})
    assert hint.startswith(f"write normalization='{normalization}' instead of reduction='{reduction}'; "), hint
    assert "'mean' -> 'valid_tokens'" in hint and "denominator=" in hint
    assert lossspec.foreign_keyword_hint({"reduction"}, {"reduction": "avg"}).startswith("write normalization= instead of reduction=")
    assert lossspec.foreign_keyword_hint({"lse_square_scale"}) == "write z_loss= instead of lse_square_scale="
    assert lossspec.foreign_keyword_hint({"bogus"}) == ""


def test_class_axis_second_gets_a_hint() -> None:
    """Logits in F.cross_entropy's [B, V, T] layout: the error says the class axis goes last."""
    logits_bvt = np.zeros((2, 5, 3), np.float32)  # [B, V, T] with labels [B, T]
    with pytest.raises(ValueError, match=r"labels must have the leading shape of logits \[2, 5\]; got labels \[2, 3\] .*"
                                         r"the class axis goes last.*pass them as \[2, 3, 5\]"):
        oracle("cross_entropy", logits_bvt, LABELS)
    with pytest.raises(ValueError, match=r"loss_mask must have the leading shape.*the class axis goes last"):
        oracle("forward_kl", logits_bvt, logits_bvt, np.ones((2, 3), bool))
    with pytest.raises(ValueError) as plain:  # a shape that is not that layout: no hint
        oracle("cross_entropy", X, LABELS[:, :2])
    assert "class axis" not in str(plain.value)


@pytest.mark.parametrize("shape", [(3,), (1, 3), (2, 1), (2, 3, 1), (1,), ()])
def test_broadcast_mask_equals_the_expanded_mask(shape: tuple[int, ...]) -> None:
    """A mask that broadcasts to the leading shape [2, 3] (a trailing size-1 class axis
    dropped) gives exactly the loss, gradient and count of the explicitly expanded mask."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
    labels = rng.integers(0, 5, (2, 3))
    mask = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    squeezed = mask.reshape(shape[:-1]) if len(shape) == 3 else mask
    expanded = np.broadcast_to(squeezed, (2, 3)).copy()
    for normalization in ("valid_tokens", "none", "sequence_mean"):
        got = oracle("cross_entropy", logits, labels, mask, normalization=normalization, causal_shift=True)
        want = oracle("cross_entropy", logits, labels, expanded, normalization=normalization, causal_shift=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert lossspec.count_denominator(labels, mask, causal_shift=True) == lossspec.count_denominator(labels, expanded, causal_shift=True)
    assert lossspec.count_denominator(None, mask, segment_ids=np.zeros((2, 3), np.int64)) == float(expanded.sum(dtype=np.float64))


@pytest.mark.parametrize("shape", [(2,), (3, 2), (2, 3, 2), (1, 2, 3), (2, 3, 1, 1)])
def test_mask_that_does_not_broadcast_is_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"loss_mask must have the leading shape of logits \[2, 3\] or broadcast to it "
                                         r"\(e\.g\. \[3\] or \[2, 3, 1\]\); got"):
        oracle("cross_entropy", X, LABELS, np.ones(shape, bool))
    with pytest.raises(ValueError, match=r"loss_mask must have the shape of labels \[2, 3\] or broadcast to it"):
        lossspec.count_denominator(LABELS, np.ones(shape, bool))
def test_validation_gaps_have_clear_errors() -> None:
    """fp8 logits, integer masks, denominators that are not real numbers and a vocab_size that is
    not an int: a TypeError naming the argument (not a failure inside ATen / int())."""
    import ml_dtypes

    fp8 = X.astype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"^logits must have dtype float32, bfloat16, float16 or float64; got float8_e4m3fn$"):
        oracle("cross_entropy", fp8, LABELS)
    with pytest.raises(TypeError, match=r"^teacher_logits must have dtype float32, bfloat16, float16 or float64; got float8_e5m2$"):
        oracle("forward_kl", X, X.astype(ml_dtypes.float8_e5m2))
    message = "loss_mask must be boolean or floating-point weights; got dtype int64 (an integer mask would weight tokens by its values: pass mask.bool() or a float mask)"
    for call in (lambda: oracle("entropy", X, None, LABELS), lambda: lossspec.count_denominator(LABELS, LABELS)):
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == message
    for denominator, got in (("5", "str"), (True, "bool"), ([5.0], "list"), (np.bool_(True), type(np.bool_(True)).__name__), (np.array(5 + 0j, np.complex64), "dtype complex64"), (np.array(True), "dtype bool")):
        with pytest.raises(TypeError) as info:
            oracle("cross_entropy", X, LABELS, denominator=denominator)
        assert str(info.value) == f"denominator must be a number or a 0-d tensor / array of a real dtype; got {got}"
    assert oracle("cross_entropy", X, LABELS, denominator=np.int32(6))[0] == oracle("cross_entropy", X, LABELS, denominator=6.0)[0]
    for bad, got in ((None, "NoneType"), (32.0, "float"), (True, "bool")):
        with pytest.raises(TypeError) as info:
            lossspec.check_vocab_size_arg(bad)
        assert str(info.value) == f"vocab_size must be an int (the last dimension of logits); got {got}"
    assert lossspec.check_vocab_size_arg(np.int64(7)) == 7


@pytest.mark.parametrize(
    "fields, error, match",
    [
        ({"vocab_block": 0}, ValueError, r"Tuning.vocab_block must be >= 1; got 0"),
        ({"chunk_elements": 2.0}, TypeError, r"Tuning.chunk_elements must be None or an int; got 2.0"),
        ({"block_rows": True}, TypeError, r"Tuning.block_rows must be None or an int; got True"),
        ({"interpret": 1}, TypeError, r"Tuning.interpret must be None, True or False"),
        ({"debug": None}, TypeError, r"Tuning.debug must be True or False"),
    ],
)
def test_tuning_fields_are_checked_on_construction(fields: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        lossspec.Tuning(**fields)


def test_tuning_sizes_may_be_numpy_integers() -> None:
    """A size read from a NumPy computation (``np.int64``) is an int like any other."""
    tuning, head = lossspec.Tuning(vocab_block=np.int64(64)), lossspec.HeadTuning(block_elements=np.int32(1024), recompute_plan=(np.int64(4), 8))
    assert (tuning.vocab_block, head.block_elements, head.recompute_plan) == (64, 1024, (4, 8))
    assert type(tuning.vocab_block) is type(head.block_elements) is type(head.recompute_plan[0]) is int  # Python ints: static arguments as any other
