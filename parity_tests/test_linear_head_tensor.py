"""The fused head's ``precision="tensor"`` contract (SPEC section 8) against the float64 oracle.

``"tensor"`` (bf16 heads): the logits gradient ``G`` is rounded once to bf16, to nearest even,
so that the three matmuls are bf16 x bf16 products accumulated in fp32 (tensor cores); on the
CPU the same numbers come from exact fp32 products. Checked three ways:

- the public functions of every head kind and both frameworks meet the contract's bounds
  (:func:`lossspec.linear.compare_head_loss` with the oracle's ``loss_slack``, and
  :func:`lossspec.linear.compare_head_grad` with ``precision="tensor"``); the recompute backward
  and the head kernels too (the kernels compute the exact contract's numbers, which meet it);
- the drivers' fp32 gradients, before their one rounding to the output dtype, are the float64
  products of ``G`` rounded to bf16 to nearest even (ties of ``G`` that its fp32 error may tip
  either way allowed both ways): this is what tells ``"tensor"`` from ``"exact"`` (whose
  gradients miss that reference by ~20x its bound) and from a truncating rounding;
- ``precision=`` reaches the plan in both frameworks (functions and modules), and its errors
  are lossspec's, the same in both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxloss
import jaxloss.head as jax_head
import jaxloss.nnx  # noqa: F401  (the module forms)
import lossspec
import torchloss
import torchloss.head as torch_head
from jaxloss._block import KernelConfig
from lossspec import linear as spec_linear
from parity_tests.support.head_cases import (
    H, HT, KINDS, LEAD, MEM_N, MEM_V, NORMS, PLANS, RUNNERS, V, block_budget, driver_reference, grad_output_for, head_target, make_inputs, options_for,
    peak_extra,
)

TENSOR = {"precision": "tensor"}


def _check_public(framework: str, kind: str, norm: str = "valid_tokens", **head_options: Any) -> None:
    """``linear_<kind>(..., precision="tensor")`` on bf16 inputs within the tensor contract's bounds."""
    inputs = make_inputs(kind, "bfloat16", seed=4)
    options = {**options_for(kind), **NORMS[norm]}
    grad_output = grad_output_for(options["normalization"])
    loss, grads = RUNNERS[framework](kind, inputs, "bfloat16", True, {**options, **TENSOR, **head_options}, grad_output)
    ref_loss, ref = spec_linear.oracle_head(
        kind, inputs["hidden"], inputs["weight"], head_target(kind, inputs), inputs["loss_mask"], bias=inputs["bias"],
        grad_output=grad_output, precision="tensor", **options,
    )
    assert np.sum(ref.loss_slack) > 0  # (0 at masked tokens of a per-token loss)
    spec_linear.compare_head_loss(loss, ref_loss, ref.loss_slack, f"{framework} {kind} tensor loss").check()
    for name, grad in grads.items():
        spec_linear.compare_head_grad(grad, ref[name], "bfloat16", f"{framework} {kind} tensor grad {name}", ref.magnitude[name], "tensor").check()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("framework", list(RUNNERS))
def test_tensor_head_meets_its_bounds(framework: str, kind: str) -> None:
    _check_public(framework, kind)


@pytest.mark.slow  # a JAX compile per kind (the fast lane's cover of the parts: the drivers test below)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("framework", list(RUNNERS))
def test_tensor_head_in_chunks_of_parts_meets_its_bounds(framework: str, kind: str) -> None:
    """The whole-row plan with 5-row chunks on 12 tokens, bias included. JAX stores ``G`` in bf16
    and cuts each chunk into parts (``jaxloss.head._whole_parts``: here 2-row parts, 4 to 10 per
    chunk by kind; the last chunk moved back over rows already done)."""
    _check_public(framework, kind, tuning=block_budget(*PLANS["whole"]))


@pytest.mark.parametrize("framework", list(RUNNERS))
def test_tensor_head_per_token_and_recompute(framework: str) -> None:
    _check_public(framework, "reverse_kl", "none", tuning=block_budget(*PLANS["blocked"]))
    _check_public(framework, "cross_entropy", recompute_logits=True)


# --------------------------------------------------------------------------------------------
# The drivers' fp32 gradients: G rounded once to bf16, to nearest even
# --------------------------------------------------------------------------------------------


