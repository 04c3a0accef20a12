"""The float64 oracle against central finite differences and against independent computations."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import lossspec
from lossspec import KINDS, NORMALIZATIONS, oracle

OPTIONS = {
    "cross_entropy": [
        {},
        {"label_smoothing": 0.1},
        {"z_loss": 1e-2},
        {"logit_scale": 0.7},
        {"label_smoothing": 0.3, "z_loss": 1e-3, "logit_scale": 1.9, "ignore_index": 3},
    ],
    "soft_cross_entropy": [{}, {"temperature": 2.0}, {"logit_scale": 0.5, "teacher_logit_scale": 1.7}],
    "forward_kl": [{}, {"temperature": 0.5}, {"logit_scale": 1.5, "teacher_logit_scale": 0.8, "temperature": 1.3}],
    "reverse_kl": [{}, {"temperature": 3.0}, {"logit_scale": 0.6, "teacher_logit_scale": 1.4, "temperature": 0.7}],
}


def _small_inputs(kind: str, seed: int, mask_kind: str):
    rng = np.random.default_rng(seed)
    lead, vocab = (2, 3), 7
    logits = rng.normal(0, 1.5, size=lead + (vocab,))
    if kind == "cross_entropy":
        target = rng.integers(0, vocab, size=lead)
        target[0, 0] = 3  # sometimes ignore_index (3) in the options
    else:
        target = rng.normal(0, 1.5, size=lead + (vocab,))
    if mask_kind == "none":
        mask = None
    elif mask_kind == "bool":
        mask = rng.random(lead) < 0.7
        mask[0, 1] = True
    else:
        mask = rng.uniform(0, 2, size=lead) * (rng.random(lead) < 0.8)
        mask[0, 1] = 0.5
    return logits, target, mask


def _finite_difference(fn, x: np.ndarray, step: float = 1e-5) -> np.ndarray:
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += step
        minus[index] -= step
        grad[index] = (fn(plus) - fn(minus)) / (2 * step)
    return grad


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_gradient_matches_finite_differences(kind: str, normalization: str, mask_kind: str) -> None:
    for option_index, options in enumerate(OPTIONS[kind]):
        logits, target, mask = _small_inputs(kind, option_index, mask_kind)
        upstream = np.random.default_rng(9).normal(size=logits.shape[:-1]) if normalization == "none" else 1.7
        extra = dict(options, normalization=normalization, grad_output=upstream)

        def scalar_loss(x: np.ndarray) -> float:
            loss, _ = oracle(kind, x, target, mask, **dict(options, normalization=normalization))
            return float(np.sum(np.asarray(loss) * upstream))

        _, grad = oracle(kind, logits, target, mask, **extra)
        numeric = _finite_difference(scalar_loss, logits)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8, err_msg=f"{kind} {options}")


@pytest.mark.parametrize("kind", KINDS)
def test_denominator_option_rescales(kind: str) -> None:
    logits, target, mask = _small_inputs(kind, 0, "float")
    base_loss, base_grad = oracle(kind, logits, target, mask, normalization="sum")
    loss, grad = oracle(kind, logits, target, mask, denominator=2.5)
    np.testing.assert_allclose(loss, base_loss / 2.5, rtol=1e-14)
    np.testing.assert_allclose(grad, base_grad / 2.5, rtol=1e-14)
    tokens_loss, _ = oracle(kind, logits, target, mask, normalization="tokens")
    np.testing.assert_allclose(tokens_loss, base_loss / logits[..., 0].size, rtol=1e-14)


def test_cross_entropy_matches_torch_functional() -> None:
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, size=(12, 9))
    labels = rng.integers(0, 9, size=12)
    labels[[2, 5]] = -100
    for smoothing in (0.0, 0.2):
        x = torch.tensor(logits, requires_grad=True)
        ref = F.cross_entropy(x, torch.tensor(labels), ignore_index=-100, label_smoothing=smoothing)
        ref.backward()
        loss, grad = oracle("cross_entropy", logits, labels, label_smoothing=smoothing)
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-12)
        np.testing.assert_allclose(grad, x.grad.numpy(), rtol=1e-10, atol=1e-15)
    # Per-token losses ("none" in both).
    ref = F.cross_entropy(torch.tensor(logits), torch.tensor(labels), ignore_index=-100, reduction="none")
    loss, _ = oracle("cross_entropy", logits, labels, normalization="none")
    np.testing.assert_allclose(loss, ref.numpy(), rtol=1e-12)


def test_kl_matches_torch_kl_div() -> None:
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(2)
    student, teacher = rng.normal(0, 2, size=(2, 10, 11))
    temperature = 2.0
    log_q = F.log_softmax(torch.tensor(student) / temperature, -1)
    log_p = F.log_softmax(torch.tensor(teacher) / temperature, -1)
    forward = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    reverse = F.kl_div(log_p, log_q, log_target=True, reduction="batchmean")
    loss, _ = oracle("forward_kl", student, teacher, temperature=temperature)
    np.testing.assert_allclose(loss, forward.item(), rtol=1e-12)
    loss, _ = oracle("reverse_kl", student, teacher, temperature=temperature)
    np.testing.assert_allclose(loss, reverse.item(), rtol=1e-12)
    # Soft cross-entropy = forward KL + teacher entropy.
    entropy = -(log_p.exp() * log_p).sum(-1).mean().item()
    loss, _ = oracle("soft_cross_entropy", student, teacher, temperature=temperature)
    np.testing.assert_allclose(loss, forward.item() + entropy, rtol=1e-12)


def test_huge_logits_are_shift_invariant() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, size=(4, 50))
    labels = rng.integers(0, 50, size=4)
    loss, grad = oracle("cross_entropy", logits, labels, logit_scale=0.5)
    shifted_loss, shifted_grad = oracle("cross_entropy", logits + 1e4, labels, logit_scale=0.5)
    np.testing.assert_allclose(shifted_loss, loss, rtol=1e-12)
    np.testing.assert_allclose(shifted_grad, grad, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("kind", KINDS)
def test_neg_inf_entries_get_zero_probability_and_gradient(kind: str) -> None:
    case = lossspec.make_case(kind, "neg_inf", vocab=40)
    ref = case.reference()
    assert np.isfinite(ref.loss)
    banned = np.isneginf(case.logits)
    assert banned.any()
    assert np.all(ref.grad[banned] == 0.0)
    # The same loss as dropping those columns altogether.
    keep = ~banned[0]
    dropped_target = case.target if kind == "cross_entropy" else case.target[:, keep]
    if kind == "cross_entropy":
        remap = np.cumsum(keep) - 1
        valid = case.loss_mask != 0
        dropped_target = np.where(valid, remap[np.clip(case.target, 0, 39)], case.target)
        dropped_target = np.where(valid & (case.target == -100), -100, dropped_target)
    loss, _ = oracle(kind, case.logits[:, keep], dropped_target, case.loss_mask)
    np.testing.assert_allclose(loss, ref.loss, rtol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_nan_or_posinf_in_a_valid_row_gives_nan(kind: str) -> None:
    for bad_value in (np.nan, np.inf):
        case = lossspec.make_case(kind, "no_mask", vocab=20, lead_shape=(3,))
        logits = case.logits.astype(np.float64)
        row = 0 if kind != "cross_entropy" else int(np.flatnonzero(case.target != -100)[0])
        logits[row, 4] = bad_value
        loss, _ = oracle(kind, logits, case.target)
        assert np.isnan(loss)
        if kind != "cross_entropy":
            teacher = case.target.astype(np.float64)
            teacher[2, 5] = bad_value
            loss, _ = oracle(kind, case.logits, teacher)
            assert np.isnan(loss)


@pytest.mark.parametrize("kind", KINDS)
def test_masked_rows_never_leak_nan(kind: str) -> None:
    case = lossspec.make_case(kind, "random", vocab=20)
    logits = case.logits.astype(np.float64)
    masked = np.flatnonzero(case.loss_mask == 0)[0]
    logits[masked] = np.nan
    loss, grad = oracle(kind, logits, case.target, case.loss_mask)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalization", ["valid_tokens", "tokens", "sum", "none"])
def test_all_masked_is_zero(kind: str, normalization: str) -> None:
    for scenario in ("all_masked", "empty"):
        case = lossspec.make_case(kind, scenario)
        loss, grad = oracle(kind, case.logits, case.target, case.loss_mask, normalization=normalization)
        assert np.all(np.asarray(loss) == 0.0) and np.all(grad == 0.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_shards", [2, 3, 7])
@pytest.mark.parametrize("scenario", ["random", "huge", "neg_inf", "confident", "float_weights"])
def test_vocab_parallel_reference_equals_oracle(kind: str, num_shards: int, scenario: str) -> None:
    options = [{"label_smoothing": 0.1, "z_loss": 1e-3, "logit_scale": 1.3}] if kind == "cross_entropy" else [
        {"temperature": 1.7, "teacher_logit_scale": 0.9}
    ]
    case = lossspec.make_case(kind, scenario, vocab=29)
    for opts in [{}] + options:
        if scenario == "neg_inf" and opts.get("label_smoothing"):
            continue  # smoothing over -inf entries is +inf in both; compared elsewhere
        loss, grad = oracle(kind, case.logits, case.target, case.loss_mask, **opts)
        vp_loss, vp_grad = lossspec.oracle_vocab_parallel(
            kind, case.logits, case.target, case.loss_mask, num_shards=num_shards, **opts
        )
        np.testing.assert_allclose(vp_loss, loss, rtol=1e-11, atol=1e-12)
        # Relative to S = max(max|grad|, G0) (SPEC section 6): the reverse-KL gradient of a
        # one-hot q cancels to ~0, where float64 noise of l ~ 1e4 is all that is left.
        scale = max(np.abs(grad).max(), case.g0(**opts))
        np.testing.assert_allclose(vp_grad, grad, rtol=0, atol=1e-11 * scale)


def test_label_smoothing_with_neg_inf_is_infinite() -> None:
    case = lossspec.make_case("cross_entropy", "neg_inf", vocab=16)
    loss, grad = oracle("cross_entropy", case.logits, case.target, case.loss_mask, label_smoothing=0.1)
    assert loss == np.inf and np.all(np.isfinite(grad))


def test_import_without_jax_or_torch() -> None:
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('jax', 'jaxlib', 'torch', 'triton', 'flax'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import lossspec\n"
        "case = lossspec.make_case('reverse_kl', 'random')\n"
        "ref = case.reference()\n"
        "print(repr(float(ref.loss)), repr(float(abs(ref.grad).sum())))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch', 'triton', 'flax')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    numbers, frameworks = result.stdout.splitlines()
    assert frameworks == "[]"
    loss, grad_abs_sum = (float(n) for n in numbers.split())
    # The same numbers as here (where the frameworks may be loaded), bit for bit ...
    case = lossspec.make_case("reverse_kl", "random")
    ref_loss, ref_grad = oracle("reverse_kl", case.logits, case.target, case.loss_mask)
    assert (loss, grad_abs_sum) == (float(ref_loss), float(np.abs(ref_grad).sum()))
    # ... and the loss is KL(q || p) averaged over the mask's weights, written out in float64.
    log_q = _log_softmax(np.asarray(case.logits, np.float64))
    log_p = _log_softmax(np.asarray(case.target, np.float64))
    per_token = np.sum(np.exp(log_q) * (log_q - log_p), axis=-1)
    weight = np.ones(per_token.shape) if case.loss_mask is None else np.asarray(case.loss_mask, np.float64)
    np.testing.assert_allclose(loss, np.sum(weight * per_token) / np.sum(weight), rtol=1e-12)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def test_count_denominator() -> None:
    labels = np.array([[1, -100, 3], [4, 5, -100]])
    mask = np.array([[1.0, 1.0, 0.5], [0.0, 2.0, 1.0]])
    assert lossspec.count_denominator(labels) == 4.0
    assert lossspec.count_denominator(labels, mask) == 1.0 + 0.5 + 2.0
    assert lossspec.count_denominator(loss_mask=mask) == 5.5
    assert lossspec.count_denominator(labels, normalization="tokens") == 6.0
    assert lossspec.count_denominator(labels, ignore_index=3) == 5.0
    # Counts add up over any split of the batch.
    rng = np.random.default_rng(0)
    labels = np.where(rng.random((8, 5)) < 0.3, -100, rng.integers(0, 9, (8, 5)))
    mask = rng.random((8, 5)) < 0.6
    whole = lossspec.count_denominator(labels, mask)
    parts = sum(lossspec.count_denominator(labels[i : i + 3], mask[i : i + 3]) for i in range(0, 8, 3))
    assert whole == parts
    for bad in ("sum", "none"):
        with pytest.raises(ValueError, match="only counts normalization"):
            lossspec.count_denominator(labels, normalization=bad)
    with pytest.raises(ValueError, match="needs labels or loss_mask"):
        lossspec.count_denominator()
    with pytest.raises(ValueError, match="normalization must be one of"):
        lossspec.count_denominator(labels, normalization="mean")
    with pytest.raises(TypeError, match="labels must be an integer array"):
        lossspec.count_denominator(labels.astype(np.float32))
    with pytest.raises(ValueError, match="must be >= 0"):
        lossspec.count_denominator(labels, -mask.astype(np.float32) - 1)
