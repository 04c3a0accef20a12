"""The tiny LM in torch with a tied, fused head (``torchloss.nn`` modules), trained with
``torchloss.distributed.accumulate``."""

from __future__ import annotations

import datetime
import math
import os
import sys
import tempfile
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchloss.nn as headnn
from torchloss.distributed import accumulate

from .weights import LN_EPS


def _layer_norm(x: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + LN_EPS) * gain + bias


class TinyLM(torch.nn.Module):
    """Embedding, one pre-LN transformer block (one attention head, GELU MLP); returns the final
    hidden states, the head being the tied embedding table (``weights.py``)."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        super().__init__()
        for name, value in weights.items():
            self.register_parameter(name, torch.nn.Parameter(torch.tensor(value)))

    def forward(self, tokens: torch.Tensor, segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``tokens [B, T]`` (and the packed documents' ``segment_ids [B, T]``) -> ``[B, T, H]``."""
        p = dict(self.named_parameters())
        seq = tokens.shape[-1]
        x = p["tok_emb"][tokens] + p["pos_emb"][:seq]
        h = _layer_norm(x, p["ln1_g"], p["ln1_b"])
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
        scores = (q @ k.transpose(-1, -2)) / np.float32(math.sqrt(q.shape[-1]))
        allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
        if segment_ids is not None:  # a token attends to its own document only
            allowed = allowed & (segment_ids[..., :, None] == segment_ids[..., None, :])
        scores = torch.where(allowed, scores, torch.tensor(-1e30))
        x = x + torch.softmax(scores, dim=-1) @ v @ p["wo"]
        h = _layer_norm(x, p["ln2_g"], p["ln2_b"])
        x = x + F.gelu(h @ p["w1"] + p["b1"], approximate="tanh") @ p["w2"] + p["b2"]
        return _layer_norm(x, p["lnf_g"], p["lnf_b"])


