"""Per-sequence normalisation (``"sequence_mean"``, ``"sequence_sum"``) and ``segment_ids``, written
once for the oracle and both frameworks.

Sequences. ``segment_ids [...]`` (optional, integers, the labels' shape; the last leading axis is
time) labels the tokens of each row: the tokens of one row with the same id ``>= 0`` form one
sequence (packed documents; a sequence need not be contiguous), and an id ``< 0`` is padding
(weight 0, in every normalisation). Without ``segment_ids`` each row of the leading shape is one
sequence (all ids 0). A sequence is a ``(row, id)`` pair: equal ids in different rows are
different sequences. Ids are compared by value in their own dtype, the same for every integer
dtype in both frameworks: an unsigned id is never padding (a uint32 ``2**32 - 1`` is a document,
not ``-1``); where a framework's working signed dtype cannot hold an unsigned dtype's values
(uint32 in JAX without x64, uint64) the ids are replaced by their ranks among the call's distinct
ids, which keeps the sequences (:func:`signed_segment_ids`).

Weights. ``w_t`` is the token's weight as for ``"valid_tokens"`` (``loss_mask`` times valid
labels), times ``id_t >= 0``. ``n_s = sum_{t in s} w_t`` and ``S`` = the number of sequences with
``n_s > 0``::

    sequence_mean = (1/S) sum_s (1/n_s) sum_{t in s} w_t l_t     coef_t = w_t / (n_s(t) S)
    sequence_sum  = (1/S) sum_s         sum_{t in s} w_t l_t     coef_t = w_t / S

``denominator=`` overrides ``S`` (``n_s`` always comes from the call: a sequence lives in one
call, or in one ``sequence_parallel`` group); ``S == 0`` (or ``denominator=0``) gives loss 0 and
gradient 0. ``count_denominator(..., normalization="sequence_mean" | "sequence_sum")`` returns
``S``; counts add up over micro-batches (which split rows, never a row) and data-parallel
replicas.

Causal shift. Segment ids are given per *input* token, like the labels. Position ``t`` predicts
token ``t + 1``, so it belongs to the sequence of ``t + 1``, and it is scored only inside one
document: with ``causal_shift=True`` the scored position ``t`` gets the id ``ids[t + 1]`` where
``ids[t] == ids[t + 1]``, and ``-1`` (padding) otherwise; the last position gets ``-1``
(:func:`scored_segment_ids`). The position whose next token starts a new document is therefore
never scored against that token.

Sequence parallelism (context parallelism). With ``sequence_parallel=`` (a JAX axis name, a
torch ``ProcessGroup``) each rank holds a contiguous slice of the time axis, in rank order. The
frameworks gather the ``[..., T]`` labels, mask and ids of the group (small: no logits), apply
the rules above to the full rows (so ``n_s`` is summed over the whole sequence and the shift
crosses slice boundaries exactly) and keep their slice. Each rank's loss is its share (the sum of
its tokens' ``coef_t l_t``): the full loss is the sum over the group, as over data-parallel
replicas. ``count_denominator(..., sequence_parallel=)`` returns the rank's share of the count:
a sequence is counted by the rank that holds its first scored position
(:func:`first_positions`), and a token position by the rank holding it, so the shares add up to
the full rows' count over the group.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SEQUENCE_NORMALIZATIONS: tuple[str, ...] = ("sequence_mean", "sequence_sum")
INT_KINDS = ("i", "u")


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_segment_ids(kind: str, dtype: str, shape: tuple[int, ...], lead_shape: tuple[int, ...]) -> None:
    """``segment_ids`` (described by its dtype ``kind``/name and ``shape``) must be an integer
    array with the labels' (the logits' leading) shape: a ``TypeError`` / ``ValueError`` otherwise."""
    if kind not in INT_KINDS:
        raise TypeError(f"segment_ids must be an integer array of shape {_shape(lead_shape)}; got dtype {dtype}")
    if tuple(shape) != tuple(lead_shape):
        raise ValueError(
            f"segment_ids must have the shape of the labels (the leading shape of logits) {_shape(tuple(lead_shape))}; "
            f"got {_shape(tuple(shape))}"
        )


def check_sequence_time_axis(normalization: str, lead_shape: tuple[int, ...]) -> None:
    """The sequence modes need a time axis (at least one leading axis): ``ValueError`` otherwise."""
    if normalization in SEQUENCE_NORMALIZATIONS and len(lead_shape) < 1:
        raise ValueError(
            f"normalization {normalization!r} needs a time axis: labels/loss_mask of shape [..., T] and logits of shape "
            "[..., T, V] (each row of the leading shape is one sequence, or segment_ids split it); got leading shape "
            f"{_shape(tuple(lead_shape))}"
        )


def scored_segment_ids(segment_ids: np.ndarray | None, lead_shape: tuple[int, ...], causal_shift: bool) -> np.ndarray:
    """The ids of the scored positions (NumPy, int64): as given (zeros without ``segment_ids``),
    or with ``causal_shift`` ``ids[t + 1]`` where ``ids[t] == ids[t + 1]``, else ``-1``; ``-1`` at
    the last position of each row."""
    ids = np.zeros(tuple(lead_shape), np.int64) if segment_ids is None else signed_segment_ids(segment_ids)
    if not causal_shift or ids.ndim == 0:
        return ids
    following = np.concatenate([ids[..., 1:], np.full(ids.shape[:-1] + (min(ids.shape[-1], 1),), -1, np.int64)], axis=-1)
    return np.where(ids == following, following, -1)


def signed_segment_ids(segment_ids: np.ndarray) -> np.ndarray:
    """NumPy ids as int64 with the same sequences and padding (ids ``< 0``): as they are, except
    uint64 ids, which int64 would wrap (``2**63`` and up would become padding): those are their
    ranks among the array's distinct ids (all ``>= 0``: an unsigned id is never padding)."""
    ids = np.asarray(segment_ids)
    if ids.dtype.kind == "u" and ids.dtype.itemsize >= 8:
        return np.unique(ids, return_inverse=True)[1].reshape(ids.shape).astype(np.int64)
    return ids.astype(np.int64)


