"""``sequence_parallel=`` (context parallelism, lossspec.sequences): the time axis of the packed
batch of packed_problem.py split over devices, documents crossing the slice boundaries.

JAX: ``shard_map`` over 4 host devices (3 positions each) for the losses and counts, and over a
2 x 4 ("data", "seq") mesh for ``accumulate`` (micro-batches x data replicas x sequence slices).
torch: 2 gloo ranks (launched by ranks.py) with uneven slices (5 / 7 of T = 12): the losses,
the count shares, and ``accumulate`` over the sequence-parallel group and over a data-parallel
split. Every result against the float64 oracle on the whole rows: the sum of the ranks' losses
is the full loss, the concatenated gradient slices the full gradient.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import lossspec
from lossspec import KINDS, assert_close_to_oracle

from parity_tests.support import ranks
from parity_tests.support.packed_problem import BATCH, MODES, OPTIONS, assert_tiny, packed_case, tiny_problem, tiny_reference

pytestmark = pytest.mark.slow  # shard_map over host devices, real processes

CHECKED_MODES = MODES + ("valid_tokens",)
TORCH_SLICES = (5, 7)


# --------------------------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------------------------


def _shard_map():
    try:
        from jax import shard_map
    except ImportError:  # pragma: no cover - older JAX
        from jax.experimental.shard_map import shard_map
    return shard_map


@pytest.mark.parametrize("kind", KINDS)
def test_jax_losses_and_counts_over_a_time_split(kind: str) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jaxloss

    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    case, ids = packed_case(kind, float_weights=True)
    function = getattr(jaxloss, kind)
    row_spec, target_spec = P(None, "seq"), (P(None, "seq") if kind == "cross_entropy" else P(None, "seq", None))
    for mode in CHECKED_MODES:
        for shift in (False, True):
            options = dict(OPTIONS[kind], normalization=mode, causal_shift=shift)

            def local(x, target, mask, seg, options=options):
                loss, grad = jax.value_and_grad(
                    lambda x: function(x, target, mask, segment_ids=seg, sequence_parallel="seq", **options)
                )(x)
                labels = target if kind == "cross_entropy" else None
                count = jaxloss.count_denominator(
                    labels, mask, normalization=mode, causal_shift=shift, segment_ids=seg, sequence_parallel="seq"
                )
                return jax.lax.psum(loss, "seq"), grad, jax.lax.psum(count, "seq")

            sharded = _shard_map()(
                local, mesh=mesh, in_specs=(P(None, "seq", None), target_spec, row_spec, row_spec), out_specs=(P(), P(None, "seq", None), P())
            )
            loss, grad, count = jax.jit(sharded)(jnp.asarray(case.logits), jnp.asarray(case.target), jnp.asarray(case.loss_mask), jnp.asarray(ids))
            ref = case.reference(segment_ids=ids, **options)
            what = f"jax-sp:{kind}/{mode}/shift={shift}"
            assert_close_to_oracle(loss, np.asarray(grad), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=what)
            labels = case.target if kind == "cross_entropy" else None
            ref_count = lossspec.count_denominator(labels, case.loss_mask, normalization=mode, causal_shift=shift, segment_ids=ids)
            np.testing.assert_allclose(float(count), ref_count, rtol=1e-6, err_msg=what)


@pytest.mark.parametrize("kind", lossspec.TARGETLESS_KINDS)
def test_jax_targetless_module_over_a_time_split(kind: str) -> None:
    """The NNX module of a kind without a target passes ``sequence_parallel`` and ``segment_ids``
    on (it once dropped both): the whole rows' loss and gradient against the oracle."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxloss import nnx

    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    case, ids = packed_case(kind, float_weights=True)
    module_class = getattr(nnx, lossspec.KIND_SPECS[kind].module)
    row_spec = P(None, "seq")
    for mode in CHECKED_MODES:
        options = OPTIONS.get(kind, {"temperature": 1.5})  # packed_problem holds options for the kinds with a target
        module = module_class(normalization=mode, causal_shift=True, sequence_parallel="seq", **options)

        def local(x, mask, seg, module=module):
            loss, grad = jax.value_and_grad(lambda x: module(x, mask, segment_ids=seg))(x)
            return jax.lax.psum(loss, "seq"), grad

        sharded = _shard_map()(local, mesh=mesh, in_specs=(P(None, "seq", None), row_spec, row_spec), out_specs=(P(), P(None, "seq", None)))
        loss, grad = jax.jit(sharded)(jnp.asarray(case.logits), jnp.asarray(case.loss_mask), jnp.asarray(ids))
        ref = case.reference(segment_ids=ids, normalization=mode, causal_shift=True, **options)
        assert_close_to_oracle(loss, np.asarray(grad), ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=f"jax-sp-module:{kind}/{mode}")


