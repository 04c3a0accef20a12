"""The fused LM head (SPEC section 8): ``linear_<kind>`` from hidden states and the head weight.

``linear_<kind>(hidden [..., H], weight [V, H], <target>, loss_mask=None, *, bias=None, ...)``
returns ``<kind>(hidden @ weight.T + bias, <target logits>, loss_mask, ...)`` with the logits
computed in fp32 and never materialised as one ``[N, V]`` buffer; ``<target>`` follows the kind
table's ``target`` (:data:`KIND_SPECS`): ``labels`` (cross-entropy), ``teacher_hidden [..., Ht],
teacher_weight [V, Ht]`` (+ ``teacher_bias=``) for the kinds with a teacher, whose teacher
logits are formed the same way and get no gradient, or nothing (entropy). Every kind whose
table row has ``head=True`` has a head (:data:`lossspec.HEAD_KINDS`).
``weight`` has the layout of a torch ``nn.Linear`` weight and of a tied embedding table in both
frameworks.

``segment_ids`` and the per-sequence normalisations are the unfused losses' (they only change
the per-token coefficient); ``vocab_parallel`` (a framework argument) splits the head along
``V`` (Megatron's column-parallel head; docs/linear_head.md).

This module is the framework-free part, written once for ``jaxloss.head`` and
``torchloss.head``: the signatures the written-out ``linear_<kind>`` follow (:func:`head_parameters`, from :data:`KIND_SPECS`), the
shape and dtype checks with their messages, the float64 reference (the chain rule through
:func:`lossspec.oracle`, which applies ``segment_ids`` as well), the gradient bound of the head
and the memory plans (also of a vocabulary shard, :func:`head_plan_shard`, and of the
``recompute_logits`` backward, :func:`head_plan_recompute`), tuned per call by
:class:`HeadTuning` (``tuning=``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import numpy as np

from .checks import FLOAT_KIND, LOGIT_DTYPES, ArrayMeta, shape_text, meta
from .config import HEAD_KINDS, check_impl
from .kinds import KIND_SPECS, KindSpec
from .oracle import oracle
from .tuning import check_size_field
from .tolerances import GRAD_RTOL, GRAD_ULPS_16BIT, SIXTEEN_BIT, Comparison, worst_comparison, gradient_scale, loss_bound, ulp

_P = inspect.Parameter

#: the public name of each kind's fused head (the kinds whose table row has ``head=True``)
LINEAR_NAMES: dict[str, str] = {kind: f"linear_{kind}" for kind in HEAD_KINDS}

#: the head's arguments shared by both frameworks after ``impl`` (then each framework's
#: ``vocab_parallel`` and ``tuning``, :class:`HeadTuning`), as ``(name, default)``
HEAD_ARGS: tuple[tuple[str, Any], ...] = (("recompute_logits", False), ("precision", "exact"))

# --------------------------------------------------------------------------------------------
# The two precision contracts (SPEC section 8)
# --------------------------------------------------------------------------------------------

#: ``precision=`` of the fused head: ``"exact"`` (every product exact, accumulated in fp32: the
#: default) or ``"tensor"`` (bf16 heads: the backward's ``G`` rounded once to bf16, so that all
#: three matmuls are bf16 x bf16 products accumulated in fp32, the tensor cores' form)
HEAD_PRECISIONS: tuple[str, ...] = ("exact", "tensor")
#: the dtypes of ``hidden`` and ``weight`` that ``precision="tensor"`` takes: bf16 has fp32's
#: exponent range, so rounding ``G`` to it loses significand bits only (float16 would flush the
#: small entries of ``G``, ``1 / N`` and below, to its subnormals)
HEAD_TENSOR_DTYPES: tuple[str, ...] = ("bfloat16",)
#: the ``"tensor"`` contract's extra gradient term, relative to the componentwise magnitude ``M``:
#: twice bf16's unit roundoff ``2^-9`` (``G``'s one rounding to nearest even takes half of it)
HEAD_TENSOR_GRAD_RTOL: float = 2.0**-8
#: the unit of the ``"tensor"`` contract's logits bound: one fp32 ulp of 1 (``2^-23``) per
#: addition, twice the round-to-nearest unit, for accumulators that truncate (tensor cores)
HEAD_TENSOR_ADD_ERROR: float = 2.0**-23
#: the devices (torch device types, JAX platforms) on which ``precision="tensor"`` runs the
#: head's matmuls on bf16 operands (where a device has no such matmul with an fp32 result, the
#: head computes the exact contract's numbers, which meet the tensor bounds too)
HEAD_TENSOR_DEVICES: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")


def check_head_precision(precision: Any, dtype: Optional[str] = None) -> str:
    """``precision=`` checked: one of :data:`HEAD_PRECISIONS`; ``"tensor"`` only for the dtypes
    of :data:`HEAD_TENSOR_DTYPES` (``dtype``: that of ``hidden`` and ``weight``; ``None`` at a
    module's construction, before any array)."""
    if not isinstance(precision, str) or precision not in HEAD_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(repr(p) for p in HEAD_PRECISIONS)}; got {precision!r}")
    if precision == "tensor" and dtype is not None and dtype not in HEAD_TENSOR_DTYPES:
        raise ValueError(
            f"precision='tensor' is the contract of bfloat16 heads (bf16 x bf16 products accumulated in fp32, the "
            f"logits gradient rounded once to bf16); hidden and weight are {dtype}: use precision='exact'"
        )
    return precision


