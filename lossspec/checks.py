"""Input checks written once over plain metadata (shapes and dtype kinds).

Each framework describes its arrays with :func:`meta` and calls :func:`check_inputs`, so JAX,
torch and the oracle raise the same ``TypeError``/``ValueError`` with the same message. Value
checks (label range, weights) take NumPy arrays and are only called where reading the values
costs no device synchronisation (SPEC section 5).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from . import accumulation
from .causal import check_causal_shift, check_count_time_axis, check_loss_time_axis
from .config import LossConfig
from .sequences import check_segment_ids, check_sequence_time_axis

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


def shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_inputs(
    config: LossConfig,
    logits: ArrayMeta,
    target: ArrayMeta | None,
    loss_mask: ArrayMeta | None,
    segment_ids: ArrayMeta | None = None,
) -> None:
    """Check shapes and dtypes of one loss call (SPEC section 5).

    Args:
      config: the call's validated options.
      logits: ``[..., V]`` floating point.
      target: labels ``[...]`` (integer) for ``cross_entropy``, teacher logits ``[..., V]``
        (floating point) for the distillation kinds; not read for ``entropy`` (no target).
      loss_mask: ``[...]`` boolean or floating-point weights, or ``None``.
      segment_ids: ``[...]`` integers, or ``None`` (:mod:`lossspec.sequences`).
    """
    if logits.kind != FLOAT_KIND:
        raise TypeError(f"logits must be a floating-point array of shape [..., V]; got dtype {logits.dtype}")
    if logits.dtype not in LOGIT_DTYPES:  # e.g. float8_*: no kernel reads them (fail here, not in ATen / XLA)
        raise TypeError(f"logits must have dtype float32, bfloat16, float16 or float64; got {logits.dtype}")
    if len(logits.shape) == 0:
        raise ValueError("logits must have shape [..., V] with at least one dimension; got a scalar")
    if logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty vocabulary axis (V > 0); got shape {shape_text(logits.shape)}")
    if config.causal_shift:
        check_loss_time_axis(logits.shape)
    lead = logits.shape[:-1]
    if not config.has_target:
        pass
    elif config.has_labels:
        assert target is not None
        if target.kind not in INT_KINDS:
            raise TypeError(f"labels must be an integer array of shape {shape_text(lead)}; got dtype {target.dtype}")
        if target.shape != lead:
            raise ValueError(
                f"labels must have the leading shape of logits {shape_text(lead)}; got labels {shape_text(target.shape)} "
                f"for logits {shape_text(logits.shape)}" + class_axis_hint(logits.shape, target.shape)
            )
    else:
        assert target is not None
        if target.kind != FLOAT_KIND:
            raise TypeError(
                f"teacher_logits must be a floating-point array of shape {shape_text(logits.shape)}; got dtype {target.dtype}"
            )
        if target.dtype not in LOGIT_DTYPES:
            raise TypeError(f"teacher_logits must have dtype float32, bfloat16, float16 or float64; got {target.dtype}")
        if target.shape != logits.shape:
            raise ValueError(
                f"teacher_logits must have the shape of logits {shape_text(logits.shape)}; got {shape_text(target.shape)}"
            )
    if loss_mask is not None:
        check_loss_mask_dtype(loss_mask)
        if not mask_broadcasts(loss_mask.shape, lead):
            raise ValueError(
                f"loss_mask must have the leading shape of logits {shape_text(lead)} or broadcast to it "
                f"({_broadcast_examples(lead)}); got {shape_text(loss_mask.shape)}" + class_axis_hint(logits.shape, loss_mask.shape)
            )
    if segment_ids is not None:
        check_segment_ids(segment_ids.kind, segment_ids.dtype, segment_ids.shape, lead)
    check_sequence_time_axis(config.normalization, lead)


def check_loss_mask_dtype(loss_mask: ArrayMeta) -> None:
    """``loss_mask`` is boolean (a 0/1 mask) or floating-point weights. An integer mask is refused
    (``TypeError``): it would be read as weights, so a mask built from label ids (or passed where
    the labels go, ``entropy(logits, labels)``) would silently weight tokens by their values."""
    if loss_mask.kind not in (BOOL_KIND, FLOAT_KIND):
        hint = " (an integer mask would weight tokens by its values: pass mask.bool() or a float mask)" if loss_mask.kind in INT_KINDS else ""
        raise TypeError(f"loss_mask must be boolean or floating-point weights; got dtype {loss_mask.dtype}{hint}")


DENOMINATOR_TYPE_MESSAGE = "denominator must be a number or a 0-d tensor / array of a real dtype; got {}"


def check_denominator_type(denominator: Any, array: ArrayMeta | None = None) -> None:
    """``denominator=`` is a real number: a Python ``int`` / ``float`` or a NumPy real scalar (not
    ``bool``), or (``array``: its metadata) an array / tensor of an integer or floating dtype (not
    bool, not complex). Anything else (a string, a list, ``True``, a complex tensor) is a
    ``TypeError`` naming ``denominator``; the shape is :func:`check_denominator_shape`'s."""
    if array is not None:
        if array.kind not in (FLOAT_KIND, *INT_KINDS):
            raise TypeError(DENOMINATOR_TYPE_MESSAGE.format(f"dtype {array.dtype}"))
        return
    if isinstance(denominator, (bool, np.bool_)) or not isinstance(denominator, numbers.Real):
        raise TypeError(DENOMINATOR_TYPE_MESSAGE.format(type(denominator).__name__))


