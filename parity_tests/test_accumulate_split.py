"""Uneven micro-batch splits (lossspec.microbatches): both frameworks split ``B`` rows into ``K``
micro-batches with ``numpy.array_split``'s sizes, and ``accumulate`` with the global
denominator equals the float64 full-batch oracle for any ``K`` (10 rows in 4 micro-batches:
3, 3, 2, 2; in 3: 4, 3, 3; in 12: ten of one row and two empty ones)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxloss
import lossspec
import torchloss
from jaxloss import distributed as jd
from torchloss import distributed as td

from parity_tests.support import tiny_lm_oracle

ROWS, SEQ, VOCAB_IN, HIDDEN, VOCAB = 10, 5, 11, 6, 23
OPTIONS = {"cross_entropy": {"label_smoothing": 0.1}, "forward_kl": {"temperature": 1.5}}


def test_sizes_are_numpy_array_split() -> None:
    for rows in range(14):
        for k in range(1, 16):
            expected = tuple(len(part) for part in np.array_split(np.arange(rows), k))
            assert lossspec.microbatch_sizes(rows, k) == expected, (rows, k)
    assert lossspec.microbatch_sizes(10, 4) == (3, 3, 2, 2)


@pytest.mark.parametrize("k", (1, 3, 4, 10, 12))
def test_split_microbatches_is_array_split_in_both_frameworks(k: int) -> None:
    rows = np.arange(ROWS * 3).reshape(ROWS, 3)
    column = np.arange(ROWS) * 10
    expected_rows, expected_column = np.array_split(rows, k), np.array_split(column, k)
    jax_parts = jd.split_microbatches({"a": jnp.asarray(rows), "b": (jnp.asarray(column),)}, k)
    torch_parts = td.split_microbatches({"a": torch.from_numpy(rows), "b": (torch.from_numpy(column),)}, k)
    assert len(jax_parts) == len(torch_parts) == k
    for part_jax, part_torch, ref_rows, ref_column in zip(jax_parts, torch_parts, expected_rows, expected_column):
        np.testing.assert_array_equal(np.asarray(part_jax["a"]), ref_rows)
        np.testing.assert_array_equal(np.asarray(part_jax["b"][0]), ref_column)
        np.testing.assert_array_equal(part_torch["a"].numpy(), ref_rows)
        np.testing.assert_array_equal(part_torch["b"][0].numpy(), ref_column)


def test_split_errors_are_the_same_in_both_frameworks() -> None:
    bad_batches = [
        ({"a": np.zeros((10, 2)), "b": np.zeros((9,))}, "the same leading batch size"),
        ({"a": np.zeros((10, 2)), "b": np.zeros(())}, "needs a leading batch axis"),
    ]
    for batch, match in bad_batches:
        messages = set()
        for split in (
            lambda b: jd.split_microbatches({key: jnp.asarray(v) for key, v in b.items()}, 2),
            lambda b: td.split_microbatches({key: torch.from_numpy(np.asarray(v)) for key, v in b.items()}, 2),
        ):
            with pytest.raises(ValueError, match=match) as err:
                split(batch)
            messages.add(str(err.value))
        assert len(messages) == 1
    for k in (0, 2.0, True):
        with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
            jd.split_microbatches({"a": jnp.zeros((4,))}, k)
        with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
            td.split_microbatches({"a": torch.zeros(4)}, k)


def make_problem(kind: str, normalization: str, seed: int = 1) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A 10 x 5 batch with valid counts spread unevenly over the rows (row 3 all masked), float
    weights for ``"sum"``, ignored labels for cross-entropy."""
    rng = np.random.default_rng(seed)
    params = {"emb": rng.normal(0, 1, (VOCAB_IN, HIDDEN)).astype(np.float32), "head": rng.normal(0, 0.5, (HIDDEN, VOCAB)).astype(np.float32)}
    mask = rng.random((ROWS, SEQ)) < np.linspace(0.2, 0.9, ROWS)[:, None]
    mask[3] = False
    batch = {"tokens": rng.integers(0, VOCAB_IN, (ROWS, SEQ))}
    batch["loss_mask"] = np.where(mask, rng.uniform(0.5, 2.0, mask.shape), 0.0).astype(np.float32) if normalization == "sum" else mask
    if kind == "cross_entropy":
        labels = rng.integers(0, VOCAB, (ROWS, SEQ))
        labels[np.nonzero(mask)[0][::5], np.nonzero(mask)[1][::5]] = -100
        batch["labels"] = labels
    else:
        batch["teacher"] = rng.normal(0, 2, (ROWS, SEQ, VOCAB)).astype(np.float32)
    return params, batch