def head_logits_gamma(width: int) -> float:
    """``gamma_H`` of the ``"tensor"`` contract: ``|z_hat - z| <= gamma_H (|h| |W|^T + |b|)`` for
    logits formed from bf16 ``h`` ``[., H]`` and ``W`` whose products are exact in fp32 and whose
    ``H`` additions (the bias's included) each err by at most :data:`HEAD_TENSOR_ADD_ERROR` of
    their result, in any order: ``gamma_H = k e / (1 - k e)`` with ``k = H``, ``e = 2^-23``
    (Higham's bound for recursive summation, with the unit doubled for truncating adders)."""
    k = max(1, int(width)) * HEAD_TENSOR_ADD_ERROR
    return k / (1.0 - k)


def head_matmul_tuning(tuning: "HeadTuning", precision: str) -> "HeadTuning":
    """The :class:`HeadTuning` that carries out ``precision``: ``"exact"`` leaves ``tuning`` as it
    is; ``"tensor"`` turns the bf16 matmuls on for every device of :data:`HEAD_TENSOR_DEVICES`
    with ``G`` as one bf16 term (``split_terms=1``: rounded once, to nearest even). Both
    frameworks' plain paths read only these two fields for it."""
    if precision == "exact":
        return tuning
    return dataclasses.replace(tuning, bf16_matmul_devices=HEAD_TENSOR_DEVICES, split_terms=1)


def check_recompute_logits(recompute_logits: Any) -> bool:
    """``recompute_logits`` checked: ``True`` or ``False`` (a ``TypeError`` otherwise)."""
    if not isinstance(recompute_logits, (bool, np.bool_)):
        raise TypeError(f"recompute_logits must be True or False, got {recompute_logits!r}")
    return bool(recompute_logits)


def head_impl(impl: str, choices: tuple[str, ...], plain: str) -> str:
    """The fused head's path from ``impl`` (checked against the framework's ``choices``): the
    framework's plain path (``plain``: ``"xla"`` / ``"torch"``) for ``"auto"`` and ``plain``;
    the kernel implementations (``"pallas"`` / ``"triton"``) raise :data:`HEAD_KERNELS_RETIRED`."""
    check_impl(impl, choices)
    if impl not in ("auto", plain):
        raise ValueError(HEAD_KERNELS_RETIRED.format(impl=impl, plain=plain))
    return plain


#: the error of ``impl="pallas"`` / ``"triton"`` on a fused head (:func:`head_impl`)
HEAD_KERNELS_RETIRED: str = (
    "impl={impl!r}: the fused head has no {impl} kernels any more (retired: their exact fp32 tiles ran about 300x "
    "slower than the three bf16 matmuls on an H200, docs/linear_head.md); the head runs on the framework's matmuls "
    "with impl='auto' or impl={plain!r} (precision='tensor' for bf16 tensor-core speed)"
)


def head_targets(spec: KindSpec) -> tuple[str, ...]:
    """The positional target arguments of ``spec``'s head: ``labels``, the teacher's pair, or
    none (a kind without a target)."""
    if spec.has_teacher:
        return ("teacher_hidden", "teacher_weight")
    return ("labels",) if spec.has_labels else ()


def head_biases(spec: KindSpec) -> tuple[str, ...]:
    """The keyword bias arguments of ``spec``'s head."""
    return ("bias", "teacher_bias") if spec.has_teacher else ("bias",)


