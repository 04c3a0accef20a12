"""docs/migrating.md, executed: every mapping row of the guide is one test here.

Each test computes the peer's formula as a float64 re-derivation (written from the peer's
documented math and its source's behaviour, never copied), checks ``torchloss`` (or ``jaxloss``)
with the mapped options against it at SPEC section 6's bounds, and then, where the peer installs
from the registry and runs on the CPU, checks the peer's own function against the same
re-derivation (so the re-derivation is the peer's formula). The peers live in the optional
``peers`` extra (``pip install -e '.[peers]'``); a test whose peer is absent skips with that
reason *after* its re-derivation checks have run. verl (its dependencies would replace the
tested ``transformers``) and Fast-LLM (not on PyPI) are checked against re-derivations only.

``test_guide_names_every_row_test`` keeps the guide and this file in step: every row of the
guide names its test, and every row test is named by the guide.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch

import lossspec
import torchloss

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "migrating.md"
B, T, V = 2, 5, 11
F64 = torch.float64


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def peer(module: str, reason: str = "") -> ModuleType:
    """The peer's module, or a skip naming why (called after the re-derivation checks)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        pytest.skip(f"{module} is not installed ({error}); install the peers extra, pip install -e '.[peers]'. {reason}"
                    "The re-derivation of its formula was checked above.")


def logits(*shape: int, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    """Seeded logits exactly representable in float32, as float64."""
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32).astype(np.float64)


def labels_with_ignored(seed: int = 1, ignore: int = -100) -> np.ndarray:
    """``[B, T]`` labels, a few of them ``ignore``."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, V, size=(B, T))
    y[0, 1] = y[1, 3] = ignore
    return y


def ours(fn: Callable[..., torch.Tensor], x: np.ndarray, *args: Any, **options: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(loss, d loss / d logits)`` of a ``torchloss`` function on float32 logits (a unit
    upstream gradient per element for ``"none"``)."""
    x32 = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    loss = fn(x32, *args, **options)
    loss.backward(torch.ones_like(loss))
    return loss.detach().double().numpy(), x32.grad.double().numpy()


def rederived(formula: Callable[..., torch.Tensor], x: np.ndarray, *args: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(loss, gradient)`` of a float64 re-derivation (autograd, a unit upstream gradient)."""
    x64 = torch.tensor(x, dtype=F64, requires_grad=True)
    loss = formula(x64, *args)
    loss.backward(torch.ones_like(loss))
    return loss.detach().numpy(), x64.grad.numpy()


def assert_within_spec(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray], g0: float, what: str) -> None:
    """SPEC section 6: the loss bound, and the fp32 gradient bound with the call's ``G0``."""
    lossspec.compare_loss(got[0], want[0], f"{what} loss").check()
    lossspec.compare_grad(got[1], want[1], "float32", g0, f"{what} grad").check()


def assert_peer_matches(value: Any, want: np.ndarray, what: str, rtol: float = 2e-5) -> None:
    """A peer's own result (often fp32 inside) against the float64 re-derivation."""
    got = value.detach().double().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value, np.float64)
    scale = float(np.max(np.abs(want))) if np.size(want) else 0.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(scale, 1e-12), err_msg=what)


