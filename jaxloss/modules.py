"""All Flax NNX modules of ``jaxloss`` (public path: :mod:`jaxloss.nnx`, which re-exports them).

The losses' modules (``CrossEntropyLoss``, ...; written out with the options of
``lossspec.KIND_SPECS``) are configured once and called with the arrays:
``module(logits, target, loss_mask=None, *, denominator=None, segment_ids=None)`` (``EntropyLoss``:
no target). The fused head's modules: ``LinearCrossEntropyLoss(...options)(hidden, head, labels,
loss_mask=None, *, bias=None, denominator=None, segment_ids=None)`` (``impl=``,
``recompute_logits=`` and ``vocab_parallel=`` among the options), the kinds with a teacher with
``teacher_hidden, teacher_head``, and ``LinearEntropyLoss`` with no target; ``head`` is a ``[V, H]`` weight or an ``nnx.Linear`` (kernel
``[H, V]``: its transpose and its bias are used; XLA folds the transpose into the matmul). Every
module validates its options on construction (the functions' checks and messages) and holds no
parameters or state. The classes name :mod:`jaxloss.nnx` as their module (reprs, pickles).
"""

from __future__ import annotations

from typing import Any, Never, Optional

import jax
from flax import nnx as _nnx

import lossspec
from lossspec import linear as spec_linear

from . import api, backends, head

__all__ = [
    "CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss", "EntropyLoss", "JensenShannonLoss",
    "LinearCrossEntropyLoss", "LinearSoftCrossEntropyLoss", "LinearForwardKLLoss", "LinearReverseKLLoss", "LinearEntropyLoss",
    "LinearJensenShannonLoss",
]

#: The public module the classes name as theirs (``__module__``): the path users import.
PUBLIC_MODULE = "jaxloss.nnx"


# --------------------------------------------------------------------------------------------
# The losses' modules
# --------------------------------------------------------------------------------------------


class _Loss(_nnx.Module):
    """Shared body: the kind's options (``lossspec.KIND_SPECS``) stored as static attributes,
    checked once."""

    kind: str = ""

    def __init__(self, settings: dict[str, Any], unexpected: dict[str, Any]):
        settings = lossspec.kinds.module_settings(lossspec.KIND_SPECS[self.kind], settings, unexpected, type(self).__name__)
        lossspec.check_impl(settings["impl"], backends.IMPLS)
        if settings["vocab_parallel"] is not None:
            from .backends.vocab_parallel import axis_names

            axis_names(settings["vocab_parallel"])  # a bad value fails here, not at the first call
        self.normalization = settings.pop("normalization")
        self.vocab_parallel = settings.pop("vocab_parallel")
        self.sequence_parallel = settings.pop("sequence_parallel")
        self.impl = settings.pop("impl")
        self.options = settings

    def __call__(self, logits: Any, target: Any, loss_mask: Any = None, *, denominator: Any = None, segment_ids: Any = None) -> jax.Array:
        """The loss of this module's kind: an fp32 scalar, or per-token losses ``[...]`` for
        ``normalization="none"``; ``target`` is the labels or the teacher logits; ``segment_ids``
        the packed documents (lossspec.sequences)."""
        function = getattr(api, self.kind)
        return function(
            logits,
            target,
            loss_mask,
            normalization=self.normalization,
            denominator=denominator,
            segment_ids=segment_ids,
            vocab_parallel=self.vocab_parallel,
            sequence_parallel=self.sequence_parallel,
            impl=self.impl,
            **self.options,
        )


class _TargetlessLoss(_Loss):
    """Shared body of the kinds without a target (``entropy``): ``module(logits, loss_mask)``."""

    def __call__(self, logits: Any, loss_mask: Any = None, *, denominator: Any = None, segment_ids: Any = None) -> jax.Array:  # type: ignore[override]
        """The loss of this module's kind: an fp32 scalar, or per-token losses ``[...]`` for
        ``normalization="none"``; ``segment_ids`` the packed documents (lossspec.sequences)."""
        function = getattr(api, self.kind)
        return function(
            logits,
            loss_mask,
            normalization=self.normalization,
            denominator=denominator,
            segment_ids=segment_ids,
            vocab_parallel=self.vocab_parallel,
            sequence_parallel=self.sequence_parallel,
            impl=self.impl,
            **self.options,
        )