def head_parameters(spec: KindSpec, extra: tuple[tuple[str, Any], ...] = ()) -> list[inspect.Parameter]:
    """The signature :data:`KIND_SPECS` implies for ``linear_<kind>`` (what the written-out heads of
    ``jaxloss.head`` and ``torchloss.head`` are checked against, annotations aside):
    ``hidden, weight, <targets>, loss_mask=None, *, <biases>=None, <options>, normalization,
    denominator, segment_ids, impl`` (the options, defaults and order of the unfused
    ``spec.kind``), :data:`HEAD_ARGS`, then the framework's own ``extra`` ``(name, default)``
    (``vocab_parallel``, ``tuning``)."""
    params = [_P("hidden", _P.POSITIONAL_OR_KEYWORD), _P("weight", _P.POSITIONAL_OR_KEYWORD)]
    params += [_P(name, _P.POSITIONAL_OR_KEYWORD) for name in head_targets(spec)]
    params.append(_P("loss_mask", _P.POSITIONAL_OR_KEYWORD, default=None))
    params += [_P(name, _P.KEYWORD_ONLY, default=None) for name in head_biases(spec)]
    params += [_P(name, _P.KEYWORD_ONLY, default=default) for name, default in spec.options]
    params += [_P("normalization", _P.KEYWORD_ONLY, default="valid_tokens"), _P("denominator", _P.KEYWORD_ONLY, default=None)]
    params += [_P("segment_ids", _P.KEYWORD_ONLY, default=None)]
    params.append(_P("impl", _P.KEYWORD_ONLY, default="auto"))
    params += [_P(name, _P.KEYWORD_ONLY, default=default) for name, default in HEAD_ARGS + tuple(extra)]
    return params


# --------------------------------------------------------------------------------------------
# Checks (shapes and dtypes; the labels, mask and denominator are then checked as for the
# unfused losses, against the stand-in metadata of the logits that are never formed)
# --------------------------------------------------------------------------------------------


def _check_projection(hidden_name: str, weight_name: str, bias_name: str, hidden: ArrayMeta, weight: ArrayMeta, bias: Optional[ArrayMeta]) -> int:
    """Check one ``hidden @ weight.T + bias`` and return its ``V``."""
    if hidden.kind != FLOAT_KIND:
        raise TypeError(f"{hidden_name} must be a floating-point array of shape [..., H]; got dtype {hidden.dtype}")
    if hidden.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{hidden_name} must have dtype float32, bfloat16, float16 or float64; got {hidden.dtype}")
    if len(hidden.shape) == 0:
        raise ValueError(f"{hidden_name} must have shape [..., H] with at least one dimension; got a scalar")
    if weight.kind != FLOAT_KIND or len(weight.shape) != 2:
        raise ValueError(
            f"{weight_name} must be a floating-point array of shape [V, H] (the nn.Linear layout); "
            f"got dtype {weight.dtype}, shape {shape_text(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{weight_name} must have the dtype of {hidden_name} ({hidden.dtype}); got {weight.dtype}")
    vocab, width = weight.shape
    if vocab == 0:
        raise ValueError(f"{weight_name} must have a non-empty vocabulary axis (V > 0); got shape {shape_text(weight.shape)}")
    if width != hidden.shape[-1]:
        raise ValueError(
            f"{weight_name} [V, H] must have H = {hidden_name}.shape[-1] = {hidden.shape[-1]}; got {weight_name} "
            f"{shape_text(weight.shape)} for {hidden_name} {shape_text(hidden.shape)} (pass nn.Linear's weight, not its transpose)"
        )
    if bias is not None:
        if bias.shape != (vocab,):
            raise ValueError(f"{bias_name} must have shape [V] = [{vocab}]; got {shape_text(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{bias_name} must have the dtype of {weight_name} ({weight.dtype}); got {bias.dtype}")
    return vocab


def check_head(
    kind: str,
    hidden: ArrayMeta,
    weight: ArrayMeta,
    bias: Optional[ArrayMeta],
    teacher: Optional[tuple[ArrayMeta, ArrayMeta, Optional[ArrayMeta]]] = None,
    precision: str = "exact",
) -> tuple[ArrayMeta, Optional[ArrayMeta]]:
    """Check the head's arrays and ``precision`` (:func:`check_head_precision`, against the dtype
    of ``hidden`` and ``weight``); return the metadata of the (never formed) student and teacher
    logits ``[..., V]``, for :func:`lossspec.check_inputs` (labels, mask, causal shift).

    ``teacher``: ``(teacher_hidden, teacher_weight, teacher_bias)`` for the kinds with a teacher.
    """
    vocab = _check_projection("hidden", "weight", "bias", hidden, weight, bias)
    check_head_precision(precision, hidden.dtype)
    logits = meta(hidden.shape[:-1] + (vocab,), FLOAT_KIND, hidden.dtype)
    if not KIND_SPECS[kind].has_teacher:
        return logits, None
    assert teacher is not None
    t_hidden, t_weight, t_bias = teacher
    t_vocab = _check_projection("teacher_hidden", "teacher_weight", "teacher_bias", t_hidden, t_weight, t_bias)
    if t_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"teacher_hidden must have the leading shape of hidden {shape_text(hidden.shape[:-1])}; got "
            f"{shape_text(t_hidden.shape)}"
        )
    if t_vocab != vocab:
        raise ValueError(f"teacher_weight must have the vocabulary of weight (V = {vocab}); got V = {t_vocab}")
    return logits, meta(hidden.shape[:-1] + (vocab,), FLOAT_KIND, t_hidden.dtype)


