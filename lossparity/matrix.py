"""The parity matrix: cases x backends, each compared with the oracle and with its twin in the
other framework at the bounds of SPEC section 6 (errors in units of the bound; <= 1 passes)."""

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
    def name(self) -> str:
        shape = "x".join(map(str, self.inputs.logits.shape))
        extra = ",".join(f"{k}={v}" for k, v in self.options.items())
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
        return case.g0(**self.call_options(), grad_output=self.grad_output)


@dataclasses.dataclass
class Result:
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


def builtin_cases(
    kinds: Iterable[str], dtypes: Iterable[str], lead_shape: tuple[int, ...], vocab: int, seed: int = 0
) -> list[CaseSpec]:
    """kinds x dtypes x (every normalisation on random inputs, option variants, and each hard
    scenario of ``lossspec.SCENARIOS`` under one normalisation each)."""
    specs = []
    for kind in kinds:
        variant = CE_VARIANT if kind == "cross_entropy" else DISTILL_VARIANT
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
    return specs


def _compare(spec: CaseSpec, backend: str, reference: str, got: tuple, ref: tuple, g0: float, seconds: float) -> Result:
    loss_cmp = lossspec.compare_loss(got[0], ref[0], "loss")
    grad_cmp = lossspec.compare_grad(got[1], ref[1], spec.inputs.dtype, g0, "grad")
    ok = loss_cmp.ok and grad_cmp.ok
    message = "" if ok else "; ".join(c.message() for c in (loss_cmp, grad_cmp) if not c.ok)
    return Result(
        spec.name, spec.kind, spec.inputs.dtype, spec.normalization, backend, reference,
        loss_cmp.error_units, grad_cmp.error_units, ok, seconds, message,
    )


def run_matrix(
    specs: list[CaseSpec],
    backends: list[str],
    *,
    on_result: Callable[[CaseSpec, list[Result]], None] | None = None,
) -> list[Result]:
    """Run every case on every backend; compare each with the oracle and the cross-framework
    pairs with each other. A backend that raises is a failure with its error as the message."""
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
                                  float("inf"), float("inf"), False, time.perf_counter() - start, detail))
                continue
            row.append(_compare(spec, name, "oracle", outputs[name], reference, g0, time.perf_counter() - start))
        for first, second in CROSS_PAIRS:
            if first in outputs and second in outputs:
                row.append(_compare(spec, first, second, outputs[first], outputs[second], g0, 0.0))
        results += row
        if on_result is not None:
            on_result(spec, row)
    return results
