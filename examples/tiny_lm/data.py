"""Real text that ships with Python, turned into byte-level SFT batches (NumPy only).

Each example is ``prompt + answer`` padded to ``SEQ``: the prompt (a question built from a
line of text) and the padding are masked, the answer bytes are the valid tokens. Answers have
very different lengths, so valid counts vary a lot between micro-batches and replicas.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import contextlib

import numpy as np

VOCAB = 256  # bytes
SEQ = 48
PAD = 0


def corpus_lines() -> list[str]:
    """Lines of real English from the Python standard library: the Zen of Python and the
    docstrings of a few modules."""
    # The Zen is printed only by the first import of ``this`` in a process; decode its text
    # (``this.s``, rot13 by ``this.d``) so that every call returns the same lines.
    with contextlib.redirect_stdout(io.StringIO()):
        this = importlib.import_module("this")
    text = "".join(this.d.get(char, char) for char in this.s)
    for name in ("json", "textwrap", "argparse", "fractions", "heapq", "bisect", "csv", "shlex"):
        text += "\n" + (importlib.import_module(name).__doc__ or "")
    lines = [" ".join(line.split()) for line in text.splitlines()]
    return [line for line in lines if 24 <= len(line) <= 80 and line.isascii()]


@dataclasses.dataclass
class SFTData:
    """``tokens`` ``[S, B, SEQ]`` inputs, ``labels`` ``[S, B, SEQ]`` next bytes (``-100`` where
    masked), ``loss_mask`` ``[S, B, SEQ]`` bool: answer tokens only, for ``S`` steps."""

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray

    def batch(self, step: int) -> dict[str, np.ndarray]:
        index = step % self.tokens.shape[0]
        return {"tokens": self.tokens[index], "labels": self.labels[index], "loss_mask": self.loss_mask[index]}


def make_sft_data(num_batches: int, batch_size: int, seed: int = 0) -> SFTData:
    """SFT batches: ``"Q: <start of a line>? A: <rest of it>"``; the model learns to complete
    lines; only the answer is trained on."""
    rng = np.random.default_rng(seed)
    lines = corpus_lines()
    tokens = np.full((num_batches, batch_size, SEQ), PAD, np.int64)
    labels = np.full((num_batches, batch_size, SEQ), -100, np.int64)
    mask = np.zeros((num_batches, batch_size, SEQ), bool)
    for s in range(num_batches):
        for b in range(batch_size):
            line = lines[rng.integers(len(lines))]
            cut = int(rng.integers(6, min(len(line) - 2, 30)))
            prompt = f"Q:{line[:cut]} A:".encode()
            # Answer lengths from 1 byte to the rest of the line: very uneven valid counts.
            answer = line[cut:].encode()[: int(rng.integers(1, SEQ))]
            sequence = (prompt + answer)[: SEQ + 1]
            ids = np.frombuffer(sequence, np.uint8).astype(np.int64)
            length = len(ids) - 1
            tokens[s, b, :length] = ids[:-1]
            # Position t predicts byte t+1; valid only where that byte belongs to the answer.
            answer_start = len(prompt) - 1
            labels[s, b, :length] = ids[1:]
            mask[s, b, answer_start:length] = True
    labels = np.where(mask, labels, -100)
    return SFTData(tokens, labels, mask)
