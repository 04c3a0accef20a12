"""Flax NNX modules for the four losses: configured once, called with the arrays.

Each module validates its options on construction (the same checks and messages as the
functions, from :func:`lossspec.make_config`) and is called as
``module(logits, target, loss_mask=None, *, denominator=None)``, where ``target`` is the
labels (:class:`CrossEntropyLoss`) or the teacher logits (the distillation losses). The
modules hold no parameters or state; they work under ``nnx.jit``, ``nnx.grad`` and inside
other modules. ``denominator`` is runtime data: a new global count never recompiles.

Example::

    loss_fn = CrossEntropyLoss(label_smoothing=0.1)
    loss = loss_fn(logits, labels, loss_mask)            # mean over valid tokens
    loss = loss_fn(logits, labels, loss_mask, denominator=global_count)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import lossspec
from flax import nnx as _nnx

from . import api

__all__ = ["CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss"]


class _Loss(_nnx.Module):
    """Shared body: keyword options stored as static attributes, checked once."""

    kind: str = ""
    _fn: Callable[..., jax.Array]

    def __init__(self, *, normalization: str = "valid_tokens", vocab_parallel: Any = None, impl: str = "auto", **options: Any):
        lossspec.make_config(self.kind, normalization=normalization, **options)
        lossspec.check_impl(impl, lossspec.JAX_IMPLS)
        if vocab_parallel is not None:
            from ._vocab_parallel import axis_names

            axis_names(vocab_parallel)  # a bad value fails here, not at the first call
        self.normalization = normalization
        self.vocab_parallel = vocab_parallel
        self.impl = impl
        self.options = dict(options)

    def __call__(self, logits: Any, target: Any, loss_mask: Any = None, *, denominator: Any = None) -> jax.Array:
        """The loss of this module's kind: an fp32 scalar, or per-token losses ``[...]`` for
        ``normalization="none"``."""
        return type(self)._fn(
            logits,
            target,
            loss_mask,
            normalization=self.normalization,
            denominator=denominator,
            vocab_parallel=self.vocab_parallel,
            impl=self.impl,
            **self.options,
        )


class CrossEntropyLoss(_Loss):
    """:func:`jaxloss.cross_entropy` as a module.

    ``CrossEntropyLoss(*, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_scale=1.0,
    normalization="valid_tokens", vocab_parallel=None, impl="auto")``, called as
    ``loss(logits [..., V], labels [...], loss_mask=None, *, denominator=None)``.
    """

    kind = "cross_entropy"
    _fn = staticmethod(api.cross_entropy)

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        logit_scale: float = 1.0,
        normalization: str = "valid_tokens",
        vocab_parallel: Any = None,
        impl: str = "auto",
    ):
        super().__init__(
            normalization=normalization,
            vocab_parallel=vocab_parallel,
            impl=impl,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            logit_scale=logit_scale,
        )


class _DistillLoss(_Loss):
    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        normalization: str = "valid_tokens",
        vocab_parallel: Any = None,
        impl: str = "auto",
    ):
        super().__init__(
            normalization=normalization,
            vocab_parallel=vocab_parallel,
            impl=impl,
            temperature=temperature,
            logit_scale=logit_scale,
            teacher_logit_scale=teacher_logit_scale,
        )


class SoftCrossEntropyLoss(_DistillLoss):
    """:func:`jaxloss.soft_cross_entropy` as a module: ``SoftCrossEntropyLoss(*, temperature=1.0,
    logit_scale=1.0, teacher_logit_scale=1.0, normalization="valid_tokens", vocab_parallel=None,
    impl="auto")``, called as ``loss(logits, teacher_logits, loss_mask=None, *, denominator=None)``."""

    kind = "soft_cross_entropy"
    _fn = staticmethod(api.soft_cross_entropy)


class ForwardKLLoss(_DistillLoss):
    """:func:`jaxloss.forward_kl` (``KL(p || q)``) as a module; options as
    :class:`SoftCrossEntropyLoss`."""

    kind = "forward_kl"
    _fn = staticmethod(api.forward_kl)


class ReverseKLLoss(_DistillLoss):
    """:func:`jaxloss.reverse_kl` (``KL(q || p)``) as a module; options as
    :class:`SoftCrossEntropyLoss`."""

    kind = "reverse_kl"
    _fn = staticmethod(api.reverse_kl)
