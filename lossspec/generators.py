"""Seeded input generators shared by every test, benchmark and the parity command.

A :class:`Case` holds NumPy inputs whose logits are exactly representable in the case's dtype
(rounded once here), so every framework sees the same numbers after its cast, and knows its
float64 reference (:meth:`Case.reference`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .causal import scored_positions, shift_targets
from .config import ALL_KINDS, KINDS
from .oracle import oracle, token_weights
from .config import make_config
from .kinds import KIND_SPECS
from .sequences import scored_segment_ids, sequence_coefficients
from .tolerances import g0_for, gradient_floor, round_to_dtype

SCENARIOS: tuple[str, ...] = (
    "random",  # moderate logits, ~30% masked, some ignore_index labels
    "confident",  # the label (or the teacher's argmax) has q_y > 0.999
    "huge",  # |logits| up to 1e4
    "neg_inf",  # -inf columns (padded vocabulary), finite where the target has mass
    "heavy_mask",  # ~90% masked
    "all_masked",  # nothing valid: D == 0
    "float_weights",  # float loss_mask weights in [0, 2), some zero
    "no_mask",  # loss_mask=None
    "empty",  # no tokens at all
)
IGNORE_INDEX = -100


@dataclasses.dataclass
class Reference:
    """The oracle's answer for one call, with the ``G0`` of its gradient bound."""

    loss: Any
    grad: np.ndarray
    g0: float
    dtype: str


@dataclasses.dataclass
class Case:
    """One generated input: ``logits`` ``[..., V]`` (float32 holding values of ``dtype``),
    ``target`` (int64 labels ``[...]``, teacher logits ``[..., V]``, or ``None`` for ``entropy``)
    and ``loss_mask``."""

    kind: str
    scenario: str
    dtype: str
    logits: np.ndarray
    target: np.ndarray | None
    loss_mask: np.ndarray | None

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.scenario}/{self.dtype}/{'x'.join(map(str, self.logits.shape))}"

    def reference(self, **options: Any) -> Reference:
        """``oracle(kind, logits, target, loss_mask, **options)`` plus its ``G0``."""
        loss, grad = oracle(self.kind, self.logits, self.target, self.loss_mask, **options)
        return Reference(loss, grad, self.g0(**options), self.dtype)

    def g0(self, **options: Any) -> float:
        normalization = options.get("normalization", "valid_tokens")
        cfg_options = {k: v for k, v in options.items() if k not in ("normalization", "denominator", "grad_output", "segment_ids")}
        config = make_config(self.kind, normalization=normalization, **cfg_options)
        lead = self.logits.shape[:-1]
        labels, mask = (self.target if KIND_SPECS[self.kind].has_labels else None), self.loss_mask
        ids = options.get("segment_ids")
        if ids is not None or config.per_sequence:
            ids = scored_segment_ids(ids, lead, config.causal_shift)
        if config.causal_shift:
            labels, mask = shift_targets(labels, mask, lead)
        valid, weight = token_weights(config, labels, mask, lead, ids)
        if config.per_sequence:
            # G0 = max coef * c (lossspec.sequences: coef = w / (n_s S) or w / S).
            coef = sequence_coefficients(weight, ids, normalization, options.get("denominator"))
            upstream = options.get("grad_output")
            upstream = 1.0 if upstream is None else float(np.max(np.abs(np.asarray(upstream, np.float64))))
            peak = float(coef.max()) if coef.size else 0.0
            return gradient_floor(peak, 1.0, config.logit_scale, config.temperature) * upstream
        if options.get("denominator") is not None:
            denominator = float(options["denominator"])
        elif normalization == "valid_tokens":
            denominator = float(weight.sum())
        elif normalization == "tokens":
            denominator = float(scored_positions(lead, config.causal_shift))
        else:
            denominator = 1.0
        return g0_for(
            mask, valid, denominator, config.logit_scale, config.temperature, normalization, options.get("grad_output")
        )


