"""Exact global normalisation in torch: global denominators and micro-batch accumulation.

The two-pass step of SPEC section 4::

    D = all_reduce(sum_k count_denominator(microbatch_k), SUM, group)   # pass 1: count
    for k: loss_fn(model, microbatch_k, D).backward()                   # pass 2: compute
    grads: summed over replicas (DDP averages: D is divided by world_size to compensate)

gives the loss and gradients of the whole batch on one device, whatever the split into
micro-batches and data-parallel replicas. Tensor/vocab-parallel groups are never part of the
counting group: their replicas hold the same tokens and would be counted twice.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

import lossspec
from lossspec.accumulation import check_accumulation  # noqa: F401 - the hand-written loop's check, re-exported

from .api import count_denominator

LossFn = Callable[[torch.nn.Module, Any, Any], torch.Tensor]


def global_denominator(
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    *,
    normalization: str = "valid_tokens",
    ignore_index: int = -100,
    group: dist.ProcessGroup | None = None,
    causal_shift: bool = False,
    segment_ids: torch.Tensor | None = None,
    sequence_parallel: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``D`` of the global batch: the count of every token given (stacked micro-batches count
    too, since counts add up), ``all_reduce``-d (SUM) over the data-parallel ``group`` when one is
    given. fp32 0-d tensor on the inputs' device; no host synchronisation except one read of the
    slice lengths under ``sequence_parallel``. ``causal_shift``, ``segment_ids`` and
    ``sequence_parallel``: as in :func:`torchloss.count_denominator`; with ``sequence_parallel``
    the count is this rank's share, and ``group`` must hold every rank with different tokens (the
    data-parallel and sequence-parallel ranks together).
    """
    count = count_denominator(
        labels,
        loss_mask,
        normalization=normalization,
        ignore_index=ignore_index,
        causal_shift=causal_shift,
        segment_ids=segment_ids,
        sequence_parallel=sequence_parallel,
    )
    if group is not None:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count