def t(a: np.ndarray, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(a, dtype=dtype)


def ce_per_token(x: torch.Tensor, y: torch.Tensor, ignore: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain cross-entropy per token (0 where ignored) and the valid mask, float64."""
    valid = y != ignore
    nll = -torch.gather(torch.log_softmax(x, -1), -1, torch.where(valid, y, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, nll, 0.0), valid.to(x.dtype)


def log_softmax(x: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.log_softmax(t(x, dtype), -1)


# --------------------------------------------------------------------------------------------
# Liger Kernel (liger-kernel==0.8.5; its Triton kernels run in the Triton interpreter on a CPU)
# --------------------------------------------------------------------------------------------

LIGER_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _liger_needs_gpu(kernel: str) -> None:
    """Skip (after the re-derivation checks) where a Liger kernel cannot run in the interpreter."""
    if LIGER_DEVICE == "cpu":
        pytest.skip(f"Liger 0.8.5's {kernel} kernel calls .to() on a Python float argument, which the Triton "
                    "interpreter rejects; it runs on a GPU only. The re-derivation of its formula was checked above.")


def _liger_ce(x: np.ndarray, y: np.ndarray, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's cross-entropy on fp32 logits: ``(loss, d loss / d logits)``."""
    functional = peer("liger_kernel.transformers.functional")
    leaf = torch.tensor(x.reshape(-1, V), dtype=torch.float32, device=LIGER_DEVICE, requires_grad=True)
    if "weight" in kwargs:
        kwargs["weight"] = kwargs["weight"].to(LIGER_DEVICE)
    loss = functional.liger_cross_entropy(leaf, torch.tensor(y.reshape(-1), device=LIGER_DEVICE), **kwargs)
    loss.backward(torch.ones_like(loss))
    return loss.detach().cpu(), leaf.grad.cpu().reshape(x.shape)


@pytest.mark.slow
@pytest.mark.parametrize("reduction,normalization", [("mean", "valid_tokens"), ("sum", "sum"), ("none", "none")])
def test_liger_reduction(reduction: str, normalization: str) -> None:
    x, y = logits(B, T, V), labels_with_ignored()
    reduce = {"mean": lambda l, m: l.sum() / m.sum(), "sum": lambda l, m: l.sum(), "none": lambda l, m: l}[reduction]
    want = rederived(lambda z: reduce(*ce_per_token(z, t(y, torch.long))), x)
    got = ours(torchloss.cross_entropy, x, torch.tensor(y), normalization=normalization)
    assert_within_spec(got, want, 1.0 / (8.0 if reduction == "mean" else 1.0), f"liger {reduction}")
    loss, grad = _liger_ce(x, y, reduction=reduction)
    assert_peer_matches(loss.reshape(want[0].shape), want[0], "liger loss")
    assert_peer_matches(grad, want[1], "liger grad")


@pytest.mark.slow
def test_liger_class_weight() -> None:
    x, y = logits(B, T, V, seed=2), labels_with_ignored(seed=3)
    weight = np.linspace(0.5, 2.0, V)
    per_token_weight = np.where(y != -100, weight[np.where(y != -100, y, 0)], 0.0)

    def formula(z: torch.Tensor) -> torch.Tensor:
        nll, _ = ce_per_token(z, t(y, torch.long))
        return (t(per_token_weight) * nll).sum() / per_token_weight.sum()

    want = rederived(formula, x)
    got = ours(torchloss.cross_entropy, x, torch.tensor(y), torch.tensor(per_token_weight, dtype=torch.float32))
    assert_within_spec(got, want, 2.0 / per_token_weight.sum(), "loss_mask=weight[labels]")
    _liger_needs_gpu("weighted cross-entropy")
    loss, grad = _liger_ce(x, y, weight=torch.tensor(weight, dtype=torch.float32))
    assert_peer_matches(loss, want[0], "liger weighted loss")
    assert_peer_matches(grad, want[1], "liger weighted grad")


@pytest.mark.slow
def test_liger_smoothing_and_z_loss() -> None:
    x, y = logits(B, T, V, seed=4), labels_with_ignored(seed=5)
    eps, lam = 0.1, 1e-2

    def formula(z: torch.Tensor) -> torch.Tensor:
        nll, valid = ce_per_token(z, t(y, torch.long))
        lse = torch.logsumexp(z, -1)
        smooth = lse - z.mean(-1)
        per_token = (1 - eps) * nll + eps * smooth + lam * lse**2
        return (per_token * valid).sum() / valid.sum()

    want = rederived(formula, x)
    got = ours(torchloss.cross_entropy, x, torch.tensor(y), label_smoothing=eps, z_loss=lam)
    assert_within_spec(got, want, 1.0 / 8.0, "label_smoothing, z_loss")
    loss, grad = _liger_ce(x, y, label_smoothing=eps, lse_square_scale=lam)
    assert_peer_matches(loss, want[0], "liger smoothing + z-loss loss")
    assert_peer_matches(grad, want[1], "liger smoothing + z-loss grad")


def _forward_kl_elementwise(z: torch.Tensor, teacher: np.ndarray) -> torch.Tensor:
    """``p (log p - log q)`` per element, float64 (``z`` the student logits)."""
    log_p = torch.log_softmax(t(teacher), -1)
    return log_p.exp() * (log_p - torch.log_softmax(z, -1))


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["mean", "batchmean", "sum"])
def test_liger_kl_div(reduction: str) -> None:
    x, teacher = logits(B * T, V, seed=6), logits(B * T, V, seed=7)
    n = B * T
    denominator = {"mean": n * V, "batchmean": n, "sum": 1}[reduction]
    want = rederived(lambda z: _forward_kl_elementwise(z, teacher).sum() / denominator, x)
    got = ours(torchloss.forward_kl, x, torch.tensor(teacher, dtype=torch.float32), normalization="sum", denominator=float(denominator))
    assert_within_spec(got, want, 1.0 / denominator, f"liger kl_div {reduction}")
    functional = peer("liger_kernel.transformers.functional")
    _liger_needs_gpu("kl_div")
    # Liger's KL takes log-probabilities as its leaves: the gradient w.r.t. the logits follows
    # through log_softmax.
    leaf = torch.tensor(x, dtype=torch.float32, device=LIGER_DEVICE, requires_grad=True)
    target = log_softmax(teacher).to(LIGER_DEVICE)
    loss = functional.liger_kl_div(torch.log_softmax(leaf, -1), target, reduction=reduction, log_target=True)
    loss.backward()
    assert_peer_matches(loss.cpu(), want[0], "liger kl_div loss")
    assert_peer_matches(leaf.grad.cpu(), want[1], "liger kl_div grad")


@pytest.mark.slow
def test_liger_kl_div_none_is_elementwise() -> None:
    x, teacher = logits(B * T, V, seed=8), logits(B * T, V, seed=9)
    want = rederived(lambda z: _forward_kl_elementwise(z, teacher).sum(-1), x)
    got = ours(torchloss.forward_kl, x, torch.tensor(teacher, dtype=torch.float32), normalization="none")
    assert_within_spec(got, want, 1.0, "per-token forward KL")
    functional = peer("liger_kernel.transformers.functional")
    _liger_needs_gpu("kl_div")
    elementwise = functional.liger_kl_div(log_softmax(x).to(LIGER_DEVICE), log_softmax(teacher).to(LIGER_DEVICE), reduction="none", log_target=True)
    assert tuple(elementwise.shape) == (B * T, V)  # per element, not per token
    assert_peer_matches(elementwise.sum(-1).cpu(), want[0], "liger kl_div none, summed over V")


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_liger_jsd(beta: float) -> None:
    x, teacher = logits(B * T, V, seed=10), logits(B * T, V, seed=11)
    y = labels_with_ignored(seed=12).reshape(-1)
    valid = y != -100

    def formula(z: torch.Tensor) -> torch.Tensor:
        log_q, log_p = torch.log_softmax(z, -1), torch.log_softmax(t(teacher), -1)
        kl_pq = (log_p.exp() * (log_p - log_q)).sum(-1)
        kl_qp = (log_q.exp() * (log_q - log_p)).sum(-1)
        if beta == 0.0:
            per_token = kl_pq
        elif beta == 1.0:
            per_token = kl_qp
        else:
            log_m = torch.logsumexp(torch.stack([log_p + np.log(beta), log_q + np.log1p(-beta)]), 0)
            per_token = beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)
        return (per_token * t(valid.astype(np.float64))).sum() / valid.sum()

    want = rederived(formula, x)
    got = ours(torchloss.jensen_shannon, x, torch.tensor(teacher, dtype=torch.float32), torch.tensor(valid), beta=beta)
    assert_within_spec(got, want, 1.0 / valid.sum(), f"jensen_shannon beta={beta}")
    functional = peer("liger_kernel.transformers.functional")
    leaf = torch.tensor(x, dtype=torch.float32, device=LIGER_DEVICE, requires_grad=True)
    loss = functional.liger_jsd(torch.log_softmax(leaf, -1), log_softmax(teacher).to(LIGER_DEVICE), torch.tensor(y, device=LIGER_DEVICE), beta=beta)
    loss.backward()
    assert_peer_matches(loss.cpu(), want[0], "liger jsd loss")
    assert_peer_matches(leaf.grad.cpu(), want[1], "liger jsd grad")


