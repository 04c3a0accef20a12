"""The packed-documents step in torch: the tiny LM (document-masked attention, tied head) and
``torchloss.linear_cross_entropy(..., segment_ids=, normalization="sequence_mean", causal_shift=True)``,
with ``torchloss.distributed.accumulate`` for micro-batches. D replicas are simulated in this
process: pass 1 counts on every replica and sums the counts (the all-reduce), pass 2 computes
each replica's gradients separately and sums them (the all-reduce of the gradients)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import torchloss
from torchloss.distributed import accumulate, split_microbatches
from examples.tiny_lm.model_torch import TinyLM

from .data import NORMALIZATION

History = dict[str, Any]


def loss_fn(model: TinyLM, microbatch: dict[str, torch.Tensor], denominator: Any) -> torch.Tensor:
    hidden = model(microbatch["tokens"], microbatch["segment_ids"])
    # The tied, fused head: the embedding table is the head weight; the logits are never formed.
    return torchloss.linear_cross_entropy(hidden, model.tok_emb, microbatch["labels"], microbatch["loss_mask"],
                                          causal_shift=True, segment_ids=microbatch["segment_ids"],
                                          normalization=NORMALIZATION, denominator=denominator)


def count(microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``S`` of one micro-batch: its documents with a scored position."""
    return torchloss.count_denominator(microbatch["labels"], microbatch["loss_mask"], normalization=NORMALIZATION,
                                       causal_shift=True, segment_ids=microbatch["segment_ids"])


def _simulated_replicas(model: TinyLM, batch: dict[str, torch.Tensor], num_microbatches: int, replicas: int) -> float:
    """The D-replica step in one process (gradients left in ``param.grad``); returns the loss."""
    shards = split_microbatches(batch, replicas)
    # Pass 1 on every replica; the sum over replicas is what dist.all_reduce(SUM) would return.
    denominator = torch.stack([count(mb) for shard in shards for mb in split_microbatches(shard, num_microbatches)]).sum()
    total, replica_grads = 0.0, []
    for shard in shards:  # pass 2: each replica's gradients, on its own
        model.zero_grad(set_to_none=True)
        for microbatch in split_microbatches(shard, num_microbatches):
            loss = loss_fn(model, microbatch, denominator)
            loss.backward()
            total += float(loss.detach())
        replica_grads.append([p.grad.clone() for p in model.parameters()])
    for param, *grads in zip(model.parameters(), *replica_grads):  # the gradients' all-reduce (SUM)
        param.grad = torch.stack(grads).sum(0)
    return total


def _naive(model: TinyLM, batch: dict[str, torch.Tensor], num_microbatches: int) -> float:
    """What a plain accumulation loop does: each micro-batch's own sequence mean, averaged over the
    micro-batches."""
    total = 0.0
    for microbatch in split_microbatches(batch, num_microbatches):
        loss = loss_fn(model, microbatch, None) / num_microbatches
        loss.backward()
        total += float(loss.detach())
    return total


def step(model: TinyLM, batch: dict[str, np.ndarray], *, num_microbatches: int = 1, replicas: int = 1, naive: bool = False) -> float:
    """One step's loss, its gradients left in ``param.grad``."""
    tensors = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in batch.items()}
    model.zero_grad(set_to_none=True)
    if naive:
        if replicas > 1:
            raise ValueError("the naive loop is shown with micro-batches only (replicas=1)")
        return _naive(model, tensors, num_microbatches)
    if replicas > 1:
        return _simulated_replicas(model, tensors, num_microbatches, replicas)
    return float(accumulate(loss_fn, model, tensors, num_microbatches=num_microbatches, normalization=NORMALIZATION, causal_shift=True))


def first_step(weights: dict[str, np.ndarray], batch: dict[str, np.ndarray], **config: Any) -> tuple[float, dict[str, np.ndarray]]:
    """The first step's ``(loss, {name: gradient})``; ``config``: :func:`step`'s options."""
    model = TinyLM(weights)
    loss = step(model, batch, **config)
    return loss, {name: p.grad.numpy().copy() for name, p in model.named_parameters()}


def train(weights: dict[str, np.ndarray], batches: list[dict[str, np.ndarray]], *, lr: float, num_microbatches: int = 1,
          replicas: int = 1, naive: bool = False, progress: Any = None) -> History:
    """Plain SGD; per step: the logged loss, the parameters after the step and ``max|grad|`` of
    each; ``first_grads``: the first step's gradients."""
    model = TinyLM(weights)
    history: History = {"losses": [], "params": [], "grad_max": []}
    for index, batch in enumerate(batches):
        loss = step(model, batch, num_microbatches=num_microbatches, replicas=replicas, naive=naive)
        if index == 0:
            history["first_grads"] = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
        history["grad_max"].append({name: float(p.grad.abs().max()) for name, p in model.named_parameters()})
        with torch.no_grad():
            for param in model.parameters():
                param -= lr * param.grad
        history["losses"].append(loss)
        history["params"].append({name: p.detach().numpy().copy() for name, p in model.named_parameters()})
        if progress is not None:
            progress(index)
    return history