def check_vocab_size_arg(vocab_size: Any) -> int:
    """A ``vocab_size`` argument (the Hugging Face adapter's): a Python or NumPy ``int`` (not
    ``bool``), as an ``int``; else a ``TypeError`` naming it."""
    if isinstance(vocab_size, (bool, np.bool_)) or not isinstance(vocab_size, (int, np.integer)):
        raise TypeError(f"vocab_size must be an int (the last dimension of logits); got {type(vocab_size).__name__}")
    return int(vocab_size)


def check_denominator_allowed(config: LossConfig, denominator: Any) -> None:
    """``denominator=`` overrides ``D`` of the reduced modes (``"sum"`` defaults to ``D = 1``);
    ``"none"`` returns per-token losses and has no denominator."""
    if denominator is not None and config.normalization == "none":
        raise ValueError(
            "denominator= is not used with normalization 'none' (it returns per-token losses); "
            "use 'valid_tokens', 'tokens', 'sum', 'sequence_mean' or 'sequence_sum'"
        )


FP32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, 2**-126 ~ 1.17549e-38
FP32_MAX = float(np.finfo(np.float32).max)  # ~ 3.40282e+38


def check_denominator_value(denominator: Any) -> None:
    """Value check of an eager (host) denominator.

    ``D`` is used in float32 (SPEC section 2; ``D == 0`` means loss 0 and gradient 0), so the
    value, read as float64, must be:

    - finite and ``>= 0``, else ``ValueError("denominator must be a finite number >= 0; got X")``;
    - ``0`` or a *normal* float32 number, ``FP32_TINY <= D <= FP32_MAX`` (``np.finfo(np.float32)
      .tiny`` / ``.max``), else ``ValueError("denominator must be 0 or a normal float32 number
      in [1.1754944e-38, 3.4028235e+38] (D is used in float32); got X")``. A subnormal ``D``
      would be flushed to 0 on some devices (loss 0) and kept on others (a huge loss); one above
      the float32 range would become ``inf`` (loss 0).

    Under tracing the frameworks cannot raise: the same conditions make the loss NaN.
    """
    value = float(np.asarray(denominator, dtype=np.float64).reshape(()))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"denominator must be a finite number >= 0; got {value}")
    if value != 0 and not FP32_TINY <= value <= FP32_MAX:
        raise ValueError(
            f"denominator must be 0 or a normal float32 number in [{FP32_TINY:.8g}, {FP32_MAX:.8g}] "
            f"(D is used in float32); got {value:.8g}"
        )


def check_denominator_shape(shape: tuple[int, ...]) -> None:
    if tuple(shape) not in ((), (1,)):
        raise ValueError(f"denominator must be a scalar; got shape {shape_text(tuple(shape))}")


