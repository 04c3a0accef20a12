"""The parity matrix: cases x backends, each compared with the oracle and with its twin in the
other framework at the bounds of SPEC section 6 (errors in units of the bound; <= 1 passes).

Each comparison ends in one of three statuses:

- ``"pass"``: within the bounds, and every loss and gradient value is finite;
- ``"fail"``: outside a bound, a crash, or a non-finite value where the reference's is finite
  (or the reverse, or a different non-finite value: NaN for +inf);
- ``"nonfinite"``: within the bounds, but some values are non-finite, exactly where (and as) the
  reference's are: the backend agrees with the oracle (SPEC gives NaN for a NaN or +inf in a valid
  row), yet those values prove nothing about precision, so this is flagged, never a pass.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Any, Callable, Iterable

import numpy as np

import lossspec

from .backends import BACKENDS, CROSS_PAIRS, Inputs

CE_VARIANT = {"label_smoothing": 0.1, "z_loss": 1e-3, "logit_scale": 1.3, "ignore_index": -100}
DISTILL_VARIANT = {"temperature": 2.0, "logit_scale": 0.8, "teacher_logit_scale": 1.2}
# The option variant of each kind (the distillation one for the three KL-type kinds).
VARIANTS: dict[str, dict[str, Any]] = {
    "cross_entropy": CE_VARIANT,
    "entropy": {"temperature": 2.0, "logit_scale": 0.8},
    "jensen_shannon": {**DISTILL_VARIANT, "beta": 0.3},
}


@dataclasses.dataclass
class CaseSpec:
    """One row of the matrix: inputs plus the call's options."""

    kind: str
    label: str  # scenario or file name
    inputs: Inputs
    normalization: str = "valid_tokens"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    denominator: float | None = None
    grad_output: Any = None

    @property
    def uses_segment_ids(self) -> bool:
        return self.inputs.segment_ids is not None

    @property
    def name(self) -> str:
        """``kind/label/normalization/dtype/shape[segment_ids,options,D=denominator]``."""
        shape = "x".join(map(str, self.inputs.logits.shape))
        extra = ",".join((["segment_ids"] if self.uses_segment_ids else []) + [f"{k}={v}" for k, v in self.options.items() if v is not None])
        if self.denominator is not None:
            extra += f"{',' if extra else ''}D={self.denominator:g}"
        return f"{self.kind}/{self.label}/{self.normalization}/{self.inputs.dtype}/{shape}" + (f"[{extra}]" if extra else "")

    def call_options(self) -> dict[str, Any]:
        options = dict(self.options, normalization=self.normalization)
        if self.denominator is not None:
            options["denominator"] = self.denominator
        return options

    def g0(self) -> float:
        case = lossspec.Case(self.kind, self.label, self.inputs.dtype, self.inputs.logits, self.inputs.target, self.inputs.loss_mask)
        return case.g0(**self.call_options(), grad_output=self.grad_output, segment_ids=self.inputs.segment_ids)


STATUSES = ("pass", "fail", "nonfinite")


@dataclasses.dataclass
class Result:
    """One comparison of ``backend`` with ``reference`` (the oracle or the backend's twin).

    ``loss`` and ``reference_loss`` are the two losses compared: the scalar loss, or for
    normalisation ``"none"`` the sum of the per-token losses; ``loss`` is None when the backend
    crashed. ``ok`` is ``status == "pass"``."""

    case: str
    kind: str
    dtype: str
    normalization: str
    backend: str
    reference: str
    loss_error: float
    grad_error: float
    ok: bool
    seconds: float
    message: str = ""
    status: str = "pass"
    loss: float | None = None
    reference_loss: float | None = None
    segment_ids: bool = False  # whether the case passed segment_ids (packed documents)


def reported_loss(loss: Any) -> float:
    """The loss as one number: itself, or the sum over tokens of a per-token loss (``"none"``)."""
    return float(np.sum(np.asarray(loss, dtype=np.float64)))


def reference_values(reference: str) -> str:
    """Whose values a backend was compared with, as a possessive: "the oracle's", "torch's" (a
    backend's name takes no article: not "the torch's")."""
    return "the oracle's" if reference == "oracle" else f"{reference}'s"