# --------------------------------------------------------------------------------------------
# Cut Cross-Entropy (cut-cross-entropy==25.1.1; its torch path, torch.compile on the CPU)
# --------------------------------------------------------------------------------------------

H = 6


def _head_inputs(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((B, T, H)).astype(np.float32).astype(np.float64)
    weight = (0.7 * rng.standard_normal((V, H))).astype(np.float32).astype(np.float64)
    y = rng.integers(0, V, size=(B, T))
    y[0, 2] = y[1, 4] = -100
    return hidden, weight, y


def _ours_head(hidden: np.ndarray, weight: np.ndarray, y: np.ndarray, **options: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    h = torch.tensor(hidden, dtype=torch.float32, requires_grad=True)
    w = torch.tensor(weight, dtype=torch.float32, requires_grad=True)
    loss = torchloss.linear_cross_entropy(h, w, torch.tensor(y), **options)
    loss.backward(torch.ones_like(loss))
    return loss.detach().double().numpy(), h.grad.double().numpy(), w.grad.double().numpy()


def _cce_formula(h: torch.Tensor, w: torch.Tensor, y: np.ndarray, reduction: str) -> torch.Tensor:
    """CCE with ``shift=True``: position t against target t+1, ``[.., T-1]`` for ``none``."""
    nll, valid = ce_per_token(h[:, :-1] @ w.T, t(y[:, 1:], torch.long))
    return {"mean": lambda: nll.sum() / valid.sum(), "sum": lambda: nll.sum(), "none": lambda: nll}[reduction]()


def _cce_peer(hidden: np.ndarray, weight: np.ndarray, y: np.ndarray, reduction: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cce = peer("cut_cross_entropy")
    h = torch.tensor(hidden, dtype=torch.float32, requires_grad=True)
    w = torch.tensor(weight, dtype=torch.float32, requires_grad=True)
    # CCE's CPU implementation is plain torch under torch.compile: run eagerly (its own code and
    # formula; Inductor's first compile of it took ~20 s of the suite), since the claims checked
    # here are its semantics (shift, reduction, ignore_index), not Inductor's kernels.
    with torch.compiler.set_stance("force_eager"):
        loss = cce.linear_cross_entropy(h, w, torch.tensor(y), shift=True, reduction=reduction, impl="torch_compile")
    loss.backward(torch.ones_like(loss))
    return loss.detach(), h.grad, w.grad


@pytest.mark.slow
@pytest.mark.parametrize("reduction,normalization", [("mean", "valid_tokens"), ("sum", "sum")])
def test_cce_shift(reduction: str, normalization: str) -> None:
    hidden, weight, y = _head_inputs(13)
    h64, w64 = t(hidden).requires_grad_(True), t(weight).requires_grad_(True)
    ref = _cce_formula(h64, w64, y, reduction)
    ref.backward()
    loss, dh, dw = _ours_head(hidden, weight, y, causal_shift=True, normalization=normalization)
    lossspec.compare_loss(loss, ref.item()).check()
    lossspec.linear.compare_head_grad(dh, h64.grad.numpy(), "float32", "dh").check()
    lossspec.linear.compare_head_grad(dw, w64.grad.numpy(), "float32", "dW").check()
    peer_loss, peer_dh, peer_dw = _cce_peer(hidden, weight, y, reduction)
    assert_peer_matches(peer_loss, ref.item(), "cce loss")
    assert_peer_matches(peer_dh, h64.grad.numpy(), "cce dh")
    assert_peer_matches(peer_dw, w64.grad.numpy(), "cce dW")


@pytest.mark.slow
def test_cce_shift_none() -> None:
    hidden, weight, y = _head_inputs(14)
    ref = _cce_formula(t(hidden), t(weight), y, "none").numpy()  # [B, T-1]
    loss, _, _ = _ours_head(hidden, weight, y, causal_shift=True, normalization="none")
    assert loss.shape == (B, T) and np.all(loss[:, -1] == 0.0)  # ours: [B, T], a zero at the end
    lossspec.compare_loss(loss[:, :-1], ref).check()
    peer_loss, _, _ = _cce_peer(hidden, weight, y, "none")
    assert tuple(peer_loss.shape) == (B, T - 1)
    assert_peer_matches(peer_loss, ref, "cce none")


def test_cce_shift_by_k() -> None:
    """A shift by ``k > 1`` (newer CCE versions' integer ``shift``; 25.1.1 has only ``True``):
    labels shifted by hand, ``"sum"`` with ``denominator=`` the number of scored positions
    ``B (T - k)`` (CCE's mean when no target is ignored). Re-derivation only."""
    k = 2
    hidden, weight, _ = _head_inputs(15)
    y = np.random.default_rng(16).integers(0, V, size=(B, T))
    h64, w64 = t(hidden).requires_grad_(True), t(weight).requires_grad_(True)
    nll, _ = ce_per_token(h64[:, :-k] @ w64.T, t(y[:, k:], torch.long))
    ref = nll.mean()
    ref.backward()
    shifted = np.concatenate([y[:, k:], np.full((B, k), -100)], axis=1)
    loss, dh, dw = _ours_head(hidden, weight, shifted, normalization="sum", denominator=float(B * (T - k)))
    lossspec.compare_loss(loss, ref.item()).check()
    lossspec.linear.compare_head_grad(dh, h64.grad.numpy(), "float32", "dh").check()
    lossspec.linear.compare_head_grad(dw, w64.grad.numpy(), "float32", "dW").check()


@pytest.mark.slow
def test_cce_all_ignored_mean() -> None:
    hidden, weight, _ = _head_inputs(17)
    y = np.full((B, T), -100)
    loss, dh, dw = _ours_head(hidden, weight, y, causal_shift=True)
    assert loss == 0.0 and not dh.any() and not dw.any()  # D == 0: loss 0, gradient 0
    peer_loss, _, _ = _cce_peer(hidden, weight, y, "mean")
    assert torch.isnan(peer_loss)  # CCE's torch path: the mean of nothing


# --------------------------------------------------------------------------------------------
# TRL (trl==1.16.0: GKDTrainer.generalized_jsd_loss; GRPO's aggregation re-derived)
# --------------------------------------------------------------------------------------------


def _gkd() -> Callable[..., torch.Tensor]:
    module = peer("trl.experimental.gkd.gkd_trainer")
    return module.GKDTrainer.generalized_jsd_loss


def _jsd_rows(z: torch.Tensor, teacher: np.ndarray, beta: float, temperature: float = 1.0) -> torch.Tensor:
    """Generalised JSD per token (``M = beta p + (1 - beta) q``), float64."""
    log_q, log_p = torch.log_softmax(z / temperature, -1), torch.log_softmax(t(teacher) / temperature, -1)
    log_m = torch.logsumexp(torch.stack([log_p + np.log(beta), log_q + np.log1p(-beta)]), 0)
    return beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)


@pytest.mark.parametrize("with_labels", [True, False])
def test_trl_gkd_batchmean(with_labels: bool) -> None:
    beta = 0.4
    x, teacher = logits(B, T, V, seed=18), logits(B, T, V, seed=19)
    y = labels_with_ignored(seed=20)
    valid = (y != -100) if with_labels else np.ones((B, T), bool)
    denominator = valid.sum() if with_labels else B  # batchmean: the valid tokens, or the rows
    want = rederived(lambda z: (_jsd_rows(z, teacher, beta) * t(valid.astype(np.float64))).sum() / denominator, x)
    normalization = "valid_tokens" if with_labels else "sequence_sum"
    got = ours(torchloss.jensen_shannon, x, torch.tensor(teacher, dtype=torch.float32), torch.tensor(valid) if with_labels else None,
               beta=beta, normalization=normalization)
    assert_within_spec(got, want, 1.0 / denominator, f"GKD batchmean labels={with_labels}")
    leaf = t(x).requires_grad_(True)
    loss = _gkd()(leaf, t(teacher), labels=torch.tensor(y) if with_labels else None, beta=beta, reduction="batchmean")
    loss.backward()
    assert_peer_matches(loss, want[0], "GKD loss", rtol=1e-9)
    assert_peer_matches(leaf.grad, want[1], "GKD grad", rtol=1e-9)


def test_trl_gkd_temperature() -> None:
    """The loss's ``temperature`` divides both logits (our ``temperature=``, no ``T**2``);
    ``GKDTrainer.compute_loss`` does not pass its ``temperature``, so the trainer's loss is
    ``temperature=1``."""
    beta, temperature = 0.5, 2.0
    x, teacher = logits(B, T, V, seed=21), logits(B, T, V, seed=22)
    y = labels_with_ignored(seed=23)
    valid = y != -100
    for temp in (temperature, 1.0):
        want = rederived(lambda z: (_jsd_rows(z, teacher, beta, temp) * t(valid.astype(np.float64))).sum() / valid.sum(), x)
        got = ours(torchloss.jensen_shannon, x, torch.tensor(teacher, dtype=torch.float32), torch.tensor(valid), beta=beta, temperature=temp)
        assert_within_spec(got, want, 1.0 / valid.sum() / temp, f"GKD temperature={temp}")
    gkd_module = peer("trl.experimental.gkd.gkd_trainer")
    # the guide's claim: the trainer's call of the loss passes no temperature (its default, 1, applies)
    assert "temperature" not in inspect.getsource(gkd_module.GKDTrainer.compute_loss).split("generalized_jsd_loss(")[1].split(")")[0]
    leaf = t(x).requires_grad_(True)
    loss = _gkd()(leaf, t(teacher), labels=torch.tensor(y), beta=beta, temperature=temperature)
    want = rederived(lambda z: (_jsd_rows(z, teacher, beta, temperature) * t(valid.astype(np.float64))).sum() / valid.sum(), x)
    assert_peer_matches(loss, want[0], "GKD loss at T=2", rtol=1e-9)


def test_trl_gkd_num_items_in_batch() -> None:
    beta, num_items = 0.5, 37.0  # the valid tokens of the whole accumulated step
    x, teacher = logits(B, T, V, seed=24), logits(B, T, V, seed=25)
    y = labels_with_ignored(seed=26)
    valid = y != -100
    want = rederived(lambda z: (_jsd_rows(z, teacher, beta) * t(valid.astype(np.float64))).sum() / num_items, x)
    got = ours(torchloss.jensen_shannon, x, torch.tensor(teacher, dtype=torch.float32), torch.tensor(valid), beta=beta, denominator=num_items)
    assert_within_spec(got, want, 1.0 / num_items, "GKD num_items_in_batch")
    loss = _gkd()(t(x), t(teacher), labels=torch.tensor(y), beta=beta, num_items_in_batch=torch.tensor(num_items))
    assert_peer_matches(loss, want[0], "GKD num_items_in_batch", rtol=1e-9)


def _grpo_problem() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Completions as rows (per-token cross-entropy as the per-token loss), one of them empty."""
    x = logits(3, T, V, seed=27)
    y = np.random.default_rng(28).integers(0, V, size=(3, T))
    mask = np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    return x, y, mask


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_grpo_loss_types(loss_type: str) -> None:
    """TRL's GRPO aggregations on one micro-batch (re-derived from ``GRPOTrainer._compute_loss``
    of trl 1.16.0; a trainer method, so not called). ``grpo`` averages over every row, the empty
    completion included: ``sequence_mean`` with ``denominator=`` the rows."""
    x, y, mask = _grpo_problem()
    rows, max_completion_length, num_items = 3, T, 8.0
    m = mask.astype(np.float64)

    def formula(z: torch.Tensor) -> torch.Tensor:
        per_token = ce_per_token(z, t(y, torch.long))[0] * t(m)
        if loss_type == "grpo":
            return (per_token.sum(-1) / t(m.sum(-1)).clamp(min=1.0)).mean()
        if loss_type == "bnpo":
            return per_token.sum() / max(m.sum(), 1.0)
        if loss_type == "dr_grpo":
            return per_token.sum() / (rows * max_completion_length)
        return per_token.sum() / num_items  # dapo: num_items_in_batch / num_processes, one process

    options = {
        "grpo": dict(normalization="sequence_mean", denominator=float(rows)),
        "bnpo": dict(normalization="valid_tokens"),
        "dr_grpo": dict(normalization="sum", denominator=float(rows * max_completion_length)),
        "dapo": dict(normalization="valid_tokens", denominator=num_items),
    }[loss_type]
    want = rederived(formula, x)
    got = ours(torchloss.cross_entropy, x, torch.tensor(y), torch.tensor(mask), **options)
    assert_within_spec(got, want, 1.0, f"TRL {loss_type}")


# --------------------------------------------------------------------------------------------
# verl (agg_loss re-derived: verl's dependencies would replace the tested transformers)
# --------------------------------------------------------------------------------------------


def _verl_problem() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Responses as rows, one empty (a response with no scored token)."""
    x = logits(4, T, V, seed=29)
    y = np.random.default_rng(30).integers(0, V, size=(4, T))
    mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]], bool)
    return x, y, mask


