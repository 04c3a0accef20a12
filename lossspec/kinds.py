"""The per-kind table: each loss's public name, target, options and defaults, math and traits.

The public functions of ``jaxloss.api`` and ``torchloss.api`` and their module classes
(``jaxloss.nnx``, ``torchloss.nn``) are written out in each framework; their signatures are the
ones this table implies (:func:`parameters`: the same names, arguments in the same order and
defaults in both frameworks, each framework adding only its own arguments after ``segment_ids``),
which ``parity_tests/test_api_signatures.py`` checks.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional


_P = inspect.Parameter


@dataclasses.dataclass(frozen=True)
class KindSpec:
    """One loss kind: its public function name (= the kind), target argument, options with
    defaults, the math of its docstring, and the traits the code reads instead of the kind's
    name (only this table, the statistics / oracle math, the block math and the kernels name
    individual kinds).

    Traits: ``target`` (``"labels"``, ``"teacher_logits"`` or ``None``: the call signature,
    input checks and shifts), ``mixture_pass`` (a second pass over each row for the mixture
    sums, after the row's statistics: lossspec.stats), ``head`` (a fused LM head
    ``linear_<kind>`` exists)."""

    kind: str
    module: str  # the module class name (jaxloss.nnx, torchloss.nn)
    target: Optional[str]  # "labels", "teacher_logits", or None (entropy: no target argument)
    title: str
    loss: str  # per-token loss formula
    grad: str  # gradient w.r.t. z
    options: tuple[tuple[str, Any], ...]  # keyword options (name, default) before normalization
    short: str  # a short label for tables and plots (benchmarks, lossparity)
    mixture_pass: bool = False
    head: bool = True

    @property
    def has_labels(self) -> bool:
        """Whether the target is integer labels ``[...]`` (gathered at the label, ``ignore_index``)."""
        return self.target == "labels"

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.options)

    @property
    def has_teacher(self) -> bool:
        """Whether the kind takes teacher logits ``[..., V]`` as its target."""
        return self.target == "teacher_logits"


# Every kind ends with causal_shift (lossspec.causal), after its own options.
_SHIFT_OPTION = (("causal_shift", False),)
# The soft caps come after the scales: x -> cap * tanh(x / cap) on the raw logits (None: off).
_CE_OPTIONS = (("ignore_index", -100), ("label_smoothing", 0.0), ("z_loss", 0.0), ("logit_scale", 1.0), ("logit_softcap", None)) + _SHIFT_OPTION
_DISTILL_OPTIONS = (
    ("temperature", 1.0),
    ("logit_scale", 1.0),
    ("teacher_logit_scale", 1.0),
    ("logit_softcap", None),
    ("teacher_logit_softcap", None),
) + _SHIFT_OPTION
_ENTROPY_OPTIONS = (("temperature", 1.0), ("logit_scale", 1.0), ("logit_softcap", None)) + _SHIFT_OPTION
_JSD_OPTIONS = (("beta", 0.5),) + _DISTILL_OPTIONS

KIND_SPECS: dict[str, KindSpec] = {
    "cross_entropy": KindSpec(
        "cross_entropy",
        "CrossEntropyLoss",
        "labels",
        "Masked cross-entropy with integer labels, label smoothing and z-loss.",
        "l = lse - (1 - eps) z_y - (eps / V) sum_v z_v + lam lse^2",
        "dl/dz = (1 + 2 lam lse) q - (1 - eps) onehot(y) - eps / V",
        _CE_OPTIONS,
        "CE",
    ),
    "soft_cross_entropy": KindSpec(
        "soft_cross_entropy",
        "SoftCrossEntropyLoss",
        "teacher_logits",
        "Masked cross-entropy against the teacher's distribution p.",
        "l = lse - sum_v p_v z_v",
        "dl/dz = q - p",
        _DISTILL_OPTIONS,
        "softCE",
    ),
    "forward_kl": KindSpec(
        "forward_kl",
        "ForwardKLLoss",
        "teacher_logits",
        "Masked forward KL, KL(p || q), of the student q from the teacher p (mean seeking).",
        "l = sum_v p_v (log p_v - log q_v)",
        "dl/dz = q - p",
        _DISTILL_OPTIONS,
        "fKL",
    ),
    "reverse_kl": KindSpec(
        "reverse_kl",
        "ReverseKLLoss",
        "teacher_logits",
        "Masked reverse KL, KL(q || p), of the student q from the teacher p (mode seeking).",
        "l = sum_v q_v (log q_v - log p_v)",
        "dl/dz = q (log q - log p - l)   (0 where q == 0)",
        _DISTILL_OPTIONS,
        "rKL",
    ),
    "entropy": KindSpec(
        "entropy",
        "EntropyLoss",
        None,
        "Masked entropy of the student's distribution q (the entropy regulariser of policy-gradient trainers).",
        "l = -sum_v q_v log q_v",
        "dl/dz = -q (log q + l)   (0 where q == 0)",
        _ENTROPY_OPTIONS,
        "H",
    ),
    "jensen_shannon": KindSpec(
        "jensen_shannon",
        "JensenShannonLoss",
        "teacher_logits",
        "Masked generalised Jensen-Shannon divergence of the student q and the teacher p (on-policy distillation).",
        "l = beta KL(p || M) + (1 - beta) KL(q || M),  M = beta p + (1 - beta) q;\n"
        "    beta = 0: KL(p || q) (forward KL), beta = 1: KL(q || p) (reverse KL), computed as those kinds",
        "dl/dz = (1 - beta) q (log q - log M - KL(q || M))   (0 where q == 0; the KL kinds' at beta = 0, 1)",
        _JSD_OPTIONS,
        "JSD",
        mixture_pass=True,
    ),
}

def parameters(spec: KindSpec, extra: tuple[tuple[str, Any], ...] = ()) -> list[inspect.Parameter]:
    """The public signature :data:`KIND_SPECS` implies for ``spec``'s function (what the written-out
    functions of ``jaxloss.api`` and ``torchloss.api`` are checked against, annotations aside):
    positional ``logits, <target>, loss_mask``, then keyword-only options, ``normalization``,
    ``denominator``, ``segment_ids`` and the framework's own ``extra`` arguments ``(name, default)``."""
    params = [_P("logits", _P.POSITIONAL_OR_KEYWORD)]
    if spec.target is not None:
        params.append(_P(spec.target, _P.POSITIONAL_OR_KEYWORD))
    params.append(_P("loss_mask", _P.POSITIONAL_OR_KEYWORD, default=None))
    params += [_P(name, _P.KEYWORD_ONLY, default=default) for name, default in spec.options]
    params += [_P("normalization", _P.KEYWORD_ONLY, default="valid_tokens"), _P("denominator", _P.KEYWORD_ONLY, default=None)]
    params += [_P("segment_ids", _P.KEYWORD_ONLY, default=None)]
    params += [_P(name, _P.KEYWORD_ONLY, default=default) for name, default in extra]
    return params


