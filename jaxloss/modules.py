"""Flax NNX module forms of the fused LM head (re-exported by :mod:`jaxloss.nnx`).

``LinearCrossEntropyLoss(**options)(hidden, head, labels, loss_mask=None, *, bias=None,
denominator=None, segment_ids=None)`` (``impl=``, ``recompute_logits=`` and ``vocab_parallel=``
among the options), and the distillation kinds with ``teacher_hidden, teacher_head``. ``head``
is a ``[V, H]`` weight or an ``nnx.Linear`` (kernel ``[H, V]``: its transpose and its bias are
used; XLA folds the transpose into the matmul). The modules hold no parameters.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from flax import nnx as _nnx

import lossspec
from lossspec import linear as spec_linear

from . import head

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

    def __init__(self, **options: Any):
        self.settings = spec_linear.head_module_settings(
            self.kind, options, type(self).__name__, head.HEAD_FRAMEWORK_ARGS, lossspec.JAX_IMPLS, "xla")
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
    return type(spec_linear.head_module_name(kind), (_LinearLoss,), {"kind": kind, "__doc__": doc, "__module__": __name__})


LinearCrossEntropyLoss = _module("cross_entropy")
LinearSoftCrossEntropyLoss = _module("soft_cross_entropy")
LinearForwardKLLoss = _module("forward_kl")
LinearReverseKLLoss = _module("reverse_kl")
