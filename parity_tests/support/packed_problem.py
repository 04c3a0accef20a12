"""The packed batches of the sequence-normalisation tests (lossspec.sequences), shared by
test_sequence_normalization.py and test_sequence_parallel.py (and its rank workers): documents
of very different lengths, padding ids, an all-masked document and row, and a tiny model's
float64 reference (tiny_lm_oracle.py). Not a test module."""

from __future__ import annotations

from typing import Any

import numpy as np

import lossspec
from lossspec import ALL_KINDS

from parity_tests.support import tiny_lm_oracle

MODES = lossspec.SEQUENCE_NORMALIZATIONS
BATCH, TIME, VOCAB = 8, 12, 37
OPTIONS = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3},
    "soft_cross_entropy": {"temperature": 1.5},
    "forward_kl": {"temperature": 2.0, "teacher_logit_scale": 0.8},
    "reverse_kl": {"temperature": 0.8, "logit_scale": 1.2},
}
# Document ids of each packed row (TIME = 12 tokens): lengths 1 to 12, padding (-1, -2, -3, -7;
# any id < 0 is padding, not only -1), ids reused in every row, a row with interleaved
# (non-contiguous) ids and one with large ids.
PACKED_IDS = np.array(
    [
        [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2],  # document 0 is all masked (MASKED_DOCUMENT)
        [0, 0, 0, 0, 0, 0, 0, -1, -2, -1, -3, -1],  # padding, unmasked in loss_mask (packed_case)
        [1000, 1000, 1000, 70000, 70000, 70000, 70000, 70000, 70000, 70000, 70000, 70000],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -7],  # the whole row is masked (MASKED_ROW)
        [3, 3, 9, 9, 3, 3, 9, 9, 5, 5, 5, 5],
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3],
    ],
    dtype=np.int64,
)
MASKED_DOCUMENT = (2, slice(0, 2))
MASKED_ROW = 5


def packed_case(kind: str, *, float_weights: bool = False, seed: int = 0, dtype: str = "float32", lead: tuple[int, int] = (BATCH, TIME)) -> tuple[lossspec.Case, np.ndarray]:
    """A case of ``lead`` (rows of PACKED_IDS) with its ids: ~80% of the tokens valid, the
    masked document and row of the module docstring, some ignored labels (cross-entropy)."""
    rng = np.random.default_rng([seed, ALL_KINDS.index(kind)])  # (the KINDS come first)
    case = lossspec.make_case(kind, "random", lead_shape=lead, vocab=VOCAB, dtype=dtype, seed=seed)
    mask = rng.random(lead) < 0.8
    if float_weights:
        mask = np.where(mask, rng.uniform(0.25, 2.0, lead), 0.0).astype(np.float32)
    ids = PACKED_IDS[: lead[0], : lead[1]].copy()
    if lead[0] > MASKED_ROW:
        mask[MASKED_DOCUMENT] = 0
        mask[MASKED_ROW] = 0
    # Padding weighs 1 in loss_mask (outside the masked row): only its ids (< 0, -2 and -3 too)
    # exclude it, so a backend that took only -1 for padding would count the others.
    padding = (ids < 0) & (np.arange(lead[0])[:, None] != MASKED_ROW)
    mask[padding] = 1
    if kind == "cross_entropy":
        labels = rng.integers(0, VOCAB, lead)
        labels = np.where(rng.random(lead) < 0.1, -100, labels)
        case.target = np.where(mask != 0, labels, rng.choice(np.array([-1, VOCAB, 10**6]), lead))
        case.target[ids < 0] = 10**6  # padding positions hold garbage labels: never read
    case.loss_mask = mask
    return case, ids


VOCAB_IN, HIDDEN = 11, 6


def tiny_problem(kind: str, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """NumPy parameters and a packed batch (tokens, labels or teacher, loss_mask, segment_ids)."""
    rng = np.random.default_rng([seed, 7])
    case, ids = packed_case(kind, float_weights=True, seed=seed)
    params = {"emb": rng.normal(0, 1, (VOCAB_IN, HIDDEN)).astype(np.float32), "head": rng.normal(0, 0.5, (HIDDEN, VOCAB)).astype(np.float32)}
    batch = {"tokens": rng.integers(0, VOCAB_IN, (BATCH, TIME)), "loss_mask": case.loss_mask, "segment_ids": ids}
    if kind == "cross_entropy":
        batch["labels"] = case.target
    else:
        batch["teacher"] = case.target
    return params, batch


def tiny_reference(kind: str, mode: str, params: dict, batch: dict, **options: Any) -> tuple[float, dict[str, np.ndarray]]:
    target = batch["labels"] if kind == "cross_entropy" else batch["teacher"]
    return tiny_lm_oracle.reference(
        kind, mode, params["emb"], params["head"], batch["tokens"], target, batch["loss_mask"], segment_ids=batch["segment_ids"], **OPTIONS[kind], **options
    )


def assert_tiny(loss: Any, grads: dict, ref_loss: float, ref_grads: dict, what: str) -> None:
    lossspec.compare_loss(np.asarray(loss, np.float64), ref_loss, f"{what} loss").check()
    for name, ref in ref_grads.items():
        lossspec.compare_grad(np.asarray(grads[name], np.float64), ref, "float32", 0.0, f"{what} grad[{name}]").check()


