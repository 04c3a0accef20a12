"""Every bad input of SPEC section 5: torchloss raises the error of ``lossspec`` (type and message,
taken from the oracle or the lossspec check on the equivalent NumPy input, never re-typed here)
before any kernel runs; where values cannot be read for free (GPU, torch.compile) a bad value makes
the loss NaN instead."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from parity_tests.support.torch_cases import FUNCTIONS, IMPLS, device_for, quiet

import lossspec
import torchloss

KINDS = lossspec.KINDS


def _inputs(kind: str, rows: int = 6, vocab: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    target = rng.integers(0, vocab, size=rows) if kind == "cross_entropy" else rng.normal(size=(rows, vocab)).astype(np.float32)
    mask = np.ones(rows, dtype=np.float32)
    return logits, target, mask


def _t(array: Any, device: torch.device | None = None) -> Any:
    """A NumPy array as a tensor made on the host (moved to ``device`` if given); anything else as is."""
    if not isinstance(array, np.ndarray):
        return array
    tensor = torch.from_numpy(np.asarray(array))
    return tensor if device is None else tensor.to(device)


def _same_error(reference: Callable[[], Any], call: Callable[[], Any]) -> None:
    """``call`` raises exactly what ``reference`` (lossspec) raises: same type, same message."""
    with pytest.raises(Exception) as expected:
        reference()
    with pytest.raises(type(expected.value), match=f"^{re.escape(str(expected.value))}$"):
        with quiet():
            call()


def _both(kind: str, impl: str, logits: Any, target: Any, mask: Any = None, **options: Any) -> None:
    """The oracle on NumPy inputs and torchloss on the same inputs as tensors fail alike."""
    _same_error(
        lambda: lossspec.oracle(kind, logits, target, mask, **options),
        lambda: FUNCTIONS[kind](_t(logits), _t(target), _t(mask), impl=impl, **options),
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_shape_and_dtype_errors(kind: str, impl: str) -> None:
    logits, target, mask = _inputs(kind)
    _both(kind, impl, logits.astype(np.int64), target, mask)  # integer logits
    _both(kind, impl, logits[:, :0], target if kind == "cross_entropy" else target[:, :0], mask)  # V == 0
    _both(kind, impl, logits, target, mask[:4])  # mask shape
    _both(kind, impl, logits, target, mask.astype(np.complex64))  # mask dtype
    if kind == "cross_entropy":
        _both(kind, impl, logits, target[:5], mask)  # labels shape
        _both(kind, impl, logits, target.astype(np.float32), mask)  # non-integer labels
        _both(kind, impl, logits.reshape(2, 3, 10), target, mask)  # leading shapes differ
    else:
        _both(kind, impl, logits, target[:, :9], mask)  # teacher shape
        _both(kind, impl, logits, target.astype(np.int32), mask)  # integer teacher logits
    _same_error(
        lambda: lossspec.check_inputs(
            lossspec.make_config(kind), lossspec.meta((), "f", "float32"), lossspec.meta((), "i", "int64"), None
        ),
        lambda: FUNCTIONS[kind](torch.tensor(1.0), torch.tensor(0) if kind == "cross_entropy" else torch.tensor(1.0)),
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_option_errors(kind: str, impl: str) -> None:
    logits, target, mask = _inputs(kind)
    bad = [
        {"normalization": "mean"},
        {"logit_scale": 0.0},
        {"logit_scale": float("nan")},
        {"logit_scale": "1"},
        # every float option a normal float32 number (lossspec.config.check_fp32_normal)
        {"logit_scale": 1e300},
        {"logit_softcap": 1e-300},
        {"logit_softcap": 1e300},
    ]
    if kind == "cross_entropy":
        bad += [{"label_smoothing": -0.1}, {"label_smoothing": 1.5}, {"z_loss": -1e-4}, {"ignore_index": 1.5}]
    else:
        bad += [{"temperature": 0.0}, {"temperature": -1.0}, {"teacher_logit_scale": 0.0}, {"temperature": float("inf")},
                {"temperature": 1e-300}, {"temperature": 10**400}, {"teacher_logit_scale": 1e20, "temperature": 1e-20}]
    for options in bad:
        _both(kind, impl, logits, target, mask, **options)
    _same_error(
        lambda: lossspec.check_impl("pallas", lossspec.TORCH_IMPLS),
        lambda: FUNCTIONS[kind](_t(logits), _t(target), impl="pallas"),
    )
    wrong = {"temperature": 2.0} if kind == "cross_entropy" else {"label_smoothing": 0.1}
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        FUNCTIONS[kind](_t(logits), _t(target), impl=impl, **wrong)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_value_errors(kind: str, impl: str) -> None:
    logits, target, mask = _inputs(kind)
    for weights in (np.where(np.arange(6) == 2, -0.5, mask), np.where(np.arange(6) == 4, np.nan, mask), np.full(6, np.inf)):
        _both(kind, impl, logits, target, weights.astype(np.float32))
    _both(kind, impl, logits, target, np.array([1, 0, -2, 1, 1, 1], dtype=np.int32))  # integer weights
    if kind == "cross_entropy":
        for bad_label in (10, -1, 10**6):
            labels = target.copy()
            labels[3] = bad_label
            _both(kind, impl, logits, labels, mask)
            # The same label at a masked position is never read: no error, and the oracle's loss.
            masked = mask.copy()
            masked[3] = 0
            device = device_for(impl)  # a call that runs: impl="triton" on TRITON_DEVICE
            loss = FUNCTIONS[kind](_t(logits, device), _t(labels, device), _t(masked, device), impl=impl)
            assert lossspec.compare_loss(loss.cpu().numpy(), lossspec.oracle(kind, logits, labels, masked)[0]).ok


@pytest.mark.parametrize("impl", IMPLS)
def test_denominator_errors(impl: str) -> None:
    kind = "cross_entropy"
    logits, target, mask = _inputs(kind)
    _both(kind, impl, logits, target, mask, normalization="none", denominator=4.0)
    for value in (-1.0, float("nan"), float("inf")):
        _both(kind, impl, logits, target, mask, denominator=value)
        _same_error(
            lambda: lossspec.check_denominator_value(value),
            lambda: torchloss.cross_entropy(_t(logits), _t(target), denominator=torch.tensor(value), impl=impl),
        )
    _same_error(
        lambda: lossspec.check_denominator_shape((2,)),
        lambda: torchloss.cross_entropy(_t(logits), _t(target), denominator=torch.ones(2), impl=impl),
    )
    with pytest.raises(TypeError, match="denominator must be a number or a 0-d tensor"):
        torchloss.cross_entropy(_t(logits), _t(target), denominator="6")


@pytest.mark.parametrize("kind", KINDS)
def test_type_device_and_vocab_parallel_errors(kind: str) -> None:
    logits, target, mask = _inputs(kind)
    fn = FUNCTIONS[kind]
    name = "labels" if kind == "cross_entropy" else "teacher_logits"
    with pytest.raises(TypeError, match="logits must be a torch.Tensor; got ndarray"):
        fn(logits, _t(target))
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor; got list"):
        fn(_t(logits), target.tolist())
    with pytest.raises(TypeError, match="loss_mask must be a torch.Tensor; got ndarray"):
        fn(_t(logits), _t(target), mask)
    with pytest.raises(ValueError, match=rf"{name} must be on the device of logits \(meta\); got cpu"):
        fn(_t(logits).to("meta"), _t(target))
    with pytest.raises(TypeError, match="vocab_parallel must be a torch.distributed ProcessGroup"):
        fn(_t(logits), _t(target), vocab_parallel=object())


def test_count_denominator_errors() -> None:
    labels = torch.tensor([[1, 2, -100], [0, 4, 5]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.5]])
    cases = [
        ((labels.numpy(), None), {"normalization": "sum"}, (labels, None)),
        ((labels.numpy(), None), {"normalization": "none"}, (labels, None)),
        ((labels.numpy(), None), {"normalization": "mean"}, (labels, None)),
        ((None, None), {}, (None, None)),
        ((labels.numpy().astype(np.float32), None), {}, (labels.float(), None)),
        ((labels.numpy(), mask.numpy()[:, :2]), {}, (labels, mask[:, :2])),
        ((None, np.where(mask.numpy() == 0.5, -1.0, mask.numpy())), {}, (None, torch.where(mask == 0.5, -1.0, mask))),
    ]
    for np_args, options, torch_args in cases:
        _same_error(
            lambda: lossspec.count_denominator(*np_args, **options),
            lambda: torchloss.count_denominator(*torch_args, **options),
        )


# --------------------------------------------------------------------------------------------
# Where values cannot be read for free (a GPU, torch.compile tracing): NaN, never a number.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_device_side_bad_values_give_nan(monkeypatch: pytest.MonkeyPatch, kind: str, impl: str) -> None:
    """The code path of CUDA tensors and compiled code, run on the CPU: no value checks on the
    host, and a bad label, a negative or non-finite weight or a bad denominator tensor turns the
    loss into NaN (labels are clamped before any gather, so nothing is read out of bounds)."""
    monkeypatch.setattr(torchloss._prepare, "host_readable", lambda *tensors: False)
    device = device_for(impl)  # impl="triton" on TRITON_DEVICE (a real CUDA call where CUDA is available)
    logits, target, mask = _inputs(kind)
    fn = FUNCTIONS[kind]
    good = fn(_t(logits, device), _t(target, device), _t(mask, device), impl=impl)
    ref, _ = lossspec.oracle(kind, logits, target, mask)  # the unchecked path still computes the loss
    lossspec.compare_loss(good.item(), ref, "good inputs").check()
    bad_weights = [np.where(np.arange(6) == 2, -0.5, mask), np.where(np.arange(6) == 4, np.nan, mask)]
    for weights in bad_weights:
        with quiet():
            assert torch.isnan(fn(_t(logits, device), _t(target, device), _t(weights.astype(np.float32), device), impl=impl))
            per_token = fn(_t(logits, device), _t(target, device), _t(weights.astype(np.float32), device), impl=impl, normalization="none")
        assert torch.all(torch.isnan(per_token))
    for denominator in (torch.tensor(-1.0), torch.tensor(float("nan"))):
        assert torch.isnan(fn(_t(logits, device), _t(target, device), _t(mask, device), impl=impl, denominator=denominator))
    if kind == "cross_entropy":
        for bad_label in (10, -1, 10**6):
            labels = target.copy()
            labels[3] = bad_label
            logits_t = _t(logits, device).requires_grad_()
            with quiet():
                loss = fn(logits_t, _t(labels, device), _t(mask, device), impl=impl)
            assert torch.isnan(loss)
            loss.backward()  # the kernel never indexed out of bounds
        assert torch.isnan(torchloss.count_denominator(None, _t(np.where(np.arange(6) == 2, -0.5, mask))))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reduction_says_what_to_write(reduction: str) -> None:
    """``reduction=`` as in ``F.cross_entropy``: a TypeError naming the ``normalization=`` to
    write, from the functions, the fused heads and the modules (lossspec's hint, as in JAX)."""
    logits, labels, _ = _inputs("cross_entropy")
    hint = lossspec.foreign_keyword_hint({"reduction"}, {"reduction": reduction})
    expected = {"mean": "valid_tokens", "sum": "sum", "none": "none"}[reduction]
    assert f"write normalization='{expected}' instead of reduction='{reduction}'" in hint
    message = f"cross_entropy(): got an unexpected keyword argument 'reduction'; {hint}"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        torchloss.cross_entropy(_t(logits), _t(labels), reduction=reduction)
    with pytest.raises(TypeError, match=re.escape(f"linear_cross_entropy(): got an unexpected keyword argument 'reduction'; {hint}")):
        torchloss.linear_cross_entropy(_t(logits), _t(logits), _t(labels), reduction=reduction)
    with pytest.raises(TypeError, match=re.escape(f"CrossEntropyLoss got unexpected option(s) reduction; {hint}; it accepts")):
        torchloss.nn.CrossEntropyLoss(reduction=reduction)


def test_class_axis_second_layout_gets_the_hint() -> None:
    """F.cross_entropy's [B, V, T] logits: lossspec's message, with the hint to move the class axis last."""
    logits = np.zeros((2, 10, 3), np.float32)
    labels = np.zeros((2, 3), np.int64)
    _both("cross_entropy", "torch", logits, labels)
    with pytest.raises(ValueError, match=r"the class axis goes last.*logits\.movedim\(1, -1\)"):
        torchloss.cross_entropy(_t(logits), _t(labels))
def _bad_value_calls(kind: str) -> list[tuple[str, np.ndarray, np.ndarray, Any]]:
    """``(what, target, mask, denominator)`` each with one bad value that only a host check sees:
    a label outside ``[0, V)`` (cross-entropy), a negative or NaN weight, a negative denominator."""
    _, target, mask = _inputs(kind)
    calls = [
        ("negative weight", target, np.where(np.arange(6) == 2, -0.5, mask).astype(np.float32), None),
        ("NaN weight", target, np.where(np.arange(6) == 4, np.nan, mask).astype(np.float32), None),
        ("negative denominator", target, mask, torch.tensor(-1.0)),
    ]
    if kind == "cross_entropy":
        for bad_label in (10, -1):
            labels = target.copy()
            labels[3] = bad_label
            calls.append((f"label {bad_label}", labels, mask, None))
    return calls


def _nan_loss_and_gradient(fn: Callable[..., Any], kind: str, impl: str, normalization: str) -> None:
    """Every bad value of :func:`_bad_value_calls`: NaN loss and an all-NaN gradient; good
    inputs: the oracle's loss and gradient (SPEC section 6)."""
    logits, target, mask = _inputs(kind)
    device = device_for(impl)
    for what, bad_target, bad_mask, denominator in [("good", target, mask, None)] + _bad_value_calls(kind):
        if normalization == "none" and denominator is not None:
            continue
        x = _t(logits, device).requires_grad_()
        with quiet():
            loss = fn(x, _t(bad_target, device), _t(bad_mask, device), impl, normalization, denominator)
            loss.sum().backward()
        assert x.grad is not None
        if what == "good":
            ref_loss, ref_grad = lossspec.oracle(kind, logits, target, mask, normalization=normalization)
            g0 = float(np.abs(ref_grad).max())  # S = max|ref grad|: the bound of SPEC section 6 without G0
            lossspec.compare_loss(loss.detach().cpu().numpy(), ref_loss, "good loss").check()
            lossspec.compare_grad(x.grad.cpu().numpy(), ref_grad, "float32", g0, "good grad").check()
        else:
            assert torch.all(torch.isnan(loss)), what
            assert torch.all(torch.isnan(x.grad)), f"{what}: a NaN loss with a finite gradient"


def _call(kind: str) -> Callable[..., Any]:
    def call(x: Any, target: Any, mask: Any, impl: str, normalization: str, denominator: Any) -> Any:
        return FUNCTIONS[kind](x, target, mask, impl=impl, normalization=normalization, denominator=denominator)

    return call


@pytest.mark.parametrize("normalization", ["valid_tokens", "none"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
def test_unchecked_bad_values_give_nan_gradient(monkeypatch: pytest.MonkeyPatch, kind: str, impl: str, normalization: str) -> None:
    """Where the values are not checked on the host (CUDA tensors, torch.compile), a bad label,
    weight or denominator makes the gradient NaN too, not only the loss (as JAX under jit)."""
    monkeypatch.setattr(torchloss._prepare, "host_readable", lambda *tensors: False)
    _nan_loss_and_gradient(_call(kind), kind, impl, normalization)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
def test_compiled_bad_values_give_nan_gradient(kind: str) -> None:
    """:func:`test_unchecked_bad_values_give_nan_gradient` under torch.compile (the checks are
    skipped while Dynamo traces)."""
    torch._dynamo.reset()
    compiled = torch.compile(_call(kind), backend="aot_eager", fullgraph=True, dynamic=False)
    _nan_loss_and_gradient(compiled, kind, "torch", "valid_tokens")


@pytest.mark.parametrize("impl", IMPLS)
def test_validation_gaps(impl: str) -> None:
    """uint64 labels work (and an out-of-range one, 2**64 - 1, is reported as given, never
    wrapped to -1 or ignored); fp8 logits, integer masks (``entropy(logits, labels)``), denominators
    that are not real numbers: lossspec's error, as in JAX, not a failure inside ATen."""
    logits, labels, mask = _inputs("cross_entropy")
    device = device_for(impl)
    unsigned = labels.astype(np.uint64)
    loss = FUNCTIONS["cross_entropy"](_t(logits, device), _t(unsigned, device), impl=impl)
    lossspec.compare_loss(loss.item(), lossspec.oracle("cross_entropy", logits, unsigned)[0]).check()
    assert torchloss.count_denominator(_t(unsigned)).item() == lossspec.count_denominator(unsigned) == 6
    for big in (2**64 - 1, 2**64 - 100, 2**40):
        bad = unsigned.copy()
        bad[2] = big
        for ignore_index in (-100, -1):
            _both("cross_entropy", impl, logits, bad, mask, ignore_index=ignore_index)
            _same_error(lambda: lossspec.oracle("cross_entropy", logits, bad, ignore_index=ignore_index),
                        lambda: FUNCTIONS["cross_entropy"](_t(logits), _t(bad), ignore_index=ignore_index, impl=impl))
        masked = mask.copy()
        masked[2] = 0  # never read there
        got = FUNCTIONS["cross_entropy"](_t(logits, device), _t(bad, device), _t(masked, device), impl=impl)
        lossspec.compare_loss(got.item(), lossspec.oracle("cross_entropy", logits, bad, masked)[0]).check()
    _same_error(lambda: lossspec.oracle("cross_entropy", logits.astype(ml_dtypes.float8_e4m3fn), labels),
                lambda: FUNCTIONS["cross_entropy"](torch.from_numpy(logits).to(torch.float8_e4m3fn), _t(labels), impl=impl))
    teacher = np.ones_like(logits)
    _same_error(lambda: lossspec.oracle("reverse_kl", logits, teacher.astype(ml_dtypes.float8_e5m2)),
                lambda: FUNCTIONS["reverse_kl"](_t(logits), torch.from_numpy(teacher).to(torch.float8_e5m2), impl=impl))
    int_labels = labels.astype(np.int64)
    _same_error(lambda: lossspec.oracle("entropy", logits, None, int_labels), lambda: torchloss.entropy(_t(logits), _t(int_labels), impl=impl))
    _same_error(lambda: lossspec.count_denominator(int_labels, int_labels), lambda: torchloss.count_denominator(_t(int_labels), _t(int_labels)))
    for denominator in ("5", True, [5.0], np.array(5 + 0j, np.complex64), np.array(True)):
        _same_error(lambda: lossspec.oracle("cross_entropy", logits, labels, denominator=denominator),
                    lambda: FUNCTIONS["cross_entropy"](_t(logits), _t(labels), denominator=_t(denominator), impl=impl))
