"""The small JAX model and batch of the micro-batch / data-parallel equivalence tests
(test_distributed_jax.py) and its multi-process worker, with its float64 reference
(tiny_lm_oracle.py). Not a test module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jaxloss
from parity_tests.support import tiny_lm_oracle

try:
    from jax import shard_map  # noqa: F401  (re-exported)
except ImportError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map  # noqa: F401  (re-exported)

BATCH, SEQ, VOCAB_IN, HIDDEN, VOCAB = 8, 5, 11, 6, 40
KIND_OPTIONS = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3},
    "soft_cross_entropy": {"temperature": 1.5},
    "forward_kl": {"temperature": 2.0},
    "reverse_kl": {"temperature": 0.8},
}


def make_problem(kind: str, seed: int = 0, float_weights: bool = False):
    rng = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(rng.normal(0, 1, (VOCAB_IN, HIDDEN)), jnp.float32),
        "head": jnp.asarray(rng.normal(0, 0.5, (HIDDEN, VOCAB)), jnp.float32),
    }
    tokens = rng.integers(0, VOCAB_IN, (BATCH, SEQ))
    # Valid counts per row (4, 1, 5, 2, 0, 0, 3, 1): every data replica of 2 holds some, unevenly
    # (12 / 4); of 4 replicas, replica 2 is all masked (5 / 7 / 0 / 4), and so is micro-batch 2
    # of 4 on one device (and micro-batch 0 of replica 1 with D = 2 x K = 2).
    mask, ignored = tiny_lm_oracle.mask_and_ignored(rng, SEQ)
    loss_mask = np.where(mask, rng.uniform(0.5, 2.0, mask.shape), 0.0).astype(np.float32) if float_weights else mask
    batch = {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(loss_mask)}
    if kind == "cross_entropy":
        labels = rng.integers(0, VOCAB, (BATCH, SEQ))
        for position in ignored:  # an ignored label among the valid positions of each half
            labels[position] = -100
        batch["labels"] = jnp.asarray(labels)
    else:
        batch["teacher"] = jnp.asarray(rng.normal(0, 2, (BATCH, SEQ, VOCAB)), jnp.float32)
    return params, batch


def make_loss_fn(kind: str, normalization: str, vocab_parallel: str | None = None):
    """The model and loss; with ``vocab_parallel``, ``params["head"]`` (and the teacher) are this
    replica's vocabulary columns and the loss combines the shards over that mesh axis."""
    loss = getattr(jaxloss, kind)

    def loss_fn(params, batch, denominator):
        logits = params["emb"][batch["tokens"]] @ params["head"]
        target = batch["labels"] if kind == "cross_entropy" else batch["teacher"]
        return loss(logits, target, batch["loss_mask"], normalization=normalization, denominator=denominator,
                    vocab_parallel=vocab_parallel, **KIND_OPTIONS[kind])

    return loss_fn


def oracle(kind: str, normalization: str, params, batch) -> tuple[float, dict[str, np.ndarray]]:
    """The float64 full-batch loss and parameter gradients (tiny_lm_oracle.py)."""
    target = batch["labels"] if kind == "cross_entropy" else batch["teacher"]
    return tiny_lm_oracle.reference(kind, normalization, params["emb"], params["head"], batch["tokens"], target,
                                     batch["loss_mask"], **KIND_OPTIONS[kind])


def assert_same(loss, grads, ref_loss, ref_grads, what: str) -> None:
    """Against the float64 oracle: loss within 4e-6 max(1, |ref|), each parameter's gradient
    within 4e-6 max|ref| (SPEC sections 6 and 8)."""
    tiny_lm_oracle.assert_matches(loss, {name: np.asarray(g) for name, g in grads.items()}, ref_loss, ref_grads, what)


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)
