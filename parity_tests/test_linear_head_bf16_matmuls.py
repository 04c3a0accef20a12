"""The fused head's opt-in bf16 matmuls, against the float64 oracle on the CPU (and a GPU).

Opted in (off by default, docs/linear_head.md), both frameworks' head paths read bf16 hidden
states and weights as they are (fp32 results) and split the fp32 logits gradient ``G`` into
exact bf16 terms for the backward (``split_bf16``); otherwise they widen to fp32. These tests force the branch on the
CPU (``tuning=lossspec.HeadTuning(bf16_matmul_devices=("cpu", "cuda"))``; torch's
``mm_f32`` computes the same numbers there from exact upcasts); on a machine with a GPU the same
tests run there (torch tensors on CUDA, JAX's default device), the tensor-core matmuls
themselves. They check the *fp32* results of
``head_forward`` (before the gradients are rounded to bf16) against the oracle's float64 head
gradients with the fp32 bound: a split that rounds ``G`` (one or two terms) fails it.

On CUDA torch's bf16 matmuls are one Triton kernel (``torchloss.backends.triton_matmul``: tensor cores,
``G`` split in registers); the tests run it in the Triton interpreter on the CPU too, alone (its
products against exact ones) and inside the head (``HeadTuning.triton_matmul_devices``).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxloss.head as jax_linear
import lossspec
import torchloss.head as torch_linear
from jaxloss._block import KernelConfig
from lossspec import linear as spec_linear

from parity_tests.support.head_cases import H, HT, PLANS, V, block_budget, driver_reference, options_for, make_inputs


def _reference(kind: str, inputs: dict[str, Any], coef: np.ndarray, options: dict[str, Any]) -> tuple:
    """``(sum_i coef_i l_i, dh, dW, db)`` in float64."""
    per_token, g, h, w = driver_reference(kind, inputs, coef, options)
    return float(np.sum(per_token)), g @ w, g.T @ h, g.sum(axis=0)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _teacher(kind: str, inputs: dict[str, Any], n: int, bf: Any) -> Any:
    """The drivers' ``teacher`` argument: ``(hidden [N, Ht], weight, bias)`` in bf16, or ``None``."""
    if not lossspec.KIND_SPECS[kind].has_teacher:
        return None
    return bf(inputs["teacher_hidden"].reshape(n, HT)), bf(inputs["teacher_weight"]), bf(inputs["teacher_bias"])


def _run_torch(kind: str, inputs: dict[str, Any], coef: np.ndarray, options: dict[str, Any], tuning: lossspec.HeadTuning) -> tuple:
    bf = lambda a: torch.tensor(np.asarray(a, np.float32)).to(DEVICE, torch.bfloat16)  # noqa: E731  (exact)
    n = coef.size
    labels = torch.tensor(inputs["labels"].reshape(-1), device=DEVICE) if "labels" in inputs else None
    teacher = _teacher(kind, inputs, n, bf)
    out = torch_linear.head_forward(lossspec.make_config(kind, **options), bf(inputs["hidden"].reshape(n, H)), bf(inputs["weight"]),
                                    bf(inputs["bias"]), labels, teacher, torch.tensor(coef, device=DEVICE), need_grad=True,
                                    tuning=tuning)
    assert all(a.dtype == torch.float32 for a in out)
    return tuple(a.double().cpu().numpy() for a in out)


def _run_jax(kind: str, inputs: dict[str, Any], coef: np.ndarray, options: dict[str, Any], tuning: lossspec.HeadTuning) -> tuple:
    bf = lambda a: jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16)  # noqa: E731  (exact)
    n = coef.size
    cfg = KernelConfig.of(lossspec.make_config(kind, **options))
    labels = jnp.asarray(inputs["labels"].reshape(-1), jnp.int32) if "labels" in inputs else None
    teacher = _teacher(kind, inputs, n, bf)
    out = jax_linear.head_forward(cfg, bf(inputs["hidden"].reshape(n, H)), bf(inputs["weight"]), bf(inputs["bias"]), labels, teacher,
                                  jnp.asarray(coef), with_grad=True, tuning=tuning)
    assert all(a.dtype == jnp.float32 for a in out)
    return tuple(np.asarray(a, np.float64) for a in out)


