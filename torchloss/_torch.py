"""The torch path (``impl="torch"``): the four masked losses as a few fused PyTorch ops per tile.

Interface (identical to :mod:`torchloss._triton`, DESIGN.md "Kernels")::

    per_token_loss [N] (compute dtype), grad [N, V] (logits dtype) or None
        = forward(config, logits [N, V], target, coef [N], need_grad=..., out=None)

``target`` holds the *safe* labels ``[N]`` (int64, 0 for invalid tokens) or the teacher logits
``[N, V]``; ``coef`` is the per-token gradient coefficient (``weight / D``, or ``weight`` for
``"none"``). The gradient written is ``coef * c * dl/dz`` with ``c = logit_scale / temperature``
(rows with ``coef == 0`` are exactly 0); the per-token loss ``l`` is 0 where ``coef == 0``.

How it is computed (DESIGN.md "Numerics"): the rows are processed in tiles ``[R, Vb]`` sized to
stay in the cache (``TILE_ELEMENTS``), in the compute dtype (fp32; fp64 for fp64 logits), in
shifted coordinates ``d = c * (x - m)`` with ``m`` the row maximum of the raw logits. Each tile
goes through the three stages of the per-row statistics:

1. :func:`block_stats` -- ``m``, ``s = sum exp(c (x - m))`` and the moments of the kind
   (:class:`RowStats`), one vocabulary block at a time, from PyTorch's fused row softmax
   (``s = 1 / max softmax``);
2. :func:`combine_stats` -- online-softmax merge of two blocks' statistics (the same algebra
   merges vocabulary shards: vocab-parallel inserts ``all_reduce(MAX)`` on ``m``/``mt`` and
   ``all_reduce(SUM)`` on the rebased sums here); :func:`finalize` turns them into ``lse`` and
   the per-token loss;
3. :func:`block_grad` -- writes ``coef * c * dl/dz`` for the block, rounded once to the logits'
   dtype.

When the whole vocabulary fits one block (``V <= MAX_VOCAB_BLOCK``, the common case) the softmax
of stage 1 stays in the tile's scratch buffer (for fp32 logits: in the gradient tile itself) and
stage 3 finishes the gradient there: the logits are read once from memory, and the only
``[N, V]`` buffer is the gradient itself. Larger vocabularies take two passes (stage 3 recomputes
the probabilities from the final statistics), exactly like a vocab-parallel shard will.

On the CPU the tiles are shared by a few worker threads that each run single-threaded ops
(:func:`_pool`); elsewhere (a CUDA tensor with ``impl="torch"``) the calling thread launches them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

import numpy as np
import torch
from torch import Tensor

from lossspec import LossConfig

__all__ = [
    "RowStats", "Final", "forward", "regrad_", "block_stats", "combine_stats", "finalize", "block_grad", "compute_dtype",
    "VocabParallel", "shard_offset", "shard_stats", "combine_shards", "vocab_parallel_stats", "vocab_parallel_grad",
]

# Elements of one tile (rows x vocabulary block): 2**19 fp32 = 2 MiB, so the tile's scratch buffer
# stays in a core's cache between the few passes made over it (each worker thread has its own).
TILE_ELEMENTS: int = 1 << 19
# Largest vocabulary block; longer rows are processed block by block (two passes). Whole rows
# are faster (one pass, the softmax cached), so the block is large: a row of 2**21 fp32 is 8 MiB.
MAX_VOCAB_BLOCK: int = 1 << 21
# 16-bit logits on the CPU skip masked rows (compact tiles) once this fraction of rows is masked.
COMPACT_MIN_MASKED: float = 0.125

# A tile: rows [r0, r1) and, for a compact tile, the runs [a, b) of rows with coef != 0 inside it
# with their row indices.
Tile = tuple[int, int, "tuple[list[tuple[int, int]], Tensor] | None"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every logits dtype except fp64, which is computed in fp64 (so that
    ``torch.autograd.gradcheck`` can check the analytic gradient)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclasses.dataclass
class RowStats:
    """Per-row statistics ``[R]`` of one vocabulary block (or shard), DESIGN.md's table.

    Sums are relative to the block's own clamped maxima ``ms = max(m, finfo.min)`` and
    ``mts`` (clamping keeps an all ``-inf`` block finite, so the rebasing below needs no special
    case). ``m``/``mt`` propagate NaN and ``+inf``, which then poison ``s``/``st`` and the loss.
    """

    count: int  # vocabulary entries covered
    ms: Tensor  # clamped row max of x
    s: Tensor  # sum exp(c (x - ms))
    sum_shift: Tensor | None = None  # sum (x - ms)                      CE, label smoothing
    mts: Tensor | None = None  # clamped row max of t                    distillation
    st: Tensor | None = None  # sum exp(ct (t - mts))
    a: Tensor | None = None  # sum exp(ct (t - mts)) (x - ms)             soft CE, forward KL
    b: Tensor | None = None  # sum exp(ct (t - mts)) (t - mts)            forward KL
    e_s: Tensor | None = None  # sum exp(c (x - ms)) (x - ms)             reverse KL
    e_t: Tensor | None = None  # sum exp(c (x - ms)) (t - t_ref)          reverse KL
    t_ref: Tensor | None = None  # the teacher's raw logit at the student's argmax (reverse KL)


@dataclasses.dataclass
class Final:
    """Per-row results of :func:`finalize` ``[R]``: ``lse = log s`` (relative to ``ms``),
    ``lse_t = log st``, the per-token loss ``l``, the CE gradient factor ``1 + 2 lam lse`` and,
    for reverse KL, ``l_ref = l - r_ref`` (see :func:`finalize`)."""

    stats: RowStats
    lse: Tensor
    loss: Tensor
    lse_t: Tensor | None = None
    zfac: Tensor | None = None
    l_ref: Tensor | None = None


def _row_max(x: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(raw max, clamped max)`` of each row in the compute dtype (NaN and +inf propagate)."""
    m = torch.amax(x, dim=1).to(acc)
    return m, m.clamp_min(torch.finfo(acc).min)


