"""torchloss ``entropy`` and ``jensen_shannon`` against the float64 oracle at the SPEC bounds.

Torch path: both kinds x every scenario x {float32, bfloat16}, the normalisations rotated through
(every kind x dtype x normalisation covered), options, beta (the end points run the KL formulas),
multi-block rows (JSD's extra pass), the 16-bit recompute for a non-unit upstream gradient, NaN /
+inf rows, ``nn`` modules, ``torch.compile``. Triton and ``vocab_parallel`` (2 gloo ranks, uneven
shards; torch and Triton backends): slow. The Triton cases run on ``torch_problem.TRITON_DEVICE``
(compiled on CUDA tensors where CUDA is available, else interpreted on CPU tensors), inputs made on
the host either way; the gloo ranks' Triton row needs the interpreter and is skipped where CUDA is
available.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch
from parity_tests.support.torch_cases import TORCH_DTYPES, quiet

import lossspec
import torchloss

from parity_tests.support import ranks
from parity_tests.support.torch_problem import TRITON_DEVICE, device_for

KINDS = lossspec.ENTROPY_JSD_KINDS
DTYPES = ("float32", "bfloat16")
NORMALIZATIONS = lossspec.NORMALIZATIONS
OPTIONS = {
    "entropy": {"temperature": 1.6, "logit_scale": 1.2},
    "jensen_shannon": {"beta": 0.3, "temperature": 1.4, "logit_scale": 0.9, "teacher_logit_scale": 1.2},
}


def _case(kind: str, scenario: str, dtype: str = "float32", **kwargs: Any) -> lossspec.Case:
    return lossspec.make_case(kind, scenario, dtype=dtype, **kwargs)


def _call(kind: str, logits: Any, target: Any, mask: Any, **options: Any) -> torch.Tensor:
    fn = getattr(torchloss, kind)
    return fn(logits, mask, **options) if kind == "entropy" else fn(logits, target, mask, **options)


def run(case: lossspec.Case, impl: str = "torch", grad_output: Any = None, tuning: Optional[lossspec.Tuning] = None,
        **options: Any) -> tuple[np.ndarray, np.ndarray]:
    """Inputs made on the host; impl="triton" runs on ``TRITON_DEVICE`` (compiled kernels on
    CUDA, else the interpreter on the CPU), the torch path on the CPU; results back on the host."""
    device = device_for(impl)
    dtype = TORCH_DTYPES[case.dtype]
    logits = torch.from_numpy(case.logits).to(dtype).to(device).requires_grad_(True)
    target = None if case.target is None else torch.from_numpy(case.target).to(dtype).to(device)
    mask = None if case.loss_mask is None else torch.from_numpy(np.array(case.loss_mask)).to(device)
    with quiet():
        loss = _call(case.kind, logits, target, mask, impl=impl, tuning=tuning, **options)
        assert loss.dtype == torch.float32
        upstream = torch.ones_like(loss) if grad_output is None else torch.as_tensor(grad_output, dtype=loss.dtype).to(device)
        loss.backward(upstream.expand_as(loss))
    assert logits.grad is not None and logits.grad.dtype == dtype
    return loss.detach().cpu().double().numpy(), logits.grad.cpu().double().numpy()


def check(case: lossspec.Case, impl: str = "torch", grad_output: Any = None, tuning: Optional[lossspec.Tuning] = None, **options: Any) -> None:
    ref_options = dict(options)
    if grad_output is not None:
        ref_options["grad_output"] = np.asarray(grad_output, np.float64)
    ref = case.reference(**ref_options)
    loss, grad = run(case, impl, grad_output, tuning, **options)
    lossspec.assert_close_to_oracle(loss, grad, ref.loss, ref.grad, dtype=case.dtype, g0=ref.g0, what=f"{impl} {case.name} {options}")


MATRIX = [
    (kind, scenario, dtype, NORMALIZATIONS[(i + j + k) % len(NORMALIZATIONS)])
    for (i, kind), (j, scenario), (k, dtype) in itertools.product(enumerate(KINDS), enumerate(lossspec.SCENARIOS), enumerate(DTYPES))
]


@pytest.mark.parametrize("kind,scenario,dtype,normalization", MATRIX)
def test_torch_matrix(kind: str, scenario: str, dtype: str, normalization: str) -> None:
    check(_case(kind, scenario, dtype), normalization=normalization)


@pytest.mark.parametrize("scenario", ("random", "huge", "neg_inf", "confident", "float_weights"))
@pytest.mark.parametrize("kind", KINDS)
def test_torch_options(kind: str, scenario: str) -> None:
    for dtype in DTYPES:
        check(_case(kind, scenario, dtype), normalization="valid_tokens", **OPTIONS[kind])


@pytest.mark.parametrize("beta", (0.0, 0.05, 0.5, 0.95, 1.0))
def test_torch_beta(beta: float) -> None:
    case = _case("jensen_shannon", "neg_inf")
    check(case, normalization="none", beta=beta)
    if beta in (0.0, 1.0):
        kl = "forward_kl" if beta == 0.0 else "reverse_kl"
        x, t = torch.from_numpy(case.logits), torch.from_numpy(case.target)
        mask = torch.from_numpy(case.loss_mask)
        got = torchloss.jensen_shannon(x, t, mask, beta=beta, normalization="none")
        want = getattr(torchloss, kl)(x, t, mask, normalization="none")
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_multi_block_rows(kind: str) -> None:
    """Rows longer than one block (two passes; three for the JSD), a 16-bit recompute for a
    non-unit per-token upstream gradient, and fp64 logits (computed in fp64)."""
    tuning = lossspec.Tuning(vocab_block=24)
    upstream = np.random.default_rng(0).uniform(0.5, 2.0, (3, 5)).astype(np.float32)
    for dtype in ("float32", "bfloat16"):
        case = _case(kind, "neg_inf", dtype, vocab=101, lead_shape=(3, 5))
        check(case, normalization="none", grad_output=upstream, tuning=tuning, **OPTIONS[kind])
        check(case, normalization="tokens", tuning=tuning)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_gradcheck_fp64(kind: str) -> None:
    """torch.autograd.gradcheck in fp64 (the analytic gradient of the torch path)."""
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.normal(0, 2, (3, 7)), dtype=torch.float64, requires_grad=True)
    t = torch.tensor(rng.normal(0, 2, (3, 7)), dtype=torch.float64)
    mask = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda z: _call(kind, z, t, mask, normalization="sum", **OPTIONS[kind]), (x,))


def _poisoned(kind: str) -> tuple[lossspec.Case, list[int]]:
    case = _case(kind, "no_mask", vocab=40, lead_shape=(8,))
    logits = case.logits.copy()
    logits[2, 10] = np.nan
    logits[5, 20] = np.inf
    logits[6, :] = np.nan
    target = None if case.target is None else case.target.copy()
    bad = [2, 5]
    if target is not None:
        target[4, 3] = np.nan
        bad.append(4)
    mask = np.ones(8, bool)
    mask[6] = False
    return dataclasses.replace(case, logits=logits, target=target, loss_mask=mask), bad


def _check_poisoned(kind: str, impl: str) -> None:
    case, bad = _poisoned(kind)
    good = [i for i in range(8) if i not in bad and i != 6]
    loss, grad = run(case, impl, normalization="none")
    ref = case.reference(normalization="none")
    assert np.all(np.isnan(loss[bad])) and np.all(np.isnan(grad[bad]))
    assert loss[6] == 0.0 and np.all(grad[6] == 0.0)
    lossspec.compare_loss(loss[good], ref.loss[good]).check()
    lossspec.compare_grad(grad[good], ref.grad[good], "float32", ref.g0).check()


@pytest.mark.parametrize("kind", KINDS)
def test_nan_and_inf_rows(kind: str) -> None:
    _check_poisoned(kind, "torch")


@pytest.mark.parametrize("vocab_block", (None, 24))
@pytest.mark.parametrize("dtype", DTYPES)
def test_jsd_zero_probabilities_on_one_side_and_dead_rows(dtype: str, vocab_block: Optional[int]) -> None:
    """Entries where only the student's or only the teacher's probability is 0 (a ``-inf`` on one
    side, or an exponential that underflows), beside a row whose teacher is all ``-inf`` (no
    teacher distribution: the oracle's loss is NaN, and its gradient wherever q > 0; only the mixture sums carry
    it, the exp-sum is 0, not NaN) and a row whose student is all ``-inf`` (NaN loss, zero
    gradient), whole rows (the in-place mixture pass, ``_block._mixture_terms_inplace``) and rows
    of several blocks (the shared algebra): against the oracle, NaN where it is NaN."""
    rng = np.random.default_rng(3)
    rows, vocab = 12, 64
    x = rng.normal(0, 2, (rows, vocab))
    t = rng.normal(0, 2, (rows, vocab))
    x[rng.random((rows, vocab)) < 0.15] = -np.inf
    t[rng.random((rows, vocab)) < 0.15] = -np.inf
    x[4, :8] = -90.0  # q underflows fp32 where p does not
    t[6, :8] = -90.0
    t[1] = -np.inf
    x[2] = -np.inf
    case = _case("jensen_shannon", "random", dtype, vocab=vocab, lead_shape=(rows,))
    # values of the dtype (the oracle's reference is of the inputs the losses are given)
    exact = lambda a: torch.from_numpy(a).to(TORCH_DTYPES[dtype]).to(torch.float64).numpy().astype(case.logits.dtype)  # noqa: E731
    case = dataclasses.replace(case, logits=exact(x), target=exact(t), loss_mask=None)
    tuning = None if vocab_block is None else lossspec.Tuning(vocab_block=vocab_block)
    for beta in (0.2, 0.5):
        loss, grad = run(case, "torch", None, tuning, normalization="none", beta=beta)
        ref = case.reference(normalization="none", beta=beta)
        assert np.array_equal(np.isnan(loss), np.isnan(ref.loss)) and np.isnan(ref.loss[[1, 2]]).all()
        assert np.array_equal(np.isnan(grad), np.isnan(ref.grad)) and np.isnan(grad[1]).any() and (grad[2] == 0).all()
        good = [i for i in range(rows) if i not in (1, 2)]
        lossspec.compare_loss(loss[good], ref.loss[good]).check()
        lossspec.compare_grad(grad[good], ref.grad[good], dtype, ref.g0).check()


@pytest.mark.parametrize("kind", KINDS)
def test_nn_module_and_errors(kind: str) -> None:
    case = _case(kind, "random")
    module = {"entropy": torchloss.nn.EntropyLoss, "jensen_shannon": torchloss.nn.JensenShannonLoss}[kind](**OPTIONS[kind])
    x = torch.from_numpy(case.logits)
    mask = torch.from_numpy(case.loss_mask)
    loss = module(x, mask) if kind == "entropy" else module(x, torch.from_numpy(case.target), mask)
    lossspec.compare_loss(loss.item(), case.reference(**OPTIONS[kind]).loss).check()
    with pytest.raises(ValueError, match="beta must be in"):
        torchloss.jensen_shannon(x, x, beta=-0.5)
    with pytest.raises(ValueError, match="teacher_logits must have the shape of logits"):
        torchloss.jensen_shannon(x, x[:, :5])
    with pytest.raises(TypeError, match="unexpected keyword argument 'teacher_logit_scale'"):
        torchloss.entropy(x, teacher_logit_scale=2.0)
    with pytest.raises(TypeError, match="EntropyLoss got unexpected option"):
        torchloss.nn.EntropyLoss(beta=0.5)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_compile(kind: str) -> None:
    """Under torch.compile the custom op carries beta (a non-default value must not be lost)."""
    case = _case(kind, "random")
    x = torch.from_numpy(case.logits).requires_grad_(True)
    t = None if case.target is None else torch.from_numpy(case.target)
    mask = torch.from_numpy(case.loss_mask)
    compiled = torch.compile(lambda z: _call(kind, z, t, mask, **OPTIONS[kind]), backend="eager", fullgraph=True)
    loss = compiled(x)
    loss.backward()
    ref = case.reference(**OPTIONS[kind])
    lossspec.assert_close_to_oracle(loss.item(), x.grad.numpy(), ref.loss, ref.grad, dtype="float32", g0=ref.g0)


# --------------------------------------------------------------------------------------------
# Triton (on TRITON_DEVICE) and vocab-parallel (Triton row without CUDA only): slow
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_triton_matches_oracle(kind: str, dtype: str) -> None:
    tuning = lossspec.Tuning(vocab_block=32)  # several blocks and a ragged tail
    for scenario, norm in (("neg_inf", "valid_tokens"), ("huge", "none"), ("float_weights", "sum")):
        check(_case(kind, scenario, dtype, vocab=75, lead_shape=(6,)), "triton", normalization=norm, tuning=tuning, **OPTIONS[kind])
    upstream = np.linspace(0.5, 2.0, 6).astype(np.float32)  # the 16-bit regrad kernel
    check(_case(kind, "random", dtype, vocab=75, lead_shape=(6,)), "triton", grad_output=upstream, normalization="none", tuning=tuning)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_nan_and_inf_rows(kind: str) -> None:
    _check_poisoned(kind, "triton")


VP_LEAD, VP_VOCAB, VP_SHARDS = (3, 6), 37, (15, 22)
VP_CONFIGS = (("random", "valid_tokens", "torch"), ("neg_inf", "none", "torch"), ("huge", "sum", "torch"), ("neg_inf", "none", "triton"))
# The gloo ranks hold CPU tensors, so their Triton row needs the Triton interpreter, which is on
# only where CUDA is unavailable: with CUDA the ranks leave it out and its test is skipped.
VP_TRITON = TRITON_DEVICE.type == "cpu"
VP_TRITON_SKIP = (
    "CUDA is available: the gloo ranks' CPU tensors would need the Triton interpreter (off with CUDA); "
    "the compiled kernels' vocab-parallel passes are checked by test_torchloss_triton_vocab_parallel.py"
)


def _vp_case(kind: str, scenario: str) -> lossspec.Case:
    return lossspec.make_case(kind, scenario, lead_shape=VP_LEAD, vocab=VP_VOCAB, seed=5)


def _vp_worker(out_dir: str) -> None:
    import torch.distributed as dist

    rank, _ = ranks.init_gloo()
    lo, hi = int(np.cumsum((0,) + VP_SHARDS)[rank]), int(np.cumsum((0,) + VP_SHARDS)[rank + 1])
    results: dict[str, np.ndarray] = {}
    for kind in KINDS:
        for scenario, norm, impl in VP_CONFIGS:
            if impl == "triton" and not VP_TRITON:
                continue
            case = _vp_case(kind, scenario)
            logits = torch.tensor(case.logits[..., lo:hi]).requires_grad_(True)
            target = None if case.target is None else torch.tensor(case.target[..., lo:hi])
            mask = None if case.loss_mask is None else torch.tensor(case.loss_mask)
            with quiet():
                loss = _call(kind, logits, target, mask, normalization=norm, vocab_parallel=dist.group.WORLD, impl=impl, **OPTIONS[kind])
                loss.sum().backward()
            key = f"{kind}/{scenario}/{norm}/{impl}"
            results[key + "/loss"] = loss.detach().double().numpy()
            results[key + "/grad"] = logits.grad.double().numpy()
    np.savez(os.path.join(out_dir, f"r{rank}.npz"), **results)
    ranks.finish(rank)


@pytest.fixture(scope="module")
def vp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, np.ndarray]]:
    return ranks.launch_once("entropy_jsd_vp", Path(__file__), lambda out_dir: [str(out_dir)], len(VP_SHARDS), tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.skipif(not VP_TRITON, reason=VP_TRITON_SKIP))])
@pytest.mark.parametrize("kind", KINDS)
def test_vocab_parallel_matches_oracle(vp_results, kind: str, impl: str) -> None:
    configs = [config for config in VP_CONFIGS if config[2] == impl]
    assert configs
    for scenario, norm, _ in configs:
        case = _vp_case(kind, scenario)
        ref = case.reference(normalization=norm, **OPTIONS[kind])
        key = f"{kind}/{scenario}/{norm}/{impl}"
        assert np.array_equal(vp_results[0][key + "/loss"], vp_results[1][key + "/loss"])
        grad = np.concatenate([r[key + "/grad"] for r in vp_results], axis=-1)
        lossspec.assert_close_to_oracle(vp_results[0][key + "/loss"], grad, ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=key)


if __name__ == "__main__":
    _vp_worker(sys.argv[1])


@pytest.mark.parametrize("kind", KINDS)
def test_nn_module_takes_packed_documents(kind: str) -> None:
    """The module forms pass ``segment_ids`` on (entropy's targetless call too): per-sequence
    normalisation of packed documents against the oracle."""
    from parity_tests.support.packed_problem import packed_case

    case, ids = packed_case(kind)
    module = {"entropy": torchloss.nn.EntropyLoss, "jensen_shannon": torchloss.nn.JensenShannonLoss}[kind](normalization="sequence_mean", **OPTIONS[kind])
    x = torch.from_numpy(case.logits).requires_grad_(True)
    mask = torch.from_numpy(case.loss_mask)
    segment_ids = torch.from_numpy(ids)
    loss = module(x, mask, segment_ids=segment_ids) if kind == "entropy" else module(x, torch.from_numpy(case.target), mask, segment_ids=segment_ids)
    loss.backward()
    ref = case.reference(normalization="sequence_mean", segment_ids=ids, **OPTIONS[kind])
    lossspec.assert_close_to_oracle(loss.item(), x.grad.numpy(), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=f"nn:{kind}")
