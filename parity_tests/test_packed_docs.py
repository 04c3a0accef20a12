"""The packed-documents demo (examples/packed_docs): documents of 3 to 60 tokens packed into rows,
trained with ``segment_ids`` and ``normalization="sequence_mean"``. In a short demo run, the
first step's loss and gradients of every exact split (full batch, K micro-batches, D replicas) in
both frameworks match the float64 oracle chained through the model
(tiny_lm_oracle.tied_lm_reference), (b) and (c) stay within the SPEC bound of (a) after every
step, and the naive mean of micro-batch means does not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import lossspec
from examples.packed_docs import demo
from examples.packed_docs.demo import BASE
from examples.packed_docs.data import MAX_DOC, MIN_DOC, NORMALIZATION, ROW, make_packed_data
from examples.tiny_lm.weights import init_weights

from parity_tests.support import tiny_lm_oracle

ROWS, HIDDEN = 8, 16


def _documents(ids: np.ndarray) -> list[int]:
    """The documents' lengths, row by row."""
    return [int(np.sum(row == doc)) for row in ids for doc in np.unique(row[row >= 0])]


def test_rows_pack_documents_of_very_different_lengths() -> None:
    data = make_packed_data(num_batches=4, rows=ROWS)
    assert data.tokens.shape == data.segment_ids.shape == (4, ROWS, ROW)
    lengths = _documents(data.segment_ids.reshape(-1, ROW))
    assert min(lengths) >= MIN_DOC and max(lengths) <= MAX_DOC
    assert min(lengths) <= 5 and max(lengths) >= 40  # very different lengths
    # Documents are numbered 0, 1, ... left to right; padding (-1) only at the end of a row.
    for row in data.segment_ids.reshape(-1, ROW):
        valid = row[row >= 0]
        assert np.all(np.diff(valid) >= 0) and valid[0] == 0 and np.all(row[len(valid):] == -1)
    np.testing.assert_array_equal(data.loss_mask, data.segment_ids >= 0)
    # The number of documents differs between the micro-batches of K=4 (what makes naive wrong).
    docs_per_row = data.segment_ids.max(-1) + 1
    per_microbatch = docs_per_row[0].reshape(4, -1).sum(-1)
    assert per_microbatch.max() >= per_microbatch.min() + 2, per_microbatch


def _reference(weights: dict[str, np.ndarray], batch: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    return tiny_lm_oracle.tied_lm_reference(
        "cross_entropy", weights, batch["tokens"], batch["labels"], batch["loss_mask"], attention_segment_ids=batch["segment_ids"],
        segment_ids=batch["segment_ids"], causal_shift=True, normalization=NORMALIZATION,
    )


def _worst_grad_error(grads: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    """The largest gradient error in units of the SPEC section 8 bound (``4e-6 max|ref|`` per tensor)."""
    return max(lossspec.compare_grad(np.asarray(grads[n], np.float64), ref[n], "float32", 0.0, n).error_units for n in ref)


@pytest.mark.slow
def test_splits_match_the_oracle_and_each_other_and_naive_drifts(tmp_path: Path) -> None:
    """A 3-step demo run (8 rows, hidden 16): every exact run's first step (loss, every gradient)
    matches the float64 oracle chained through the model; after every step (b) and (c) are within
    the bound of (a); the naive loop is more than 100 bounds off, from its first gradient on."""
    configs = [BASE, "K=4", "D=2,K=2", "naive K=4"]  # D=2 alone is in the demo; one compile less here
    result = demo.run(steps=3, rows=ROWS, configs=configs, out=tmp_path, hidden=HIDDEN)
    weights = init_weights(hidden=HIDDEN, seed=0, seq=ROW)
    ref_loss, ref_grads = _reference(weights, make_packed_data(num_batches=3, rows=ROWS).batch(0))
    for framework, histories in result["runs"].items():
        for config, history in histories.items():
            if demo.CONFIGS[config][2]:
                assert _worst_grad_error(history["first_grads"], ref_grads) > 100.0, (framework, config)
            else:
                tiny_lm_oracle.assert_matches(history["losses"][0], history["first_grads"], ref_loss, ref_grads, f"{framework} {config}")
    checks = {c["check"]: c for c in result["checks"]}
    for framework in ("jax", "torch"):
        for config in ("K=4", "D=2,K=2"):
            check = checks[f"{framework}: {config} vs full batch"]
            assert check["ok"] and check["ratio_to_bound"] <= 1.0, check
        naive = checks[f"{framework}: naive K=4 vs full batch"]
        assert naive["ratio_to_bound"] > 100.0, naive
    assert checks["jax vs torch, full batch"]["ok"], checks["jax vs torch, full batch"]
    losses = result["losses"]
    assert losses["jax full batch"][-1] < losses["jax full batch"][0]  # it trains
    saved = json.loads((tmp_path / "packed.json").read_text())
    assert saved["grad_rtol"] == lossspec.GRAD_RTOL and len(saved["checks"]) == len(result["checks"])
    assert (tmp_path / "packed.png").stat().st_size > 20_000