def check_weights(loss_mask: np.ndarray) -> None:
    """Value check of a ``loss_mask`` on the host (SPEC section 5). Weights are used in float32.

    Boolean masks always pass (integer masks are refused earlier, :func:`check_loss_mask_dtype`).
    Otherwise (float weights), in this order, each
    failure a ``ValueError`` that names ``loss_mask``:

    1. every weight finite (read as float64):
       ``"loss_mask weights must be finite; got NaN or inf"``;
    2. every weight ``>= 0``: ``"loss_mask weights must be >= 0; got minimum X"``;
    3. every weight finite once converted to float32 (``<= FP32_MAX`` up to float32 rounding):
       ``"loss_mask weights must be finite in float32 (at most 3.4028235e+38); got X"``;
    4. every positive weight a normal float32 number (``>= FP32_TINY = np.finfo(np.float32).tiny``):
       ``"loss_mask weights must be 0 or at least 1.1754944e-38 (the smallest normal float32;
       smaller weights are flushed to zero on some devices); got X"``;
    5. the sum of all weights (the float32 values, summed in float64; every token of the mask,
       also those that ``ignore_index`` masks) at most ``FP32_MAX``:
       ``"loss_mask weights must have a sum that is finite in float32 (at most 3.4028235e+38);
       got a sum of X"`` (the float32 ``valid_tokens`` denominator would be ``inf``).

    ``count_denominator`` applies the same check. Under tracing the frameworks cannot raise:
    the same conditions make the loss (and the count) NaN.
    """
    weights = np.asarray(loss_mask)
    if weights.dtype.kind == BOOL_KIND or weights.size == 0:
        return
    weights = weights.astype(np.float64)
    if not np.all(np.isfinite(weights)):
        raise ValueError("loss_mask weights must be finite; got NaN or inf")
    if np.any(weights < 0):
        raise ValueError(f"loss_mask weights must be >= 0; got minimum {weights.min()}")
    with np.errstate(over="ignore"):
        weights32 = weights.astype(np.float32)
    if not np.all(np.isfinite(weights32)):
        raise ValueError(
            f"loss_mask weights must be finite in float32 (at most {FP32_MAX:.8g}); got {float(weights.max()):.8g}"
        )
    tiny = (weights > 0) & (weights < FP32_TINY)
    if np.any(tiny):
        raise ValueError(
            f"loss_mask weights must be 0 or at least {FP32_TINY:.8g} (the smallest normal float32; smaller "
            f"weights are flushed to zero on some devices); got {float(weights[tiny].min()):.8g}"
        )
    total = float(np.sum(weights32, dtype=np.float64))
    if total > FP32_MAX:
        raise ValueError(
            f"loss_mask weights must have a sum that is finite in float32 (at most {FP32_MAX:.8g}); "
            f"got a sum of {total:.8g}"
        )


def ignore_index_in_dtype(ignore_index: int, dtype: Any) -> bool:
    """Whether a label of integer ``dtype`` (a NumPy dtype or its name) can equal ``ignore_index``.

    Labels are compared with ``ignore_index`` exactly, never after a conversion that wraps or
    overflows: when this is ``False`` no label is ignored (e.g. ``uint32`` labels with the
    default ``-100``, or ``int32`` labels with ``2**40``); when ``True`` the comparison is done in
    the labels' own dtype.
    """
    info = np.iinfo(np.dtype(dtype))
    return int(info.min) <= int(ignore_index) <= int(info.max)


def check_labels(labels: np.ndarray, valid: np.ndarray, vocab_size: int, causal_shift: bool = False) -> None:
    """Value check: every valid token's label lies in ``[0, vocab_size)``.

    With ``causal_shift`` the arrays are the shifted ones (``labels[..., t]`` is the given
    ``labels[..., t + 1]``); the error names the position in the given labels."""
    labels = np.asarray(labels)
    bad = np.asarray(valid, dtype=bool) & ((labels < 0) | (labels >= vocab_size))
    if np.any(bad):
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        given = first[:-1] + (first[-1] + 1,) if causal_shift else first
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) for valid tokens (or equal ignore_index); "
            f"got {int(labels[first])} at position {given}"
        )


