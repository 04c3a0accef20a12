"""The numeric bounds of SPEC section 6 as named constants, and comparisons that report the
error in units of the bound (1.0 = exactly at the bound; a pass is <= 1)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# |loss - ref| <= LOSS_RTOL * max(1, |ref|), every dtype, per token for "none".
LOSS_RTOL: float = 4e-6
# |grad - ref| <= GRAD_RTOL * S, S = max(max|ref grad|, G0), fp32 logits (plus one ulp for 16-bit).
GRAD_RTOL: float = 4e-6
# 16-bit gradients: within this many units in the last place of the 16-bit dtype of the reference.
GRAD_ULPS_16BIT: float = 1.0

SIXTEEN_BIT = ("bfloat16", "float16")
# Significand bits after the point and the smallest normal exponent of the 16-bit dtypes.
_FRACTION_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}
_MIN_EXPONENT = {"bfloat16": -126, "float16": -14, "float32": -126, "float64": -1022}


def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` at ``|values|`` (one unit in the last place), float64."""
    values = np.abs(np.asarray(values, dtype=np.float64))
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.where(values > 0, values, 1.0)))
    exponent = np.maximum(np.where(values > 0, exponent, _MIN_EXPONENT[dtype]), _MIN_EXPONENT[dtype])
    return np.exp2(exponent - _FRACTION_BITS[dtype])


def round_to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round float values to ``dtype`` (nearest even) and return them as float32 (float64 for
    ``"float64"``), so that a framework can cast them to ``dtype`` exactly."""
    values = np.asarray(values)
    if dtype == "float64":
        return values.astype(np.float64)
    if dtype == "float32":
        return values.astype(np.float32)
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        as_f32 = np.ascontiguousarray(values.astype(np.float32))
        bits = as_f32.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = rounded.astype(np.uint32).view(np.float32)
        # Keep NaN and inf as they are (the rounding trick is for finite values).
        return np.where(np.isfinite(as_f32), out, as_f32)
    raise ValueError(f"dtype must be one of float32, bfloat16, float16, float64; got {dtype!r}")


@dataclasses.dataclass
class Comparison:
    """Result of one comparison: worst error in units of its bound, and where it is."""

    what: str
    error_units: float
    worst_index: tuple[int, ...]
    actual: float
    reference: float
    bound: float

    @property
    def ok(self) -> bool:
        return bool(self.error_units <= 1.0)

    def message(self) -> str:
        return (
            f"{self.what}: worst error {self.error_units:.3g}x its bound at {self.worst_index} "
            f"(got {self.actual!r}, reference {self.reference!r}, bound {self.bound:.3g})"
        )

    def check(self) -> "Comparison":
        if not self.ok:
            raise AssertionError(self.message())
        return self


def worst_comparison(what: str, actual: np.ndarray, reference: np.ndarray, bound: np.ndarray) -> Comparison:
    actual = np.asarray(actual, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if actual.shape != reference.shape:
        raise AssertionError(f"{what}: shape {actual.shape} differs from the reference's {reference.shape}")
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), reference.shape)
    if reference.size == 0:
        return Comparison(what, 0.0, (), 0.0, 0.0, 0.0)
    both_nan = np.isnan(actual) & np.isnan(reference)
    same_inf = np.isinf(actual) & (actual == reference)
    with np.errstate(invalid="ignore"):
        units = np.abs(actual - reference) / bound
    units = np.where(both_nan | same_inf, 0.0, units)
    units = np.where(np.isnan(units), np.inf, units)  # a NaN on one side only is a failure
    flat = int(np.argmax(units))
    index = tuple(int(i) for i in np.unravel_index(flat, reference.shape))
    return Comparison(what, float(units.flat[flat]), index, float(actual.flat[flat]), float(reference.flat[flat]), float(bound.flat[flat]))


def loss_bound(reference: Any) -> np.ndarray:
    """``LOSS_RTOL * max(1, |ref|)`` (elementwise for per-token losses)."""
    return LOSS_RTOL * np.maximum(1.0, np.abs(np.nan_to_num(np.asarray(reference, dtype=np.float64))))


def compare_loss(actual: Any, reference: Any, what: str = "loss") -> Comparison:
    """``|loss - ref| <= 4e-6 * max(1, |ref|)``; NaN must match NaN."""
    return worst_comparison(what, np.asarray(actual), np.asarray(reference), loss_bound(reference))


def gradient_scale(reference_grad: np.ndarray, g0: float) -> float:
    """``S = max(max|ref grad|, G0)``."""
    finite = np.asarray(reference_grad, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    peak = float(np.max(np.abs(finite))) if finite.size else 0.0
    return max(peak, float(g0))


def gradient_floor(max_weight: float, denominator: float, logit_scale: float = 1.0, temperature: float = 1.0) -> float:
    """``G0 = (max weight / D) * logit_scale / temperature`` (0 when ``D == 0``)."""
    if denominator <= 0 or max_weight <= 0:
        return 0.0
    return max_weight / denominator * logit_scale / temperature


def grad_bound(reference_grad: np.ndarray, dtype: str, g0: float) -> np.ndarray:
    """Per-element bound: ``GRAD_RTOL * S`` plus, for 16-bit dtypes, one ulp of the reference."""
    reference_grad = np.asarray(reference_grad, dtype=np.float64)
    scale = gradient_scale(reference_grad, g0)
    bound = np.full(reference_grad.shape, GRAD_RTOL * scale)
    if dtype in SIXTEEN_BIT:
        bound = bound + GRAD_ULPS_16BIT * ulp(np.nan_to_num(reference_grad), dtype)
    # An all-zero reference (D == 0) with G0 == 0 must be matched exactly.
    return np.where(bound > 0, bound, np.finfo(np.float64).tiny)


def compare_grad(actual: Any, reference: Any, dtype: str, g0: float, what: str = "grad") -> Comparison:
    """Gradient bound of SPEC section 6 for logits of ``dtype``."""
    return worst_comparison(what, np.asarray(actual), np.asarray(reference), grad_bound(reference, dtype, g0))


def g0_for(
    loss_mask: np.ndarray | None,
    valid: np.ndarray,
    denominator: float,
    logit_scale: float,
    temperature: float,
    normalization: str,
    grad_output: Any = None,
) -> float:
    """``G0`` of a call: max weight over valid tokens / D * logit_scale / temperature; for
    ``"none"``, ``D = 1 / max|upstream|``."""
    weights = np.ones(np.shape(valid)) if loss_mask is None else np.asarray(loss_mask, dtype=np.float64)
    weights = np.where(np.asarray(valid, bool), weights, 0.0)
    max_weight = float(weights.max()) if weights.size else 0.0
    upstream = 1.0 if grad_output is None else float(np.max(np.abs(np.asarray(grad_output, dtype=np.float64))))
    if normalization == "none":
        return max_weight * upstream * logit_scale / temperature
    denom = denominator if denominator > 0 else 0.0
    return gradient_floor(max_weight, denom, logit_scale, temperature) * upstream if denom else 0.0


def assert_close_to_oracle(
    loss: Any, grad: Any, ref_loss: Any, ref_grad: Any, *, dtype: str, g0: float, what: str = ""
) -> tuple[Comparison, Comparison]:
    """Check a backend's ``(loss, grad)`` against the oracle at the SPEC bounds; raise an
    ``AssertionError`` whose message gives the worst error in units of the bound."""
    prefix = f"{what}: " if what else ""
    loss_cmp = compare_loss(loss, ref_loss, prefix + "loss").check()
    grad_cmp = compare_grad(grad, ref_grad, dtype, g0, prefix + "grad").check()
    return loss_cmp, grad_cmp
