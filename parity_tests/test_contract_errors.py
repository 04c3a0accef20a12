"""Contract, SPEC section 5 (bad input), with the option errors of sections 1 and 7 and the
foreign names of section 3, on every backend (parity_tests/support/backends.py).

Every bad input raises, on every backend, exactly the error of ``lossspec`` on the same NumPy
inputs (type and message: the oracle runs ``lossspec.checks`` and ``lossspec.config``), before
any kernel runs; the messages are never re-typed here. Inputs are host arrays (CPU tensors in
torch: where the value checks run; elsewhere a bad value gives NaN instead, checked per framework
in test_jaxloss_errors.py and test_torchloss_errors.py). Inputs are never modified.
"""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest

import lossspec
from lossspec import ALL_KINDS, KIND_SPECS

from parity_tests.support.backends import Backend, kinds_by_target, never, over_backends, over_frameworks, sample_options

CE, KD, H = kinds_by_target()  # a kind with labels, one with teacher logits, one without a target
JSD = next(kind for kind, spec in KIND_SPECS.items() if "beta" in spec.option_names)
N, V = 4, 10
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, V)).astype(np.float32)
T = RNG.normal(size=(N, V)).astype(np.float32)
Y = RNG.integers(0, V, size=N).astype(np.int32)
M = np.array([1.0, 0.5, 0.0, 2.0], np.float32)
TARGET = {CE: Y, KD: T, H: None, JSD: T}

