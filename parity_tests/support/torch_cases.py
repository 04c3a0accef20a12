"""Helpers shared by the ``test_torchloss_*`` tests (this module holds no tests).

Every numeric test runs a :class:`lossspec.Case` through a ``torchloss`` function, backpropagates
the oracle's upstream gradient and checks loss and gradient with
:func:`lossspec.assert_close_to_oracle` at the bounds of SPEC section 6. Inputs are made on the
host; ``impl="triton"`` runs on ``torch_problem.TRITON_DEVICE`` (compiled kernels on CUDA tensors
where CUDA is available, else the Triton interpreter on CPU tensors), the torch path on the CPU;
results come back to the host (:func:`device_for`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch

import lossspec
import torchloss

from parity_tests.support.torch_problem import device_for  # noqa: F401  (re-exported for the torch test files)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
FUNCTIONS = {
    "cross_entropy": torchloss.cross_entropy,
    "soft_cross_entropy": torchloss.soft_cross_entropy,
    "forward_kl": torchloss.forward_kl,
    "reverse_kl": torchloss.reverse_kl,
}
IMPLS = ("torch", "triton")
DTYPES = ("float32", "bfloat16", "float16")


def inputs(
    case: lossspec.Case, requires_grad: bool = True, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(logits, target, loss_mask)`` as torch tensors on ``device`` (the CPU by default), made on
    the host; the logits (and teacher logits) in the case's dtype, exactly the values the oracle
    sees."""
    device = torch.device("cpu") if device is None else device
    dtype = TORCH_DTYPES[case.dtype]
    logits = torch.from_numpy(case.logits).to(dtype).to(device).requires_grad_(requires_grad)
    target = torch.from_numpy(np.array(case.target))
    if case.kind != "cross_entropy":
        target = target.to(dtype)
    mask = None if case.loss_mask is None else torch.from_numpy(np.array(case.loss_mask)).to(device)
    return logits, target.to(device), mask


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The Triton interpreter evaluates masked lanes with NumPy (``-inf - -inf`` and the like) and
    warns; those lanes are discarded by design."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def run(
    case: lossspec.Case, impl: str, *, grad_output: Any = None, denominator: Any = None, tuning: Optional[lossspec.Tuning] = None,
    **options: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Loss and ``d(sum(loss * grad_output))/dlogits`` of ``case`` by ``torchloss`` (on
    :func:`device_for` ``impl``, with ``tuning``), as float64 arrays."""
    logits, target, mask = inputs(case, device=device_for(impl))
    with quiet():
        loss = FUNCTIONS[case.kind](logits, target, mask, impl=impl, denominator=denominator, tuning=tuning, **options)
        assert loss.dtype == torch.float32, loss.dtype
        upstream = torch.ones_like(loss) if grad_output is None else torch.as_tensor(grad_output, dtype=loss.dtype).to(loss.device)
        loss.backward(upstream.expand_as(loss))
    assert logits.grad is not None and logits.grad.dtype == logits.dtype
    return loss.detach().cpu().double().numpy(), logits.grad.cpu().double().numpy()


def check(
    case: lossspec.Case, impl: str, *, grad_output: Any = None, denominator: Any = None, tuning: Optional[lossspec.Tuning] = None,
    **options: Any,
) -> tuple[lossspec.Comparison, lossspec.Comparison]:
    """Run ``case`` and assert it meets SPEC section 6 against the oracle (same options).

    ``denominator`` may be a torch tensor (the oracle gets its value); ``tuning`` (the block and
    tile sizes) goes to torchloss only."""
    ref_options = dict(options)
    if grad_output is not None:
        ref_options["grad_output"] = np.asarray(grad_output, dtype=np.float64)
    if denominator is not None:
        ref_options["denominator"] = float(denominator)
    ref = case.reference(**ref_options)
    loss, grad = run(case, impl, grad_output=grad_output, denominator=denominator, tuning=tuning, **options)
    what = f"{impl}:{case.name}:{options or ''}"
    return lossspec.assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0, what=what)