def _verl_agg(per_token: torch.Tensor, mask: np.ndarray, mode: str, version: str, dp_size: int = 1,
              batch_num_tokens: Optional[float] = None, global_batch_size: Optional[float] = None) -> torch.Tensor:
    """verl's ``agg_loss``: ``version="current"`` (after the change of 2025-10-28, e.g. 0.9.1:
    seq-mean modes over the non-empty rows, global counts / dp_size) or ``"before"``."""
    m = t(mask.astype(np.float64))
    token_sum = (per_token * m).sum(-1)
    counts = m.sum(-1)
    if version == "before":
        if mode == "token-mean":
            return (per_token * m).sum() / m.sum()
        if mode == "seq-mean-token-sum":
            return token_sum.mean()
        if mode == "seq-mean-token-mean":
            return (token_sum / counts).mean()  # NaN with an empty row
        return token_sum.sum() / mask.shape[-1]
    if mode == "token-mean":
        tokens = m.sum() if batch_num_tokens is None else batch_num_tokens
        return (per_token * m).sum() / tokens * dp_size
    nonempty = (counts > 0).to(F64)
    rows = nonempty.sum() if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-mean":
        return ((token_sum / (counts + 1e-8)) * nonempty).sum() / rows * dp_size
    loss = (token_sum * nonempty).sum() / rows * dp_size
    return loss / mask.shape[-1] if mode == "seq-mean-token-sum-norm" else loss


