"""End-to-end: the tiny LM trains identically in Flax NNX and torch, with K=4 micro-batches and
2 data-parallel replicas matching K=1, while the naive mean of micro-batch means drifts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from examples.tiny_lm import demo
from examples.tiny_lm.data import corpus_lines, make_sft_data


def test_sft_data_is_real_text_with_uneven_masks() -> None:
    lines = corpus_lines()
    assert len(lines) > 50 and any("Beautiful is better than ugly" in line for line in lines)
    data = make_sft_data(num_batches=5, batch_size=8)
    counts = data.loss_mask.reshape(5, 4, -1).sum(-1)  # valid tokens per micro-batch of 2 sequences
    assert counts.min() >= 1 and counts.max() >= 4 * counts.min()
    # Labels are the next byte where valid, -100 elsewhere.
    valid = data.loss_mask
    assert np.all(data.labels[~valid] == -100)
    assert np.all((data.labels[valid] > 0) & (data.labels[valid] < 128))  # ASCII bytes
    # Where the next position is still in the sequence, the label is the next input byte.
    inside = valid[:, :, :-1] & (data.tokens[:, :, 1:] != 0)
    np.testing.assert_array_equal(data.labels[:, :, :-1][inside], data.tokens[:, :, 1:][inside])


@pytest.mark.slow
def test_jax_and_torch_train_identically(tmp_path: Path) -> None:
    result = demo.run(steps=4, teacher_steps=4, tasks=list(demo.TASKS), configs=list(demo.CONFIGS), out=tmp_path)
    checks = result["checks"]
    failed = [c for c in checks if not c["ok"]]
    assert not failed, failed
    names = {(c["task"], c["check"]) for c in checks}
    for task in demo.TASKS:
        for config in ("K=1", "K=4", "D=2", "D=2,K=2"):
            assert (task, f"jax vs torch, {config}") in names
        for framework in ("jax", "torch"):
            assert (task, f"{framework}: K=4 vs K=1") in names and (task, f"{framework}: D=2 vs K=1") in names
    naive = [c for c in checks if "naive" in c["check"] and "vs K=1" in c["check"]]
    assert len(naive) == 2 and all(c["gap"] > 1e-3 for c in naive)
    curves = result["curves"]["sft_cross_entropy"]
    assert curves["jax K=1"][-1] < curves["jax K=1"][0]  # it trains
    saved = json.loads((tmp_path / "curves.json").read_text())
    assert saved["curve_rtol"] == demo.CURVE_RTOL and len(saved["curves"]) == 3
    assert (tmp_path / "curves.png").stat().st_size > 20_000
