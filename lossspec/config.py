"""Loss configuration and the scalar-option checks of SPEC section 5.

Every framework builds a :class:`LossConfig` from its keyword arguments, so an
invalid option raises the same error, with the same message, in the oracle, in
``jaxloss`` and in ``torchloss``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .causal import check_causal_shift
from .kinds import KIND_SPECS
from .sequences import SEQUENCE_NORMALIZATIONS

# Every kind of the kind table (lossspec.kinds.KIND_SPECS): everything check_kind accepts.
ALL_KINDS: tuple[str, ...] = tuple(KIND_SPECS)
# The kinds with a fused LM head ``linear_<kind>`` (the table's ``head`` trait; the head's tests
# take their kinds from here).
HEAD_KINDS: tuple[str, ...] = tuple(kind for kind, spec in KIND_SPECS.items() if spec.head)
# The kinds of the shared test matrices of the unfused losses (every backend, every test file
# parametrised over ``lossspec.KINDS``). entropy and jensen_shannon (ENTROPY_JSD_KINDS) have their
# own test files until the shared matrices take them in.
ENTROPY_JSD_KINDS: tuple[str, ...] = ("entropy", "jensen_shannon")
KINDS: tuple[str, ...] = tuple(kind for kind in ALL_KINDS if kind not in ENTROPY_JSD_KINDS)
# Kinds with teacher logits (the target argument ``teacher_logits [..., V]``).
DISTILL_KINDS: tuple[str, ...] = tuple(kind for kind, spec in KIND_SPECS.items() if spec.has_teacher)
# Kinds without a target argument: ``fn(logits, loss_mask=None, ...)``.
TARGETLESS_KINDS: tuple[str, ...] = tuple(kind for kind, spec in KIND_SPECS.items() if spec.target is None)
# The token-level normalisations (SPEC section 2); the per-sequence ones are in lossspec.sequences.
NORMALIZATIONS: tuple[str, ...] = ("valid_tokens", "tokens", "sum", "none")
# Every value `normalization=` accepts.
ALL_NORMALIZATIONS: tuple[str, ...] = NORMALIZATIONS + SEQUENCE_NORMALIZATIONS
# Normalisations whose denominator is a count that adds up over micro-batches and replicas
# (a number of tokens, a weight sum, or S, the number of sequences).
COUNTED_NORMALIZATIONS: tuple[str, ...] = ("valid_tokens", "tokens") + SEQUENCE_NORMALIZATIONS
JAX_IMPLS: tuple[str, ...] = ("auto", "xla", "pallas")
TORCH_IMPLS: tuple[str, ...] = ("auto", "torch", "triton")

# Keyword options each kind accepts (besides loss_mask, normalization, denominator): the table's.
KIND_OPTIONS: dict[str, tuple[str, ...]] = {kind: spec.option_names for kind, spec in KIND_SPECS.items()}


# The float32 range every float option must stay in (the backends compute in fp32): the smallest
# normal number 2**-126 (below it, subnormals are flushed to zero on some devices) and the largest
# finite one. Equal to lossspec.checks.FP32_TINY / FP32_MAX (np.finfo(np.float32)).
FP32_TINY: float = 2.0**-126
FP32_MAX: float = float.fromhex("0x1.fffffep+127")
_FP32_RANGE = f"[{FP32_TINY:.8g}, {FP32_MAX:.8g}]"


def _finite_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not _is_numpy_scalar(value):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond the float range (10**400): name the option, not float()
        raise ValueError(f"{name} must be finite, got an integer of {int(value).bit_length()} bits (beyond the float range)") from None
    # ``value - value == 0`` is False for inf and NaN: math.isfinite's test in arithmetic, which
    # torch.compile can trace on a symbolic float (a changing option under Dynamo).
    if not value - value == 0:
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_fp32_normal(name: str, value: float, zero_allowed: bool) -> float:
    """``value`` (finite, in its option's range already) must be a normal float32 number, or 0
    where ``zero_allowed``: the backends use every option in fp32, where a larger magnitude is
    ``inf`` and a smaller one is subnormal (flushed to 0 on some devices), so the loss or the
    gradient would be NaN or 0 instead of the option's value. Else a ``ValueError`` naming
    ``name``."""
    if (value != 0.0 or not zero_allowed) and not FP32_TINY <= abs(value) <= FP32_MAX:
        # ``{value}`` without a format spec: torch.compile traces this on a symbolic float
        raise ValueError(f"{name} must be {'0 or ' if zero_allowed else ''}a normal float32 number, magnitude in {_FP32_RANGE} (it is used in float32); got {value}")
    return value


def check_softcap(name: str, value: Any) -> Optional[float]:
    """A soft cap (``logit_softcap``, ``teacher_logit_softcap``): ``None`` (off) or a finite
    number ``> 0`` that is a normal float32 number (:func:`check_fp32_normal`), as a Python
    ``float``."""
    if value is None:
        return None
    cap = _finite_number(name, value)
    if cap <= 0.0:
        raise ValueError(f"{name} must be None or > 0, got {cap}")
    return check_fp32_normal(name, cap, zero_allowed=False)


def _is_numpy_scalar(value: Any) -> bool:
    import numpy as np

    return isinstance(value, np.generic) and np.issubdtype(type(value), np.number)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_ignore_index(ignore_index: Any) -> int:
    """``ignore_index`` as a Python ``int``.

    Accepted: a Python ``int`` or a NumPy integer scalar (not ``bool``, not a float, even an
    integral one), in the int64 range ``[-2**63, 2**63 - 1]``. Otherwise a ``TypeError``
    (wrong type) or ``ValueError`` (out of range) that names ``ignore_index``.

    Labels are compared with it exactly (no wrapping): a label equals ``ignore_index`` only
    when the labels' dtype can represent it and the values are equal, so with ``uint32``
    labels the default ``-100`` masks nothing, and with ``int32`` labels ``2**40`` masks
    nothing.
    """
    import numpy as np

    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    value = int(ignore_index)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"ignore_index must be an integer in the int64 range [-2**63, 2**63 - 1]; got {value}")
    return value


def check_kind(kind: str) -> str:
    if kind not in ALL_KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, ALL_KINDS))}; got {kind!r}")
    return kind


def check_normalization(normalization: str) -> str:
    if normalization not in ALL_NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {', '.join(map(repr, ALL_NORMALIZATIONS))}; got {normalization!r}"
        )
    return normalization


def check_impl(impl: str, allowed: tuple[str, ...]) -> str:
    if impl not in allowed:
        raise ValueError(f"impl must be one of {', '.join(map(repr, allowed))}; got {impl!r}")
    return impl


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The scalar options of one loss call, validated on construction.

    ``temperature`` applies to every kind but ``cross_entropy``, ``teacher_logit_scale`` to the
    distillation kinds; ``ignore_index``, ``label_smoothing`` and ``z_loss`` only to
    ``cross_entropy``; ``beta`` (in ``[0, 1]``) only to ``jensen_shannon``; ``causal_shift`` to
    every kind (:mod:`lossspec.causal`). ``logit_softcap`` (every kind) and
    ``teacher_logit_softcap`` (the kinds with a teacher) are ``None`` (off) or a cap ``> 0``:
    ``x -> cap * tanh(x / cap)`` on the raw logits, before the scales and the temperature.
    Every float option, and ``logit_scale / temperature`` and ``teacher_logit_scale /
    temperature``, must be a normal float32 number (0 allowed where the option's range holds 0:
    ``label_smoothing``, ``z_loss``, ``beta``), else a ``ValueError`` naming it
    (:func:`check_fp32_normal`). The effective student scale is ``student_scale = logit_scale / temperature`` and the
    teacher's ``teacher_scale = teacher_logit_scale / temperature``.
    """

    kind: str
    normalization: str = "valid_tokens"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    logit_scale: float = 1.0
    teacher_logit_scale: float = 1.0
    temperature: float = 1.0
    causal_shift: bool = False
    beta: float = 0.5
    logit_softcap: Optional[float] = None
    teacher_logit_softcap: Optional[float] = None

    def __post_init__(self) -> None:
        check_kind(self.kind)
        check_normalization(self.normalization)
        object.__setattr__(self, "causal_shift", check_causal_shift(self.causal_shift))
        object.__setattr__(self, "ignore_index", check_ignore_index(self.ignore_index))
        eps = _finite_number("label_smoothing", self.label_smoothing)
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {eps}")
        lam = _finite_number("z_loss", self.z_loss)
        if lam < 0.0:
            raise ValueError(f"z_loss must be >= 0, got {lam}")
        temperature = _finite_number("temperature", self.temperature)
        if temperature <= 0.0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        scale = _finite_number("logit_scale", self.logit_scale)
        if scale <= 0.0:
            raise ValueError(f"logit_scale must be > 0, got {scale}")
        teacher_scale = _finite_number("teacher_logit_scale", self.teacher_logit_scale)
        if teacher_scale <= 0.0:
            raise ValueError(f"teacher_logit_scale must be > 0, got {teacher_scale}")
        if self.kind == "cross_entropy" and temperature != 1.0:
            raise ValueError("temperature applies to the distillation losses only; cross_entropy uses T = 1")
        if self.kind != "cross_entropy" and (eps != 0.0 or lam != 0.0):
            raise ValueError("label_smoothing and z_loss apply to cross_entropy only")
        beta = _finite_number("beta", self.beta)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if self.kind != "jensen_shannon" and beta != 0.5:
            raise ValueError("beta applies to jensen_shannon only")
        softcap = check_softcap("logit_softcap", self.logit_softcap)
        teacher_softcap = check_softcap("teacher_logit_softcap", self.teacher_logit_softcap)
        if teacher_softcap is not None and self.kind not in DISTILL_KINDS:
            raise ValueError(f"teacher_logit_softcap applies to the kinds with a teacher only, not {self.kind}")
        for name, value, zero_allowed in (
            ("label_smoothing", eps, True),
            ("z_loss", lam, True),
            ("temperature", temperature, False),
            ("logit_scale", scale, False),
            ("teacher_logit_scale", teacher_scale, False),
            ("beta", beta, True),
            # the factors the backends multiply by, formed in float64 and used in fp32
            ("logit_scale / temperature", scale / temperature, False),
            ("teacher_logit_scale / temperature", teacher_scale / temperature, False),
        ):
            check_fp32_normal(name, value, zero_allowed)
        for name, value in (
            ("logit_softcap", softcap),
            ("teacher_logit_softcap", teacher_softcap),
            ("label_smoothing", eps),
            ("z_loss", lam),
            ("temperature", temperature),
            ("logit_scale", scale),
            ("teacher_logit_scale", teacher_scale),
            ("beta", beta),
        ):
            object.__setattr__(self, name, value)

    @property
    def student_scale(self) -> float:
        """``logit_scale / temperature``: the factor from logits ``x`` to ``z``."""
        return self.logit_scale / self.temperature

    @property
    def teacher_scale(self) -> float:
        """``teacher_logit_scale / temperature``: the factor from teacher logits to theirs ``z``."""
        return self.teacher_logit_scale / self.temperature

    @property
    def is_distill(self) -> bool:
        return self.kind in DISTILL_KINDS

    @property
    def has_target(self) -> bool:
        """Whether the kind takes a target (labels or teacher logits); ``entropy`` does not."""
        return self.kind not in TARGETLESS_KINDS

    @property
    def has_labels(self) -> bool:
        """Whether the target is integer labels (the kind table's ``target == "labels"``)."""
        return KIND_SPECS[self.kind].has_labels

    @property
    def mixture_pass(self) -> bool:
        """Whether this kind reads each row a second time for its mixture sums (the kind table's
        trait; :meth:`kernel_config` turns the end points of ``jensen_shannon`` into KL kinds,
        which have none)."""
        return KIND_SPECS[self.kind].mixture_pass

    @property
    def formula(self) -> str:
        """The kind whose formulas compute this call: ``jensen_shannon`` at ``beta = 0`` is
        exactly ``forward_kl`` and at ``beta = 1`` exactly ``reverse_kl`` (TRL's GKD and
        Liger-Kernel define those end points so; the mixture's ``log(0)`` never appears),
        every other call its own kind."""
        if self.kind == "jensen_shannon" and self.beta in (0.0, 1.0):
            return "forward_kl" if self.beta == 0.0 else "reverse_kl"
        return self.kind

    def kernel_config(self) -> "LossConfig":
        """This config with ``kind = formula`` (and the default ``beta`` where the kind
        changed): what the backends compute. The same scales, normalisation and shift."""
        if self.formula == self.kind:
            return self
        return dataclasses.replace(self, kind=self.formula, beta=0.5)

    def counting_config(self) -> "LossConfig":
        """The fields the per-token coefficients depend on (normalisation, ``ignore_index``,
        ``causal_shift``, and whether the target is labels), every option at its default and the
        kind the first of the kind table with this config's target form. Two losses that weigh
        their tokens alike have the same counting config: a framework that compiles the
        coefficients per config (jaxloss's ``prepare``) compiles them once for both (e.g. the
        teacher kinds, or a new temperature)."""
        kind = next(name for name, spec in KIND_SPECS.items() if spec.has_labels == self.has_labels)
        return LossConfig(kind=kind, normalization=self.normalization, ignore_index=self.ignore_index, causal_shift=self.causal_shift)

    @property
    def counted(self) -> bool:
        """Whether the denominator is a count (``valid_tokens``/``tokens``, or ``S`` of the sequence modes)."""
        return self.normalization in COUNTED_NORMALIZATIONS

    @property
    def per_sequence(self) -> bool:
        """Whether the normalisation is per sequence (``sequence_mean``/``sequence_sum``, lossspec.sequences)."""
        return self.normalization in SEQUENCE_NORMALIZATIONS


def make_config(kind: str, **options: Any) -> LossConfig:
    """Build a :class:`LossConfig` from a function's keyword options, rejecting the ones
    that do not belong to ``kind`` with a ``TypeError`` that names them."""
    check_kind(kind)
    allowed = KIND_OPTIONS[kind]
    unknown = sorted(set(options) - set(allowed) - {"normalization"})
    if unknown:
        raise TypeError(f"{kind} got unexpected option(s) {', '.join(unknown)}; it accepts {', '.join(allowed)}")
    return LossConfig(kind=kind, **options)