VERL_ROWS = {
    # (mode, version, verl's global arguments): our options
    ("token-mean", "current", "local"): dict(normalization="valid_tokens"),
    ("token-mean", "current", "global"): dict(normalization="valid_tokens", denominator=25.0 / 2),
    ("seq-mean-token-sum", "current", "local"): dict(normalization="sequence_sum"),
    ("seq-mean-token-sum", "current", "global"): dict(normalization="sequence_sum", denominator=6.0 / 2),
    ("seq-mean-token-mean", "current", "local"): dict(normalization="sequence_mean"),
    ("seq-mean-token-mean", "current", "global"): dict(normalization="sequence_mean", denominator=6.0 / 2),
    ("seq-mean-token-sum-norm", "current", "local"): dict(normalization="sum", denominator=3.0 * T),
    ("seq-mean-token-sum-norm", "current", "global"): dict(normalization="sequence_sum", denominator=6.0 / 2 * T),
    ("token-mean", "before", "local"): dict(normalization="valid_tokens"),
    ("seq-mean-token-sum", "before", "local"): dict(normalization="sequence_sum", denominator=4.0),
    ("seq-mean-token-sum-norm", "before", "local"): dict(normalization="sum", denominator=float(T)),
}


@pytest.mark.parametrize("mode,version,scope", list(VERL_ROWS))
def test_verl_agg_loss(mode: str, version: str, scope: str) -> None:
    """``global``: this rank's micro-batch of a step over dp_size=2 ranks holding 25 valid
    tokens and 6 non-empty responses in all (verl's ``batch_num_tokens`` / ``global_batch_size``)."""
    x, y, mask = _verl_problem()
    extra = dict(dp_size=2, batch_num_tokens=25.0, global_batch_size=6.0) if scope == "global" else {}
    want = rederived(lambda z: _verl_agg(ce_per_token(z, t(y, torch.long))[0], mask, mode, version, **extra), x)
    got = ours(torchloss.cross_entropy, x, torch.tensor(y), torch.tensor(mask), **VERL_ROWS[(mode, version, scope)])
    assert_within_spec(got, want, 1.0, f"verl {mode} ({version}, {scope})")