class CrossEntropyLoss(_Loss):
    """Module form of :func:`jaxloss.cross_entropy`: masked cross-entropy with integer labels, label smoothing and z-loss.

    The options are fixed at construction (keyword only: those of :func:`jaxloss.cross_entropy` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, with the function's errors); called as
    ``module(logits, labels, loss_mask=None, *, denominator=None, segment_ids=None)``. It holds no parameters.

        l = lse - (1 - eps) z_y - (eps / V) sum_v z_v + lam lse^2
        dl/dz = (1 + 2 lam lse) q - (1 - eps) onehot(y) - eps / V
    """

    kind = "cross_entropy"

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        vocab_parallel: Optional[api.AxisNames] = None,
        sequence_parallel: Optional[api.AxisNames] = None,
        impl: str = "auto",
        tuning: Optional[lossspec.Tuning] = None,
        inplace: bool = False,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                ignore_index=ignore_index,
                label_smoothing=label_smoothing,
                z_loss=z_loss,
                logit_scale=logit_scale,
                logit_softcap=logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                vocab_parallel=vocab_parallel,
                sequence_parallel=sequence_parallel,
                impl=impl,
                tuning=tuning,
                inplace=inplace,
            ),
            unexpected,
        )


class SoftCrossEntropyLoss(_Loss):
    """Module form of :func:`jaxloss.soft_cross_entropy`: masked cross-entropy against the teacher's distribution p.

    The options are fixed at construction (keyword only: those of :func:`jaxloss.soft_cross_entropy` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, with the function's errors); called as
    ``module(logits, teacher_logits, loss_mask=None, *, denominator=None, segment_ids=None)``. It holds no parameters.

        l = lse - sum_v p_v z_v
        dl/dz = q - p
    """

    kind = "soft_cross_entropy"

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        teacher_logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        vocab_parallel: Optional[api.AxisNames] = None,
        sequence_parallel: Optional[api.AxisNames] = None,
        impl: str = "auto",
        tuning: Optional[lossspec.Tuning] = None,
        inplace: bool = False,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                temperature=temperature,
                logit_scale=logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                logit_softcap=logit_softcap,
                teacher_logit_softcap=teacher_logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                vocab_parallel=vocab_parallel,
                sequence_parallel=sequence_parallel,
                impl=impl,
                tuning=tuning,
                inplace=inplace,
            ),
            unexpected,
        )


class ForwardKLLoss(_Loss):
    """Module form of :func:`jaxloss.forward_kl`: masked forward KL, KL(p || q), of the student q from the teacher p (mean
    seeking).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.forward_kl` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, with the function's errors); called as
    ``module(logits, teacher_logits, loss_mask=None, *, denominator=None, segment_ids=None)``. It holds no parameters.

        l = sum_v p_v (log p_v - log q_v)
        dl/dz = q - p
    """

    kind = "forward_kl"

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        teacher_logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        vocab_parallel: Optional[api.AxisNames] = None,
        sequence_parallel: Optional[api.AxisNames] = None,
        impl: str = "auto",
        tuning: Optional[lossspec.Tuning] = None,
        inplace: bool = False,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                temperature=temperature,
                logit_scale=logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                logit_softcap=logit_softcap,
                teacher_logit_softcap=teacher_logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                vocab_parallel=vocab_parallel,
                sequence_parallel=sequence_parallel,
                impl=impl,
                tuning=tuning,
                inplace=inplace,
            ),
            unexpected,
        )


class ReverseKLLoss(_Loss):
    """Module form of :func:`jaxloss.reverse_kl`: masked reverse KL, KL(q || p), of the student q from the teacher p (mode
    seeking).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.reverse_kl` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, with the function's errors); called as
    ``module(logits, teacher_logits, loss_mask=None, *, denominator=None, segment_ids=None)``. It holds no parameters.

        l = sum_v q_v (log q_v - log p_v)
        dl/dz = q (log q - log p - l)   (0 where q == 0)
    """

    kind = "reverse_kl"

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        teacher_logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        vocab_parallel: Optional[api.AxisNames] = None,
        sequence_parallel: Optional[api.AxisNames] = None,
        impl: str = "auto",
        tuning: Optional[lossspec.Tuning] = None,
        inplace: bool = False,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                temperature=temperature,
                logit_scale=logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                logit_softcap=logit_softcap,
                teacher_logit_softcap=teacher_logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                vocab_parallel=vocab_parallel,
                sequence_parallel=sequence_parallel,
                impl=impl,
                tuning=tuning,
                inplace=inplace,
            ),
            unexpected,
        )


