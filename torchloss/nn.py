"""Public import path of the ``nn.Module`` classes: a re-export of :mod:`torchloss.modules`, where they are defined.

``nn.Module`` wrappers of the losses and of the fused head, mirroring ``jaxloss.nnx``, built like
``torch.nn.CrossEntropyLoss``: the options are fixed at construction (keyword only, validated
there with the same errors as the functions), the inputs are given per call::

    loss_fn = torchloss.nn.CrossEntropyLoss(label_smoothing=0.1)
    loss = loss_fn(logits, labels, loss_mask, denominator=D)
    shifted = torchloss.nn.CrossEntropyLoss(causal_shift=True)  # labels=input_ids (lossspec.causal)
    per_document = torchloss.nn.CrossEntropyLoss(normalization="sequence_mean")
    loss = per_document(logits, labels, loss_mask, segment_ids=document_ids)  # lossspec.sequences

The modules hold no parameters or buffers.
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
