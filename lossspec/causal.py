"""The causal-LM shift (``causal_shift=True``), written once for the oracle and both frameworks.

Labels and ``loss_mask`` are given per token of the *input* sequence (Hugging Face style,
``labels=input_ids``), the last leading axis of ``logits [..., T, V]`` is time, and::

    position t (0 <= t < T - 1) is scored against labels[..., t + 1], weight loss_mask[..., t + 1]
    position T - 1 (the last of each row) has weight 0: loss 0, gradient exactly 0

For the distillation kinds the teacher logits are *not* shifted (student and teacher logits at
position ``t`` both predict token ``t + 1``); only ``loss_mask`` shifts, and the last position
is ignored. ``labels[..., 0]`` and ``loss_mask[..., 0]`` are never read (no value check either).

Normalisation counts the scored positions: ``"tokens"`` gives ``D = prod(lead[:-1]) * (T - 1)``
(:func:`scored_positions`), ``"valid_tokens"`` the sum of the shifted weights;
``count_denominator(..., causal_shift=True)`` counts ``labels[..., 1:]`` / ``loss_mask[..., 1:]``.
``normalization="none"`` keeps the shape ``[..., T]``, 0 at the last position.

Only the labels and the mask (``[..., T]``, small) are shifted: left by one, padded with a
weight-0 entry (:func:`shift_left`); the logits are never copied and the kernels are unchanged.
It needs a time axis (at least one leading axis); :func:`check_loss_time_axis` and
:func:`check_count_time_axis` say so otherwise, with one message in both frameworks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_causal_shift(value: Any) -> bool:
    """``causal_shift`` as a Python ``bool`` (a NumPy bool too); anything else a ``TypeError``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"causal_shift must be a bool; got {type(value).__name__}")
    return bool(value)


def check_loss_time_axis(logits_shape: tuple[int, ...]) -> None:
    """A loss call with ``causal_shift=True`` needs logits ``[..., T, V]`` (a time axis before the
    vocabulary); otherwise a ``ValueError``."""
    if len(logits_shape) < 2:
        raise ValueError(
            "causal_shift=True needs a time axis: logits of shape [..., T, V] (time is the last leading axis); "
            f"got logits of shape {_shape(tuple(logits_shape))}"
        )


def check_count_time_axis(shape: tuple[int, ...]) -> None:
    """``count_denominator(..., causal_shift=True)`` needs labels / loss_mask ``[..., T]``."""
    if len(shape) < 1:
        raise ValueError(
            "causal_shift=True needs a time axis: labels/loss_mask of shape [..., T] (time is the last axis); "
            f"got labels/loss_mask of shape {_shape(tuple(shape))}"
        )


def scored_positions(lead_shape: tuple[int, ...], causal_shift: bool) -> int:
    """The ``"tokens"`` denominator: ``prod(lead)`` positions, or with the shift
    ``prod(lead[:-1]) * max(T - 1, 0)`` (the last position of each row is not scored)."""
    lead = tuple(int(s) for s in lead_shape)  # plain Python: torch.compile traces it
    if not causal_shift:
        return math.prod(lead)
    return math.prod(lead[:-1]) * max(lead[-1] - 1, 0)


def shift_left(values: np.ndarray, fill: Any) -> np.ndarray:
    """``out[..., t] = values[..., t + 1]`` and ``out[..., T - 1] = fill`` (NumPy; the frameworks
    write the same two lines: a slice and a one-column pad)."""
    values = np.asarray(values)
    pad = np.full(values.shape[:-1] + (min(values.shape[-1], 1),), fill, dtype=values.dtype)
    return np.concatenate([values[..., 1:], pad], axis=-1)


def shift_targets(
    labels: np.ndarray | None, loss_mask: np.ndarray | None, lead_shape: tuple[int, ...]
) -> tuple[np.ndarray | None, np.ndarray]:
    """``(labels, loss_mask)`` of the scored positions: both shifted left by one; the labels
    padded with 0 (any value is legal where the weight is 0), the mask with 0 (``False``). A
    missing mask becomes the boolean ``t < T - 1``."""
    if loss_mask is None:
        loss_mask = np.ones(tuple(lead_shape), dtype=bool)
    shifted_labels = None if labels is None else shift_left(labels, 0)
    return shifted_labels, shift_left(loss_mask, 0)
