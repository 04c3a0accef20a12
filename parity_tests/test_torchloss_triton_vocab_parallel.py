"""Vocab-parallel Triton passes emulated in one process: split V into uneven shards,
``shard_stats`` each, combine them as the collectives would (max of the maxima and the pivot,
rescale to them, sum), ``torchloss._block.finalize``, ``shard_grad`` each shard, concatenate,
and compare with the float64 oracle. Small shapes, 32-column blocks; compiled kernels on CUDA
tensors where CUDA is available, else the Triton interpreter on CPU tensors
(``torch_problem.TRITON_DEVICE``).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import lossspec
from torchloss import _block
from torchloss.backends import triton as _triton

from parity_tests.support.torch_problem import TRITON_DEVICE as DEVICE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VOCAB = 150
# Shard boundaries: three uneven shards (one narrower than a block), and two.
SPLITS = {"3 uneven": (0, 37, 41, VOCAB), "2 uneven": (0, 100, VOCAB)}
OPTIONS = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3, "logit_scale": 0.75},
    "soft_cross_entropy": {"temperature": 2.0, "teacher_logit_scale": 0.5},
    "forward_kl": {"temperature": 0.5, "logit_scale": 1.5},
    "reverse_kl": {"temperature": 3.0, "logit_scale": 0.5, "teacher_logit_scale": 1.25},
}


# 32-column blocks: several blocks per shard and a ragged tail.
SMALL_BLOCKS = lossspec.Tuning(vocab_block=32)


def _inputs(case: lossspec.Case, config: lossspec.LossConfig):
    dtype = DTYPES[case.dtype]
    x = torch.tensor(case.logits).to(dtype).to(DEVICE)
    is_ce = config.kind == "cross_entropy"
    valid, weight = lossspec.token_weights(config, case.target if is_ce else None, case.loss_mask, (x.shape[0],))
    denom = weight.sum()
    coef = torch.tensor(weight / denom if denom > 0 else weight * 0.0, dtype=torch.float32).to(DEVICE)
    target = torch.tensor(np.where(valid, case.target, 0)) if is_ce else torch.tensor(case.target).to(dtype)
    return x, target.to(DEVICE), coef


def _shard(config: lossspec.LossConfig, x: torch.Tensor, target: torch.Tensor, a: int, b: int):
    """This shard's logits and target (global labels for cross-entropy), as a rank holds them."""
    xs = x[:, a:b].contiguous()
    ts = target if config.kind == "cross_entropy" else target[:, a:b].contiguous()
    return xs, ts


def combine_like_collectives(config: lossspec.LossConfig, parts: list) -> _block.Stats:
    """What the all-reduces compute: max of the maxima, the pivot of the shards holding the
    student's maximum (the first such shard on ties), each shard rescaled to them, then one sum."""
    m = torch.stack([p.m for p in parts]).amax(0)
    mt = None if parts[0].mt is None else torch.stack([p.mt for p in parts]).amax(0)
    rescaled = [_block.rescale(config, p, m, mt) for p in parts]
    out = functools.reduce(lossspec.stats.add, rescaled)
    if parts[0].tau is not None:
        # The pivot over the shards (pivot() returns tau; the running maximum goes alongside).
        tau = parts[0].tau
        run_m = parts[0].m
        for p in parts[1:]:
            tau = lossspec.stats.pivot(torch, run_m, tau, p.m, p.tau)
            run_m = torch.maximum(run_m, p.m)
        e_d = functools.reduce(torch.add, [_block.rescale_e_d(config, p, m, tau) for p in parts])
        out = out._replace(tau=tau, e_d=e_d)
    return out


def run_vocab_parallel(config, x, target, coef, cuts, *, fold: bool = False, grad_coef=None):
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        xs, ts = _shard(config, x, target, a, b)
        parts.append(_triton.shard_stats(config, xs, ts, coef, a, SMALL_BLOCKS))
    if fold:
        stats = functools.reduce(lambda p, q: _block.combine(config, p, q), parts)
    else:
        stats = combine_like_collectives(config, parts)
    fin = _block.finalize(config, stats, x.shape[1])
    grads = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        xs, ts = _shard(config, x, target, a, b)
        out = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
        assert _triton.shard_grad(config, fin, xs, ts, coef if grad_coef is None else grad_coef, a, x.shape[1], out, SMALL_BLOCKS) is out
        grads.append(out)
    loss = torch.where(coef != 0, coef.double() * fin.l.double(), 0.0).sum()
    return loss, torch.cat(grads, dim=1), fin, parts


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scenario", ["random", "confident", "huge", "neg_inf", "float_weights", "all_masked"])
@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_vocab_parallel_matches_oracle(kind: str, scenario: str, dtype: str, split: str) -> None:
    if dtype == "float16" and scenario == "huge":
        pytest.skip("|x| up to 1e4 is beyond float16's range")
    options = dict(OPTIONS[kind])
    if scenario == "neg_inf":
        options.pop("label_smoothing", None)  # -inf logits make the smoothed loss +inf
    case = lossspec.make_case(kind, scenario, lead_shape=(10,), vocab=VOCAB, dtype=dtype, seed=21)
    config = lossspec.make_config(kind, **options)
    x, target, coef = _inputs(case, config)
    loss, grad, _, _ = run_vocab_parallel(config, x, target, coef, SPLITS[split])
    ref = case.reference(**options)
    lossspec.assert_close_to_oracle(loss.cpu().numpy(), grad.cpu().double().numpy(), ref.loss, ref.grad, dtype=dtype, g0=ref.g0,
                                    what=f"{case.name} {split} {options}")


