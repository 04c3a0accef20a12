"""``nn.Module`` wrappers of the four losses, mirroring ``jaxloss.nnx``.

Built like ``torch.nn.CrossEntropyLoss``: the options are fixed at construction (keyword only,
validated there with the same errors as the functions), the inputs are given per call::

    loss_fn = torchloss.nn.CrossEntropyLoss(label_smoothing=0.1)
    loss = loss_fn(logits, labels, loss_mask, denominator=D)

The modules hold no parameters or buffers.
"""

from __future__ import annotations

from typing import Any

import lossspec
import torch
from torch import Tensor

from . import api

__all__ = ["CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss"]


class _MaskedLoss(torch.nn.Module):
    kind: str = ""

    def __init__(self, *, normalization: str, vocab_parallel: Any, impl: str, inplace: bool, **options: Any) -> None:
        super().__init__()
        # Validate now, like torch.nn losses do, with the functions' own errors.
        lossspec.make_config(self.kind, normalization=normalization, **options)
        lossspec.check_impl(impl, lossspec.TORCH_IMPLS)
        self.normalization = normalization
        self.vocab_parallel = vocab_parallel
        self.impl = impl
        self.inplace = inplace
        self.options = dict(options)

    def _kwargs(self, denominator: api.Denominator) -> dict[str, Any]:
        return dict(
            self.options,
            normalization=self.normalization,
            denominator=denominator,
            vocab_parallel=self.vocab_parallel,
            impl=self.impl,
            inplace=self.inplace,
        )

    def extra_repr(self) -> str:
        items = dict(self.options, normalization=self.normalization, impl=self.impl)
        if self.inplace:
            items["inplace"] = True
        return ", ".join(f"{k}={v!r}" for k, v in items.items())


class CrossEntropyLoss(_MaskedLoss):
    """Module form of :func:`torchloss.cross_entropy`: ``module(logits, labels, loss_mask=None,
    *, denominator=None)``."""

    kind = "cross_entropy"

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
        inplace: bool = False,
    ) -> None:
        super().__init__(
            normalization=normalization,
            vocab_parallel=vocab_parallel,
            impl=impl,
            inplace=inplace,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            logit_scale=logit_scale,
        )

    def forward(
        self, logits: Tensor, target: Tensor, loss_mask: Tensor | None = None, *, denominator: api.Denominator = None
    ) -> Tensor:
        return api.cross_entropy(logits, target, loss_mask, **self._kwargs(denominator))


class _DistillLoss(_MaskedLoss):
    def __init__(
        self,
        *,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        teacher_logit_scale: float = 1.0,
        normalization: str = "valid_tokens",
        vocab_parallel: Any = None,
        impl: str = "auto",
        inplace: bool = False,
    ) -> None:
        super().__init__(
            normalization=normalization,
            vocab_parallel=vocab_parallel,
            impl=impl,
            inplace=inplace,
            temperature=temperature,
            logit_scale=logit_scale,
            teacher_logit_scale=teacher_logit_scale,
        )

    def forward(
        self, logits: Tensor, target: Tensor, loss_mask: Tensor | None = None, *, denominator: api.Denominator = None
    ) -> Tensor:
        """``target``: the teacher logits, same shape as ``logits`` (no gradient)."""
        fn = {"soft_cross_entropy": api.soft_cross_entropy, "forward_kl": api.forward_kl, "reverse_kl": api.reverse_kl}[
            self.kind
        ]
        return fn(logits, target, loss_mask, **self._kwargs(denominator))


class SoftCrossEntropyLoss(_DistillLoss):
    """Module form of :func:`torchloss.soft_cross_entropy`: ``module(logits, teacher_logits,
    loss_mask=None, *, denominator=None)``."""

    kind = "soft_cross_entropy"


class ForwardKLLoss(_DistillLoss):
    """Module form of :func:`torchloss.forward_kl` (KL(p || q), teacher ``p``)."""

    kind = "forward_kl"


class ReverseKLLoss(_DistillLoss):
    """Module form of :func:`torchloss.reverse_kl` (KL(q || p), teacher ``p``)."""

    kind = "reverse_kl"