def test_verl_seq_mean_token_mean_before_empty_row() -> None:
    """Before 2025-10-28 verl's ``seq-mean-token-mean`` is NaN with an empty response (0/0)
    and otherwise ``sequence_mean``; ours skips empty rows."""
    x, y, mask = _verl_problem()
    with torch.no_grad():
        assert torch.isnan(_verl_agg(ce_per_token(t(x), t(y, torch.long))[0], mask, "seq-mean-token-mean", "before"))
    full = mask[[0, 1, 3]]
    want = rederived(lambda z: _verl_agg(ce_per_token(z, t(y[[0, 1, 3]], torch.long))[0], full, "seq-mean-token-mean", "before"), x[[0, 1, 3]])
    got = ours(torchloss.cross_entropy, x[[0, 1, 3]], torch.tensor(y[[0, 1, 3]]), torch.tensor(full), normalization="sequence_mean")
    assert_within_spec(got, want, 1.0, "verl seq-mean-token-mean before, no empty row")


# --------------------------------------------------------------------------------------------
# Fast-LLM (not on PyPI: re-derivations of its documented behaviour)
# --------------------------------------------------------------------------------------------


def test_fast_llm_teacher_temperature() -> None:
    """Fast-LLM's distillation temperature ``T`` divides only the teacher's logits (its logits
    scale ``s`` both): ``logit_scale=s, teacher_logit_scale=s/T, temperature=1``."""
    s, temperature = 1.5, 2.0
    x, teacher = logits(B * T, V, seed=31), logits(B * T, V, seed=32)

    def formula(z: torch.Tensor) -> torch.Tensor:
        log_p = torch.log_softmax(t(teacher) * s / temperature, -1)
        return (-(log_p.exp() * torch.log_softmax(z * s, -1)).sum(-1)).mean()

    want = rederived(formula, x)
    got = ours(torchloss.soft_cross_entropy, x, torch.tensor(teacher, dtype=torch.float32), logit_scale=s,
               teacher_logit_scale=s / temperature, temperature=1.0)
    assert_within_spec(got, want, s / (B * T), "Fast-LLM teacher-only temperature")


