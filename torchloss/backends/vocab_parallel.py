"""Vocab-parallel losses (``vocab_parallel=<ProcessGroup>``): the vocabulary is split over the
ranks of a group in contiguous shards in rank order (sizes may differ).

Each rank holds ``x [N, V_local]`` (and the teacher's matching slice; labels are global ids).
One call is three steps, every collective explicit (never autograd through one), the twin of
``jaxloss.backends.vocab_parallel``::

    1. local statistics of the shard       _block.block_stats per row tile / the Triton
                                           kernel's shard-stats job
    2. combine over the group              all_gather of the maxima (and reverse KL's pivots:
                                           the first shard holding the maximum supplies it),
                                           rescale to them, one all_reduce(SUM) of the sums
    3. finalize, then this shard's grad    the same Final on every rank; _block.block_grad /
                                           the Triton kernel's shard-grad job

``jensen_shannon`` adds a step between 2 and 3 (:func:`mixture_shards`): its mixture sums need
the global ``lse``'s, so each shard sums its terms and one more ``all_reduce`` adds them.

The algebra is that of :mod:`lossspec.stats`: shards are blocks of one row, combined exactly as
the online softmax combines vocabulary blocks. NaN / ``+inf`` rows need no flag of their own:
they make the owning shard's ``s`` (or ``st``) NaN, the sum carries it to every rank, and
finalize marks the row bad there (NaN loss, NaN gradient on every shard).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor

from lossspec import LossConfig, Tuning

from . import cpu_tiles as _cpu
from .. import _block
from .._block import compute_dtype

# The Stats fields that are sums over the vocabulary (summed once rescaled to the global maxima).
SUM_FIELDS = _block.stats.SUM_STATS


def shard_offset(vocab_local: int, group: Any, device: torch.device) -> tuple[int, int]:
    """``(offset, global V)`` of this rank's contiguous shard: an ``all_gather`` of the local
    vocabulary sizes (shards in rank order; sizes may differ)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.tensor([vocab_local], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=group)
    counts = [int(s.item()) for s in sizes]  # one host read (a synchronisation off the CPU)
    return sum(counts[:rank]), sum(counts)