def check_count_args(
    normalization: str,
    labels: ArrayMeta | None,
    loss_mask: ArrayMeta | None,
    causal_shift: Any = False,
    segment_ids: ArrayMeta | None = None,
) -> None:
    """Arguments of ``count_denominator`` (``causal_shift=True`` and the sequence modes need a
    time axis; ``segment_ids`` the shape of the labels / mask)."""
    from .config import COUNTED_NORMALIZATIONS, check_normalization

    check_normalization(normalization)
    if normalization not in COUNTED_NORMALIZATIONS:
        raise ValueError(
            f"count_denominator only counts normalization 'valid_tokens', 'tokens', 'sequence_mean' or 'sequence_sum'; "
            f"normalization {normalization!r} has D = 1 however the batch is split"
        )
    if labels is None and loss_mask is None and segment_ids is None:
        raise ValueError("count_denominator needs labels or loss_mask (or segment_ids; any of them) to see the batch")
    if labels is not None and labels.kind not in INT_KINDS:
        raise TypeError(f"labels must be an integer array; got dtype {labels.dtype}")
    if loss_mask is not None:
        check_loss_mask_dtype(loss_mask)
    lead = count_shape(labels, loss_mask, segment_ids)
    if loss_mask is not None and not mask_broadcasts(loss_mask.shape, lead):
        of = "labels" if labels is not None else "segment_ids"
        raise ValueError(
            f"loss_mask must have the shape of {of} {shape_text(lead)} or broadcast to it ({_broadcast_examples(lead)}); "
            f"got {shape_text(loss_mask.shape)}"
        )
    if segment_ids is not None:
        check_segment_ids(segment_ids.kind, segment_ids.dtype, segment_ids.shape, lead)
    check_sequence_time_axis(normalization, lead)
    if check_causal_shift(causal_shift):
        check_count_time_axis(lead)


# ----------------------------------------------------------------------------------------------
# Shapes and names users bring from other libraries (torch.nn.functional, Liger-Kernel)
# ----------------------------------------------------------------------------------------------


def squeezed_mask_shape(mask_shape: tuple[int, ...], lead: tuple[int, ...]) -> tuple[int, ...]:
    """``mask_shape`` without a trailing size-1 axis where it has one axis more than the
    leading shape ``lead`` (``[B, T, 1]`` for ``[B, T]``: a mask shaped like the logits with
    ``V = 1``); otherwise as given."""
    mask_shape = tuple(mask_shape)
    if len(mask_shape) == len(lead) + 1 and mask_shape[-1] == 1:
        return mask_shape[:-1]
    return mask_shape


def mask_broadcasts(mask_shape: tuple[int, ...], lead: tuple[int, ...]) -> bool:
    """Whether a ``loss_mask`` of ``mask_shape`` is accepted for the leading shape ``lead``
    (SPEC section 5): after :func:`squeezed_mask_shape`, it broadcasts to ``lead`` by NumPy's
    rules (trailing axes aligned, size-1 or missing axes repeated) without growing it: ``[T]``,
    ``[B, 1]``, ``[B, T, 1]`` for ``[B, T]``."""
    squeezed = squeezed_mask_shape(mask_shape, lead)
    try:
        return np.broadcast_shapes(squeezed, tuple(lead)) == tuple(lead)
    except ValueError:
        return False