def _softmax_(buf: Tensor, src: Tensor | None = None) -> Tensor:
    """``buf = softmax(src)`` along rows (``src = buf`` by default: in place).

    PyTorch's fused row softmax (max, exp-and-sum, scale, vectorised per row in the cache) is
    ~2.5x faster on the CPU than separate ``exp_``/``sum`` passes; softmax is shift-invariant, so
    the shifted coordinates below give the same numbers.
    """
    return torch._softmax(buf if src is None else src, 1, False, out=buf)


def _sum_from_softmax(q: Tensor, m: Tensor) -> Tensor:
    """``s = sum exp(z - max z)`` of rows whose softmax is ``q``: the maximum entry is
    ``exp(0) / s``, so ``s = 1 / max q``. 0 for all ``-inf`` rows (whose softmax is NaN)."""
    s = torch.amax(q, dim=1).reciprocal_()
    return torch.where(m == float("-inf"), 0.0, s)


def _finite_positive(s: Tensor) -> Tensor:
    return torch.isfinite(s) & (s > 0)


def _zero_rows(g: Tensor, rows: Tensor) -> None:
    """Set the rows where ``rows`` is True to exact zeros (NaN-proof, unlike ``g * 0``).

    Such rows (masked rows holding NaN/inf logits) are rare. On the CPU they are found on the
    host (there is no device to synchronise) and only they are written: ``masked_fill_`` with a
    row mask is as slow there as a softmax of the whole tile. Elsewhere ``masked_fill_``.
    """
    if g.device.type == "cpu":
        idx = rows.nonzero()
        if idx.numel():
            g.index_fill_(0, idx[:, 0], 0.0)
    else:
        g.masked_fill_(rows[:, None], 0.0)


def _nan_dot(w: Tensor, v: Tensor, scratch: Tensor) -> Tensor:
    """``sum_v w_v v_v`` per row with ``0 * -inf = 0`` (an entry of zero probability adds 0).
    The products go to ``scratch`` (which may be ``v`` itself): no allocation per tile.

    Any other NaN comes from a NaN or +inf input row, whose ``s``/``st`` is NaN already.
    """
    return torch.nansum(torch.mul(w, v, out=scratch), dim=1)