# (id, kind, logits, target, loss_mask, options): each fails in the oracle and on every backend.
BAD_CALLS: list[tuple[str, str, Any, Any, Any, dict[str, Any]]] = [
    # shapes
    ("labels-shape", CE, X, Y[:3], None, {}),
    ("labels-2d", CE, X, Y[:, None], None, {}),
    ("mask-shape", CE, X, Y, M[:3], {}),
    ("mask-shape-no-target", H, X, None, M[:3], {}),
    ("teacher-shape", KD, X, T[:, :5], None, {}),
    ("teacher-mask-shape", KD, X, T, M[None], {}),
    ("class-axis-second", CE, np.zeros((2, V, 3), np.float32), np.zeros((2, 3), np.int32), None, {}),
    ("scalar-logits", CE, np.float32(1.0), np.int32(0), None, {}),
    ("empty-vocab", CE, X[:, :0], Y, None, {}),
    ("empty-vocab-teacher", KD, X[:, :0], T[:, :0], None, {}),
    # dtypes
    ("integer-logits", CE, X.astype(np.int32), Y, None, {}),
    ("integer-logits-teacher", KD, X.astype(np.int32), T, None, {}),
    ("fp8-logits", CE, X.astype(ml_dtypes.float8_e4m3fn), Y, None, {}),
    ("fp8-teacher", KD, X, T.astype(ml_dtypes.float8_e5m2), None, {}),
    ("float-labels", CE, X, Y.astype(np.float32), None, {}),
    ("bool-labels", CE, X, Y > 3, None, {}),
    ("integer-teacher", KD, X, Y[:, None].repeat(V, 1), None, {}),
    ("complex-mask", CE, X, Y, M.astype(np.complex64), {}),
    ("integer-mask", CE, X, Y, np.array([1, 0, 2, 1], np.int32), {}),
    ("labels-as-mask", H, X, None, Y, {}),  # entropy(logits, labels): the labels where the mask goes
    # weights
    ("negative-weight", CE, X, Y, np.array([1.0, -0.5, 0.0, 1.0], np.float32), {}),
    ("nan-weight", KD, X, T, np.array([1.0, np.nan, 0.0, 1.0], np.float32), {}),
    ("inf-weight", H, X, None, np.array([1.0, np.inf, 0.0, 1.0], np.float32), {}),
    ("weight-subnormal", CE, X, Y, np.array([1.0, 1e-40, 0.0, 1.0], np.float32), {}),
    ("weight-sum-overflows-float32", KD, X, T, np.array([3e38, 0.0, 3e38, 1.0], np.float32), {"normalization": "sum"}),
    # labels and ignore_index (compared in the labels' dtype, never wrapped)
    ("label-too-large", CE, X, np.array([1, V, 2, 3], np.int32), None, {}),
    ("label-negative", CE, X, np.array([1, 2, -1, 3], np.int32), None, {}),
    ("label-bad-beside-masked-garbage", CE, X, np.array([V, 2, 99, 3], np.int32), M, {}),
    ("label-uint32-near-2**32", CE, X, np.array([1, 2**32 - 100, 2, 3], np.uint32), None, {}),
    ("ignore-index-float", CE, X, Y, None, {"ignore_index": 1.5}),
    ("ignore-index-integral-float", CE, X, Y, None, {"ignore_index": np.float64(-100.0)}),
    ("ignore-index-bool", CE, X, Y, None, {"ignore_index": True}),
    ("ignore-index-beyond-int64", CE, X, Y, None, {"ignore_index": 2**64}),
    # normalisation and denominator
    ("normalization", CE, X, Y, None, {"normalization": "mean"}),
    ("normalization-teacher", KD, X, T, None, {"normalization": "batch"}),
    ("denominator-with-none", KD, X, T, None, {"normalization": "none", "denominator": 3.0}),
    ("denominator-string", CE, X, Y, None, {"denominator": "5"}),
    ("denominator-bool", KD, X, T, None, {"denominator": True}),
    ("denominator-list", CE, X, Y, None, {"denominator": [5.0]}),
    ("denominator-complex", CE, X, Y, None, {"denominator": np.array(5 + 0j, np.complex64)}),
    ("denominator-bool-array", H, X, None, None, {"denominator": np.array(True)}),
    ("denominator-negative", CE, X, Y, None, {"denominator": -1.0}),
    ("denominator-nan", KD, X, T, None, {"denominator": float("nan")}),
    ("denominator-inf", CE, X, Y, M, {"normalization": "tokens", "denominator": float("inf")}),
    ("denominator-subnormal", CE, X, Y, None, {"denominator": 1e-40}),
    ("denominator-above-float32", KD, X, T, None, {"denominator": 1e39}),
    ("denominator-negative-array", H, X, None, None, {"denominator": np.array(-2.0, np.float32)}),
    # options (every float option a normal float32 number, the ratios with the temperature too)
    ("label-smoothing-negative", CE, X, Y, None, {"label_smoothing": -0.1}),
    ("label-smoothing-above-one", CE, X, Y, None, {"label_smoothing": 1.5}),
    ("label-smoothing-nan", CE, X, Y, None, {"label_smoothing": float("nan")}),
    ("z-loss-negative", CE, X, Y, None, {"z_loss": -1e-4}),
    ("option-bool", CE, X, Y, None, {"z_loss": True}),
    ("option-string", KD, X, T, None, {"temperature": "2"}),
    ("logit-scale-zero", CE, X, Y, None, {"logit_scale": 0.0}),
    ("logit-scale-inf", KD, X, T, None, {"logit_scale": float("inf")}),
    ("logit-scale-above-float32", CE, X, Y, None, {"logit_scale": 1e300}),
    ("temperature-zero", KD, X, T, None, {"temperature": 0.0}),
    ("temperature-negative", H, X, None, None, {"temperature": -2.0}),
    ("temperature-subnormal", KD, X, T, None, {"temperature": 1e-300}),
    ("temperature-beyond-float", KD, X, T, None, {"temperature": 10**400}),
    ("teacher-scale-negative", KD, X, T, None, {"teacher_logit_scale": -1.0}),
    ("teacher-scale-over-temperature", KD, X, T, None, {"teacher_logit_scale": 1e20, "temperature": 1e-20}),
    ("beta-above-one", JSD, X, T, None, {"beta": 1.5}),
    ("beta-negative", JSD, X, T, None, {"beta": -0.1}),
    # causal shift and sequences: a time axis
    ("causal-shift-no-time-axis", CE, X[0], Y[0], None, {"causal_shift": True}),
    ("causal-shift-not-bool", KD, X, T, None, {"causal_shift": "yes"}),
    ("sequence-mode-no-time-axis", H, X[0], None, None, {"normalization": "sequence_mean"}),
    ("segment-ids-shape", CE, X, Y, None, {"segment_ids": np.zeros(N - 1, np.int32)}),
    ("segment-ids-float", KD, X, T, None, {"segment_ids": np.zeros(N, np.float32)}),
]
# The soft caps' errors, spelled out in SPEC section 1, for the student's and the teacher's cap.
BAD_CAPS = (0.0, -2.0, float("inf"), float("nan"), "30", True, 1e-300, 1e300)
BAD_CALLS += [(f"{option}-{type(value).__name__}-{value}", KD, X, T, None, {option: value})
              for option in ("logit_softcap", "teacher_logit_softcap") for value in BAD_CAPS]


