"""Triton kernels of the fused LM head (``linear_<kind>(..., impl="triton")``).

The logits ``z = h W^T + b`` are never stored: every kernel computes its ``[BLOCK_N, BLOCK_V]``
tiles of them in fp32 (``tl.dot`` over ``BLOCK_H`` slices of the hidden axis, ``ieee``
precision: no TF32) and uses them at once, as Cut Cross-Entropy does. The formulation is
:mod:`lossspec.stats` (the unfused kernels' :mod:`torchloss.backends.triton_kernels`, here on 2-D tiles
with one statistic per row of the tile)::

    _head_forward_kernel  grid: token blocks. For each vocabulary block: the tile z (and the
                          teacher's tile t = h_t W_t^T + b_t), folded into the row statistics
                          (online softmax: m, s, x_y, sum_shift, mt, st, a, b, tau, e_d, h); then
                          finalize (jensen_shannon: the tiles once more for its mixture sums
                          kl_qm, kl_pm): loss [N] and the final statistics [len(FINAL_STATS), N]
    _head_dh_kernel       grid: token blocks. For each vocabulary block: the tiles again, the
                          gradient tile G = coef * c * dl/dz, dh[rows] += G W[cols] (fp32,
                          read-modify-write of the program's own rows in a fixed order)
    _head_dw_kernel       grid: vocabulary blocks. For each token block: the tiles again, G,
                          dW[cols] += G^T h[rows], db[cols] += sum G (the program owns its
                          columns)

No atomics: each output element is written by one program, its terms added in loop order, so
two runs give the same bits. Offsets are int64 (``rows * stride``). The scalars (``c``, ``ct``,
``eps``, ``lam``) come from :mod:`torchloss.backends.triton`'s parameter tensor and the coefficients
``coef`` (normalisation, denominator, upstream gradient) are a runtime ``[N]`` tensor: nothing
recompiles per batch. ``HAS_SOFTCAP`` / ``HAS_T_SOFTCAP`` (constexpr) with the runtime caps
``cap`` / ``t_cap``: ``z -> cap tanh(z / cap)`` before the statistics (the gradient gains
the slope ``4 e / (1 + e)^2``, ``e = exp(-2 |z / cap|)``, from the raw ``z``).

Rows with ``coef == 0`` get loss 0 and a zero gradient; NaN / ``+inf`` in a row makes its ``s``
(or ``st``) NaN, its loss NaN and (``coef != 0``) its gradient row NaN, as in the unfused kernels.

Driver: :func:`head_forward` (the interface of ``torchloss.head.head_forward``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from . import triton as _triton  # first: it decides TRITON_INTERPRET before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import lossspec  # noqa: E402
from lossspec import LossConfig  # noqa: E402

from .triton_kernels import (  # noqa: E402
    CROSS_ENTROPY,
    ENTROPY,
    FIN_KL_QM,
    FIN_M,
    FIN_MEAN_D,
    FIN_MEAN_H,
    FIN_MT,
    FIN_Q_COEF,
    FIN_S,
    FIN_ST,
    FIN_TAU,
    FORWARD_KL,
    JENSEN_SHANNON,
    REVERSE_KL,
    SOFT_CROSS_ENTROPY,
    finalize,
    finite,
    is_bad,
    load_mixture_params,
    load_params,
    mixture_log_ratios,
    shift,
    softcap,
    softcap_slope,
)


@triton.jit
def _tile_logits(
    x_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, K, stride_x, stride_w, cap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``z = x[rows] @ w[cols]^T + b[cols]`` ``[BLOCK_N, BLOCK_V]`` in fp32 (16-bit inputs: exact
    products, fp32 sums), then ``cap tanh(z / cap)`` with ``HAS_SOFTCAP``. Rows / columns outside
    the arrays read 0 (the callers mask them). ``rows``, ``cols``: int64 index vectors."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    ks = tl.arange(0, BLOCK_H)
    x_base = x_ptr + rows[:, None] * stride_x
    w_base = w_ptr + cols[:, None] * stride_w
    for k0 in range(0, K, BLOCK_H):
        k = k0 + ks
        k_ok = k < K
        xb = tl.load(x_base + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wb = tl.load(w_base + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(xb, tl.trans(wb), acc, input_precision="ieee")
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        acc = softcap(acc, cap)  # the unfused kernels' cap (lossspec.stats.softcap)
    return acc


@triton.jit
def _head_tiles(
    h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, rows, cols, row_ok, col_ok, H, HT,
    stride_h, stride_w, stride_th, stride_tw, cap, t_cap,
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_T_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``(z, t)``: the student's tile and the teacher's (the kinds without a teacher: ``z``
    again, unused), ``-inf`` outside the vocabulary (probability 0, never a maximum)."""
    z = _tile_logits(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, cap,
                     HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H)
    z = tl.where(col_ok[None, :], z, float("-inf"))
    t = z
    if KIND != CROSS_ENTROPY and KIND != ENTROPY:
        t = _tile_logits(th_ptr, tw_ptr, tb_ptr, rows, cols, row_ok, col_ok, HT, stride_th, stride_tw, t_cap,
                         HAS_T_BIAS, HAS_T_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H)
        t = tl.where(col_ok[None, :], t, float("-inf"))
    return z, t


