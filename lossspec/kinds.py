"""The per-kind table: each loss's public signature and docstring, written once.

``jaxloss`` and ``torchloss`` build their four public functions, and their module wrappers
(``jaxloss.nnx``, ``torchloss.nn``), from :data:`KIND_SPECS`: the same names, the same
arguments in the same order, the same defaults and the same text in both frameworks. Each
framework adds only its own arguments (:class:`FrameworkArgs`: ``vocab_parallel`` and
``impl``, plus torch's ``inplace``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional


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
        head=False,
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
        head=False,
    ),
}

_NOTATION = {
    "labels": (
        "Per token, with ``z = logit_scale * x``, ``lse = log sum_v exp(z_v)``, ``q = softmax(z)``,\n"
        "``eps = label_smoothing``, ``lam = z_loss``::"
    ),
    "teacher_logits": (
        "Per token, with ``z = logit_scale * x / T``, ``q = softmax(z)`` (student),\n"
        "``p = softmax(teacher_logit_scale * t / T)`` (teacher, no gradient), ``T = temperature``,\n"
        "``lse = log sum_v exp(z_v)`` (no ``T**2`` factor: multiply the loss by ``T**2`` for\n"
        "Hinton's scaling)::"
    ),
    None: (
        "Per token, with ``z = logit_scale * x / T``, ``q = softmax(z)`` (the student's distribution),\n"
        "``T = temperature``::"
    ),
}

ARG_DOCS: dict[str, str] = {
    "logits": "``[..., V]`` floating point (computed in fp32; fp64 in fp64 where the framework can).",
    "labels": "``[...]`` integers; labels of masked tokens are never read as indices (any value is legal there).",
    "teacher_logits": "``[..., V]`` floating point, the shape of ``logits``; gets no gradient.",
    "loss_mask": (
        "``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal "
        "float32 numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the "
        "labels: no gradient flows to it."
    ),
    "ignore_index": (
        "label value of ignored tokens: an ``int`` in the int64 range, compared exactly (a label equals it "
        "only if the labels' dtype can hold it)."
    ),
    "label_smoothing": "``eps`` in ``[0, 1]``.",
    "z_loss": "``lam >= 0``.",
    "logit_scale": "``> 0``, multiplies the student's logits (before the temperature).",
    "temperature": "``T > 0``, divides student and teacher alike.",
    "teacher_logit_scale": "``> 0``, multiplies the teacher's logits.",
    "logit_softcap": (
        "``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)`` "
        "before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken "
        "through the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss)."
    ),
    "teacher_logit_softcap": (
        "``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits, before "
        "``teacher_logit_scale`` and the temperature."
    ),
    "beta": (
        "``beta`` in ``[0, 1]``, the teacher's share of the mixture ``M = beta p + (1 - beta) q`` (TRL's GKD and "
        "Liger-Kernel's JSD): 0.5 the symmetric JSD, 0 forward KL ``KL(p || q)``, 1 reverse KL ``KL(q || p)``."
    ),
    "causal_shift": (
        "``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input token "
        "(e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored "
        "against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is "
        "ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token "
        "``t + 1``). ``\"tokens\"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. "
        "Needs ``logits [..., T, V]``."
    ),
    "normalization": (
        '``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` '
        "of ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, "
        '``"sequence_mean"`` ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` '
        "``(1/S) sum_s sum_{i in s} w_i l_i``, with ``n_s`` the sequence's weight sum and ``S`` the number of "
        "sequences with ``n_s > 0`` (each row of the leading shape, or ``segment_ids``; lossspec.sequences)."
    ),
    "segment_ids": (
        "``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0`` form "
        "one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per "
        "input token like the labels: with ``causal_shift`` position ``t`` is scored only if ``segment_ids[..., t] "
        "== segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that sequence. Data: no "
        "gradient."
    ),
    "denominator": (
        "the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced "
        'modes (``S`` of the sequence modes); ``None`` counts this call\'s own tokens (``D = 1`` for ``"sum"``). '
        "Pass the sum of ``count_denominator`` over every micro-batch and replica. Not accepted with "
        '``"none"``. 0 or a normal float32 number; data (no gradient flows to it).'
    ),
}

RETURNS_DOC = (
    "The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the\n"
    'per-token ``w_i l_i`` with ``labels``\' leading shape for ``normalization="none"`` (0 at masked tokens).'
)


@dataclasses.dataclass(frozen=True)
class FrameworkArgs:
    """The arguments a framework adds after ``denominator`` (name, default, doc)."""

    args: tuple[tuple[str, Any, str], ...]


def parameters(spec: KindSpec, extra: FrameworkArgs) -> list[inspect.Parameter]:
    """The public signature of ``spec``'s function: positional ``logits, <target>, loss_mask``,
    then keyword-only options, ``normalization``, ``denominator``, ``segment_ids`` and the framework's own."""
    params = [_P("logits", _P.POSITIONAL_OR_KEYWORD)]
    if spec.target is not None:
        params.append(_P(spec.target, _P.POSITIONAL_OR_KEYWORD))
    params.append(_P("loss_mask", _P.POSITIONAL_OR_KEYWORD, default=None))
    params += [_P(name, _P.KEYWORD_ONLY, default=default) for name, default in spec.options]
    params += [_P("normalization", _P.KEYWORD_ONLY, default="valid_tokens"), _P("denominator", _P.KEYWORD_ONLY, default=None)]
    params += [_P("segment_ids", _P.KEYWORD_ONLY, default=None)]
    params += [_P(name, _P.KEYWORD_ONLY, default=default) for name, default, _ in extra.args]
    return params


