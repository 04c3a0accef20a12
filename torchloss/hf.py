"""Hugging Face ``transformers``' causal-LM loss on ``torchloss`` (no jaxloss twin: JAX's adapter is a recipe, docs/jaxloss.md).

One line makes a ``transformers`` causal LM (or any model whose ``loss_type`` maps to
``ForCausalLMLoss``, e.g. ``...ForConditionalGeneration``) compute its loss with
:func:`torchloss.cross_entropy`::

    model.loss_function = torchloss.hf.for_causal_lm_loss

The model's forward (and ``Trainer``, which passes ``num_items_in_batch`` through the forward's
``**kwargs``) then calls it as it calls ``transformers.loss.loss_utils.ForCausalLMLoss``, with the
same arguments and the same numbers (docs/huggingface.md). This module does not import
``transformers``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor

import lossspec

from .api import cross_entropy

__all__ = ["for_causal_lm_loss"]

NumItems = Union[int, float, Tensor, None]


def shift_labels_left(labels: Tensor, ignore_index: int) -> Tensor:
    """The causal targets of ``labels [..., T]``: ``out[..., t] = labels[..., t + 1]`` and
    ``out[..., T - 1] = ignore_index`` (the last position predicts nothing). Same shape and dtype;
    a new (small) labels tensor, the logits are never copied or sliced."""
    # Pad then slice, as ForCausalLMLoss does: the same result for every labels shape it takes.
    # torchloss.cross_entropy(..., causal_shift=True) replaces this function and its copy.
    padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
    return padded[..., 1:]


def _check_vocab_size(logits: Tensor, vocab_size: int) -> None:
    """``ForCausalLMLoss`` views the logits as ``[-1, vocab_size]``; a last dimension of another
    size would silently pair logits with the wrong labels there, so it is an error here."""
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a torch.Tensor; got {type(logits).__name__}")
    vocab_size = lossspec.check_vocab_size_arg(vocab_size)  # None / a float: a clear TypeError, not int()'s
    if logits.ndim == 0 or int(logits.shape[-1]) != vocab_size:
        raise ValueError(
            f"vocab_size must equal the last dimension of logits; got vocab_size={vocab_size} and logits of shape "
            f"{tuple(logits.shape)}"
        )


def _token_labels(logits: Tensor, targets: Tensor) -> Tensor:
    """``targets`` on the logits' device in the logits' leading shape ``[...]`` when they hold one
    label per logits row (``ForCausalLMLoss`` flattens both); otherwise unchanged, so that
    ``torchloss.cross_entropy`` reports the shape mismatch with its own error."""
    targets = targets.to(logits.device)
    leading = logits.shape[:-1]
    if targets.shape != leading and targets.numel() == leading.numel():
        return targets.reshape(leading)
    return targets


def _denominator(num_items_in_batch: NumItems, device: torch.device) -> NumItems:
    """``num_items_in_batch`` as ``torchloss``' ``denominator=``: a number as is; a tensor with one
    element as a 0-d tensor (``Trainer`` hands a ``[1]`` one to each ``DataParallel`` replica), on
    the logits' device unless it is on the CPU (read there without a device synchronisation)."""
    if not isinstance(num_items_in_batch, Tensor):
        return num_items_in_batch
    count = num_items_in_batch.detach()
    if count.numel() == 1:
        count = count.reshape(())
    if count.device != device and count.device.type != "cpu":
        count = count.to(device)
    return count


def for_causal_lm_loss(
    logits: Tensor,
    labels: Optional[Tensor],
    vocab_size: int,
    num_items_in_batch: NumItems = None,
    ignore_index: int = -100,
    shift_labels: Optional[Tensor] = None,
    **kwargs: Any,
) -> Tensor:
    """``transformers``' ``ForCausalLMLoss`` computed by :func:`torchloss.cross_entropy`.

    With ``logits [..., T, V]`` (``V == vocab_size``) and targets ``y [..., T]``: ``y =
    shift_labels`` when given (already aligned with the logits, used as is), else the labels shifted
    left by one, ``y[..., t] = labels[..., t + 1]``, the last position ``ignore_index``. Valid tokens
    are those with ``y != ignore_index``, ``l_i = lse(x_i) - x_i[y_i]`` in fp32 and::

        loss = sum_valid l_i / num_items_in_batch     if num_items_in_batch is given (int or tensor)
        loss = sum_valid l_i / (number of valid tokens) otherwise

    Under gradient accumulation ``num_items_in_batch`` is the valid count of all micro-batches of the
    optimizer step (as ``Trainer`` passes it), so the micro-batch losses add up to the step's mean.

    Args:
      logits: ``[..., V]`` fp32/bf16/fp16 (fp64 computed in fp64). Not upcast or copied: the
        kernel reads any float dtype, computes in fp32 and rounds the gradient once to the logits'
        dtype, the numbers ``ForCausalLMLoss`` gets from its ``logits.float()`` copy.
      labels: integer ``[...]``, unused when ``shift_labels`` is given (may then be ``None``).
      vocab_size: must equal ``logits.shape[-1]`` (``ValueError`` otherwise).
      num_items_in_batch: the denominator: ``None``, a number, or a one-element tensor.
      ignore_index: the label of tokens that are not scored (also the shift's padding).
      shift_labels: pre-shifted targets (e.g. from a padding-free collator), as in ``transformers``.
      **kwargs: whatever else the model's forward passes on (attention kwargs, ``output_*``
        flags ...); ignored, as ``ForCausalLMLoss`` ignores them.

    Returns:
      the 0-d fp32 loss. Differs from ``ForCausalLMLoss`` only where that one is not a number:
      with no valid token, or ``num_items_in_batch == 0``, it returns 0 (gradient 0), not NaN.
    """
    del kwargs  # ForCausalLMLoss accepts and drops them too
    _check_vocab_size(logits, vocab_size)
    if shift_labels is None:
        if labels is None:
            raise ValueError("labels must be a tensor when shift_labels is None; got None")
        shift_labels = shift_labels_left(labels, ignore_index)
    targets = _token_labels(logits, shift_labels)
    return cross_entropy(
        logits, targets, ignore_index=ignore_index, denominator=_denominator(num_items_in_batch, logits.device)
    )