class EntropyLoss(_TargetlessLoss):
    """Module form of :func:`jaxloss.entropy`: masked entropy of the student's distribution q (the entropy regulariser of
    policy-gradient trainers).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.entropy` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, with the function's errors); called as
    ``module(logits, loss_mask=None, *, denominator=None, segment_ids=None)``. It holds no parameters.

        l = -sum_v q_v log q_v
        dl/dz = -q (log q + l)   (0 where q == 0)
    """

    kind = "entropy"

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        vocab_parallel: Optional[api.AxisNames] = None,
        sequence_parallel: Optional[api.AxisNames] = None,
        impl: str = "auto",
        tuning: Optional[lossspec.Tuning] = None,
        inplace: bool = False,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                temperature=temperature,
                logit_scale=logit_scale,
                logit_softcap=logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                vocab_parallel=vocab_parallel,
                sequence_parallel=sequence_parallel,
                impl=impl,
                tuning=tuning,
                inplace=inplace,
            ),
            unexpected,
        )


class JensenShannonLoss(_Loss):
    """Module form of :func:`jaxloss.jensen_shannon`: masked generalised Jensen-Shannon divergence of the student q and the
    teacher p (on-policy distillation).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.jensen_shannon` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, with the function's errors); called as
    ``module(logits, teacher_logits, loss_mask=None, *, denominator=None, segment_ids=None)``. It holds no parameters.

        l = beta KL(p || M) + (1 - beta) KL(q || M),  M = beta p + (1 - beta) q;
        beta = 0: KL(p || q) (forward KL), beta = 1: KL(q || p) (reverse KL), computed as those kinds
        dl/dz = (1 - beta) q (log q - log M - KL(q || M))   (0 where q == 0; the KL kinds' at beta = 0, 1)
    """

    kind = "jensen_shannon"

    def __init__(
        self,
        *,
        beta: float = 0.5,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        teacher_logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        vocab_parallel: Optional[api.AxisNames] = None,
        sequence_parallel: Optional[api.AxisNames] = None,
        impl: str = "auto",
        tuning: Optional[lossspec.Tuning] = None,
        inplace: bool = False,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                beta=beta,
                temperature=temperature,
                logit_scale=logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                logit_softcap=logit_softcap,
                teacher_logit_softcap=teacher_logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                vocab_parallel=vocab_parallel,
                sequence_parallel=sequence_parallel,
                impl=impl,
                tuning=tuning,
                inplace=inplace,
            ),
            unexpected,
        )


# The classes name the public module as theirs (reprs, pickles): the path users import.
for _cls in (CrossEntropyLoss, SoftCrossEntropyLoss, ForwardKLLoss, ReverseKLLoss, EntropyLoss, JensenShannonLoss):
    _cls.__module__ = PUBLIC_MODULE


# --------------------------------------------------------------------------------------------
# The fused head's modules
# --------------------------------------------------------------------------------------------


def _unpack_linear(weight: Any, bias: Any) -> tuple[Any, Any]:
    """An ``nnx.Linear`` becomes its kernel transposed to ``[V, H]`` and (unless given) its bias."""
    if isinstance(weight, _nnx.Linear):
        layer_bias = None if weight.bias is None else weight.bias[...]
        return weight.kernel[...].T, layer_bias if bias is None else bias
    return weight, bias


