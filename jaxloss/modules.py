"""All Flax NNX modules of ``jaxloss`` (public path: :mod:`jaxloss.nnx`, which re-exports them).

The losses' modules (``CrossEntropyLoss``, ...; their signatures and docstrings from
``lossspec.KIND_SPECS``) are configured once and called with the arrays:
``module(logits, target, loss_mask=None, *, denominator=None, segment_ids=None)`` (``EntropyLoss``:
no target). The fused head's modules: ``LinearCrossEntropyLoss(**options)(hidden, head, labels,
loss_mask=None, *, bias=None, denominator=None, segment_ids=None)`` (``impl=``,
``recompute_logits=`` and ``vocab_parallel=`` among the options), and the distillation kinds with
``teacher_hidden, teacher_head``; ``head`` is a ``[V, H]`` weight or an ``nnx.Linear`` (kernel
``[H, V]``: its transpose and its bias are used; XLA folds the transpose into the matmul). Every
module validates its options on construction (the functions' checks and messages) and holds no
parameters or state. The classes name :mod:`jaxloss.nnx` as their module (reprs, pickles).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from flax import nnx as _nnx

import lossspec
from lossspec import linear as spec_linear

from . import api, backends, head

__all__ = [
    "CrossEntropyLoss", "SoftCrossEntropyLoss", "ForwardKLLoss", "ReverseKLLoss", "EntropyLoss", "JensenShannonLoss",
    "LinearCrossEntropyLoss", "LinearSoftCrossEntropyLoss", "LinearForwardKLLoss", "LinearReverseKLLoss",
]

#: The public module the classes name as theirs (``__module__``): the path users import.
PUBLIC_MODULE = "jaxloss.nnx"


# --------------------------------------------------------------------------------------------
# The losses' modules
# --------------------------------------------------------------------------------------------


class _Loss(_nnx.Module):
    """Shared body: the kind's options (``lossspec.KIND_SPECS``) stored as static attributes,
    checked once."""

    kind: str = ""

    def __init__(self, **options: Any):
        spec = lossspec.KIND_SPECS[self.kind]
        settings = lossspec.kinds.module_settings(spec, api.FRAMEWORK_ARGS, options, type(self).__name__)
        lossspec.check_impl(settings["impl"], backends.IMPLS)
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
    return lossspec.kinds.module_class(kind, base, api.FRAMEWORK_ARGS, "jaxloss", PUBLIC_MODULE)


CrossEntropyLoss = _module("cross_entropy")
SoftCrossEntropyLoss = _module("soft_cross_entropy")
ForwardKLLoss = _module("forward_kl")
ReverseKLLoss = _module("reverse_kl")
EntropyLoss = _module("entropy")
JensenShannonLoss = _module("jensen_shannon")


# --------------------------------------------------------------------------------------------
# The fused head's modules
# --------------------------------------------------------------------------------------------


def _unpack_linear(weight: Any, bias: Any) -> tuple[Any, Any]:
    """An ``nnx.Linear`` becomes its kernel transposed to ``[V, H]`` and (unless given) its bias."""
    if isinstance(weight, _nnx.Linear):
        layer_bias = None if weight.bias is None else weight.bias[...]
        return weight.kernel[...].T, layer_bias if bias is None else bias
    return weight, bias


class _LinearLoss(_nnx.Module):
    """Shared body: the kind's options stored as static attributes, checked once."""

    kind: str = ""

    def __init__(self, **options: Any):
        self.settings = spec_linear.head_module_settings(
            self.kind, options, type(self).__name__, head.HEAD_FRAMEWORK_ARGS, backends.IMPLS, backends.PLAIN)
        if self.settings["vocab_parallel"] is not None:
            from .backends.vocab_parallel import axis_names

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
        return getattr(head, spec_linear.LINEAR_NAMES[self.kind])(hidden, weight, *args_list, **kwargs)


def _module(kind: str) -> type:
    doc = spec_linear.head_module_docstring(kind, "jaxloss", "flax.nnx.Linear (kernel [H, V], transposed here)")
    return type(spec_linear.head_module_name(kind), (_LinearLoss,), {"kind": kind, "__doc__": doc, "__module__": PUBLIC_MODULE})


LinearCrossEntropyLoss = _module("cross_entropy")
LinearSoftCrossEntropyLoss = _module("soft_cross_entropy")
LinearForwardKLLoss = _module("forward_kl")
LinearReverseKLLoss = _module("reverse_kl")