# opt-in on every device (off by default: docs/linear_head.md)
GPU_BRANCH = {"bf16_matmul_devices": ("cpu", "cuda")}
# the Triton kernel on every device (the interpreter on the CPU)
TRITON_MATMULS = {"triton_matmul_devices": ("cpu", "cuda")}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", list(lossspec.HEAD_KINDS))
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_bf16_matmuls_match_the_oracle_in_fp32(framework: str, kind: str, plan: str) -> None:
    _check_head(framework, kind, block_budget(*PLANS[plan], **GPU_BRANCH))


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("kind", list(lossspec.HEAD_KINDS))
def test_triton_bf16_matmuls_match_the_oracle_in_fp32(kind: str, plan: str) -> None:
    tuning = block_budget(*PLANS[plan], **GPU_BRANCH, **TRITON_MATMULS)
    assert torch_linear._triton_matmuls(torch.device(DEVICE), tuning)
    _check_head("torch", kind, tuning)


def _check_head(framework: str, kind: str, tuning: lossspec.HeadTuning) -> None:
    inputs = make_inputs(kind, "bfloat16", seed=3)
    options = options_for(kind)
    if "labels" in inputs:
        inputs["labels"] = np.abs(inputs["labels"]) % V  # the drivers take safe labels
    coef = inputs["loss_mask"].reshape(-1).astype(np.float32)
    run = _run_torch if framework == "torch" else _run_jax
    loss, dh, dw, db = run(kind, inputs, coef, options, tuning)
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


def _matmul_inputs(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(g [m, k] fp32 over 60 binades, p [k, n] bf16, perm)``: ``p`` a signed permutation with
    power-of-two entries, so every exact product is an fp32 number and each output one product."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-20, 20, (m, k)))).astype(np.float32)
    perm = rng.permutation(k)[:n].tolist()
    p = np.zeros((k, n), np.float32)
    p[perm, np.arange(n)] = rng.choice([-4.0, -1.0, 0.5, 2.0], n)
    return torch.tensor(g, device=DEVICE), torch.tensor(p, device=DEVICE).bfloat16(), perm


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("terms", [1, 2, 3])
def test_triton_matmul_multiplies_fp32_exactly_as_three_bf16_terms(terms: int) -> None:
    # G [M, K] fp32 times a signed power-of-two permutation: every output is one product, exact
    # in fp32, so the kernel must return it bit for bit; a split into fewer terms rounds G. The
    # head's matmul (mm_f32) passes HeadTuning.split_terms (default 3) down to the kernel.
    tuning = lossspec.HeadTuning(split_terms=terms, **TRITON_MATMULS)
    assert torch_linear._triton_matmuls(torch.device(DEVICE), tuning)
    g, p, perm = _matmul_inputs(37, 45, 29, seed=1)
    want = g[:, perm] * p[perm, torch.arange(29)].float()
    got = torch_linear.mm_f32(g, p, tuning=tuning)
    assert torch.equal(got, want) == (terms == 3), (terms, (got - want).abs().max().item())
    # a transposed view of G (the weight gradient's G^T h), accumulated into a strided slice
    out = torch.full((64, 40), 7.0, device=DEVICE)
    g_t, p_t, perm_t = _matmul_inputs(45, 37, 29, seed=2)
    torch_linear.mm_f32(g_t.t().contiguous().t(), p_t, out[3:48, 5:34], accumulate=True, tuning=tuning)
    exact = g_t[:, perm_t].double() * p_t[perm_t, torch.arange(29)].double() + 7.0
    assert torch.equal(out[3:48, 5:34], exact.float()) == (terms == 3)
    assert bool((out[:3] == 7.0).all() and (out[48:] == 7.0).all() and (out[:, :5] == 7.0).all() and (out[:, 34:] == 7.0).all())


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("shape", [(37, 45, 29), (16, 100, 33), (5, 1, 3)])
def test_triton_matmul_bf16_products_are_accumulated_in_fp32(shape: tuple[int, int, int]) -> None:
    # Dense bf16 operands (every tile, ragged tails): within fp32 summation error of the exact
    # product, |C - AB| <= K 2^-24 |A| |B| elementwise (a bf16 rounding of anything is ~2^-9).
    from torchloss.backends import triton_matmul as _triton_matmul

    m, k, n = shape
    rng = np.random.default_rng(k)
    a = torch.tensor(rng.standard_normal((m, k)), dtype=torch.bfloat16, device=DEVICE)
    b = torch.tensor(rng.standard_normal((k, n)), dtype=torch.bfloat16, device=DEVICE)
    exact = a.double() @ b.double()
    bound = k * 2.0**-24 * (a.double().abs() @ b.double().abs())
    for got in (_triton_matmul.matmul_f32(a, b), _triton_matmul.matmul_f32(b.t(), a.t()).t()):
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert bool(((got.double() - exact).abs() <= bound).all()), ((got.double() - exact).abs() / bound).max().item()
    # runs give the same bits
    assert torch.equal(_triton_matmul.matmul_f32(a, b), _triton_matmul.matmul_f32(a, b))
