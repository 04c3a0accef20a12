"""The packed-documents step in JAX: the tiny LM (document-masked attention, tied head) and
``jaxloss.linear_cross_entropy(..., segment_ids=, normalization="sequence_mean", causal_shift=True)``,
with ``jaxloss.distributed.accumulate`` for micro-batches and ``shard_map`` replicas."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import jaxloss
from jaxloss.distributed import accumulate
from examples.tiny_lm.model_jax import TinyLM, shard_map

from .data import NORMALIZATION

History = dict[str, Any]  # losses [steps]; params, grad_max: [steps] of {name: ...}; first_grads: {name: array}


def make_step(graphdef: Any, *, num_microbatches: int = 1, replicas: int = 1, naive: bool = False) -> Any:
    """``step(state, batch) -> (loss, grads)``: the exact step (``accumulate``: ``S`` counted over
    all micro-batches and replicas) or with ``naive=True`` each micro-batch's own sequence mean,
    averaged over the ``K`` micro-batches (one replica)."""
    if naive and replicas > 1:
        raise ValueError("the naive loop is shown with micro-batches only (replicas=1)")

    def loss_fn(state: Any, microbatch: dict[str, jax.Array], denominator: Any) -> jax.Array:
        model = nnx.merge(graphdef, state)
        hidden = model(microbatch["tokens"], microbatch["segment_ids"])
        # The tied, fused head: the embedding table is the head weight; the logits are never formed.
        return jaxloss.linear_cross_entropy(hidden, model.tok_emb[...], microbatch["labels"], microbatch["loss_mask"],
                                            causal_shift=True, segment_ids=microbatch["segment_ids"],
                                            normalization=NORMALIZATION, denominator=denominator)

    def exact(state: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        return accumulate(loss_fn, state, batch, num_microbatches=num_microbatches, normalization=NORMALIZATION,
                          causal_shift=True, data_axes="data" if replicas > 1 else None)

    def naive_step(state: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        parts = jax.tree_util.tree_map(lambda x: x.reshape((num_microbatches, -1) + x.shape[1:]), batch)
        losses, grads = jax.lax.map(lambda mb: jax.value_and_grad(loss_fn)(state, mb, None), parts)
        return losses.mean(), jax.tree_util.tree_map(lambda g: g.mean(0), grads)

    step_fn = naive_step if naive else exact
    if replicas > 1:
        mesh = Mesh(np.array(jax.devices()[:replicas]), ("data",))
        step_fn = shard_map(step_fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    return step_fn


def _numpy(tree: Any) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in nnx.to_pure_dict(tree).items()}


def first_step(weights: dict[str, np.ndarray], batch: dict[str, np.ndarray], **config: Any) -> tuple[float, dict[str, np.ndarray]]:
    """The first step's ``(loss, {name: gradient})``; ``config``: :func:`make_step`'s options."""
    graphdef, state = nnx.split(TinyLM(weights))
    loss, grads = jax.jit(make_step(graphdef, **config))(state, {k: jnp.asarray(v) for k, v in batch.items()})
    return float(loss), _numpy(grads)


def train(weights: dict[str, np.ndarray], batches: list[dict[str, np.ndarray]], *, lr: float, num_microbatches: int = 1,
          replicas: int = 1, naive: bool = False, progress: Any = None) -> History:
    """Plain SGD; per step: the logged loss, the parameters after the step and ``max|grad|`` of
    each; ``first_grads``: the first step's gradients."""
    graphdef, state = nnx.split(TinyLM(weights))
    step_fn = make_step(graphdef, num_microbatches=num_microbatches, replicas=replicas, naive=naive)

    @jax.jit
    def update(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, jax.Array, Any]:
        loss, grads = step_fn(state, batch)
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, state, grads), loss, grads

    history: History = {"losses": [], "params": [], "grad_max": []}
    for index, batch in enumerate(batches):
        state, loss, grads = update(state, {k: jnp.asarray(v) for k, v in batch.items()})
        if index == 0:
            history["first_grads"] = _numpy(grads)
        grad_max = jax.tree_util.tree_map(lambda g: jnp.max(jnp.abs(g)), grads)
        history["losses"].append(float(loss))
        history["params"].append(_numpy(state))
        history["grad_max"].append({name: float(v) for name, v in _numpy(grad_max).items()})
        if progress is not None:
            progress(index)
    return history
