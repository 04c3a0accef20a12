"""``nn.Module`` wrappers of the losses, mirroring ``jaxloss.nnx`` (both built from
``lossspec``'s per-kind table).

Built like ``torch.nn.CrossEntropyLoss``: the options are fixed at construction (keyword only,
validated there with the same errors as the functions), the inputs are given per call::

    loss_fn = torchloss.nn.CrossEntropyLoss(label_smoothing=0.1)
    loss = loss_fn(logits, labels, loss_mask, denominator=D)
    shifted = torchloss.nn.CrossEntropyLoss(causal_shift=True)  # labels=input_ids (lossspec.causal)
    per_document = torchloss.nn.CrossEntropyLoss(normalization="sequence_mean")
    loss = per_document(logits, labels, loss_mask, segment_ids=document_ids)  # lossspec.sequences

The modules hold no parameters or buffers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

import lossspec

from . import api
from .head import LinearCrossEntropyLoss, LinearForwardKLLoss, LinearReverseKLLoss, LinearSoftCrossEntropyLoss  # fused-head modules

__all__ = [
    "CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss", "EntropyLoss", "JensenShannonLoss",
    "LinearCrossEntropyLoss", "LinearSoftCrossEntropyLoss", "LinearForwardKLLoss", "LinearReverseKLLoss",
]


class _MaskedLoss(torch.nn.Module):
    """Shared body: the kind's options (``lossspec.KIND_SPECS``) stored and checked once."""

    kind: str = ""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        spec = lossspec.KIND_SPECS[self.kind]
        # Validated now, like torch.nn losses do, with the functions' own errors.
        self.settings = lossspec.kinds.module_settings(spec, api.FRAMEWORK_ARGS, options, type(self).__name__)
        lossspec.check_impl(self.settings["impl"], lossspec.TORCH_IMPLS)

    def forward(
        self,
        logits: Tensor,
        target: Tensor,
        loss_mask: Optional[Tensor] = None,
        *,
        denominator: api.Denominator = None,
        segment_ids: Optional[Tensor] = None,
    ) -> Tensor:
        """The loss of this module's kind: a 0-d fp32 tensor, or per-token losses ``[...]`` for
        ``normalization="none"``; ``target`` is the labels or the teacher logits; ``segment_ids``
        the packed documents (lossspec.sequences)."""
        function = getattr(api, self.kind)
        return function(logits, target, loss_mask, denominator=denominator, segment_ids=segment_ids, **self.settings)

    def extra_repr(self) -> str:
        shown = {k: v for k, v in self.settings.items() if k not in ("vocab_parallel", "sequence_parallel", "inplace") or v}
        return ", ".join(f"{k}={v!r}" for k, v in shown.items())


class _TargetlessLoss(_MaskedLoss):
    """Shared body of the kinds without a target (``entropy``): ``module(logits, loss_mask)``."""

    def forward(self, logits: Tensor, loss_mask: Optional[Tensor] = None, *, denominator: api.Denominator = None) -> Tensor:  # type: ignore[override]
        """The loss of this module's kind: a 0-d fp32 tensor, or per-token losses ``[...]`` for
        ``normalization="none"``."""
        function = getattr(api, self.kind)
        return function(logits, loss_mask, denominator=denominator, **self.settings)


def _module(kind: str) -> type:
    base = _MaskedLoss if lossspec.KIND_SPECS[kind].target is not None else _TargetlessLoss
    return lossspec.kinds.module_class(kind, base, api.FRAMEWORK_ARGS, "torchloss", __name__)


CrossEntropyLoss = _module("cross_entropy")
SoftCrossEntropyLoss = _module("soft_cross_entropy")
ForwardKLLoss = _module("forward_kl")
ReverseKLLoss = _module("reverse_kl")
EntropyLoss = _module("entropy")
JensenShannonLoss = _module("jensen_shannon")