@triton.jit
def _head_forward_kernel(
    h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, y_ptr, coef_ptr, params_ptr, loss_ptr, fin_ptr,
    N, V, H, HT, stride_h, stride_w, stride_th, stride_tw, stride_fin, cap, t_cap,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_T_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rows ``[pid BLOCK_N, (pid + 1) BLOCK_N)``: the online statistics over the vocabulary
    blocks (each block folded in relative to the new maxima, as ``_row_stats`` does per row),
    then ``loss[row]`` (0 where ``coef == 0``) and ``fin[FIN_<name>, row]``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    c, ct, eps, lam = load_params(params_ptr)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
    y = tl.zeros((BLOCK_N,), tl.int64)
    if KIND == CROSS_ENTROPY:
        y = tl.load(y_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    neg_inf = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    zero = tl.zeros((BLOCK_N,), tl.float32)
    m, s, x_y, sum_shift, mt, st, a, b, tau, e_d, h = neg_inf, zero, zero, zero, neg_inf, zero, zero, zero, neg_inf, zero, zero
    bad = tl.zeros((BLOCK_N,), tl.int32)
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs.to(tl.int64)
        col_ok = cols < V
        z, t = _head_tiles(h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, rows, cols, row_ok, col_ok, H, HT,
                           stride_h, stride_w, stride_th, stride_tw, cap, t_cap,
                           KIND, HAS_BIAS, HAS_T_BIAS, HAS_SOFTCAP, HAS_T_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H)
        bad = bad | tl.max(tl.where(col_ok[None, :], is_bad(z), 0), axis=1)
        block_m = tl.max(z, axis=1)
        m_new = tl.maximum(m, block_m)
        r, dm = shift(m, m_new, c)
        u = z - finite(m_new)[:, None]
        e = tl.exp(c * u)
        if KIND == CROSS_ENTROPY:
            x_y = x_y + tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
            if SMOOTHING:
                sum_shift = sum_shift + (v0 * 1.0) * dm + tl.sum(tl.where(col_ok[None, :], u, 0.0), axis=1)
        elif KIND == ENTROPY:
            h = r * (h + s * dm) + tl.sum(tl.where(e > 0, e * u, 0.0), axis=1)
        else:
            bad = bad | tl.max(tl.where(col_ok[None, :], is_bad(t), 0), axis=1)
            mt_new = tl.maximum(mt, tl.max(t, axis=1))
            rt, dmt = shift(mt, mt_new, ct)
            ut = t - finite(mt_new)[:, None]
            et = tl.exp(ct * ut)
            if KIND == SOFT_CROSS_ENTROPY or KIND == FORWARD_KL:
                a = rt * (a + st * dm) + tl.sum(tl.where(et > 0, et * u, 0.0), axis=1)
            if KIND == FORWARD_KL:
                b = rt * (b + st * dmt) + tl.sum(tl.where(et > 0, et * ut, 0.0), axis=1)
            if KIND == REVERSE_KL:
                # The pivot: the teacher at the first column of the block's maximum; an earlier
                # block keeps its pivot on ties (lossspec.stats).
                first = tl.min(tl.where(col_ok[None, :] & (z == block_m[:, None]), cols[None, :], V), axis=1)
                block_tau = tl.max(tl.where(cols[None, :] == first[:, None], t, float("-inf")), axis=1)
                tau_new = tl.where(block_m > m, block_tau, tau)
                e_d = tl.where(r > 0, r * (e_d + s * (c * dm - ct * (tau - tau_new))), 0.0)
                d = c * u - ct * (t - tau_new[:, None])
                e_d = e_d + tl.sum(tl.where(e > 0, e * d, 0.0), axis=1)
                tau = tau_new
            st = rt * st + tl.sum(et, axis=1)
            mt = mt_new
        s = r * s + tl.sum(e, axis=1)
        m = m_new
    s = tl.where(bad != 0, float("nan"), s)
    loss, m, mt, q_coef, mean_d, mean_h = finalize(
        m, s, x_y, sum_shift, mt, st, a, b, tau, e_d, h, bad, V, c, ct, eps, lam, KIND, SMOOTHING, Z_LOSS
    )
    kl_qm = zero
    if KIND == JENSEN_SHANNON:
        # The second pass (lossspec.stats): the tiles again, the mixture sums from the rows'
        # lse's (as _row_mixture per row); entries of probability 0 add 0.
        beta, log_beta, log_rest = load_mixture_params(params_ptr)
        lse = tl.log(s)
        lse_t = tl.log(st)
        kl_pm = zero
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs.to(tl.int64)
            col_ok = cols < V
            z, t = _head_tiles(h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, rows, cols, row_ok, col_ok, H, HT,
                               stride_h, stride_w, stride_th, stride_tw, cap, t_cap,
                               KIND, HAS_BIAS, HAS_T_BIAS, HAS_SOFTCAP, HAS_T_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H)
            log_q = c * (z - m[:, None]) - lse[:, None]
            log_p = ct * (t - mt[:, None]) - lse_t[:, None]
            q = tl.exp(log_q)
            p = tl.exp(log_p)
            log_qm, log_pm = mixture_log_ratios(log_q - log_p, log_beta, log_rest)
            kl_qm = kl_qm + tl.sum(tl.where(q > 0, q * log_qm, 0.0), axis=1)
            kl_pm = kl_pm + tl.sum(tl.where(p > 0, p * log_pm, 0.0), axis=1)
        loss = tl.where(bad != 0, float("nan"), beta * kl_pm + (1.0 - beta) * kl_qm)
    tl.store(loss_ptr + rows, tl.where(coef != 0, loss, 0.0), mask=row_ok)
    fin = fin_ptr + rows
    tl.store(fin + FIN_M * stride_fin, m, mask=row_ok)
    tl.store(fin + FIN_S * stride_fin, s, mask=row_ok)
    if KIND == CROSS_ENTROPY:
        tl.store(fin + FIN_Q_COEF * stride_fin, q_coef, mask=row_ok)
    elif KIND == ENTROPY:
        tl.store(fin + FIN_MEAN_H * stride_fin, mean_h, mask=row_ok)
    else:
        tl.store(fin + FIN_MT * stride_fin, mt, mask=row_ok)
        tl.store(fin + FIN_ST * stride_fin, st, mask=row_ok)
        if KIND == REVERSE_KL:
            tl.store(fin + FIN_TAU * stride_fin, tau, mask=row_ok)
            tl.store(fin + FIN_MEAN_D * stride_fin, mean_d, mask=row_ok)
        if KIND == JENSEN_SHANNON:
            tl.store(fin + FIN_KL_QM * stride_fin, kl_qm, mask=row_ok)


@triton.jit
def _head_grad_tile(
    h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, y_ptr, coef_ptr, params_ptr, fin_ptr, rows, cols, row_ok, col_ok,
    V, H, HT, stride_h, stride_w, stride_th, stride_tw, stride_fin, c, ct, eps, cap, t_cap,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_T_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """The gradient tile ``G = coef * c * dl/dz_raw`` ``[BLOCK_N, BLOCK_V]`` fp32 of the raw logits
    from the recomputed tiles and the rows' final statistics (``_row_grad``'s formulas)::

        cross_entropy        q_coef q - (1 - eps) onehot(y) - eps / V
        soft CE, forward KL  q - p
        reverse KL           q (D - e_d / s),  D = c (x - m) - ct (t - tau)
        entropy              -c q ((x - m) - h / s)
        jensen_shannon       (1 - beta) q (log q - log M - kl_qm)

    (0 where ``q == 0`` for the last three) times the cap's slope (``softcap_slope`` of the raw tile) with a soft cap. Exactly 0 outside the arrays and where
    ``coef == 0``; NaN on bad rows."""
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
    scale = coef * c
    fin = fin_ptr + rows
    m = tl.load(fin + FIN_M * stride_fin, mask=row_ok, other=0.0)
    s = tl.load(fin + FIN_S * stride_fin, mask=row_ok, other=1.0)
    bad = s != s
    z_raw, t = _head_tiles(h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, rows, cols, row_ok, col_ok, H, HT,
                           stride_h, stride_w, stride_th, stride_tw, cap, t_cap,
                           KIND, HAS_BIAS, HAS_T_BIAS, False, HAS_T_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H)
    z = z_raw
    if HAS_SOFTCAP:
        z = softcap(z_raw, cap)  # capped here: the slope below needs the raw tile
    u = z - m[:, None]
    e = tl.exp(c * u)
    p_scale = scale / s
    if KIND == CROSS_ENTROPY:
        if Z_LOSS:
            p_scale = p_scale * tl.load(fin + FIN_Q_COEF * stride_fin, mask=row_ok, other=1.0)
        y = tl.load(y_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        g = e * p_scale[:, None] + tl.where(cols[None, :] == y[:, None], ((eps - 1.0) * scale)[:, None], 0.0)
        if SMOOTHING:
            g = g - (scale * (eps / V))[:, None]
    elif KIND == ENTROPY:
        mean_h = tl.load(fin + FIN_MEAN_H * stride_fin, mask=row_ok, other=0.0)
        g = tl.where(e > 0, e * (u - mean_h[:, None]), 0.0) * (-c * p_scale)[:, None]
    else:
        mt = tl.load(fin + FIN_MT * stride_fin, mask=row_ok, other=0.0)
        st = tl.load(fin + FIN_ST * stride_fin, mask=row_ok, other=1.0)
        bad = bad | (st != st)
        if KIND == REVERSE_KL:
            tau = tl.load(fin + FIN_TAU * stride_fin, mask=row_ok, other=0.0)
            mean_d = tl.load(fin + FIN_MEAN_D * stride_fin, mask=row_ok, other=0.0)
            d = c * u - ct * (t - tau[:, None])
            g = tl.where(e > 0, e * (d - mean_d[:, None]), 0.0) * p_scale[:, None]
        elif KIND == JENSEN_SHANNON:
            beta, log_beta, log_rest = load_mixture_params(params_ptr)
            kl_qm = tl.load(fin + FIN_KL_QM * stride_fin, mask=row_ok, other=0.0)
            log_q = c * u - tl.log(s)[:, None]
            log_p = ct * (t - mt[:, None]) - tl.log(st)[:, None]
            q = tl.exp(log_q)
            log_qm, log_pm = mixture_log_ratios(log_q - log_p, log_beta, log_rest)
            g = tl.where(q > 0, q * (log_qm - kl_qm[:, None]), 0.0) * ((1.0 - beta) * scale)[:, None]
        else:
            g = e * p_scale[:, None] - tl.exp(ct * (t - mt[:, None])) * (scale / st)[:, None]
    if HAS_SOFTCAP:
        g = g * softcap_slope(z_raw, cap)
    g = tl.where(bad[:, None], float("nan"), g)
    return tl.where((scale != 0)[:, None] & col_ok[None, :], g, 0.0)


@triton.jit
def _head_dh_kernel(
    h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, y_ptr, coef_ptr, params_ptr, fin_ptr, dh_ptr,
    N, V, H, HT, stride_h, stride_w, stride_th, stride_tw, stride_fin, stride_dh, cap, t_cap,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_T_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``dh[rows] = sum over vocabulary blocks of G W[cols]`` (fp32, ``dh`` zero on entry), the
    blocks in order."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    c, ct, eps, lam = load_params(params_ptr)
    offs = tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_H)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs.to(tl.int64)
        col_ok = cols < V
        g = _head_grad_tile(h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, y_ptr, coef_ptr, params_ptr, fin_ptr, rows, cols, row_ok, col_ok,
                            V, H, HT, stride_h, stride_w, stride_th, stride_tw, stride_fin, c, ct, eps, cap, t_cap,
                            KIND, SMOOTHING, Z_LOSS, HAS_BIAS, HAS_T_BIAS, HAS_SOFTCAP, HAS_T_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H)
        for k0 in range(0, H, BLOCK_H):
            k = k0 + ks
            k_ok = k < H
            wb = tl.load(w_ptr + cols[:, None] * stride_w + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            out = dh_ptr + rows[:, None] * stride_dh + k[None, :]
            out_ok = row_ok[:, None] & k_ok[None, :]
            part = tl.dot(g, wb, input_precision="ieee")
            tl.store(out, tl.load(out, mask=out_ok, other=0.0) + part, mask=out_ok)


@triton.jit
def _head_dw_kernel(
    h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, y_ptr, coef_ptr, params_ptr, fin_ptr, dw_ptr, db_ptr,
    N, V, H, HT, stride_h, stride_w, stride_th, stride_tw, stride_fin, stride_dw, cap, t_cap,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_T_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_T_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Columns ``[pid BLOCK_V, (pid + 1) BLOCK_V)``: ``dW[cols] = sum over token blocks of
    G^T h[rows]`` (fp32, ``dW`` zero on entry) and ``db[cols] = sum G``, token blocks in order."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    c, ct, eps, lam = load_params(params_ptr)
    offs = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_H)
    db = tl.zeros((BLOCK_V,), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + offs.to(tl.int64)
        row_ok = rows < N
        g = _head_grad_tile(h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, y_ptr, coef_ptr, params_ptr, fin_ptr, rows, cols, row_ok, col_ok,
                            V, H, HT, stride_h, stride_w, stride_th, stride_tw, stride_fin, c, ct, eps, cap, t_cap,
                            KIND, SMOOTHING, Z_LOSS, HAS_BIAS, HAS_T_BIAS, HAS_SOFTCAP, HAS_T_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H)
        if HAS_BIAS:
            db = db + tl.sum(g, axis=0)
        g_t = tl.trans(g)
        for k0 in range(0, H, BLOCK_H):
            k = k0 + ks
            k_ok = k < H
            hb = tl.load(h_ptr + rows[:, None] * stride_h + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            out = dw_ptr + cols[:, None] * stride_dw + k[None, :]
            out_ok = col_ok[:, None] & k_ok[None, :]
            part = tl.dot(g_t, hb, input_precision="ieee")
            tl.store(out, tl.load(out, mask=out_ok, other=0.0) + part, mask=out_ok)
    if HAS_BIAS:
        tl.store(db_ptr + cols, db, mask=col_ok)


# ================================================================================================
# Driver
# ================================================================================================

#: The default (BLOCK_N, BLOCK_V, BLOCK_H, num_warps), where :class:`lossspec.HeadTuning`'s
#: ``block_rows``, ``block_vocab``, ``block_hidden``, ``num_warps`` are ``None``: on a GPU
#: (registers and spills: ``scripts/triton_aot_report.py``) and in the interpreter (small, so that
#: the tests' shapes take several blocks of each axis and ragged tails). ``tl.dot`` needs every
#: block >= 16. The fp32 ``ieee`` dot holds its operands' whole ``BLOCK_H`` slice in registers:
#: 32 x 32 x 16 with 4 warps fits; 64 x 64 x 32 spilled up to ~8 KB, 32 x 32 x 32 a few bytes on sm_80.
GPU_BLOCKS: tuple[int, int, int, int] = (32, 32, 16, 4)
INTERPRETER_BLOCKS: tuple[int, int, int, int] = (16, 16, 16, 1)


def blocks(tuning: lossspec.HeadTuning) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_V, BLOCK_H, num_warps)`` of a call: ``tuning``'s fields where given, else
    :data:`INTERPRETER_BLOCKS` (interpreted) or :data:`GPU_BLOCKS`."""
    default = INTERPRETER_BLOCKS if _triton.INTERPRETED else GPU_BLOCKS
    given = (tuning.block_rows, tuning.block_vocab, tuning.block_hidden, tuning.num_warps)
    return tuple(d if g is None else int(g) for g, d in zip(given, default))  # type: ignore[return-value]


#: ``.maxnreg`` of the GPU launches: without it ptxas aims at a higher occupancy (64-128 registers)
#: and spills a few bytes (8-32 B on sm_80); with it none of the head kernels spills.
MAXNREG: int = 255

KERNELS: dict[str, Any] = {"head_forward": _head_forward_kernel, "head_dh": _head_dh_kernel, "head_dw": _head_dw_kernel}


def softcaps(config: LossConfig) -> tuple[Optional[float], Optional[float]]:
    """``(logit_softcap, teacher_logit_softcap)`` of ``config`` (``None`` where absent or unset)."""
    return getattr(config, "logit_softcap", None), getattr(config, "teacher_logit_softcap", None)


def constexprs(config: LossConfig, has_bias: bool, has_t_bias: bool, blocks: tuple[int, int, int, int] = GPU_BLOCKS) -> dict[str, Any]:
    """The ``tl.constexpr`` arguments of the head kernels for a call (shared with the AOT report)."""
    cap, t_cap = softcaps(config)
    ce = config.has_labels
    return {
        "KIND": lossspec.KIND_IDS[config.kind],
        "SMOOTHING": ce and config.label_smoothing > 0,
        "Z_LOSS": ce and config.z_loss > 0,
        "HAS_BIAS": has_bias,
        "HAS_T_BIAS": has_t_bias,
        "HAS_SOFTCAP": cap is not None,
        "HAS_T_SOFTCAP": config.is_distill and t_cap is not None,
        "BLOCK_N": blocks[0],
        "BLOCK_V": blocks[1],
        "BLOCK_H": blocks[2],
    }


def _rows(a: Tensor) -> Tensor:
    """``a`` with a unit stride along its last axis (the kernels' addressing)."""
    return a if a.stride(-1) == 1 else a.contiguous()


def head_forward(
    config: LossConfig,
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Optional[Tensor],
    teacher: Optional[tuple],
    coef: Tensor,
    *,
    need_grad: bool,
    tuning: lossspec.HeadTuning = lossspec.DEFAULT_HEAD_TUNING,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``torchloss.head.head_forward`` on the Triton kernels (fp32, fp16, bf16 inputs).

    Returns ``(l [N], dh [N, H], dW [V, H], db [V] | None)`` in fp32: the per-token loss (0 where
    ``coef == 0``) and, with ``need_grad``, the gradients of ``sum_i coef_i l_i``. Three
    launches: the forward (loss and final statistics), ``dh`` over token blocks and ``dW``,
    ``db`` over vocabulary blocks. Of ``tuning`` (:class:`lossspec.HeadTuning`) the kernels read
    the tiles ``block_rows``, ``block_vocab``, ``block_hidden`` and ``num_warps``, ``num_stages``
    (:func:`blocks`); the torch path's memory plan and bf16 matmul fields are not used.
    """
    _triton.check_runnable(hidden)
    n, width = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    f32 = torch.float32
    hidden, weight = _rows(hidden.detach()), _rows(weight.detach())
    bias = None if bias is None else bias.detach().contiguous()
    if config.is_distill:
        th, tw, tb = _rows(teacher[0].detach()), _rows(teacher[1].detach()), teacher[2]
        tb = None if tb is None else tb.detach().contiguous()
    else:  # no teacher: the student's arrays as dummy pointers, never read
        th, tw, tb = hidden, weight, None
    y = labels if config.has_labels else coef  # coef: a dummy pointer, never read
    coef = coef.detach().to(f32).contiguous()
    loss = torch.zeros(n, dtype=f32, device=device)
    fin = torch.zeros((len(lossspec.FINAL_STATS), n), dtype=f32, device=device)
    dh = torch.zeros((n, width), dtype=f32, device=device) if need_grad else None
    dw = torch.zeros((vocab, width), dtype=f32, device=device) if need_grad else None
    db = torch.zeros(vocab, dtype=f32, device=device) if (need_grad and bias is not None) else None
    if n == 0:
        return loss, dh, dw, db
    cap, t_cap = softcaps(config)
    tiles = blocks(tuning)
    meta = constexprs(config, bias is not None, tb is not None, tiles)
    block_n, block_v, _, warps = tiles
    params = _triton.params_for(config, f32, device)
    head = (hidden, weight, bias if bias is not None else weight, th, tw, tb if tb is not None else tw, y, coef, params)
    sizes = (n, vocab, width, th.shape[1], hidden.stride(0), weight.stride(0), th.stride(0), tw.stride(0), fin.stride(0))
    caps = (1.0 if cap is None else float(cap), 1.0 if t_cap is None else float(t_cap))
    launch = {"num_warps": warps}
    if tuning.num_stages is not None:
        launch["num_stages"] = tuning.num_stages
    guard = contextlib.ExitStack()
    if not _triton.INTERPRETED:
        launch["maxnreg"] = MAXNREG
    else:
        # Masked lanes are evaluated by NumPy (-inf - -inf): values the kernels discard by design.
        guard.enter_context(np.errstate(all="ignore"))
        guard.enter_context(_triton.INTERPRETER_LOCK)
    with guard:
        _head_forward_kernel[(triton.cdiv(n, block_n),)](*head, loss, fin, *sizes, *caps, **meta, **launch)
        if need_grad:
            _head_dh_kernel[(triton.cdiv(n, block_n),)](*head, fin, dh, *sizes, dh.stride(0), *caps, **meta, **launch)
            db_arg = db if db is not None else dw
            _head_dw_kernel[(triton.cdiv(vocab, block_v),)](*head, fin, dw, db_arg, *sizes, dw.stride(0), *caps, **meta, **launch)
    return loss, dh, dw, db
