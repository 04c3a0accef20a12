"""The prepare stage of every ``torchloss`` loss and of the fused head (``torchloss.head``):
validation (options, tensors, shapes, dtypes, devices, ``inplace``; value checks where they are
free: CPU tensors outside tracing), then the shifted targets, segment ids and sequence-parallel
window, ``valid`` and the weights, ``D``, the per-token coefficient
``coef = where(D > 0, weight / D, 0)``, the safe labels and the flag for bad values that could
not be checked eagerly; and :func:`finish` (NaN on a bad value, the per-token shape for
``"none"``). The twin of ``jaxloss._prepare``; the rules are lossspec's (docs/DESIGN.md)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor

import lossspec
from lossspec import LossConfig

from .backends import Backend, vocab_parallel as _vocab_parallel
from ._block import compute_dtype

Denominator = Union[int, float, Tensor, None]

_UNSIGNED = {torch.uint8, getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None)}


# ----------------------------------------------------------------------------------------------
# 1. Validation
# ----------------------------------------------------------------------------------------------


def _dtype_kind(dtype: torch.dtype) -> str:
    """numpy's ``dtype.kind`` of a torch dtype (what :func:`lossspec.meta` expects)."""
    if dtype == torch.bool:
        return "b"
    if dtype.is_complex:
        return "c"
    if dtype.is_floating_point:
        return "f"
    return "u" if dtype in _UNSIGNED else "i"


def array_meta(tensor: Tensor) -> lossspec.ArrayMeta:
    return lossspec.meta(tensor.shape, _dtype_kind(tensor.dtype), str(tensor.dtype).removeprefix("torch."))


