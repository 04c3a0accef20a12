"""The tiny LM in Flax NNX, trained with ``jaxloss.nnx`` loss modules and ``jaxloss.distributed.accumulate``."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import jaxloss.nnx as lossnn
from jaxloss.distributed import accumulate

from .weights import LN_EPS

try:
    from jax import shard_map
except ImportError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map


def _layer_norm(x: jax.Array, gain: jax.Array, bias: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + LN_EPS) * gain + bias


class TinyLM(nnx.Module):
    """Embedding, one pre-LN transformer block (one attention head, GELU MLP), untied head."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        for name, value in weights.items():
            setattr(self, name, nnx.Param(jnp.asarray(value)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        seq = tokens.shape[-1]
        x = self.tok_emb[...][tokens] + self.pos_emb[...][:seq]
        h = _layer_norm(x, self.ln1_g[...], self.ln1_b[...])
        q, k, v = h @ self.wq[...], h @ self.wk[...], h @ self.wv[...]
        scores = (q @ jnp.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1]).astype(np.float32)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores, -1e30)
        x = x + jax.nn.softmax(scores, axis=-1) @ v @ self.wo[...]
        h = _layer_norm(x, self.ln2_g[...], self.ln2_b[...])
        x = x + jax.nn.gelu(h @ self.w1[...] + self.b1[...], approximate=True) @ self.w2[...] + self.b2[...]
        return _layer_norm(x, self.lnf_g[...], self.lnf_b[...]) @ self.head[...]


def logits_of(weights: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    return np.asarray(TinyLM(weights)(jnp.asarray(tokens)))


def loss_module(kind: str, temperature: float = 1.0) -> nnx.Module:
    if kind == "cross_entropy":
        return lossnn.CrossEntropyLoss()
    classes = {"forward_kl": lossnn.ForwardKLLoss, "reverse_kl": lossnn.ReverseKLLoss,
               "soft_cross_entropy": lossnn.SoftCrossEntropyLoss}
    return classes[kind](temperature=temperature)


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
    progress: Any = None,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """Plain SGD over ``batches``; returns the logged loss of every step (the full-batch loss,
    or for ``naive=True`` the mean of micro-batch means a plain accumulation loop logs) and the
    final weights. ``replicas > 1`` runs data-parallel over that many devices with ``shard_map``."""
    model = TinyLM(weights)
    graphdef, state = nnx.split(model)
    criterion = loss_module(kind, temperature)
    target_key = "labels" if kind == "cross_entropy" else "teacher"

    def loss_fn(state: Any, microbatch: dict[str, jax.Array], denominator: Any) -> jax.Array:
        logits = nnx.merge(graphdef, state)(microbatch["tokens"])
        return criterion(logits, microbatch[target_key], microbatch["loss_mask"], denominator=denominator)

    def exact(state: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        return accumulate(loss_fn, state, batch, num_microbatches=num_microbatches, count_fn=_count,
                          data_axes="data" if replicas > 1 else None)

    def naive_step(state: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        # What a plain accumulation loop does: each micro-batch normalised by its own count,
        # then the K losses and gradients averaged.
        parts = jax.tree_util.tree_map(lambda x: x.reshape((num_microbatches, -1) + x.shape[1:]), batch)
        losses, grads = jax.lax.map(lambda mb: jax.value_and_grad(loss_fn)(state, mb, None), parts)
        return losses.mean(), jax.tree_util.tree_map(lambda g: g.mean(0), grads)

    step_fn = naive_step if naive else exact
    if replicas > 1:
        mesh = Mesh(np.array(jax.devices()[:replicas]), ("data",))
        step_fn = shard_map(step_fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))

    @jax.jit
    def update(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
        loss, grads = step_fn(state, batch)
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, state, grads), loss

    losses = []
    for index, batch in enumerate(batches):
        state, loss = update(state, {key: jnp.asarray(value) for key, value in batch.items()})
        losses.append(float(loss))
        if progress is not None:
            progress(index)
    final = {name: np.asarray(value) for name, value in nnx.to_pure_dict(state).items()}
    return losses, final


def _count(microbatch: dict[str, jax.Array]) -> jax.Array:
    from jaxloss import count_denominator

    return count_denominator(loss_mask=microbatch["loss_mask"])