def reference(kind: str, normalization: str, params, batch) -> tuple[float, dict[str, np.ndarray]]:
    target = batch["labels"] if kind == "cross_entropy" else batch["teacher"]
    return tiny_lm_oracle.reference(kind, normalization, params["emb"], params["head"], batch["tokens"], target,
                                     batch["loss_mask"], **OPTIONS[kind])


CASES = [("cross_entropy", "valid_tokens"), ("cross_entropy", "tokens"), ("cross_entropy", "sum"), ("forward_kl", "tokens")]


# Each JAX case compiles its own step: two in the fast lane, the others with the slow tests.
JAX_CASES = CASES[:2] + [pytest.param(*case, marks=pytest.mark.slow) for case in CASES[2:]]


@pytest.mark.parametrize("kind,normalization", JAX_CASES)
def test_jax_accumulate_uneven_equals_full_batch(kind: str, normalization: str) -> None:
    params, batch = make_problem(kind, normalization)
    ref_loss, ref_grads = reference(kind, normalization, params, batch)
    function = getattr(jaxloss, kind)

    def loss_fn(params, microbatch, denominator):
        logits = params["emb"][microbatch["tokens"]] @ params["head"]
        target = microbatch["labels"] if kind == "cross_entropy" else microbatch["teacher"]
        return function(logits, target, microbatch["loss_mask"], normalization=normalization, denominator=denominator, **OPTIONS[kind])

    params_jax = jax.tree_util.tree_map(jnp.asarray, params)
    batch_jax = jax.tree_util.tree_map(jnp.asarray, batch)
    for k in (4, 12) if normalization == "valid_tokens" else (4,):
        step = jax.jit(lambda p, b, k=k: jd.accumulate(loss_fn, p, b, num_microbatches=k, normalization=normalization))
        loss, grads = step(params_jax, batch_jax)
        tiny_lm_oracle.assert_matches(loss, {n: np.asarray(g) for n, g in grads.items()}, ref_loss, ref_grads, f"jax K={k}")


@pytest.mark.parametrize("kind,normalization", CASES)
def test_torch_accumulate_uneven_equals_full_batch(kind: str, normalization: str) -> None:
    params, batch = make_problem(kind, normalization)
    ref_loss, ref_grads = reference(kind, normalization, params, batch)
    function = getattr(torchloss, kind)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB_IN, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(params["emb"]))
        model[1].weight.copy_(torch.from_numpy(params["head"].T))
    batch_torch = {key: torch.from_numpy(np.asarray(value)) for key, value in batch.items()}

    def loss_fn(model, microbatch, denominator):
        logits = model(microbatch["tokens"])
        target = microbatch["labels"] if kind == "cross_entropy" else microbatch["teacher"]
        return function(logits, target, microbatch["loss_mask"], normalization=normalization, denominator=denominator, **OPTIONS[kind])

    for k in (3, 4, 12):
        model.zero_grad()
        loss = td.accumulate(loss_fn, model, batch_torch, num_microbatches=k, normalization=normalization)
        grads = {"emb": model[0].weight.grad.numpy(), "head": model[1].weight.grad.numpy().T}
        tiny_lm_oracle.assert_matches(float(loss), grads, ref_loss, ref_grads, f"torch K={k}")


@pytest.mark.slow  # shard_map over 2 host devices
def test_jax_accumulate_uneven_per_replica() -> None:
    """10 rows on 2 data replicas (5 each) in 2 micro-batches (3, 2) per replica."""
    try:
        from jax import shard_map
    except ImportError:  # pragma: no cover - older JAX
        from jax.experimental.shard_map import shard_map
    from jax.sharding import Mesh, PartitionSpec as P

    params, batch = make_problem("cross_entropy", "valid_tokens")
    ref_loss, ref_grads = reference("cross_entropy", "valid_tokens", params, batch)

    def loss_fn(params, microbatch, denominator):
        logits = params["emb"][microbatch["tokens"]] @ params["head"]
        return jaxloss.cross_entropy(logits, microbatch["labels"], microbatch["loss_mask"], denominator=denominator, **OPTIONS["cross_entropy"])

    def step(params, batch):
        return jd.accumulate(loss_fn, params, batch, num_microbatches=2, data_axes="data")

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    sharded = shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
    loss, grads = jax.jit(sharded)(jax.tree_util.tree_map(jnp.asarray, params), jax.tree_util.tree_map(jnp.asarray, batch))
    tiny_lm_oracle.assert_matches(loss, {n: np.asarray(g) for n, g in grads.items()}, ref_loss, ref_grads, "D=2 K=2 uneven")
