"""Triton kernels (``impl="triton"``): one program per row, online softmax over vocabulary blocks.

Interface (identical to :mod:`torchloss._torch`, DESIGN.md "Kernels")::

    per_token_loss [N] (compute dtype), grad [N, V] (logits dtype) or None
        = forward(config, logits [N, V], target, coef [N], need_grad=..., out=None)

Each program handles one row: pass 1 loops over vocabulary blocks of ``BLOCK_V`` entries and
keeps the online statistics of DESIGN.md (``m``, ``s`` and the moments of the kind, rebased on
every new maximum), finalises the per-token loss, and pass 2 loops over the blocks again and
writes ``coef * c * dl/dz``, rounded once to the logits' dtype on store. Everything inside is
fp32 (fp64 for fp64 logits), row offsets are int64, the ragged last block is masked. A row with
``coef == 0`` is skipped (loss 0, gradient 0). NaN or ``+inf`` in a row is detected explicitly
(``max`` may drop NaN on the GPU) and makes its loss NaN.

On a machine without CUDA this module sets ``TRITON_INTERPRET=1`` (unless set already) before
the kernels are defined, so the same kernels run on CPU tensors through the Triton interpreter
(slow: for tests). ``MODE`` selects the pass structure: ``0`` fused (both passes); for
vocab-parallel ``1`` (pass 1 only: the shard's statistics out, :func:`shard_stats`) and ``2``
(pass 2 from the global statistics, :func:`shard_grad`); ``torchloss._torch.combine_shards``
makes the collectives in between. ``REGRAD`` (:func:`regrad_`, the backward of 16-bit
logits) reruns both passes for the rows whose upstream gradient, read on the device, is not 1,
and writes only their gradient, with ``coef`` times that upstream gradient: rounded once.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
import torch
from torch import Tensor

if not torch.cuda.is_available():
    # Must precede the @triton.jit definitions below: the decorator picks the interpreter then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lossspec import LossConfig  # noqa: E402

from ._torch import compute_dtype  # noqa: E402

__all__ = ["forward", "regrad_", "shard_stats", "shard_grad", "INTERPRETED", "MAX_BLOCK_V"]

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Triton's own library functions (tl.max, tl.sum, ...) are interpreted only if the variable was
# set before triton was first imported.
_LANGUAGE_INTERPRETED: bool = type(tl.max).__name__ == "InterpretedFunction"
# Largest vocabulary block of one loop iteration (a power of two). Tests lower it to run the
# block loop and the ragged tail on small vocabularies.
MAX_BLOCK_V: int = 1024 if INTERPRETED else 4096

_KIND_IDS = {"cross_entropy": 0, "soft_cross_entropy": 1, "forward_kl": 2, "reverse_kl": 3}
_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def _rebase(m_old, m_new):
    """``m_old - m_new`` for clamped maxima (finite, or NaN when the row holds NaN / +inf)."""
    return m_old - m_new


@triton.jit
def _row_stats(
    x_row,
    t_row,
    V,
    c,
    ct,
    KIND: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """Pass 1: online statistics of one row, as in DESIGN.md, relative to the clamped maxima
    ``ms = max(m, finfo.min)`` (an all ``-inf`` prefix then rebases like any other).

    Returns ``(ms, s, sum_shift, mts, st, a, b, e_s, e_t, t_ref, bad)``; entries a kind does not
    use stay 0. ``bad`` is 1 when the row holds NaN or ``+inf`` (student or teacher). Reverse KL:
    ``t_ref`` is the teacher's logit at the student's (running) argmax and ``e_t`` is taken
    relative to it (see ``torchloss._torch.finalize`` for why).
    On a new maximum ``ms' >= ms`` (``d = ms - ms'``, ``r = exp(c d)``) the exp-sums scale by
    ``r`` and the moments that carry ``(x - ms)`` gain ``d`` times their weight sum.
    """
    if ACC == tl.float64:
        fmin = tl.full((), -1.7976931348623157e308, ACC)
    else:
        fmin = tl.full((), -3.4028234663852886e38, ACC)
    zero = tl.full((), 0.0, ACC)
    ms = fmin
    s = zero
    sum_shift = zero
    mts = fmin
    st = zero
    a = zero
    b = zero
    e_s = zero
    e_t = zero
    t_ref = zero
    bad = tl.full((), 0, tl.int32)
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        inside = cols < V
        x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(ACC)
        bad = bad | tl.max(tl.where(inside & ((x != x) | (x == float("inf"))), 1, 0), axis=0)
        block_max = tl.max(x, axis=0)
        ms_new = tl.maximum(ms, block_max)
        d = _rebase(ms, ms_new)
        r = tl.exp(c * d)
        u = x - ms_new  # -inf for -inf logits and for the masked tail
        e = tl.exp(c * u)
        if KIND == 0:
            # sum (x - ms'): the v0 entries seen so far each shift by d.
            sum_shift = sum_shift + (v0 * 1.0) * d + tl.sum(tl.where(inside, u, 0.0), axis=0)
        else:
            t = tl.load(t_row + cols, mask=inside, other=float("-inf")).to(ACC)
            bad = bad | tl.max(tl.where(inside & ((t != t) | (t == float("inf"))), 1, 0), axis=0)
            mts_new = tl.maximum(mts, tl.max(t, axis=0))
            dt = _rebase(mts, mts_new)
            rt = tl.exp(ct * dt)
            ut = t - mts_new
            et = tl.exp(ct * ut)
            # Products use where(weight > 0, ...): an entry of probability 0 adds 0, not 0 * -inf.
            if KIND == 1 or KIND == 2:
                a = rt * (a + d * st) + tl.sum(tl.where(et > 0, et * u, 0.0), axis=0)
            if KIND == 2:
                b = rt * (b + dt * st) + tl.sum(tl.where(et > 0, et * ut, 0.0), axis=0)
            if KIND == 3:
                moved = block_max > ms
                t_ref_new = tl.where(moved, tl.max(tl.where(x == block_max, t, float("-inf")), axis=0), t_ref)
                shift_t = tl.where(moved & (s > 0), t_ref - t_ref_new, 0.0)
                e_s = r * (e_s + d * s) + tl.sum(tl.where(e > 0, e * u, 0.0), axis=0)
                e_t = r * (e_t + shift_t * s) + tl.sum(tl.where(e > 0, e * (t - t_ref_new), 0.0), axis=0)
                t_ref = t_ref_new
            st = st * rt + tl.sum(et, axis=0)
            mts = mts_new
        s = s * r + tl.sum(e, axis=0)
        ms = ms_new
    return ms, s, sum_shift, mts, st, a, b, e_s, e_t, t_ref, bad


@triton.jit
def _row_loss(ms, s, sum_shift, mts, st, a, b, e_s, e_t, t_ref, bad, x_y, V, c, ct, eps, lam, KIND: tl.constexpr):
    """Per-token loss from whole-row statistics (DESIGN.md), NaN for a bad row.

    Returns ``(loss, lse, lse_t, zfac, l_ref)`` with ``lse = log s``, ``lse_t = log st``, the
    cross-entropy gradient factor ``zfac = 1 + 2 lam (lse + c m)`` and, for reverse KL,
    ``l_ref = (c e_s - ct e_t) / s``.
    """
    lse = tl.log(s)
    lse_t = lse * 0.0
    zfac = lse * 0.0 + 1.0
    l_ref = lse * 0.0
    if KIND == 0:
        loss = lse - ((1.0 - eps) * c) * (x_y - ms)
        if eps > 0:
            loss = loss - (eps / V * c) * sum_shift
        if lam > 0:
            full_lse = lse + c * ms
            loss = loss + lam * full_lse * full_lse
            zfac = 1.0 + (2.0 * lam) * full_lse
    else:
        lse_t = tl.log(st)
        if KIND == 1:
            loss = lse - c * a / st
        elif KIND == 2:
            loss = (ct * b / st - lse_t) - (c * a / st - lse)
        else:
            l_ref = (c * e_s - ct * e_t) / s
            loss = (c * e_s / s - lse) - (ct * (e_t / s + (t_ref - mts)) - lse_t)
    loss = tl.where(bad != 0, float("nan"), loss)
    return loss, lse, lse_t, zfac, l_ref


@triton.jit
def _round_for_store(g, GRAD_BF16: tl.constexpr):
    """Round fp32 to bf16 to nearest even by hand (the interpreter's cast truncates); the
    following cast on store is then exact, on the GPU as in the interpreter."""
    if GRAD_BF16:
        bits = g.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        g = tl.where(g != g, g, bits.to(tl.float32, bitcast=True))
    return g


@triton.jit
def _row_grad(
    x_row,
    t_row,
    g_row,
    y,
    scale,
    ms,
    s,
    mts,
    st,
    t_ref,
    l_ref,
    zfac,
    V,
    V_total,
    c,
    ct,
    eps,
    KIND: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
    GRAD_BF16: tl.constexpr,
):
    """Pass 2: ``grad = scale * dl/dz`` (``scale = coef * c``) from the row's final statistics::

        CE                   zfac q - (1 - eps) onehot(y) - eps / V
        soft CE, forward KL  q - p
        reverse KL           q (log q - log p - l) = q (c (x - m) - ct (t - t_ref) - l_ref),
                             0 where q == 0

    ``V`` entries are written; ``V_total`` is the global vocabulary (label smoothing's ``eps / V``)
    and ``y`` the label's column in this row (out of ``[0, V)`` when another shard owns it).
    """
    offs = tl.arange(0, BLOCK_V)
    inv_s = 1.0 / s
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        inside = cols < V
        x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(ACC)
        u = x - ms
        q = tl.exp(c * u) * inv_s
        if KIND == 0:
            g = zfac * q - tl.where(cols == y, 1.0 - eps, 0.0) - eps / V_total
        else:
            t = tl.load(t_row + cols, mask=inside, other=float("-inf")).to(ACC)
            if KIND == 3:
                g = tl.where(q > 0, q * (c * u - ct * (t - t_ref) - l_ref), 0.0)
            else:
                g = q - tl.exp(ct * (t - mts)) / st
        g = _round_for_store(g * scale, GRAD_BF16)
        tl.store(g_row + cols, g.to(g_row.dtype.element_ty), mask=inside)


@triton.jit
def _masked_loss_kernel(
    x_ptr,
    t_ptr,
    y_ptr,
    coef_ptr,
    up_ptr,
    params_ptr,
    loss_ptr,
    grad_ptr,
    stats_ptr,
    V,
    V_total,
    offset,
    stride_x,
    stride_t,
    stride_g,
    stride_up,
    KIND: tl.constexpr,
    MODE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    REGRAD: tl.constexpr,
    GRAD_BF16: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per row: ``loss[row] = l`` (0 where ``coef == 0``) and, with
    ``WRITE_GRAD``, ``grad[row, :] = coef * c * dl/dz``. ``params = [c, ct, eps, lam]``.

    ``REGRAD`` (the backward of 16-bit logits): rewrite only ``grad[row, :]`` as
    ``(coef * g) * c * dl/dz`` with the upstream gradient ``g = up[row * stride_up]`` read on the
    device; rows with ``g == 1`` (already right) or ``coef == 0`` (already 0) are left alone and
    ``loss`` is not written."""
    tl.static_assert(MODE >= 0 and MODE <= 2, "MODE: 0 fused, 1 shard statistics, 2 gradient from statistics")
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    t_row = t_ptr + row * stride_t
    g_row = grad_ptr + row * stride_g
    c = tl.load(params_ptr + 0)
    ct = tl.load(params_ptr + 1)
    eps = tl.load(params_ptr + 2)
    lam = tl.load(params_ptr + 3)
    coef = tl.load(coef_ptr + row)
    work = coef != 0
    if REGRAD:
        up = tl.load(up_ptr + row * stride_up)
        work = work & (up != 1)
        coef = coef * up
    if MODE == 1:
        # Vocab-parallel pass 1: this shard's statistics (and the label's logit if it owns the
        # label) -> stats[row, 0:12]; rows with coef == 0 keep the empty statistics.
        st_row = stats_ptr + row * 12
        if ACC == tl.float64:
            fmin = tl.full((), -1.7976931348623157e308, ACC)
        else:
            fmin = tl.full((), -3.4028234663852886e38, ACC)
        zero = tl.full((), 0.0, ACC)
        ms, s, sum_shift, mts, st, a, b, e_s, e_t, t_ref, bad = fmin, zero, zero, fmin, zero, zero, zero, zero, zero, zero, tl.full((), 0, tl.int32)
        x_y = zero
        if work:
            ms, s, sum_shift, mts, st, a, b, e_s, e_t, t_ref, bad = _row_stats(x_row, t_row, V, c, ct, KIND, BLOCK_V, ACC)
            if KIND == 0:
                y_local = tl.load(y_ptr + row).to(tl.int64) - offset
                owned = (y_local >= 0) & (y_local < V)
                x_y = tl.load(x_row + tl.where(owned, y_local, 0)).to(ACC)
                x_y = tl.where(owned, x_y, 0.0)
        tl.store(st_row + 0, ms)
        tl.store(st_row + 1, s)
        tl.store(st_row + 2, sum_shift)
        tl.store(st_row + 3, mts)
        tl.store(st_row + 4, st)
        tl.store(st_row + 5, a)
        tl.store(st_row + 6, b)
        tl.store(st_row + 7, e_s)
        tl.store(st_row + 8, e_t)
        tl.store(st_row + 9, t_ref)
        tl.store(st_row + 10, bad.to(ACC))
        tl.store(st_row + 11, x_y)
    elif MODE == 2:
        # Vocab-parallel pass 2: this shard's gradient from the global statistics
        # stats[row, 0:7] = (ms, s, mts, st, t_ref, l_ref, zfac).
        st_row = stats_ptr + row * 7
        if work:
            y = tl.full((), 0, tl.int64)
            if KIND == 0:
                y = tl.load(y_ptr + row).to(tl.int64) - offset
            _row_grad(
                x_row, t_row, g_row, y, coef * c, tl.load(st_row + 0), tl.load(st_row + 1), tl.load(st_row + 2),
                tl.load(st_row + 3), tl.load(st_row + 4), tl.load(st_row + 5), tl.load(st_row + 6), V, V_total,
                c, ct, eps, KIND, BLOCK_V, ACC, GRAD_BF16,
            )
        elif not REGRAD:
            offs = tl.arange(0, BLOCK_V)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + offs
                tl.store(g_row + cols, tl.zeros((BLOCK_V,), ACC).to(g_row.dtype.element_ty), mask=cols < V)
    elif work:
        ms, s, sum_shift, mts, st, a, b, e_s, e_t, t_ref, bad = _row_stats(x_row, t_row, V, c, ct, KIND, BLOCK_V, ACC)
        y = tl.full((), 0, tl.int64)
        x_y = ms * 0.0
        if KIND == 0:
            y = tl.load(y_ptr + row).to(tl.int64)
            x_y = tl.load(x_row + y).to(ACC)
        loss, lse, lse_t, zfac, l_ref = _row_loss(
            ms, s, sum_shift, mts, st, a, b, e_s, e_t, t_ref, bad, x_y, V, c, ct, eps, lam, KIND
        )
        if not REGRAD:
            tl.store(loss_ptr + row, loss)
        if WRITE_GRAD:
            _row_grad(
                x_row, t_row, g_row, y, coef * c, ms, s, mts, st, t_ref, l_ref, zfac, V, V, c, ct, eps,
                KIND, BLOCK_V, ACC, GRAD_BF16,
            )
    elif not REGRAD:
        tl.store(loss_ptr + row, coef * 0.0)
        if WRITE_GRAD:
            offs = tl.arange(0, BLOCK_V)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + offs
                tl.store(g_row + cols, tl.zeros((BLOCK_V,), ACC).to(g_row.dtype.element_ty), mask=cols < V)


def _check_runnable(logits: Tensor) -> None:
    if logits.device.type == "cpu" and not (INTERPRETED and _LANGUAGE_INTERPRETED):
        raise RuntimeError(
            "impl='triton' on CPU tensors needs the Triton interpreter, enabled before triton is first "
            "imported: set TRITON_INTERPRET=1 in the environment, or import torchloss before anything that "
            "imports triton (torch._dynamo does); torchloss sets it itself when CUDA is unavailable"
        )


def forward(
    config: LossConfig,
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    *,
    need_grad: bool = True,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token loss ``[N]`` and gradient ``[N, V]`` by the Triton kernel (see the module
    docstring); same arguments as :func:`torchloss._torch.forward`."""
    _check_runnable(logits)
    rows, vocab = logits.shape
    acc = compute_dtype(logits.dtype)
    device = logits.device
    loss = torch.empty(rows, dtype=acc, device=device)
    grad = None
    if need_grad:
        grad = out if out is not None else torch.empty((rows, vocab), dtype=logits.dtype, device=device)
    if rows == 0:
        return loss, grad
    _launch(config, logits, target, coef, loss, grad, None)
    return loss, grad


def regrad_(config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, upstream: Tensor, grad: Tensor) -> Tensor:
    """Rewrite ``grad`` as the gradient for the upstream gradient ``upstream`` (``[1]``, or ``[N]``
    per token, compute dtype), rounded once: the kernel in ``REGRAD`` mode reads ``upstream`` on
    the device (no host synchronisation) and recomputes only the rows where it is not 1."""
    if logits.shape[0] and logits.shape[1]:
        _launch(config, logits, target, coef, None, grad, upstream)
    return grad


def _launch(
    config: LossConfig,
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    loss: Tensor | None,
    grad: Tensor | None,
    upstream: Tensor | None,
    *,
    mode: int = 0,
    stats: Tensor | None = None,
    offset: int = 0,
    vocab_total: int | None = None,
) -> None:
    """One kernel launch over the rows: the forward (``upstream is None``) or ``REGRAD``; ``mode``
    1/2 are the vocab-parallel passes (``stats`` ``[N, 12]`` out / ``[N, 7]`` in)."""
    rows, vocab = logits.shape
    acc = compute_dtype(logits.dtype)
    device = logits.device
    kind = _KIND_IDS[config.kind]
    teacher = target if kind != 0 else logits
    labels = target if kind == 0 else coef
    if logits.stride(1) != 1 or teacher.stride(1) != 1:
        raise ValueError("the Triton kernel needs a unit stride along the vocabulary")
    params = torch.tensor(
        [config.student_scale, config.teacher_scale, config.label_smoothing, config.z_loss], dtype=acc, device=device
    )
    coef_acc = coef.to(acc)
    up = coef_acc if upstream is None else upstream.to(acc).contiguous()  # unread without REGRAD
    block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    # Without a gradient the kernel still needs a pointer of the logits' dtype.
    grad_arg = grad if grad is not None else logits
    # The interpreter evaluates masked lanes with NumPy (-inf - -inf, 0 * inf) and would warn about
    # values that the kernel discards by design.
    with np.errstate(all="ignore") if INTERPRETED else contextlib.nullcontext():
        _masked_loss_kernel[(rows,)](
            logits,
            teacher,
            labels,
            coef_acc,
            up,
            params,
            loss if loss is not None else coef_acc,  # REGRAD writes no loss
            grad_arg,
            stats if stats is not None else coef_acc,
            vocab,
            vocab if vocab_total is None else vocab_total,
            offset,
            logits.stride(0),
            teacher.stride(0),
            grad_arg.stride(0),
            0 if up.numel() == 1 else 1,
            KIND=kind,
            MODE=mode,
            WRITE_GRAD=grad is not None,
            REGRAD=upstream is not None and mode == 0,
            GRAD_BF16=logits.dtype == torch.bfloat16,
            BLOCK_V=block_v,
            ACC=_TL_DTYPES[acc],
            # A row block of 4096 fp32 values and its temporaries: 8 warps keep registers from
            # spilling (an untuned default; the interpreter ignores it).
            num_warps=4 if block_v <= 2048 else 8,
        )


def shard_stats(config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, offset: int) -> tuple[Any, Tensor, Tensor]:
    """Vocab-parallel pass 1 (``MODE=1``): this shard's per-row statistics as a
    ``torchloss._torch.RowStats`` (rows with ``coef == 0`` hold empty statistics), the label's raw
    logit where this shard (global ids ``[offset, offset + V_local)``) owns it (else 0), and the
    NaN / ``+inf`` flag; :func:`torchloss._torch.combine_shards` makes the collectives."""
    from ._torch import RowStats

    _check_runnable(logits)
    rows, width = logits.shape
    acc = compute_dtype(logits.dtype)
    stats = torch.zeros((rows, 12), dtype=acc, device=logits.device)
    if rows:
        _launch(config, logits, target, coef, None, None, None, mode=1, stats=stats, offset=offset)
    col = stats.unbind(1)
    kind = config.kind
    local = RowStats(width, col[0], col[1])
    if kind == "cross_entropy":
        if config.label_smoothing > 0:
            local.sum_shift = col[2]
    else:
        local.mts, local.st = col[3], col[4]
        if kind in ("soft_cross_entropy", "forward_kl"):
            local.a = col[5]
        if kind == "forward_kl":
            local.b = col[6]
        if kind == "reverse_kl":
            local.e_s, local.e_t, local.t_ref = col[7], col[8], col[9]
    return local, col[11], col[10]


def shard_grad(
    config: LossConfig, fin: Any, logits: Tensor, target: Tensor, coef: Tensor, offset: int, vocab: int, out: Tensor
) -> Tensor:
    """Vocab-parallel pass 2 (``MODE=2``): this shard's ``coef * c * dl/dz`` from the global
    statistics ``fin`` (a ``torchloss._torch.Final``), rounded once into ``out``."""
    _check_runnable(logits)
    rows = logits.shape[0]
    if rows == 0 or logits.shape[1] == 0:
        return out
    st = fin.stats
    zero = torch.zeros_like(st.s)
    cols = [st.ms, st.s, st.mts if st.mts is not None else zero, st.st if st.st is not None else zero,
            st.t_ref if st.t_ref is not None else zero, fin.l_ref if fin.l_ref is not None else zero,
            fin.zfac if fin.zfac is not None else zero + 1.0]
    stats = torch.stack(cols, dim=1).contiguous()
    _launch(config, logits, target, coef, None, out, None, mode=2, stats=stats, offset=offset, vocab_total=vocab)
    return out
