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

from typing import Any

import jax
import lossspec
from flax import nnx as _nnx

from . import api
from .modules import LinearCrossEntropyLoss, LinearForwardKLLoss, LinearReverseKLLoss, LinearSoftCrossEntropyLoss  # fused-head modules

__all__ = [
    "CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss", "EntropyLoss", "JensenShannonLoss",
    "LinearCrossEntropyLoss", "LinearSoftCrossEntropyLoss", "LinearForwardKLLoss", "LinearReverseKLLoss",
]


class _Loss(_nnx.Module):
    """Shared body: the kind's options (``lossspec.KIND_SPECS``) stored as static attributes,
    checked once."""

    kind: str = ""

    def __init__(self, **options: Any):
        spec = lossspec.KIND_SPECS[self.kind]
        settings = lossspec.kinds.module_settings(spec, api.FRAMEWORK_ARGS, options, type(self).__name__)
        lossspec.check_impl(settings["impl"], lossspec.JAX_IMPLS)
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


def _module(kind: str) -> type:
    base = _Loss if lossspec.KIND_SPECS[kind].target is not None else _TargetlessLoss
    return lossspec.kinds.module_class(kind, base, api.FRAMEWORK_ARGS, "jaxloss", __name__)


CrossEntropyLoss = _module("cross_entropy")
SoftCrossEntropyLoss = _module("soft_cross_entropy")
ForwardKLLoss = _module("forward_kl")
ReverseKLLoss = _module("reverse_kl")
EntropyLoss = _module("entropy")
JensenShannonLoss = _module("jensen_shannon")
