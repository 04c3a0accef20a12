"""The ``optax.MultiSteps`` recipe of docs/jaxloss.md: gradient accumulation by the optimizer,
with the exact global denominator.

Each optimizer step sees ``K`` micro-batches (uneven sizes, causal_shift with
``labels=input_ids`` and a padding mask). The step's ``D`` is counted first over its ``K``
micro-batches; every micro-step passes ``denominator=D``; ``MultiSteps(...,
use_grad_mean=False)`` sums the ``K`` gradients, so the update it applies is the full-batch
gradient. Three training steps, each compared with the float64 oracle of the whole step batch at
the current parameters (loss, and the applied update divided by ``-lr``). The default
``use_grad_mean=True`` averages instead: then ``denominator=D / K`` gives the same update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxloss
import lossspec

ROWS, TIME, VOCAB, HIDDEN, K, LR, STEPS = 10, 7, 19, 6, 3, 0.5, 3


def loss_fn(params, microbatch, denominator):
    logits = params["emb"][microbatch["input_ids"]] @ params["head"]
    return jaxloss.cross_entropy(logits, microbatch["input_ids"], microbatch["loss_mask"], causal_shift=True,
                                 denominator=denominator)


def oracle(params, batch) -> tuple[float, dict[str, np.ndarray]]:
    """Float64 loss and parameter gradients of the whole step batch (causal_shift)."""
    emb, head = (np.asarray(params[name], np.float64) for name in ("emb", "head"))
    ids = np.asarray(batch["input_ids"])
    hidden = emb[ids]
    loss, grad_logits = lossspec.oracle("cross_entropy", hidden @ head, ids, np.asarray(batch["loss_mask"]), causal_shift=True)
    grad_emb = np.zeros_like(emb)
    np.add.at(grad_emb, ids, grad_logits @ head.T)
    return loss, {"emb": grad_emb, "head": np.einsum("bth,btv->hv", hidden, grad_logits)}


def step_batches(seed: int) -> tuple[dict[str, np.ndarray], list[dict[str, jax.Array]]]:
    """One optimizer step's batch (right-padded sequences) and its K micro-batches (4, 3, 3 rows)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, TIME + 1, ROWS)
    batch = {"input_ids": rng.integers(0, VOCAB, (ROWS, TIME)), "loss_mask": np.arange(TIME)[None, :] < lengths[:, None]}
    bounds = np.cumsum([0] + list(lossspec.microbatch_sizes(ROWS, K)))
    micro = [{key: jnp.asarray(value[a:b]) for key, value in batch.items()} for a, b in zip(bounds[:-1], bounds[1:])]
    return batch, micro


@pytest.mark.parametrize("use_grad_mean", (False, True))
def test_multisteps_with_the_global_denominator_trains_as_the_full_batch(use_grad_mean: bool) -> None:
    rng = np.random.default_rng(0)
    params = {"emb": jnp.asarray(rng.normal(0, 1, (VOCAB, HIDDEN)), jnp.float32),
              "head": jnp.asarray(rng.normal(0, 0.5, (HIDDEN, VOCAB)), jnp.float32)}
    optimizer = optax.MultiSteps(optax.sgd(LR), every_k_schedule=K, use_grad_mean=use_grad_mean)
    state = optimizer.init(params)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    for step in range(STEPS):
        batch, micro = step_batches(step)
        ref_loss, ref_grads = oracle(params, batch)
        denominator = sum(jaxloss.count_denominator(mb["input_ids"], mb["loss_mask"], causal_shift=True) for mb in micro)
        if use_grad_mean:
            denominator = denominator / K  # MultiSteps averages the K gradients: K times each
        total = 0.0
        for index, mb in enumerate(micro):
            loss, grads = grad_fn(params, mb, denominator)
            updates, state = optimizer.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            total += float(loss)
            if index < K - 1:  # accumulating: the parameters do not move
                assert all(np.all(np.asarray(u) == 0) for u in jax.tree_util.tree_leaves(updates))
        logged = total / K if use_grad_mean else total
        lossspec.compare_loss(logged, ref_loss, f"step {step} loss").check()
        for name, update in updates.items():
            applied = np.asarray(update, np.float64) / -LR  # sgd: update = -lr * g, one fp32 rounding
            lossspec.compare_grad(applied, ref_grads[name], "float32", 0.0, f"step {step} grad[{name}]").check()