def test_fast_llm_global_document_ids() -> None:
    """Fast-LLM's document ids number documents across the whole batch (a document may
    continue in the next row); ours are per row: flatten the rows into one first."""
    x = logits(B, T, V, seed=33)
    y = np.random.default_rng(34).integers(0, V, size=(B, T))
    documents = np.array([[0, 0, 1, 1, 1], [1, 1, 2, 2, 2]])  # document 1 spans both rows

    def formula(z: torch.Tensor) -> torch.Tensor:
        nll = ce_per_token(z.reshape(B * T, V), t(y.reshape(-1), torch.long))[0]
        ids = documents.reshape(-1)
        return sum(nll[ids == d].mean() for d in np.unique(ids)) / len(np.unique(ids))

    want = rederived(formula, x)
    got = ours(lambda z, *a, **k: torchloss.cross_entropy(z.reshape(1, B * T, V), *a, **k), x,
               torch.tensor(y.reshape(1, -1)), segment_ids=torch.tensor(documents.reshape(1, -1)), normalization="sequence_mean")
    assert_within_spec(got, want, 1.0, "Fast-LLM global document ids")


def test_fast_llm_negative_labels() -> None:
    """Fast-LLM masks every negative label (not one ``ignore_index``): ``loss_mask=labels >= 0``."""
    x = logits(B, T, V, seed=35)
    y = np.random.default_rng(36).integers(0, V, size=(B, T))
    y[0, 0], y[1, 2], y[1, 4] = -100, -1, -7
    want = rederived(lambda z: ce_per_token(z, t(np.where(y >= 0, y, -100), torch.long))[0].sum() / (y >= 0).sum(), x)
    got = ours(torchloss.cross_entropy, x, torch.tensor(np.where(y >= 0, y, 0)), torch.tensor(y >= 0))
    assert_within_spec(got, want, 1.0 / (y >= 0).sum(), "Fast-LLM negative labels")


@pytest.mark.parametrize("where", ["tests", "model"])
def test_fast_llm_normalisation(where: str) -> None:
    """Fast-LLM's own tests average over every position (``"tokens"``); its model divides by the
    number of labels in the batch (``"valid_tokens"`` with that count as ``denominator=``)."""
    x = logits(B, T, V, seed=37)
    y = labels_with_ignored(seed=38)
    valid = y >= 0
    denominator = B * T if where == "tests" else float(valid.sum())
    want = rederived(lambda z: ce_per_token(z, t(y, torch.long))[0].sum() / denominator, x)
    options = dict(normalization="tokens") if where == "tests" else dict(normalization="valid_tokens", denominator=denominator)
    got = ours(torchloss.cross_entropy, x, torch.tensor(y), **options)
    assert_within_spec(got, want, 1.0 / denominator, f"Fast-LLM {where}")


# --------------------------------------------------------------------------------------------
# Hugging Face transformers and optax
# --------------------------------------------------------------------------------------------


def test_hf_for_causal_lm_loss() -> None:
    """``model.loss_function = torchloss.hf.for_causal_lm_loss`` (docs/huggingface.md), against
    transformers' own ``ForCausalLMLoss`` (the dev extra's transformers==5.23.0)."""
    loss_utils = peer("transformers.loss.loss_utils")
    x = logits(B, T, V, seed=39)
    y = labels_with_ignored(seed=40)
    leaf = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    loss = torchloss.hf.for_causal_lm_loss(leaf, torch.tensor(y), V, num_items_in_batch=torch.tensor(9))
    loss.backward()
    theirs = t(x).requires_grad_(True)
    ref = loss_utils.ForCausalLMLoss(theirs, torch.tensor(y), V, num_items_in_batch=torch.tensor(9))
    ref.backward()
    # transformers computes in fp32 (logits.float()); both within SPEC's bounds of each other
    lossspec.compare_loss(loss.item(), ref.item()).check()
    lossspec.compare_grad(leaf.grad.numpy(), theirs.grad.numpy(), "float32", 1.0 / 9).check()