def require_tensor(name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    return value


def host_readable(*tensors: Optional[Tensor]) -> bool:
    """Values can be read without a device synchronisation: CPU tensors, outside tracing."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or t.device.type == "cpu" for t in tensors)


def to_numpy(tensor: Tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()  # numpy has no bfloat16; the conversion is exact
    return tensor.numpy()


def broadcast_mask(loss_mask: Optional[Tensor], lead: tuple[int, ...]) -> Optional[Tensor]:
    """A ``loss_mask`` that broadcasts to the leading shape ``lead`` (``[T]``, ``[B, T, 1]``;
    ``lossspec.mask_broadcasts``, checked before) as a view of that shape (no copy)."""
    if loss_mask is None or tuple(loss_mask.shape) == lead:
        return loss_mask
    return loss_mask.reshape(lossspec.squeezed_mask_shape(tuple(loss_mask.shape), lead)).expand(lead)


def check_device(name: str, tensor: Optional[Tensor], device: torch.device) -> None:
    if tensor is not None and tensor.device != device:
        raise ValueError(f"{name} must be on the device of logits ({device}); got {tensor.device}")


def check_process_group(group: Any, name: str = "vocab_parallel") -> None:
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"{name} must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD or dist.new_group(...)); "
            f"got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(f"{name} needs an initialised default process group (dist.init_process_group)")


def _check_no_functorch(*tensors: Optional[Tensor]) -> None:
    """torch.func transforms (grad, vmap, jacrev, ...) wrap tensors in a way the fused kernels
    cannot read: a clear error instead of 'Cannot access data pointer'. Not asked while Dynamo
    traces (the query is opaque to it; compiled code calls the custom op, not the kernels)."""
    if torch.compiler.is_compiling():
        return
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    if wrapped is not None and any(t is not None and wrapped(t) for t in tensors):
        raise NotImplementedError(
            "torchloss losses do not support torch.func transforms (torch.func.grad, vmap, jacrev, ...): their "
            "gradient is computed by a fused kernel in the forward. Use loss.backward() or torch.autograd.grad, "
            "and a Python loop (or a batch dimension) instead of vmap"
        )


def _check_inplace(logits: Tensor, need_grad: bool) -> None:
    """``inplace=True`` overwrites the logits with their gradient: never a leaf's storage (the
    messages: :func:`lossspec.inplace_refusal`)."""
    if not need_grad:
        return
    base = logits
    while base is not None:
        if base.is_leaf and base.requires_grad:
            raise lossspec.inplace_refusal("leaf", "a leaf tensor" if base is logits else "a view of a leaf tensor")
        base = base._base
    if not logits.is_contiguous():
        raise lossspec.inplace_refusal("contiguous")


@dataclasses.dataclass
class Call:
    """One validated call."""

    config: LossConfig
    logits: Tensor
    target: Tensor
    loss_mask: Optional[Tensor]
    segment_ids: Optional[Tensor]
    denominator: Denominator
    sequence_parallel: Any  # a ProcessGroup splitting the time axis, or None
    backend: Backend  # the resolved impl
    kernels: Any  # what the autograd Functions call (forward, regrad_): the backend's module, or a VocabParallel over it
    vocab: int  # the global vocabulary (labels are global ids)
    host: bool  # values readable without a synchronisation
    need_grad: bool
    inplace: bool
    tuning: lossspec.Tuning = lossspec.DEFAULT_TUNING  # the block and tile sizes (lossspec.tuning)


def validate(
    config: LossConfig,
    logits: Any,
    target: Any,
    loss_mask: Any,
    segment_ids: Any,
    denominator: Denominator,
    vocab_parallel: Any,
    sequence_parallel: Any,
    backend: Backend,
    inplace: bool,
    tuning: Optional[lossspec.Tuning] = None,
) -> Call:
    """The checks of one call (its ``impl`` resolved by the caller: :func:`torchloss.backends.resolve`)."""
    is_ce = config.has_labels
    target_name = "labels" if is_ce else "teacher_logits"
    tuning = lossspec.check_tuning(tuning)
    logits = require_tensor("logits", logits)
    if config.has_target:
        target = require_tensor(target_name, target)
        target_meta: Optional[lossspec.ArrayMeta] = array_meta(target)
    else:
        # No target (entropy): an empty [..., 0] stand-in carries the leading shape through the
        # shared steps at no cost; the backends never read it.
        target = logits.new_empty(tuple(logits.shape[:-1]) + (0,)).detach()
        target_meta = None
    if loss_mask is not None:
        loss_mask = require_tensor("loss_mask", loss_mask)
    if segment_ids is not None:
        segment_ids = require_tensor("segment_ids", segment_ids)
    lossspec.check_inputs(
        config, array_meta(logits), target_meta, None if loss_mask is None else array_meta(loss_mask), None if segment_ids is None else array_meta(segment_ids)
    )
    loss_mask = broadcast_mask(loss_mask, tuple(logits.shape[:-1]))
    lossspec.check_denominator_allowed(config, denominator)
    if isinstance(denominator, Tensor):
        lossspec.check_denominator_type(denominator, array_meta(denominator))  # not bool, not complex
        lossspec.check_denominator_shape(tuple(denominator.shape))
    elif denominator is not None:
        lossspec.check_denominator_type(denominator)
    lossspec.check_inplace(inplace)
    _check_no_functorch(logits, target, loss_mask)
    device = logits.device
    check_device(target_name, target, device)
    check_device("loss_mask", loss_mask, device)
    check_device("segment_ids", segment_ids, device)
    if isinstance(denominator, Tensor) and denominator.device != device and denominator.device.type != "cpu":
        raise ValueError(f"denominator must be on the device of logits ({device}) or the CPU; got {denominator.device}")
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    if inplace:
        _check_inplace(logits, need_grad)
    kernels: Any = backend.kernels()  # imported here: an ImportError (no triton) after the checks above
    vocab = int(logits.shape[-1])
    if vocab_parallel is not None:
        check_process_group(vocab_parallel)
        offset, vocab = _vocab_parallel.shard_offset(vocab, vocab_parallel, device)
        kernels = _vocab_parallel.VocabParallel(vocab_parallel, offset, vocab, kernel=backend.shard_kernels())
    if sequence_parallel is not None:
        check_process_group(sequence_parallel, "sequence_parallel")
        lossspec.check_sequence_parallel_axis(tuple(logits.shape[:-1]))
    host = host_readable(logits, target, loss_mask, segment_ids, denominator if isinstance(denominator, Tensor) else None)
    return Call(
        config, logits, target, loss_mask, segment_ids, denominator, sequence_parallel, backend, kernels, vocab, host, need_grad, inplace, tuning
    )


# ----------------------------------------------------------------------------------------------
# 2. Weights, denominator, coefficients
# ----------------------------------------------------------------------------------------------


def weights_of(
    config: LossConfig,
    labels: Optional[Tensor],
    loss_mask: Optional[Tensor],
    lead: tuple[int, ...],
    device: torch.device,
    acc: torch.dtype,
    segment_ids: Optional[Tensor] = None,
    ignore_matches: bool = True,
) -> tuple[Tensor, Tensor]:
    """``(valid, weight)``: valid tokens (mask non-zero, segment id ``>= 0`` and label !=
    ignore_index, where the labels' dtype can hold it: ``ignore_matches``) and their weights in
    ``acc`` (0 where invalid). The mask is data: no gradient flows to it."""
    valid = torch.ones(lead, dtype=torch.bool, device=device)
    if loss_mask is not None:
        valid = valid & (loss_mask != 0)
    if labels is not None and ignore_matches:
        valid = valid & (labels != config.ignore_index)
    if segment_ids is not None:
        valid = valid & (segment_ids >= 0)
    if loss_mask is not None and loss_mask.dtype != torch.bool:
        return valid, torch.where(valid, loss_mask.detach().to(acc), 0.0)
    return valid, valid.to(acc)


def bad_weights(loss_mask: Tensor) -> Tensor:
    """On-device twin of ``lossspec.check_weights`` (0-d bool): a negative, non-finite,
    non-finite-in-float32 or subnormal weight, or float32 weights whose sum (in float64)
    overflows float32."""
    w = loss_mask.detach().to(torch.float64)
    w32 = loss_mask.detach().to(torch.float32).to(torch.float64)
    bad = (~torch.isfinite(w) | (w < 0) | ~torch.isfinite(w32) | ((w32 > 0) & (w32 < lossspec.FP32_TINY))).any()
    return bad | (w32.sum() > lossspec.FP32_MAX)


_UINT64 = getattr(torch, "uint64", None)


def labels_int64(labels: Tensor) -> Tensor:
    """Labels as int64 for comparisons. ATen has no uint64 comparison on the CPU, so uint64
    labels are their bits read as int64: values from 2**63 read negative, out of ``[0, V)``
    either way, and the host check reads them back as uint64 (:func:`ignore_index_matches` keeps a
    negative ``ignore_index`` from matching them: no wrapping)."""
    if labels.dtype == _UINT64:
        return labels.view(torch.int64)
    return labels.to(torch.int64)


def ignore_index_matches(labels: Optional[Tensor], ignore_index: int) -> bool:
    """Whether a label of ``labels``' dtype can equal ``ignore_index`` after
    :func:`labels_int64` (``lossspec.ignore_index_in_dtype``; only uint64's int64 view could
    otherwise match a negative one)."""
    return labels is None or labels.dtype != _UINT64 or lossspec.ignore_index_in_dtype(ignore_index, "uint64")


@dataclasses.dataclass
class Prepared:
    target: Tensor  # safe labels [N] int64 / teacher logits [N, V]
    coef: Tensor  # [N] in the compute dtype
    bad: Optional[Tensor]  # deferred value check failed (0-d bool), None where checked eagerly


def shift_left(values: Tensor, fill: Union[int, float, bool]) -> Tensor:
    """``out[..., t] = values[..., t + 1]``, ``out[..., T - 1] = fill`` (``lossspec.shift_left``)."""
    pad = values.new_full(tuple(values.shape[:-1]) + (min(values.shape[-1], 1),), fill)
    return torch.cat([values[..., 1:], pad], dim=-1)


def scored_targets(
    causal_shift: bool, labels: Optional[Tensor], loss_mask: Optional[Tensor], lead: tuple[int, ...], device: torch.device
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(labels, loss_mask)`` of the scored positions: as given, or with ``causal_shift`` both
    shifted left by one along time with a weight-0 last position (``lossspec.causal``). Only
    these ``[..., T]`` tensors are shifted, never the logits."""
    if not causal_shift:
        return labels, loss_mask
    if loss_mask is None:
        loss_mask = torch.ones(lead, dtype=torch.bool, device=device)
    return (None if labels is None else shift_left(labels, 0)), shift_left(loss_mask.detach(), 0)


def scored_segment_ids(
    config: LossConfig, segment_ids: Optional[Tensor], lead: tuple[int, ...], device: torch.device
) -> Optional[Tensor]:
    """The int64 ids of the scored positions (``lossspec.scored_segment_ids``): as given (zeros,
    one sequence per row, for the sequence modes without ids), or with ``causal_shift``
    ``ids[t + 1]`` where ``ids[t] == ids[t + 1]``, else -1 (never across a document boundary).
    ``None`` when neither given nor needed."""
    if segment_ids is None:
        if not config.per_sequence:
            return None
        segment_ids = torch.zeros(lead, dtype=torch.int64, device=device)
    ids = _signed_ids(segment_ids.detach())
    if not config.causal_shift:
        return ids
    following = shift_left(ids, -1)
    return torch.where(ids == following, following, -1)


def _signed_ids(ids: Tensor) -> Tensor:
    """``ids`` as int64 with the same sequences and padding (``lossspec.signed_segment_ids``):
    as they are, except uint64 ids, which int64 would wrap (``2**63`` and up would become
    padding): those are their ranks among the tensor's distinct ids (sort-based, on the device;
    an unsigned id is never padding)."""
    if ids.dtype != getattr(torch, "uint64", None):
        return ids.to(torch.int64)
    # Flipping the sign bit maps uint64 onto int64 in order (sorts of int64 run on every device).
    flat = ids.reshape(-1).view(torch.int64) ^ torch.iinfo(torch.int64).min
    sorted_ids, order = torch.sort(flat, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    ranks = torch.empty_like(flat).scatter_(0, order, torch.cumsum(starts, dim=0) - 1)
    return ranks.reshape(ids.shape)


def _sequence_sums(weight: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(n, first)`` ``[..., T]``: per token, the weight sum ``n_s`` of its sequence (the
    ``(row, id)`` pair; ``lossspec.sequence_weight_sums``), and whether it is the first position
    of its sequence (id ``>= 0``). Sort-based, no host synchronisation: the ids of each row are
    sorted (stably), numbered by group, and the weights summed per group with ``scatter_add``
    (each sum rounds like a plain sum of the sequence's weights, whatever the row's total)."""
    shape, time = weight.shape, weight.shape[-1]
    rows_w, rows_ids = weight.reshape(-1, time), ids.reshape(-1, time)
    sorted_ids, order = torch.sort(rows_ids, dim=-1, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    inverse = torch.argsort(order, dim=-1)
    group = (torch.cumsum(starts, dim=-1) - 1).gather(1, inverse)  # the sequence's number in its row
    sums = torch.zeros_like(rows_w).scatter_add_(1, group, rows_w)
    first = starts.gather(1, inverse) & (rows_ids >= 0)  # stable sort: the group's first is its earliest position
    return sums.gather(1, group).reshape(shape), first.reshape(shape)


def sequence_count(weight: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(n, counted)``: :func:`_sequence_sums`' ``n`` and, per position, whether it counts a
    sequence in ``S`` (its first position, for sequences with ``n_s > 0``)."""
    n, first = _sequence_sums(weight, ids)
    return n, first & (n > 0)


@dataclasses.dataclass(frozen=True)
class _TimeWindow:
    """This rank's slice ``[offset, offset + length)`` of the time axis of ``total`` positions."""

    offset: int
    length: int
    total: int

    def take(self, values: Tensor) -> Tensor:
        return values[..., self.offset : self.offset + self.length]


def _time_window(group: Any, length: int, device: torch.device) -> tuple[_TimeWindow, list[int]]:
    """This rank's window and every rank's slice length (an ``all_gather`` of the lengths; one
    host read, as for the vocabulary shards). Slices are contiguous, in rank order; lengths may differ."""
    import torch.distributed as dist

    mine = torch.tensor([length], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, mine, group=group)
    lengths = [int(size.item()) for size in sizes]
    rank = dist.get_rank(group)
    return _TimeWindow(sum(lengths[:rank]), length, sum(lengths)), lengths


def _gather_time(values: Optional[Tensor], group: Any, lengths: list[int]) -> Optional[Tensor]:
    """``[..., T_local]`` -> ``[..., T]``: the group's slices concatenated along time, in rank
    order (padded to the longest slice for the ``all_gather``). Booleans travel as uint8 and
    float weights as float64 (exact); the values come back in their dtype."""
    import torch.distributed as dist

    if values is None:
        return None
    values = values.detach()
    dtype = values.dtype
    wire = values.to(torch.uint8) if dtype == torch.bool else values.to(torch.float64) if dtype.is_floating_point else values
    longest = max(lengths)
    padded = torch.nn.functional.pad(wire, (0, longest - wire.shape[-1])) if wire.shape[-1] < longest else wire.contiguous()
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded, group=group)
    full = torch.cat([part[..., :length] for part, length in zip(parts, lengths)], dim=-1)
    return full.to(dtype)


def full_rows(
    group: Any, arrays: tuple[Optional[Tensor], ...], lead: tuple[int, ...], device: torch.device
) -> tuple[tuple[Optional[Tensor], ...], tuple[int, ...], Optional[_TimeWindow]]:
    """Under ``sequence_parallel`` the ``[..., T_local]`` ``arrays`` (labels, mask, ids) of the
    whole rows, the rows' leading shape and this rank's window; otherwise as given (window None)."""
    if group is None:
        return arrays, lead, None
    window, lengths = _time_window(group, lead[-1], device)
    return tuple(_gather_time(a, group, lengths) for a in arrays), lead[:-1] + (window.total,), window


def _denominator(config: LossConfig, denominator: Denominator, weight: Tensor, counted: Optional[Tensor], lead: tuple[int, ...], acc: torch.dtype) -> Union[Tensor, float]:
    """``D`` (``S`` for the sequence modes): the given one, else this call's own count."""
    if isinstance(denominator, Tensor):
        return denominator.detach().to(device=weight.device, dtype=acc).reshape(())
    if denominator is not None:
        return float(denominator)
    if config.normalization == "valid_tokens":
        return weight.sum()
    if config.normalization == "tokens":
        return float(lossspec.scored_positions(lead, config.causal_shift))
    if config.per_sequence:
        assert counted is not None
        return counted.sum().to(acc)
    return 1.0


def _coefficients(config: LossConfig, weight: Tensor, n: Optional[Tensor], denom: Union[Tensor, float]) -> Tensor:
    """``coef = where(D > 0, weight / D, 0)``; ``"sequence_mean"`` divides by ``n_s`` too
    (``w_t / (n_s D)``, 0 where ``w_t == 0``). The only place ``D`` and ``n_s`` enter: runtime data
    for the kernels. ``D == 0`` gives loss 0 and gradient 0."""
    if config.normalization == "sequence_mean":
        assert n is not None
        weight = torch.where(weight > 0, weight / torch.where(n > 0, n, 1.0), 0.0)
    if isinstance(denom, Tensor):
        return torch.where(denom > 0, weight / torch.where(denom > 0, denom, 1.0), 0.0)
    return weight / denom if denom > 0 else torch.zeros_like(weight)


def prepare(call: Call) -> Prepared:
    config, logits = call.config, call.logits
    is_ce = config.has_labels
    lead = tuple(logits.shape[:-1])
    rows = math.prod(lead)
    acc = compute_dtype(logits.dtype)
    device = logits.device
    # Under sequence_parallel: the whole rows' labels, mask and ids (lossspec.sequences); the
    # coefficients are computed on them and this rank keeps its window.
    (labels, loss_mask, segment_ids), full_lead, window = full_rows(
        call.sequence_parallel, (labels_int64(call.target) if is_ce else None, call.loss_mask, call.segment_ids), lead, device
    )
    labels, loss_mask = scored_targets(config.causal_shift, labels, loss_mask, full_lead, device)
    ids = scored_segment_ids(config, segment_ids, full_lead, device)
    ignore_matches = ignore_index_matches(call.target if is_ce else None, config.ignore_index)
    valid, weight = weights_of(config, labels, loss_mask, full_lead, device, acc, ids, ignore_matches)
    float_mask = loss_mask is not None and loss_mask.dtype != torch.bool
    denominator = call.denominator
    if denominator is not None and not isinstance(denominator, Tensor) and torch.compiler.is_compiling():
        # Traced, a Python number that changes between calls is a symbolic float: reading it on
        # the host (the value check's np.asarray) would specialise the graph to each value (a
        # recompile per value, FailOnRecompileLimitHit under fullgraph=True). As a 0-d float64
        # tensor it is runtime data, checked on the device like a denominator tensor (NaN loss).
        denominator = torch.full((), denominator, dtype=torch.float64, device=device)
    # Value checks where they are free (SPEC section 5), in the oracle's order.
    if denominator is not None and (call.host or not isinstance(denominator, Tensor)):
        lossspec.check_denominator_value(to_numpy(denominator) if isinstance(denominator, Tensor) else denominator)
    if call.host and float_mask:
        lossspec.check_weights(to_numpy(loss_mask))
    in_range = None
    if labels is not None:
        in_range = (labels >= 0) & (labels < call.vocab)
        if call.host:
            host_labels = to_numpy(labels)
            if call.target.dtype == _UINT64:
                host_labels = host_labels.view(np.uint64)  # the given values, not their int64 view
            lossspec.check_labels(host_labels, to_numpy(valid), call.vocab, config.causal_shift)
    bad = None
    if not call.host:
        bad = torch.zeros((), dtype=torch.bool, device=device)
        if in_range is not None:
            bad = bad | (valid & ~in_range).any()
        if float_mask:
            bad = bad | bad_weights(loss_mask)
    if config.normalization == "none":
        coef = weight
    else:
        n, counted = sequence_count(weight, ids) if config.per_sequence else (None, None)  # type: ignore[arg-type]
        denom = _denominator(config, denominator, weight, counted, full_lead, acc)
        if isinstance(denom, Tensor) and isinstance(denominator, Tensor) and bad is not None:
            # the on-device twin of lossspec.check_denominator_value, on the value as given (a
            # float64 one below the float32 range must not pass as 0) and as used in float32
            given = denominator.detach().reshape(()).to(device)
            out_of_range = (given != 0) & ((given < lossspec.FP32_TINY) | (given > lossspec.FP32_MAX))
            bad = bad | ~torch.isfinite(denom) | ~(given >= 0) | out_of_range
        coef = _coefficients(config, weight, n, denom)
    if bad is not None:
        # A value that could not be checked on the host and is bad makes every coefficient NaN:
        # the loss and the whole gradient are NaN (as in JAX under jit), never a plausible
        # gradient that a step using only the gradient would train on.
        coef = torch.where(bad, float("nan"), coef)
    if window is not None:
        coef, valid = window.take(coef), window.take(valid)
        labels = None if labels is None else window.take(labels)
        in_range = None if in_range is None else window.take(in_range)
    if is_ce:
        assert labels is not None and in_range is not None
        target = torch.where(valid & in_range, labels, 0).reshape(rows)
    else:
        # The teacher gets no gradient (entropy's stand-in is [..., 0]).
        target = call.target.detach().reshape(rows, int(call.target.shape[-1]))
        if target.stride(-1) != 1:
            target = target.contiguous()
    return Prepared(target, coef.reshape(rows), bad)




def finish(call: Call, prepared: Prepared, loss: Tensor) -> Tensor:
    if prepared.bad is not None:
        loss = loss + torch.where(prepared.bad, float("nan"), 0.0).to(loss.dtype)
    if call.config.normalization == "none":
        return loss.reshape(call.logits.shape[:-1])
    return loss
