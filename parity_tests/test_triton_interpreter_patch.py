"""The test processes' Triton-interpreter shortcut (parity_tests/support/triton_interpreter.py),
its type caches and binary-op shortcut included, changes no bit: every kind's kernels (with and without soft caps: reverse KL's tl.reduce combines
either way, several vocabulary blocks and a ragged tail, a non-unit upstream gradient through the
16-bit regrad kernel) give the same loss and gradient with the interpreter's own device calls and
element-by-element reductions and with the shortcut; and a tl.reduce of sums in float32 whose
order shows in the bits gives the interpreter's own bits."""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import lossspec
import torchloss
from parity_tests.support import triton_interpreter

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the shortcut is for the Triton interpreter (a CPU run)")

TUNING = lossspec.Tuning(vocab_block=32)  # V = 75: 3 blocks, the last ragged


def _options(kind: str, caps: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"logit_softcap": 20.0 if caps else None, "logit_scale": 1.3}
    if kind != "cross_entropy":
        options["temperature"] = 1.5
    if kind in lossspec.DISTILL_KINDS:
        options.update(teacher_logit_softcap=25.0 if caps else None)
    if kind == "cross_entropy":
        options.update(label_smoothing=0.1, z_loss=1e-3)
    return options


def _run(kind: str, dtype: torch.dtype, caps: bool) -> tuple[np.ndarray, np.ndarray]:
    case = lossspec.make_case(kind, "random", lead_shape=(3,), vocab=75, seed=11)
    x = torch.from_numpy(case.logits).to(dtype).requires_grad_(True)
    target = () if case.target is None else ((torch.from_numpy(case.target) if kind == "cross_entropy" else torch.from_numpy(case.target).to(dtype)),)
    mask = torch.from_numpy(np.array(case.loss_mask))
    loss = getattr(torchloss, kind)(x, *target, mask, impl="triton", normalization="none", tuning=TUNING, **_options(kind, caps))
    loss.backward(torch.linspace(0.5, 2.0, loss.numel()).reshape(loss.shape))
    return loss.detach().double().numpy(), x.grad.float().numpy()


@pytest.fixture
def without_shortcut() -> Iterator[None]:
    triton_interpreter.uninstall()
    try:
        yield
    finally:
        assert triton_interpreter.install()


def test_the_triton_shortcut_is_installed() -> None:
    """With its type caches: on this Triton the cached ``tl.tensor.__init__`` gives Triton's own
    attributes (else ``install`` would leave it out, silently slower)."""
    from triton.language import core
    from triton.runtime import interpreter

    assert getattr(interpreter.InterpretedFunction, triton_interpreter.INSTALLED_FLAG, False)
    assert core.tensor.__init__.__name__ == "cached_init"
    assert interpreter._get_np_dtype.__name__ == "_get_np_dtype" and hasattr(interpreter._get_np_dtype, "__wrapped__")
    assert "binary_op_type_checking_impl" in vars(interpreter.interpreter_semantic)  # the binary-op shortcut


@pytest.mark.parametrize("caps", [True, False], ids=["caps", "no_caps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", lossspec.ALL_KINDS)
def test_triton_kernels_give_the_same_bits_with_the_shortcut(kind: str, dtype: torch.dtype, caps: bool, without_shortcut: None) -> None:
    plain_loss, plain_grad = _run(kind, dtype, caps)
    assert triton_interpreter.install()
    fast_loss, fast_grad = _run(kind, dtype, caps)
    assert np.isfinite(plain_loss).all() and plain_grad.any()
    np.testing.assert_array_equal(fast_loss, plain_loss)
    np.testing.assert_array_equal(fast_grad, plain_grad)


@triton.jit
def _add_pair(a, b, c, d):
    return a + c, b + d


@triton.jit
def _add_one(a, b):
    return a + b


@triton.jit
def _reduce_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    by_row, squares = tl.reduce((x, x * x), 1, _add_pair)
    tl.store(out_ptr + tl.arange(0, R), by_row - squares)
    tl.store(out_ptr + R + tl.arange(0, C), tl.reduce(x, 0, _add_one))
    tl.store(out_ptr + R + C, tl.reduce(x, None, _add_one))


def test_triton_reduce_with_a_combine_keeps_the_interpreters_order(without_shortcut: None) -> None:
    """Sums of float32 values spread over 40 binades (the order of the additions shows in the
    bits) through tl.reduce with combine functions of ours, along each axis and over the whole
    block: the shortcut's slice-at-a-time reduction gives the interpreter's own bits."""
    kernel = _reduce_kernel
    rng = np.random.default_rng(5)
    x = torch.from_numpy((rng.standard_normal((8, 16)) * 2.0 ** rng.integers(-20, 20, (8, 16))).astype(np.float32))
    plain = torch.zeros(8 + 16 + 1)
    kernel[(1,)](x, plain, R=8, C=16)
    assert triton_interpreter.install()
    fast = torch.zeros(8 + 16 + 1)
    kernel[(1,)](x, fast, R=8, C=16)
    assert plain.abs().min() > 0
    np.testing.assert_array_equal(fast.numpy(), plain.numpy())