def _tile_rows(rows: int, width: int, device: torch.device, tuning: Optional[Tuning]) -> int:
    return max(1, min(rows, _cpu.tile_elements(device, 1, tuning) // max(1, width)))


def local_stats(config: LossConfig, x: Tensor, target: Tensor, coef: Tensor, offset: int, tuning: Optional[Tuning] = None) -> Any:
    """Step 1 on this rank's shard (global ids ``[offset, offset + V_local)``), no collective:
    :class:`_block.Stats` ``[N]`` relative to the shard's maxima; ``x_y`` is the label's raw
    logit where this shard owns the label, else 0."""
    rows, width = x.shape
    acc = compute_dtype(x.dtype)
    is_ce = config.has_labels
    tile_rows = _tile_rows(rows, width, x.device, tuning)
    parts: dict[int, Any] = {}

    def run(tiles: Iterable[_cpu.Tile]) -> None:
        bufs_flat = [torch.empty(tile_rows * width, dtype=acc, device=x.device) for _ in range(_block.buffers_needed(config.kind))]
        with torch.no_grad():
            for r0, r1, _ in tiles:
                n = r1 - r0
                x_y = None
                if is_ce:
                    local = target[r0:r1] - offset
                    owned = (local >= 0) & (local < width)
                    picked = x[r0:r1].gather(1, local.clamp(0, width - 1)[:, None])[:, 0].to(acc)
                    x_y = torch.where(owned, picked, 0.0)
                bufs = [f[: n * width].view(n, width) for f in bufs_flat]
                tb = target[r0:r1] if config.is_distill else None
                parts[r0], _ = _block.block_stats(config, x[r0:r1], tb, bufs, x_y=x_y)

    tiles = _cpu.row_tiles(rows, tile_rows)
    _cpu.map_tiles(run, tiles, x.device)
    ordered = [parts[r0] for r0, _, _ in tiles]
    return _block.Stats(**{name: torch.cat([getattr(p, name) for p in ordered]) for name in ordered[0]._fields if getattr(ordered[0], name) is not None})


def combine_shards(config: LossConfig, local: Any, group: Any) -> Any:
    """Step 2: the statistics of the whole row, identical on every rank: one ``all_gather`` of
    the shards' maxima (and pivots), one ``all_reduce(SUM)`` of the sums rescaled to the global
    maxima."""
    import torch.distributed as dist

    # A NaN maximum (NaN in the shard) competes as +inf; its NaN sums mark the row bad anyway.
    heads = [torch.where(torch.isnan(local.m), float("inf"), local.m)]
    if local.mt is not None:
        heads.append(torch.where(torch.isnan(local.mt), float("inf"), local.mt))
    if local.tau is not None:
        heads.append(local.tau)
    mine = torch.stack(heads)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    every = torch.stack(gathered)  # [P, fields, N], shards in rank order
    m = every[:, 0].amax(dim=0)
    mt = every[:, 1].amax(dim=0) if local.mt is not None else None
    glob = _block.rescale(config, local, m, mt)
    if local.tau is not None:
        # The pivot of the first shard (in rank order) holding the maximum (lossspec.stats).
        holder = torch.argmax((every[:, 0] == m).to(torch.uint8), dim=0)
        tau = every[:, -1].gather(0, holder[None])[0]
        glob = glob._replace(tau=tau, e_d=_block.rescale_e_d(config, local, m, tau))
    names = [name for name in SUM_FIELDS if getattr(glob, name) is not None]
    sums = torch.stack([getattr(glob, name) for name in names])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return glob._replace(**dict(zip(names, sums.unbind(0))))


def mixture_shard_sums(config: LossConfig, fin: Any, x: Tensor, target: Tensor, tuning: Optional[Tuning] = None) -> Tensor:
    """This shard's :data:`lossspec.MIXTURE_STATS` ``[2, N]`` (``kl_qm``, ``kl_pm``) from the global
    :class:`_block.Final`, no collective, tiled: row tiles of column blocks of at most
    ``_cpu.tile_elements`` entries (``tuning.cpu_tile_elements`` on the CPU) (the sums are plain sums, relative to the global ``lse``'s,
    so blocks simply add), so the fp32 temporaries never grow with the shard's width."""
    rows, width = x.shape
    sums = torch.zeros((2, rows), dtype=fin.s.dtype, device=x.device)
    block = max(1, min(width, _cpu.tile_elements(x.device, 1, tuning)))
    tile_rows = _tile_rows(rows, block, x.device, tuning)

    def run(tiles: Iterable[_cpu.Tile]) -> None:
        with torch.no_grad():
            for r0, r1, _ in tiles:
                part = _block.Final(*(None if v is None else v[r0:r1] for v in fin))
                for v0 in range(0, width, block):
                    v1 = min(width, v0 + block)
                    kl_qm, kl_pm = _block.mixture_sums(config, part, x[r0:r1, v0:v1], target[r0:r1, v0:v1], None)
                    sums[0, r0:r1] += kl_qm
                    sums[1, r0:r1] += kl_pm

    if rows and width:
        _cpu.map_tiles(run, _cpu.row_tiles(rows, tile_rows), x.device)
    return sums


def mixture_shards(config: LossConfig, fin: Any, x: Tensor, target: Tensor, group: Any, tuning: Optional[Tuning] = None) -> Any:
    """``jensen_shannon``'s second pass (``lossspec.stats``): this shard's mixture sums from the
    global ``lse``'s (:func:`mixture_shard_sums`, tiled), one ``all_reduce(SUM)`` of the two
    ``[N]`` sums, then the loss. Both backends use this torch code (it reads the shard once more)."""
    return reduce_mixture(config, fin, mixture_shard_sums(config, fin, x, target, tuning), group)


def reduce_mixture(config: LossConfig, fin: Any, sums: Tensor, group: Any) -> Any:
    """``jensen_shannon``'s loss from this shard's mixture sums ``[2, N]`` (``kl_qm``, ``kl_pm``):
    one ``all_reduce(SUM)`` over the group, then ``lossspec.stats.finalize_mixture``. Shared with
    the fused head (``torchloss.head``)."""
    import torch.distributed as dist

    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return _block.stats.finalize_mixture(torch, config, fin, sums[0], sums[1])


def shard_grad(
    config: LossConfig, fin: Any, x: Tensor, target: Tensor, coef: Tensor, offset: int, vocab: int, out: Tensor,
    tuning: Optional[Tuning] = None,
) -> Tensor:
    """Step 3: this shard's ``coef * c * dl/dz`` from the global :class:`_block.Final` (no
    collective), written into ``out`` and rounded once to its dtype. Labels are global ids."""
    rows, width = x.shape
    acc = compute_dtype(x.dtype)
    is_ce = config.has_labels
    tile_rows = _tile_rows(rows, width, x.device, tuning)

    def run(tiles: Iterable[_cpu.Tile]) -> None:
        bufs_flat = [torch.empty(tile_rows * width, dtype=acc, device=x.device) for _ in range(_block.buffers_needed(config.kind) + 1)]
        with torch.no_grad():
            for r0, r1, _ in tiles:
                n = r1 - r0
                part = _block.Final(*(None if v is None else v[r0:r1] for v in fin))
                bufs = [f[: n * width].view(n, width) for f in bufs_flat]
                tb = target[r0:r1] if config.is_distill else None
                y = target[r0:r1] if is_ce else None
                _block.block_grad(config, part, coef[r0:r1], x[r0:r1], tb, y, offset, vocab, out[r0:r1], bufs, None)

    if rows and width:
        _cpu.map_tiles(run, _cpu.row_tiles(rows, tile_rows), x.device)
    return out


class VocabParallel:
    """The backend of one vocab-parallel call (the interface of ``torchloss.backends.torch``: ``forward`` and
    ``regrad_``). The forward keeps the global :class:`_block.Final`, so the backward of 16-bit
    logits recomputes this rank's gradient slice without another collective.

    ``kernel``: the impl's shard kernels (``Backend.shard_kernels``: Triton's shard-stats / shard-grad jobs) or ``None`` for the
    torch path."""

    #: The forward keeps the global final statistics on this object (``self.fin``), not in a
    #: caller's buffer (``torchloss.backends.triton.KEEPS_FINAL``).
    KEEPS_FINAL = False

    def __init__(self, group: Any, offset: int, vocab: int, kernel: Any = None) -> None:
        self.group, self.offset, self.vocab, self.kernel = group, offset, vocab, kernel
        self.fin: Optional[Any] = None

    def _grad(self, config: LossConfig, fin: Any, x: Tensor, target: Tensor, coef: Tensor, out: Tensor, tuning: Optional[Tuning]) -> Tensor:
        if self.kernel is None:
            return shard_grad(config, fin, x, target, coef, self.offset, self.vocab, out, tuning)
        return self.kernel.shard_grad(config, fin, x, target, coef, self.offset, self.vocab, out, tuning)

    def forward(
        self, config: LossConfig, x: Tensor, target: Tensor, coef: Tensor, *, need_grad: bool = True, out: Optional[Tensor] = None,
        tuning: Optional[Tuning] = None,
    ) -> tuple[Tensor, Optional[Tensor]]:
        rows = x.shape[0]
        grad = None
        if need_grad:
            grad = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if rows == 0:  # every rank holds the same (no) tokens: nothing to combine
            return torch.zeros(0, dtype=compute_dtype(x.dtype), device=x.device), grad
        with torch.no_grad():
            if self.kernel is None:
                local = local_stats(config, x, target, coef, self.offset, tuning)
            else:
                local = self.kernel.shard_stats(config, x, target, coef, self.offset, tuning)
            fin = _block.finalize(config, combine_shards(config, local, self.group), self.vocab)
            if config.mixture_pass:
                fin = mixture_shards(config, fin, x, target, self.group, tuning)
            self.fin = fin
            loss = torch.where(coef != 0, fin.l, 0.0)
            if grad is not None:
                self._grad(config, fin, x, target, coef, grad, tuning)
        return loss, grad

    def regrad_(
        self, config: LossConfig, x: Tensor, target: Tensor, coef: Tensor, upstream: Tensor, grad: Tensor, *, tuning: Optional[Tuning] = None
    ) -> Tensor:
        assert self.fin is not None
        scaled = torch.where(coef != 0, coef * upstream, 0.0)
        with torch.no_grad():
            return self._grad(config, self.fin, x, target, scaled, grad, tuning)