def broadcast_mask(loss_mask: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """A NumPy ``loss_mask`` accepted by :func:`mask_broadcasts`, as a (read-only) view of the
    leading shape ``lead``; a mask of that shape is returned as it is."""
    loss_mask = np.asarray(loss_mask)
    if loss_mask.shape == tuple(lead):
        return loss_mask
    return np.broadcast_to(loss_mask.reshape(squeezed_mask_shape(loss_mask.shape, lead)), tuple(lead))


def _broadcast_examples(lead: tuple[int, ...]) -> str:
    examples = [shape_text(lead[1:])] if len(lead) > 1 else []
    return "e.g. " + " or ".join(examples + [shape_text(tuple(lead) + (1,))])


def count_shape(labels: ArrayMeta | None, loss_mask: ArrayMeta | None, segment_ids: ArrayMeta | None) -> tuple[int, ...]:
    """The leading shape ``count_denominator`` counts over: the labels', else the segment ids',
    else the mask's (a mask broadcasts to the other two)."""
    ref = next(a for a in (labels, segment_ids, loss_mask) if a is not None)
    return tuple(ref.shape)


def class_axis_hint(logits_shape: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """A hint for logits in ``torch.nn.functional.cross_entropy``'s ``[B, V, T...]`` layout
    (class axis second): ``""`` unless ``shape`` (the labels' or the mask's) is ``logits_shape``
    without its second axis."""
    logits_shape, shape = tuple(logits_shape), tuple(shape)
    if len(logits_shape) >= 3 and shape == logits_shape[:1] + logits_shape[2:]:
        moved = logits_shape[:1] + logits_shape[2:] + logits_shape[1:2]
        return (
            f"; the class axis goes last here: logits {shape_text(logits_shape)} look like torch.nn.functional.cross_entropy's "
            f"[B, V, T] layout, pass them as {shape_text(moved)} (torch: logits.movedim(1, -1); JAX: jnp.moveaxis(logits, 1, -1))"
        )
    return ""


# ``reduction=`` of torch.nn.functional and Liger-Kernel, as a normalisation here.
REDUCTION_TO_NORMALIZATION = {"mean": "valid_tokens", "sum": "sum", "none": "none", "batchmean": "tokens"}
# Other libraries' option names for options these losses have under another name.
RENAMED_OPTIONS = {"lse_square_scale": "z_loss", "softcap": "logit_softcap"}


def foreign_keyword_hint(names: Any, values: dict[str, Any] | None = None) -> str:
    """What to write instead of keyword arguments named as in torch or Liger-Kernel (``""`` when
    ``names`` holds none of them): ``reduction=`` becomes ``normalization=``
    (:data:`REDUCTION_TO_NORMALIZATION`), and the options of :data:`RENAMED_OPTIONS` their names
    here. ``values`` (the call's keyword arguments) makes the hint name the exact replacement."""
    values = values or {}
    hints = []
    if "reduction" in names:
        given = values.get("reduction")
        mapping = "reduction= maps to normalization= as 'mean' -> 'valid_tokens' (the mean over valid tokens), " \
                  "'sum' -> 'sum', 'none' -> 'none', 'batchmean' -> 'tokens'; with micro-batches pass denominator= too"
        if isinstance(given, str) and given in REDUCTION_TO_NORMALIZATION:
            hints.append(f"write normalization={REDUCTION_TO_NORMALIZATION[given]!r} instead of reduction={given!r}; {mapping}")
        else:
            hints.append(f"write normalization= instead of reduction=; {mapping}")
    for name in sorted(set(names) & set(RENAMED_OPTIONS)):
        hints.append(f"write {RENAMED_OPTIONS[name]}= instead of {name}=")
    return "; ".join(hints)


def check_inplace(inplace: Any) -> bool:
    """The ``inplace=`` argument of a loss, both frameworks: ``True`` lets the gradient take the
    logits' buffer (torchloss writes it there; jaxloss aliases the Pallas kernel's gradient to the
    logits, a saving only when the logits are donated or die at the call). A ``bool``, else a
    ``TypeError``."""
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool; got {type(inplace).__name__}")
    return inplace


def inplace_refusal(reason: str, what: str = "") -> ValueError:
    """The error of an ``inplace=True`` call whose logits cannot take the gradient, one message per
    ``reason``: ``"leaf"`` (``what``: "a leaf tensor" or "a view of a leaf tensor" that requires
    grad: its values would be overwritten) or ``"contiguous"`` (the buffer must be one block).
    torchloss raises these; jaxloss never refuses (arrays are immutable: XLA copies logits that are
    still needed before the kernel writes their buffer)."""
    if reason == "leaf":
        return ValueError(
            f"inplace=True writes the gradient into the logits' buffer, but logits is {what} that requires grad "
            "(its values would be overwritten); pass the output of an operation (e.g. the LM head) instead"
        )
    if reason == "contiguous":
        return ValueError("inplace=True needs contiguous logits (their buffer receives the gradient)")
    raise ValueError(f"unknown inplace refusal {reason!r}")


def begin_call(name: str, unexpected: dict[str, Any], normalization: Any, causal_shift: Any, denominator: Any) -> None:
    """The first step of every public loss and fused head ``name`` (both frameworks): a keyword
    the function does not take (``unexpected``, its ``**unexpected``) is a ``TypeError`` naming the
    argument to write instead (:func:`foreign_keyword_hint`); else the call is recorded for
    ``accumulate(check=...)`` (:func:`lossspec.accumulation.record`)."""
    if unexpected:
        hint = foreign_keyword_hint(unexpected, unexpected)
        raise TypeError(f"{name}(): got an unexpected keyword argument {next(iter(unexpected))!r}" + (f"; {hint}" if hint else ""))
    accumulation.record(name, normalization, causal_shift, denominator)
