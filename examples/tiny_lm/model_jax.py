"""The tiny LM in Flax NNX with a tied, fused head (``jaxloss.nnx`` modules), trained with
``jaxloss.distributed.accumulate``."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import jaxloss.nnx as headnn
from jaxloss.distributed import accumulate

from .weights import LN_EPS

try:
    from jax import shard_map
except ImportError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map

StepFn = Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, Any]]


def _layer_norm(x: jax.Array, gain: jax.Array, bias: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + LN_EPS) * gain + bias


class TinyLM(nnx.Module):
    """Embedding, one pre-LN transformer block (one attention head, GELU MLP); returns the final
    hidden states, the head being the tied embedding table (``weights.py``)."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        for name, value in weights.items():
            setattr(self, name, nnx.Param(jnp.asarray(value)))

    def __call__(self, tokens: jax.Array, segment_ids: Optional[jax.Array] = None) -> jax.Array:
        """``tokens [B, T]`` (and the packed documents' ``segment_ids [B, T]``) -> ``[B, T, H]``."""
        seq = tokens.shape[-1]
        x = self.tok_emb[...][tokens] + self.pos_emb[...][:seq]
        h = _layer_norm(x, self.ln1_g[...], self.ln1_b[...])
        q, k, v = h @ self.wq[...], h @ self.wk[...], h @ self.wv[...]
        scores = (q @ jnp.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1]).astype(np.float32)
        allowed = jnp.tril(jnp.ones((seq, seq), bool))
        if segment_ids is not None:  # a token attends to its own document only
            allowed = allowed & (segment_ids[..., :, None] == segment_ids[..., None, :])
        scores = jnp.where(allowed, scores, -1e30)
        x = x + jax.nn.softmax(scores, axis=-1) @ v @ self.wo[...]
        h = _layer_norm(x, self.ln2_g[...], self.ln2_b[...])
        x = x + jax.nn.gelu(h @ self.w1[...] + self.b1[...], approximate=True) @ self.w2[...] + self.b2[...]
        return _layer_norm(x, self.lnf_g[...], self.lnf_b[...])


def hidden_of(weights: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    return np.asarray(TinyLM(weights)(jnp.asarray(tokens)))


def head_loss(kind: str, temperature: float = 1.0) -> nnx.Module:
    """The fused head's loss module: ``(hidden, tok_emb, labels | teacher_hidden, teacher_weight)``."""
    if kind == "cross_entropy":
        return headnn.LinearCrossEntropyLoss()
    classes = {"forward_kl": headnn.LinearForwardKLLoss, "reverse_kl": headnn.LinearReverseKLLoss,
               "soft_cross_entropy": headnn.LinearSoftCrossEntropyLoss}
    return classes[kind](temperature=temperature)


def make_step(graphdef: Any, *, kind: str, num_microbatches: int = 1, replicas: int = 1, naive: bool = False,
              temperature: float = 1.0, teacher_weight: Optional[np.ndarray] = None) -> StepFn:
    """``step(state, batch) -> (loss, grads)`` of one optimizer step: the full-batch loss and
    gradients through ``accumulate`` (K micro-batches, ``shard_map`` over ``replicas`` devices),
    or with ``naive=True`` the mean over micro-batches of each one's own mean."""
    criterion = head_loss(kind, temperature)
    teacher_w = None if teacher_weight is None else jnp.asarray(teacher_weight)

    def loss_fn(state: Any, microbatch: dict[str, jax.Array], denominator: Any) -> jax.Array:
        model = nnx.merge(graphdef, state)
        hidden = model(microbatch["tokens"])
        # Tied head: the embedding table [V, H] is the head's weight; its gradient sums both uses.
        targets = (microbatch["labels"],) if kind == "cross_entropy" else (microbatch["teacher_hidden"], teacher_w)
        return criterion(hidden, model.tok_emb[...], *targets, loss_mask=microbatch["loss_mask"], denominator=denominator)

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
    return step_fn


def _device_batch(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {key: jnp.asarray(value) for key, value in batch.items()}


def first_step(weights: dict[str, np.ndarray], batch: dict[str, np.ndarray], **options: Any) -> tuple[float, dict[str, np.ndarray]]:
    """One step's ``(loss, {name: gradient})`` (NumPy) from ``weights``; ``options``: :func:`make_step`'s."""
    graphdef, state = nnx.split(TinyLM(weights))
    loss, grads = jax.jit(make_step(graphdef, **options))(state, _device_batch(batch))
    return float(loss), {name: np.asarray(value) for name, value in nnx.to_pure_dict(grads).items()}


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
    """Plain SGD over ``batches``; returns the logged loss of every step (the full-batch loss,
    or for ``naive=True`` the mean of micro-batch means a plain accumulation loop logs) and the
    final weights. ``replicas > 1`` runs data-parallel over that many devices with ``shard_map``.
    Distillation batches hold ``teacher_hidden`` ``[B, T, Ht]``; ``teacher_weight`` ``[V, Ht]``."""
    graphdef, state = nnx.split(TinyLM(weights))
    step_fn = make_step(graphdef, kind=kind, num_microbatches=num_microbatches, replicas=replicas, naive=naive,
                        temperature=temperature, teacher_weight=teacher_weight)

    @jax.jit
    def update(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
        loss, grads = step_fn(state, batch)
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, state, grads), loss

    losses = []
    for index, batch in enumerate(batches):
        state, loss = update(state, _device_batch(batch))
        losses.append(float(loss))
        if progress is not None:
            progress(index)
    final = {name: np.asarray(value) for name, value in nnx.to_pure_dict(state).items()}
    return losses, final


def _count(microbatch: dict[str, jax.Array]) -> jax.Array:
    from jaxloss import count_denominator

    return count_denominator(loss_mask=microbatch["loss_mask"])