def device_message(name: str, device: Any, expected: Any) -> str:
    """The error for an array on another device than ``hidden``."""
    return f"{name} must be on the device of hidden ({expected}); got {device}"


# --------------------------------------------------------------------------------------------
# The float64 reference and the bound
# --------------------------------------------------------------------------------------------


def head_logits(hidden: np.ndarray, weight: np.ndarray, bias: Optional[np.ndarray] = None) -> np.ndarray:
    """``hidden @ weight.T + bias`` in float64, ``[..., V]``."""
    z = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64).T
    return z if bias is None else z + np.asarray(bias, np.float64)


def oracle_head(
    kind: str,
    hidden: np.ndarray,
    weight: np.ndarray,
    target: Any,
    loss_mask: Optional[np.ndarray] = None,
    *,
    bias: Optional[np.ndarray] = None,
    precision: str = "exact",
    **options: Any,
) -> tuple[Any, dict[str, Optional[np.ndarray]]]:
    """The float64 reference of ``linear_<kind>``: ``(loss, grads)``.

    ``target``: labels, ``(teacher_hidden, teacher_weight, teacher_bias)``, or ``None`` (a kind
    without a target). With ``G`` the
    oracle's gradient of the logits ``[N, V]`` (``h`` ``[N, H]`` the flattened hidden)::

        grad_hidden = G @ weight       grad_weight = G.T @ h       grad_bias = sum_n G

    ``grads``: ``{"hidden", "weight", "bias"}`` (``bias``: ``None`` without a bias), a
    :class:`HeadGrads` whose ``magnitude`` holds the same products of the absolute values,
    ``|G| @ |weight|``, ``|G|.T @ |h|`` and ``sum_n |G|``, for :func:`compare_head_grad`, and
    whose ``loss_slack`` is the loss's extra bound under ``precision`` (:func:`compare_head_loss`):
    0 for ``"exact"``; for ``"tensor"`` the logits' error propagated to the loss,
    ``sum_{n,v} |dL/dz_nv| gamma_H (|h_n| |W_v| + |b_v|)`` (:func:`head_logits_gamma`; ``dL/dz`` of
    the loss itself, without ``grad_output``), per token for ``normalization="none"`` and for the
    whole loss otherwise (an element of a per-sequence loss gets the total: a bound for each).
    """
    precision = check_head_precision(precision)
    logits = head_logits(hidden, weight, bias)
    if KIND_SPECS[kind].has_teacher:
        t_hidden, t_weight, t_bias = target
        target = head_logits(t_hidden, t_weight, t_bias)
    loss, grad_logits = oracle(kind, logits, target, loss_mask, **options)
    vocab, width = np.shape(weight)
    g = grad_logits.reshape(-1, vocab)
    h = np.asarray(hidden, np.float64).reshape(-1, width)
    w = np.asarray(weight, np.float64)
    grads = HeadGrads({
        "hidden": (g @ w).reshape(np.shape(hidden)),
        "weight": g.T @ h,
        "bias": None if bias is None else g.sum(axis=0),
    })
    # The componentwise magnitudes of the same products (SPEC section 8): what the rounding
    # errors of G are multiplied by, however much the sums themselves cancel.
    grads.magnitude = {
        "hidden": (np.abs(g) @ np.abs(w)).reshape(np.shape(hidden)),
        "weight": np.abs(g).T @ np.abs(h),
        "bias": None if bias is None else np.abs(g).sum(axis=0),
    }
    grads.loss_slack = np.zeros(np.shape(loss))
    if precision == "tensor":
        unit = {key: value for key, value in options.items() if key != "grad_output"}  # dL/dz of the loss itself
        _, grad_unit = oracle(kind, logits, target, loss_mask, **unit)
        error = head_logits_gamma(width) * (np.abs(h) @ np.abs(w).T + (0.0 if bias is None else np.abs(np.asarray(bias, np.float64))))
        per_token = np.sum(np.nan_to_num(np.abs(grad_unit.reshape(-1, vocab)), nan=0.0, posinf=0.0) * error, axis=1)
        if options.get("normalization") == "none":
            grads.loss_slack = per_token.reshape(np.shape(loss))
        else:
            grads.loss_slack = np.full(np.shape(loss), per_token.sum())
    return loss, grads


class HeadGrads(dict):
    """The float64 head gradients by name, with ``magnitude``: for each, the same product of the
    absolute values (``|G| @ |weight|`` for ``hidden``), the scale SPEC section 8 measures it in."""

    magnitude: dict[str, Optional[np.ndarray]]
    loss_slack: np.ndarray