@pytest.mark.parametrize("kind", ["cross_entropy", "forward_kl"])
def test_jax_sequence_and_vocab_parallel_together(kind: str) -> None:
    """2 time slices x 2 vocabulary shards (V = 38): the coefficients come from the time axis,
    the statistics from the vocabulary axis; together the full rows' loss and gradient."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jaxloss

    case, ids = packed_case(kind, float_weights=True)
    logits = np.concatenate([case.logits, np.full(case.logits.shape[:-1] + (1,), -1.0, np.float32)], axis=-1)
    target = case.target if kind == "cross_entropy" else np.concatenate([case.target, np.zeros_like(logits[..., :1])], axis=-1)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("seq", "model"))
    function = getattr(jaxloss, kind)
    for mode in MODES:
        options = dict(OPTIONS[kind], normalization=mode, causal_shift=True)

        def local(x, t, mask, seg, options=options):
            loss, grad = jax.value_and_grad(
                lambda x: function(x, t, mask, segment_ids=seg, sequence_parallel="seq", vocab_parallel="model", **options)
            )(x)
            return jax.lax.psum(loss, "seq"), grad

        target_spec = P(None, "seq") if kind == "cross_entropy" else P(None, "seq", "model")
        sharded = _shard_map()(
            local, mesh=mesh, in_specs=(P(None, "seq", "model"), target_spec, P(None, "seq"), P(None, "seq")),
            out_specs=(P(), P(None, "seq", "model")),
        )
        loss, grad = jax.jit(sharded)(jnp.asarray(logits), jnp.asarray(target), jnp.asarray(case.loss_mask), jnp.asarray(ids))
        ref_loss, ref_grad = lossspec.oracle(kind, logits, target, case.loss_mask, segment_ids=ids, **options)
        g0 = case.g0(segment_ids=ids, **options)
        assert_close_to_oracle(loss, np.asarray(grad), ref_loss, ref_grad, dtype="float32", g0=g0, what=f"sp x vp {kind}/{mode}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["cross_entropy", "reverse_kl"])
def test_jax_accumulate_data_by_sequence_parallel(kind: str, mode: str) -> None:
    """2 data replicas x 4 time slices x 2 micro-batches == the full batch."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jaxloss
    from jaxloss.distributed import accumulate

    params, batch = tiny_problem(kind)
    shift = mode == "sequence_mean"
    ref_loss, ref_grads = tiny_reference(kind, mode, params, batch, causal_shift=shift)
    params = {key: jnp.asarray(value) for key, value in params.items()}
    batch = {key: jnp.asarray(value) for key, value in batch.items()}

    def loss_fn(p, mb, denominator):
        logits = p["emb"][mb["tokens"]] @ p["head"]
        target = mb["labels"] if kind == "cross_entropy" else mb["teacher"]
        return getattr(jaxloss, kind)(logits, target, mb["loss_mask"], segment_ids=mb["segment_ids"], normalization=mode,
                                      denominator=denominator, causal_shift=shift, sequence_parallel="seq", **OPTIONS[kind])

    def step(p, b):
        return accumulate(loss_fn, p, b, num_microbatches=2, normalization=mode, causal_shift=shift,
                          data_axes=("data", "seq"), sequence_parallel="seq")

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "seq"))
    specs = {key: P("data", "seq") if np.ndim(value) == 2 else P("data", "seq", None) for key, value in batch.items()}
    sharded = _shard_map()(step, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), P()))
    assert_tiny(*jax.jit(sharded)(params, batch), ref_loss, ref_grads, f"jax D=2 x SP=4 x K=2 {kind}/{mode}")


# --------------------------------------------------------------------------------------------
# torch: 2 gloo ranks
# --------------------------------------------------------------------------------------------


def _window(rank: int) -> slice:
    bounds = np.cumsum((0,) + TORCH_SLICES)
    return slice(int(bounds[rank]), int(bounds[rank + 1]))


