"""Public import path of the Flax NNX modules: a re-export of :mod:`jaxloss.modules`, where they are defined.

The loss modules are configured once and called with the arrays. Each module validates its
options on construction (the same checks and messages as the functions, from
:func:`lossspec.make_config`) and is called as
``module(logits, target, loss_mask=None, *, denominator=None, segment_ids=None)``, where ``target`` is the
labels (:class:`CrossEntropyLoss`) or the teacher logits (the distillation losses);
:class:`EntropyLoss` has no target: ``module(logits, loss_mask=None, *, denominator=None, segment_ids=None)``. The
modules hold no parameters or state; they work under ``nnx.jit``, ``nnx.grad`` and inside
other modules. ``denominator`` is runtime data: a new global count never recompiles. The fused
head's modules (``LinearCrossEntropyLoss``, ...) take the hidden states and the head instead.

Example::

    loss_fn = CrossEntropyLoss(label_smoothing=0.1)
    loss = loss_fn(logits, labels, loss_mask)            # mean over valid tokens
    loss = loss_fn(logits, labels, loss_mask, denominator=global_count)
    shifted = CrossEntropyLoss(causal_shift=True)       # labels=input_ids (lossspec.causal)
    per_document = CrossEntropyLoss(normalization="sequence_mean")
    loss = per_document(logits, labels, loss_mask, segment_ids=document_ids)  # lossspec.sequences
"""

from __future__ import annotations

from .modules import (
    CrossEntropyLoss,
    EntropyLoss,
    ForwardKLLoss,
    JensenShannonLoss,
    LinearCrossEntropyLoss,
    LinearEntropyLoss,
    LinearForwardKLLoss,
    LinearJensenShannonLoss,
    LinearReverseKLLoss,
    LinearSoftCrossEntropyLoss,
    ReverseKLLoss,
    SoftCrossEntropyLoss,
)

__all__ = [
    "CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss", "EntropyLoss", "JensenShannonLoss",
    "LinearCrossEntropyLoss", "LinearSoftCrossEntropyLoss", "LinearForwardKLLoss", "LinearReverseKLLoss", "LinearEntropyLoss",
    "LinearJensenShannonLoss",
]
