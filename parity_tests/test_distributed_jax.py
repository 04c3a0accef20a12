"""Micro-batch and data-parallel equivalence in JAX (SPEC sections 4 and 6): a small model
(embedding -> linear head) on a batch whose valid tokens are spread unevenly over every replica and
micro-batch, with an all-masked micro-batch and an all-masked replica (see tiny_lm_oracle.py);
every split gives the full-batch loss and parameter gradients of the float64 oracle (and of the
library's own full-batch call), within the SPEC bounds."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import lossspec
from jaxloss.distributed import accumulate, global_denominator


from parity_tests.support.jax_problem import (  # noqa: F401
    BATCH, HIDDEN, KIND_OPTIONS, SEQ, VOCAB, VOCAB_IN, assert_same, make_loss_fn, make_problem, mesh, oracle, shard_map,
)


@pytest.mark.parametrize("kind", lossspec.KINDS)
@pytest.mark.parametrize("normalization", ["valid_tokens", "tokens", "sum"])
def test_microbatches_and_replicas_equal_full_batch(kind: str, normalization: str) -> None:
    params, batch = make_problem(kind, float_weights=(normalization == "sum"))
    loss_fn = make_loss_fn(kind, normalization)
    ref_loss, ref_grads = oracle(kind, normalization, params, batch)
    # The library's own full-batch call (denominator=None) first.
    assert_same(*jax.value_and_grad(lambda p: loss_fn(p, batch, None))(params), ref_loss, ref_grads, "full batch")

    # K = 4 micro-batches on one device (valid counts 5 / 7 / 0 / 4).
    step = jax.jit(functools.partial(accumulate, loss_fn, num_microbatches=4, normalization=normalization))
    assert_same(*step(params, batch), ref_loss, ref_grads, "K=4")

    # D = 2 replicas (12 / 4 valid; with K = 2 replica 1's first micro-batch is empty) and D = 4
    # (5 / 7 / 0 / 4: replica 2 all masked), under shard_map.
    for replicas, k in ((2, 1), (2, 2), (4, 1), (4, 2)):
        def replicated(params, batch, k=k):
            return accumulate(loss_fn, params, batch, num_microbatches=k, normalization=normalization, data_axes="data")

        sharded = shard_map(replicated, mesh=mesh((replicas,), ("data",)), in_specs=(P(), P("data")), out_specs=(P(), P()))
        assert_same(*jax.jit(sharded)(params, batch), ref_loss, ref_grads, f"D={replicas} K={k}")

    # pmap over 2 devices, K = 2.
    def per_device(params, batch):
        return accumulate(loss_fn, params, batch, num_microbatches=2, normalization=normalization, data_axes="data")

    stacked = jax.tree_util.tree_map(lambda x: x.reshape((2, BATCH // 2) + x.shape[1:]), batch)
    loss, grads = jax.pmap(per_device, axis_name="data", in_axes=(None, 0))(params, stacked)
    np.testing.assert_array_equal(np.asarray(loss)[0], np.asarray(loss)[1])  # the same on every replica
    assert_same(loss[0], jax.tree_util.tree_map(lambda g: g[0], grads), ref_loss, ref_grads, "pmap D=2 K=2")


@pytest.mark.parametrize("kind", lossspec.KINDS)
@pytest.mark.parametrize("normalization", ["valid_tokens", "tokens", "sum"])
def test_vocab_parallel_and_replicas_equal_full_batch(kind: str, normalization: str) -> None:
    """P = 2 vocabulary shards (K = 1, 2) and D = 2 replicas x P = 2 shards (K = 1, 2) on a
    ("data", "model") mesh: the head's columns and the teacher's are split over "model", the
    count is summed over "data" only, and the embedding's gradient gathers every shard's part
    (shard_map's autodiff psums the replicated parameter's gradient)."""
    params, batch = make_problem(kind, float_weights=(normalization == "sum"))
    ref_loss, ref_grads = oracle(kind, normalization, params, batch)
    loss_fn = make_loss_fn(kind, normalization, vocab_parallel="model")
    param_specs = {"emb": P(), "head": P(None, "model")}

    def batch_specs(data: str | None) -> dict[str, P]:
        specs = {key: P(data) for key in batch}
        if "teacher" in batch:
            specs["teacher"] = P(data, None, "model")
        return specs

    for data_replicas in (1, 2):
        for k in (1, 2):
            data = "data" if data_replicas == 2 else None

            def step(params, batch, k=k, data=data):
                return accumulate(loss_fn, params, batch, num_microbatches=k, normalization=normalization, data_axes=data)

            grid = mesh((data_replicas, 2), ("data", "model"))
            sharded = shard_map(step, mesh=grid, in_specs=(param_specs, batch_specs(data)), out_specs=(P(), param_specs))
            loss, grads = jax.jit(sharded)(params, batch)
            assert grads["head"].shape == (HIDDEN, VOCAB)
            assert_same(loss, grads, ref_loss, ref_grads, f"D={data_replicas} x P=2 K={k}")


def test_global_denominator_is_bit_identical_across_splits() -> None:
    _, batch = make_problem("cross_entropy")
    full = global_denominator(batch["labels"], batch["loss_mask"])
    assert float(full) == 14.0  # 4 + 1 + 5 + 2 + 3 + 1 valid, two of them ignored
    for replicas in (2, 4, 8):
        def count(labels, mask):
            return global_denominator(labels, mask, data_axes="data")

        sharded = shard_map(count, mesh=mesh((replicas,), ("data",)), in_specs=(P("data"), P("data")), out_specs=P())
        counted = jax.jit(sharded)(batch["labels"], batch["loss_mask"])
        assert np.asarray(counted).tobytes() == np.asarray(full).tobytes()
        # The per-token coefficient w / D is then bit-identical too.
        assert (np.float32(1.0) / np.asarray(counted)).tobytes() == (np.float32(1.0) / np.asarray(full)).tobytes()
    tokens = global_denominator(batch["labels"], normalization="tokens")
    assert float(tokens) == BATCH * SEQ


def test_counts_never_include_model_parallel_replicas() -> None:
    """On a data x model mesh, only the data axis is summed: the model replicas hold the same tokens."""
    _, batch = make_problem("cross_entropy")

    def count(labels, mask):
        return global_denominator(labels, mask, data_axes="data")

    sharded = shard_map(count, mesh=mesh((2, 2), ("data", "model")), in_specs=(P("data"), P("data")), out_specs=P())
    assert float(jax.jit(sharded)(batch["labels"], batch["loss_mask"])) == 14.0


def test_naive_mean_of_microbatch_means_is_wrong() -> None:
    """The bug this library fixes: averaging per-micro-batch means weighs tokens unequally."""
    params, batch = make_problem("cross_entropy")
    loss_fn = make_loss_fn("cross_entropy", "valid_tokens")
    full_loss, _ = jax.value_and_grad(lambda p: loss_fn(p, batch, None))(params)
    microbatches = [jax.tree_util.tree_map(lambda x: x[i : i + 2], batch) for i in range(0, BATCH, 2)]
    means = [loss_fn(params, mb, None) for mb in microbatches]
    naive = sum(means) / len(means)  # what a plain gradient-accumulation loop logs and optimises
    exact, _ = accumulate(loss_fn, params, batch, num_microbatches=4)
    assert abs(float(naive) - float(full_loss)) > 0.1 * float(full_loss)
    lossspec.compare_loss(float(exact), oracle("cross_entropy", "valid_tokens", params, batch)[0]).check()


def test_accumulate_rejects_bad_arguments() -> None:
    params, batch = make_problem("cross_entropy")
    loss_fn = make_loss_fn("cross_entropy", "valid_tokens")
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        accumulate(loss_fn, params, batch, num_microbatches=0)
    with pytest.raises(ValueError, match="not 'none'"):
        accumulate(loss_fn, params, batch, num_microbatches=2, normalization="none")
    with pytest.raises(ValueError, match="only counts normalization"):
        global_denominator(batch["labels"], normalization="sum")
