"""Worker launched as 4 ranks (gloo on the loopback interface, see ranks.py) by
test_distributed_torch_tp.py: vocab-parallel (P=2) and data x vocab-parallel (D=2 x P=2) splits
of the TinyLM problem of torch_problem.py, for every kind and reduced normalisation.

Layout (every rank creates every group, in the same order)::

    vocab (tensor-parallel) groups  {0, 1}  {2, 3}    tp_rank = rank % 2
    data-parallel groups            {0, 2}  {1, 3}    dp_rank = rank // 2

Vocabulary shards are contiguous, uneven (``SHARDS``) and in TP-group rank order: TP rank ``t``
holds the columns ``[lo_t, hi_t)`` of the full TinyLM head (so the results compare with the one
process, full-batch baseline), and the matching slice of the teacher logits; labels stay global
ids. ``emb`` is replicated; the hidden activations go through :class:`_CopyToVocabShards`
(identity forward, ``all_reduce(SUM)`` over the TP group backward) so ``emb`` receives the
gradient of every vocabulary shard.

Scenarios (``SCENARIOS``):

* ``p2``: P=2, the whole batch, one plain loss call with ``denominator=None`` (each TP pair
  runs it on its own: two independent copies);
* ``p2_k2``: P=2, ``accumulate`` with K=2 on a plain module and no data-parallel group
  (12 and 4 valid tokens in the two micro-batches);
* ``d2p2`` / ``d2p2_k2`` / ``d2p2_k5_empty``: D=2 x P=2, ``DistributedDataParallel(model,
  process_group=dp_group)`` and ``accumulate`` with K=1 / 2 / 5 (4 local rows in 5 micro-batches:
  one is empty); data replica 0 holds rows 0-3 (12 valid), replica 1 rows 4-7 (4 valid, its
  first micro-batch of 2 all masked);
* ``d2p2_plain_k2``: D=2 x P=2 without DDP: ``accumulate`` on the plain module with
  ``group=dp_group`` (counts and gradients summed over the data-parallel group only).

Inside the worker: TP partners hold bit-identical losses and ``emb`` gradients, DP replicas hold
bit-identical losses and gradients (``emb`` and their head shard), and so every rank holds the
same loss and ``emb`` gradient. Each rank writes ``r{rank}.npz`` (loss, ``emb`` gradient, its head
shard's gradient) to the directory in argv[1]; the test concatenates the shards.
Not a test module itself (no test_ prefix).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist


from parity_tests.support.ranks import finish, init_gloo
from parity_tests.support.torch_problem import KIND_OPTIONS, KINDS, NORMALIZATIONS, VOCAB, make_model, make_problem

import torchloss
from torchloss.distributed import accumulate

WORLD = 4
SHARDS = (16, 24)  # uneven vocabulary shards of VOCAB = 40, in TP-group rank order
BOUNDS = tuple(int(b) for b in np.concatenate(([0], np.cumsum(SHARDS))))
assert BOUNDS[-1] == VOCAB
# name: (how, number of micro-batches). how: "call" one plain loss call with denominator=None;
# "plain" accumulate on the plain module, no data-parallel group; "ddp" DDP over the data-parallel
# group; "plain_dp" accumulate on the plain module with group=<the data-parallel group>.
SCENARIOS = {
    "p2": ("call", 1),
    "p2_k2": ("plain", 2),
    "d2p2": ("ddp", 1),
    "d2p2_k2": ("ddp", 2),
    "d2p2_k5_empty": ("ddp", 5),
    "d2p2_plain_k2": ("plain_dp", 2),
}


class _CopyToVocabShards(torch.autograd.Function):
    """Identity forward; backward sums the incoming gradient over the vocab-parallel group (each
    shard of the head contributes its part of d loss / d hidden)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class VocabShardedLM(torch.nn.Module):
    """TinyLM with its head split by columns: ``emb`` replicated, ``head[:, lo:hi]`` local."""

    def __init__(self, tp_group: dist.ProcessGroup, lo: int, hi: int) -> None:
        super().__init__()
        full = make_model()
        self.tp_group = tp_group
        self.emb = torch.nn.Parameter(full.emb.detach().clone())
        self.head = torch.nn.Parameter(full.head.detach()[:, lo:hi].clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = _CopyToVocabShards.apply(self.emb[tokens], self.tp_group)
        return hidden @ self.head  # this rank's slice of the logits


def tp_loss_fn_for(kind: str, normalization: str, tp_group: dist.ProcessGroup, lo: int, hi: int):
    loss = getattr(torchloss, kind)

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor], denominator) -> torch.Tensor:
        logits = model(batch["tokens"])
        target = batch["labels"] if kind == "cross_entropy" else batch["teacher"][..., lo:hi]
        return loss(logits, target, batch["loss_mask"], normalization=normalization, denominator=denominator,
                    vocab_parallel=tp_group, **KIND_OPTIONS[kind])

    return loss_fn


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _assert_equal_over(group: dist.ProcessGroup, tensor: torch.Tensor, what: str) -> None:
    gathered = _gather(tensor, group)
    for index, other in enumerate(gathered[1:], start=1):
        assert torch.equal(gathered[0], other), f"{what}: group member {index} differs from member 0"