def docstring(spec: KindSpec, extra: FrameworkArgs) -> str:
    """The docstring of ``spec``'s public function in one framework."""
    lines = [spec.title, "", _NOTATION[spec.target], "", f"    {spec.loss}", f"    {spec.grad}", "", "Args:"]
    names = ["logits", *([spec.target] if spec.target else []), "loss_mask", *spec.option_names, "normalization", "denominator", "segment_ids"]
    lines += [f"  {name}: {ARG_DOCS[name]}" for name in names]
    lines += [f"  {name}: {doc}" for name, _, doc in extra.args]
    lines += ["", "Returns:"] + ["  " + line for line in RETURNS_DOC.splitlines()]
    return "\n".join(lines) + "\n"


def public_function(
    spec: KindSpec, extra: FrameworkArgs, impl: Callable[..., Any], module: str
) -> Callable[..., Any]:
    """A function named ``spec.kind`` with the signature of :func:`parameters` and the
    docstring of :func:`docstring` that calls ``impl(spec.kind, **bound arguments)``."""
    # checks, accumulation and config import this table: imported when the frameworks build
    # their functions, once lossspec is whole.
    from . import accumulation
    from .checks import foreign_keyword_hint

    signature = inspect.Signature(parameters(spec, extra))

    def loss(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as err:
            hint = foreign_keyword_hint(set(kwargs) - set(signature.parameters), kwargs)
            raise TypeError(f"{spec.kind}(): {err}" + (f"; {hint}" if hint else "")) from None
        bound.apply_defaults()
        arguments = bound.arguments
        accumulation.record(spec.kind, arguments["normalization"], arguments["causal_shift"], arguments["denominator"])
        return impl(spec.kind, **arguments)

    loss.__name__ = loss.__qualname__ = spec.kind
    loss.__module__ = module
    loss.__doc__ = docstring(spec, extra)
    loss.__signature__ = signature  # type: ignore[attr-defined]
    return loss


def module_docstring(spec: KindSpec, extra: FrameworkArgs, framework: str) -> str:
    """The docstring of ``spec``'s module class: options fixed at construction, arrays per call."""
    options = ", ".join(f"{name}={default!r}" for name, default in spec.options)
    extras = ", ".join(f"{name}={default!r}" for name, default, _ in extra.args)
    return (
        f"Module form of :func:`{framework}.{spec.kind}`: {spec.title[0].lower()}{spec.title[1:]}\n\n"
        f"Constructed with the keyword options ``{options}, normalization='valid_tokens', {extras}``\n"
        "(validated at construction, with the function's errors); called as\n"
        f"``module(logits, {spec.target + ', ' if spec.target else ''}loss_mask=None, *, denominator=None, segment_ids=None)``. "
        "It holds no parameters.\n\n"
        f"    {spec.loss}\n    {spec.grad}\n"
    )


def module_settings(spec: KindSpec, extra: FrameworkArgs, options: dict[str, Any], owner: str) -> dict[str, Any]:
    """A module's settings: ``options`` over the defaults of ``spec``'s options,
    ``normalization`` and the framework's arguments, validated with the functions' own errors
    (an unknown name is a ``TypeError`` naming ``owner``)."""
    defaults = dict(spec.options, normalization="valid_tokens", **{name: default for name, default, _ in extra.args})
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        from .checks import foreign_keyword_hint  # checks and config import this table: imported here

        hint = foreign_keyword_hint(unknown, options)
        raise TypeError(f"{owner} got unexpected option(s) {', '.join(unknown)}; " + (f"{hint}; " if hint else "")
                        + f"it accepts {', '.join(defaults)}")
    from .config import make_config  # config builds its kind lists from this table

    settings = {**defaults, **options}
    make_config(spec.kind, normalization=settings["normalization"], **{name: settings[name] for name in spec.option_names})
    return settings


def module_class(kind: str, base: type, extra: FrameworkArgs, framework: str, module: str) -> type:
    """The module class of ``kind`` (named ``KIND_SPECS[kind].module``) on a framework's shared
    ``base`` class, with the table's docstring."""
    spec = KIND_SPECS[kind]
    return type(spec.module, (base,), {"kind": kind, "__doc__": module_docstring(spec, extra, framework), "__module__": module})
