"""Rows packed with byte-level documents of very different lengths (NumPy only).

Each row of ``ROW`` tokens holds documents (3 to 60 bytes of stdlib text, lengths drawn
log-uniformly, so most are short and a few are long) back to back, numbered ``0, 1, ...`` in
``segment_ids``; the last one is cut to fit, and fewer than MIN_DOC free tokens at the end of a
row are padding (id ``-1``). The losses get ``labels=tokens``
with ``causal_shift=True``: position ``t`` predicts token ``t + 1`` of the same document only
(``lossspec.sequences``), so a row with one long document holds one sequence and a row with many
short ones holds many: the number of sequences ``S`` differs a lot between micro-batches.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from examples.tiny_lm.data import PAD, corpus_lines

ROW = 64
MIN_DOC, MAX_DOC = 3, 60


@dataclasses.dataclass
class PackedData:
    """``tokens`` ``[S, B, ROW]`` bytes, ``segment_ids`` ``[S, B, ROW]`` (``-1``: padding),
    ``loss_mask`` ``[S, B, ROW]`` bool (``segment_ids >= 0``), for ``S`` steps."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """One step's batch: ``labels`` are the tokens themselves (the loss shifts them)."""
        index = step % self.tokens.shape[0]
        tokens = self.tokens[index]
        return {"tokens": tokens, "labels": tokens, "loss_mask": self.loss_mask[index], "segment_ids": self.segment_ids[index]}


def document_lengths(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` lengths in ``[MIN_DOC, MAX_DOC]``, log-uniform (as many 3-7 as 28-60 byte documents)."""
    return np.exp(rng.uniform(np.log(MIN_DOC), np.log(MAX_DOC + 1), count)).astype(np.int64).clip(MIN_DOC, MAX_DOC)


def pack_row(rng: np.random.Generator, text: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [ROW], segment_ids [ROW])``: documents (random slices of ``text``) packed back to
    back; the one that does not fit is cut to the space left (if that is at least MIN_DOC),
    else the row ends with padding."""
    tokens = np.full(ROW, PAD, np.int64)
    ids = np.full(ROW, -1, np.int64)
    position, doc = 0, 0
    while ROW - position >= MIN_DOC:
        length = min(int(document_lengths(rng, 1)[0]), ROW - position)
        start = int(rng.integers(0, len(text) - length))
        tokens[position : position + length] = np.frombuffer(text[start : start + length], np.uint8)
        ids[position : position + length] = doc
        position, doc = position + length, doc + 1
    return tokens, ids


def make_packed_data(num_batches: int, rows: int, seed: int = 0) -> PackedData:
    """``num_batches`` batches of ``rows`` packed rows."""
    rng = np.random.default_rng(seed)
    text = " ".join(corpus_lines()).encode()
    packed = [pack_row(rng, text) for _ in range(num_batches * rows)]
    tokens = np.stack([t for t, _ in packed]).reshape(num_batches, rows, ROW)
    ids = np.stack([i for _, i in packed]).reshape(num_batches, rows, ROW)
    return PackedData(tokens, ids, ids >= 0)


#: the loss of the demo: every document counts the same, whatever its length (lossspec.sequences)
NORMALIZATION = "sequence_mean"
