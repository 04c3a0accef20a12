"""The block math of the torch path: block statistics, combine, finalize, block gradient.

The formulation, its names and the pivot's tie rule are :mod:`lossspec.stats` (the same in
``jaxloss._block``): statistics of a vocabulary block relative to its own maxima, an
associative :func:`combine` (online softmax; the same algebra merges vocabulary shards in
``torchloss.backends.vocab_parallel``), :func:`finalize` to the per-token loss, and :func:`block_grad`
from the final statistics. :class:`Stats` and :class:`Final` are lossspec's records, derived from
``lossspec.ROW_STATS`` / ``lossspec.FINAL_STATS``; the algebra between blocks (rescale,
combine, finalize) is written once there for every array namespace and used here on tensors.

Everything runs in the compute dtype (fp32; fp64 for fp64 logits) on tiles ``[R, B]``, with
caller-owned scratch buffers ``bufs`` so that nothing ``[R, B]``-sized is allocated per tile.
The exponentials are elementwise (``torch.exp2`` on the CPU, :func:`_exp_sum`), ~1 ulp: PyTorch's
fused CPU softmax uses a faster, less accurate exponential that misses SPEC section 6 by up to
~1e-5 on rows where one probability is close to 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch import Tensor

import lossspec
from lossspec import LossConfig, stats
from lossspec.stats import NEG_INF

from .backends import cpu_tiles

Stats = stats.Stats
Final = stats.Final


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every logits dtype except fp64, which is computed in fp64 (so that
    ``torch.autograd.gradcheck`` can check the analytic gradient)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pos_dot(weight: Tensor, value: Tensor, scratch: Tensor) -> Tensor:
    """``sum_v where(weight > 0, weight * value, 0)`` per row (an entry of probability 0 adds
    0, not ``0 * -inf``); the products go to ``scratch`` (which may be ``value``).

    ``nansum`` drops the NaN of ``0 * inf``; a NaN from a NaN / ``+inf`` row is dropped too, but
    such a row's exp-sum is NaN already (:func:`bad_rows`)."""
    return torch.nansum(torch.mul(weight, value, out=scratch), dim=1)


FIRST_MAX_BLOCK = 256