def compare_head_loss(actual: Any, reference: Any, slack: Any = 0.0, what: str = "loss") -> Comparison:
    """SPEC section 8's loss bound: section 6's (:func:`lossspec.compare_loss`) plus ``slack``, the
    logits' error propagated to the loss under the call's precision (``oracle_head``'s
    ``grads.loss_slack``: 0 for ``"exact"``)."""
    return worst_comparison(what, np.asarray(actual), np.asarray(reference), loss_bound(reference) + np.asarray(slack, np.float64))


def compare_head_grad(
    actual: Any, reference: np.ndarray, dtype: str, what: str = "grad", magnitude: Optional[np.ndarray] = None, precision: str = "exact"
) -> Comparison:
    """SPEC section 8's bound for one head gradient, per element:
    ``4e-6 * max(S, M)`` (plus one ulp of ``dtype`` for 16-bit), with ``S = max |reference|`` of
    that tensor and ``M`` the element's componentwise magnitude (``oracle_head``'s
    ``grads.magnitude[name]``: ``(|G| @ |weight|)`` for ``hidden``). Without ``magnitude``, the
    stricter ``4e-6 S`` alone (``M = 0``). ``precision="tensor"`` adds
    :data:`HEAD_TENSOR_GRAD_RTOL` ``* M`` (``G`` rounded once to bf16 before the products).

    Why ``M``: every gradient of the head is a product with the logits' gradient ``G``, whose
    fp32 errors are relative to ``G``'s own entries (section 6) and partly shared by a whole row
    (one normaliser); ``dh = G W`` sums them weighted by ``W``. Where the row sums of ``G`` are 0
    (the distillation kinds) and ``W``'s columns have a large mean (all-positive weights), the sum
    cancels to far below its terms (``sum |G||W| / max |dh|`` about 6 on ``torch.rand`` inputs)
    while the errors do not: a bound on ``max |dh|`` alone then measures the cancellation, not the
    backend. ``M`` is the error scale of any fp32 product, so the bound is never below the old
    one and exceeds it only where the product cancels."""
    reference = np.asarray(reference, np.float64)
    scale = np.full(reference.shape, gradient_scale(reference, 0.0))
    if magnitude is not None:
        # NaN / inf magnitudes come from bad rows, whose NaN the comparison matches by itself
        finite = np.nan_to_num(np.asarray(magnitude, np.float64), nan=0.0, posinf=0.0)
        scale = np.maximum(scale, np.broadcast_to(finite, reference.shape))
    bound = GRAD_RTOL * scale
    if check_head_precision(precision) == "tensor":
        if magnitude is None:
            raise ValueError("precision='tensor' bounds a head gradient by its componentwise magnitude: pass magnitude")
        bound = bound + HEAD_TENSOR_GRAD_RTOL * np.broadcast_to(finite, reference.shape)
    if dtype in SIXTEEN_BIT:
        bound = bound + GRAD_ULPS_16BIT * ulp(np.nan_to_num(reference), dtype)
    # An all-zero reference (D == 0) must be matched exactly.
    bound = np.where(bound > 0, bound, np.finfo(np.float64).tiny)
    return worst_comparison(what, np.asarray(actual), reference, bound)


# --------------------------------------------------------------------------------------------
# The memory plan, shared by both frameworks
# --------------------------------------------------------------------------------------------

#: the peak extra memory of the head's temporaries, as a fraction of one [N, V] logits buffer in
#: the inputs' dtype (not counting the fp32 gradients of hidden, weight and bias, and in torch
#: for 16-bit inputs the fp32 copy of the weight). How many fp32 [R, B] blocks a framework's
#: head holds at once for a kind (``live_blocks`` of :func:`head_plan`) is its block math's to
#: say, which names the kinds' buffers: ``jaxloss._block.head_live_blocks``,
#: ``torchloss._block.head_live_blocks``.
HEAD_MEMORY_FRACTION: float = 1 / 8
#: the largest [R, B] block by default (64 MiB fp32): bigger blocks gain nothing in matmul speed
HEAD_MAX_BLOCK_ELEMENTS: int = 1 << 24
#: rows of a chunk in the vocabulary-blocked fallback (one row's V does not fit the budget)
HEAD_BLOCKED_ROWS: int = 64
#: bf16 terms of the fp32 logits gradient ``G`` in the heads' opt-in bf16 backward matmuls
#: (``split_bf16`` of both frameworks): each term but the last holds the remainder's top 8
#: significant bits, so three carry all 24 bits of an fp32 significand and ``sum_k term_k W`` is
#: the exact ``G W`` with its products accumulated in fp32 (two would round ``G`` to ~17 bits).
HEAD_SPLIT_TERMS: int = 3