def main(out_dir: str, kinds: tuple[str, ...] = KINDS, normalizations: tuple[str, ...] = NORMALIZATIONS) -> None:
    rank, world = init_gloo()
    assert world == WORLD, f"run with {WORLD} ranks, not {world}"
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_rank, dp_rank = rank % 2, rank // 2
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    assert dist.get_rank(tp_group) == tp_rank and dist.get_rank(dp_group) == dp_rank
    lo, hi = BOUNDS[tp_rank], BOUNDS[tp_rank + 1]

    results: dict[str, np.ndarray] = {}
    for kind in kinds:
        for normalization in normalizations:
            batch = make_problem(kind, float_weights=(normalization == "sum"))
            rows = batch["tokens"].shape[0] // 2
            local = {key: value[dp_rank * rows : (dp_rank + 1) * rows] for key, value in batch.items()}
            loss_fn = tp_loss_fn_for(kind, normalization, tp_group, lo, hi)
            for name, (how, k) in SCENARIOS.items():
                model = VocabShardedLM(tp_group, lo, hi)
                if how == "call":
                    loss = loss_fn(model, batch, None)
                    loss.backward()
                    loss = loss.detach()
                elif how == "plain":
                    loss = accumulate(loss_fn, model, batch, num_microbatches=k, normalization=normalization)
                elif how == "ddp":  # accumulate counts over DDP's process group: the data-parallel one
                    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group)
                    loss = accumulate(loss_fn, ddp, local, num_microbatches=k, normalization=normalization)
                else:
                    assert how == "plain_dp"
                    loss = accumulate(loss_fn, model, local, num_microbatches=k, normalization=normalization,
                                      group=dp_group)
                key = f"{kind}/{normalization}/{name}"
                assert model.head.grad.shape == (model.emb.shape[1], hi - lo)
                results[key + "/loss"] = loss.numpy().copy()
                results[key + "/grad/emb"] = model.emb.grad.numpy().copy()
                results[key + "/grad/head_shard"] = model.head.grad.numpy().copy()

    for key in sorted(results):
        value = torch.from_numpy(results[key])
        if not key.endswith("/head_shard"):
            _assert_equal_over(tp_group, value, f"vocab-parallel partners' {key}")
            _assert_equal_over(dist.group.WORLD, value, f"all ranks' {key}")
        _assert_equal_over(dp_group, value, f"data-parallel replicas' {key}")
    np.savez(os.path.join(out_dir, f"r{rank}.npz"), **results)
    print(f"[rank {rank}] tp {tp_rank} dp {dp_rank}: {len(results)} results checked across replicas", flush=True)
    finish(rank)


if __name__ == "__main__":
    # argv: OUT_DIR [KIND,... [NORMALIZATION,...]] (default: all of them)
    chosen = [tuple(arg.split(",")) for arg in sys.argv[2:4]]
    main(sys.argv[1], *chosen)
