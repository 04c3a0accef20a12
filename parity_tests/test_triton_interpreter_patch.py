"""The test processes' Triton-interpreter shortcut (parity_tests/support/triton_interpreter.py)
changes no bit: every kind's kernels (the soft caps' helpers included, several vocabulary blocks
and a ragged tail, a non-unit upstream gradient through the 16-bit regrad kernel) give the same
loss and gradient with the interpreter's own device calls and with the shortcut."""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import lossspec
import torchloss
from parity_tests.support import triton_interpreter

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the shortcut is for the Triton interpreter (a CPU run)")

TUNING = lossspec.Tuning(vocab_block=32)  # V = 75: 3 blocks, the last ragged


def _options(kind: str) -> dict[str, Any]:
    options: dict[str, Any] = {"logit_softcap": 20.0, "logit_scale": 1.3}
    if kind != "cross_entropy":
        options["temperature"] = 1.5
    if kind in lossspec.DISTILL_KINDS:
        options.update(teacher_logit_softcap=25.0)
    if kind == "cross_entropy":
        options.update(label_smoothing=0.1, z_loss=1e-3)
    return options


def _run(kind: str, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    case = lossspec.make_case(kind, "random", lead_shape=(3,), vocab=75, seed=11)
    x = torch.from_numpy(case.logits).to(dtype).requires_grad_(True)
    target = () if case.target is None else ((torch.from_numpy(case.target) if kind == "cross_entropy" else torch.from_numpy(case.target).to(dtype)),)
    mask = torch.from_numpy(np.array(case.loss_mask))
    loss = getattr(torchloss, kind)(x, *target, mask, impl="triton", normalization="none", tuning=TUNING, **_options(kind))
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
    from triton.runtime import interpreter

    assert getattr(interpreter.InterpretedFunction, triton_interpreter.INSTALLED_FLAG, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", lossspec.ALL_KINDS)
def test_triton_kernels_give_the_same_bits_with_the_shortcut(kind: str, dtype: torch.dtype, without_shortcut: None) -> None:
    plain_loss, plain_grad = _run(kind, dtype)
    assert triton_interpreter.install()
    fast_loss, fast_grad = _run(kind, dtype)
    assert np.isfinite(plain_loss).all() and plain_grad.any()
    np.testing.assert_array_equal(fast_loss, plain_loss)
    np.testing.assert_array_equal(fast_grad, plain_grad)
