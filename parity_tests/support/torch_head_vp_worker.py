"""Worker launched as 2 ranks (gloo on the loopback interface, ranks.py) by
test_linear_head_vocab_parallel.py: ``torchloss.linear_<kind>(..., vocab_parallel=group)`` with the
head split along ``V`` in uneven shards (``SHARDS``, rank order; neither a multiple of the
blocked plan's block), ``hidden`` the same on both ranks, for every case of ``CASES``. Each rank
writes ``r{rank}.npz``: per case the loss, the gradient of ``hidden`` and of its weight and bias
shards; the test compares them with the float64 oracle of the whole head. Not a test module.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


from parity_tests.support.head_problem import BATCH, KINDS, OPTIONS, TIME, make_problem, target_args
from parity_tests.support.ranks import finish, init_gloo

import lossspec
import torchloss

WORLD = 2
VOCAB = 23
SHARDS = (9, 14)  # uneven; the blocked plan's blocks of 4 columns: 9 = 2 * 4 + 1, 14 = 3 * 4 + 2
BOUNDS = tuple(int(b) for b in np.concatenate(([0], np.cumsum(SHARDS))))
# (block_elements, blocked_rows): whole shard rows in chunks of 5 tokens (70 // 14), or the
# fallback, chunks of 5 rows and blocks of 4 columns.
PLANS = {"whole": (70, 64), "blocked": (20, 5)}
# name -> (kind, plan, options); "segment_ids": True passes the problem's ids.
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {}
for _kind in KINDS:
    for _plan in PLANS:
        CASES[f"{_kind}/{_plan}/valid_tokens"] = (_kind, _plan, dict(OPTIONS[_kind]))
        CASES[f"{_kind}/{_plan}/none"] = (_kind, _plan, dict(OPTIONS[_kind], normalization="none"))
        # the gradients formed in the backward from the combined row statistics
        CASES[f"{_kind}/{_plan}/recompute"] = (_kind, _plan, dict(OPTIONS[_kind], recompute_logits=True))
    CASES[f"{_kind}/whole/sequence_mean_shift"] = (
        _kind, "whole", dict(OPTIONS[_kind], normalization="sequence_mean", causal_shift=True, segment_ids=True)
    )
# The module form, vocab_parallel given at construction.
CASES["cross_entropy/blocked/module"] = ("cross_entropy", "blocked", dict(OPTIONS["cross_entropy"], module=True))
# precision="tensor" (bfloat16 problems: dtype_of)
CASES["cross_entropy/blocked/tensor"] = ("cross_entropy", "blocked", dict(OPTIONS["cross_entropy"], precision="tensor"))
CASES["reverse_kl/whole/tensor"] = ("reverse_kl", "whole", dict(OPTIONS["reverse_kl"], precision="tensor"))


def dtype_of(options: dict[str, Any]) -> str:
    """The problem's dtype: bfloat16 for ``precision="tensor"`` (its only dtype), else float32."""
    return "bfloat16" if options.get("precision") == "tensor" else "float32"


def upstream(options: dict[str, Any]) -> np.ndarray:
    """A non-unit upstream gradient: per token for ``"none"``, else a scalar."""
    if options.get("normalization") == "none":
        return np.linspace(0.5, 2.0, BATCH * TIME).reshape(BATCH, TIME).astype(np.float32)
    return np.asarray(1.75, np.float32)


def run_case(kind: str, plan: str, options: dict[str, Any], lo: int, hi: int, group: Any) -> dict[str, np.ndarray]:
    dtype = getattr(torch, dtype_of(options))
    problem = make_problem(kind, VOCAB, seed=11, dtype=dtype_of(options))
    block_elements, blocked_rows = PLANS[plan]
    options = dict(options, tuning=lossspec.HeadTuning(block_elements=block_elements, blocked_rows=blocked_rows))
    if options.pop("segment_ids", False):
        options["segment_ids"] = torch.tensor(problem["segment_ids"])
    as_t = lambda a: torch.tensor(a).to(dtype) if np.issubdtype(np.asarray(a).dtype, np.floating) else torch.tensor(a)  # noqa: E731  (exact)
    hidden = as_t(problem["hidden"]).requires_grad_(True)
    weight = as_t(problem["weight"][lo:hi]).requires_grad_(True)
    bias = as_t(problem["bias"][lo:hi]).requires_grad_(True)
    fn = getattr(torchloss, f"linear_{kind}")
    target, extra = target_args(kind, problem, as_t, vocab=slice(lo, hi))
    mask = torch.tensor(problem["loss_mask"])
    if options.pop("module", False):
        loss = torchloss.nn.LinearCrossEntropyLoss(vocab_parallel=group, **options)(hidden, weight, *target, loss_mask=mask, bias=bias)
    else:
        loss = fn(hidden, weight, *target, mask, bias=bias, vocab_parallel=group, **extra, **options)
    loss.backward(torch.tensor(upstream(options)))
    return {
        "loss": loss.detach().numpy().copy(),
        "hidden": hidden.grad.float().numpy().copy(),
        "weight": weight.grad.float().numpy().copy(),
        "bias": bias.grad.float().numpy().copy(),
    }


def main(out_dir: str) -> None:
    rank, world = init_gloo()
    assert world == WORLD, f"run with {WORLD} ranks, not {world}"
    group = dist.new_group(list(range(WORLD)))
    lo, hi = BOUNDS[rank], BOUNDS[rank + 1]
    results: dict[str, np.ndarray] = {}
    for name, (kind, plan, options) in CASES.items():
        for key, value in run_case(kind, plan, options, lo, hi, group).items():
            results[f"{name}/{key}"] = value
    np.savez(os.path.join(out_dir, f"r{rank}.npz"), **results)
    print(f"[rank {rank}] shard [{lo}, {hi}): {len(CASES)} cases", flush=True)
    finish(rank)


if __name__ == "__main__":
    main(sys.argv[1])