def _nonfinite_mismatch(what: str, got: Any, ref: Any, reference: str) -> str:
    """A message when ``got`` is non-finite where ``ref`` is finite, else ``""``."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    wrong = ~np.isfinite(got) & np.isfinite(ref)
    if not wrong.any():
        return ""
    first = tuple(int(i) for i in np.argwhere(wrong)[0])
    return (f"{what} is non-finite ({float(got[first])!r}) where {reference_values(reference)} is finite "
            f"({int(wrong.sum())} of {got.size} values; first at {first})")


def _count_nonfinite(values: Any) -> int:
    return int(np.size(values) - np.count_nonzero(np.isfinite(np.asarray(values, dtype=np.float64))))


def packed_row_ids(time: int, row: int, rng: np.random.Generator) -> np.ndarray:
    """The segment ids ``[time]`` of one packed row: documents of very different lengths (one of
    about two thirds of the live tokens, id 0 on even rows, beside ones of 1 to 3 tokens), ids
    from 0 to 70000, a padding tail (ids -1 and -7, a quarter of the odd rows), and on rows 1, 4,
    7, ... the last document reusing the first one's id (a sequence need not be contiguous)."""
    pad = time // 4 if row % 2 else 0
    live = time - pad
    long = max(1, (2 * live) // 3)
    lengths = [long] if live else []
    while sum(lengths) < live:  # then documents of 1, 2, 3, 1, ... tokens (shifted by the row)
        lengths.append(min(1 + (row + len(lengths) - 1) % 3, live - sum(lengths)))
    order = rng.permutation(len(lengths))  # the long document anywhere in the row
    lengths = [lengths[i] for i in order]
    ids = rng.choice(np.array([1, 2, 3, 5, 9, 41, 70000]), size=len(lengths), replace=len(lengths) > 7)
    if row % 2 == 0 and len(ids):
        ids[int(np.argmax(order == 0))] = 0  # id 0 (the smallest document id) on the long document
    if row % 3 == 1 and len(ids) > 2:
        ids[-1] = ids[0]
    padding = rng.choice(np.array([-1, -7]), size=pad)
    return np.concatenate([np.repeat(ids, lengths), padding]).astype(np.int64)


def packed_segment_ids(lead_shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """int64 ``segment_ids`` of ``lead_shape`` (the last axis is time): :func:`packed_row_ids`
    per row of the leading shape."""
    rng = np.random.default_rng([seed, 15])
    time = lead_shape[-1]
    rows = int(np.prod(lead_shape[:-1], dtype=np.int64))
    return np.stack([packed_row_ids(time, row, rng) for row in range(rows)]).reshape(lead_shape) if rows else \
        np.zeros(lead_shape, np.int64)


def packed_inputs(kind: str, dtype: str, lead_shape: tuple[int, ...], vocab: int, seed: int = 0) -> Inputs:
    """The ``"random"`` case of ``lossspec.make_case`` with :func:`packed_segment_ids`; the second
    document of the first row is all masked (its ``n_s == 0``: it does not count in ``S``).
    Padding positions are unmasked in ``loss_mask``, so that only their ids exclude them, and hold
    out-of-range cross-entropy labels (never read)."""
    made = lossspec.make_case(kind, "random", lead_shape=lead_shape, vocab=vocab, dtype=dtype, seed=seed)
    ids = packed_segment_ids(lead_shape, seed)
    mask = np.asarray(made.loss_mask) | (ids < 0)
    first_row, first_mask = ids.reshape(-1, ids.shape[-1])[0], mask.reshape(-1, ids.shape[-1])[0]  # views
    documents = [seq for seq in dict.fromkeys(first_row.tolist()) if seq >= 0]
    if len(documents) > 1:
        first_mask[first_row == documents[1]] = False
    target = made.target
    if lossspec.KIND_SPECS[kind].has_labels:
        target = np.where(ids < 0, vocab, target)
    return Inputs(made.logits, target, mask, dtype, ids)


# The per-sequence cases of each kind (a subset: the token modes' full cross product is not
# repeated): (normalisation, dtypes, packed segment ids or one sequence per row, option variant).
SEQUENCE_CASES: tuple[tuple[str, tuple[str, ...], bool, bool], ...] = (
    ("sequence_mean", ("float32", "bfloat16", "float16"), True, False),
    ("sequence_sum", ("float32", "bfloat16"), True, True),
    ("sequence_mean", ("float32",), False, False),
)


def builtin_cases(
    kinds: Iterable[str], dtypes: Iterable[str], lead_shape: tuple[int, ...], vocab: int, seed: int = 0
) -> list[CaseSpec]:
    """kinds x dtypes x (every token normalisation on random inputs, option variants, each hard
    scenario of ``lossspec.SCENARIOS`` under one normalisation each), plus the per-sequence
    subset of :data:`SEQUENCE_CASES`: ``"packed"`` rows (:func:`packed_inputs`) and the random
    inputs with each row one sequence."""
    specs = []
    for kind in kinds:
        variant = VARIANTS.get(kind, DISTILL_VARIANT)
        for dtype in dtypes:

            def case(scenario: str) -> Inputs:
                made = lossspec.make_case(kind, scenario, lead_shape=lead_shape, vocab=vocab, dtype=dtype, seed=seed)
                return Inputs(made.logits, made.target, made.loss_mask, dtype)

            random = case("random")
            upstream = np.random.default_rng(seed).normal(size=lead_shape).astype(np.float32)
            specs += [
                CaseSpec(kind, "random", random, "valid_tokens"),
                CaseSpec(kind, "random", random, "tokens"),
                CaseSpec(kind, "random", random, "sum"),
                CaseSpec(kind, "random", random, "none", grad_output=upstream),
                CaseSpec(kind, "random", random, "valid_tokens", dict(variant)),
                CaseSpec(kind, "confident", case("confident"), "valid_tokens"),
                CaseSpec(kind, "huge", case("huge"), "sum", dict(variant)),
                CaseSpec(kind, "neg_inf", case("neg_inf"), "tokens"),
                CaseSpec(kind, "float_weights", case("float_weights"), "none"),
                CaseSpec(kind, "heavy_mask", case("heavy_mask"), "valid_tokens", denominator=7.0),
                CaseSpec(kind, "all_masked", case("all_masked"), "valid_tokens"),
                CaseSpec(kind, "no_mask", case("no_mask"), "valid_tokens"),
            ]
            for normalization, sequence_dtypes, packed, with_variant in SEQUENCE_CASES:
                if dtype in sequence_dtypes:
                    inputs = packed_inputs(kind, dtype, lead_shape, vocab, seed) if packed else random
                    options = dict(variant) if with_variant else {}
                    specs.append(CaseSpec(kind, "packed" if packed else "random", inputs, normalization, options))
    return specs


def _compare(spec: CaseSpec, backend: str, reference: str, got: tuple, ref: tuple, g0: float, seconds: float) -> Result:
    """Compare ``got = (loss, grad)`` with ``ref`` at the SPEC bounds; see the module docstring
    for the three statuses."""
    loss_cmp = lossspec.compare_loss(got[0], ref[0], "loss")
    grad_cmp = lossspec.compare_grad(got[1], ref[1], spec.inputs.dtype, g0, "grad")
    nonfinite = {"loss": _count_nonfinite(got[0]), "grad": _count_nonfinite(got[1])}
    if not (loss_cmp.ok and grad_cmp.ok):
        status = "fail"
        # A non-finite value where the reference is finite is named as such, not as "inf x bound".
        message = "; ".join(_nonfinite_mismatch(c.what, value, ref_value, reference) or c.message()
                            for c, value, ref_value in ((loss_cmp, got[0], ref[0]), (grad_cmp, got[1], ref[1])) if not c.ok)
    elif any(nonfinite.values()):
        status = "nonfinite"
        message = (f"non-finite where {reference_values(reference)} is too: loss {nonfinite['loss']} of {np.size(got[0])}, "
                   f"grad {nonfinite['grad']} of {np.size(got[1])} values (NaN or +inf in the inputs?); "
                   "the finite values are within the bounds")
    else:
        status, message = "pass", ""
    return Result(
        spec.name, spec.kind, spec.inputs.dtype, spec.normalization, backend, reference,
        loss_cmp.error_units, grad_cmp.error_units, status == "pass", seconds, message,
        status=status, loss=reported_loss(got[0]), reference_loss=reported_loss(ref[0]),
        segment_ids=spec.uses_segment_ids,
    )


def run_matrix(
    specs: list[CaseSpec],
    backends: list[str],
    *,
    on_result: Callable[[CaseSpec, list[Result], float], None] | None = None,
) -> list[Result]:
    """Run every case on every backend; compare each with the oracle and the cross-framework
    pairs with each other. A backend that raises is a failure with its error as the message.
    ``on_result(spec, row, oracle_loss)`` is called after each case."""
    results: list[Result] = []
    for spec in specs:
        g0 = spec.g0()
        outputs: dict[str, tuple] = {}
        row: list[Result] = []
        options = spec.call_options()
        reference = BACKENDS["oracle"].run(spec.kind, spec.inputs, options, spec.grad_output)
        for name in backends:
            if name == "oracle":
                continue
            start = time.perf_counter()
            try:
                outputs[name] = BACKENDS[name].run(spec.kind, spec.inputs, options, spec.grad_output)
            except Exception as error:  # a crash is a failure of that backend, reported, not fatal
                detail = traceback.format_exception_only(type(error), error)[-1].strip()
                row.append(Result(spec.name, spec.kind, spec.inputs.dtype, spec.normalization, name, "oracle",
                                  float("inf"), float("inf"), False, time.perf_counter() - start, detail,
                                  status="fail", loss=None, reference_loss=reported_loss(reference[0]),
                                  segment_ids=spec.uses_segment_ids))
                continue
            row.append(_compare(spec, name, "oracle", outputs[name], reference, g0, time.perf_counter() - start))
        for first, second in CROSS_PAIRS:
            if first in outputs and second in outputs:
                row.append(_compare(spec, first, second, outputs[first], outputs[second], g0, 0.0))
        results += row
        if on_result is not None:
            on_result(spec, row, reported_loss(reference[0]))
    return results
