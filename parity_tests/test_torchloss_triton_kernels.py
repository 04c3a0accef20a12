"""torchloss' Triton kernels (``torchloss.backends.triton``) against the float64 oracle: compiled, on CUDA
tensors, where CUDA is available; else through the Triton interpreter on CPU tensors
(``torch_problem.TRITON_DEVICE``). Inputs are made on the host either way.

Small shapes (V <= ~300, N <= 16) with ``tuning=lossspec.Tuning(vocab_block=64)``, so that every row takes
several vocabulary blocks and a ragged tail: the online statistics, the reverse-KL pivot and the
masked tail are exercised as on a GPU with a 128k vocabulary. The kernels are called directly
(``forward``, ``regrad_``, ``shard_stats``) and through ``torchloss.<kind>(..., impl="triton")``.
"""

from __future__ import annotations

import math

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import lossspec
import torchloss
from torchloss import _block
from torchloss.backends import triton as _triton
from torchloss.backends import triton_kernels as K

from parity_tests.support.torch_problem import TRITON_DEVICE as DEVICE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONS = {
    "cross_entropy": [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "logit_scale": 0.75}],
    "soft_cross_entropy": [{}, {"temperature": 2.0, "logit_scale": 1.5, "teacher_logit_scale": 0.5}],
    "forward_kl": [{}, {"temperature": 0.5, "teacher_logit_scale": 2.0}],
    "reverse_kl": [{}, {"temperature": 3.0, "logit_scale": 0.5, "teacher_logit_scale": 1.25}],
}


# 64-column blocks: V = 150 is two full blocks and a ragged tail of 22.
SMALL_BLOCKS = lossspec.Tuning(vocab_block=64)


def _tensors(case: lossspec.Case, config: lossspec.LossConfig, **options):
    """``(x, target, coef)`` as the torch driver hands them to the kernels: logits in the case's
    dtype, safe int64 labels (0 where invalid) or teacher logits, ``coef = w / D`` fp32."""
    dtype = DTYPES[case.dtype]
    x = torch.tensor(case.logits).to(dtype).to(DEVICE)
    rows, vocab = x.shape
    is_ce = config.kind == "cross_entropy"
    valid, weight = lossspec.token_weights(config, case.target if is_ce else None, case.loss_mask, (rows,))
    if config.normalization == "none":
        coef = weight
    else:
        denom = weight.sum()
        coef = weight / denom if denom > 0 else np.zeros_like(weight)
    coef_t = torch.tensor(coef, dtype=torch.float32).to(DEVICE)
    if is_ce:
        target = torch.tensor(np.where(valid, case.target, 0), dtype=torch.int64).to(DEVICE)
    else:
        target = torch.tensor(case.target).to(dtype).to(DEVICE)
    return x, target, coef_t


def _reduced_loss(loss: torch.Tensor, coef: torch.Tensor) -> np.ndarray:
    return torch.where(coef != 0, coef.double() * loss.double(), 0.0).sum().cpu().numpy()