def _rounded_g_reference(kind: str, inputs: dict[str, Any], coef: np.ndarray, options: dict[str, Any]) -> tuple:
    """``(sum_i coef_i l_i, dh, dW, allowance_h, allowance_w, magnitude_h, magnitude_w)`` in float64
    with ``G`` (the oracle's) rounded to bf16 to nearest even. Entries of ``G`` within section 6's
    bound of a bf16 rounding boundary may round either way in fp32: their difference (one bf16 ulp)
    times ``|W|`` / ``|h|`` is the allowance."""
    per_token, g, h, w = driver_reference(kind, inputs, coef, options)
    g_error = lossspec.GRAD_RTOL * np.abs(g).max()
    low = lossspec.round_to_dtype(g - g_error, "bfloat16").astype(np.float64)
    high = lossspec.round_to_dtype(g + g_error, "bfloat16").astype(np.float64)
    g_rounded = lossspec.round_to_dtype(g, "bfloat16").astype(np.float64)
    tipping = np.abs(high - low)
    return (float(np.sum(per_token)), g_rounded @ w, g_rounded.T @ h, tipping @ np.abs(w), tipping.T @ np.abs(h),
            np.abs(g) @ np.abs(w), np.abs(g).T @ np.abs(h))


def _drivers(framework: str, kind: str, inputs: dict[str, Any], coef: np.ndarray, options: dict[str, Any], tuning: lossspec.HeadTuning) -> tuple:
    """``(l [N], dh, dW)`` fp32 from the framework's ``head_forward`` on bf16 inputs."""
    n = coef.size
    spec = lossspec.KIND_SPECS[kind]
    if framework == "torch":
        bf = lambda a: torch.tensor(np.asarray(a, np.float32)).to(torch.bfloat16)  # noqa: E731  (exact)
        labels = torch.tensor(inputs["labels"].reshape(-1)) if spec.has_labels else None
        teacher = (bf(inputs["teacher_hidden"].reshape(n, HT)), bf(inputs["teacher_weight"]), bf(inputs["teacher_bias"])) if spec.has_teacher else None
        out = torch_head.head_forward(lossspec.make_config(kind, **options), bf(inputs["hidden"].reshape(n, H)), bf(inputs["weight"]),
                                      bf(inputs["bias"]), labels, teacher, torch.tensor(coef), need_grad=True, tuning=tuning)
        return tuple(a.double().numpy() for a in out[:3])
    bj = lambda a: jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16)  # noqa: E731  (exact)
    labels = jnp.asarray(inputs["labels"].reshape(-1), jnp.int32) if spec.has_labels else None
    teacher = (bj(inputs["teacher_hidden"].reshape(n, HT)), bj(inputs["teacher_weight"]), bj(inputs["teacher_bias"])) if spec.has_teacher else None
    out = jax_head.head_forward(KernelConfig.of(lossspec.make_config(kind, **options)), bj(inputs["hidden"].reshape(n, H)), bj(inputs["weight"]),
                                bj(inputs["bias"]), labels, teacher, jnp.asarray(coef), with_grad=True, tuning=tuning)
    return tuple(np.asarray(a, np.float64) for a in out[:3])


def _rounded_g_misses(framework: str, kind: str, precision: str, plan: str = "whole", **fields: Any) -> float:
    """The worst error of the drivers' fp32 ``dh`` and ``dW`` against the rounded-``G``
    reference, in units of its bound: the exact contract's fp32 bound (``4e-6 max(S, M)``) plus
    the allowance of ``G``'s entries at a rounding boundary."""
    inputs = make_inputs(kind, "bfloat16", seed=3, lead=(4, 9))
    if "labels" in inputs:
        inputs["labels"] = np.abs(inputs["labels"]) % V  # the drivers take safe labels
    options = options_for(kind)
    coef = inputs["loss_mask"].reshape(-1).astype(np.float32)
    tuning = spec_linear.head_matmul_tuning(block_budget(*PLANS[plan], **fields), precision)
    loss, dh, dw = _drivers(framework, kind, inputs, coef, options, tuning)
    ref_loss, ref_dh, ref_dw, allow_h, allow_w, mag_h, mag_w = _rounded_g_reference(kind, inputs, coef, options)
    lossspec.compare_loss(float(np.sum(coef * loss)), ref_loss, f"{framework} {kind} loss").check()
    worst = 0.0
    for got, want, allowance, magnitude in ((dh, ref_dh, allow_h, mag_h), (dw, ref_dw, allow_w, mag_w)):
        bound = lossspec.GRAD_RTOL * np.maximum(np.abs(want).max(), magnitude) + allowance
        worst = max(worst, float(np.max(np.abs(got - want) / bound)))
    return worst


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_tensor_drivers_round_g_once_to_nearest_even(framework: str, kind: str) -> None:
    assert _rounded_g_misses(framework, kind, "tensor") <= 1.0
    # The same reference tells the exact contract's products apart: G not rounded misses it
    # (by 30x to 120x here).
    assert _rounded_g_misses(framework, kind, "exact") > 3.0


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_tensor_drivers_in_the_vocabulary_blocked_plan(framework: str) -> None:
    assert _rounded_g_misses(framework, "jensen_shannon", "tensor", plan="blocked") <= 1.0


