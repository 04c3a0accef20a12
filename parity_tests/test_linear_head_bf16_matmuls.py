"""The fused head's opt-in bf16 matmuls, against the float64 oracle on the CPU (and a GPU).

Opted in (off by default, docs/linear_head.md), both frameworks' head paths read bf16 hidden
states and weights as they are (fp32 results) and split the fp32 logits gradient ``G`` into
exact bf16 terms for the backward (``split_bf16``); otherwise they widen to fp32. These tests force the branch on the
CPU (``torchloss.linear.BF16_MATMUL_DEVICES``, ``jaxloss.linear.BF16_BACKWARD_PLATFORMS``; torch's
``mm_f32`` computes the same numbers there from exact upcasts); on a machine with a GPU the same
tests run there (torch tensors on CUDA, JAX's default device), the tensor-core matmuls
themselves. They check the *fp32* results of
``head_forward`` (before the gradients are rounded to bf16) against the oracle's float64 head
gradients with the fp32 bound: a split that rounds ``G`` (one or two terms) fails it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxloss.linear as jax_linear
import lossspec
import torchloss.linear as torch_linear
from jaxloss._stats import KernelConfig
from lossspec import linear as spec_linear

from test_linear_head import H, HT, PLANS, V, _options, make_inputs


def _reference(kind: str, inputs: dict[str, Any], coef: np.ndarray, options: dict[str, Any]) -> tuple:
    """``(sum_i coef_i l_i, dh, dW, db)`` in float64."""
    h = inputs["hidden"].reshape(-1, H).astype(np.float64)
    z = spec_linear.head_logits(h, inputs["weight"], inputs["bias"])
    if kind == "cross_entropy":
        target = inputs["labels"].reshape(-1)
    else:
        target = spec_linear.head_logits(inputs["teacher_hidden"].reshape(-1, HT), inputs["teacher_weight"], inputs["teacher_bias"])
    per_token, g = lossspec.oracle(kind, z, target, coef, normalization="none", **options)
    return float(np.sum(per_token)), g @ inputs["weight"].astype(np.float64), g.T @ h, g.sum(axis=0)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run_torch(kind: str, inputs: dict[str, Any], coef: np.ndarray, options: dict[str, Any], plan: tuple[int, int]) -> tuple:
    bf = lambda a: torch.tensor(np.asarray(a, np.float32)).to(DEVICE, torch.bfloat16)  # noqa: E731  (exact)
    n = coef.size
    labels = torch.tensor(inputs["labels"].reshape(-1), device=DEVICE) if kind == "cross_entropy" else None
    teacher = None if kind == "cross_entropy" else (bf(inputs["teacher_hidden"].reshape(n, HT)), bf(inputs["teacher_weight"]), bf(inputs["teacher_bias"]))
    out = torch_linear.head_forward(lossspec.make_config(kind, **options), bf(inputs["hidden"].reshape(n, H)), bf(inputs["weight"]),
                                    bf(inputs["bias"]), labels, teacher, torch.tensor(coef, device=DEVICE), need_grad=True,
                                    block_elements=plan[0], blocked_rows=plan[1])
    assert all(a.dtype == torch.float32 for a in out)
    return tuple(a.double().cpu().numpy() for a in out)


def _run_jax(kind: str, inputs: dict[str, Any], coef: np.ndarray, options: dict[str, Any], plan: tuple[int, int]) -> tuple:
    bf = lambda a: jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16)  # noqa: E731  (exact)
    n = coef.size
    config = lossspec.make_config(kind, **options)
    cfg = KernelConfig(kind=kind, scale=config.student_scale, teacher_scale=config.teacher_scale,
                       label_smoothing=config.label_smoothing, z_loss=config.z_loss)
    labels = jnp.asarray(inputs["labels"].reshape(-1), jnp.int32) if kind == "cross_entropy" else None
    teacher = None if kind == "cross_entropy" else (bf(inputs["teacher_hidden"].reshape(n, HT)), bf(inputs["teacher_weight"]), bf(inputs["teacher_bias"]))
    out = jax_linear.head_forward(cfg, bf(inputs["hidden"].reshape(n, H)), bf(inputs["weight"]), bf(inputs["bias"]), labels, teacher,
                                  jnp.asarray(coef), with_grad=True, block_elements=plan[0], blocked_rows=plan[1])
    assert all(a.dtype == jnp.float32 for a in out)
    return tuple(np.asarray(a, np.float64) for a in out)


@pytest.fixture
def gpu_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    # opt-in on every device (off by default: docs/linear_head.md)
    monkeypatch.setattr(torch_linear, "BF16_MATMUL_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(jax_linear, "BF16_BACKWARD_PLATFORMS", ("cpu", "cuda"))


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", list(lossspec.KINDS))
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_bf16_matmuls_match_the_oracle_in_fp32(gpu_branch: None, framework: str, kind: str, plan: str) -> None:
    inputs = make_inputs(kind, "bfloat16", seed=3)
    options = _options(kind)
    if kind == "cross_entropy":
        inputs["labels"] = np.abs(inputs["labels"]) % V  # the drivers take safe labels
    coef = inputs["loss_mask"].reshape(-1).astype(np.float32)
    run = _run_torch if framework == "torch" else _run_jax
    loss, dh, dw, db = run(kind, inputs, coef, options, PLANS[plan])
    ref_loss, ref_dh, ref_dw, ref_db = _reference(kind, inputs, coef, options)
    lossspec.compare_loss(float(np.sum(coef * loss)), ref_loss, f"{framework} bf16-matmul loss").check()
    for name, got, want in (("hidden", dh, ref_dh), ("weight", dw, ref_dw), ("bias", db, ref_db)):
        spec_linear.compare_head_grad(got, want, "float32", f"{framework} bf16-matmul grad {name}").check()


@pytest.mark.parametrize("terms", [1, 2, 3])
def test_split_bf16_is_exact_with_three_terms(terms: int) -> None:
    rng = np.random.default_rng(0)
    g = (rng.standard_normal(4096) * np.exp(rng.uniform(-30, 30, 4096))).astype(np.float32)
    for split, to_np in ((torch_linear.split_bf16, lambda a: a.float().numpy()), (jax_linear.split_bf16, lambda a: np.asarray(a, np.float32))):
        parts = split(torch.tensor(g) if split is torch_linear.split_bf16 else jnp.asarray(g), terms)
        total = np.sum([to_np(p).astype(np.float64) for p in parts], axis=0)
        error = np.max(np.abs(total - g) / np.abs(g))
        assert (error == 0.0) == (terms == 3), (terms, error)