def module_settings(spec: KindSpec, settings: dict[str, Any], unexpected: dict[str, Any], owner: str, head: bool = False) -> dict[str, Any]:
    """A module's ``settings`` (its constructor's keyword arguments, in order), validated with the
    functions' own errors; ``unexpected`` (the constructor's other keywords) is a ``TypeError``
    naming ``owner``, the keyword to write instead (:func:`lossspec.foreign_keyword_hint`) and the
    accepted names. ``tuning`` is a :class:`lossspec.Tuning` for a loss, a
    :class:`lossspec.HeadTuning` for a fused head (``head``)."""
    if unexpected:
        from .checks import foreign_keyword_hint  # checks and config import this table: imported here

        hint = foreign_keyword_hint(unexpected, unexpected)
        raise TypeError(f"{owner} got unexpected option(s) {', '.join(sorted(unexpected))}; " + (f"{hint}; " if hint else "")
                        + f"it accepts {', '.join(settings)}")
    from .config import make_config  # config builds its kind lists from this table

    make_config(spec.kind, normalization=settings["normalization"], **{name: settings[name] for name in spec.option_names})
    if "tuning" in settings and head:
        from .linear import check_head_tuning  # linear imports this table: imported here

        check_head_tuning(settings["tuning"])
    elif "tuning" in settings:
        from .tuning import check_tuning

        check_tuning(settings["tuning"])
    if "inplace" in settings:
        from .checks import check_inplace

        check_inplace(settings["inplace"])
    return dict(settings)