@pytest.mark.slow  # the Triton interpreter
def test_tensor_drivers_on_the_triton_matmul() -> None:
    """torch's bf16 matmuls on CUDA are the Triton kernel: run in the interpreter, G is rounded to
    nearest even before it (the interpreter's own cast truncates)."""
    assert torch_head._triton_matmuls(torch.device("cpu"), lossspec.HeadTuning(triton_matmul_devices=("cpu",)))
    assert _rounded_g_misses("torch", "cross_entropy", "tensor", triton_matmul_devices=("cpu",)) <= 1.0


def test_truncating_g_misses_the_rounded_reference() -> None:
    """The rounded-``G`` reference tells rounding to nearest even from truncation (what a bare
    fp32 -> bf16 bit cut, or the Triton interpreter's cast, would give)."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal((12, 37)) * 1e-2
    w = lossspec.round_to_dtype(rng.standard_normal((37, 8)), "bfloat16").astype(np.float64)
    nearest = lossspec.round_to_dtype(g, "bfloat16").astype(np.float64)
    truncated = (g.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    magnitude = np.abs(g) @ np.abs(w)
    bound = lossspec.GRAD_RTOL * np.maximum(np.abs(nearest @ w).max(), magnitude)
    assert np.max(np.abs(truncated @ w - nearest @ w) / bound) > 10.0


# --------------------------------------------------------------------------------------------
# precision= reaches the plan; its errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", list(RUNNERS))
def test_precision_reaches_the_plan(framework: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's ``head_forward`` gets the tensor contract's matmul tuning
    (:func:`lossspec.linear.head_matmul_tuning`) from the function and the module with
    ``precision="tensor"``, and the caller's tuning unchanged otherwise."""
    head = jax_head if framework == "jax" else torch_head
    seen: list[lossspec.HeadTuning] = []
    real = head.head_forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["tuning"])
        return real(*args, **kwargs)

    monkeypatch.setattr(head, "head_forward", recording)
    inputs = make_inputs("cross_entropy", "bfloat16", seed=10)
    if framework == "jax":
        conv, package, modules = (lambda a: jnp.asarray(a, jnp.bfloat16)), jaxloss, jaxloss.nnx
        labels = jnp.asarray(inputs["labels"])
    else:
        conv, package, modules = (lambda a: torch.tensor(a).to(torch.bfloat16)), torchloss, torchloss.nn
        labels = torch.tensor(inputs["labels"])
    args = (conv(inputs["hidden"]), conv(inputs["weight"]), labels)
    # three values used by no other test, so that JAX traces each call anew
    tunings = [lossspec.HeadTuning(blocked_rows=rows) for rows in (7, 9, 11)]
    package.linear_cross_entropy(*args, precision="tensor", tuning=tunings[0])
    modules.LinearCrossEntropyLoss(precision="tensor", tuning=tunings[1])(*args)
    package.linear_cross_entropy(*args, tuning=tunings[2])
    tensor = [spec_linear.head_matmul_tuning(tuning, "tensor") for tuning in tunings[:2]]
    assert all(t.split_terms == 1 and "cpu" in t.bf16_matmul_devices for t in tensor) and tensor[1].blocked_rows == 9
    assert seen == [*tensor, tunings[2]], seen


@pytest.mark.parametrize("framework", list(RUNNERS))
def test_precision_errors_are_lossspecs(framework: str) -> None:
    """An unknown precision is a ``ValueError`` (functions and module constructors); ``"tensor"``
    on float32 / float16 heads a ``ValueError`` naming the dtype; the same messages in both."""
    inputs = make_inputs("cross_entropy", "float32", seed=10)
    if framework == "jax":
        package, modules = jaxloss, jaxloss.nnx
        conv = lambda a, dt: jnp.asarray(a, dt)  # noqa: E731
        labels = jnp.asarray(inputs["labels"])
    else:
        package, modules = torchloss, torchloss.nn
        conv = lambda a, dt: torch.tensor(a).to(getattr(torch, dt))  # noqa: E731
        labels = torch.tensor(inputs["labels"])
    for bad in ("fast", "TENSOR", None):
        with pytest.raises(ValueError, match="precision must be one of 'exact', 'tensor'"):
            package.linear_cross_entropy(conv(inputs["hidden"], "float32"), conv(inputs["weight"], "float32"), labels, precision=bad)
        with pytest.raises(ValueError, match="precision must be one of 'exact', 'tensor'"):
            modules.LinearCrossEntropyLoss(precision=bad)
    for dtype in ("float32", "float16"):
        with pytest.raises(ValueError, match=f"precision='tensor' is the contract of bfloat16 heads.*are {dtype}: use precision='exact'"):
            package.linear_entropy(conv(inputs["hidden"], dtype), conv(inputs["weight"], dtype), precision="tensor")