#: the fields of :class:`HeadTuning` holding a size (``None`` or a positive ``int``)
HEAD_SIZE_FIELDS = ("block_elements", "blocked_rows")


def _device_types(name: str, value: Any) -> tuple[str, ...]:
    """``value`` as a tuple of device type names (a list or tuple of ``str``; a bare string is refused)."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"HeadTuning.{name} must be a tuple of device type names such as ('cuda',); got {value!r}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class HeadTuning:
    """How the fused head (``linear_<kind>(..., tuning=)``) splits its work, in both frameworks.

    One frozen, hashable dataclass (JAX takes it as a static argument: a new value compiles anew).
    ``None`` stands for the default; each path reads only the fields it uses and ignores the others,
    so the same value can be passed to ``jaxloss`` and ``torchloss`` alike. It changes how the work
    is split and which matmuls run, which may move results by a rounding within the bounds of
    docs/spec.md section 8, never what is computed. Validated on construction (``TypeError`` /
    ``ValueError`` naming the field).

    =========================  ======================================================  ==============================
    field                      read by                                                 default (``None`` / omitted)
    =========================  ======================================================  ==============================
    ``block_elements``         XLA / torch path: the budget of one ``[R, B]`` block    :func:`head_plan`'s (1/8 of the
                               (:func:`head_plan`; small values force the              logits buffer, at most
                               vocabulary-blocked fallback)                            :data:`HEAD_MAX_BLOCK_ELEMENTS`)
    ``blocked_rows``           XLA / torch path: rows of a chunk in the                :data:`HEAD_BLOCKED_ROWS` (64)
                               vocabulary-blocked fallback
    ``recompute_plan``         XLA / torch path with ``recompute_logits=True``: the    :func:`head_plan_recompute`'s
                               backward's ``(R, B)``, a pair of ints ``>= 1``
    ``bf16_matmul_devices``    XLA / torch path: the device types (JAX platforms)      ``()`` (off)
                               whose matmuls read bf16 operands as they are, the
                               backward's ``G`` as ``split_terms`` exact bf16 terms
                               (e.g. ``("cuda",)``; docs/linear_head.md)
    ``triton_matmul_devices``  torch path: the device types whose bf16 matmuls run     ``("cuda",)``
                               on the Triton kernel (``torchloss.backends.
                               triton_matmul``); JAX ignores it
    ``split_terms``            both paths' ``split_bf16`` and the Triton matmul: bf16  :data:`HEAD_SPLIT_TERMS` (3)
                               terms of the fp32 ``G`` (fewer round it: tests)
    =========================  ======================================================  ==============================

    The tile fields of the retired head kernels (``block_rows``, ``block_vocab``, ``block_hidden``,
    ``num_warps``, ``num_stages``, ``interpret``) are gone with them (docs/migrating.md).
    """

    block_elements: Optional[int] = None
    blocked_rows: Optional[int] = None
    recompute_plan: Optional[tuple[int, int]] = None
    bf16_matmul_devices: tuple[str, ...] = ()
    triton_matmul_devices: tuple[str, ...] = ("cuda",)
    split_terms: int = HEAD_SPLIT_TERMS

    def __post_init__(self) -> None:
        for name in HEAD_SIZE_FIELDS:
            object.__setattr__(self, name, check_size_field("HeadTuning", name, getattr(self, name)))
        plan = self.recompute_plan
        if plan is not None:
            if not isinstance(plan, (tuple, list)) or len(plan) != 2:
                raise TypeError(f"HeadTuning.recompute_plan must be None or a pair (R, B) of ints; got {plan!r}")
            sizes = tuple(check_size_field("HeadTuning", "recompute_plan", value) for value in plan)
            object.__setattr__(self, "recompute_plan", sizes)
        for name in ("bf16_matmul_devices", "triton_matmul_devices"):
            object.__setattr__(self, name, _device_types(name, getattr(self, name)))
        object.__setattr__(self, "split_terms", check_size_field("HeadTuning", "split_terms", self.split_terms, optional=False))


#: every field of :class:`HeadTuning` at its default (an immutable value, never a knob)
DEFAULT_HEAD_TUNING = HeadTuning()


def check_head_tuning(tuning: Any) -> HeadTuning:
    """The ``tuning=`` argument of a fused head: ``None`` (the defaults) or a :class:`HeadTuning`."""
    if tuning is None:
        return DEFAULT_HEAD_TUNING
    if not isinstance(tuning, HeadTuning):
        hint = " (the fused head takes lossspec.HeadTuning; lossspec.Tuning is the losses')" if type(tuning).__name__ == "Tuning" else ""
        raise TypeError(f"tuning must be None or a lossspec.HeadTuning; got {type(tuning).__name__}{hint}")
    return tuning


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """How one fused-head call runs, resolved once before it: the implementation
    (:func:`head_impl`), whether the backward recomputes the logits
    (:func:`check_recompute_logits`) and the call's :class:`HeadTuning` (the block budget of
    :func:`head_plan`, the ``recompute_logits`` backward's ``(R, B)``, the bf16 matmuls; with ``precision``'s matmuls applied, :func:`head_matmul_tuning`) and the
    precision contract (:data:`HEAD_PRECISIONS`). Frozen and hashable: JAX's ``custom_vjp`` takes it as a static argument."""

    impl: str = "auto"
    recompute_logits: bool = False
    tuning: HeadTuning = DEFAULT_HEAD_TUNING
    precision: str = "exact"

    @property
    def block_elements(self) -> Optional[int]:
        """The budget of one ``[R, B]`` block (``None``: :func:`head_plan`'s default)."""
        return self.tuning.block_elements

    @property
    def blocked_rows(self) -> int:
        """Rows of a chunk in the vocabulary-blocked fallback."""
        return head_blocked_rows(self.tuning)

    @property
    def recompute_plan(self) -> Optional[tuple[int, int]]:
        """The ``recompute_logits`` backward's ``(R, B)`` (``None``: :func:`head_plan_recompute`'s)."""
        return self.tuning.recompute_plan


