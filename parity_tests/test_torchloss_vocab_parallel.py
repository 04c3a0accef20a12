"""Vocab-parallel torchloss (SPEC section 3) with real processes on gloo (loopback).

The module fixture runs this file as a script in 3 processes (launched by ranks.py), which run world size 3
(uneven shards 20/50/30 of V = 100) on the whole group and world size 2 (even shards) on a
sub-group of the first two ranks; every rank runs all kinds x normalisations
{valid_tokens, none} x options x dtypes {float32, bfloat16} x cases {random, huge, neg_inf}, and
every kind with "tokens", "sum" and ``denominator=`` (REDUCED_CONFIGS), on its vocabulary shard and
saves its loss and gradient slice to an .npz. The tests concatenate the
slices and check them against the float64 oracle at the SPEC bounds, and that every rank returns
bit-identical losses. The ranks hold CPU tensors, so their Triton rows need the Triton interpreter,
which is on only where CUDA is unavailable: with CUDA the ranks leave them out and their tests are
skipped (the compiled kernels' vocab-parallel passes: test_torchloss_triton_vocab_parallel.py).
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lossspec

from parity_tests.support import ranks

KINDS = ("cross_entropy", "soft_cross_entropy", "forward_kl", "reverse_kl")
NORMALIZATIONS = ("valid_tokens", "none")
DTYPES = ("float32", "bfloat16")
SCENARIOS = ("random", "huge", "neg_inf")
VOCAB = 100
LEAD = (4, 6)
SHARDS = {2: (50, 50), 3: (20, 50, 30)}
TRITON_CONFIGS = {
    ("cross_entropy", "valid_tokens", "bfloat16", "huge", "smooth_z"),
    ("soft_cross_entropy", "none", "float32", "random", "temp"),
    ("forward_kl", "valid_tokens", "float32", "neg_inf", "temp"),
    ("reverse_kl", "none", "bfloat16", "huge", "temp"),
}


TRITON_SKIP = (
    "CUDA is available: the gloo ranks' CPU tensors would need the Triton interpreter (off with CUDA); "
    "the compiled kernels' vocab-parallel passes are checked by test_torchloss_triton_vocab_parallel.py"
)


def _triton_on_cpu() -> bool:
    """Whether the Triton rows run: the Triton kernel tests' device (``support.torch_problem``) is the CPU."""
    from parity_tests.support.torch_problem import TRITON_DEVICE

    return TRITON_DEVICE.type == "cpu"


# The reduced modes beside valid_tokens, and denominator= (SPEC section 2): (scenario, dtype,
# normalization, denominator, options name, impls).
REDUCED_CONFIGS = (
    ("random", "float32", "tokens", None, "plain", ("torch", "triton")),
    ("float_weights", "float32", "tokens", None, "opts", ("torch",)),
    ("float_weights", "float32", "sum", None, "plain", ("torch",)),
    ("random", "float32", "sum", None, "opts", ("torch", "triton")),
    ("random", "float32", "valid_tokens", 3.0, "opts", ("torch",)),
    ("float_weights", "float32", "tokens", 40.0, "plain", ("torch",)),
    ("random", "bfloat16", "tokens", 7.5, "opts", ("torch",)),
    ("float_weights", "bfloat16", "sum", 2.5, "opts", ("torch",)),
)


def options_for(kind: str, scenario: str) -> dict[str, dict[str, Any]]:
    if kind == "cross_entropy":
        extra = {"z_loss": 1e-3} if scenario == "neg_inf" else {"label_smoothing": 0.1, "z_loss": 1e-3}
        return {"plain": {}, "smooth_z": extra} if scenario != "neg_inf" else {"plain": {}, "z": extra}
    return {"plain": {}, "temp": {"temperature": 1.7, "logit_scale": 1.3, "teacher_logit_scale": 0.8}}


def _configs() -> list[tuple[str, str, str, str, str, dict[str, Any], str]]:
    """Every combination on the torch path; the Triton kernel's statistics / gradient modes
    (interpreted on the CPU: slow) on :data:`TRITON_CONFIGS`."""
    out = []
    for kind, norm, dtype, scenario in itertools.product(KINDS, NORMALIZATIONS, DTYPES, SCENARIOS):
        for opt_name, options in options_for(kind, scenario).items():
            impls = ("torch", "triton") if (kind, norm, dtype, scenario, opt_name) in TRITON_CONFIGS else ("torch",)
            for impl in impls:
                out.append((f"{kind}/{norm}/{dtype}/{scenario}/{opt_name}/{impl}", kind, norm, dtype, scenario, options, impl))
    for kind in KINDS:
        for scenario, dtype, norm, denominator, opt_name, impls in REDUCED_CONFIGS:
            named = options_for(kind, "random")
            options = dict(named["smooth_z" if kind == "cross_entropy" else "temp"] if opt_name == "opts" else {})
            if denominator is not None:
                options["denominator"] = denominator
            for impl in impls:
                key = f"{kind}/{norm}/D={denominator}/{dtype}/{scenario}/{opt_name}/{impl}"
                out.append((key, kind, norm, dtype, scenario, options, impl))
    return out