@functools.lru_cache(maxsize=16)
def _descending(width: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.arange(width, 0, -1, dtype=dtype, device=device)


def _first_max_index(u: Tensor, scratch: Tensor) -> Tensor:
    """``[R, 1]`` int64: the first column of each row where ``u == 0``, i.e. the argmax of ``x``
    for ``u = x - m`` (``x - x`` is exactly 0), or the last column where there is none (a row
    with NaN / ``+inf`` / only ``-inf``, whose loss is NaN whatever the index).

    ``torch.argmax`` is not vectorised on the CPU (3-4x the time of a compare, a multiply by
    ``width, ..., 1`` and a row max, which is what this does in ``scratch``).
    """
    width = u.shape[1]
    torch.eq(u, 0, out=scratch)
    first = scratch.mul_(_descending(width, scratch.dtype, scratch.device)).amax(dim=1)
    return (width - first).to(torch.int64).clamp_(max=width - 1)[:, None]


Cache = tuple[Tensor, ...]


def block_stats(config: LossConfig, xb: Tensor, tb: Tensor | None, bufs: list[Tensor]) -> tuple[RowStats, Cache]:
    """Statistics of one block ``xb [R, Vb]`` (teacher ``tb``), in the compute dtype of ``bufs``.

    Also returns what :func:`block_grad` reuses when this block is the whole row, with ``q``/``p``
    the block's student/teacher softmax: CE ``(q,)``; distillation the four buffers
    ``(u, ut, q, p)``, of which soft CE / forward KL reuse ``q, p`` (``u``/``ut`` end as scratch)
    and reverse KL ``u = x - ms``, ``ut = t - t_ref`` and ``q`` (``p`` ends as scratch).
    """
    kind, c, ct = config.kind, config.student_scale, config.teacher_scale
    acc = bufs[0].dtype
    width = xb.shape[1]
    u = bufs[0]
    if kind == "cross_entropy":
        eps = config.label_smoothing
        sum_shift = None
        if c != 1.0 or eps > 0:
            # Subtract the maximum before scaling (huge logits), then softmax the result.
            m, ms = _row_max(xb, acc)
            torch.sub(xb, ms[:, None], out=u)
            if eps > 0:
                sum_shift = u.sum(dim=1)
            if c != 1.0:
                u.mul_(c)
            q = _softmax_(u)
        elif xb.dtype == acc:
            m, ms = _row_max(xb, acc)
            q = _softmax_(u, xb)
        else:
            u.copy_(xb)  # the one upcast; amax is also faster on fp32 than on 16-bit data
            m, ms = _row_max(u, acc)
            q = _softmax_(u)
        return RowStats(width, ms, _sum_from_softmax(q, m), sum_shift=sum_shift), (q,)
    assert tb is not None
    ut, q, p = bufs[1], bufs[2], bufs[3]
    m, ms = _row_max(xb, acc)
    mt, mts = _row_max(tb, acc)
    torch.sub(xb, ms[:, None], out=u)
    _softmax_(q, u if c == 1.0 else torch.mul(u, c, out=q))
    if ct == 1.0 and tb.dtype == acc and kind != "forward_kl":
        # Softmax is shift-invariant and subtracts the row maximum itself: t - mts is only
        # formed where a moment needs it (forward KL's b).
        _softmax_(p, tb)
    else:
        torch.sub(tb, mts[:, None], out=ut)
        _softmax_(p, ut if ct == 1.0 else torch.mul(ut, ct, out=p))
    s, st = _sum_from_softmax(q, m), _sum_from_softmax(p, mt)
    stats = RowStats(width, ms, s, mts=mts, st=st)
    # The moments are weight sums times normalised averages (sum p (x - m) etc.). The gradient
    # of soft CE / forward KL needs only q and p, so u and ut serve as the products' scratch.
    if kind in ("soft_cross_entropy", "forward_kl"):
        stats.a = st * _nan_dot(p, u, u)
    if kind == "forward_kl":
        stats.b = st * _nan_dot(p, ut, ut)
    if kind == "reverse_kl":
        # e_t is taken relative to t_ref, the teacher at the student's argmax (see finalize).
        # Reverse KL's gradient needs u, t - t_ref and q: p is free for scratch.
        t_ref = tb.gather(1, _first_max_index(u, ut))[:, 0].to(acc)
        torch.sub(tb, t_ref[:, None], out=ut)
        stats.t_ref = t_ref
        stats.e_s = s * _nan_dot(q, u, p)
        stats.e_t = s * _nan_dot(q, ut, p)
    return stats, (u, ut, q, p)


def _rebase(m_old: Tensor, m_new: Tensor) -> Tensor:
    return m_old - m_new  # <= 0; finite for clamped maxima, NaN if a row holds NaN / +inf


def combine_stats(config: LossConfig, p: RowStats, q: RowStats) -> RowStats:
    """Merge the statistics of two disjoint vocabulary blocks (or shards) of the same rows.

    On the new maxima ``ms' >= ms`` the exp-sums scale by ``r = exp(c (ms - ms'))`` and the
    moments that carry ``(x - ms)`` gain ``sum * (ms - ms')`` (likewise for the teacher). This is
    the algebra of ``lossspec.oracle_vocab_parallel``: for vocab-parallel, ``ms'`` is an
    ``all_reduce(MAX)`` and the rebased sums an ``all_reduce(SUM)``.
    """
    c, ct = config.student_scale, config.teacher_scale
    ms = torch.maximum(p.ms, q.ms)
    dp, dq = _rebase(p.ms, ms), _rebase(q.ms, ms)
    rp, rq = torch.exp(c * dp), torch.exp(c * dq)
    out = RowStats(p.count + q.count, ms, p.s * rp + q.s * rq)
    if p.sum_shift is not None and q.sum_shift is not None:
        out.sum_shift = (p.sum_shift + p.count * dp) + (q.sum_shift + q.count * dq)
    if p.mts is None or q.mts is None:
        return out
    assert p.st is not None and q.st is not None
    mts = torch.maximum(p.mts, q.mts)
    dtp, dtq = _rebase(p.mts, mts), _rebase(q.mts, mts)
    rtp, rtq = torch.exp(ct * dtp), torch.exp(ct * dtq)
    out.mts, out.st = mts, p.st * rtp + q.st * rtq
    if p.a is not None and q.a is not None:
        out.a = rtp * (p.a + dp * p.st) + rtq * (q.a + dq * q.st)
    if p.b is not None and q.b is not None:
        out.b = rtp * (p.b + dtp * p.st) + rtq * (q.b + dtq * q.st)
    if p.e_s is not None and q.e_s is not None:
        out.e_s = rp * (p.e_s + dp * p.s) + rq * (q.e_s + dq * q.s)
    if p.e_t is not None and q.e_t is not None and p.t_ref is not None and q.t_ref is not None:
        # e_t follows the student's argmax: the reference moves to the block holding the max.
        out.t_ref = torch.where(p.ms >= q.ms, p.t_ref, q.t_ref)
        term_p = torch.where(p.s > 0, rp * (p.e_t + (p.t_ref - out.t_ref) * p.s), 0.0)
        term_q = torch.where(q.s > 0, rq * (q.e_t + (q.t_ref - out.t_ref) * q.s), 0.0)
        out.e_t = term_p + term_q
    return out


def finalize(config: LossConfig, stats: RowStats, x_y: Tensor | None, vocab: int) -> Final:
    """Per-token loss from the statistics of whole rows (DESIGN.md "Numerics")::

        CE          l = lse - (1 - eps) c (x_y - m) - (eps / V) c sum_shift + lam (lse + c m)^2
        soft CE     l = lse - c a / st
        forward KL  l = (ct b / st - log st) - (c a / st - lse)
        reverse KL  l = (c e_s / s - lse) - (ct (e_t / s + t_ref - mt) - log st)

    with ``lse = log s`` relative to the row maximum ``m`` and ``x_y`` the label's raw logit.

    Reverse KL takes its teacher moment relative to ``t_ref``, the teacher's logit at the
    student's argmax, where ``log q - log p = r_ref``. Then ``l - r_ref = l_ref = c e_s / s -
    ct e_t / s`` is a sum of small weights times differences, and the gradient
    ``q (log q - log p - l) = q (c (x - m) - ct (t - t_ref) - l_ref)`` no longer subtracts two
    nearly equal large numbers (``|l|`` in the 1e4s with huge logits, where fp32 would lose the
    answer).
    """
    kind, c, ct = config.kind, config.student_scale, config.teacher_scale
    lse = torch.log(stats.s)
    if kind == "cross_entropy":
        assert x_y is not None
        eps, lam = config.label_smoothing, config.z_loss
        loss = lse - ((1.0 - eps) * c) * (x_y - stats.ms)
        if eps > 0:
            assert stats.sum_shift is not None
            loss = loss - (eps / vocab * c) * stats.sum_shift
        zfac = None
        if lam > 0:
            full_lse = lse + c * stats.ms
            loss = loss + lam * full_lse * full_lse
            zfac = 1.0 + (2.0 * lam) * full_lse
        return Final(stats, lse, loss, zfac=zfac)
    assert stats.st is not None
    lse_t = torch.log(stats.st)
    if kind == "soft_cross_entropy":
        loss = lse - c * stats.a / stats.st
    elif kind == "forward_kl":
        loss = (ct * stats.b / stats.st - lse_t) - (c * stats.a / stats.st - lse)
    else:
        assert stats.t_ref is not None and stats.mts is not None
        l_ref = (c * stats.e_s - ct * stats.e_t) / stats.s
        loss = (c * stats.e_s / stats.s - lse) - (ct * (stats.e_t / stats.s + (stats.t_ref - stats.mts)) - lse_t)
        return Final(stats, lse, loss, lse_t=lse_t, l_ref=l_ref)
    return Final(stats, lse, loss, lse_t=lse_t)


def _probabilities(buf: Tensor, src: Tensor, m: Tensor, scale: float, total: Tensor) -> Tensor:
    """``buf = exp(scale (src - m)) / total``: a block's probabilities from the final
    statistics of the whole row (the multi-block pass 2, where no softmax of the block fits)."""
    torch.sub(src, m[:, None], out=buf)
    if scale != 1.0:
        buf.mul_(scale)
    return buf.exp_().mul_(total.reciprocal()[:, None])


def block_grad(
    config: LossConfig,
    fin: Final,
    coef: Tensor,
    xb: Tensor,
    tb: Tensor | None,
    labels: Tensor | None,
    v0: int,
    vocab: int,
    out: Tensor | None,
    bufs: list[Tensor],
    cache: Cache | None,
) -> Tensor | None:
    """Write ``coef * c * dl/dz`` of the block ``[R, v0:v0+Vb]`` into ``out`` (logits dtype), or
    return it in the compute dtype (in one of ``bufs``/``cache``) when ``out`` is None::

        CE                   (1 + 2 lam lse) q - (1 - eps) onehot(y) - eps / V
        soft CE, forward KL  q - p
        reverse KL           q (log q - log p - l) = q (c (x - m) - ct (t - t_ref) - l_ref)

    ``cache``: this block's values from :func:`block_stats` when it is the whole row; otherwise
    (``None``) the probabilities are recomputed from the final statistics. Everything up to the
    last multiplication by ``coef * c`` is fp32, which then rounds once into ``out``. Rows with
    ``coef == 0`` come out as exact zeros.
    """
    kind, c, ct = config.kind, config.student_scale, config.teacher_scale
    st = fin.stats
    scale = (coef * c)[:, None]
    dead = coef == 0
    if kind == "cross_entropy":
        q = cache[0] if cache is not None else _probabilities(bufs[0], xb, st.ms, c, st.s)
        if fin.zfac is not None:
            q.mul_(fin.zfac[:, None])
        eps = config.label_smoothing
        assert labels is not None
        local = labels - v0
        owned = (local >= 0) & (local < xb.shape[1])
        q.scatter_add_(1, local.clamp(0, xb.shape[1] - 1)[:, None], owned.to(q.dtype)[:, None] * (eps - 1.0))
        if eps > 0:
            q.sub_(eps / vocab)
        _zero_rows(q, dead & ~_finite_positive(st.s))
        g = q
    elif kind in ("soft_cross_entropy", "forward_kl"):
        assert tb is not None and st.mts is not None and st.st is not None
        if cache is not None:
            q, p = cache[2], cache[3]
        else:
            q = _probabilities(bufs[2], xb, st.ms, c, st.s)
            p = _probabilities(bufs[3], tb, st.mts, ct, st.st)
        g = q.sub_(p)
        _zero_rows(g, dead & ~(_finite_positive(st.s) & _finite_positive(st.st)))
    else:
        assert tb is not None and st.t_ref is not None and fin.l_ref is not None
        if cache is not None:
            u, w, q = cache[0], cache[1], cache[2]
        else:
            u, w = bufs[0], bufs[1]
            torch.sub(xb, st.ms[:, None], out=u)
            torch.sub(tb, st.t_ref[:, None], out=w)
            q = torch.mul(u, c, out=bufs[2]).exp_().mul_(st.s.reciprocal()[:, None])
        # q (c u - ct (t - t_ref) - l_ref), 0 where q == 0. The scale goes on before
        # nan_to_num_, so a masked row's inf * 0 is cleaned up too.
        g = (u if c == 1.0 else u.mul_(c)).sub_(w, alpha=ct).sub_(fin.l_ref[:, None])
        g.mul_(q).mul_(scale).nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        if out is None:
            return g
        if g.data_ptr() != out.data_ptr() or g.stride() != out.stride():
            out.copy_(g)  # the one rounding to the logits' dtype
        return None
    if out is None:
        return g.mul_(scale)
    if g.data_ptr() == out.data_ptr() and g.stride() == out.stride():
        g.mul_(scale)
    elif g.dtype == out.dtype:
        torch.mul(g, scale, out=out)
    else:
        # Multiplied in fp32, then rounded once to the logits' dtype by the copy (a mul with a
        # 16-bit out= would allocate an fp32 temporary and copy anyway).
        out.copy_(g.mul_(scale))
    return None


def _buffers_needed(kind: str) -> int:
    return 1 if kind == "cross_entropy" else 4


def forward(
    config: LossConfig,
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    *,
    need_grad: bool = True,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token loss ``[N]`` and gradient ``[N, V]`` (see the module docstring).

    Args:
      config: validated options (``config.kind`` selects the loss).
      logits: ``[N, V]`` float, unit stride along ``V``.
      target: safe labels ``[N]`` int64 (cross-entropy) or teacher logits ``[N, V]``.
      coef: ``[N]`` gradient coefficient in the compute dtype.
      need_grad: compute the gradient (``False``: loss only, no ``[N, V]`` buffer).
      out: where to write the gradient (``logits`` itself for ``inplace=True``); allocated
        when ``None``.
    """
    rows, vocab = logits.shape
    acc = compute_dtype(logits.dtype)
    device = logits.device
    loss = torch.zeros(rows, dtype=acc, device=device)
    grad = None
    if need_grad:
        grad = out if out is not None else torch.empty((rows, vocab), dtype=logits.dtype, device=device)
    if rows == 0:
        return loss, grad
    vb = min(vocab, MAX_VOCAB_BLOCK)
    tile_rows = max(1, min(rows, TILE_ELEMENTS // vb))
    tiles: list[Tile] = [(r0, min(rows, r0 + tile_rows), None) for r0 in range(0, rows, tile_rows)]
    if device.type == "cpu" and vb == vocab and logits.dtype != acc:
        tiles = _compact_tiles(coef, tile_rows) or tiles
    _map_tiles(functools.partial(_run_tiles, config, logits, target, coef, grad, loss, vb, tile_rows, acc, device), tiles, device)
    return loss, grad


def regrad_(config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, upstream: Tensor, grad: Tensor) -> Tensor:
    """Rewrite ``grad`` as the gradient for the upstream gradient ``upstream`` (``[1]``, or ``[N]``
    per token, compute dtype): :func:`forward` with ``coef * upstream`` (formed in the compute
    dtype; rows with ``coef == 0`` stay 0), so the result is rounded once to ``grad``'s dtype.

    The backward of 16-bit logits (see ``torchloss.api``). Every row is recomputed: reading the
    upstream gradient to skip the unit ones would synchronise with the device (the caller skips
    the call when it is all ones on the CPU).
    """
    scaled = torch.where(coef != 0, coef * upstream, 0.0)
    forward(config, logits, target, scaled, need_grad=True, out=grad)
    return grad


def _compact_tiles(coef: Tensor, tile_rows: int) -> list[Tile] | None:
    """Row tiles holding ``tile_rows`` *valid* rows each (16-bit logits on the CPU).

    16-bit logits are copied into an fp32 tile and the gradient copied back anyway; copying only
    the runs of valid rows costs nothing more and skips all work on masked rows, whose gradient
    rows are just zeroed (~30% of the rows in a typical batch). The valid rows are read on the
    host, which on the CPU is no synchronisation. ``None`` when few rows are masked.
    """
    live = (coef != 0).numpy()
    rows = live.shape[0]
    if rows == 0 or live.mean() > 1.0 - COMPACT_MIN_MASKED:
        return None
    index = torch.from_numpy(np.flatnonzero(live))
    edges = np.diff(np.concatenate(([0], live.astype(np.int8), [0])))
    runs = zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist())
    tiles: list[Tile] = []
    r0, taken, done, current = 0, 0, 0, []
    for a, b in runs:
        while a < b:
            step = min(b - a, tile_rows - taken)
            current.append((a, a + step))
            taken += step
            a += step
            if taken == tile_rows:
                tiles.append((r0, a, (current, index[done : done + taken])))
                r0, done, taken, current = a, done + taken, 0, []
    if r0 < rows:
        tiles.append((r0, rows, (current, index[done : done + taken])))
    return tiles


T = TypeVar("T")


class _Tiles(Generic[T]):
    """A thread-safe iterator over the row tiles that the workers pull from: a worker whose core
    is busy with other work simply takes fewer tiles (dynamic scheduling)."""

    def __init__(self, tiles: Sequence[T]) -> None:
        self._tiles = iter(tiles)
        self._lock = threading.Lock()

    def __iter__(self) -> "_Tiles[T]":
        return self

    def __next__(self) -> T:
        with self._lock:
            return next(self._tiles)


def _map_tiles(run: Callable[[Iterable[T]], None], tiles: Sequence[T], device: torch.device) -> None:
    """``run(tiles)`` on this thread, or on the CPU worker threads sharing one tile queue."""
    workers = _worker_count(device, len(tiles))
    if workers <= 1:
        run(tiles)
        return
    queue = _Tiles(tiles)
    for future in [_pool(workers).submit(run, queue) for _ in range(workers)]:
        future.result()


def _worker_count(device: torch.device, n_tiles: int) -> int:
    """CPU tensors with several tiles are processed by worker threads (see :func:`_pool`)."""
    if device.type != "cpu" or n_tiles < 2:
        return 1
    return min(torch.get_num_threads(), n_tiles)


_POOLS: dict[tuple[int, int], concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """A persistent pool of ``workers`` threads, each running single-threaded ATen ops.

    The tiles are independent (disjoint rows), so on the CPU each worker takes its own tiles and
    runs every op of a tile on one core: no OpenMP fork/join per op, the tile stays in that
    core's cache, and a core taken by another process delays only its own tiles instead of
    stalling every parallel region at its barrier. ``torch.set_num_threads`` is per thread
    (OpenMP), so the caller's setting is untouched. Pools are per process: a forked child (a
    DataLoader worker) does not inherit the parent's threads and makes its own.
    """
    key = (os.getpid(), workers)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="torchloss", initializer=torch.set_num_threads, initargs=(1,)
            )
            _POOLS[key] = pool
        return pool


def _run_tiles(
    config: LossConfig,
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    grad: Tensor | None,
    loss: Tensor,
    vb: int,
    tile_rows: int,
    acc: torch.dtype,
    device: torch.device,
    tiles: Iterable[Tile],
) -> None:
    """Loss (and gradient) of the row tiles taken from ``tiles``, with this thread's scratch
    buffers."""
    kind, vocab = config.kind, logits.shape[1]
    blocks = [(v0, min(vocab, v0 + vb)) for v0 in range(0, vocab, vb)]
    whole_row = len(blocks) == 1
    # For fp32 logits the gradient tile itself is the first scratch buffer (no copy at the end),
    # except where pass 1 of a multi-block row would overwrite logits still to be read.
    grad_as_scratch = grad is not None and grad.dtype == acc and (whole_row or grad is not logits)
    n_bufs = _buffers_needed(kind) - (1 if grad_as_scratch and whole_row else 0)
    flat = [torch.empty(tile_rows * vb, dtype=acc, device=device) for _ in range(n_bufs)]
    teacher = target if kind != "cross_entropy" else None
    labels = target if kind == "cross_entropy" else None
    # Raw computations in the compute dtype: no autograd (worker threads start with grad mode on)
    # and no autocast, whatever the calling thread has enabled.
    cpu_or_cuda = device.type in ("cpu", "cuda")
    no_autocast = torch.autocast(device.type, enabled=False) if cpu_or_cuda else contextlib.nullcontext()
    compact_x: Tensor | None = None
    compact_t: Tensor | None = None
    with torch.no_grad(), no_autocast:
        for r0, r1, compact in tiles:
            if compact is None:
                _run_tile(config, logits, teacher, labels, coef, grad, loss, r0, r1, blocks, flat, grad_as_scratch, acc)
                continue
            if compact_x is None:  # compact tiles only come with 16-bit logits: no grad_as_scratch
                compact_x = torch.empty(tile_rows * vocab, dtype=acc, device=device)
                if teacher is not None:
                    compact_t = torch.empty(tile_rows * vocab, dtype=acc, device=device)
            _run_compact_tile(config, logits, teacher, labels, coef, grad, loss, r0, r1, *compact, compact_x, compact_t, flat)


def _run_tile(
    config: LossConfig,
    logits: Tensor,
    teacher: Tensor | None,
    labels: Tensor | None,
    coef: Tensor,
    grad: Tensor | None,
    loss: Tensor,
    r0: int,
    r1: int,
    blocks: list[tuple[int, int]],
    flat: list[Tensor],
    grad_as_scratch: bool,
    acc: torch.dtype,
) -> None:
    vocab = logits.shape[1]
    whole_row = len(blocks) == 1
    n = r1 - r0
    x = logits[r0:r1]
    t = teacher[r0:r1] if teacher is not None else None
    y = labels[r0:r1] if labels is not None else None
    cf = coef[r0:r1]
    # The label's raw logit, gathered before an in-place gradient overwrites the row.
    x_y = x.gather(1, y[:, None])[:, 0].to(acc) if y is not None else None

    def views(v0: int, v1: int) -> list[Tensor]:
        return [f[: n * (v1 - v0)].view(n, v1 - v0) for f in flat]

    stats: RowStats | None = None
    cache: Cache | None = None
    for v0, v1 in blocks:
        bufs = views(v0, v1)
        if grad_as_scratch and whole_row:
            assert grad is not None
            bufs.insert(0, grad[r0:r1])
        part, cache = block_stats(config, x[:, v0:v1], t[:, v0:v1] if t is not None else None, bufs)
        stats = part if stats is None else combine_stats(config, stats, part)
    assert stats is not None
    fin = finalize(config, stats, x_y, vocab)
    loss[r0:r1] = torch.where(cf != 0, fin.loss, 0.0)
    if grad is None:
        return
    if whole_row:
        block_grad(config, fin, cf, x, t, y, 0, vocab, grad[r0:r1], [], cache)
        return
    for v0, v1 in blocks:
        bufs = views(v0, v1)
        out_b = grad[r0:r1, v0:v1]
        if grad_as_scratch:
            bufs[0] = out_b
        tb = t[:, v0:v1] if t is not None else None
        block_grad(config, fin, cf, x[:, v0:v1], tb, y, v0, vocab, out_b, bufs, None)


def _run_compact_tile(
    config: LossConfig,
    logits: Tensor,
    teacher: Tensor | None,
    labels: Tensor | None,
    coef: Tensor,
    grad: Tensor | None,
    loss: Tensor,
    r0: int,
    r1: int,
    runs: list[tuple[int, int]],
    index: Tensor,
    compact_x: Tensor,
    compact_t: Tensor | None,
    flat: list[Tensor],
) -> None:
    """A compact tile: rows ``[r0, r1)`` whose valid rows are the ``runs``. The runs are copied
    (upcast) into one fp32 tile, computed as a whole row block, and the gradient copied back
    (rounded once); the masked rows in between get zero gradients and keep their zero loss."""
    vocab = logits.shape[1]
    if grad is not None:
        start = r0
        for a, b in runs + [(r1, r1)]:
            if a > start:
                grad[start:a].zero_()
            start = b
    n = sum(b - a for a, b in runs)
    if n == 0:
        return
    x = compact_x[: n * vocab].view(n, vocab)
    t = compact_t[: n * vocab].view(n, vocab) if compact_t is not None and teacher is not None else None
    j = 0
    for a, b in runs:
        x[j : j + b - a].copy_(logits[a:b])
        if t is not None and teacher is not None:
            t[j : j + b - a].copy_(teacher[a:b])
        j += b - a
    cf = coef[index]
    y = labels[index] if labels is not None else None
    x_y = x.gather(1, y[:, None])[:, 0] if y is not None else None
    bufs = [x] if config.kind == "cross_entropy" else [f[: n * vocab].view(n, vocab) for f in flat]
    stats, cache = block_stats(config, x, t, bufs)
    fin = finalize(config, stats, x_y, vocab)
    loss.index_copy_(0, index, torch.where(cf != 0, fin.loss, 0.0))
    if grad is None:
        return
    g = block_grad(config, fin, cf, x, t, y, 0, vocab, None, [], cache)
    assert g is not None
    j = 0
    for a, b in runs:
        grad[a:b].copy_(g[j : j + b - a])  # the one rounding to the logits' dtype
        j += b - a


def scale_rows_(grad: Tensor, factor: Tensor) -> Tensor:
    """``grad *= factor`` in place, ``factor`` ``[N, 1]`` (per row) in the compute dtype: the
    product is formed in the compute dtype and rounded once to ``grad``'s dtype.

    On the CPU a 16-bit ``grad`` goes tile by tile through the worker pool (upcast, multiply,
    round): the same numbers as ``grad.mul_(factor)``, whose mixed-dtype broadcast is ~10x
    slower there.
    """
    acc = factor.dtype
    if grad.device.type != "cpu" or grad.dtype == acc or grad.dim() != 2 or grad.numel() == 0:
        return grad.mul_(factor)
    rows, vocab = grad.shape
    tile_rows = max(1, min(rows, TILE_ELEMENTS // max(vocab, 1)))
    tiles = [(r0, min(rows, r0 + tile_rows)) for r0 in range(0, rows, tile_rows)]

    def run(part: Iterable[tuple[int, int]]) -> None:
        buf = torch.empty(tile_rows * vocab, dtype=acc)
        for r0, r1 in part:
            tile = buf[: (r1 - r0) * vocab].view(r1 - r0, vocab)
            tile.copy_(grad[r0:r1]).mul_(factor[r0:r1])
            grad[r0:r1].copy_(tile)

    _map_tiles(run, tiles, grad.device)
    return grad


# ----------------------------------------------------------------------------------------------
# Vocab-parallel (SPEC section 3): per-shard statistics, explicit collectives, local gradient.
# ----------------------------------------------------------------------------------------------


def _row_tiles(rows: int, width: int) -> list[tuple[int, int]]:
    tile_rows = max(1, min(rows, TILE_ELEMENTS // max(1, min(width, MAX_VOCAB_BLOCK))))
    return [(r0, min(rows, r0 + tile_rows)) for r0 in range(0, rows, tile_rows)]


def _cat_stats(parts: list[RowStats]) -> RowStats:
    """Concatenate the per-tile statistics (rows in order) into one :class:`RowStats`."""
    out = RowStats(parts[0].count, torch.cat([p.ms for p in parts]), torch.cat([p.s for p in parts]))
    for field in ("sum_shift", "mts", "st", "a", "b", "e_s", "e_t", "t_ref"):
        if getattr(parts[0], field) is not None:
            setattr(out, field, torch.cat([getattr(p, field) for p in parts]))
    return out


def _slice_final(fin: Final, r0: int, r1: int) -> Final:
    def cut(value: Tensor | None) -> Tensor | None:
        return None if value is None else value[r0:r1]

    st = fin.stats
    stats = RowStats(st.count, st.ms[r0:r1], st.s[r0:r1])
    for field in ("sum_shift", "mts", "st", "a", "b", "e_s", "e_t", "t_ref"):
        setattr(stats, field, cut(getattr(st, field)))
    return Final(stats, fin.lse[r0:r1], fin.loss[r0:r1], lse_t=cut(fin.lse_t), zfac=cut(fin.zfac), l_ref=cut(fin.l_ref))


def shard_offset(vocab_local: int, group: object, device: torch.device) -> tuple[int, int]:
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


def vocab_parallel_stats(
    config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, group: object, offset: int, vocab: int
) -> Final:
    """:func:`shard_stats` of this rank's shard, combined over ``group`` (:func:`combine_shards`)."""
    local, x_y, bad = shard_stats(config, logits, target, coef, offset)
    return combine_shards(config, local, x_y if config.kind == "cross_entropy" else None, bad, group, vocab)


def shard_stats(config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, offset: int) -> tuple[RowStats, Tensor, Tensor]:
    """Vocab-parallel pass 1 on this rank's shard (global ids ``[offset, offset + V_local)``):
    :func:`block_stats` per row tile (:func:`combine_stats` over vocabulary blocks longer than
    ``MAX_VOCAB_BLOCK``). Returns ``(RowStats, the label's raw logit where this shard owns the
    label else 0, bad)`` with ``bad`` 1 for rows holding NaN / ``+inf``. No collective.
    """
    kind = config.kind
    rows, width = logits.shape
    acc = compute_dtype(logits.dtype)
    device = logits.device
    is_ce = kind == "cross_entropy"
    vb = min(width, MAX_VOCAB_BLOCK)
    blocks = [(v0, min(width, v0 + vb)) for v0 in range(0, width, vb)]
    parts: dict[int, RowStats] = {}
    x_y = torch.zeros(rows, dtype=acc, device=device)
    bad = torch.zeros(rows, dtype=acc, device=device)

    def run(tiles: Iterable[tuple[int, int]]) -> None:
        with torch.no_grad():
            for r0, r1 in tiles:
                n = r1 - r0
                flat = [torch.empty(n * vb, dtype=acc, device=device) for _ in range(_buffers_needed(kind))]
                stats: RowStats | None = None
                for v0, v1 in blocks:
                    xb = logits[r0:r1, v0:v1]
                    tb = None if is_ce else target[r0:r1, v0:v1]
                    bufs = [f[: n * (v1 - v0)].view(n, v1 - v0) for f in flat]
                    part, _ = block_stats(config, xb, tb, bufs)
                    stats = part if stats is None else combine_stats(config, stats, part)
                    row_bad = torch.isnan(xb).any(1) | (xb == float("inf")).any(1)
                    if tb is not None:
                        row_bad = row_bad | torch.isnan(tb).any(1) | (tb == float("inf")).any(1)
                    bad[r0:r1] = torch.maximum(bad[r0:r1], row_bad.to(acc))
                assert stats is not None
                parts[r0] = stats
                if is_ce:
                    local = target[r0:r1] - offset
                    owned = (local >= 0) & (local < width)
                    gathered = logits[r0:r1].gather(1, local.clamp(0, width - 1)[:, None])[:, 0].to(acc)
                    x_y[r0:r1] = torch.where(owned, gathered, 0.0)

    tiles = _row_tiles(rows, width)
    _map_tiles(run, tiles, device)
    local = _cat_stats([parts[r0] for r0, _ in tiles])
    return local, x_y, bad


def combine_shards(
    config: LossConfig, local: RowStats, x_y: Tensor | None, bad: Tensor, group: object, vocab: int
) -> Final:
    """This shard's statistics ``local`` (from :func:`shard_stats` or the Triton kernel's
    ``MODE=1``; ``x_y`` the owned label logit, 0 elsewhere; ``bad`` 1 for rows with NaN /
    ``+inf``) combined with the other shards' by explicit collectives (never autograd):

    1. ``all_reduce(MAX)`` of ``[ms, bad, mts]``;
    2. reverse KL only: ``all_reduce(SUM)`` of the teacher's logit at the student's argmax and of
       the number of shards holding that argmax (their mean is the common reference ``t_ref``);
    3. ``all_reduce(SUM)`` of the sums rebased on the global maxima (DESIGN.md's algebra, that
       of ``lossspec.oracle_vocab_parallel``) and of the label's raw logit from its owner.

    Every rank then finalises the same numbers: the returned :class:`Final` (and so the loss) is
    identical on every rank."""
    import torch.distributed as dist

    kind, c, ct = config.kind, config.student_scale, config.teacher_scale
    is_ce = kind == "cross_entropy"
    acc = local.s.dtype

    # 1. Global maxima (NaN rows reduce as +inf: the rebased sums turn NaN; ``bad`` marks them).
    inf = float("inf")
    maxima = [torch.nan_to_num(local.ms, nan=inf, posinf=inf), bad]
    if local.mts is not None:
        maxima.append(torch.nan_to_num(local.mts, nan=inf, posinf=inf))
    packed = torch.stack(maxima)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    ms, bad = packed[0], packed[1] > 0
    mts = packed[2] if local.mts is not None else None
    dp = _rebase(local.ms, ms)
    rp = torch.exp(c * dp)
    out = RowStats(vocab, ms, local.s * rp)
    sums = [out.s]
    if is_ce:
        assert x_y is not None
        sums.append(x_y)
        if local.sum_shift is not None:
            out.sum_shift = local.sum_shift + local.count * dp
            sums.append(out.sum_shift)
    else:
        assert mts is not None and local.mts is not None and local.st is not None
        dtp = _rebase(local.mts, mts)
        rtp = torch.exp(ct * dtp)
        out.mts, out.st = mts, local.st * rtp
        sums.append(out.st)
        if local.a is not None:
            out.a = rtp * (local.a + dp * local.st)
            sums.append(out.a)
        if local.b is not None:
            out.b = rtp * (local.b + dtp * local.st)
            sums.append(out.b)
        if local.e_s is not None:
            assert local.e_t is not None and local.t_ref is not None
            # 2. The common teacher reference at the student's global argmax.
            holds_max = (local.ms == ms).to(acc)
            ref = torch.stack([torch.where(holds_max > 0, local.t_ref, 0.0), holds_max])
            dist.all_reduce(ref, op=dist.ReduceOp.SUM, group=group)
            t_ref = torch.where(ref[1] > 0, ref[0] / ref[1].clamp_min(1.0), 0.0)
            out.t_ref = t_ref
            out.e_s = rp * (local.e_s + dp * local.s)
            out.e_t = torch.where(local.s > 0, rp * (local.e_t + (local.t_ref - t_ref) * local.s), 0.0)
            sums += [out.e_s, out.e_t]
    # 3. The rebased sums (and the label's logit, held by one shard).
    packed = torch.stack(sums)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    names = ["s"] + (["x_y"] if is_ce else ["st"])
    names += [n for n in ("sum_shift", "a", "b", "e_s", "e_t") if getattr(out, n) is not None]
    reduced = dict(zip(names, packed.unbind(0)))
    for name, value in reduced.items():
        if name != "x_y":
            setattr(out, name, value)
    fin = finalize(config, out, reduced.get("x_y"), vocab)
    fin.loss = torch.where(bad, float("nan"), fin.loss)
    return fin


def vocab_parallel_grad(
    config: LossConfig, fin: Final, logits: Tensor, target: Tensor, coef: Tensor, offset: int, vocab: int, out: Tensor
) -> Tensor:
    """Pass 2 on this rank's shard: ``coef * c * dl/dz`` of its slice from the global statistics
    ``fin`` (no collective), written into ``out`` and rounded once to its dtype."""
    rows, width = logits.shape
    acc = compute_dtype(logits.dtype)
    device = logits.device
    is_ce = config.kind == "cross_entropy"
    vb = min(width, MAX_VOCAB_BLOCK)
    blocks = [(v0, min(width, v0 + vb)) for v0 in range(0, width, vb)]

    def run(tiles: Iterable[tuple[int, int]]) -> None:
        with torch.no_grad():
            for r0, r1 in tiles:
                n = r1 - r0
                flat = [torch.empty(n * vb, dtype=acc, device=device) for _ in range(_buffers_needed(config.kind))]
                part = _slice_final(fin, r0, r1)
                for v0, v1 in blocks:
                    bufs = [f[: n * (v1 - v0)].view(n, v1 - v0) for f in flat]
                    tb = None if is_ce else target[r0:r1, v0:v1]
                    y = target[r0:r1] if is_ce else None
                    block_grad(config, part, coef[r0:r1], logits[r0:r1, v0:v1], tb, y, offset + v0, vocab,
                               out[r0:r1, v0:v1], bufs, None)

    if rows:
        _map_tiles(run, _row_tiles(rows, width), device)
    return out


class VocabParallel:
    """The backend of one vocab-parallel call (same interface as this module: ``forward`` and
    ``regrad_``). The forward keeps the global statistics, so the backward of 16-bit logits
    recomputes this rank's gradient slice from them without another collective."""

    def __init__(self, group: object, offset: int, vocab: int, kernel: object = None) -> None:
        self.group, self.offset, self.vocab = group, offset, vocab
        self.kernel = kernel  # torchloss._triton (its statistics / gradient modes), or None: this module
        self.fin: Final | None = None

    def _stats(self, config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor) -> Final:
        if self.kernel is None:
            return vocab_parallel_stats(config, logits, target, coef, self.group, self.offset, self.vocab)
        local, x_y, bad = self.kernel.shard_stats(config, logits, target, coef, self.offset)  # type: ignore[attr-defined]
        return combine_shards(config, local, x_y if config.kind == "cross_entropy" else None, bad, self.group, self.vocab)

    def _grad(self, config: LossConfig, fin: Final, logits: Tensor, target: Tensor, coef: Tensor, out: Tensor) -> Tensor:
        if self.kernel is None:
            return vocab_parallel_grad(config, fin, logits, target, coef, self.offset, self.vocab, out)
        return self.kernel.shard_grad(config, fin, logits, target, coef, self.offset, self.vocab, out)  # type: ignore[attr-defined]

    def forward(
        self, config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, *, need_grad: bool = True,
        out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        rows = logits.shape[0]
        if rows == 0:  # every rank holds the same (no) tokens: nothing to combine
            empty = torch.zeros(0, dtype=compute_dtype(logits.dtype), device=logits.device)
            grad0 = (out if out is not None else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)) if need_grad else None
            return empty, grad0
        with torch.no_grad():
            fin = self._stats(config, logits, target, coef)
            self.fin = fin
            loss = torch.where(coef != 0, fin.loss, 0.0)
            grad = None
            if need_grad:
                grad = out if out is not None else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
                self._grad(config, fin, logits, target, coef, grad)
        return loss, grad

    def regrad_(self, config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, upstream: Tensor, grad: Tensor) -> Tensor:
        assert self.fin is not None
        scaled = torch.where(coef != 0, coef * upstream, 0.0)
        with torch.no_grad():
            return self._grad(config, self.fin, logits, target, scaled, grad)