def head_blocked_rows(tuning: HeadTuning) -> int:
    """``tuning.blocked_rows``, or :data:`HEAD_BLOCKED_ROWS` where it is ``None``."""
    return HEAD_BLOCKED_ROWS if tuning.blocked_rows is None else int(tuning.blocked_rows)


#: the fewest vocabulary columns of a ``recompute_logits`` backward slice (when the budget allows)
HEAD_RECOMPUTE_MIN_COLUMNS: int = 256


def head_plan(
    rows: int,
    vocab: int,
    block_elements: Optional[int] = None,
    blocked_rows: int = HEAD_BLOCKED_ROWS,
    live_blocks: int = 4,
    logits_itemsize: int = 4,
    block_itemsize: int = 4,
    *,
    whole_row_live_blocks: Optional[int] = None,
) -> tuple[int, int]:
    """``(R, B)``: token chunks of ``R`` rows and vocabulary blocks of ``B`` columns.

    The budget of one ``[R, B]`` block is ``block_elements`` or
    ``min(N V HEAD_MEMORY_FRACTION / live_blocks * logits_itemsize / block_itemsize,
    HEAD_MAX_BLOCK_ELEMENTS)`` (``live_blocks``: the frameworks' ``_block.head_live_blocks``): the blocks fit the
    fraction of the logits buffer the head replaces, in the inputs' dtype (``logits_itemsize``
    bytes: 2 for 16-bit inputs, whose blocks are fp32, ``block_itemsize = 4``). When a whole
    row fits (``V <= budget``), ``B = V`` (no recompute: three matmuls); otherwise the fallback
    takes ``R = min(N, blocked_rows, budget)`` rows in blocks of ``B = budget // R``
    columns with an online softmax (the logits are recomputed in the gradient pass).
    ``whole_row_live_blocks``: the live blocks of a kind whose whole-row chunks hold fewer than
    its rows of several blocks (``live_blocks`` if ``None``); its budget decides whole rows first.
    """
    if block_elements is None:
        share = int(rows * vocab * HEAD_MEMORY_FRACTION * logits_itemsize / block_itemsize)
        block_elements = min(share // live_blocks, HEAD_MAX_BLOCK_ELEMENTS)
        if whole_row_live_blocks is not None and vocab <= min(share // whole_row_live_blocks, HEAD_MAX_BLOCK_ELEMENTS):
            block_elements = min(share // whole_row_live_blocks, HEAD_MAX_BLOCK_ELEMENTS)
    budget = max(1, int(block_elements))
    rows = max(1, rows)
    if vocab <= budget:
        return max(1, min(rows, budget // vocab)), vocab
    chunk = max(1, min(rows, blocked_rows, budget))
    return chunk, max(1, min(vocab, budget // chunk))


def head_plan_recompute(
    rows: int, vocab: int, width: int, budget: int, blocks: int = 1, slices: int = 2, row_elements: int = 0
) -> tuple[int, int]:
    """``(R, B)`` of the ``recompute_logits`` backward: vocabulary slices of ``B`` columns (the
    outer loop: each slice's weight gradient is summed over all tokens, then rounded and
    written) and token chunks of ``R`` rows, such that ``blocks`` ``[R, B]`` blocks,
    ``slices`` ``[B, H]`` temporaries (the slice's weight rows widened, its fp32 gradient) and
    ``row_elements`` per row of a chunk (its hidden states widened to fp32, where they are
    16-bit) fit ``budget`` elements together: ``blocks R B + slices B H + R row_elements <=
    budget`` (the forward's live blocks). All tokens in one chunk when that leaves ``B >=``
    :data:`HEAD_RECOMPUTE_MIN_COLUMNS`; otherwise fewer rows, so the matmuls stay wide (with
    ``row_elements``, which are paid again for every slice, the slices take half the budget). ``B``
    divides ``V`` when a divisor at least half as wide exists (JAX then stacks the slices'
    gradients without a copy), and the chunks are balanced (``R = ceil(N / ceil(N / R_max))``:
    JAX moves the last chunk back to end at ``N`` and recomputes the rows it shares)."""
    budget, rows, blocks = max(1, int(budget)), max(1, rows), max(1, blocks)
    cols = (budget - rows * row_elements) // (blocks * rows + slices * width)
    if cols < HEAD_RECOMPUTE_MIN_COLUMNS:
        if row_elements:  # the rows are widened again for every slice: half the budget to the slices
            cols = max(cols, budget // (2 * slices * width))
        cols = max(cols, min(HEAD_RECOMPUTE_MIN_COLUMNS, budget // (blocks + slices * width + row_elements)))
    cols = max(1, min(vocab, cols))
    if vocab % cols:  # a width that divides V, if one is at least half as wide (no moved-back slice)
        cols = next((d for d in range(cols, (cols + 1) // 2 - 1, -1) if vocab % d == 0), cols)
    chunk = max(1, min(rows, (budget - slices * width * cols) // (blocks * cols + row_elements)))
    chunks = -(-rows // chunk)  # balanced: a last chunk moved back to end at N recomputes its overlap
    return -(-rows // chunks), cols


def head_recompute_budget(budget: int, rows: int, width: int, fp32_dh_apart: bool) -> int:
    """The ``recompute_logits`` backward's budget for :func:`head_plan_recompute`: the forward's
    live blocks' elements ``budget``, less the fp32 ``dh [N, H]`` where it is kept apart from
    the result (16-bit hidden states; for fp32 ones ``dh`` is the result), but never less than
    half of it, so that a wide ``H`` next to a small ``V`` keeps workable slices."""
    return max(budget - (rows * width if fp32_dh_apart else 0), budget // 2)


def head_plan_shard(
    rows: int,
    vocab_local: int,
    vocab_widest: int,
    block_elements: Optional[int] = None,
    blocked_rows: int = HEAD_BLOCKED_ROWS,
    live_blocks: int = 4,
    logits_itemsize: int = 4,
    block_itemsize: int = 4,
) -> tuple[int, int]:
    """``(R, B)`` of one vocabulary shard (``vocab_parallel``). The shards combine each token
    chunk's statistics with collectives, so every shard must cut the tokens alike: ``R`` is the
    plan of the widest shard (``vocab_widest``; shards may differ in torch), and ``B`` this
    shard's block, ``min(V_local, B_widest)`` (so a block never exceeds the widest shard's)."""
    chunk, block = head_plan(rows, vocab_widest, block_elements, blocked_rows, live_blocks, logits_itemsize, block_itemsize)
    return chunk, min(vocab_local, block)


# --------------------------------------------------------------------------------------------
# Module forms (jaxloss.nnx, torchloss.nn): options at construction, arrays per call
# --------------------------------------------------------------------------------------------


def head_module_name(kind: str) -> str:
    """``Linear`` + the unfused module's name, e.g. ``LinearCrossEntropyLoss``."""
    return "Linear" + KIND_SPECS[kind].module


def head_module_settings(kind: str, settings: dict[str, Any], unexpected: dict[str, Any], owner: str, impls: tuple[str, ...], plain: str) -> dict[str, Any]:
    """A head module's ``settings`` (its constructor's keyword arguments: ``kind``'s options,
    ``normalization``, ``impl``, ``recompute_logits``, ``precision``, ``vocab_parallel``, ``tuning``), validated
    with the functions' own errors (:func:`lossspec.kinds.module_settings`; ``unexpected`` keywords
    are a ``TypeError`` naming ``owner``): ``impl`` against the framework's ``impls``
    (:func:`head_impl`, ``plain`` its XLA / torch path), ``recompute_logits`` against the
    resolved path (:func:`check_recompute_logits`), ``precision``'s name (:func:`check_head_precision`;
    its dtype rule per call) and ``tuning`` (:func:`check_head_tuning`)."""
    from .kinds import module_settings

    settings = module_settings(KIND_SPECS[kind], settings, unexpected, owner, head=True)
    head_impl(settings["impl"], impls, plain)
    check_recompute_logits(settings["recompute_logits"])
    check_head_precision(settings.get("precision", "exact"))
    return settings