def _case(kind: str, scenario: str, dtype: str) -> lossspec.Case:
    return lossspec.make_case(kind, scenario, lead_shape=LEAD, vocab=VOCAB, dtype=dtype, seed=7)


def _upstream(norm: str) -> np.ndarray | None:
    """A non-unit per-token upstream gradient for "none" (exercises the 16-bit recompute)."""
    if norm != "none":
        return None
    return np.random.default_rng(3).uniform(0.5, 2.0, size=LEAD).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# The worker (run in spawned processes; the test module never imports torch.distributed state)
# ----------------------------------------------------------------------------------------------


def _worker(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import torchloss

    rank, world_size = ranks.init_gloo()
    fns = {"cross_entropy": torchloss.cross_entropy, "soft_cross_entropy": torchloss.soft_cross_entropy,
           "forward_kl": torchloss.forward_kl, "reverse_kl": torchloss.reverse_kl}
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    # One launch serves every world size: a sub-group of the first ranks for the smaller ones.
    for world in sorted(SHARDS, reverse=True):
        group = dist.group.WORLD if world == world_size else dist.new_group(list(range(world)))
        if rank >= world:
            continue
        bounds = np.concatenate(([0], np.cumsum(SHARDS[world])))
        lo, hi = int(bounds[rank]), int(bounds[rank + 1])
        results: dict[str, np.ndarray] = {}
        triton = _triton_on_cpu()
        for key, kind, norm, dtype, scenario, options, impl in _configs():
            if impl == "triton" and not triton:
                continue
            case = _case(kind, scenario, dtype)
            logits = torch.tensor(case.logits[..., lo:hi], dtype=torch.float32).to(torch_dtype[dtype]).requires_grad_(True)
            if kind == "cross_entropy":
                target = torch.tensor(case.target)
            else:
                target = torch.tensor(case.target[..., lo:hi], dtype=torch.float32).to(torch_dtype[dtype])
            mask = None if case.loss_mask is None else torch.tensor(case.loss_mask)
            loss = fns[kind](logits, target, mask, normalization=norm, vocab_parallel=group, impl=impl, **options)
            upstream = _upstream(norm)
            if upstream is None:
                loss.backward()
            else:
                loss.backward(torch.tensor(upstream))
            results[key + "/loss"] = loss.detach().double().numpy()
            results[key + "/grad"] = logits.grad.float().numpy()
        np.savez(os.path.join(out_dir, f"w{world}_r{rank}.npz"), **results)
    ranks.finish(rank)


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, np.ndarray]]]:
    # once per run, whichever xdist worker asks first (a module fixture runs in every worker)
    out_dir = ranks.launch_dir_once("torch_vocab_parallel", Path(__file__), lambda out_dir: [str(out_dir)], max(SHARDS),
                                    tmp_path_factory)
    loaded: dict[int, list[dict[str, np.ndarray]]] = {}
    for world in SHARDS:
        loaded[world] = []
        for rank in range(world):
            with np.load(out_dir / f"w{world}_r{rank}.npz") as data:
                loaded[world].append({k: data[k] for k in data.files})
    return loaded


CONFIGS = _configs()


@pytest.mark.parametrize("world", sorted(SHARDS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("impl", ("torch", "triton"))
def test_vocab_parallel_matches_oracle(results, world: int, kind: str, impl: str) -> None:
    if impl == "triton" and not _triton_on_cpu():
        pytest.skip(TRITON_SKIP)
    rank_results = results[world]
    checked = 0
    for key, k, norm, dtype, scenario, options, config_impl in CONFIGS:
        if k != kind or config_impl != impl:
            continue
        case = _case(kind, scenario, dtype)
        upstream = _upstream(norm)
        opts = dict(options, normalization=norm)
        if upstream is not None:
            opts["grad_output"] = upstream
        ref = case.reference(**opts)
        losses = [r[key + "/loss"] for r in rank_results]
        for rank, other in enumerate(losses[1:], start=1):
            assert np.array_equal(losses[0], other, equal_nan=True), f"{key}: rank {rank}'s loss differs from rank 0's"
        grad = np.concatenate([r[key + "/grad"] for r in rank_results], axis=-1)
        assert [r[key + "/grad"].shape[-1] for r in rank_results] == list(SHARDS[world])
        lossspec.assert_close_to_oracle(losses[0], grad, ref.loss, ref.grad, dtype=dtype, g0=ref.g0, what=f"w{world}/{key}")
        checked += 1
    if impl == "torch":
        assert checked >= 24 + len(REDUCED_CONFIGS)
    else:  # this kind's TRITON_CONFIGS row and the Triton rows of REDUCED_CONFIGS
        assert checked >= 1 + sum("triton" in impls for *_, impls in REDUCED_CONFIGS)


def test_vocab_parallel_rejects_non_group() -> None:
    import torch

    import torchloss

    with pytest.raises(TypeError, match="vocab_parallel must be a torch.distributed ProcessGroup"):
        torchloss.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]), vocab_parallel="tp")


if __name__ == "__main__":
    _worker(sys.argv[1])
