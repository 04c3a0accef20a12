"""All ``nn.Module`` classes of ``torchloss`` (public path: :mod:`torchloss.nn`, which re-exports them).

The losses' modules (``CrossEntropyLoss``, ...; their signatures and docstrings from
``lossspec.KIND_SPECS``, mirroring ``jaxloss.modules``) are built like ``torch.nn.CrossEntropyLoss``:
the options fixed at construction (keyword only, validated there with the functions' errors), the
inputs given per call, ``module(logits, target, loss_mask=None, *, denominator=None,
segment_ids=None)`` (``EntropyLoss``: no target). The fused head's modules:
``LinearCrossEntropyLoss(**options)(hidden, head, labels, loss_mask=None, *, bias=None,
denominator=None, segment_ids=None)``, and the distillation kinds with ``teacher_hidden,
teacher_head``; ``head`` is a ``[V, H]`` weight or an ``nn.Linear`` (its weight and bias are
used). The modules hold no parameters or buffers. The classes name :mod:`torchloss.nn` as their
module (reprs, pickles).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

import lossspec
from lossspec import linear as spec_linear

from . import api, backends, head

__all__ = [
    "CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss", "EntropyLoss", "JensenShannonLoss",
    "LinearCrossEntropyLoss", "LinearSoftCrossEntropyLoss", "LinearForwardKLLoss", "LinearReverseKLLoss",
]

#: The public module the classes name as theirs (``__module__``): the path users import.
PUBLIC_MODULE = "torchloss.nn"


# --------------------------------------------------------------------------------------------
# The losses' modules
# --------------------------------------------------------------------------------------------


class _MaskedLoss(torch.nn.Module):
    """Shared body: the kind's options (``lossspec.KIND_SPECS``) stored and checked once."""

    kind: str = ""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        spec = lossspec.KIND_SPECS[self.kind]
        # Validated now, like torch.nn losses do, with the functions' own errors.
        self.settings = lossspec.kinds.module_settings(spec, api.FRAMEWORK_ARGS, options, type(self).__name__)
        lossspec.check_impl(self.settings["impl"], backends.IMPLS)

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
    return lossspec.kinds.module_class(kind, base, api.FRAMEWORK_ARGS, "torchloss", PUBLIC_MODULE)


CrossEntropyLoss = _module("cross_entropy")
SoftCrossEntropyLoss = _module("soft_cross_entropy")
ForwardKLLoss = _module("forward_kl")
ReverseKLLoss = _module("reverse_kl")
EntropyLoss = _module("entropy")
JensenShannonLoss = _module("jensen_shannon")


# --------------------------------------------------------------------------------------------
# The fused head's modules
# --------------------------------------------------------------------------------------------


def _unpack_linear(weight: Any, bias: Optional[Tensor]) -> tuple[Any, Optional[Tensor]]:
    """An ``nn.Linear`` head becomes its ``[V, H]`` weight and (unless given) its bias."""
    if isinstance(weight, torch.nn.Linear):
        return weight.weight, weight.bias if bias is None else bias
    return weight, bias


class _LinearLoss(torch.nn.Module):
    """Shared body of the head modules: the kind's options stored and checked once."""

    kind: str = ""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.settings = spec_linear.head_module_settings(
            self.kind, options, type(self).__name__, head.HEAD_FRAMEWORK_ARGS, backends.IMPLS, backends.PLAIN)

    def forward(self, hidden: Tensor, weight: Any, *args: Any, loss_mask: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                teacher_bias: Optional[Tensor] = None, denominator: api.Denominator = None, segment_ids: Optional[Tensor] = None) -> Tensor:
        """The loss of this module's kind; ``args``: the labels, or the teacher's hidden states
        and weight, then optionally the mask (as for the function)."""
        weight, bias = _unpack_linear(weight, bias)
        args = list(args)
        kwargs: dict[str, Any] = {"bias": bias, "denominator": denominator, "segment_ids": segment_ids, **self.settings}
        if loss_mask is not None:
            kwargs["loss_mask"] = loss_mask
        if lossspec.KIND_SPECS[self.kind].has_teacher:
            if len(args) >= 2:
                args[1], teacher_bias = _unpack_linear(args[1], teacher_bias)
            kwargs["teacher_bias"] = teacher_bias
        return getattr(head, spec_linear.LINEAR_NAMES[self.kind])(hidden, weight, *args, **kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.settings.items())


def _module(kind: str) -> type:
    doc = spec_linear.head_module_docstring(kind, "torchloss", "torch.nn.Linear")
    return type(spec_linear.head_module_name(kind), (_LinearLoss,), {"kind": kind, "__doc__": doc, "__module__": PUBLIC_MODULE})


LinearCrossEntropyLoss = _module("cross_entropy")
LinearSoftCrossEntropyLoss = _module("soft_cross_entropy")
LinearForwardKLLoss = _module("forward_kl")
LinearReverseKLLoss = _module("reverse_kl")
