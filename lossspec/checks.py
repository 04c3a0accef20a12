"""Input checks written once over plain metadata (shapes and dtype kinds).

Each framework describes its arrays with :func:`meta` and calls :func:`check_inputs`, so JAX,
torch and the oracle raise the same ``TypeError``/``ValueError`` with the same message. Value
checks (label range, weights) take NumPy arrays and are only called where reading the values
costs no device synchronisation (SPEC section 5).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from .config import LossConfig

# dtype kinds, as in numpy's ``dtype.kind``: b bool, i signed int, u unsigned int, f float, c complex.
FLOAT_KIND = "f"
INT_KINDS = ("i", "u")
BOOL_KIND = "b"
# Logit dtypes the kernels accept.
LOGIT_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class ArrayMeta:
    """What the checks need to know of an array: its shape, dtype kind and dtype name."""

    shape: tuple[int, ...]
    kind: str
    dtype: str


def meta(shape: Any, dtype_kind: str, dtype_name: str) -> ArrayMeta:
    return ArrayMeta(tuple(int(s) for s in shape), dtype_kind, str(dtype_name))


def numpy_meta(array: np.ndarray) -> ArrayMeta:
    """:func:`meta` of a NumPy array. The extension floats of ``ml_dtypes`` (``bfloat16``,
    ``float8_*``, ...), which NumPy files under kind ``"V"``, count as floats (``"f"``)."""
    kind = array.dtype.kind
    if kind == "V" and array.dtype.name.startswith(("bfloat", "float")):
        kind = "f"
    return meta(array.shape, kind, array.dtype.name)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_inputs(
    config: LossConfig,
    logits: ArrayMeta,
    target: ArrayMeta,
    loss_mask: ArrayMeta | None,
) -> None:
    """Check shapes and dtypes of one loss call (SPEC section 5).

    Args:
      config: the call's validated options.
      logits: ``[..., V]`` floating point.
      target: labels ``[...]`` (integer) for ``cross_entropy``, teacher logits ``[..., V]``
        (floating point) for the distillation kinds.
      loss_mask: ``[...]`` boolean or floating-point weights, or ``None``.
    """
    if logits.kind != FLOAT_KIND:
        raise TypeError(f"logits must be a floating-point array of shape [..., V]; got dtype {logits.dtype}")
    if len(logits.shape) == 0:
        raise ValueError("logits must have shape [..., V] with at least one dimension; got a scalar")
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary axis (V > 0); got shape {_shape(logits.shape)}")
    lead = logits.shape[:-1]
    if config.kind == "cross_entropy":
        if target.kind not in INT_KINDS:
            raise TypeError(f"labels must be an integer array of shape {_shape(lead)}; got dtype {target.dtype}")
        if target.shape != lead:
            raise ValueError(
                f"labels must have the leading shape of logits {_shape(lead)}; got labels {_shape(target.shape)} "
                f"for logits {_shape(logits.shape)}"
            )
    else:
        if target.kind != FLOAT_KIND:
            raise TypeError(
                f"teacher_logits must be a floating-point array of shape {_shape(logits.shape)}; got dtype {target.dtype}"
            )
        if target.shape != logits.shape:
            raise ValueError(
                f"teacher_logits must have the shape of logits {_shape(logits.shape)}; got {_shape(target.shape)}"
            )
    if loss_mask is not None:
        if loss_mask.kind not in (BOOL_KIND, FLOAT_KIND, *INT_KINDS):
            raise TypeError(f"loss_mask must be boolean or floating-point weights; got dtype {loss_mask.dtype}")
        if loss_mask.shape != lead:
            raise ValueError(
                f"loss_mask must have the leading shape of logits {_shape(lead)}; got {_shape(loss_mask.shape)}"
            )


def check_denominator_allowed(config: LossConfig, denominator: Any) -> None:
    """``denominator=`` overrides ``D`` of the reduced modes (``"sum"`` defaults to ``D = 1``);
    ``"none"`` returns per-token losses and has no denominator."""
    if denominator is not None and config.normalization == "none":
        raise ValueError(
            "denominator= is not used with normalization 'none' (it returns per-token losses); "
            "use 'valid_tokens', 'tokens' or 'sum'"
        )


def check_denominator_value(denominator: Any) -> None:
    """Value check of an eager (host) denominator: a finite number >= 0."""
    value = float(np.asarray(denominator, dtype=np.float64).reshape(()))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"denominator must be a finite number >= 0; got {value}")


def check_denominator_shape(shape: tuple[int, ...]) -> None:
    if tuple(shape) not in ((), (1,)):
        raise ValueError(f"denominator must be a scalar; got shape {_shape(tuple(shape))}")


def check_weights(loss_mask: np.ndarray) -> None:
    """Value check of float weights: finite and >= 0 (SPEC section 5)."""
    weights = np.asarray(loss_mask)
    if weights.dtype.kind == BOOL_KIND or weights.size == 0:
        return
    weights = weights.astype(np.float64)
    if not np.all(np.isfinite(weights)):
        raise ValueError("loss_mask weights must be finite; got NaN or inf")
    if np.any(weights < 0):
        raise ValueError(f"loss_mask weights must be >= 0; got minimum {weights.min()}")


def check_labels(labels: np.ndarray, valid: np.ndarray, vocab_size: int) -> None:
    """Value check: every valid token's label lies in ``[0, vocab_size)``."""
    labels = np.asarray(labels)
    bad = np.asarray(valid, dtype=bool) & ((labels < 0) | (labels >= vocab_size))
    if np.any(bad):
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) for valid tokens (or equal ignore_index); "
            f"got {int(labels[first])} at position {first}"
        )


def check_count_args(normalization: str, labels: ArrayMeta | None, loss_mask: ArrayMeta | None) -> None:
    """Arguments of ``count_denominator``."""
    from .config import COUNTED_NORMALIZATIONS, check_normalization

    check_normalization(normalization)
    if normalization not in COUNTED_NORMALIZATIONS:
        raise ValueError(
            f"count_denominator only counts normalization 'valid_tokens' or 'tokens'; "
            f"normalization {normalization!r} has D = 1 however the batch is split"
        )
    if labels is None and loss_mask is None:
        raise ValueError("count_denominator needs labels or loss_mask (or both) to see the batch")
    if labels is not None and labels.kind not in INT_KINDS:
        raise TypeError(f"labels must be an integer array; got dtype {labels.dtype}")
    if loss_mask is not None and loss_mask.kind not in (BOOL_KIND, FLOAT_KIND, *INT_KINDS):
        raise TypeError(f"loss_mask must be boolean or floating-point weights; got dtype {loss_mask.dtype}")
    if labels is not None and loss_mask is not None and labels.shape != loss_mask.shape:
        raise ValueError(
            f"loss_mask must have the shape of labels {_shape(labels.shape)}; got {_shape(loss_mask.shape)}"
        )
