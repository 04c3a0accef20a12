"""Micro-batch and data-parallel equivalence in torch (SPEC sections 4 and 6), with real
processes: 4 ranks on gloo (loopback; launched by ranks.py) run D = 2 and D = 4 data-parallel
replicas (valid tokens on every replica but one, unevenly; an all-masked replica; empty
micro-batches); every split gives the float64 oracle's full-batch loss and parameter gradients
(tiny_lm_oracle.py) within the SPEC bounds, as does one process's full-batch call."""

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

from parity_tests.support import ranks
from parity_tests.support import tiny_lm_oracle
from parity_tests.support.torch_dp_worker import SCENARIOS, WORLDS
from parity_tests.support.torch_problem import BATCH, KINDS, NORMALIZATIONS, SEQ, loss_fn_for, make_model, make_problem, oracle

HERE = Path(__file__).parent


def full_batch(kind: str, normalization: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One process, the whole batch, one loss call with ``denominator=None``."""
    model = make_model()
    batch = make_problem(kind, float_weights=(normalization == "sum"))
    loss = loss_fn_for(kind, normalization)(model, batch, None)
    loss.backward()
    return loss.detach().numpy(), {name: p.grad.numpy() for name, p in model.named_parameters()}


def assert_same(loss, grads, ref_loss, ref_grads, what: str) -> None:
    """Against the float64 oracle: loss within 4e-6 max(1, |ref|), each parameter's gradient
    within 4e-6 max|ref| (SPEC sections 6 and 8)."""
    tiny_lm_oracle.assert_matches(loss, grads, ref_loss, ref_grads, what)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_full_batch_matches_oracle(kind: str, normalization: str) -> None:
    ref_loss, ref_grads = oracle(kind, normalization)
    assert_same(*full_batch(kind, normalization), ref_loss, ref_grads, f"full batch {kind}/{normalization}")


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    out_dir = ranks.launch_dir_once("dp_ranks", HERE / "support" / "torch_dp_worker.py", lambda out_dir: [str(out_dir / "results.npz")],
                                     max(WORLDS), tmp_path_factory)
    with np.load(out_dir / "results.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_ddp_and_microbatches_equal_full_batch(rank_results, kind: str, normalization: str) -> None:
    ref_loss, ref_grads = oracle(kind, normalization)
    checked = 0
    for world in WORLDS:
        for scenario in SCENARIOS[world]:
            key = f"D{world}/{kind}/{normalization}/{scenario}"
            grads = {name: rank_results[f"{key}/grad/{name}"] for name in ref_grads}
            assert_same(rank_results[f"{key}/loss"], grads, ref_loss, ref_grads, key)
            checked += 1
    assert checked == 7


def test_torchrun_launch_equals_full_batch(tmp_path: Path) -> None:
    """The same worker started the way users start it: ``torchrun --standalone`` (its own
    rendezvous and TCP store, ``env://``), 2 ranks; one kind and mode keeps it short."""
    kind, normalization = "reverse_kl", "valid_tokens"
    out, log = tmp_path / "results.npz", tmp_path / "torchrun.log"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(HERE.parent), os.environ.get("PYTHONPATH", "")] if p))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(HERE / "support" / "torch_dp_worker.py"), str(out), kind, normalization]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=ranks.RANK_TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = "timeout"
    assert code == 0, f"torchrun exit {code}; its log:\n{log.read_text()[-6000:]}"
    with np.load(out) as data:
        results = {key: data[key] for key in data.files}
    ref_loss, ref_grads = oracle(kind, normalization)
    assert not any(key.startswith("D4/") for key in results)  # 2 ranks: D = 2 only
    for scenario in SCENARIOS[2]:
        key = f"D2/{kind}/{normalization}/{scenario}"
        grads = {name: results[f"{key}/grad/{name}"] for name in ref_grads}
        assert_same(results[f"{key}/loss"], grads, ref_loss, ref_grads, f"torchrun {key}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_microbatches_on_one_process(kind: str, normalization: str) -> None:
    ref_loss, ref_grads = oracle(kind, normalization)
    for k in (2, 4, 9):  # 9 micro-batches of 8 rows: one is empty
        model = make_model()
        batch = make_problem(kind, float_weights=(normalization == "sum"))
        loss = accumulate(loss_fn_for(kind, normalization), model, batch, num_microbatches=k, normalization=normalization)
        grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
        assert_same(loss.numpy(), grads, ref_loss, ref_grads, f"K={k}")


def test_global_denominator_and_split() -> None:
    batch = make_problem("cross_entropy")
    full = global_denominator(batch["labels"], batch["loss_mask"])
    assert full.dtype == torch.float32 and float(full) == 14.0  # 16 valid, 2 ignored
    parts = split_microbatches(batch, 3)
    assert [p["tokens"].shape[0] for p in parts] == [3, 3, 2]
    summed = sum(global_denominator(p["labels"], p["loss_mask"]) for p in parts)
    assert summed.numpy().tobytes() == full.numpy().tobytes()  # bit-identical, so w / D is too
    assert float(global_denominator(batch["labels"], normalization="tokens")) == BATCH * SEQ


def test_naive_mean_of_microbatch_means_is_wrong() -> None:
    batch = make_problem("cross_entropy")
    loss_fn = loss_fn_for("cross_entropy", "valid_tokens")
    full = float(loss_fn(make_model(), batch, None).detach())
    means = [float(loss_fn(make_model(), mb, None).detach()) for mb in split_microbatches(batch, 4)]
    naive = sum(means) / len(means)
    exact = float(accumulate(loss_fn, make_model(), batch, num_microbatches=4))
    assert abs(naive - full) > 0.1 * full
    lossspec.compare_loss(exact, oracle("cross_entropy", "valid_tokens")[0]).check()


def test_accumulate_rejects_bad_arguments() -> None:
    batch = make_problem("cross_entropy")
    loss_fn = loss_fn_for("cross_entropy", "valid_tokens")
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        accumulate(loss_fn, make_model(), batch, num_microbatches=0)
    with pytest.raises(ValueError, match="not 'none'"):
        accumulate(loss_fn, make_model(), batch, num_microbatches=2, normalization="none")
    with pytest.raises(ValueError, match="only counts normalization"):
        global_denominator(batch["labels"], normalization="sum")


def test_ranks_are_processes_of_their_own_that_report_failures_and_timeouts(tmp_path: Path) -> None:
    """``ranks.launch`` (its ranks forked from a pre-imported Python, parity_tests/support/zygote.py):
    each rank runs the script as ``__main__`` with its own ``RANK``, process id and arguments, a
    rank that raises fails the launch with every rank's log (its traceback included), and ranks
    still running at the deadline are killed and reported, not waited for."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "print('rank', rank, 'of', os.environ['WORLD_SIZE'], 'pid', os.getpid(), 'argv', sys.argv[1:], flush=True)\n"
        "if sys.argv[1] == 'fail' and rank == 1:\n"
        "    raise RuntimeError('rank 1 breaks')\n"
        "if sys.argv[1] == 'hang':\n"
        "    time.sleep(120)\n"
    )
    ranks.launch(script, ["ok"], world_size=3, log_dir=tmp_path / "ok")
    lines = [(tmp_path / "ok" / f"rank{rank}.log").read_text().split() for rank in range(3)]
    assert [line[1] for line in lines] == ["0", "1", "2"] and all(line[3] == "3" and line[-1] == "['ok']" for line in lines)
    assert len({line[5] for line in lines} | {str(os.getpid())}) == 4  # three processes, none of them this one
    with pytest.raises(AssertionError, match=r"(?s)exit codes \[0, 1\].*RuntimeError: rank 1 breaks"):
        ranks.launch(script, ["fail"], world_size=2, log_dir=tmp_path / "fail")
    with pytest.raises(AssertionError, match=r"timed out after 3 s; exit codes \[-9, -9\]"):
        ranks.launch(script, ["hang"], world_size=2, log_dir=tmp_path / "hang", timeout_s=3)
