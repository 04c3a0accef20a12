"""Splitting one step's batch into micro-batches: the rule both frameworks' helpers follow.

``split_microbatches(batch, K)`` and ``accumulate(..., num_microbatches=K)`` (``jaxloss.distributed``,
``torchloss.distributed``) split every leaf along its leading (batch) axis of ``B`` rows into ``K``
contiguous micro-batches with the sizes of ``numpy.array_split`` (:func:`microbatch_sizes`)::

    q, r = divmod(B, K)       # the first r micro-batches hold q + 1 rows, the other K - r hold q

``B`` need not divide by ``K``; with ``K > B`` the last ``K - B`` micro-batches are empty. With
the global denominator (the sum of every micro-batch's count) the result equals the full batch
for any split. Every leaf needs the same leading size ``B``. With ``causal_shift=True`` the
batch axis is split and the time axis (the last one) is shifted, so the counted labels / mask
need both: ``[B, ..., T]``.
"""

from __future__ import annotations

from typing import Any, Iterable


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_num_microbatches(num_microbatches: Any) -> int:
    """``K``: a positive Python ``int``; otherwise a ``ValueError``."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int; got {num_microbatches!r}")
    return num_microbatches


def batch_rows(shapes: Iterable[tuple[int, ...]]) -> int:
    """The common leading size ``B`` of the batch's leaves (their ``shapes``). A leaf without a
    leading axis, leaves of different ``B`` or no leaf at all are a ``ValueError``."""
    shapes = [tuple(int(s) for s in shape) for shape in shapes]
    if not shapes:
        raise ValueError("the batch has no arrays to split into micro-batches")
    for shape in shapes:
        if len(shape) == 0:
            raise ValueError(f"every batch leaf needs a leading batch axis to split into micro-batches; got shape {_shape(shape)}")
    rows = {shape[0] for shape in shapes}
    if len(rows) > 1:
        raise ValueError(
            "every batch leaf needs the same leading batch size to split into micro-batches; got "
            + ", ".join(_shape(shape) for shape in shapes)
        )
    return rows.pop()


def microbatch_sizes(rows: int, num_microbatches: int) -> tuple[int, ...]:
    """The rows of each micro-batch, as ``numpy.array_split``: the first ``rows % K`` get
    ``rows // K + 1``, the others ``rows // K`` (e.g. 10 rows in 4: ``(3, 3, 2, 2)``)."""
    check_num_microbatches(num_microbatches)
    quotient, remainder = divmod(int(rows), num_microbatches)
    return tuple(quotient + 1 if k < remainder else quotient for k in range(num_microbatches))


def check_shifted_microbatch(shape: tuple[int, ...]) -> None:
    """The counted labels / mask of a micro-batch under ``causal_shift=True`` need a batch axis
    (split) and a time axis (shifted): ``[B, ..., T]``."""
    if len(shape) < 2:
        raise ValueError(
            "causal_shift=True with micro-batches needs labels/loss_mask of shape [B, ..., T] (the batch axis is "
            f"split, the time axis shifted); got a micro-batch of shape {_shape(tuple(shape))}"
        )