def _worker(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import torchloss
    from torchloss.distributed import accumulate

    rank, _ = ranks.init_gloo()
    world = dist.group.WORLD
    time = _window(rank)
    results: dict[str, np.ndarray] = {}
    for kind in KINDS:
        case, ids = packed_case(kind, float_weights=True)
        for mode in CHECKED_MODES:
            for shift in (False, True):
                key = f"{kind}/{mode}/{shift}"
                logits = torch.tensor(case.logits[:, time]).requires_grad_(True)
                target = torch.tensor(case.target[:, time])
                mask, seg = torch.tensor(case.loss_mask[:, time]), torch.tensor(ids[:, time])
                loss = getattr(torchloss, kind)(logits, target, mask, segment_ids=seg, normalization=mode, causal_shift=shift,
                                                sequence_parallel=world, **OPTIONS[kind])
                loss.backward()
                total = loss.detach().clone()
                dist.all_reduce(total)
                labels = target if kind == "cross_entropy" else None
                count = torchloss.count_denominator(labels, mask, normalization=mode, causal_shift=shift, segment_ids=seg,
                                                    sequence_parallel=world)
                dist.all_reduce(count)
                results[key + "/loss"] = total.double().numpy()
                results[key + "/grad"] = logits.grad.double().numpy()
                results[key + "/count"] = count.double().numpy()
    for kind in ("cross_entropy", "forward_kl"):
        for mode in MODES:
            params, batch = tiny_problem(kind)
            shift = mode == "sequence_mean"
            for split in ("sequence", "data"):
                model = torch.nn.Module()
                model.emb = torch.nn.Parameter(torch.tensor(params["emb"]))
                model.head = torch.nn.Parameter(torch.tensor(params["head"]))
                rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
                part = {k: torch.tensor(v[:, time] if split == "sequence" else v[rows]) for k, v in batch.items()}
                group_sp = world if split == "sequence" else None

                def loss_fn(model, mb, denominator, kind=kind, mode=mode, shift=shift, group_sp=group_sp):
                    logits = model.emb[mb["tokens"]] @ model.head
                    target = mb["labels"] if kind == "cross_entropy" else mb["teacher"]
                    return getattr(torchloss, kind)(logits, target, mb["loss_mask"], segment_ids=mb["segment_ids"], normalization=mode,
                                                    denominator=denominator, causal_shift=shift, sequence_parallel=group_sp, **OPTIONS[kind])

                loss = accumulate(loss_fn, model, part, num_microbatches=3, normalization=mode, causal_shift=shift,
                                  group=world, sequence_parallel=group_sp)
                key = f"acc/{kind}/{mode}/{split}"
                results[key + "/loss"] = loss.double().numpy()
                results[key + "/emb"] = model.emb.grad.double().numpy()
                results[key + "/head"] = model.head.grad.double().numpy()
    np.savez(os.path.join(out_dir, f"r{rank}.npz"), **results)
    ranks.finish(rank)


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, np.ndarray]]:
    return ranks.launch_once("sequence_parallel", Path(__file__), lambda out_dir: [str(out_dir)], len(TORCH_SLICES), tmp_path_factory)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_sequence_parallel_matches_oracle(torch_results, kind: str) -> None:
    case, ids = packed_case(kind, float_weights=True)
    for mode in CHECKED_MODES:
        for shift in (False, True):
            key = f"{kind}/{mode}/{shift}"
            ref = case.reference(segment_ids=ids, normalization=mode, causal_shift=shift, **OPTIONS[kind])
            grad = np.concatenate([r[key + "/grad"] for r in torch_results], axis=1)
            assert_close_to_oracle(torch_results[0][key + "/loss"], grad, ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=key)
            labels = case.target if kind == "cross_entropy" else None
            ref_count = lossspec.count_denominator(labels, case.loss_mask, normalization=mode, causal_shift=shift, segment_ids=ids)
            for r in torch_results:
                np.testing.assert_allclose(r[key + "/count"], ref_count, rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("split", ["sequence", "data"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["cross_entropy", "forward_kl"])
def test_torch_accumulate_over_ranks_equals_full_batch(torch_results, kind: str, mode: str, split: str) -> None:
    params, batch = tiny_problem(kind)
    ref_loss, ref_grads = tiny_reference(kind, mode, params, batch, causal_shift=(mode == "sequence_mean"))
    key = f"acc/{kind}/{mode}/{split}"
    for r in torch_results:
        assert_tiny(r[key + "/loss"], {"emb": r[key + "/emb"], "head": r[key + "/head"]}, ref_loss, ref_grads, key)


if __name__ == "__main__":
    _worker(sys.argv[1])