@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_fold_combine_equals_collectives(kind: str) -> None:
    """Folding ``torchloss._block.combine`` over the shards is the same algebra as the
    collectives' max / rescale / sum: the same loss and gradient, to rounding."""
    case = lossspec.make_case(kind, "random", lead_shape=(8,), vocab=VOCAB, dtype="float32", seed=2)
    config = lossspec.make_config(kind, **OPTIONS[kind])
    x, target, coef = _inputs(case, config)
    cuts = SPLITS["3 uneven"]
    loss_a, grad_a, fin_a, _ = run_vocab_parallel(config, x, target, coef, cuts)
    loss_b, grad_b, fin_b, _ = run_vocab_parallel(config, x, target, coef, cuts, fold=True)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-5, atol=1e-8)
    if kind == "reverse_kl":
        assert torch.equal(fin_a.tau, fin_b.tau)


def test_label_logit_from_its_owner_only() -> None:
    """``x_y`` is the label's raw logit on the shard that owns the (global) label, 0 elsewhere;
    ``n`` is the shard's width with label smoothing."""
    config = lossspec.make_config("cross_entropy", label_smoothing=0.1)
    case = lossspec.make_case("cross_entropy", "no_mask", lead_shape=(8,), vocab=VOCAB, seed=3)
    x, target, coef = _inputs(case, config)
    target[0], target[1], target[2] = 36, 37, 41  # the last column of shard 0, the first of 1 and of 2
    cuts = SPLITS["3 uneven"]
    for a, b in zip(cuts[:-1], cuts[1:]):
        xs, ts = _shard(config, x, target, a, b)
        stats = _triton.shard_stats(config, xs, ts, coef, a, SMALL_BLOCKS)
        owned = (target >= a) & (target < b) & (coef != 0)  # coef == 0: empty statistics
        expected = torch.where(owned, x.gather(1, target[:, None])[:, 0], 0.0)
        assert torch.equal(stats.x_y, expected)
        assert torch.all(stats.n[coef != 0] == b - a)


@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_bad_row_in_one_shard(kind: str) -> None:
    """A NaN in one shard of a valid row: that shard's ``s`` is NaN, the combined loss is NaN and
    every shard's gradient row is NaN; a masked bad row stays 0."""
    case = lossspec.make_case(kind, "no_mask", lead_shape=(6,), vocab=VOCAB, dtype="bfloat16", seed=5)
    logits = case.logits.copy()
    logits[2, 120] = np.nan
    logits[4, 10] = np.inf
    mask = np.ones(6, dtype=bool)
    mask[4] = False
    target = case.target
    if kind == "cross_entropy":
        target = np.arange(6) * 7  # every label valid (no ignore_index): only the mask drops row 4
    case = lossspec.Case(kind, "bad", "bfloat16", logits, target, mask)
    config = lossspec.make_config(kind)
    x, target, coef = _inputs(case, config)
    loss, grad, fin, parts = run_vocab_parallel(config, x, target, coef, SPLITS["2 uneven"])
    assert torch.isnan(parts[1].s[2]) and not torch.isnan(parts[0].s[2])
    assert torch.isnan(fin.l[2]) and torch.isnan(grad[2]).all()
    assert torch.all(grad[4] == 0) and parts[0].m[4] == float("-inf")
    good = [0, 1, 3, 5]
    assert not torch.isnan(grad[good]).any()


@pytest.mark.parametrize("kind", lossspec.KINDS)
def test_shard_grad_with_upstream(kind: str) -> None:
    """The vocab-parallel backward of 16-bit logits passes ``coef * upstream`` to ``shard_grad``:
    rounded once, within 1 ulp of the oracle."""
    case = lossspec.make_case(kind, "float_weights", lead_shape=(8,), vocab=VOCAB, dtype="bfloat16", seed=6)
    config = lossspec.make_config(kind, **OPTIONS[kind])
    x, target, coef = _inputs(case, config)
    _, grad, _, _ = run_vocab_parallel(config, x, target, coef, SPLITS["3 uneven"], grad_coef=coef * -2.75)
    ref = case.reference(grad_output=-2.75, **OPTIONS[kind])
    lossspec.compare_grad(grad.cpu().double().numpy(), ref.grad, "bfloat16", ref.g0).check()
