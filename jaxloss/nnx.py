"""Flax NNX modules for the losses: configured once, called with the arrays.

Each module validates its options on construction (the same checks and messages as the
functions, from :func:`lossspec.make_config`) and is called as
``module(logits, target, loss_mask=None, *, denominator=None)``, where ``target`` is the
labels (:class:`CrossEntropyLoss`) or the teacher logits (the distillation losses);
:class:`EntropyLoss` has no target: ``module(logits, loss_mask=None, *, denominator=None)``. The
modules hold no parameters or state; they work under ``nnx.jit``, ``nnx.grad`` and inside
other modules. ``denominator`` is runtime data: a new global count never recompiles.

Example::

    loss_fn = CrossEntropyLoss(label_smoothing=0.1)
    loss = loss_fn(logits, labels, loss_mask)            # mean over valid tokens
    loss = loss_fn(logits, labels, loss_mask, denominator=global_count)
    shifted = CrossEntropyLoss(causal_shift=True)       # labels=input_ids (lossspec.causal)
    per_document = CrossEntropyLoss(normalization="sequence_mean")
    loss = per_document(logits, labels, loss_mask, segment_ids=document_ids)  # lossspec.sequences
"""

from __future__ import annotations

from typing import Any, Never, Optional

import jax
import lossspec
from flax import nnx as _nnx

from . import api
from .linear_nnx import LinearCrossEntropyLoss, LinearForwardKLLoss, LinearReverseKLLoss, LinearSoftCrossEntropyLoss  # fused-head modules

__all__ = [
    "CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss", "EntropyLoss", "JensenShannonLoss",
    "LinearCrossEntropyLoss", "LinearSoftCrossEntropyLoss", "LinearForwardKLLoss", "LinearReverseKLLoss",
]


class _Loss(_nnx.Module):
    """Shared body: the kind's options (``lossspec.KIND_SPECS``) stored as static attributes,
    checked once."""

    kind: str = ""

    def __init__(self, settings: dict[str, Any], unexpected: dict[str, Any]):
        settings = lossspec.kinds.module_settings(lossspec.KIND_SPECS[self.kind], settings, unexpected, type(self).__name__)
        lossspec.check_impl(settings["impl"], lossspec.JAX_IMPLS)
        if settings["vocab_parallel"] is not None:
            from ._vocab_parallel import axis_names

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

    def __call__(self, logits: Any, loss_mask: Any = None, *, denominator: Any = None) -> jax.Array:  # type: ignore[override]
        """The loss of this module's kind: an fp32 scalar, or per-token losses ``[...]`` for
        ``normalization="none"``."""
        function = getattr(api, self.kind)
        return function(
            logits,
            loss_mask,
            normalization=self.normalization,
            denominator=denominator,
            vocab_parallel=self.vocab_parallel,
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
            ),
            unexpected,
        )


class EntropyLoss(_TargetlessLoss):
    """Module form of :func:`jaxloss.entropy`: masked entropy of the student's distribution q (the entropy regulariser of
    policy-gradient trainers).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.entropy` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, with the function's errors); called as
    ``module(logits, loss_mask=None, *, denominator=None)``. It holds no parameters.

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
            ),
            unexpected,
        )
