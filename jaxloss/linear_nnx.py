"""Flax NNX module forms of the fused LM head (re-exported by :mod:`jaxloss.nnx`).

``LinearCrossEntropyLoss(**options)(hidden, head, labels, loss_mask=None, *, bias=None,
denominator=None, segment_ids=None)`` (``impl=``, ``recompute_logits=`` and ``vocab_parallel=``
among the options), and the distillation kinds with ``teacher_hidden, teacher_head``. ``head``
is a ``[V, H]`` weight or an ``nnx.Linear`` (kernel ``[H, V]``: its transpose and its bias are
used; XLA folds the transpose into the matmul). The modules hold no parameters.
"""

from __future__ import annotations

from typing import Any, Never, Optional

import jax
from flax import nnx as _nnx

import lossspec
from lossspec import linear as spec_linear

from . import api, linear

__all__ = ["LinearCrossEntropyLoss", "LinearSoftCrossEntropyLoss", "LinearForwardKLLoss", "LinearReverseKLLoss"]


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
        self.settings = spec_linear.head_module_settings(self.kind, settings, unexpected, type(self).__name__, lossspec.JAX_IMPLS, "xla")
        if self.settings["vocab_parallel"] is not None:
            from ._vocab_parallel import axis_names

            axis_names(self.settings["vocab_parallel"])  # a bad value fails here, not at the first call

    def __call__(self, hidden: Any, weight: Any, *args: Any, loss_mask: Any = None, bias: Any = None, teacher_bias: Any = None,
                 denominator: Any = None, segment_ids: Any = None) -> jax.Array:
        """The loss of this module's kind; ``args``: the labels, or the teacher's hidden states
        and head, then optionally the mask (as for the function)."""
        weight, bias = _unpack_linear(weight, bias)
        args_list = list(args)
        kwargs: dict[str, Any] = {"bias": bias, "denominator": denominator, "segment_ids": segment_ids, **self.settings}
        if loss_mask is not None:
            kwargs["loss_mask"] = loss_mask
        if lossspec.KIND_SPECS[self.kind].has_teacher:
            if len(args_list) >= 2:
                args_list[1], teacher_bias = _unpack_linear(args_list[1], teacher_bias)
            kwargs["teacher_bias"] = teacher_bias
        return getattr(linear, spec_linear.LINEAR_NAMES[self.kind])(hidden, weight, *args_list, **kwargs)


class LinearCrossEntropyLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_cross_entropy` (fused LM head + cross_entropy).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_cross_entropy` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, ``impl`` and ``recompute_logits`` included); called as
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
        vocab_parallel: Optional[api.AxisNames] = None,
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
                vocab_parallel=vocab_parallel,
            ),
            unexpected,
        )


class LinearSoftCrossEntropyLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_soft_cross_entropy` (fused LM head + soft_cross_entropy).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_soft_cross_entropy` but the
    arrays, ``denominator`` and ``segment_ids``; validated there, ``impl`` and ``recompute_logits`` included); called as
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
        vocab_parallel: Optional[api.AxisNames] = None,
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
                vocab_parallel=vocab_parallel,
            ),
            unexpected,
        )


class LinearForwardKLLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_forward_kl` (fused LM head + forward_kl).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_forward_kl` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, ``impl`` and ``recompute_logits`` included); called as
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
        vocab_parallel: Optional[api.AxisNames] = None,
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
                vocab_parallel=vocab_parallel,
            ),
            unexpected,
        )


class LinearReverseKLLoss(_LinearLoss):
    """Module form of :func:`jaxloss.linear_reverse_kl` (fused LM head + reverse_kl).

    The options are fixed at construction (keyword only: those of :func:`jaxloss.linear_reverse_kl` but the arrays,
    ``denominator`` and ``segment_ids``; validated there, ``impl`` and ``recompute_logits`` included); called as
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
        vocab_parallel: Optional[api.AxisNames] = None,
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
                vocab_parallel=vocab_parallel,
            ),
            unexpected,
        )