def test_tensor_bounds_in_lossspec() -> None:
    """``gamma_H`` is Higham's ``k e / (1 - k e)`` with ``k = H`` and ``e = 2^-23``; the loss slack
    is ``sum |dL/dz| gamma_H (|h||W| + |b|)`` of the loss itself (not scaled by ``grad_output``),
    per token for ``"none"``; the tensor gradient bound adds ``2^-8 M`` to the exact one."""
    assert spec_linear.head_logits_gamma(4096) == pytest.approx(4096 * 2.0**-23 / (1 - 4096 * 2.0**-23), rel=1e-15)
    inputs = make_inputs("cross_entropy", "bfloat16", seed=2)
    h, w, b = inputs["hidden"].reshape(-1, H).astype(np.float64), inputs["weight"].astype(np.float64), inputs["bias"].astype(np.float64)
    error = spec_linear.head_logits_gamma(H) * (np.abs(h) @ np.abs(w).T + np.abs(b))
    for norm, grad_output in (("valid_tokens", 3.0), ("none", np.full(LEAD, 3.0))):
        options = {**options_for("cross_entropy"), "normalization": norm}
        _, g_unit = lossspec.oracle("cross_entropy", spec_linear.head_logits(h, w, b).reshape(LEAD + (V,)), inputs["labels"], inputs["loss_mask"], **options)
        per_token = np.sum(np.abs(g_unit.reshape(-1, V)) * error, axis=1)
        _, ref = spec_linear.oracle_head("cross_entropy", inputs["hidden"], inputs["weight"], inputs["labels"], inputs["loss_mask"], bias=inputs["bias"],
                                         precision="tensor", grad_output=grad_output, **options)
        want = per_token.reshape(LEAD) if norm == "none" else per_token.sum()
        np.testing.assert_allclose(ref.loss_slack, want, rtol=1e-12)
        _, exact = spec_linear.oracle_head("cross_entropy", inputs["hidden"], inputs["weight"], inputs["labels"], inputs["loss_mask"], bias=inputs["bias"],
                                           grad_output=grad_output, **options)
        assert np.all(exact.loss_slack == 0)
    grad = np.array([1.0, -2.0]), np.array([0.5, 4.0])
    ref_grad, magnitude = grad
    off = ref_grad + np.array([0.0, 2.0**-8 * 4.0 * 0.99])
    assert not spec_linear.compare_head_grad(off, ref_grad, "float32", magnitude=magnitude).ok
    assert spec_linear.compare_head_grad(off, ref_grad, "float32", magnitude=magnitude, precision="tensor").ok
    assert not spec_linear.compare_head_grad(ref_grad + np.array([0.0, 2.0**-8 * 4.0 * 1.01 + 4e-6 * 4.0]), ref_grad, "float32",
                                             magnitude=magnitude, precision="tensor").ok


# --------------------------------------------------------------------------------------------
# Memory: the tensor contract keeps the exact one's budget (1/8 of the logits + the gradients)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # profiled, and an XLA compile of the tensor head
def test_tensor_head_memory_is_an_eighth_of_the_logits() -> None:
    """bf16, H = 128: torch's profiled peak and XLA's temporaries of the value-and-grad stay within
    1/8 of the bf16 logits plus the fp32 and bf16 gradients and a few per-token vectors (``G``'s
    bf16 copy is one [R, B] block's, inside the 1/8)."""
    width = 128
    rng = np.random.default_rng(5)
    h_np, w_np, y_np = rng.standard_normal((MEM_N, width)), 0.5 * rng.standard_normal((MEM_V, width)), rng.integers(0, MEM_V, MEM_N)
    logits_bytes = MEM_N * MEM_V * 2
    vectors_bytes = 16 * MEM_N * 8
    hidden = torch.tensor(h_np, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.tensor(w_np, dtype=torch.bfloat16, requires_grad=True)

    def fused() -> None:
        torchloss.linear_cross_entropy(hidden, weight, torch.tensor(y_np), precision="tensor").backward()

    fused()  # warm-up
    peak = peak_extra(fused)
    assert peak <= logits_bytes / 8 + (MEM_N * width + MEM_V * width + MEM_V) * 6 + vectors_bytes, (peak, logits_bytes)
    step = jax.jit(jax.value_and_grad(lambda h, w: jaxloss.linear_cross_entropy(h, w, jnp.asarray(y_np, jnp.int32), precision="tensor"), argnums=(0, 1)))
    temp = int(step.lower(jnp.asarray(h_np, jnp.bfloat16), jnp.asarray(w_np, jnp.bfloat16)).compile().memory_analysis().temp_size_in_bytes)
    assert temp <= logits_bytes / 8 + (MEM_N * width + MEM_V * width) * 4 + vectors_bytes, (temp, logits_bytes)