def _mask(rng: np.random.Generator, lead: tuple[int, ...], scenario: str) -> np.ndarray | None:
    if scenario == "no_mask":
        return None
    if scenario == "all_masked":
        return np.zeros(lead, dtype=bool)
    if scenario == "float_weights":
        weights = rng.uniform(0.0, 2.0, size=lead).astype(np.float32)
        return np.where(rng.random(lead) < 0.2, 0.0, weights).astype(np.float32)
    keep = 0.1 if scenario == "heavy_mask" else 0.7
    mask = rng.random(lead) < keep
    if mask.size and scenario == "heavy_mask":
        mask.flat[rng.integers(mask.size)] = True  # keep at least one valid token
    return mask


def make_case(
    kind: str,
    scenario: str = "random",
    *,
    lead_shape: tuple[int, ...] = (16,),
    vocab: int = 100,
    dtype: str = "float32",
    seed: int = 0,
) -> Case:
    """Generate one seeded :class:`Case` (see :data:`SCENARIOS`).

    Labels of masked tokens hold arbitrary values, out-of-range ones included, because they
    must never be read as indices; valid labels lie in ``[0, vocab)`` and avoid ``-inf`` columns.
    """
    if kind not in ALL_KINDS:
        raise ValueError(f"kind must be one of {ALL_KINDS}; got {kind!r}")
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}; got {scenario!r}")
    rng = np.random.default_rng([seed, ALL_KINDS.index(kind), SCENARIOS.index(scenario), vocab])
    lead = (0,) + tuple(lead_shape[1:]) if scenario == "empty" else tuple(lead_shape)
    shape = lead + (vocab,)
    if scenario == "huge":
        logits = rng.uniform(-1e4, 1e4, size=shape)
        teacher = rng.uniform(-1e4, 1e4, size=shape)
    else:
        logits = rng.normal(0.0, 2.0, size=shape)
        teacher = rng.normal(0.0, 2.0, size=shape)
    labels = rng.integers(0, vocab, size=lead)
    banned = np.zeros(vocab, dtype=bool)
    if scenario == "neg_inf" and vocab > 1:
        banned[rng.permutation(vocab)[: max(1, vocab // 8)]] = True
        allowed = np.flatnonzero(~banned)
        labels = allowed[rng.integers(0, allowed.size, size=lead)]
        logits[..., banned] = -np.inf
        teacher[..., banned] = -np.inf
    if scenario == "confident":
        margin = np.log(vocab) + 9.0  # q_y > 0.999 (softmax mass of the rest < 1e-3)
        np.put_along_axis(logits, labels[..., None], margin + 4.0, axis=-1)
        np.put_along_axis(teacher, labels[..., None], margin + 4.0, axis=-1)
    mask = _mask(rng, lead, scenario)
    if KIND_SPECS[kind].has_labels:
        labels = labels.astype(np.int64)
        if labels.size and scenario in ("random", "no_mask", "heavy_mask", "float_weights"):
            labels = np.where(rng.random(lead) < 0.1, IGNORE_INDEX, labels)
        if mask is not None and labels.size:
            # Garbage labels at masked positions, out-of-range ones included.
            garbage = rng.choice(np.array([-1, vocab, 10**6, IGNORE_INDEX, 0]), size=lead)
            labels = np.where(mask != 0, labels, garbage)
        target = labels
    elif KIND_SPECS[kind].target is None:
        target = None  # no target
    else:
        target = round_to_dtype(teacher, dtype)
    return Case(kind, scenario, dtype, round_to_dtype(logits, dtype), target, mask)


def all_cases(
    kinds: tuple[str, ...] = KINDS,
    scenarios: tuple[str, ...] = SCENARIOS,
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16"),
    *,
    lead_shape: tuple[int, ...] = (16,),
    vocab: int = 100,
    seed: int = 0,
) -> list[Case]:
    """Every combination of kind, scenario and dtype (fp16 skips ``huge`` beyond its range)."""
    return [
        make_case(kind, scenario, lead_shape=lead_shape, vocab=vocab, dtype=dtype, seed=seed)
        for kind in kinds
        for scenario in scenarios
        for dtype in dtypes
    ]