def _leaves(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [leaf for value in batch.values() for leaf in _leaves(value)]
    if isinstance(batch, (list, tuple)):
        return [leaf for value in batch for leaf in _leaves(value)]
    raise TypeError(f"batch must be a tensor, a dict or a list/tuple of tensors; got {type(batch).__name__}")


def _split(batch: Any, sizes: tuple[int, ...]) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, list(sizes)))
    if isinstance(batch, dict):
        parts = {key: _split(value, sizes) for key, value in batch.items()}
        return [{key: parts[key][k] for key in batch} for k in range(len(sizes))]
    parts = [_split(value, sizes) for value in batch]
    return [type(batch)(part[k] for part in parts) for k in range(len(sizes))]


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor of ``batch`` (a tensor, a dict, or a list/tuple of them) along dim 0
    into ``num_microbatches`` contiguous parts (views), sized by ``lossspec.microbatch_sizes``:
    as ``numpy.array_split``, the first ``B % K`` parts get one more row (10 rows in 4:
    3, 3, 2, 2). Every tensor needs the same leading size ``B``."""
    lossspec.check_num_microbatches(num_microbatches)
    rows = lossspec.batch_rows(tuple(leaf.shape) for leaf in _leaves(batch))
    return _split(batch, lossspec.microbatch_sizes(rows, num_microbatches))


def _default_count_fn(
    normalization: str,
    ignore_index: int,
    labels_key: str,
    mask_key: str,
    causal_shift: bool = False,
    segment_ids_key: str = "segment_ids",
    sequence_parallel: dist.ProcessGroup | None = None,
) -> Callable[[Any], torch.Tensor]:
    def count(microbatch: Any) -> torch.Tensor:
        if not isinstance(microbatch, dict):
            raise TypeError("accumulate needs count_fn= unless the batch is a dict with labels/loss_mask entries")
        labels, mask, ids = microbatch.get(labels_key), microbatch.get(mask_key), microbatch.get(segment_ids_key)
        if labels is None and mask is None:
            raise ValueError(f"the batch has neither {labels_key!r} nor {mask_key!r}; pass count_fn= to count it")
        if causal_shift:
            lossspec.check_shifted_microbatch(tuple((labels if labels is not None else mask).shape))
        return count_denominator(
            labels,
            mask,
            normalization=normalization,
            ignore_index=ignore_index,
            causal_shift=causal_shift,
            segment_ids=ids,
            sequence_parallel=sequence_parallel,
        )

    return count


def accumulate(
    loss_fn: LossFn,
    model: torch.nn.Module,
    batch: Any,
    *,
    num_microbatches: int,
    normalization: str = "valid_tokens",
    ignore_index: int = -100,
    count_fn: Callable[[Any], torch.Tensor] | None = None,
    group: dist.ProcessGroup | None = None,
    labels_key: str = "labels",
    mask_key: str = "loss_mask",
    causal_shift: bool = False,
    segment_ids_key: str = "segment_ids",
    sequence_parallel: dist.ProcessGroup | None = None,
    check: str = "off",
) -> torch.Tensor:
    """Run one optimizer step's forward and backward passes over micro-batches (and replicas),
    leaving the full-batch gradients in ``param.grad``.

    Args:
      loss_fn: ``loss_fn(model, microbatch, denominator) -> scalar``: the user's forward and loss,
        which passes ``denominator=denominator`` to a ``torchloss`` loss (same ``normalization``).
      model: a plain ``nn.Module`` or a ``DistributedDataParallel`` one.
      batch: a dict (or tensor, list, tuple) of tensors with a leading batch dim ``B``, split by
        :func:`split_microbatches` into ``num_microbatches`` (uneven sizes allowed: the first
        ``B % K`` micro-batches get one more row, ``lossspec.microbatch_sizes``).
      normalization: ``"valid_tokens"`` / ``"tokens"`` (counted over the global batch),
        ``"sequence_mean"`` / ``"sequence_sum"`` (``S`` counted over the global batch; micro-batches
        split rows, so a sequence never spans two) or ``"sum"`` (``D = 1``).
      count_fn: ``count_fn(microbatch) -> count``; default: ``count_denominator`` of the
        ``labels_key``/``mask_key``/``segment_ids_key`` entries of a dict batch (the ids if present).
      causal_shift: the default count counts the shifted positions (``labels[..., 1:]``,
        ``loss_mask[..., 1:]``), as the losses of a ``loss_fn`` that passes ``causal_shift=True``
        score them (e.g. ``labels=input_ids``); the labels/mask need ``[B, ..., T]``. The
        ``loss_fn`` passes ``causal_shift=True`` to its loss itself; a ``count_fn`` counts on its own.
      segment_ids_key: the dict entry of the packed documents' ids (``lossspec.sequences``), if any.
      sequence_parallel: the ``ProcessGroup`` splitting the time axis (context parallelism), for the
        default count: each rank counts its share. The ``loss_fn`` passes ``sequence_parallel=`` to its
        loss itself, and ``group`` (or DDP's group) must then hold the data- and sequence-parallel
        ranks together (every rank with different tokens): counts, losses and gradients are summed over it.
      group: the data-parallel process group. With DDP it defaults to the model's group and
        DDP's averaging is undone in the denominator (``D / world_size``), never by scaling
        anything else; ``no_sync`` skips the all-reduce of all but the last micro-batch. With a
        plain module and a ``group``, the gradients are all-reduced (SUM) after the last
        micro-batch.
      check: ``"off"`` (default), ``"warn"`` or ``"raise"``: check the step's loss and count calls
        for the mistakes that give a plausible but wrong result (``lossspec.accumulation``): a loss
        called without ``denominator=`` (each micro-batch normalised locally: about ``K`` times too
        large), a count whose ``causal_shift`` or normalisation differs from the loss's. Warns
        (``RuntimeWarning``) or raises a ``ValueError`` naming each one.

    Returns:
      The full-batch loss (a detached fp32 0-d tensor: the sum over micro-batches and
      replicas, never a mean of means), the same on every replica.
    """
    lossspec.check_normalization(normalization)
    causal_shift = lossspec.check_causal_shift(causal_shift)
    # Checked: the step's loss and count calls recorded (at trace time under jit) and read at the end.
    return lossspec.accumulation.run_checked(
        lambda: _accumulate(
            loss_fn, model, batch, num_microbatches, normalization, ignore_index, count_fn, group,
            labels_key, mask_key, causal_shift, segment_ids_key, sequence_parallel,
        ),
        check, normalization, "accumulate",
    )


def _accumulate(
    loss_fn: LossFn,
    model: torch.nn.Module,
    batch: Any,
    num_microbatches: int,
    normalization: str,
    ignore_index: int,
    count_fn: Callable[[Any], torch.Tensor] | None,
    group: dist.ProcessGroup | None,
    labels_key: str,
    mask_key: str,
    causal_shift: bool,
    segment_ids_key: str,
    sequence_parallel: Any,
) -> torch.Tensor:
    """The body of :func:`accumulate` (arguments checked)."""
    if normalization == "none":
        raise ValueError("accumulate needs a scalar loss: normalization must be 'valid_tokens', 'tokens' or 'sum', not 'none'")
    is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if is_ddp and group is None:
        group = model.process_group
    world_size = dist.get_world_size(group) if group is not None else 1
    microbatches = split_microbatches(batch, num_microbatches)
    if normalization in lossspec.COUNTED_NORMALIZATIONS:
        count = count_fn or _default_count_fn(
            normalization, ignore_index, labels_key, mask_key, causal_shift, segment_ids_key, sequence_parallel
        )
        denominator = torch.stack([count(mb).float().reshape(()) for mb in microbatches]).sum()
        if group is not None:
            dist.all_reduce(denominator, op=dist.ReduceOp.SUM, group=group)
    else:
        device = next(iter(model.parameters())).device
        denominator = torch.ones((), dtype=torch.float32, device=device)
    if is_ddp:
        # DDP divides the summed gradients by world_size: a world_size-times smaller D undoes it.
        denominator = denominator / world_size
    total = torch.zeros((), dtype=torch.float32, device=denominator.device)
    for index, microbatch in enumerate(microbatches):
        last = index == len(microbatches) - 1
        sync = contextlib.nullcontext() if (not is_ddp or last) else model.no_sync()
        with sync:
            loss = loss_fn(model, microbatch, denominator)
            loss.backward()
        total = total + loss.detach().float()
    if is_ddp:
        total = total / world_size  # each replica's share of the global loss
    elif group is not None:
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total