@pytest.mark.parametrize("row", ["integer_labels", "soft_targets", "kl_divergence"])
def test_optax_per_token(row: str) -> None:
    """optax's per-token losses are ``normalization="none"`` of jaxloss (masks by hand there)."""
    import jax
    import jax.numpy as jnp

    optax = peer("optax")
    import jaxloss

    x, teacher = logits(B * T, V, seed=41).astype(np.float32), logits(B * T, V, seed=42).astype(np.float32)
    y = np.random.default_rng(43).integers(0, V, size=(B * T,))
    p = jax.nn.softmax(jnp.asarray(teacher))
    theirs = {
        "integer_labels": lambda z: optax.softmax_cross_entropy_with_integer_labels(z, jnp.asarray(y)),
        "soft_targets": lambda z: optax.softmax_cross_entropy(z, p),
        "kl_divergence": lambda z: optax.kl_divergence(jax.nn.log_softmax(z), p),
    }[row]
    ours_fn = {
        "integer_labels": lambda z: jaxloss.cross_entropy(z, jnp.asarray(y), normalization="none"),
        "soft_targets": lambda z: jaxloss.soft_cross_entropy(z, jnp.asarray(teacher), normalization="none"),
        "kl_divergence": lambda z: jaxloss.forward_kl(z, jnp.asarray(teacher), normalization="none"),
    }[row]
    got = jax.value_and_grad(lambda z: jnp.sum(ours_fn(z)))(jnp.asarray(x))
    per_token = ours_fn(jnp.asarray(x))
    if row == "integer_labels":
        want = rederived(lambda z: ce_per_token(z, t(y, torch.long))[0], x.astype(np.float64))
    elif row == "soft_targets":
        want = rederived(lambda z: -(torch.softmax(t(teacher), -1) * torch.log_softmax(z, -1)).sum(-1), x.astype(np.float64))
    else:
        want = rederived(lambda z: _forward_kl_elementwise(z, teacher.astype(np.float64)).sum(-1), x.astype(np.float64))
    assert_within_spec((np.asarray(per_token, np.float64), np.asarray(got[1], np.float64)), want, 1.0, f"optax {row}")
    assert_peer_matches(theirs(jnp.asarray(x)), want[0], f"optax {row}")


# --------------------------------------------------------------------------------------------
# The fused head's module knobs are tuning=lossspec.HeadTuning(...)
# --------------------------------------------------------------------------------------------

# removed (module, global) -> the HeadTuning field that replaces it (docs/migrating.md)
HEAD_KNOBS = {
    ("jaxloss.head", "BLOCK_ELEMENTS"): "block_elements", ("torchloss.head", "BLOCK_ELEMENTS"): "block_elements",
    ("jaxloss.head", "BLOCKED_ROWS"): "blocked_rows", ("torchloss.head", "BLOCKED_ROWS"): "blocked_rows",
    ("jaxloss.head", "RECOMPUTE_PLAN"): "recompute_plan", ("torchloss.head", "RECOMPUTE_PLAN"): "recompute_plan",
    ("jaxloss.head", "BF16_BACKWARD_PLATFORMS"): "bf16_matmul_devices", ("torchloss.head", "BF16_MATMUL_DEVICES"): "bf16_matmul_devices",
    ("torchloss.head", "TRITON_MATMUL_DEVICES"): "triton_matmul_devices",
}
# the tile fields of the retired head kernels (jaxloss.backends.pallas_head, torchloss.backends.triton_head)
RETIRED_HEAD_FIELDS = {"block_rows", "block_vocab", "block_hidden", "num_warps", "num_stages", "interpret"}


def test_head_knobs_are_head_tuning_fields() -> None:
    """Each removed global is gone (no alias) and its ``lossspec.HeadTuning`` field exists;
    ``HEAD_SPLIT_TERMS`` is ``split_terms``' default; a head call with the guide's example
    ``tuning=`` (and a forced small block budget) gives the default call's loss and gradients."""
    import dataclasses

    fields = {field.name for field in dataclasses.fields(lossspec.HeadTuning)}
    for (module, name), field in HEAD_KNOBS.items():
        assert not hasattr(importlib.import_module(module), name), f"{module}.{name} is still there"
        assert field in fields, field
    assert "split_terms" in fields and not RETIRED_HEAD_FIELDS & fields
    for module in ("jaxloss.backends.pallas_head", "torchloss.backends.triton_head"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(module)
    assert lossspec.HeadTuning().split_terms == lossspec.linear.HEAD_SPLIT_TERMS
    rng = np.random.default_rng(0)
    hidden = torch.tensor(rng.standard_normal((3, 4, 8)), dtype=torch.float32)
    weight = torch.tensor(0.5 * rng.standard_normal((37, 8)), dtype=torch.float32)
    labels = torch.tensor(rng.integers(0, 37, (3, 4)))
    results = []
    for tuning in (None, lossspec.HeadTuning(bf16_matmul_devices=("cuda",)), lossspec.HeadTuning(block_elements=15, blocked_rows=5)):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = torchloss.linear_cross_entropy(h, w, labels, tuning=tuning)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# The guide and this file stay in step
# --------------------------------------------------------------------------------------------


def test_guide_names_every_row_test() -> None:
    """Every table row of docs/migrating.md names its test here (``test_migrating.py::name``),
    every named test exists, and every row test of this file is named by the guide."""
    text = GUIDE.read_text()
    lines = text.splitlines()
    separator = lambda line: line.startswith("|") and set(line) <= set("|-: ")  # noqa: E731
    body = [line for i, line in enumerate(lines) if line.startswith("|") and not separator(line)
            and not (i + 1 < len(lines) and separator(lines[i + 1]))]  # neither a separator nor a header
    named = set(re.findall(r"test_migrating\.py::(test_\w+)", text))
    defined = {name for name in globals() if name.startswith("test_") and name != "test_guide_names_every_row_test"}
    assert named, "the guide names no test"
    assert named <= defined, f"the guide names tests that do not exist: {sorted(named - defined)}"
    assert defined <= named, f"tests the guide does not name: {sorted(defined - named)}"
    unnamed = [row for row in body if "test_migrating.py::" not in row]
    assert not unnamed, f"table rows without their test: {unnamed}"