class _LinearLoss(_nnx.Module):
    """Shared body: the kind's options stored as static attributes, checked once."""

    kind: str = ""

    def __init__(self, settings: dict[str, Any], unexpected: dict[str, Any]):
        self.settings = spec_linear.head_module_settings(self.kind, settings, unexpected, type(self).__name__, backends.IMPLS, backends.PLAIN)
        if self.settings["vocab_parallel"] is not None:
            from .backends.vocab_parallel import axis_names

            axis_names(self.settings["vocab_parallel"])  # a bad value fails here, not at the first call

    def __call__(self, hidden: Any, weight: Any, *args: Any, loss_mask: Any = None, bias: Any = None, teacher_bias: Any = None,
                 denominator: Any = None, segment_ids: Any = None) -> jax.Array:
        """The loss of this module's kind; ``args``: the labels, the teacher's hidden states and
        head, or nothing (a kind without a target), then optionally the mask (as for the function)."""
        weight, bias = _unpack_linear(weight, bias)
        args_list = list(args)
        kwargs: dict[str, Any] = {"bias": bias, "denominator": denominator, "segment_ids": segment_ids, **self.settings}
        if loss_mask is not None:
            kwargs["loss_mask"] = loss_mask
        if lossspec.KIND_SPECS[self.kind].has_teacher:
            if len(args_list) >= 2:
                args_list[1], teacher_bias = _unpack_linear(args_list[1], teacher_bias)
            kwargs["teacher_bias"] = teacher_bias
        return getattr(head, spec_linear.LINEAR_NAMES[self.kind])(hidden, weight, *args_list, **kwargs)


class LinearCrossEntropyLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_cross_entropy` (fused LM head + cross_entropy).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_cross_entropy` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, ``impl``, ``recompute_logits`` and ``precision`` included); called as
    ``module(hidden, weight, labels, loss_mask=None, *, bias=None, denominator=None, segment_ids=None)``. ``weight`` may
    be a ``flax.nnx.Linear`` (kernel ``[H, V]``, transposed here): its weight in the ``[V, H]`` layout and its bias
    (unless ``bias=`` is given) are used. It holds no parameters.
    """

    kind = "cross_entropy"

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        impl: str = "auto",
        recompute_logits: bool = False,
        precision: str = "exact",
        vocab_parallel: Optional[api.AxisNames] = None,
        tuning: Optional[lossspec.HeadTuning] = None,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                ignore_index=ignore_index,
                label_smoothing=label_smoothing,
                z_loss=z_loss,
                logit_scale=logit_scale,
                logit_softcap=logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                impl=impl,
                recompute_logits=recompute_logits,
                precision=precision,
                vocab_parallel=vocab_parallel,
                tuning=tuning,
            ),
            unexpected,
        )


class LinearSoftCrossEntropyLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_soft_cross_entropy` (fused LM head + soft_cross_entropy).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_soft_cross_entropy` but the
    arrays, ``denominator`` and ``segment_ids``; validated there, ``impl``, ``recompute_logits`` and ``precision`` included); called as
    ``module(hidden, weight, teacher_hidden, teacher_weight, loss_mask=None, *, bias=None, teacher_bias=None, denominator=None, segment_ids=None)``.
    ``weight`` (and ``teacher_weight``) may be a ``flax.nnx.Linear`` (kernel ``[H, V]``, transposed here): its weight in
    the ``[V, H]`` layout and its bias (unless ``bias=`` is given) are used. It holds no parameters.
    """

    kind = "soft_cross_entropy"

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        teacher_logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        impl: str = "auto",
        recompute_logits: bool = False,
        precision: str = "exact",
        vocab_parallel: Optional[api.AxisNames] = None,
        tuning: Optional[lossspec.HeadTuning] = None,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                temperature=temperature,
                logit_scale=logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                logit_softcap=logit_softcap,
                teacher_logit_softcap=teacher_logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                impl=impl,
                recompute_logits=recompute_logits,
                precision=precision,
                vocab_parallel=vocab_parallel,
                tuning=tuning,
            ),
            unexpected,
        )


class LinearForwardKLLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_forward_kl` (fused LM head + forward_kl).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_forward_kl` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, ``impl``, ``recompute_logits`` and ``precision`` included); called as
    ``module(hidden, weight, teacher_hidden, teacher_weight, loss_mask=None, *, bias=None, teacher_bias=None, denominator=None, segment_ids=None)``.
    ``weight`` (and ``teacher_weight``) may be a ``flax.nnx.Linear`` (kernel ``[H, V]``, transposed here): its weight in
    the ``[V, H]`` layout and its bias (unless ``bias=`` is given) are used. It holds no parameters.
    """

    kind = "forward_kl"

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        teacher_logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        impl: str = "auto",
        recompute_logits: bool = False,
        precision: str = "exact",
        vocab_parallel: Optional[api.AxisNames] = None,
        tuning: Optional[lossspec.HeadTuning] = None,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                temperature=temperature,
                logit_scale=logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                logit_softcap=logit_softcap,
                teacher_logit_softcap=teacher_logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                impl=impl,
                recompute_logits=recompute_logits,
                precision=precision,
                vocab_parallel=vocab_parallel,
                tuning=tuning,
            ),
            unexpected,
        )


class LinearReverseKLLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_reverse_kl` (fused LM head + reverse_kl).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_reverse_kl` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, ``impl``, ``recompute_logits`` and ``precision`` included); called as
    ``module(hidden, weight, teacher_hidden, teacher_weight, loss_mask=None, *, bias=None, teacher_bias=None, denominator=None, segment_ids=None)``.
    ``weight`` (and ``teacher_weight``) may be a ``flax.nnx.Linear`` (kernel ``[H, V]``, transposed here): its weight in
    the ``[V, H]`` layout and its bias (unless ``bias=`` is given) are used. It holds no parameters.
    """

    kind = "reverse_kl"

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        teacher_logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        impl: str = "auto",
        recompute_logits: bool = False,
        precision: str = "exact",
        vocab_parallel: Optional[api.AxisNames] = None,
        tuning: Optional[lossspec.HeadTuning] = None,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                temperature=temperature,
                logit_scale=logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                logit_softcap=logit_softcap,
                teacher_logit_softcap=teacher_logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                impl=impl,
                recompute_logits=recompute_logits,
                precision=precision,
                vocab_parallel=vocab_parallel,
                tuning=tuning,
            ),
            unexpected,
        )


class LinearEntropyLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_entropy` (fused LM head + entropy).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_entropy` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, ``impl``, ``recompute_logits`` and ``precision`` included); called as
    ``module(hidden, weight, loss_mask=None, *, bias=None, denominator=None, segment_ids=None)``.
    ``weight`` may be a ``flax.nnx.Linear`` (kernel ``[H, V]``, transposed here): its weight in
    the ``[V, H]`` layout and its bias (unless ``bias=`` is given) are used. It holds no parameters.
    """

    kind = "entropy"

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        impl: str = "auto",
        recompute_logits: bool = False,
        precision: str = "exact",
        vocab_parallel: Optional[api.AxisNames] = None,
        tuning: Optional[lossspec.HeadTuning] = None,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                temperature=temperature,
                logit_scale=logit_scale,
                logit_softcap=logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                impl=impl,
                recompute_logits=recompute_logits,
                precision=precision,
                vocab_parallel=vocab_parallel,
                tuning=tuning,
            ),
            unexpected,
        )


class LinearJensenShannonLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_jensen_shannon` (fused LM head + jensen_shannon).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_jensen_shannon` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, ``impl``, ``recompute_logits`` and ``precision`` included); called as
    ``module(hidden, weight, teacher_hidden, teacher_weight, loss_mask=None, *, bias=None, teacher_bias=None, denominator=None, segment_ids=None)``.
    ``weight`` (and ``teacher_weight``) may be a ``flax.nnx.Linear`` (kernel ``[H, V]``, transposed here): its weight in
    the ``[V, H]`` layout and its bias (unless ``bias=`` is given) are used. It holds no parameters.
    """

    kind = "jensen_shannon"

    def __init__(
        self,
        *,
        beta: float = 0.5,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        logit_softcap: Optional[float] = None,
        teacher_logit_softcap: Optional[float] = None,
        causal_shift: bool = False,
        normalization: str = "valid_tokens",
        impl: str = "auto",
        recompute_logits: bool = False,
        precision: str = "exact",
        vocab_parallel: Optional[api.AxisNames] = None,
        tuning: Optional[lossspec.HeadTuning] = None,
        **unexpected: Never,
    ) -> None:
        super().__init__(
            dict(
                beta=beta,
                temperature=temperature,
                logit_scale=logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                logit_softcap=logit_softcap,
                teacher_logit_softcap=teacher_logit_softcap,
                causal_shift=causal_shift,
                normalization=normalization,
                impl=impl,
                recompute_logits=recompute_logits,
                precision=precision,
                vocab_parallel=vocab_parallel,
                tuning=tuning,
            ),
            unexpected,
        )


for _cls in (
    LinearCrossEntropyLoss, LinearSoftCrossEntropyLoss, LinearForwardKLLoss, LinearReverseKLLoss, LinearEntropyLoss,
    LinearJensenShannonLoss,
):
    _cls.__module__ = PUBLIC_MODULE
del _cls