def raised(call: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def assert_same_error(got: BaseException, want: BaseException) -> None:
    """The same type and message (a ``ValueError``/``TypeError``)."""
    assert isinstance(want, (TypeError, ValueError)), want
    assert type(got) is type(want) and str(got) == str(want), f"got {type(got).__name__}({got}), want {type(want).__name__}({want})"


@over_backends("name,kind,logits,target,mask,options", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_the_lossspec_error(backend: Backend, name: str, kind: str, logits: Any, target: Any, mask: Any,
                                              options: dict) -> None:
    want = raised(lambda: lossspec.oracle(kind, logits, target, mask, **options))
    assert_same_error(raised(lambda: backend.call(kind, logits, target, mask, **options)), want)


@over_backends()
def test_denominator_must_be_a_scalar(backend: Backend) -> None:
    assert_same_error(raised(lambda: backend.call(CE, X, Y, denominator=np.ones(2, np.float32))),
                      raised(lambda: lossspec.check_denominator_shape((2,))))


@over_backends()
def test_unknown_impl(backend: Backend) -> None:
    """An ``impl=`` the framework does not have (the other framework's included): its list."""
    others = [impl for impl in lossspec.JAX_IMPLS + lossspec.TORCH_IMPLS + ("cuda", "") if impl not in backend.impls]
    for kind in ALL_KINDS:
        for impl in others:
            assert_same_error(raised(lambda: backend.call(kind, X, TARGET.get(kind, T), impl=impl)),
                              raised(lambda: lossspec.check_impl(impl, backend.impls)))


# torch.nn.functional's / Liger-Kernel's names: a TypeError that says what to write.
FOREIGN = [("reduction", "mean"), ("reduction", "sum"), ("reduction", "none"), ("reduction", "batchmean"),
           ("lse_square_scale", 1e-4), ("softcap", 30.0)]


@over_backends("keyword,value", FOREIGN)
def test_foreign_keyword_says_what_to_write(backend: Backend, keyword: str, value: Any) -> None:
    hint = lossspec.foreign_keyword_hint({keyword}, {keyword: value})
    assert hint
    error = raised(lambda: backend.call(CE, X, Y, **{keyword: value}))
    assert type(error) is TypeError and str(error) == f"{CE}(): got an unexpected keyword argument {keyword!r}; {hint}"


@over_backends("kind", ALL_KINDS)
def test_options_of_other_kinds_are_refused(backend: Backend, kind: str) -> None:
    """An option of another kind in the table (``temperature`` for cross-entropy, ``beta`` for the
    KL kinds, ``label_smoothing`` for the distillation kinds, ...) is an unexpected keyword."""
    others = sorted({name for spec in KIND_SPECS.values() for name in spec.option_names} - set(KIND_SPECS[kind].option_names))
    assert others
    for option in others:
        error = raised(lambda: backend.call(kind, X, TARGET.get(kind, T), **{option: 0.5}))
        assert type(error) is TypeError and str(error) == f"{kind}(): got an unexpected keyword argument {option!r}"


BAD_COUNTS = [
    ("sum", dict(labels=Y, normalization="sum")),
    ("none", dict(loss_mask=M, normalization="none")),
    ("unknown", dict(labels=Y, normalization="mean")),
    ("nothing", dict()),
    ("float-labels", dict(labels=Y.astype(np.float32))),
    ("complex-mask", dict(loss_mask=M.astype(np.complex64))),
    ("integer-mask", dict(labels=Y, loss_mask=Y)),
    ("shape", dict(labels=Y, loss_mask=M[:3])),
    ("negative-weight", dict(loss_mask=np.array([1.0, -1.0], np.float32))),
    ("nan-weight", dict(labels=Y[:2], loss_mask=np.array([1.0, np.nan], np.float32))),
    ("weight-sum-overflows-float32", dict(loss_mask=np.array([3e38, 3e38], np.float32))),
    ("weight-subnormal", dict(labels=Y[:2], loss_mask=np.array([1e-40, 1.0], np.float32))),
    ("ignore-index-float", dict(labels=Y, ignore_index=-100.0)),
    ("ignore-index-beyond-int64", dict(labels=Y, ignore_index=-(2**63) - 1)),
    ("causal-shift-no-time-axis", dict(labels=np.int32(3), causal_shift=True)),
    ("sequence-mode-segment-ids-shape", dict(labels=Y[None], normalization="sequence_mean", segment_ids=np.zeros((1, N - 1), np.int32))),
]


@over_frameworks("name,kwargs", BAD_COUNTS, ids=[c[0] for c in BAD_COUNTS])
def test_count_denominator_bad_input(backend: Backend, name: str, kwargs: dict) -> None:
    assert_same_error(raised(lambda: backend.count_denominator(**kwargs)), raised(lambda: lossspec.count_denominator(**kwargs)))


@over_backends("kind", ALL_KINDS, cover=lambda kind: kind == ALL_KINDS[0], xla_fast=never)
def test_inputs_are_not_modified(backend: Backend, kind: str) -> None:
    """Logits, target, mask and segment ids are left as they were (torch reads the NumPy buffers
    in place: a write would show here)."""
    case = lossspec.make_case(kind, "float_weights", lead_shape=backend.lead, vocab=37, seed=14)
    ids = np.zeros(backend.lead, np.int64)
    inputs = [case.logits, case.target, case.loss_mask, ids]
    before = [None if a is None else a.copy() for a in inputs]
    backend.run(kind, case.logits, case.target, case.loss_mask, segment_ids=ids, **sample_options(kind))
    for name, array, copy in zip(("logits", "target", "loss_mask", "segment_ids"), inputs, before):
        assert array is None or np.array_equal(array, copy, equal_nan=True), f"{name} was modified"
