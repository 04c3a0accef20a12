"""The oracle and the shared statistics of ``entropy`` and ``jensen_shannon`` (NumPy only).

- the oracle's analytic gradients against central finite differences in float64;
- ``jensen_shannon`` at ``beta = 0`` / ``1`` is forward / reverse KL exactly (TRL's GKD and
  Liger-Kernel's definition), and ``l / beta`` tends to forward KL as ``beta -> 0``;
- known values (uniform rows, symmetry and bounds of the symmetric JSD);
- ``lossspec.stats``' block algebra (online combine of blocks, the JSD's second pass) run on
  NumPy blocks against the oracle, and ``oracle_vocab_parallel`` against ``oracle``;
- option checks (``beta`` in ``[0, 1]``, options of the other kinds rejected).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import lossspec
from lossspec import oracle, stats

BETAS = (0.1, 0.5, 0.85)


def _rows(seed: int, rows: int = 5, vocab: int = 9, scale: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, scale, (rows, vocab)), rng.normal(0.0, scale, (rows, vocab))


def _finite_differences(fn, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += h
        down[index] -= h
        grad[index] = (fn(up) - fn(down)) / (2 * h)
    return grad


@pytest.mark.parametrize(
    "kind,options",
    [
        ("entropy", {}),
        ("entropy", {"temperature": 1.7, "logit_scale": 0.8}),
        *[("jensen_shannon", {"beta": beta}) for beta in BETAS],
        ("jensen_shannon", {"beta": 0.3, "temperature": 1.4, "logit_scale": 1.2, "teacher_logit_scale": 0.7}),
        ("jensen_shannon", {"beta": 0.0}),
        ("jensen_shannon", {"beta": 1.0, "temperature": 0.8}),
    ],
)
def test_oracle_gradient_matches_finite_differences(kind: str, options: dict) -> None:
    x, t = _rows(1)
    target = None if kind == "entropy" else t
    weights = np.array([1.0, 0.0, 2.5, 0.5, 1.0])
    loss, grad = oracle(kind, x, target, weights, normalization="sum", **options)
    numeric = _finite_differences(lambda z: oracle(kind, z, target, weights, normalization="sum", **options)[0], x)
    assert loss > 0
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)
    assert np.all(grad[1] == 0.0)  # masked row


def test_beta_end_points_are_the_kl_kinds_exactly() -> None:
    x, t = _rows(2)
    opts = {"temperature": 1.3, "logit_scale": 0.9, "teacher_logit_scale": 1.1, "normalization": "none"}
    for beta, kl in ((0.0, "forward_kl"), (1.0, "reverse_kl")):
        jsd_loss, jsd_grad = oracle("jensen_shannon", x, t, beta=beta, **opts)
        kl_loss, kl_grad = oracle(kl, x, t, **opts)
        np.testing.assert_array_equal(jsd_loss, kl_loss)
        np.testing.assert_array_equal(jsd_grad, kl_grad)
    assert lossspec.make_config("jensen_shannon", beta=0.0).formula == "forward_kl"
    assert lossspec.make_config("jensen_shannon", beta=1.0).formula == "reverse_kl"
    assert lossspec.make_config("jensen_shannon", beta=0.5).formula == "jensen_shannon"


def test_end_points_are_the_scaled_limits() -> None:
    """TRL / Liger define beta = 0 as KL(p || q) and beta = 1 as KL(q || p): the limits of
    ``l / beta`` and ``l / (1 - beta)`` (so student and teacher are where the docs say)."""
    x, t = _rows(3)
    small = 1e-8
    fwd, fwd_grad = oracle("forward_kl", x, t, normalization="none")
    rev, rev_grad = oracle("reverse_kl", x, t, normalization="none")
    lo, lo_grad = oracle("jensen_shannon", x, t, beta=small, normalization="none")
    hi, hi_grad = oracle("jensen_shannon", x, t, beta=1.0 - small, normalization="none")
    np.testing.assert_allclose(lo / small, fwd, rtol=1e-4)
    np.testing.assert_allclose(hi / small, rev, rtol=1e-4)
    np.testing.assert_allclose(lo_grad / small, fwd_grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(hi_grad / small, rev_grad, rtol=1e-4, atol=1e-6)


def test_known_values() -> None:
    vocab = 8
    flat = np.zeros((2, vocab))
    loss, grad = oracle("entropy", flat, None, normalization="none")
    np.testing.assert_allclose(loss, math.log(vocab), rtol=1e-15)
    np.testing.assert_allclose(grad, 0.0, atol=1e-16)  # the maximum of the entropy
    x, t = _rows(4)
    jsd_qp, _ = oracle("jensen_shannon", x, t, beta=0.5, normalization="none")
    jsd_pq, _ = oracle("jensen_shannon", t, x, beta=0.5, normalization="none")
    np.testing.assert_allclose(jsd_qp, jsd_pq, rtol=1e-12)  # symmetric at beta = 1/2
    assert np.all((jsd_qp > 0) & (jsd_qp < math.log(2)))
    same, same_grad = oracle("jensen_shannon", x, x, beta=0.3, normalization="none")
    np.testing.assert_allclose(same, 0.0, atol=1e-15)
    np.testing.assert_allclose(same_grad, 0.0, atol=1e-15)
    # beta weights the teacher: with p = (1, 0), q = (0.5, 0.5) the terms are asymmetric.
    x2 = np.array([[0.0, 0.0]])
    t2 = np.array([[0.0, -np.inf]])
    beta = 0.25
    m = np.array([beta + (1 - beta) * 0.5, (1 - beta) * 0.5])
    expected = beta * math.log(1 / m[0]) + (1 - beta) * 0.5 * (math.log(0.5 / m[0]) + math.log(0.5 / m[1]))
    loss2, _ = oracle("jensen_shannon", x2, t2, beta=beta, normalization="none")
    np.testing.assert_allclose(loss2, expected, rtol=1e-14)


# --------------------------------------------------------------------------------------------
# lossspec.stats on NumPy blocks
# --------------------------------------------------------------------------------------------


def _block_stats(config: lossspec.LossConfig, x: np.ndarray, t: np.ndarray) -> stats.Stats:
    """The first-pass statistics of a block, relative to its own maxima (NumPy)."""
    c, ct = config.student_scale, config.teacher_scale
    with np.errstate(invalid="ignore"):
        m = x.max(axis=1)
        u = x - stats.finite_max(np, m)[:, None]
        e = np.exp(c * u)
        if config.kind == "entropy":
            return stats.Stats(m=m, s=e.sum(1), h=np.where(e > 0, e * u, 0.0).sum(1))
        mt = t.max(axis=1)
        et = np.exp(ct * (t - stats.finite_max(np, mt)[:, None]))
        return stats.Stats(m=m, s=e.sum(1), mt=mt, st=et.sum(1))


@pytest.mark.parametrize("scale", (2.0, 3e3))
@pytest.mark.parametrize("kind,options", [("entropy", {"temperature": 1.3}), ("jensen_shannon", {"beta": 0.3, "teacher_logit_scale": 1.6})])
def test_block_algebra_matches_oracle(kind: str, options: dict, scale: float) -> None:
    """Blocks of 4 columns folded with ``stats.combine``, finalized (and for the JSD the second
    pass, block by block, from the global statistics) equal the oracle, -inf columns included."""
    config = lossspec.make_config(kind, **options)
    x, t = _rows(5, rows=6, vocab=23, scale=scale)
    x[:, [0, 7, 21]] = -np.inf
    t[:, [7, 3]] = -np.inf
    x[2, :5] = -np.inf  # a whole block of -inf
    blocks = [slice(v, min(v + 4, 23)) for v in range(0, 23, 4)]
    acc = None
    for block in blocks:
        part = _block_stats(config, x[:, block], t[:, block])
        acc = part if acc is None else stats.combine(np, config, acc, part)
    fin = stats.finalize(np, config, acc, 23)
    if kind == "jensen_shannon":
        assert fin.l is None  # no loss before the second pass
        kl_qm = kl_pm = 0.0
        for block in blocks:
            with np.errstate(invalid="ignore", over="ignore"):
                _, wq, wp, _ = stats.mixture_terms(np, config, fin, x[:, block] - fin.m[:, None], t[:, block] - fin.mt[:, None])
            kl_qm, kl_pm = kl_qm + wq.sum(1), kl_pm + wp.sum(1)
        fin = stats.finalize_mixture(np, config, fin, kl_qm, kl_pm)
    ref, _ = oracle(kind, x, None if kind == "entropy" else t, normalization="none", **options)
    np.testing.assert_allclose(fin.l, ref, rtol=1e-12, atol=1e-12 * scale)


def test_mixture_log_ratios_are_exact_and_finite() -> None:
    """The min / log1p form equals log q - log M and log p - log M (float64, logaddexp), and stays
    finite where the other distribution is 0."""
    config = lossspec.make_config("jensen_shannon", beta=0.2)
    log_q = np.array([-1.0, -30.0, -0.1, -5.0, 0.0])
    log_p = np.array([-2.0, -0.5, -40.0, -5.0, -np.inf])
    log_m = np.logaddexp(math.log(0.8) + log_q, math.log(0.2) + log_p)
    with np.errstate(invalid="ignore"):
        log_qm, log_pm = stats.mixture_log_ratios(np, config, log_q - log_p)
    np.testing.assert_allclose(log_qm, log_q - log_m, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(log_pm[:4], (log_p - log_m)[:4], rtol=1e-14, atol=1e-14)
    assert log_qm[4] == pytest.approx(-math.log(0.8))


@pytest.mark.parametrize("shards", (2, 3))
@pytest.mark.parametrize("scenario", ("random", "huge", "neg_inf", "float_weights"))
@pytest.mark.parametrize("kind,options", [("entropy", {"logit_scale": 1.4}), ("jensen_shannon", {"beta": 0.6, "temperature": 1.5})])
def test_vocab_parallel_oracle_matches_oracle(kind: str, options: dict, scenario: str, shards: int) -> None:
    case = lossspec.make_case(kind, scenario, vocab=31, lead_shape=(7,))
    ref_loss, ref_grad = oracle(kind, case.logits, case.target, case.loss_mask, normalization="none", **options)
    loss, grad = lossspec.oracle_vocab_parallel(
        kind, case.logits, case.target, case.loss_mask, num_shards=shards, normalization="none", **options
    )
    scale = max(1.0, float(np.max(np.abs(ref_loss))))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-10, atol=1e-10 * scale)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def test_options() -> None:
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\], got 1.5"):
        lossspec.make_config("jensen_shannon", beta=1.5)
    with pytest.raises(ValueError, match="beta must be in"):
        lossspec.make_config("jensen_shannon", beta=-0.1)
    with pytest.raises(ValueError, match="beta must be finite"):
        lossspec.make_config("jensen_shannon", beta=float("nan"))
    with pytest.raises(TypeError, match="beta must be a Python number"):
        lossspec.make_config("jensen_shannon", beta=True)
    with pytest.raises(TypeError, match="forward_kl got unexpected option"):
        lossspec.make_config("forward_kl", beta=0.3)
    with pytest.raises(TypeError, match="entropy got unexpected option.*teacher_logit_scale"):
        lossspec.make_config("entropy", teacher_logit_scale=2.0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        lossspec.make_config("entropy", temperature=0.0)
    assert lossspec.make_config("entropy", temperature=2.0).student_scale == 0.5
    spec = lossspec.KIND_SPECS["entropy"]
    names = [p.name for p in lossspec.kinds.parameters(spec)]
    assert names[:2] == ["logits", "loss_mask"] and "teacher_logits" not in names
    jsd_names = [p.name for p in lossspec.kinds.parameters(lossspec.KIND_SPECS["jensen_shannon"])]
    assert jsd_names[:4] == ["logits", "teacher_logits", "loss_mask", "beta"]
