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
    shifted = CrossEntropyLoss(causal_shift=True)       # labels=input_ids (lossspec.causal)
"""

from __future__ import annotations

from typing import Any

import jax
import lossspec
from flax import nnx as _nnx

from . import api
from .linear_nnx import LinearCrossEntropyLoss, LinearForwardKLLoss, LinearReverseKLLoss, LinearSoftCrossEntropyLoss  # noqa: F401  (fused-head modules)

__all__ = ["CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss"]


class _Loss(_nnx.Module):
    """Shared body: the kind's options (``lossspec.KIND_SPECS``) stored as static attributes,
    checked once."""

    kind: str = ""

    def __init__(self, **options: Any):
        spec = lossspec.KIND_SPECS[self.kind]
        settings = lossspec.kinds.module_settings(spec, api.FRAMEWORK_ARGS, options, type(self).__name__)
        lossspec.check_impl(settings["impl"], lossspec.JAX_IMPLS)
        if settings["vocab_parallel"] is not None:
            from ._vocab_parallel import axis_names

            axis_names(settings["vocab_parallel"])  # a bad value fails here, not at the first call
        self.normalization = settings.pop("normalization")
        self.vocab_parallel = settings.pop("vocab_parallel")
        self.impl = settings.pop("impl")
        self.options = settings

    def __call__(self, logits: Any, target: Any, loss_mask: Any = None, *, denominator: Any = None) -> jax.Array:
        """The loss of this module's kind: an fp32 scalar, or per-token losses ``[...]`` for
        ``normalization="none"``; ``target`` is the labels or the teacher logits."""
        function = getattr(api, self.kind)
        return function(
            logits,
            target,
            loss_mask,
            normalization=self.normalization,
            denominator=denominator,
            vocab_parallel=self.vocab_parallel,
            impl=self.impl,
            **self.options,
        )


def _module(kind: str) -> type:
    return lossspec.kinds.module_class(kind, _Loss, api.FRAMEWORK_ARGS, "jaxloss", __name__)


CrossEntropyLoss = _module("cross_entropy")
SoftCrossEntropyLoss = _module("soft_cross_entropy")
ForwardKLLoss = _module("forward_kl")
ReverseKLLoss = _module("reverse_kl")