def first_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(max, first column of the max)`` per row of ``x [R, W]``: ``torch.max(x, dim=1)``.

    ``torch.max`` with indices is not vectorised on the CPU (3.5x the time of ``torch.amax``):
    the maxima of blocks of :data:`FIRST_MAX_BLOCK` columns (a vectorised ``amax``), the first
    block holding the row's maximum, then the first column inside it. The same values and
    indices, NaN propagation included (the first NaN block, then its first NaN)."""
    rows, width = x.shape
    blocks = width // FIRST_MAX_BLOCK
    if blocks < 2 or x.device.type != "cpu":
        return torch.max(x, dim=1)
    head = x[:, : blocks * FIRST_MAX_BLOCK].unflatten(1, (blocks, FIRST_MAX_BLOCK))
    block_max = torch.amax(head, dim=2)
    tail = x[:, blocks * FIRST_MAX_BLOCK :]
    if tail.shape[1]:
        block_max = torch.cat([block_max, torch.amax(tail, dim=1, keepdim=True)], dim=1)
    top, block = torch.max(block_max, dim=1)
    in_head = block < blocks
    block = block.clamp(max=blocks - 1)
    inner = head[torch.arange(rows, device=x.device), block]
    column = block * FIRST_MAX_BLOCK + torch.max(inner, dim=1)[1]
    if tail.shape[1] and not bool(in_head.all()):
        column = torch.where(in_head, column, blocks * FIRST_MAX_BLOCK + torch.max(tail, dim=1)[1])
    return top, column


def _row_max(x: Tensor, acc: torch.dtype) -> Tensor:
    """Raw row maximum in the compute dtype (``torch.amax`` propagates NaN)."""
    m = torch.amax(x, dim=1)
    return m if m.dtype == acc else m.to(acc)


def shift_column(m: Tensor) -> Tensor:
    """``finite_max(m)`` (lossspec.stats) as a column ``[R, 1]``: ``-inf`` -> 0, NaN and
    ``+inf`` kept. One ``nan_to_num`` instead of lossspec's ``where(m == -inf, 0, m)``: the
    per-tile row ops are dispatch-bound on the CPU (:class:`torchloss.backends.torch.RowStats`)."""
    return torch.nan_to_num(m, nan=float("nan"), posinf=float("inf"), neginf=0.0).unsqueeze(1)


def _shifted(xb: Tensor, m: Tensor, out: Tensor) -> Tensor:
    """``out = xb - finite_max(m)`` in the compute dtype (16-bit data is upcast once first:
    mixed-dtype elementwise ops are much slower on the CPU)."""
    if xb.dtype == out.dtype:
        return torch.sub(xb, shift_column(m), out=out)
    out.copy_(xb)
    return out.sub_(shift_column(m))


# 1 / ln 2: exp(v) = exp2(v / ln 2).
LOG2_E: float = 1.4426950408889634


def _exp_sum(u: Tensor, scale: float, out: Tensor) -> tuple[Tensor, Tensor]:
    """``(e, sum e)`` with ``e = exp(scale * u)`` written into ``out``.

    On the CPU as ``exp2((scale / ln 2) * u)``: ``torch.exp`` goes to MKL's vector exp, which on
    AMD CPUs runs 2.7x slower than ATen's own vectorised ``exp2`` (0.87 vs 0.32 ns per fp32
    element on a 2-core EPYC, single-threaded); the exponentials were a quarter of the torch
    path's time. The product's one rounding (relative 2**-24 of ``|scale u|``, the same as that of
    the shift ``x - m`` before it) moves ``e`` by at most ~6e-8 absolute for ``u <= 0`` against
    ~3e-8 for ``torch.exp``: far inside SPEC section 6 (``4e-6 S``), and the tails, where the
    relative error grows with ``|u|``, are too small to matter to any sum.
    """
    if u.device.type == "cpu":
        e = torch.mul(u, scale * LOG2_E, out=out).exp2_()
    elif scale != 1.0:
        e = torch.mul(u, scale, out=out).exp_()
    else:
        e = u.exp_() if out is u else torch.exp(u, out=out)
    return e, e.sum(dim=1)


Cache = tuple[Tensor, ...]


def softcapped(xb: Tensor, cap: Optional[float], acc: torch.dtype, out: Optional[Tensor] = None) -> Tensor:
    """The block with the soft cap applied (``lossspec.stats.softcap``), a new tensor in the
    compute dtype (never rounded to the logits' dtype), or ``out``; ``xb`` itself for ``cap = None``."""
    return softcap_with_slope(xb, cap, acc, with_slope=False, out=out)[0]


def softcap_with_slope(
    xb: Tensor, cap: Optional[float], acc: torch.dtype, with_slope: bool = True, out: Optional[Tensor] = None, slope_out: Optional[Tensor] = None
) -> tuple[Tensor, Optional[Tensor]]:
    """``(capped, slope)``: the block ``xb`` ``[R, B]`` with the soft cap applied
    (``cap * tanh(xb / cap)`` on the finite entries, :func:`lossspec.stats.softcap`) and, with
    ``with_slope``, the cap's slope ``d/dx cap tanh(x / cap) = 4 e / (1 + e)^2``,
    ``e = exp(-2 |x / cap|)`` (:func:`lossspec.stats.softcap_slope`; from the *raw* block: from
    the capped one, ``1 - (y / cap)^2`` cancels near saturation). Each a new tensor in the compute
    dtype ``acc``, never rounded to the logits' dtype; ``(xb, None)`` for ``cap = None``.
    ``out`` / ``slope_out``: ``[R, B]`` compute-dtype buffers to write them into instead (``out``
    may be ``xb`` itself: the cap is then taken in place).

    lossspec's operations in lossspec's order, so lossspec's bits. On the CPU they run tile by
    tile (:func:`_softcap_tile`) in four scratch tiles that stay in a core's cache, the slope
    reusing the tanh's ``e`` and ``1 + e``: the shared formulation on the whole block allocates a
    block per operation (about thirty for the tanh's series, exponential and selects), which made
    a capped loss 9x (torch path) and a capped fused head 4x the time of an uncapped one.
    Elsewhere (CUDA: a launch per operation and tile) on the whole block.
    """
    if cap is None:
        return xb, None
    if xb.device.type != "cpu":
        x = xb.to(acc)
        capped, slope = stats.softcap(torch, x, cap), (_softcap_slope_whole(x, cap) if with_slope else None)
        if slope is not None and slope_out is not None:
            slope = slope_out.copy_(slope)
        return (capped if out is None else out.copy_(capped)), slope
    rows, width = xb.shape
    capped = torch.empty((rows, width), dtype=acc) if out is None else out
    slope = None if not with_slope else (torch.empty_like(capped) if slope_out is None else slope_out)
    # Each worker takes four scratch tiles and a mask: together at most about one block (a tile
    # is at most a quarter of the block over the workers), far less once the tile size caps them.
    # The tiles are shared by the worker threads of cpu_tiles (each single-threaded).
    tile = max(1, min(SOFTCAP_TILE_ELEMENTS, rows * width // (4 * cpu_tiles.MAX_WORKERS)))
    tile_cols = max(1, min(width, tile))
    tile_rows = max(1, min(rows, tile // tile_cols))
    tiles = [(r0, min(rows, r0 + tile_rows), c0, min(width, c0 + tile_cols)) for r0 in range(0, rows, tile_rows) for c0 in range(0, width, tile_cols)]

    def run(part: Iterable[tuple[int, int, int, int]]) -> None:
        scratch = torch.empty((4, tile_rows * tile_cols), dtype=acc)
        mask = torch.empty(tile_rows * tile_cols, dtype=torch.bool)
        for r0, r1, c0, c1 in part:
            shape = (r1 - r0, c1 - c0)
            count = shape[0] * shape[1]
            _softcap_tile(
                xb[r0:r1, c0:c1], cap, capped[r0:r1, c0:c1], None if slope is None else slope[r0:r1, c0:c1],
                [buf[:count].view(shape) for buf in scratch], mask[:count].view(shape),
            )

    cpu_tiles.map_tiles(run, tiles, xb.device)
    return capped, slope


#: Elements of one tile of the CPU soft cap (:func:`softcap_with_slope`; 1 MiB per fp32 scratch
#: tile): each tile pays the dispatch of ~30 ATen ops, so smaller tiles are slower (a 2048 x
#: 32768 block on two workers: 2**15 1.85x, 2**16 1.25x, 2**17 1.01x the time of 2**18).
SOFTCAP_TILE_ELEMENTS: int = 1 << 18


def _softcap_tile(x: Tensor, cap: float, out: Tensor, slope: Optional[Tensor], scratch: list[Tensor], mask: Tensor) -> None:
    """One tile of :func:`softcap_with_slope`: ``out`` (and ``slope``) from the raw ``x``, with
    :func:`lossspec.stats.tanh`'s operations in its order in the scratch tiles ``u, z, s, w``.

    Two selects of the shared formulation are cheaper here with the same results (ATen's
    ``where`` costs about fifteen times a multiplication on the CPU):

    - ``where(u < 0, -big, big)`` is ``copysign(big, u)``: ``big >= 0``, and the two differ only
      at ``u = +-0`` (where the series is taken instead) and at NaN (where ``x`` is kept);
    - ``where(x - x == 0, capped, x)`` (``x - x == 0``: ``x`` finite) runs only for a tile with
      a NaN or an infinite ``|x / cap|`` (one ``amax``; the check is conservative: an ``x / cap``
      that overflows takes the select, which keeps the capped value there).
    """
    u, z, s, w = scratch
    if x.dtype != out.dtype:
        x = out.copy_(x)  # out holds the widened raw tile until the last select
    torch.div(x, cap, out=u)  # u = x / cap
    torch.mul(u, u, out=z)  # z = u^2
    torch.mul(z, stats.TANH_SERIES[-1], out=s).add_(stats.TANH_SERIES[-2])  # series = series z + coefficient
    for coefficient in stats.TANH_SERIES[-3:0:-1]:
        s.mul_(z).add_(coefficient)
    s.mul_(z).mul_(u).add_(u)  # small = u + u (z series)
    torch.abs(u, out=z).mul_(-2.0).exp_()  # e = exp(-2 |u|)
    if slope is not None:
        torch.mul(z, 4.0, out=slope)  # 4 e
    torch.neg(z, out=w).add_(1.0)  # 1 - e
    z.add_(1.0)  # 1 + e
    w.div_(z).copysign_(u)  # big = (1 - e) / (1 + e), with the sign of u
    if slope is not None:
        slope.div_(z.mul_(z))  # 4 e / ((1 + e) (1 + e))
    torch.lt(u.abs_(), stats.TANH_SERIES_LIMIT, out=mask)
    finite = bool(torch.amax(u) < math.inf)  # |x / cap| < inf everywhere: no NaN, no inf
    torch.where(mask, s, w, out=w)  # tanh(u)
    if finite:
        torch.mul(w, cap, out=out)
    else:
        torch.where(torch.isfinite(x), w.mul_(cap), x, out=out)


def _softcap_slope_whole(x: Tensor, cap: float) -> Tensor:
    """:func:`lossspec.stats.softcap_slope` of the whole compute-dtype block ``x``, its operations
    in its order, in place in two block temporaries."""
    e = torch.div(x, cap).abs_().mul_(-2.0).exp_()
    denominator = e + 1.0
    denominator.mul_(denominator)
    return e.mul_(4.0).div_(denominator)


def block_stats(
    config: LossConfig, xb: Tensor, tb: Optional[Tensor], bufs: list[Tensor], x_y: Optional[Tensor] = None, slope_buf: Optional[Tensor] = None
) -> tuple[Any, Cache]:
    """Statistics of one block ``xb`` ``[R, B]`` (teacher ``tb``) relative to its maxima.

    ``bufs``: scratch ``[R, B]`` in the compute dtype (:func:`buffers_needed`; soft CE and
    forward KL take fp32 ``xb``, ``tb`` as the first two, :func:`shifts_inputs`); ``x_y``: the label's raw logit ``[R]`` (cross-entropy; the caller
    gathers it, or passes zeros for a block that is not the whole row).

    ``xb``, ``tb`` are the raw logits: with a soft cap the statistics are those of the capped
    block (``x_y`` stays raw, ``finalize`` caps it). The capped blocks take the buffers that
    16-bit blocks are widened into (the student ``bufs[0]``, the teacher ``bufs[1]``, reverse
    KL's ``bufs[2]``), so a cap adds one block, its slope (``slope_buf``, or a new tensor).

    Returns ``(stats, cache)`` with ``cache`` what :func:`block_grad` reuses when this block is
    the whole row: cross-entropy ``(e,)``; soft CE / forward KL ``(e, et)``; reverse KL
    ``(e, e D, clean)`` with ``D = c (x - m) - ct (t - tau)`` and ``clean`` True where no
    product ``e D`` is NaN or infinite (known on the CPU only); entropy ``(e, x - m)``;
    jensen_shannon ``(e, et, x - m, t - mt, spare)`` (its second pass, :func:`mixture_sums`,
    works in those five buffers and leaves in them what the gradient reads); each followed by
    the soft cap's slope (:func:`softcap_with_slope`, from the raw ``xb``; ``None`` without a
    cap), taken here because a caller may reuse ``xb``'s memory as scratch before the gradient.
    """
    acc = bufs[0].dtype
    xb, slope = softcap_with_slope(xb, config.logit_softcap, acc, out=bufs[0], slope_out=slope_buf)
    if tb is not None:
        tb = softcapped(tb, config.teacher_logit_softcap, acc, out=_teacher_buffer(config.kind, bufs))
    block, cache = _block_stats(config, xb, tb, bufs, x_y)
    return block, cache + (slope,)


def _teacher_buffer(kind: str, bufs: list[Tensor]) -> Tensor:
    """The scratch buffer a teacher block is widened (or capped) into: ``bufs[1]``, except for
    reverse KL, which reads the teacher again after shifting it into ``bufs[1]`` (``bufs[2]``)."""
    return bufs[2] if kind == "reverse_kl" else bufs[1]


def _block_stats(config: LossConfig, xb: Tensor, tb: Optional[Tensor], bufs: list[Tensor], x_y: Optional[Tensor]) -> tuple[Any, Cache]:
    """:func:`block_stats` of the (capped) block, without the slope."""
    kind, c, ct = config.kind, config.student_scale, config.teacher_scale
    acc = bufs[0].dtype
    u = bufs[0]
    if xb.dtype != acc:
        # 16-bit logits: one vectorised upcast into the scratch, then every pass reads fp32 (on
        # the CPU a bf16 amax takes twice an fp32 one, a mixed-dtype subtraction 1.5x a copy
        # and an fp32 subtraction together).
        xb = u.copy_(xb)
    first = None
    if kind == "reverse_kl":
        top, first = first_max(xb)  # the maximum and the pivot's column (lossspec.stats)
        m = top.to(acc)
    else:
        m = _row_max(xb, acc)
    if kind == "cross_entropy":
        _shifted(xb, m, u)
        sum_shift = n = None
        if config.label_smoothing > 0:
            sum_shift = u.sum(dim=1)
            n = torch.full_like(m, float(xb.shape[1]))
        e, s = _exp_sum(u, c, u)
        return Stats(m=m, s=s, x_y=x_y, sum_shift=sum_shift, n=n), (e,)
    if kind == "entropy":
        _shifted(xb, m, u)
        e, s = _exp_sum(u, c, bufs[1])
        return Stats(m=m, s=s, h=pos_dot(e, u, bufs[2])), (e, u)
    assert tb is not None
    ut, e_buf = bufs[1], bufs[2]
    if tb.dtype != acc:  # as the student's; reverse KL reads the teacher again (tau, D): e_buf keeps it
        tb = _teacher_buffer(kind, bufs).copy_(tb)
    mt = _row_max(tb, acc)
    if kind in ("soft_cross_entropy", "forward_kl"):
        return _teacher_first_stats(config, xb, tb, m, mt, bufs)
    _shifted(xb, m, u)
    _shifted(tb, mt, ut)
    if kind == "reverse_kl":
        assert first is not None
        _, st = _exp_sum(ut, ct, ut)  # only the teacher's exp-sum is needed: ut is scratch after it
        tau = tb.gather(1, first[:, None])[:, 0].to(acc)
        d = _pivot_d(config, u, tb, tau, e_buf)
        e, s = _exp_sum(u, c, u)  # in place: u is not needed past D
        e_d = torch.mul(e, d, out=ut).sum(dim=1)
        # sum == nansum unless a product is NaN (0 * inf at an entry of probability 0, or a NaN
        # row); then (rare) the NaN-dropping sum, and block_grad zeroes such entries.
        clean = e_d.device.type == "cpu" and bool(torch.isfinite(e_d).all())
        if not clean:
            e_d = pos_dot(e, d, ut)
        # The products e D (in ut) are cached rather than D: the gradient e (D - e_d / s) is then
        # one fused pass, e D - e (e_d / s) (block_grad).
        return Stats(m=m, s=s, mt=mt, st=st, tau=tau, e_d=e_d), (e, ut, clean)
    # jensen_shannon, pass 1: the exp-sums only (lossspec.stats); its second pass reads u, ut
    # and takes e, et and the fifth buffer as scratch.
    e, s = _exp_sum(u, c, e_buf)
    et, st = _exp_sum(ut, ct, bufs[3])
    return Stats(m=m, s=s, mt=mt, st=st), (e, et, u, ut, bufs[4])


def _teacher_first_stats(config: LossConfig, xb: Tensor, tb: Tensor, m: Tensor, mt: Tensor, bufs: list[Tensor]) -> tuple[Any, Cache]:
    """Soft CE and forward KL in three buffers: the teacher's ``t - mt``, its exponentials and
    ``b`` first, then the student's ``x - m`` whose exponentials take the teacher's freed
    buffer. ``xb`` / ``tb`` may be ``bufs[0]`` / ``bufs[1]`` themselves (shifted in place)."""
    c, ct = config.student_scale, config.teacher_scale
    u, ut, et_buf = bufs[0], bufs[1], bufs[2]
    _shifted(tb, mt, ut)
    et, st = _exp_sum(ut, ct, et_buf)
    b = pos_dot(et, ut, ut) if config.kind == "forward_kl" else None  # ut is free after b
    _shifted(xb, m, u)
    e, s = _exp_sum(u, c, ut)
    a = pos_dot(et, u, u)
    return Stats(m=m, s=s, mt=mt, st=st, a=a, b=b), (e, et)


def _pivot_d(config: LossConfig, u: Tensor, tb: Tensor, tau: Tensor, out: Tensor) -> Tensor:
    """``D = c (x - m) - ct (t - tau)`` into ``out`` (``u = x - m``)."""
    c, ct = config.student_scale, config.teacher_scale
    d = _shifted(tb, tau, out)  # t - tau
    if c == 1.0:
        return torch.sub(u, d, alpha=ct, out=d)
    return d.mul_(-ct).add_(u, alpha=c)


def buffers_needed(kind: str) -> int:
    """Scratch buffers :func:`block_stats` takes for ``kind`` (jensen_shannon: the fifth is its
    mixture pass's, :func:`mixture_sums`)."""
    return {"cross_entropy": 1, "jensen_shannon": 5}.get(kind, 3)


def chunk_buffers(kind: str, z: Tensor, t: Optional[Tensor], fresh: Callable[[], Tensor]) -> list[Tensor]:
    """:func:`block_stats`' scratch for a whole-row chunk of the fused head whose logits ``z``
    (and teacher ``t``) are its own to overwrite: cross-entropy needs ``z`` only; soft CE,
    forward KL and jensen_shannon shift ``z`` and ``t`` in place and take two fresh blocks
    (jensen_shannon three: its mixture pass works in a fifth);
    reverse KL reads the teacher after the shift, and entropy has none, so they take two fresh
    blocks besides ``z``."""
    if kind == "cross_entropy":
        return [z]
    if kind in ("reverse_kl", "entropy"):
        return [z, fresh(), fresh()]
    return [z, t, fresh(), fresh()] + ([fresh()] if kind == "jensen_shannon" else [])


# The blocks [R, B] (compute dtype) the fused head (torchloss.head) holds at once per kind, so
# that they fit lossspec.linear.HEAD_MEMORY_FRACTION of the logits. Whole rows: cross-entropy
# works in the chunk's logits alone (statistics and gradient in place); the kinds with a teacher
# hold the logits, the teacher's and two scratch blocks (chunk_buffers); entropy's gradient
# takes two temporaries beside its three; jensen_shannon's per-entry mixture terms
# (lossspec.stats.mixture_terms, tensor by tensor, where a row spans several blocks; a whole row
# works in its five buffers, _mixture_terms_inplace) about twelve more (the profiler's peak at
# N = 1024, V = 4096, H = 16 fp32: 0.91 of the 1/8 with 16 blocks, 1.10 with 12). A vocabulary shard's
# exponentials are relative to its own maxima, so the gradient cannot reuse them in place: the
# logits (and the teacher's) stay intact beside buffers_needed scratch blocks.
_HEAD_LIVE_BLOCKS = {"cross_entropy": 1, "soft_cross_entropy": 4, "forward_kl": 4, "reverse_kl": 4, "entropy": 5, "jensen_shannon": 16}
_HEAD_LIVE_BLOCKS_VOCAB_PARALLEL = {
    "cross_entropy": 2, "soft_cross_entropy": 6, "forward_kl": 6, "reverse_kl": 5, "entropy": 6, "jensen_shannon": 18,
}
# With a soft cap the capped blocks take the buffers 16-bit blocks are widened into and the cap's
# slope is one block more (block_stats; the head reuses it from chunk to chunk); the workers'
# scratch tiles of softcap_with_slope hold at most about one block together (small blocks), far
# less for large ones. The gradient of rows of several blocks caps
# its block again (block_grad without a cache): two blocks more than without a cap. The
# profiler's peak, fp32, every cap of the kind set, at 3, 6, 6, 6 and 5 blocks: whole rows (N = 1024,
# V = 4096, H = 16) 0.60, 0.77, 0.77, 0.78, 0.72 of the 1/8 (cross-entropy, soft CE, forward and
# reverse KL, entropy: about 1.8, 4.6, 4.6, 4.7, 3.6 blocks); rows of several blocks (N = 64,
# V = 32768, 256 columns a block) 2.1, 2.0 and 2.0 blocks above the same plan without a cap
# (cross-entropy, forward KL, entropy). So: two more than without a cap (entropy's and
# jensen_shannon's whole rows need fewer). Before the tiles (the shared formulation on the whole
# block, a block per operation) cross-entropy took 10.7 blocks. Vocabulary shards (not measured
# with caps) keep the counts of that implementation: its 12, 16, 16, 16, 13, 17, two more.
_HEAD_LIVE_BLOCKS_SOFTCAP = {"cross_entropy": 3, "soft_cross_entropy": 6, "forward_kl": 6, "reverse_kl": 6, "entropy": 7, "jensen_shannon": 18}
_HEAD_LIVE_BLOCKS_SOFTCAP_VOCAB_PARALLEL = {
    "cross_entropy": 14, "soft_cross_entropy": 18, "forward_kl": 18, "reverse_kl": 18, "entropy": 15, "jensen_shannon": 19,
}


# Whole rows of jensen_shannon form their mixture terms in place in five blocks
# (_mixture_terms_inplace), against the ~12 temporaries of rows of several blocks: the profiler's
# peak at N = 1024, V = 4096, H = 16 fp32 was 0.26 of the 1/8 planned with 16 blocks (about 4.2
# blocks), 4.7 blocks with both caps. So whole rows plan with 6, with a cap or without (a
# 2048 x 32768 x 256 fp32 head: 1380 ms against 2020 ms with 16; both caps, 2390 against 4230).
_HEAD_LIVE_BLOCKS_WHOLE_ROWS = {"jensen_shannon": 6}


def head_live_blocks(kind: str, vocab_parallel: bool, softcap: bool = False, whole_rows: bool = False) -> int:
    """The blocks ``[R, B]`` in the compute dtype that the fused head holds at once for
    ``kind`` (a vocabulary shard's with ``vocab_parallel``; with ``softcap``, a soft cap of the
    student or the teacher is set; with ``whole_rows``, in chunks whose rows are one block each):
    the ``live_blocks`` (``whole_row_live_blocks``) of :func:`lossspec.linear.head_plan`."""
    if whole_rows and not vocab_parallel and kind in _HEAD_LIVE_BLOCKS_WHOLE_ROWS:
        return _HEAD_LIVE_BLOCKS_WHOLE_ROWS[kind]
    if softcap:
        return (_HEAD_LIVE_BLOCKS_SOFTCAP_VOCAB_PARALLEL if vocab_parallel else _HEAD_LIVE_BLOCKS_SOFTCAP)[kind]
    return (_HEAD_LIVE_BLOCKS_VOCAB_PARALLEL if vocab_parallel else _HEAD_LIVE_BLOCKS)[kind]


def grad_scratch_blocks(kind: str) -> int:
    """Scratch blocks :func:`block_grad` needs beyond the logits' own (cross-entropy's gradient
    forms in place: none)."""
    return 0 if kind == "cross_entropy" else buffers_needed(kind)


def shifts_inputs(kind: str) -> bool:
    """Whether :func:`block_stats` accepts compute-dtype logits and teacher that are its first
    two scratch buffers (shifted in place): soft CE and forward KL, which read neither again."""
    return kind in ("soft_cross_entropy", "forward_kl")


def mixture_sums(config: LossConfig, fin: Any, xb: Tensor, tb: Tensor, cache: Optional[Cache]) -> tuple[Tensor, Tensor]:
    """``jensen_shannon``'s second pass over one block (``lossspec.stats``): its
    ``(kl_qm, kl_pm)`` ``[R]`` given the global statistics ``fin``, plain sums that blocks and
    shards add. ``cache``: the block's :func:`block_stats` cache when it is the whole row
    (:func:`_mixture_terms_inplace`: the pass then leaves ``q`` and ``log q - log M`` in the
    cache for :func:`block_grad`); ``xb``, ``tb`` raw (capped here when there is no cache)."""
    if cache is not None:
        return _mixture_terms_inplace(config, fin, cache)
    xb = softcapped(xb, config.logit_softcap, fin.s.dtype)
    tb = softcapped(tb, config.teacher_logit_softcap, fin.s.dtype)
    u, ut = _mixture_inputs(fin, xb, tb)
    _, wq, wp, _ = stats.mixture_terms(torch, config, fin, u, ut)
    return wq.sum(dim=1), wp.sum(dim=1)


def _mixture_terms_inplace(config: LossConfig, fin: Any, cache: Cache) -> tuple[Tensor, Tensor]:
    """``lossspec.stats.mixture_terms`` (with selects) of a whole-row block, in the five buffers of
    jensen_shannon's :func:`block_stats` cache ``(e, et, x - m, t - mt, spare)``: no block-sized
    temporary, the same bits. Returns the sums ``(kl_qm, kl_pm)``; afterwards the cache's ``e``
    holds ``q`` and ``spare`` holds ``log q - log M``, the gradient's two terms
    (:func:`block_grad`), computed once, not again.

    Why: the shared algebra allocates a tensor per operation (about twenty per entry), and the
    gradient computed it all a second time; on the CPU that made the torch path's
    jensen_shannon 1.9x (fp32) to 4.2x (bf16) the time of ``torch.compile``'s fused loop. ATen's
    ``where`` costs about ten times an add there (3.4 ns per fp32 entry against 0.3), so:

    - ``where(side < bound, side, bound) - soft`` is ``clamp_max(side, bound) - soft``: the two
      differ only where ``side`` is NaN, and ``soft`` is NaN exactly there (``side`` is ``diff``
      less a constant, ``soft`` a function of ``diff``), so the result is NaN either way;
    - ``where(q > 0, q * r, 0)`` is ``q * r`` itself where every ``q`` of the block is positive
      (:func:`_where_positive`: one ``amin``; otherwise the select runs).
    """
    q, p, dx, dt, spare = cache[0], cache[1], cache[2], cache[3], cache[4]
    beta = config.beta
    log_beta, log_rest = math.log(beta), math.log1p(-beta)
    # A product by 1.0 and a sum with 0.0 change no number (the sum may turn -0.0 into +0.0, which
    # abs() does anyway): skipped, a pass over the block each.
    log_q = (dx if config.student_scale == 1.0 else dx.mul_(config.student_scale)).sub_(fin.lse[:, None])
    log_p = (dt if config.teacher_scale == 1.0 else dt.mul_(config.teacher_scale)).sub_(fin.lse_t[:, None])
    torch.exp(log_q, out=q)
    torch.exp(log_p, out=p)
    diff = log_q.sub_(log_p)  # dt is free from here on
    shift = log_rest - log_beta
    soft = (torch.abs(diff, out=dt) if shift == 0.0 else torch.add(diff, shift, out=dt).abs_()).neg_().exp_().log1p_()
    log_qm = torch.sub(diff, log_beta, out=spare).clamp_max_(-log_rest).sub_(soft)
    log_pm = diff.neg_().sub_(log_rest).clamp_max_(-log_beta).sub_(soft)
    kl_pm = _where_positive(p, torch.mul(p, log_pm, out=soft)).sum(dim=1)
    kl_qm = _where_positive(q, torch.mul(q, log_qm, out=p)).sum(dim=1)
    return kl_qm, kl_pm


def _where_positive(weight: Tensor, products: Tensor) -> Tensor:
    """``torch.where(weight > 0, products, 0)`` written into ``products``. On the CPU, where every
    ``weight`` is positive (``amin > 0``, False if one is NaN) that is ``products`` unchanged and
    the select (~10x an add there) is skipped: a host check, as the CPU has no device to wait for."""
    if weight.device.type == "cpu" and weight.numel() and bool(torch.amin(weight) > 0):
        return products
    return torch.where(weight > 0, products, torch.tensor(0.0, dtype=products.dtype), out=products)


def _mixture_inputs(fin: Any, xb: Tensor, tb: Tensor) -> tuple[Tensor, Tensor]:
    """``(x - m, t - mt)`` relative to the global maxima, in the compute dtype (a block that is
    not the whole row: no cache)."""
    acc = fin.s.dtype
    return xb.to(acc) - fin.m[:, None], tb.to(acc) - fin.mt[:, None]


def empty_stats(config: LossConfig, rows: int, dtype: torch.dtype, device: torch.device) -> Any:
    """The identity of :func:`combine`: nothing seen yet."""
    neg = torch.full((rows,), NEG_INF, dtype=dtype, device=device)
    zero = torch.zeros((rows,), dtype=dtype, device=device)
    used = lossspec.stats_used(config)
    return Stats(**{name: (neg if name in ("m", "mt", "tau") else zero) for name in used})


# The algebra between blocks (and shards) is lossspec.stats', on torch tensors.
finite_max, rescale, rescale_e_d, combine, finalize, finalize_gradient, bad_rows = stats.bind(torch)


def _fill_rows(g: Tensor, rows: Tensor, value: float) -> None:
    """Set whole rows of ``g`` where ``rows`` is True to ``value`` (NaN-proof, unlike
    ``g * 0``). Such rows are rare: on the CPU they are found on the host (no device to
    synchronise with) and only they are written; elsewhere ``masked_fill_``."""
    if g.device.type == "cpu":
        idx = rows.nonzero()
        if idx.numel():
            g.index_fill_(0, idx[:, 0], value)
    else:
        g.masked_fill_(rows[:, None], value)


def block_grad(
    config: LossConfig,
    fin: Any,
    coef: Tensor,
    xb: Tensor,
    tb: Optional[Tensor],
    labels: Optional[Tensor],
    v0: int,
    vocab: int,
    out: Tensor,
    bufs: list[Tensor],
    cache: Optional[Cache],
    fill_rows: bool = True,
) -> None:
    """Write ``coef * c * dl/dz`` of the block ``[R, v0:v0+B]`` into ``out`` (logits dtype,
    rounded once from the compute dtype)::

        cross_entropy        q_coef q - (1 - eps) onehot(y) - eps / V
        soft CE, forward KL  q - p
        reverse KL           q (D - e_d / s), 0 where q == 0
        entropy              -c q ((x - m) - h / s), 0 where q == 0
        jensen_shannon       (1 - beta) q (log q - log M - kl_qm), 0 where q == 0

    ``cache``: this block's exponentials from :func:`block_stats` when it is the whole row;
    ``None`` recomputes them from the final statistics (``bufs``, or ``out`` itself where it
    has the compute dtype, as scratch). Rows with ``coef == 0`` are exact zeros, bad rows
    (NaN / ``+inf``) NaN (:func:`fill_bad_rows`; ``fill_rows=False`` leaves that to the caller,
    who then calls it once over all rows). ``xb``, ``tb`` are raw: with a soft cap the gradient is formed on the
    capped block (taken before ``out``, which may be ``xb`` itself, is written) and multiplied
    by the cap's slope (:func:`softcap_with_slope`, from the raw ``xb``) in the compute dtype, before
    the one rounding.
    """
    kind, c, ct = config.kind, config.student_scale, config.teacher_scale
    scale = coef if c == 1.0 else coef * c
    acc = scale.dtype
    slope = None
    if cache is not None:
        slope = cache[-1]  # xb may have been scratch since block_stats; the cache holds all else
    elif config.logit_softcap is not None:
        xb, slope = softcap_with_slope(xb, config.logit_softcap, acc)
    if cache is None and tb is not None:
        tb = softcapped(tb, config.teacher_logit_softcap, acc)
    direct = out.dtype == acc  # the gradient can be formed in out itself
    if kind == "jensen_shannon":
        if cache is not None:  # the terms that mixture_sums left in the cache (its buffers)
            q, log_qm = cache[0], cache[4]
            gz = _where_positive(q, torch.mul(q, log_qm.sub_(fin.kl_qm[:, None]), out=log_qm))
        else:
            u, ut = _mixture_inputs(fin, xb, tb)
            q, _, _, log_qm = stats.mixture_terms(torch, config, fin, u, ut)
            gz = torch.where(q > 0, q * (log_qm - fin.kl_qm[:, None]), 0.0)
        g = torch.mul(gz, ((1.0 - config.beta) * scale)[:, None], out=out if direct else gz)
        e = None
    elif cache is None:
        u = out if direct and kind == "cross_entropy" else bufs[0]
        e, _ = _exp_sum(_shifted(xb, fin.m, u), c, u)
    else:
        e = cache[0]
    if kind == "jensen_shannon":
        pass
    elif kind == "entropy":
        # -c q ((x - m) - h / s); 0 where q == 0 (there x - m is -inf)
        u = cache[1] if cache is not None else _shifted(xb, fin.m, bufs[1])
        d = u.sub_(fin.mean_h[:, None])
        g = _where_positive(e, torch.mul(e, d, out=d))
        g = torch.mul(g, (-c * scale / fin.s)[:, None], out=out if direct else g)
    elif kind == "cross_entropy":
        factor = scale / fin.s if fin.q_coef is None else scale * fin.q_coef / fin.s
        g = torch.mul(e, factor[:, None], out=out if direct else e)
        hit = (config.label_smoothing - 1.0) * scale
        if v0 == 0 and xb.shape[1] == vocab:  # the whole row holds every (safe) label
            g.scatter_add_(1, labels[:, None], hit[:, None])
        else:
            local = labels - v0
            owned = (local >= 0) & (local < xb.shape[1])
            g.scatter_add_(1, local.clamp(0, xb.shape[1] - 1)[:, None], torch.where(owned, hit, 0.0)[:, None])
        if config.label_smoothing > 0:
            g.sub_((scale * (config.label_smoothing / vocab))[:, None])
    elif kind == "reverse_kl":
        if cache is None:
            d, clean = _pivot_d(config, _shifted(xb, fin.m, bufs[2]), tb, fin.tau, bufs[1]), False
            g = d.sub_(fin.mean_d[:, None]).mul_(e)
        else:
            # e D - e mean_d in one pass from the cached products. Its rounding error is a few
            # ulps of scale q (|D| + |mean_d|) <= 3 max|gradient|: scale q |mean_d| is at most the
            # gradient at the pivot column, where D = 0 and q is largest.
            e_times_d, clean = cache[1], cache[2]
            g = torch.addcmul(e_times_d, e, (-fin.mean_d)[:, None], out=out if direct else e_times_d)
        if not clean:
            # 0 * inf at entries of probability 0 is NaN: those are 0 (bad rows are refilled below).
            # A block whose e_d is finite on every row has no such entry (block_stats).
            g.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        g = torch.mul(g, (scale / fin.s)[:, None], out=out if direct else g)
    else:
        if cache is None:
            et, _ = _exp_sum(_shifted(tb, fin.mt, bufs[1]), ct, bufs[1])
        else:
            et = cache[1]
        g = torch.mul(e, (scale / fin.s)[:, None], out=out if direct else e)
        g.addcmul_(et, (scale / fin.st)[:, None], value=-1.0)
    if slope is not None:  # the chain rule to the raw logits (dead rows are refilled below)
        g.mul_(slope)
    if fill_rows:
        fill_bad_rows(g, fin, coef)
    if g.data_ptr() != out.data_ptr():
        out.copy_(g)  # the one rounding to the logits' dtype


def fill_bad_rows(g: Tensor, fin: Any, coef: Tensor) -> None:
    """Finish the gradient rows ``g`` ``[R, B]`` of the rows whose statistics ``fin`` are not
    those of a finite row: masked rows (``coef == 0``) are exact zeros even where their
    statistics are NaN, inf or 0 (``0 * NaN``), unmasked bad rows (NaN / ``+inf``) NaN.

    A masked row is formed with ``scale = 0`` (dense tiles compute it like any other), so any
    infinite per-row factor of its gradient leaves ``0 * inf = NaN`` there: besides the exp-sums,
    the row factors ``mean_d`` (reverse KL: infinite where the teacher has ``-inf`` at an entry
    the student gives probability, or at the pivot), ``mean_h``, ``q_coef`` and ``kl_qm``."""
    bad = bad_rows(fin)
    dead = coef == 0
    degenerate = bad | ~(fin.s > 0) | torch.isinf(fin.s)
    if fin.st is not None:
        degenerate = degenerate | ~(fin.st > 0) | torch.isinf(fin.st)
    for factor in (fin.mean_d, fin.mean_h, fin.q_coef, fin.kl_qm):
        if factor is not None:
            degenerate = degenerate | ~torch.isfinite(factor)
    zero, nan = dead & degenerate, bad & ~dead
    if g.device.type != "cpu" or bool((zero | nan).any()):  # rare: one host check on the CPU
        _fill_rows(g, zero, 0.0)
        _fill_rows(g, nan, float("nan"))
