"""The torch path (``impl="torch"``): the chunked driver over the block math of ``torchloss._block``.

Interface (identical to :mod:`torchloss.backends.triton`)::

    per_token_loss [N] (compute dtype), grad [N, V] (logits dtype) or None
        = forward(config, logits [N, V], target, coef [N], need_grad=..., out=None)

``target`` holds the *safe* labels ``[N]`` (int64, 0 for invalid tokens) or the teacher logits
``[N, V]``; ``coef`` is the per-token gradient coefficient (``weight / D``, or ``weight`` for
``"none"``). The gradient written is ``coef * c * dl/dz`` (rows with ``coef == 0`` exactly 0);
the per-token loss ``l`` is 0 where ``coef == 0``.

The rows are processed in tiles (``_cpu.tile_elements``: larger off the CPU) in the compute dtype. When the whole
vocabulary fits one block (``V <= vocab_block``, the common case) the exponentials of the
statistics pass stay in the tile's scratch buffer (for fp32 logits: in the gradient tile itself)
and the gradient is finished there: the logits are read once from memory. Larger vocabularies
take two passes (the gradient recomputes the exponentials from the final statistics), as a
vocab-parallel shard does. On the CPU the tiles go to the worker pool of :mod:`torchloss.backends.cpu_tiles`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor

from lossspec import LossConfig, Tuning
from lossspec import stats as lossspec_stats

from . import cpu_tiles as _cpu
from .. import _block
from .._block import compute_dtype

__all__ = ["forward", "regrad_", "compute_dtype", "DEFAULTS", "KEEPS_FINAL"]

#: Whether the forward keeps the rows' final statistics for :func:`regrad_` (the Triton kernels'
#: ``forward(..., final=)``): not here. On the CPU the statistics pass is a small share of a
#: tile's work, and :func:`regrad_` reruns :func:`forward`, the same code and numbers.
KEEPS_FINAL: bool = False

# The default of lossspec.Tuning.vocab_block here, the largest vocabulary block; longer rows are
# processed block by block (two passes). Whole rows are faster (one pass, the exponentials kept),
# so the block is large: 2**21 fp32 is 8 MiB. (The CPU tile: torchloss.backends.cpu_tiles.DEFAULTS.)
DEFAULTS = Tuning(vocab_block=1 << 21)


def forward(
    config: LossConfig,
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    *,
    need_grad: bool = True,
    out: Optional[Tensor] = None,
    tuning: Optional[Tuning] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Per-token loss ``[N]`` and gradient ``[N, V]`` (see the module docstring).

    Args:
      config: validated options (``config.kind`` selects the loss).
      logits: ``[N, V]`` float, unit stride along ``V``.
      target: safe labels ``[N]`` int64 (cross-entropy) or teacher logits ``[N, V]``.
      coef: ``[N]`` gradient coefficient in the compute dtype.
      need_grad: compute the gradient (``False``: loss only, no ``[N, V]`` buffer).
      out: where to write the gradient (``logits`` itself for ``inplace=True``); allocated
        when ``None``.
      tuning: the :class:`lossspec.Tuning` fields ``vocab_block`` (:data:`DEFAULTS`) and
        ``cpu_tile_elements`` (``torchloss.backends.cpu_tiles.DEFAULTS``); ``None``: the defaults.
    """
    rows, vocab = logits.shape
    acc = compute_dtype(logits.dtype)
    device = logits.device
    grad = None
    if need_grad:
        grad = out if out is not None else torch.empty((rows, vocab), dtype=logits.dtype, device=device)
    if rows == 0:
        return torch.zeros(rows, dtype=acc, device=device), grad
    block = min(vocab, (tuning or DEFAULTS).vocab_block or DEFAULTS.vocab_block)  # type: ignore[type-var]
    tile_rows = max(1, min(rows, _cpu.tile_elements(device, _block.buffers_needed(config.kind), tuning) // block))
    tiles = _cpu.row_tiles(rows, tile_rows)
    if device.type == "cpu" and block == vocab and logits.dtype != acc:
        # Compact tiles hold fp32 copies of the valid rows (and teacher rows) besides the scratch
        # buffers, unless block_stats takes them as scratch: their tile size counts them.
        copies = 0 if _block.shifts_inputs(config.kind) else 1 + config.is_distill
        compact_rows = max(1, min(rows, _cpu.tile_elements(device, _block.buffers_needed(config.kind) + copies, tuning) // block))
        compact = _cpu.compact_tiles(coef, compact_rows)
        if compact is not None:
            tiles, tile_rows = compact, compact_rows
    table = RowStats(config, rows, acc, device)
    run = functools.partial(_run_tiles, config, logits, target, coef, grad, table, block, tile_rows)
    _cpu.map_tiles(run, tiles, device)
    # The loss and the bad rows' gradients once over all rows (the tiles wrote their statistics).
    fin = _block.finalize(config, table.stats(), vocab)
    if grad is not None:
        _block.fill_bad_rows(grad, fin, coef)
    return torch.where(coef != 0, fin.l, 0.0), grad


class RowStats:
    """The statistics of every row, one ``[k, N]`` table the tiles write (one op per tile),
    finalised once over all rows by :func:`forward`.

    The per-row algebra of a tile (finalize, the bad-row checks) is some forty ops on ``[R]``
    tensors, each ~3 us of Python and dispatch. On the CPU the workers run them under the GIL,
    one at a time, so they do not parallelise: per tile they cost as much as a pass over the
    tile. A tile now finalises only what its gradient reads (``finalize_gradient``).

    Rows no tile visits (the masked rows of compact tiles) keep the statistics of a one-hot row
    (``m = 0``, ``s = st = 1``): finite, so nothing refills their zero gradient rows.
    """

    def __init__(self, config: LossConfig, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.names = lossspec_stats.stats_used(config)
        if config.mixture_pass:
            self.names += lossspec_stats.MIXTURE_STATS
        self.table = torch.zeros((len(self.names), rows), dtype=dtype, device=device)
        for name in ("s", "st"):
            if name in self.names:
                self.table[self.names.index(name)] = 1.0

    def put(self, rows: slice | Tensor, stats: Any) -> None:
        """Write the statistics of the rows ``rows`` (a slice, or row indices)."""
        values = [getattr(stats, name) for name in self.names]
        if isinstance(rows, slice):
            torch.stack(values, out=self.table[:, rows])
        else:
            self.table.index_copy_(1, rows, torch.stack(values))

    def stats(self) -> Any:
        return _block.Stats(**dict(zip(self.names, self.table)))


def regrad_(
    config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, upstream: Tensor, grad: Tensor, *, tuning: Optional[Tuning] = None
) -> Tensor:
    """Rewrite ``grad`` as the gradient for the upstream gradient ``upstream`` (``[1]``, or
    ``[N]`` per token, compute dtype): :func:`forward` with ``coef * upstream``, so that the
    result is rounded once to ``grad``'s dtype (the backward of 16-bit logits)."""
    scaled = torch.where(coef != 0, coef * upstream, 0.0)
    forward(config, logits, target, scaled, need_grad=True, out=grad, tuning=tuning)
    return grad


def _mixture_pass(config: LossConfig, stats: Any, fin: Any, x: Tensor, t: Tensor, cache: Optional[_block.Cache]) -> tuple[Any, Any]:
    """``jensen_shannon``'s second pass over whole rows (the cached block): the statistics with
    :data:`lossspec.stats.MIXTURE_STATS` and the final statistics its gradient reads."""
    kl_qm, kl_pm = _block.mixture_sums(config, fin, x, t, cache)
    return stats._replace(kl_qm=kl_qm, kl_pm=kl_pm), lossspec_stats.finalize_mixture(torch, config, fin, kl_qm, kl_pm)


def no_autocast(device: torch.device) -> Any:
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _run_tiles(
    config: LossConfig,
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    grad: Optional[Tensor],
    table: RowStats,
    block: int,
    tile_rows: int,
    tiles: Iterable[_cpu.Tile],
) -> None:
    """Statistics (and gradient) of the tiles taken from ``tiles``, with this thread's scratch."""
    acc = table.table.dtype
    device = logits.device
    vocab = logits.shape[1]
    whole_row = block == vocab
    # For fp32 logits the gradient tile itself is the first scratch buffer (no copy at the end),
    # except where pass 1 of a multi-block row would overwrite logits still to be read.
    grad_as_scratch = grad is not None and grad.dtype == acc and (whole_row or grad is not logits)
    n_bufs = _block.buffers_needed(config.kind) + (0 if whole_row else 1)
    scratch = Scratch([torch.empty(tile_rows * block, dtype=acc, device=device) for _ in range(n_bufs)])
    compact: list[Optional[Tensor]] = [None, None]  # fp32 logits and teacher
    # Raw computations in the compute dtype: no autograd (worker threads start with grad mode
    # on) and no autocast, whatever the calling thread has enabled.
    with torch.no_grad(), no_autocast(device):
        for r0, r1, runs in tiles:
            if runs is None:
                _run_tile(config, logits, target, coef, grad, table, r0, r1, block, scratch, grad_as_scratch)
            else:
                _run_compact_tile(config, logits, target, coef, grad, table, r0, r1, runs, scratch, compact, tile_rows)


def row_views(flat: list[Tensor], rows: int, width: int) -> list[Tensor]:
    return [f[: rows * width].view(rows, width) for f in flat]


class Scratch:
    """A worker's flat scratch buffers and their ``[rows, width]`` views, made once per shape
    (each view is two ATen dispatches; per tile they add up, :class:`RowStats`)."""

    def __init__(self, flat: list[Tensor]) -> None:
        self.flat = flat
        self.row_views: dict[tuple[int, int], list[Tensor]] = {}

    def views(self, rows: int, width: int) -> list[Tensor]:
        key = (rows, width)
        if key not in self.row_views:
            self.row_views[key] = row_views(self.flat, rows, width)
        return list(self.row_views[key])


def _run_tile(
    config: LossConfig,
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    grad: Optional[Tensor],
    table: RowStats,
    r0: int,
    r1: int,
    block: int,
    scratch: Scratch,
    grad_as_scratch: bool,
) -> None:
    vocab = logits.shape[1]
    is_ce = config.has_labels
    n = r1 - r0
    x = logits[r0:r1]
    t = target[r0:r1] if config.is_distill else None
    y = target[r0:r1] if is_ce else None
    cf = coef[r0:r1]
    acc = table.table.dtype
    # The label's raw logit, gathered before an in-place gradient overwrites the row.
    x_y = x.gather(1, y[:, None])[:, 0].to(acc) if y is not None else None
    if block == vocab:
        bufs = scratch.views(n, vocab)
        if grad_as_scratch:
            assert grad is not None
            bufs.insert(0, grad[r0:r1])
        stats, cache = _block.block_stats(config, x, t, bufs, x_y=x_y)
        fin = _block.finalize_gradient(config, stats)
        if config.mixture_pass:  # its second pass, on the cached block
            stats, fin = _mixture_pass(config, stats, fin, x, t, cache)
        table.put(slice(r0, r1), stats)
        if grad is not None:
            _block.block_grad(config, fin, cf, x, t, y, 0, vocab, grad[r0:r1], [], cache, fill_rows=False)
        return
    stats = _block.empty_stats(config, n, acc, x.device)
    if is_ce:
        stats = stats._replace(x_y=x_y)
    for v0 in range(0, vocab, block):
        v1 = min(vocab, v0 + block)
        tb = None if t is None else t[:, v0:v1]
        part, _ = _block.block_stats(config, x[:, v0:v1], tb, scratch.views(n, v1 - v0), x_y=None if y is None else torch.zeros_like(x_y))
        stats = _block.combine(config, stats, part)
    fin = _block.finalize(config, stats, vocab)
    if config.mixture_pass:
        # The second pass (lossspec.stats): log M needs the global lse's of pass 1.
        kl_qm = kl_pm = torch.zeros_like(fin.s)
        for v0 in range(0, vocab, block):
            v1 = min(vocab, v0 + block)
            part_qm, part_pm = _block.mixture_sums(config, fin, x[:, v0:v1], t[:, v0:v1], None)
            kl_qm, kl_pm = kl_qm + part_qm, kl_pm + part_pm
        stats = stats._replace(kl_qm=kl_qm, kl_pm=kl_pm)
        fin = lossspec_stats.finalize_mixture(torch, config, fin, kl_qm, kl_pm)
    table.put(slice(r0, r1), stats)
    if grad is None:
        return
    for v0 in range(0, vocab, block):
        v1 = min(vocab, v0 + block)
        out = grad[r0:r1, v0:v1]
        tb = None if t is None else t[:, v0:v1]
        bufs = scratch.views(n, v1 - v0)
        _block.block_grad(config, fin, cf, x[:, v0:v1], tb, y, v0, vocab, out, bufs, None, fill_rows=False)


def _run_compact_tile(
    config: LossConfig,
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    grad: Optional[Tensor],
    table: RowStats,
    r0: int,
    r1: int,
    runs_index: tuple[list[tuple[int, int]], Tensor, Tensor],
    scratch: Scratch,
    compact: list[Optional[Tensor]],
    tile_rows: int,
) -> None:
    """A compact tile (16-bit logits): rows ``[r0, r1)`` whose valid rows are the ``runs``. The
    runs are copied (upcast) into one fp32 tile, computed as a whole-row block, and the gradient
    copied back (rounded once); the masked rows get zero gradients (one ``index_fill_``) and no
    statistics (:class:`RowStats`). Gathering the rows instead (``index_select`` into a 16-bit
    buffer, one upcast, ``index_copy_`` back) measured 1.1-1.25x slower even for random masks
    (runs of ~3 rows)."""
    runs, index, masked = runs_index
    vocab = logits.shape[1]
    is_ce = config.has_labels
    has_teacher = config.is_distill
    acc = table.table.dtype
    if grad is not None and masked.numel():
        grad.index_fill_(0, masked, 0.0)
    n = index.numel()
    if n == 0:
        return
    if compact[0] is None:
        compact[0] = torch.empty(tile_rows * vocab, dtype=acc, device=logits.device)
        if has_teacher:
            compact[1] = torch.empty(tile_rows * vocab, dtype=acc, device=logits.device)
    x = compact[0][: n * vocab].view(n, vocab)
    t = compact[1][: n * vocab].view(n, vocab) if has_teacher else None  # type: ignore[index]
    j = 0
    for a, b in runs:
        x[j : j + b - a].copy_(logits[a:b])
        if t is not None:
            t[j : j + b - a].copy_(target[a:b])
        j += b - a
    cf = coef[index]
    y = target[index] if is_ce else None
    x_y = x.gather(1, y[:, None])[:, 0] if y is not None else None
    bufs = scratch.views(n, vocab)
    if _block.shifts_inputs(config.kind):  # the fp32 copies are scratch: one buffer less in cache
        bufs = [x, t] + bufs[2:]
    stats, cache = _block.block_stats(config, x, t, bufs, x_y=x_y)
    fin = _block.finalize_gradient(config, stats)
    if config.mixture_pass:
        stats, fin = _mixture_pass(config, stats, fin, x, t, cache)
    table.put(index, stats)
    if grad is None:
        return
    # The gradient is formed in the fp32 tile (x is free by then) and copied back per run.
    g = x
    _block.block_grad(config, fin, cf, x, t, y, 0, vocab, g, [], cache, fill_rows=False)
    j = 0
    for a, b in runs:
        grad[a:b].copy_(g[j : j + b - a])  # the one rounding to the logits' dtype
        j += b - a
