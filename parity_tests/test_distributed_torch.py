"""Micro-batch and data-parallel equivalence in torch (SPEC section 4), with real processes:
2 ranks on gloo (loopback; launched by _ranks.py); every split gives the full-batch loss and
parameter gradients of one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import lossspec
from torchloss.distributed import accumulate, global_denominator, split_microbatches

sys.path.insert(0, os.path.dirname(__file__))
import _ranks  # noqa: E402
from _torch_problem import BATCH, KINDS, NORMALIZATIONS, SEQ, loss_fn_for, make_model, make_problem  # noqa: E402

HERE = Path(__file__).parent


def baseline(kind: str, normalization: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    model = make_model()
    batch = make_problem(kind, float_weights=(normalization == "sum"))
    loss = loss_fn_for(kind, normalization)(model, batch, None)
    loss.backward()
    return loss.detach().numpy(), {name: p.grad.numpy() for name, p in model.named_parameters()}


def assert_same(loss, grads, ref_loss, ref_grads, what: str) -> None:
    lossspec.compare_loss(np.asarray(loss), np.asarray(ref_loss), f"{what} loss").check()
    for name, ref in ref_grads.items():
        lossspec.compare_grad(np.asarray(grads[name]), ref, "float32", 0.0, f"{what} grad[{name}]").check()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    out_dir = tmp_path_factory.mktemp("ranks")
    out = out_dir / "results.npz"
    _ranks.launch(HERE / "_torch_dp_worker.py", [str(out)], world_size=2, log_dir=out_dir)
    with np.load(out) as data:
        return {key: data[key] for key in data.files}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_ddp_and_microbatches_equal_full_batch(rank_results, kind: str, normalization: str) -> None:
    ref_loss, ref_grads = baseline(kind, normalization)
    assert float(ref_loss) > 0
    for scenario in ("ddp_k1", "ddp_k2", "plain_k2", "ddp_k5_empty"):
        key = f"{kind}/{normalization}/{scenario}"
        grads = {name: rank_results[f"{key}/grad/{name}"] for name in ref_grads}
        assert_same(rank_results[f"{key}/loss"], grads, ref_loss, ref_grads, key)


def test_torchrun_launch_equals_full_batch(tmp_path: Path) -> None:
    """The same worker started the way users start it: ``torchrun --standalone`` (its own
    rendezvous and TCP store, ``env://``), 2 ranks; one kind and mode keeps it short."""
    kind, normalization = "reverse_kl", "valid_tokens"
    out, log = tmp_path / "results.npz", tmp_path / "torchrun.log"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(HERE.parent), os.environ.get("PYTHONPATH", "")] if p))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(HERE / "_torch_dp_worker.py"), str(out), kind, normalization]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=_ranks.RANK_TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = "timeout"
    assert code == 0, f"torchrun exit {code}; its log:\n{log.read_text()[-6000:]}"
    with np.load(out) as data:
        results = {key: data[key] for key in data.files}
    ref_loss, ref_grads = baseline(kind, normalization)
    for scenario in ("ddp_k1", "ddp_k2", "plain_k2", "ddp_k5_empty"):
        key = f"{kind}/{normalization}/{scenario}"
        grads = {name: results[f"{key}/grad/{name}"] for name in ref_grads}
        assert_same(results[f"{key}/loss"], grads, ref_loss, ref_grads, f"torchrun {key}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_microbatches_on_one_process(kind: str, normalization: str) -> None:
    ref_loss, ref_grads = baseline(kind, normalization)
    for k in (2, 4, 9):  # 9 micro-batches of 8 rows: one is empty
        model = make_model()
        batch = make_problem(kind, float_weights=(normalization == "sum"))
        loss = accumulate(loss_fn_for(kind, normalization), model, batch, num_microbatches=k, normalization=normalization)
        grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
        assert_same(loss.numpy(), grads, ref_loss, ref_grads, f"K={k}")


def test_global_denominator_and_split() -> None:
    batch = make_problem("cross_entropy")
    full = global_denominator(batch["labels"], batch["loss_mask"])
    assert full.dtype == torch.float32 and float(full) == 10.0
    parts = split_microbatches(batch, 3)
    assert [p["tokens"].shape[0] for p in parts] == [3, 3, 2]
    summed = sum(global_denominator(p["labels"], p["loss_mask"]) for p in parts)
    assert summed.numpy().tobytes() == full.numpy().tobytes()  # bit-identical, so w / D is too
    assert float(global_denominator(batch["labels"], normalization="tokens")) == BATCH * SEQ


def test_naive_mean_of_microbatch_means_is_wrong() -> None:
    batch = make_problem("cross_entropy")
    loss_fn = loss_fn_for("cross_entropy", "valid_tokens")
    full = float(loss_fn(make_model(), batch, None))
    means = [float(loss_fn(make_model(), mb, None)) for mb in split_microbatches(batch, 4)]
    naive = sum(means) / len(means)
    exact = float(accumulate(loss_fn, make_model(), batch, num_microbatches=4))
    assert abs(naive - full) > 0.1 * full
    lossspec.compare_loss(exact, full).check()


def test_accumulate_rejects_bad_arguments() -> None:
    batch = make_problem("cross_entropy")
    loss_fn = loss_fn_for("cross_entropy", "valid_tokens")
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        accumulate(loss_fn, make_model(), batch, num_microbatches=0)
    with pytest.raises(ValueError, match="not 'none'"):
        accumulate(loss_fn, make_model(), batch, num_microbatches=2, normalization="none")
    with pytest.raises(ValueError, match="only counts normalization"):
        global_denominator(batch["labels"], normalization="sum")
