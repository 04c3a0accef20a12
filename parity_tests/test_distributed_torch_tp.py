"""Vocab-parallel and data x vocab-parallel equivalence in torch (SPEC sections 3-4), with real
processes: 4 ranks on gloo (loopback; launched by ranks.py) run torch_tp_worker.py, which
splits the TinyLM (embedding -> linear head) problem as P=2 vocabulary shards and as D=2 x P=2
(with K = 1, 2 and 5 micro-batches: an all-masked micro-batch, an empty one; the two data
replicas hold 12 and 4 valid tokens). Every split gives the float64 oracle's full-batch loss and
parameter gradients (``emb``, and ``head`` concatenated from its vocabulary shards;
tiny_lm_oracle.py) at the SPEC section 6 and 8 bounds. (The all-masked data replica is in
test_distributed_torch.py's D = 4.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity_tests.support import ranks, tiny_lm_oracle
from parity_tests.support.torch_problem import HIDDEN, KINDS, NORMALIZATIONS, VOCAB, oracle
from parity_tests.support.torch_tp_worker import SCENARIOS, SHARDS, WORLD

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, np.ndarray]]:
    return ranks.launch_once("tp_ranks", HERE / "support" / "torch_tp_worker.py", lambda out_dir: [str(out_dir)], WORLD, tmp_path_factory)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_vocab_and_data_parallel_equal_full_batch(rank_results, kind: str, normalization: str) -> None:
    ref_loss, ref_grads = oracle(kind, normalization)
    assert set(ref_grads) == {"emb", "head"}
    for scenario in SCENARIOS:
        key = f"{kind}/{normalization}/{scenario}"
        for pair in ((0, 1), (2, 3)):  # the two vocab-parallel groups, shards in group-rank order
            shards = [rank_results[rank][f"{key}/grad/head_shard"] for rank in pair]
            assert [s.shape for s in shards] == [(HIDDEN, width) for width in SHARDS]
            head = np.concatenate(shards, axis=-1)
            assert head.shape == (HIDDEN, VOCAB)
            for rank in pair:
                grads = {"emb": rank_results[rank][f"{key}/grad/emb"], "head": head}
                tiny_lm_oracle.assert_matches(rank_results[rank][f"{key}/loss"], grads, ref_loss, ref_grads, f"rank {rank} {key}")


def test_worker_checked_replicas(rank_results) -> None:
    """The worker asserted bit-identical results across partners; spot-check what it saved."""
    for key in rank_results[0]:
        if key.endswith("/head_shard"):
            assert np.array_equal(rank_results[0][key], rank_results[2][key]), key
            assert np.array_equal(rank_results[1][key], rank_results[3][key]), key
        else:
            for rank in range(1, WORLD):
                assert np.array_equal(rank_results[0][key], rank_results[rank][key]), f"rank {rank} {key}"
    assert len(rank_results[0]) == len(KINDS) * len(NORMALIZATIONS) * len(SCENARIOS) * 3
