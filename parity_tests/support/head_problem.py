"""The fused-head problems of the per-sequence and vocab-parallel head tests, shared by
test_linear_head_sequences.py, test_linear_head_vocab_parallel.py and its torch rank worker
(torch_head_vp_worker.py). Not a test module.

A problem is ``[B, T]`` tokens of packed rows (documents of different lengths, padding ids,
an all-masked row, ignored labels, float mask weights), hidden states ``[B, T, H]``, a head
``[V, H]`` with bias and, for the kinds with a teacher, a teacher head ``[V, HT]``. The float64
reference is :func:`lossspec.linear.oracle_head` on the whole head.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

import lossspec
from lossspec import linear as spec_linear

KINDS = tuple(lossspec.HEAD_KINDS)  # every kind whose table row has head=True
BATCH, TIME, H, HT = 4, 6, 8, 6
# Document ids per row: three documents, one document, padding (-1) at the end, interleaved.
SEGMENT_IDS = np.array(
    [
        [0, 0, 1, 1, 1, 2],
        [5, 5, 5, 5, 5, 5],
        [0, 0, 0, 0, -1, -1],
        [3, 7, 3, 7, 3, 3],
    ],
    dtype=np.int64,
)
MASKED_ROW = 1  # every token of this row has weight 0: no sequence, no contribution
OPTIONS = {
    "cross_entropy": {"label_smoothing": 0.1, "z_loss": 1e-3, "logit_scale": 1.2},
    "soft_cross_entropy": {"temperature": 1.5},
    "forward_kl": {"temperature": 2.0, "teacher_logit_scale": 0.8},
    "reverse_kl": {"temperature": 0.8, "logit_scale": 1.2},
    "entropy": {"temperature": 1.3, "logit_scale": 0.9},
    "jensen_shannon": {"beta": 0.7, "temperature": 1.5, "teacher_logit_scale": 0.8},
}


def make_problem(kind: str, vocab: int, *, seed: int = 0, dtype: str = "float32", masked_row: bool = True) -> dict[str, Any]:
    """Seeded float32 arrays, exactly representable in ``dtype``; ``labels`` (cross-entropy, one
    ignored) or ``teacher_hidden``, ``teacher_weight``, ``teacher_bias``; float ``loss_mask``
    weights with zeros (and the all-masked row); ``segment_ids`` (:data:`SEGMENT_IDS`)."""
    rng = np.random.default_rng([seed, KINDS.index(kind), vocab])
    lead = (BATCH, TIME)
    r = lambda shape, scale: lossspec.round_to_dtype(scale * rng.standard_normal(shape), dtype).astype(np.float32)  # noqa: E731
    mask = rng.choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), size=lead, p=[0.2, 0.2, 0.4, 0.2])
    if masked_row:
        mask[MASKED_ROW] = 0.0
    problem: dict[str, Any] = {
        "hidden": r(lead + (H,), 1.0),
        "weight": r((vocab, H), 0.7),
        "bias": r((vocab,), 0.5),
        "loss_mask": mask,
        "segment_ids": SEGMENT_IDS.copy(),
    }
    spec = lossspec.KIND_SPECS[kind]
    if spec.has_labels:
        labels = rng.integers(0, vocab, lead)
        labels[0, 3] = -100
        problem["labels"] = labels
    elif spec.has_teacher:
        problem.update(teacher_hidden=r(lead + (HT,), 1.0), teacher_weight=r((vocab, HT), 0.7), teacher_bias=r((vocab,), 0.5))
    return problem


def reference(kind: str, problem: dict[str, Any], rows: Optional[slice] = None, **options: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """The float64 ``(loss, {hidden, weight, bias})`` of the whole head (``rows``: a slice of the
    batch rows; ``options``: the call's options, ``segment_ids`` given as ``True`` to use the
    problem's ids, ``grad_output`` the upstream gradient)."""
    rows = rows if rows is not None else slice(None)
    if options.pop("segment_ids", None) is not None:
        options["segment_ids"] = problem["segment_ids"][rows]
    spec = lossspec.KIND_SPECS[kind]
    target: Any = None
    if spec.has_labels:
        target = problem["labels"][rows]
    elif spec.has_teacher:
        target = (problem["teacher_hidden"][rows], problem["teacher_weight"], problem["teacher_bias"])
    return spec_linear.oracle_head(kind, problem["hidden"][rows], problem["weight"], target, problem["loss_mask"][rows], bias=problem["bias"], **options)


def target_args(kind: str, problem: dict[str, Any], convert: Any, rows: Optional[slice] = None, vocab: slice = slice(None)) -> tuple[tuple, dict[str, Any]]:
    """``linear_<kind>``'s positional target arguments and its ``teacher_bias`` keyword, each
    through ``convert``: ``(labels[rows],)``, the teacher's ``(hidden[rows], weight[vocab])`` and
    ``teacher_bias[vocab]`` (``vocab``: a shard's rows of the teacher head), or nothing."""
    rows = rows if rows is not None else slice(None)
    spec = lossspec.KIND_SPECS[kind]
    if spec.has_labels:
        return (convert(problem["labels"][rows]),), {}
    if spec.has_teacher:
        target = (convert(problem["teacher_hidden"][rows]), convert(problem["teacher_weight"][vocab]))
        return target, {"teacher_bias": convert(problem["teacher_bias"][vocab])}
    return (), {}