def sequence_weight_sums(weight: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, int]:
    """``(n, S)``: per token, the weight sum ``n_s`` of its sequence (float64; 0 for padding ids),
    and the number ``S`` of sequences (``(row, id)`` pairs, id ``>= 0``) with ``n_s > 0``. A plain
    loop over rows and ids: the reference the frameworks' sort-based versions are tested against."""
    weight = np.asarray(weight, np.float64)
    ids = np.asarray(ids)
    time = ids.shape[-1] if ids.ndim else 1
    flat_w, flat_ids = weight.reshape(-1, time), ids.reshape(-1, time)
    n = np.zeros_like(flat_w)
    count = 0
    for row in range(flat_ids.shape[0]):
        for seq in np.unique(flat_ids[row]):
            if seq < 0:
                continue
            members = flat_ids[row] == seq
            total = float(flat_w[row][members].sum())
            n[row][members] = total
            count += int(total > 0)
    return n.reshape(weight.shape), count


def sequence_coefficients(weight: np.ndarray, ids: np.ndarray, normalization: str, denominator: Any = None) -> np.ndarray:
    """``coef_t`` of the sequence modes (float64): ``w_t / (n_s S)`` or ``w_t / S``, ``S`` the
    given ``denominator`` if any; 0 where ``S == 0`` or ``w_t == 0``."""
    n, count = sequence_weight_sums(weight, ids)
    total = float(count) if denominator is None else float(np.asarray(denominator, np.float64).reshape(()))
    weight = np.asarray(weight, np.float64)
    if total <= 0:
        return np.zeros_like(weight)
    if normalization == "sequence_sum":
        return weight / total
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(weight > 0, weight / np.where(n > 0, n, 1.0) / total, 0.0)


def first_positions(ids: np.ndarray) -> np.ndarray:
    """Per position (bool): the first position of its row holding its id, for ids ``>= 0``: the
    position that counts the sequence under ``sequence_parallel``."""
    ids = np.asarray(ids)
    first = np.zeros(ids.shape, bool)
    flat_ids, flat_first = ids.reshape(-1, ids.shape[-1]), first.reshape(-1, ids.shape[-1])
    for row in range(flat_ids.shape[0]):
        seen: set[int] = set()
        for t, seq in enumerate(flat_ids[row]):
            if seq >= 0 and int(seq) not in seen:
                seen.add(int(seq))
                flat_first[row, t] = True
    return first


def compact_segment_ids(segment_ids: np.ndarray) -> np.ndarray:
    """NumPy ids as int32 with the same sequences: ids ``< 0`` become ``-1``, the others their rank
    among the array's distinct non-negative ids (for frameworks whose default integer is 32
    bits, where 64-bit ids would wrap). Only for ids of one call: ranks differ between arrays."""
    ids = np.asarray(segment_ids)
    info = np.iinfo(np.int32)
    if ids.size == 0 or (int(ids.min()) >= info.min and int(ids.max()) <= info.max):
        return ids.astype(np.int32)
    distinct, inverse = np.unique(ids, return_inverse=True)
    negatives = int(np.sum(distinct < 0))
    return np.where(ids < 0, -1, inverse.reshape(ids.shape) - negatives).astype(np.int32)


def check_sequence_parallel_axis(lead_shape: tuple[int, ...]) -> None:
    """``sequence_parallel=`` splits the time axis (the last leading axis): it needs one."""
    if len(lead_shape) < 1:
        raise ValueError(
            "sequence_parallel splits the time axis: it needs labels/loss_mask of shape [..., T] (logits [..., T, V]); "
            f"got leading shape {_shape(tuple(lead_shape))}"
        )
