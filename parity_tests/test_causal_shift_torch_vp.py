"""``causal_shift=True`` with torch's ``vocab_parallel``: 2 gloo ranks (launched by ranks.py)
hold uneven vocabulary shards (15 / 22 of V = 37); the shift is on the time axis, so every kind
matches the float64 oracle, every rank returns the same loss and the last position's gradient
is exactly 0 on every shard."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import lossspec

from parity_tests.support import ranks

pytestmark = pytest.mark.slow  # real processes

KINDS = lossspec.KINDS
NORMALIZATIONS = ("valid_tokens", "tokens", "none")
LEAD, VOCAB, SHARDS = (3, 6), 37, (15, 22)


def _case(kind: str) -> lossspec.Case:
    return lossspec.make_case(kind, "random", lead_shape=LEAD, vocab=VOCAB, seed=5)


def _worker(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import torchloss

    rank, _ = ranks.init_gloo()
    lo, hi = int(np.cumsum((0,) + SHARDS)[rank]), int(np.cumsum((0,) + SHARDS)[rank + 1])
    results: dict[str, np.ndarray] = {}
    for kind in KINDS:
        case = _case(kind)
        for norm in NORMALIZATIONS:
            logits = torch.tensor(case.logits[..., lo:hi]).requires_grad_(True)
            target = torch.tensor(case.target) if kind == "cross_entropy" else torch.tensor(case.target[..., lo:hi])
            loss = getattr(torchloss, kind)(logits, target, torch.tensor(case.loss_mask), normalization=norm,
                                            causal_shift=True, vocab_parallel=dist.group.WORLD)
            loss.sum().backward()
            results[f"{kind}/{norm}/loss"] = loss.detach().double().numpy()
            results[f"{kind}/{norm}/grad"] = logits.grad.double().numpy()
    np.savez(os.path.join(out_dir, f"r{rank}.npz"), **results)
    ranks.finish(rank)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, np.ndarray]]:
    return ranks.launch_once("causal_vp", Path(__file__), lambda out_dir: [str(out_dir)], len(SHARDS), tmp_path_factory)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_vocab_parallel_with_causal_shift_matches_oracle(results, kind: str) -> None:
    case = _case(kind)
    for norm in NORMALIZATIONS:
        ref = case.reference(normalization=norm, causal_shift=True)
        key = f"{kind}/{norm}"
        assert np.array_equal(results[0][key + "/loss"], results[1][key + "/loss"])
        grad = np.concatenate([r[key + "/grad"] for r in results], axis=-1)
        lossspec.assert_close_to_oracle(results[0][key + "/loss"], grad, ref.loss, ref.grad, dtype="float32", g0=ref.g0, what=key)
        assert np.all(grad[:, -1] == 0)


if __name__ == "__main__":
    _worker(sys.argv[1])