def hidden_of(weights: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return TinyLM(weights)(torch.tensor(tokens)).numpy()


def head_loss(kind: str, temperature: float = 1.0) -> torch.nn.Module:
    """The fused head's loss module: ``(hidden, tok_emb, labels | teacher_hidden, teacher_weight)``."""
    if kind == "cross_entropy":
        return headnn.LinearCrossEntropyLoss()
    classes = {"forward_kl": headnn.LinearForwardKLLoss, "reverse_kl": headnn.LinearReverseKLLoss,
               "soft_cross_entropy": headnn.LinearSoftCrossEntropyLoss}
    return classes[kind](temperature=temperature)


def _count(microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    from torchloss import count_denominator

    return count_denominator(loss_mask=microbatch["loss_mask"])


def _train_local(
    weights: dict[str, np.ndarray],
    batches: list[dict[str, np.ndarray]],
    *,
    kind: str,
    lr: float,
    num_microbatches: int,
    naive: bool,
    temperature: float,
    teacher_weight: Optional[np.ndarray] = None,
    rank: int = 0,
    world: int = 1,
    progress: Any = None,
    grads_out: Optional[list[dict[str, np.ndarray]]] = None,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """SGD in this process (rank ``rank`` of ``world``); appends each step's gradients to ``grads_out``."""
    model = TinyLM(weights)
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    criterion = head_loss(kind, temperature)
    teacher_w = None if teacher_weight is None else torch.from_numpy(teacher_weight)

    def loss_fn(module: torch.nn.Module, microbatch: dict[str, torch.Tensor], denominator: Any) -> torch.Tensor:
        hidden = module(microbatch["tokens"])
        # Tied head: the embedding table [V, H] is the head's weight; its gradient sums both uses.
        targets = (microbatch["labels"],) if kind == "cross_entropy" else (microbatch["teacher_hidden"], teacher_w)
        return criterion(hidden, model.tok_emb, *targets, loss_mask=microbatch["loss_mask"], denominator=denominator)

    losses = []
    for index, numpy_batch in enumerate(batches):
        rows = numpy_batch["tokens"].shape[0] // world
        batch = {key: torch.from_numpy(np.ascontiguousarray(value[rank * rows : (rank + 1) * rows]))
                 for key, value in numpy_batch.items()}
        model.zero_grad(set_to_none=True)
        if naive:
            parts = [{key: value.tensor_split(num_microbatches)[k] for key, value in batch.items()}
                     for k in range(num_microbatches)]
            logged = 0.0
            for part in parts:
                loss = loss_fn(wrapped, part, None) / num_microbatches  # mean of micro-batch means
                loss.backward()
                logged += float(loss.detach())
        else:
            logged = float(accumulate(loss_fn, wrapped, batch, num_microbatches=num_microbatches, count_fn=_count))
        if grads_out is not None:
            grads_out.append({name: p.grad.numpy().copy() for name, p in model.named_parameters()})
        with torch.no_grad():
            for param in model.parameters():
                param -= lr * param.grad
        losses.append(logged)
        if progress is not None:
            progress(index)
    return losses, {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


def first_step(weights: dict[str, np.ndarray], batch: dict[str, np.ndarray], *, kind: str, num_microbatches: int = 1,
               naive: bool = False, temperature: float = 1.0, teacher_weight: Optional[np.ndarray] = None) -> tuple[float, dict[str, np.ndarray]]:
    """One step's ``(loss, {name: gradient})`` (NumPy) from ``weights``, in this process."""
    grads: list[dict[str, np.ndarray]] = []
    losses, _ = _train_local(weights, [batch], kind=kind, lr=1.0, num_microbatches=num_microbatches, naive=naive,
                             temperature=temperature, teacher_weight=teacher_weight, grads_out=grads)
    return losses[0], grads[0]


def _ddp_worker(rank: int, world: int, init_file: str, kwargs: dict[str, Any], out_path: str) -> None:
    torch.set_num_threads(1)
    if os.path.exists("/sys/class/net/lo"):
        # Gloo otherwise picks its interface by looking up the host name; the ranks all live here.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A FileStore rendezvous (no TCP port to pick) and a bounded wait for every collective.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    losses, final = _train_local(**kwargs, rank=rank, world=world)
    if rank == 0:
        np.savez(out_path, losses=np.asarray(losses), **{f"w_{k}": v for k, v in final.items()})
    dist.barrier()
    # Exit without tearing the gloo group down: freeing its last reference joins gloo's thread
    # while holding the GIL, and that thread may need the GIL to release a finished
    # collective's tensors (a deadlock seen with torch 2.13 on CPU). The OS reclaims the sockets.
    sys.stdout.flush()
    os._exit(0)


def train(
    weights: dict[str, np.ndarray],
    batches: list[dict[str, np.ndarray]],
    *,
    kind: str,
    lr: float,
    num_microbatches: int = 1,
    replicas: int = 1,
    naive: bool = False,
    temperature: float = 1.0,
    teacher_weight: Optional[np.ndarray] = None,
    progress: Any = None,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """Plain SGD over ``batches`` (the torch twin of ``model_jax.train``). ``replicas > 1``
    launches that many processes (gloo on the loopback interface, FileStore rendezvous) training a ``DistributedDataParallel``
    model, each on its share of every batch."""
    kwargs = dict(weights=weights, batches=batches, kind=kind, lr=lr, num_microbatches=num_microbatches,
                  naive=naive, temperature=temperature, teacher_weight=teacher_weight)
    if replicas == 1:
        return _train_local(**kwargs, progress=progress)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank0.npz")
        init_file = os.path.join(tmp, "init_store")
        torch.multiprocessing.spawn(_ddp_worker, args=(replicas, init_file, kwargs, out_path), nprocs=replicas, join=True)
        with np.load(out_path) as data:
            losses = [float(x) for x in data["losses"]]
            final = {key[2:]: data[key] for key in data.files if key.startswith("w_")}
    if progress is not None:
        progress(len(batches) - 1)
    return losses, final