def _numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` on the host in float64 (exact for every dtype here), for the NumPy comparisons."""
    return t.detach().cpu().double().numpy()


# ------------------------------------------------------------------------------------------------
# The lossspec scenarios, every kind and dtype, called directly
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scenario", lossspec.SCENARIOS)
@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_forward_scenarios(kind: str, scenario: str, dtype: str) -> None:
    if dtype == "float16" and scenario == "huge":
        pytest.skip("|x| up to 1e4 is beyond float16's range")
    case = lossspec.make_case(kind, scenario, lead_shape=(12,), vocab=150, dtype=dtype, seed=3)
    config = lossspec.make_config(kind)
    x, target, coef = _tensors(case, config)
    loss, grad = _triton.forward(config, x, target, coef, tuning=SMALL_BLOCKS)
    assert loss.dtype == torch.float32 and grad is not None and grad.dtype == x.dtype
    ref = case.reference()
    lossspec.assert_close_to_oracle(_reduced_loss(loss, coef), _numpy(grad), ref.loss, ref.grad, dtype=dtype,
                                    g0=ref.g0, what=case.name)
    # Rows with coef == 0: loss 0 and gradient exactly 0 (no NaN leaks from garbage rows).
    dead = coef == 0
    assert torch.all(loss[dead] == 0) and torch.all(grad[dead] == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scenario", ["random", "confident", "huge", "neg_inf"])
@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_forward_options(kind: str, scenario: str, dtype: str) -> None:
    options = OPTIONS[kind][1]
    if scenario == "neg_inf" and options.get("label_smoothing"):
        options = {k: v for k, v in options.items() if k != "label_smoothing"}  # the true loss is +inf
    case = lossspec.make_case(kind, scenario, lead_shape=(10,), vocab=150, dtype=dtype, seed=5)
    config = lossspec.make_config(kind, **options)
    x, target, coef = _tensors(case, config)
    loss, grad = _triton.forward(config, x, target, coef, tuning=SMALL_BLOCKS)
    ref = case.reference(**options)
    lossspec.assert_close_to_oracle(_reduced_loss(loss, coef), _numpy(grad), ref.loss, ref.grad, dtype=dtype,
                                    g0=ref.g0, what=f"{case.name} {options}")


@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_forward_without_grad_and_in_place(kind: str) -> None:
    """``need_grad=False`` gives the same loss and no gradient; ``out=logits`` (``inplace=True``)
    gives the same gradient, written over the logits."""
    case = lossspec.make_case(kind, "random", lead_shape=(8,), vocab=150, dtype="bfloat16", seed=1)
    config = lossspec.make_config(kind)
    x, target, coef = _tensors(case, config)
    loss, grad = _triton.forward(config, x, target, coef, tuning=SMALL_BLOCKS)
    loss2, none = _triton.forward(config, x, target, coef, need_grad=False, tuning=SMALL_BLOCKS)
    assert none is None and torch.equal(loss, loss2)
    buf = x.clone()
    loss3, grad3 = _triton.forward(config, buf, target, coef, out=buf, tuning=SMALL_BLOCKS)
    assert grad3 is buf and torch.equal(loss3, loss) and torch.equal(buf, grad)


def test_float64_logits_compute_in_float64() -> None:
    """fp64 logits are computed in fp64 (gradcheck-grade): loss and gradient far inside fp32's
    reach of the oracle."""
    for kind in lossspec.KINDS:
        case = lossspec.make_case(kind, "random", lead_shape=(6,), vocab=150, dtype="float32", seed=2)
        config = lossspec.make_config(kind, **OPTIONS[kind][1]) if kind != "cross_entropy" else lossspec.make_config(kind)
        x, target, coef = _tensors(case, config)
        x = x.double()
        target = target if kind == "cross_entropy" else target.double()
        _, weight = lossspec.token_weights(config, case.target if kind == "cross_entropy" else None, case.loss_mask, (6,))
        coef = torch.tensor(weight / weight.sum(), dtype=torch.float64).to(DEVICE)  # exact, not via fp32
        loss, grad = _triton.forward(config, x, target, coef, tuning=SMALL_BLOCKS)
        assert loss.dtype == torch.float64 and grad is not None and grad.dtype == torch.float64
        options = OPTIONS[kind][1] if kind != "cross_entropy" else {}
        ref = case.reference(**options)
        assert abs(float(_reduced_loss(loss, coef)) - ref.loss) <= 1e-12 * max(1.0, abs(ref.loss))
        np.testing.assert_allclose(_numpy(grad), ref.grad, rtol=0, atol=1e-12 * max(1.0, np.abs(ref.grad).max()))


@pytest.mark.slow
def test_gradcheck_float64() -> None:
    """The analytic gradient of the fp64 kernels agrees with finite differences (public API;
    blocks of 8 columns: two blocks and a tail of 4)."""
    tuning = lossspec.Tuning(vocab_block=8)
    torch.manual_seed(0)
    for kind, options in (("cross_entropy", {"label_smoothing": 0.2, "z_loss": 0.01}), ("reverse_kl", {"temperature": 1.5})):
        # Drawn on the host (the same numbers on every machine), then moved.
        x = torch.randn(2, 12, dtype=torch.float64).to(DEVICE).requires_grad_()
        target = torch.tensor([0, 11]) if kind == "cross_entropy" else torch.randn(2, 12, dtype=torch.float64)
        target = target.to(DEVICE)
        fn = getattr(torchloss, kind)
        assert torch.autograd.gradcheck(lambda z: fn(z, target, impl="triton", tuning=tuning, **options), (x,), eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# Reverse KL: ties of the student's maximum (the pivot rule)
# ------------------------------------------------------------------------------------------------


def _tie_case(scale: float, dtype: str = "float32", vocab: int = 150, rows: int = 6, seed: int = 0):
    """Student rows whose maximum is tied at 2-3 columns in different blocks (and twice inside a
    block), the teacher different at each tying column; ``scale`` sets the logits' magnitude."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, (rows, vocab)) * scale
    t = rng.normal(0.0, 1.0, (rows, vocab)) * scale
    ties = [(5, 100), (70, 140, 149), (3, 4, 130), (0, 63, 64), (127, 128), (10, 90)]
    for r in range(rows):
        cols = list(ties[r % len(ties)])
        x[r, cols] = x[r].max() + abs(scale) * 0.5
        t[r, cols] = rng.normal(0.0, 1.0, len(cols)) * scale
    x = lossspec.round_to_dtype(x, dtype)
    t = lossspec.round_to_dtype(t, dtype)
    return x, t


@pytest.mark.parametrize("block", [16, 64, 256])
@pytest.mark.parametrize("scale", [2.0, 1e3])
def test_reverse_kl_pivot_on_ties(block: int, scale: float) -> None:
    """tau is the teacher logit at the first column where the student ties its maximum,
    whatever the blocks; the loss and gradient match the oracle (huge logits included)."""
    tuning = lossspec.Tuning(vocab_block=block)
    x_np, t_np = _tie_case(scale)
    config = lossspec.make_config("reverse_kl")
    x, t = torch.tensor(x_np).to(DEVICE), torch.tensor(t_np).to(DEVICE)
    coef = torch.full((x.shape[0],), 1.0 / x.shape[0], device=DEVICE)
    stats = _triton.shard_stats(config, x, t, coef, 0, tuning)
    at_max = x_np == x_np.max(axis=1, keepdims=True)
    assert (at_max.sum(axis=1) >= 2).all()
    expected_tau = t_np[np.arange(x_np.shape[0]), np.argmax(x_np, axis=1)]  # the first tying column
    np.testing.assert_array_equal(stats.tau.cpu().numpy(), expected_tau.astype(np.float32))
    np.testing.assert_array_equal(stats.m.cpu().numpy(), x_np.max(axis=1).astype(np.float32))
    loss, grad = _triton.forward(config, x, t, coef, tuning=tuning)
    ref_loss, ref_grad = lossspec.oracle("reverse_kl", x_np, t_np)
    g0 = 1.0 / x.shape[0]
    lossspec.assert_close_to_oracle(_reduced_loss(loss, coef), _numpy(grad), ref_loss, ref_grad, dtype="float32", g0=g0)


def test_reverse_kl_pivot_matches_lossspec_combine() -> None:
    """The kernel's online pivot equals ``torchloss._block.combine`` folded over blocks."""
    x_np, t_np = _tie_case(3.0, seed=7)
    config = lossspec.make_config("reverse_kl")
    x, t = torch.tensor(x_np).to(DEVICE), torch.tensor(t_np).to(DEVICE)
    coef = torch.ones(x.shape[0], device=DEVICE)
    whole = _triton.shard_stats(config, x, t, coef, 0, SMALL_BLOCKS)
    acc = _block.empty_stats(config, x.shape[0], torch.float32, x.device)
    for v0 in range(0, x.shape[1], 32):
        part = _triton.shard_stats(config, x[:, v0:v0 + 32].contiguous(), t[:, v0:v0 + 32].contiguous(), coef, v0, SMALL_BLOCKS)
        acc = _block.combine(config, acc, part)
    torch.testing.assert_close(acc.tau, whole.tau, rtol=0, atol=0)
    torch.testing.assert_close(acc.m, whole.m, rtol=0, atol=0)
    torch.testing.assert_close(acc.e_d, whole.e_d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(acc.s, whole.s, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# Full blocks and the ragged tail, each alone (the kernels peel the tail: full blocks load and
# store unmasked, the tail is one masked step after them)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [40, 128])
@pytest.mark.parametrize("scenario", ["random", "neg_inf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", lossspec.ALL_KINDS)
def test_full_blocks_or_tail_alone(kind: str, dtype: str, scenario: str, vocab: int) -> None:
    """64-column blocks with ``V = 40`` (the masked tail step alone, no full block) and
    ``V = 128`` (two full blocks, no tail; every other test here has both), every kind: the
    forward against the oracle and, for the kinds without a mixture pass, the vocab-parallel
    passes (``shard_stats``, ``finalize``, ``shard_grad``) too."""
    case = lossspec.make_case(kind, scenario, lead_shape=(6,), vocab=vocab, dtype=dtype, seed=8)
    config = lossspec.make_config(kind)
    x, target, coef = _tensors(case, config) if case.target is not None else _tensors_targetless(case, config)
    loss, grad = _triton.forward(config, x, target, coef, tuning=SMALL_BLOCKS)
    ref = case.reference()
    what = f"{case.name} V={vocab}"
    lossspec.assert_close_to_oracle(_reduced_loss(loss, coef), _numpy(grad), ref.loss, ref.grad, dtype=dtype,
                                    g0=ref.g0, what=what)
    if not config.mixture_pass:
        stats = _triton.shard_stats(config, x, target, coef, 0, SMALL_BLOCKS)
        out = torch.empty_like(x)
        _triton.shard_grad(config, _block.finalize(config, stats, vocab), x, target, coef, 0, vocab, out, SMALL_BLOCKS)
        lossspec.compare_grad(_numpy(out), ref.grad, dtype, ref.g0).check()


def _tensors_targetless(case: lossspec.Case, config: lossspec.LossConfig):
    """:func:`_tensors` for a kind without a target (entropy): the coefficients as the dummy target."""
    dtype = DTYPES[case.dtype]
    x = torch.tensor(case.logits).to(dtype).to(DEVICE)
    _, weight = lossspec.token_weights(config, None, case.loss_mask, (x.shape[0],))
    denom = weight.sum()
    if config.normalization == "none":
        denom = 1.0
    coef = torch.tensor(weight / denom if denom > 0 else np.zeros_like(weight), dtype=torch.float32).to(DEVICE)
    return x, coef, coef


# ------------------------------------------------------------------------------------------------
# -inf blocks, NaN / +inf rows
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_all_neg_inf_leading_block(kind: str, dtype: str) -> None:
    """A first block of only ``-inf`` (padded vocabulary) and a ``-inf`` tail: the empty prefix
    must rebase to 0, never NaN."""
    case = lossspec.make_case(kind, "random", lead_shape=(8,), vocab=150, dtype=dtype, seed=11)
    logits = case.logits.copy()
    logits[:, :70] = -np.inf
    logits[:, 145:] = -np.inf
    target = case.target
    if kind == "cross_entropy":
        target = np.where(target >= 0, 70 + np.abs(target) % 75, target)
    else:
        target = target.copy()
        target[:, :70] = -np.inf
        target[:, 145:] = -np.inf
    case = lossspec.Case(kind, "padded", dtype, logits, target, case.loss_mask)
    config = lossspec.make_config(kind)
    x, tgt, coef = _tensors(case, config)
    loss, grad = _triton.forward(config, x, tgt, coef, tuning=SMALL_BLOCKS)
    ref = case.reference()
    lossspec.assert_close_to_oracle(_reduced_loss(loss, coef), _numpy(grad), ref.loss, ref.grad, dtype=dtype, g0=ref.g0)
    assert torch.all(grad[:, :70] == 0) and torch.all(grad[:, 145:] == 0)


def _bad_rows_case(kind: str, dtype: str):
    """Rows 1, 3 (NaN / +inf in the student, in different blocks), 5 (teacher NaN or +inf, or a
    second student NaN for cross-entropy) and 6 (NaN, but masked), the others clean."""
    case = lossspec.make_case(kind, "no_mask", lead_shape=(8,), vocab=150, dtype=dtype, seed=4)
    logits = case.logits.copy()
    target = case.target.copy()
    logits[1, 80] = np.nan
    logits[3, 149] = np.inf
    logits[6, 10] = np.nan
    if kind == "cross_entropy":
        logits[5, 0] = np.nan
    else:
        target[5, 130] = np.nan
        target[7, 20] = np.inf  # 7: teacher +inf
    mask = np.ones(8, dtype=bool)
    mask[6] = False
    bad = [1, 3, 5] + ([] if kind == "cross_entropy" else [7])
    return lossspec.Case(kind, "bad", dtype, logits, target, mask), bad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_nan_and_inf_rows(kind: str, dtype: str) -> None:
    """A NaN or ``+inf`` in a valid row gives a NaN loss AND a NaN gradient row; a masked bad row
    gives 0 and 0; clean rows are unaffected. The same through the shard passes (``s`` NaN)."""
    case, bad = _bad_rows_case(kind, dtype)
    config = lossspec.make_config(kind)
    x, target, coef = _tensors(case, config)
    loss, grad = _triton.forward(config, x, target, coef, tuning=SMALL_BLOCKS)
    good = [r for r in range(8) if r not in bad and r != 6]
    for r in bad:
        assert torch.isnan(loss[r]), r
        assert torch.isnan(grad[r]).all(), r
    assert loss[6] == 0 and torch.all(grad[6] == 0)
    valid = np.zeros(8, dtype=bool)
    valid[good] = True
    ref_l, ref_dz = lossspec.per_token_oracle(config, case.logits, case.target, valid)
    ref_grad = coef.cpu().double().numpy()[:, None] * config.student_scale * ref_dz
    g0 = float(coef.max()) * config.student_scale
    lossspec.compare_loss(_numpy(loss)[good], ref_l[good]).check()
    lossspec.compare_grad(_numpy(grad)[good], ref_grad[good], dtype, g0).check()

    stats = _triton.shard_stats(config, x, target, coef, 0, SMALL_BLOCKS)
    assert torch.isnan(stats.s[bad]).all() and not torch.isnan(stats.s[good]).any()
    assert stats.s[6] == 0 and stats.m[6] == float("-inf")  # masked: empty statistics
    fin = _block.finalize(config, stats, x.shape[1])
    out = torch.empty_like(x)
    _triton.shard_grad(config, fin, x, target, coef, 0, x.shape[1], out, SMALL_BLOCKS)
    for r in bad:
        assert torch.isnan(out[r]).all(), r
    assert torch.all(out[6] == 0)


@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_nan_rows_public_api(kind: str) -> None:
    """Through ``torchloss.<kind>(..., impl="triton", normalization="none")``: NaN per-token loss
    and NaN gradient rows where valid, 0 where masked."""
    case, bad = _bad_rows_case(kind, "float32")
    x = torch.tensor(case.logits).to(DEVICE).requires_grad_()
    target = torch.tensor(case.target).to(DEVICE)
    loss = getattr(torchloss, kind)(x, target, torch.tensor(case.loss_mask).to(DEVICE), normalization="none", impl="triton", tuning=SMALL_BLOCKS)
    loss.sum().backward()
    assert torch.isnan(loss[bad]).all() and loss[6] == 0
    assert torch.isnan(x.grad[bad]).all() and torch.all(x.grad[6] == 0)


# ------------------------------------------------------------------------------------------------
# regrad_: the backward of 16-bit logits for a non-unit upstream gradient
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_regrad_per_token_upstream(kind: str, dtype: str) -> None:
    """``regrad_`` rewrites the rows whose upstream gradient is not exactly 1 with
    ``coef * upstream``, rounded once (within 1 ulp of the oracle gradient times the upstream),
    and leaves the rows with upstream 1 (and coef 0) untouched."""
    options = OPTIONS[kind][1] if kind != "cross_entropy" else {"label_smoothing": 0.05}
    case = lossspec.make_case(kind, "float_weights", lead_shape=(12,), vocab=150, dtype=dtype, seed=8)
    config = lossspec.make_config(kind, normalization="none", **options)
    x, target, coef = _tensors(case, config)
    upstream = torch.tensor([0.37, 1.0, -2.5, 3.0, 1.0, 1e-3, 0.0, 7.25, 1.0, -0.5, 2.0, 0.9], dtype=torch.float32).to(DEVICE)
    final = _triton.final_buffer(x).fill_(float("nan"))  # a statistic the forward failed to keep would show
    _triton.forward(config, x, target, coef, need_grad=False, final=final, tuning=SMALL_BLOCKS)
    sentinel = torch.full(x.shape, 0.125, dtype=x.dtype, device=DEVICE)
    grad = sentinel.clone()
    out = _triton.regrad_(config, x, target, coef, upstream, grad, final=final, tuning=SMALL_BLOCKS)
    assert out is grad
    kept = (upstream == 1) | (coef == 0)
    assert torch.equal(grad[kept], sentinel[kept])
    ref = case.reference(normalization="none", grad_output=_numpy(upstream), **options)
    rows = (~kept).cpu().numpy()
    lossspec.compare_grad(_numpy(grad)[rows], ref.grad[rows], dtype, ref.g0).check()


def test_regrad_reads_the_forwards_final_statistics() -> None:
    """``regrad_`` runs the gradient pass alone, from the statistics ``forward(..., final=)``
    kept: without them it refuses (a second pass 1 is gone), and a buffer of another shape or
    dtype is refused before any launch."""
    case = lossspec.make_case("cross_entropy", "random", lead_shape=(6,), vocab=40, dtype="bfloat16", seed=3)
    config = lossspec.make_config("cross_entropy", normalization="none")
    x, target, coef = _tensors(case, config)
    upstream = torch.full((6,), 0.5, device=DEVICE)
    grad = torch.zeros_like(x)
    with pytest.raises(ValueError, match="final statistics"):
        _triton.regrad_(config, x, target, coef, upstream, grad, tuning=SMALL_BLOCKS)
    for wrong in (torch.empty((len(lossspec.FINAL_STATS), 3), device=DEVICE), _triton.final_buffer(x).double()):
        with pytest.raises(ValueError, match="final must be"):
            _triton.forward(config, x, target, coef, final=wrong, tuning=SMALL_BLOCKS)
        with pytest.raises(ValueError, match="final must be"):
            _triton.regrad_(config, x, target, coef, upstream, grad, final=wrong, tuning=SMALL_BLOCKS)
    # What it reads is the buffer: a row whose kept normaliser is NaN comes out as a bad row (NaN)
    # and a row whose kept maximum moved by log 2 / c comes out halved, the others unchanged.
    final = _triton.final_buffer(x)
    _triton.forward(config, x, target, coef, need_grad=False, final=final, tuning=SMALL_BLOCKS)
    want = _triton.regrad_(config, x, target, coef, upstream, torch.zeros_like(x), final=final.clone(), tuning=SMALL_BLOCKS)
    bad, shifted, *rest = torch.nonzero(coef).flatten().tolist()
    final[lossspec.FINAL_STAT_INDEX["s"], bad] = float("nan")
    final[lossspec.FINAL_STAT_INDEX["m"], shifted] += math.log(2.0) / config.student_scale
    got = _triton.regrad_(config, x, target, coef, upstream, torch.zeros_like(x), final=final, tuning=SMALL_BLOCKS)
    assert torch.isnan(got[bad]).all() and rest and torch.equal(got[rest], want[rest])
    others = torch.arange(x.shape[1], device=DEVICE) != int(target[shifted])  # the label's entry holds the one-hot term too
    torch.testing.assert_close(got[shifted, others].float(), want[shifted, others].float() / 2, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_regrad_scalar_upstream_public_api(kind: str) -> None:
    """``loss.backward(g)`` with a scalar ``g != 1`` on bf16 logits (the driver calls
    ``regrad_``): one rounding, within 1 ulp of the oracle."""
    case = lossspec.make_case(kind, "confident", lead_shape=(10,), vocab=150, dtype="bfloat16", seed=9)
    x = torch.tensor(case.logits).to(torch.bfloat16).to(DEVICE).requires_grad_()
    target = torch.tensor(case.target).to(DEVICE)
    if kind != "cross_entropy":
        target = target.to(torch.bfloat16)
    mask = torch.tensor(case.loss_mask).to(DEVICE)
    loss = getattr(torchloss, kind)(x, target, mask, impl="triton", tuning=SMALL_BLOCKS)
    loss.backward(torch.tensor(-3.7, device=DEVICE))
    ref = case.reference(grad_output=-3.7)
    lossspec.assert_close_to_oracle(loss.detach().cpu().numpy(), _numpy(x.grad), ref.loss, ref.grad, dtype="bfloat16", g0=ref.g0)


# ------------------------------------------------------------------------------------------------
# Through the public functions (the non-vocab-parallel path of the torch driver)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_public_api(kind: str, dtype: str) -> None:
    options = OPTIONS[kind][1]
    case = lossspec.make_case(kind, "float_weights", lead_shape=(4, 3), vocab=130, dtype=dtype, seed=12)
    x = torch.tensor(case.logits).to(DTYPES[dtype]).to(DEVICE).requires_grad_()
    target = torch.tensor(case.target).to(DEVICE)
    if kind != "cross_entropy":
        target = target.to(DTYPES[dtype])
    loss = getattr(torchloss, kind)(x, target, torch.tensor(case.loss_mask).to(DEVICE), impl="triton", tuning=SMALL_BLOCKS, **options)
    loss.backward()
    ref = case.reference(**options)
    lossspec.assert_close_to_oracle(loss.detach().cpu().numpy(), _numpy(x.grad), ref.loss, ref.grad, dtype=dtype,
                                    g0=ref.g0, what=case.name)


# ------------------------------------------------------------------------------------------------
# Pipelined loops (Tuning.num_stages) and persistent programs (Tuning.programs)
# ------------------------------------------------------------------------------------------------

# 3 stages; 5 programs over 12 rows (2 or 3 rows each, masked rows among them); one program for all.
PIPELINED = (lossspec.Tuning(vocab_block=64, num_stages=3, programs=5), lossspec.Tuning(vocab_block=64, num_stages=2, programs=1))


@pytest.mark.parametrize("capped", [False, True], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", lossspec.ALL_KINDS)
def test_pipelined_and_persistent_launches(kind: str, dtype: str, capped: bool) -> None:
    """``Tuning(num_stages=, programs=)``: the forward (also in place), and the 16-bit backward's
    per-token recompute, against the oracle, and bit for bit the default launch's results (a
    launch shape never changes what is computed: the same blocks, in the same order per row)."""
    options: dict = {}
    if capped:
        options["logit_softcap"] = 4.0
        if lossspec.KIND_SPECS[kind].has_teacher:
            options["teacher_logit_softcap"] = 6.0
    case = lossspec.make_case(kind, "float_weights", lead_shape=(12,), vocab=150, dtype=dtype, seed=21)
    config = lossspec.make_config(kind, normalization="none", **options)
    x, target, coef = _tensors(case, config) if case.target is not None else _tensors_targetless(case, config)
    upstream = torch.tensor([0.37, 1.0, -2.5, 3.0, 1.0, 1e-3, 0.0, 7.25, 1.0, -0.5, 2.0, 0.9], dtype=torch.float32).to(DEVICE)
    base_final = _triton.final_buffer(x)
    base_loss, base_grad = _triton.forward(config, x, target, coef, final=base_final, tuning=SMALL_BLOCKS)
    base_regrad = _triton.regrad_(config, x, target, coef, upstream, base_grad.clone(), final=base_final, tuning=SMALL_BLOCKS)
    ref = case.reference(normalization="none", **options)
    ref_up = case.reference(normalization="none", grad_output=_numpy(upstream), **options)
    for tuning in PIPELINED:
        what = f"{case.name} {options} {tuning}"
        final = _triton.final_buffer(x)
        loss, grad = _triton.forward(config, x, target, coef, final=final, tuning=tuning)
        lossspec.assert_close_to_oracle(_numpy(torch.where(coef != 0, coef * loss, 0.0)), _numpy(grad), ref.loss, ref.grad,
                                        dtype=dtype, g0=ref.g0, what=what)
        assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad), what
        buf = x.clone()
        loss_inplace, _ = _triton.forward(config, buf, target, coef, out=buf, tuning=tuning)
        assert torch.equal(loss_inplace, base_loss) and torch.equal(buf, base_grad), what
        regrad = _triton.regrad_(config, x, target, coef, upstream, grad.clone(), final=final, tuning=tuning)
        lossspec.compare_grad(_numpy(regrad), ref_up.grad, dtype, ref_up.g0).check()
        assert torch.equal(regrad, base_regrad), what


# ------------------------------------------------------------------------------------------------
# Named constants, no literal layouts
# ------------------------------------------------------------------------------------------------


def test_constants_are_derived_from_lossspec() -> None:
    for name, kid in lossspec.KIND_IDS.items():
        assert getattr(K, name.upper()).value == kid
    for name, i in lossspec.ROW_STAT_INDEX.items():
        assert getattr(K, f"ROW_{name.upper()}").value == i
    for name in ("m", "s", "mt", "st", "q_coef", "tau", "mean_d"):
        assert getattr(K, f"FIN_{name.upper()}").value == lossspec.FINAL_STAT_INDEX[name]
    source = Path(K.__file__).read_text()
    assert not re.search(r"KIND\s*[=!]=\s*\d", source), "compare kinds with the named constexprs"
    assert not re.search(r"(stats|final|fin|out)\w*\s*\+\s*\d", source), "stat offsets must be named"


def test_shard_stats_fields_follow_lossspec() -> None:
    """``shard_stats`` hands out exactly ``lossspec.stats_used(config)``, each a contiguous
    ``[N]`` tensor; coef == 0 rows hold ``empty_stats``."""
    for kind, options in (("cross_entropy", {}), ("cross_entropy", {"label_smoothing": 0.1}), ("soft_cross_entropy", {}),
                          ("forward_kl", {}), ("reverse_kl", {})):
        config = lossspec.make_config(kind, **options)
        case = lossspec.make_case(kind, "random", lead_shape=(8,), vocab=90, seed=1)
        x, target, coef = _tensors(case, config)
        stats = _triton.shard_stats(config, x, target, coef, 0, SMALL_BLOCKS)
        used = lossspec.stats_used(config)
        assert tuple(f for f in stats._fields if getattr(stats, f) is not None) == used
        empty = _block.empty_stats(config, 8, torch.float32, x.device)
        dead = coef == 0
        assert dead.any()
        for name in used:
            value = getattr(stats, name)
            assert value.shape == (8,) and value.is_contiguous() and value.dtype == torch.float32
            torch.testing.assert_close(value[dead], getattr(empty, name)[dead], rtol=0, atol=0)
        if "n" in used:
            assert torch.all(stats.n[~dead] == 90)
