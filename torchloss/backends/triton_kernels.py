"""The Triton kernels of ``impl="triton"``, one per job (no jaxloss twin: the Pallas kernels sit in pallas.py with their driver).

Four kernels (listed below) over shared ``@triton.jit`` helpers.

The formulation is :mod:`lossspec.stats` (the same in ``torchloss._block`` and ``jaxloss``): per
row, in the compute dtype ``ACC`` (fp32; fp64 for fp64 logits), with ``c = logit_scale / T``,
``ct = teacher_logit_scale / T``, ``m = max x``, ``mt = max t``, ``e = exp(c (x - m))``,
``et = exp(ct (t - mt))`` (subtract the maximum, *then* scale: huge logits lose nothing)::

    m, s = sum e                      all kinds
    x_y, sum_shift = sum (x - m), n   cross-entropy (the last two with label smoothing)
    mt, st = sum et                   distillation
    a = sum et (x - m)                soft cross-entropy, forward KL
    b = sum et (t - mt)               forward KL
    tau, e_d = sum e D                reverse KL, D = c (x - m) - ct (t - tau)
    h = sum e (x - m)                 entropy
    kl_qm, kl_pm                      jensen_shannon, a second pass (:func:`_row_mixture`): the
                                      mixture M = beta p + (1 - beta) q needs the global lse's

``tau`` (the pivot) is the teacher's raw logit at the student's argmax; on ties of the maximum the
*first* tying column (``argmax`` semantics; an earlier block keeps its pivot). ``D`` is exactly 0 on the argmax, the entry that
carries the probability mass, so the gradient ``q (D - e_d / s)`` never subtracts large numbers.

Kernels (one program per row; ``row`` offsets are int64; the vocabulary is walked in blocks of
``BLOCK_V`` columns: the full blocks unmasked, then the ragged tail, if any, as one masked step:
the *peeled* tail; with a soft cap every block takes the masked step, whose peeled copy spilled)::

    fused_kernel        pass 1 (online statistics), finalize, pass 2 (gradient): the forward;
                         with WRITE_FINAL also each row's final statistics (for regrad_kernel)
    regrad_kernel       pass 2 alone, from the forward's final statistics, for rows whose
                         upstream gradient (read on the device) is not exactly 1, with
                         coef * upstream (16-bit backward)
    shard_stats_kernel  pass 1 of a vocabulary shard: lossspec statistics out (vocab-parallel)
    shard_grad_kernel   pass 2 of a shard from the global final statistics (vocab-parallel)

Helpers: :func:`_row_stats` (pass 1; a block: :func:`_stats_block`), :func:`finalize` (loss and
what pass 2 needs), :func:`_row_mixture` (jensen_shannon's second pass, a block:
:func:`_mixture_block`, per entry :func:`mixture_log_ratios`), :func:`_row_grad` (the gradient
pass, a block: :func:`_grad_block`), :func:`_zero_row`, :func:`_round_for_store`, :func:`shift`,
:func:`shift2` (base 2), :func:`weighted_shift` / :func:`weighted_log` (a weighted term that is 0
at weight 0, without a select).

The statistics passes keep their sums per *lane*: ``VEC`` adjacent columns of every block (one
16-byte load, ``VEC = min(16 / itemsize, BLOCK_V)`` from the driver) that one thread holds and
reduces alone, ``[BLOCK_V // VEC]`` partial sums added up once per row; a block's only
cross-thread reductions are its maxima (``tl.max``; reverse KL's with its pivot column in one
``tl.reduce``, :func:`_argmax_max` / :func:`_pivot_max`, and its sums in one, :func:`_add3`:
separate, they spilled on sm_80). The other kinds' reductions are ``tl.max`` / ``tl.sum``: the
interpreter runs a ``tl.reduce`` with a combine of ours element by element in Python.

Soft caps (``lossspec.stats``): with ``SOFTCAP`` / ``TEACHER_SOFTCAP`` (``constexpr``; the caps
themselves are runtime scalars of the parameter tensor) every block of raw logits is replaced
by ``cap * tanh(x / cap)`` in ``ACC`` as it is loaded (:func:`_load_logits`; ``+-inf``, NaN and
the ragged tail's ``-inf`` kept), the fused kernels cap the label's logit ``x_y`` before
:func:`finalize` (the shard statistics hand it out raw: ``lossspec.stats.finalize`` caps it), and
:func:`_row_grad` multiplies the gradient by the slope (``softcap_slope``, from the raw logits) before the one
rounding. Off, the branches are not compiled in: the code is that of a call without caps.

Rows with ``coef == 0`` are skipped (loss 0, gradient 0, empty statistics). NaN or ``+inf`` in a
row (student or teacher) leaves ``s`` (or ``st``) NaN, whatever a GPU ``max`` does with NaN (the
flag is read from the sums after pass 1, :func:`_row_stats`): the loss is NaN and, where
``coef != 0``, the whole gradient row is NaN.

Exponentials are ``exp2`` with ``log2(e)`` folded into the scale once per row (``c2 = LOG2E c``;
jensen_shannon's ``p`` and soft term too);
cross-entropy's one-hot term is added to the label's entry once after pass 2 (a fix-up store
behind a barrier), not compared for at every entry; bf16 gradients are rounded to nearest even
by the cast on a GPU and by hand only in the interpreter (``ROUND_BF16``). Instructions per
entry: ``scripts/triton_aot_report.py --instructions-only``, ``docs/triton_kernels.md``.

Constants shared with Python are ``tl.constexpr`` globals derived from :mod:`lossspec`: the kind
ids (:data:`lossspec.KIND_IDS`), the row index of each statistic in the shard-statistics buffer
(:data:`lossspec.ROW_STAT_INDEX`) and in the final-statistics buffer
(:data:`lossspec.FINAL_STAT_INDEX`), and the slots of the scalar parameters (:data:`PARAMS`).
Both buffers are statistic-major, ``[len(ROW_STATS), N]`` and ``[len(FINAL_STATS), N]``, so
every statistic is a contiguous ``[N]`` tensor (what collectives and ``torchloss._block`` use).

Import this module only after ``TRITON_INTERPRET`` is decided (``torchloss.backends.triton`` does it).
"""

from __future__ import annotations

import triton
import triton.language as tl

import lossspec

# --- Kinds (``if KIND == REVERSE_KL``, never a bare number) -------------------------------------
CROSS_ENTROPY = tl.constexpr(lossspec.KIND_IDS["cross_entropy"])
SOFT_CROSS_ENTROPY = tl.constexpr(lossspec.KIND_IDS["soft_cross_entropy"])
FORWARD_KL = tl.constexpr(lossspec.KIND_IDS["forward_kl"])
REVERSE_KL = tl.constexpr(lossspec.KIND_IDS["reverse_kl"])
ENTROPY = tl.constexpr(lossspec.KIND_IDS["entropy"])
JENSEN_SHANNON = tl.constexpr(lossspec.KIND_IDS["jensen_shannon"])

# --- Scalar parameters: a tiny tensor in the compute dtype (exact for fp64) ----------------------
# scale, teacher scale, label smoothing, z-loss; jensen_shannon's beta, log(beta), log(1 - beta);
# the soft caps of the student and the teacher (read only with SOFTCAP / TEACHER_SOFTCAP)
PARAMS: tuple[str, ...] = ("c", "ct", "eps", "lam", "beta", "log_beta", "log_rest", "cap", "teacher_cap")
P_C = tl.constexpr(PARAMS.index("c"))
P_CT = tl.constexpr(PARAMS.index("ct"))
P_EPS = tl.constexpr(PARAMS.index("eps"))
P_LAM = tl.constexpr(PARAMS.index("lam"))
P_BETA = tl.constexpr(PARAMS.index("beta"))
P_LOG_BETA = tl.constexpr(PARAMS.index("log_beta"))
P_LOG_REST = tl.constexpr(PARAMS.index("log_rest"))
P_CAP = tl.constexpr(PARAMS.index("cap"))
P_TEACHER_CAP = tl.constexpr(PARAMS.index("teacher_cap"))


# The most negative finite float32 (weighted_log's stand-in for -inf and NaN where the weight is 0).
LOWEST = tl.constexpr(-3.4028234663852886e38)

# exp(c v) = exp2(LOG2E c v): the loops fold LOG2E into the scale once per row, so an entry costs
# one multiply before the hardware's exp2 (ex2.approx.ftz; tl.exp adds a multiply and a
# subnormal-range fix-up per entry).
LOG2E = tl.constexpr(1.4426950408889634)

# tanh without libdevice (the interpreter has none): lossspec.stats.tanh's arithmetic, the series
# below TANH_SERIES_LIMIT, (1 - e) / (1 + e) with e = exp(-2 |u|) above it.
_TANH = lossspec.stats.TANH_SERIES
TANH_SERIES_LIMIT = tl.constexpr(lossspec.stats.TANH_SERIES_LIMIT)
TANH_C1 = tl.constexpr(_TANH[1])
TANH_C2 = tl.constexpr(_TANH[2])
TANH_C3 = tl.constexpr(_TANH[3])
TANH_C4 = tl.constexpr(_TANH[4])
TANH_C5 = tl.constexpr(_TANH[5])
TANH_C6 = tl.constexpr(_TANH[6])
TANH_C7 = tl.constexpr(_TANH[7])

# --- Shard statistics out: buffer [len(ROW_STATS), N], row ROW_<name> holds stat <name> ----------
_ROW = lossspec.ROW_STAT_INDEX
ROW_M = tl.constexpr(_ROW["m"])
ROW_S = tl.constexpr(_ROW["s"])
ROW_X_Y = tl.constexpr(_ROW["x_y"])
ROW_SUM_SHIFT = tl.constexpr(_ROW["sum_shift"])
ROW_N = tl.constexpr(_ROW["n"])
ROW_MT = tl.constexpr(_ROW["mt"])
ROW_ST = tl.constexpr(_ROW["st"])
ROW_A = tl.constexpr(_ROW["a"])
ROW_B = tl.constexpr(_ROW["b"])
ROW_TAU = tl.constexpr(_ROW["tau"])
ROW_E_D = tl.constexpr(_ROW["e_d"])
ROW_H = tl.constexpr(_ROW["h"])
# jensen_shannon's second-pass sums: the fused kernels keep them in registers; vocab-parallel
# computes them outside the kernels (torchloss.backends.vocab_parallel.mixture_shards).
ROW_KL_QM = tl.constexpr(_ROW["kl_qm"])
ROW_KL_PM = tl.constexpr(_ROW["kl_pm"])

# --- Final statistics (shard_grad_kernel and regrad_kernel in, fused_kernel out with WRITE_FINAL):
# buffer [len(FINAL_STATS), N] ----------------------------------------------------------------------
_FIN = lossspec.FINAL_STAT_INDEX
FIN_M = tl.constexpr(_FIN["m"])
FIN_S = tl.constexpr(_FIN["s"])
FIN_MT = tl.constexpr(_FIN["mt"])
FIN_ST = tl.constexpr(_FIN["st"])
FIN_Q_COEF = tl.constexpr(_FIN["q_coef"])
FIN_TAU = tl.constexpr(_FIN["tau"])
FIN_MEAN_D = tl.constexpr(_FIN["mean_d"])
FIN_MEAN_H = tl.constexpr(_FIN["mean_h"])
FIN_KL_QM = tl.constexpr(_FIN["kl_qm"])

_KIND_NAMES = ("CROSS_ENTROPY", "SOFT_CROSS_ENTROPY", "FORWARD_KL", "REVERSE_KL", "ENTROPY", "JENSEN_SHANNON")
assert sorted(lossspec.KIND_IDS.values()) == sorted(globals()[n].value for n in _KIND_NAMES), "kind ids drifted"


# ================================================================================================
# Shared helpers
# ================================================================================================


@triton.jit
def finite(m):
    """A maximum usable as a shift (``lossspec``'s ``finite_max``): ``-inf`` (nothing but ``-inf``
    seen) becomes 0, so ``x - m`` is ``-inf`` there instead of NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def shift(m_old, m_new, scale):
    """``(r, delta)`` for moving statistics from the maximum ``m_old`` to ``m_new >= m_old``:
    ``delta = m_old - m_new``, ``r = exp(scale * delta)``; both 0 where ``m_old == -inf`` (nothing
    seen: the sums are 0, and ``-inf - -inf`` must not make them NaN)."""
    empty = m_old == float("-inf")
    delta = tl.where(empty, 0.0, finite(m_old) - finite(m_new))
    r = tl.where(empty, 0.0, tl.exp(scale * delta))
    return r, delta


@triton.jit
def shift2(m_old, m_new, scale2):
    """:func:`shift` with the exponential in base 2: ``scale2 = LOG2E * scale``,
    ``r = exp2(scale2 * delta)``."""
    empty = m_old == float("-inf")
    delta = tl.where(empty, 0.0, finite(m_old) - finite(m_new))
    r = tl.where(empty, 0.0, tl.exp2(scale2 * delta))
    return r, delta


@triton.jit
def _argmax_max(v1, i1, w1, v2, i2, w2):
    """Combine of reverse KL's block reduction: ``(max v, its first column, max w)``
    (``tl.max(v, return_indices=True, return_indices_tie_break_left=True)``'s rule: the larger
    value, the smaller column on ties, so the result does not depend on the reduction's order)."""
    gt = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(gt, v1, v2), tl.where(gt, i1, i2), tl.maximum(w1, w2)


@triton.jit
def _pivot_max(v1, i1, a1, w1, v2, i2, a2, w2):
    """:func:`_argmax_max` carrying ``a`` (the capped teacher at the column) along."""
    gt = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(gt, v1, v2), tl.where(gt, i1, i2), tl.where(gt, a1, a2), tl.maximum(w1, w2)


@triton.jit
def _add3(a, b, c, d, e, f):
    """Combine of reverse KL's three per-lane sums reduced together."""
    return a + d, b + e, c + f


@triton.jit
def weighted_shift(w, v):
    """``w v`` where the weight ``w`` (an exponential, ``>= 0``) is > 0, and 0 where it is 0, for
    ``v <= 0`` (a logit minus its maximum, ``-inf`` at a ``-inf`` logit): the product is ``<= 0``
    wherever it is a number, and its only NaN in a clean row is ``0 * -inf`` (an entry of
    probability 0 at a ``-inf`` logit), so ``min(w v, 0)`` with the NaN-dropping minimum
    (``min.f32``; ``np.fmin`` interpreted) is the select ``where(w > 0, w v, 0)`` in two operations,
    not three. It differs only where ``w`` or ``v`` is NaN, i.e. in a bad row, whose loss and
    gradient are NaN from ``s`` / ``st`` whatever this sum holds."""
    return tl.minimum(w * v, 0.0)


@triton.jit
def _tanh(u):
    """``tanh(u)`` from ``exp``: ``lossspec.stats.tanh``, the same operations."""
    return _tanh_of(u, tl.exp(-2.0 * tl.abs(u)))


@triton.jit
def _tanh_of(u, e):
    """:func:`_tanh` given ``e = exp(-2 |u|)`` (shared with the soft cap's slope)."""
    z = u * u
    series = TANH_C7
    series = series * z + TANH_C6
    series = series * z + TANH_C5
    series = series * z + TANH_C4
    series = series * z + TANH_C3
    series = series * z + TANH_C2
    series = series * z + TANH_C1
    small = u + u * (z * series)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(u < 0, -big, big)
    return tl.where(tl.abs(u) < TANH_SERIES_LIMIT, small, big)


@triton.jit
def softcap(v, cap):
    """``cap * tanh(v / cap)`` on finite entries; ``+-inf`` and NaN unchanged (``lossspec.stats.softcap``)."""
    return tl.where(v - v == 0, cap * _tanh(v / cap), v)


@triton.jit
def _softcap_with_slope(v, cap):
    """``(cap * tanh(v / cap), slope)``: :func:`softcap` (the same operations) and
    :func:`softcap_slope` of the raw ``v``, sharing ``u = v / cap`` and ``e = exp(-2 |u|)``."""
    u = v / cap
    e = tl.exp(-2.0 * tl.abs(u))
    capped = tl.where(v - v == 0, cap * _tanh_of(u, e), v)
    return capped, tl.fdiv(4.0 * e, (1.0 + e) * (1.0 + e), ieee_rounding=False)


@triton.jit
def softcap_slope(v, cap):
    """``d/dv cap tanh(v / cap) = 4 e / (1 + e)^2``, ``e = exp(-2 |v / cap|)``, from the raw ``v``
    (``lossspec.stats.softcap_slope``: no cancellation near saturation; 0 at ``+-inf``). The
    division is the fast one (``div.full.f32``, within 2 ulps on a GPU; exact in the
    interpreter): the IEEE division's subroutine made the 16-warp kernels spill."""
    e = tl.exp(-2.0 * tl.abs(v / cap))
    return tl.fdiv(4.0 * e, (1.0 + e) * (1.0 + e), ieee_rounding=False)


@triton.jit
def _load_logits(row_ptr, cols, V, params_ptr, CAP_SLOT: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr,
                 MASKED: tl.constexpr):
    """A block of logits in ``ACC``, soft-capped with the cap in ``params[CAP_SLOT]`` when
    ``SOFTCAP``. Every column is ``< V`` unless ``MASKED`` (the ragged tail, whose columns from
    ``V`` on read ``-inf``): full blocks load without a mask."""
    if MASKED:
        v = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(ACC)
    else:
        v = tl.load(row_ptr + cols).to(ACC)
    if SOFTCAP:
        v = softcap(v, tl.load(params_ptr + CAP_SLOT))
    return v


@triton.jit
def load_params(params_ptr):
    """``(c, ct, eps, lam)`` from the parameter tensor (compute dtype)."""
    c = tl.load(params_ptr + P_C)
    ct = tl.load(params_ptr + P_CT)
    eps = tl.load(params_ptr + P_EPS)
    lam = tl.load(params_ptr + P_LAM)
    return c, ct, eps, lam


@triton.jit
def load_mixture_params(params_ptr):
    """``(beta, log(beta), log(1 - beta))`` of jensen_shannon (``0 < beta < 1``; logs from the host)."""
    beta = tl.load(params_ptr + P_BETA)
    log_beta = tl.load(params_ptr + P_LOG_BETA)
    log_rest = tl.load(params_ptr + P_LOG_REST)
    return beta, log_beta, log_rest


@triton.jit
def mixture_log_ratios(diff, log_beta, log_rest):
    """``(log q - log M, log p - log M)`` from ``diff = log q - log p``, ``M = beta p + (1 - beta) q``
    (``lossspec.stats.mixture_log_ratios``): ``log M = max(a, b) + log(1 + exp(-|a - b|))`` with
    ``a = log((1 - beta) q)``, ``b = log(beta p)``, so each ratio is a ``min`` of two bounded terms
    minus the soft part; NaN only where ``p = q = 0`` (the callers weight it by 0)."""
    # exp2 with log2(e) folded (the flush of results below 2**-126 is invisible in 1 + y)
    soft = tl.log(1.0 + tl.exp2(-tl.abs(diff + (log_rest - log_beta)) * LOG2E))
    q_side = diff - log_beta
    p_side = -diff - log_rest
    # min(side, bound) with the NaN-dropping minimum: lossspec's where(side < bound, side, bound)
    # bit for bit (NaN gives the bound in both), one operation instead of a compare and a select
    log_qm = tl.minimum(q_side, -log_rest) - soft
    log_pm = tl.minimum(p_side, -log_beta) - soft
    return log_qm, log_pm


@triton.jit
def weighted_log(w, v):
    """``where(w > 0, w v, 0)`` for a weight ``w >= 0`` (a probability) and a log-ratio ``v`` of
    :func:`mixture_log_ratios` that is finite wherever ``w > 0``: ``w max(v, LOWEST)`` with the
    NaN-dropping maximum. Where ``w == 0``, ``v`` may be ``-inf`` or NaN (``p = q = 0``) and
    becomes ``LOWEST`` (finite), so the product is 0, not NaN; where ``w > 0`` nothing changes.
    Two operations, not three (compare, multiply, select)."""
    return w * tl.maximum(v, LOWEST)


@triton.jit
def _mixture_block(
    x_row, t_row, params_ptr, V, v0, m, lse, mt, lse_t, c, ct, log_beta, log_rest,
    SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The terms of :func:`_row_mixture` of the columns ``[v0, v0 + BLOCK_V)`` (``MASKED``: the
    ragged tail), summed per lane (``[BLOCK_V // VEC]``, as in :func:`_stats_block`):
    ``(sum q (log q - log M), sum p (log p - log M))``."""
    cols = v0 + tl.arange(0, BLOCK_V // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    x = _load_logits(x_row, cols, V, params_ptr, P_CAP, SOFTCAP, ACC, MASKED)
    t = _load_logits(t_row, cols, V, params_ptr, P_TEACHER_CAP, TEACHER_SOFTCAP, ACC, MASKED)
    log_q = c * (x - m) - lse
    log_p = ct * (t - mt) - lse_t
    q = tl.exp2(log_q * LOG2E)
    p = tl.exp2(log_p * LOG2E)
    log_qm, log_pm = mixture_log_ratios(log_q - log_p, log_beta, log_rest)
    return tl.sum(weighted_log(q, log_qm), axis=1), tl.sum(weighted_log(p, log_pm), axis=1)


@triton.jit
def _row_mixture(
    x_row, t_row, params_ptr, V, m, lse, mt, lse_t, c, ct, log_beta, log_rest,
    SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr,
    STAGES: tl.constexpr,
):
    """jensen_shannon's second pass over one row: ``(kl_qm, kl_pm) = (sum q (log q - log M),
    sum p (log p - log M))`` from the global ``m``, ``lse = log s``, ``mt``, ``lse_t = log st``
    of pass 1 (``lossspec.stats``); an entry's term is 0 where its weight is 0. Full blocks, then
    the ragged tail (:func:`_mixture_block`), summed per lane and over the lanes once."""
    kl_qm = tl.zeros((BLOCK_V // VEC,), ACC)
    kl_pm = tl.zeros((BLOCK_V // VEC,), ACC)
    if SOFTCAP or TEACHER_SOFTCAP:
        for v0 in tl.range(0, V, BLOCK_V, num_stages=STAGES):  # every block masked (a peeled copy of the capped step spilled)
            qm, pm = _mixture_block(x_row, t_row, params_ptr, V, v0, m, lse, mt, lse_t, c, ct, log_beta, log_rest,
                                    SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, True)
            kl_qm = kl_qm + qm
            kl_pm = kl_pm + pm
    else:
        full = (V // BLOCK_V) * BLOCK_V
        for v0 in tl.range(0, full, BLOCK_V, num_stages=STAGES):
            qm, pm = _mixture_block(x_row, t_row, params_ptr, V, v0, m, lse, mt, lse_t, c, ct, log_beta, log_rest,
                                    SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, False)
            kl_qm = kl_qm + qm
            kl_pm = kl_pm + pm
        if full < V:
            qm, pm = _mixture_block(x_row, t_row, params_ptr, V, full, m, lse, mt, lse_t, c, ct, log_beta, log_rest,
                                    SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, True)
            kl_qm = kl_qm + qm
            kl_pm = kl_pm + pm
    return tl.sum(kl_qm, axis=0), tl.sum(kl_pm, axis=0)


@triton.jit
def _stats_block(
    x_row, t_row, params_ptr, V, v0, c, ct, c2, ct2, m, s, sum_shift, mt, st, a, b, tau, e_d, h,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr, MASKED: tl.constexpr,
):
    """:func:`_row_stats`' step: the columns ``[v0, v0 + BLOCK_V)`` folded into the maxima ``m``,
    ``mt``, the pivot ``tau`` (scalars) and the sums ``s, sum_shift, st, a, b, e_d, h``, which are
    per-lane partial sums (``[BLOCK_V // VEC]``; lane ``l`` holds columns ``[l VEC, (l + 1) VEC)``
    of every block, ``VEC`` adjacent columns that one thread loads and reduces alone), so a block
    costs no cross-thread reduction for its sums; ``c2 = LOG2E c``, ``ct2 = LOG2E ct``. ``MASKED``:
    the ragged tail, whose columns from ``V`` on read ``-inf`` (probability 0, never a maximum,
    never a pivot); a full block needs no mask, no ``-inf`` fill and no column compare."""
    cols = v0 + tl.arange(0, BLOCK_V // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    x = _load_logits(x_row, cols, V, params_ptr, P_CAP, SOFTCAP, ACC, MASKED)
    # The block's maxima: over each lane's VEC columns (in-thread), then over the lanes.
    if KIND != REVERSE_KL:
        block_m = tl.max(tl.max(x, axis=1), axis=0)
    if KIND != CROSS_ENTROPY and KIND != ENTROPY:
        t = _load_logits(t_row, cols, V, params_ptr, P_TEACHER_CAP, TEACHER_SOFTCAP, ACC, MASKED)
        # In-thread reductions (over each lane's VEC columns) are tl.max / tl.sum where they can
        # be: the Triton interpreter runs a tl.reduce with a combine function of ours element by
        # element in Python (with every maximum and sum fused so, the suite's interpreted kernels
        # took 3 minutes longer), and fused maxima saved ~1% of the instructions on sm_90.
        # Reverse KL keeps its combines (maxima and pivot column, in-thread and across the lanes;
        # its three sums below): every separate form tried spilled on sm_80.
        if (KIND == REVERSE_KL) and TEACHER_SOFTCAP:
            # the capped teacher at the pivot carried along (the cap of one value computed apart
            # need not give the block's bits interpreted)
            lane_m, lane_first, lane_tau, lane_mt = tl.reduce((x, cols, t, t), 1, _pivot_max)
            block_m, first, block_tau, block_mt = tl.reduce((lane_m, lane_first, lane_tau, lane_mt), 0, _pivot_max)
        elif KIND == REVERSE_KL:
            lane_m, lane_first, lane_mt = tl.reduce((x, cols, t), 1, _argmax_max)
            block_m, first, block_mt = tl.reduce((lane_m, lane_first, lane_mt), 0, _argmax_max)
            # the teacher at the pivot: one load of a column just read (a cache hit), cheaper
            # than carrying it through the reduction
            if MASKED:
                # a NaN maximum (a bad row) may name a tail column
                block_tau = tl.load(t_row + first, mask=first < V, other=float("-inf")).to(ACC)
            else:
                block_tau = tl.load(t_row + first).to(ACC)
        else:
            block_mt = tl.max(tl.max(t, axis=1), axis=0)
    m_new = tl.maximum(m, block_m)
    r, dm = shift2(m, m_new, c2)
    u = x - finite(m_new)  # -inf on -inf logits and on the tail
    e = tl.exp2(c2 * u)
    # Each lane's sums over its VEC columns (in-thread: no barrier).
    if KIND == CROSS_ENTROPY:
        if SMOOTHING:
            if MASKED:
                u = tl.where(cols < V, u, 0.0)  # the tail's -inf columns are no columns
            sum_e, sum_u = tl.sum(e, axis=1), tl.sum(u, axis=1)
            # each lane saw v0 / (BLOCK_V / VEC) columns before this block (the tail comes last)
            sum_shift = sum_shift + ((v0 // (BLOCK_V // VEC)) * 1.0) * dm + sum_u
        else:
            sum_e = tl.sum(e, axis=1)
    elif KIND == ENTROPY:
        sum_e, sum_h = tl.sum(e, axis=1), tl.sum(weighted_shift(e, u), axis=1)
        h = r * (h + s * dm) + sum_h
    else:
        mt_new = tl.maximum(mt, block_mt)
        rt, dmt = shift2(mt, mt_new, ct2)
        ut = t - finite(mt_new)
        et = tl.exp2(ct2 * ut)
        if KIND == JENSEN_SHANNON:
            sum_e, sum_et = tl.sum(e, axis=1), tl.sum(et, axis=1)
        if KIND == SOFT_CROSS_ENTROPY:
            sum_e, sum_et, sum_a = tl.sum(e, axis=1), tl.sum(et, axis=1), tl.sum(weighted_shift(et, u), axis=1)
            a = rt * (a + st * dm) + sum_a
        if KIND == FORWARD_KL:
            sum_e, sum_et = tl.sum(e, axis=1), tl.sum(et, axis=1)
            sum_a, sum_b = tl.sum(weighted_shift(et, u), axis=1), tl.sum(weighted_shift(et, ut), axis=1)
            a = rt * (a + st * dm) + sum_a
            b = rt * (b + st * dmt) + sum_b
        if KIND == REVERSE_KL:
            # The pivot rule of lossspec.stats: the first column of the maximum (an earlier
            # block keeps it on ties), block_tau the teacher's logit there (above).
            tau_new = tl.where(block_m > m, block_tau, tau)
            # Old e_d re-expressed on (m', tau'): D gains c (m - m') - ct (tau - tau'); a prefix
            # with r == 0 (empty, or far below) contributes exactly 0.
            e_d = tl.where(r > 0, r * (e_d + s * (c * dm - ct * (tau - tau_new))), 0.0)
            d = c * u - ct * (t - tau_new)
            # e > 0 keeps D's infinities where the teacher is -inf (no NaN-dropping shortcut)
            # one combine for the three sums (separate tl.sum's spilled on sm_80)
            sum_e, sum_et, sum_d = tl.reduce((e, et, tl.where(e > 0, e * d, 0.0)), 1, _add3)
            e_d = e_d + sum_d
            tau = tau_new
        st = rt * st + sum_et
        mt = mt_new
    s = r * s + sum_e
    m = m_new
    return m, s, sum_shift, mt, st, a, b, tau, e_d, h


@triton.jit
def _row_stats(
    x_row, t_row, params_ptr, V, c, ct,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr,
):
    """Pass 1: the :mod:`lossspec.stats` statistics of one row ``x_row[0:V]`` (teacher ``t_row``),
    online over blocks of ``BLOCK_V`` columns.

    Returns ``(m, s, sum_shift, mt, st, a, b, tau, e_d, h, bad)`` in ``ACC`` with raw maxima
    (``-inf`` when nothing was seen, as lossspec hands them out); statistics the kind does not use
    stay 0. ``bad`` (int32) is 1 when the row holds NaN or ``+inf`` (student, or teacher); ``s`` is
    then NaN.

    Each block is folded in directly relative to the new maxima ``m' = max(m, max block)``,
    ``mt'`` and pivot ``tau'`` (the combine of lossspec with the block's own statistics already
    rebased): with ``(r, dm) = shift(m, m', c)`` and ``(rt, dmt) = shift(mt, mt', ct)``::

        s         <- r s + sum e'                       e'  = exp(c (x - m'))
        sum_shift <- sum_shift + n dm + sum (x - m')    n   = columns seen before the block
        a         <- rt (a + st dm) + sum et' (x - m')  et' = exp(ct (t - mt'))
        b         <- rt (b + st dmt) + sum et' (t - mt')
        st        <- rt st + sum et'
        e_d       <- r (e_d + s (c dm - ct (tau - tau'))) + sum e' (c (x - m') - ct (t - tau'))
        h         <- r (h + s dm) + sum e' (x - m')

    ``tau'``: the block's pivot (the teacher at the first column where ``x`` equals the block's maximum)
    when the block's maximum exceeds ``m``, else (ties included: the earlier column wins)
    ``tau``. Products weighted by an exponential are taken only where the weight is > 0, so an
    entry of probability 0 adds 0, not ``0 * -inf`` (:func:`weighted_shift` for ``a``, ``b``,
    ``h``; a select for reverse KL's ``e D``, whose infinities must stay). The sums are kept per
    lane in the loop (:func:`_stats_block`) and added up once after it.
    """
    neg_inf = tl.full((), float("-inf"), ACC)
    lanes = tl.zeros((BLOCK_V // VEC,), ACC)  # per-lane partial sums (_stats_block)
    m = neg_inf
    s = lanes
    sum_shift = lanes
    mt = neg_inf
    st = lanes
    a = lanes
    b = lanes
    tau = neg_inf
    e_d = lanes
    h = lanes
    c2 = c * LOG2E  # e = exp(c u) = exp2(c2 u)
    ct2 = ct * LOG2E
    if SOFTCAP or TEACHER_SOFTCAP:
        # Every block takes the masked step: a second, peeled copy of the capped step spilled.
        for v0 in tl.range(0, V, BLOCK_V, num_stages=STAGES):
            m, s, sum_shift, mt, st, a, b, tau, e_d, h = _stats_block(
                x_row, t_row, params_ptr, V, v0, c, ct, c2, ct2, m, s, sum_shift, mt, st, a, b, tau, e_d, h,
                KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, True)
    else:
        # Full blocks unmasked, then the ragged tail (if any) masked: one copy of the step each.
        full = (V // BLOCK_V) * BLOCK_V
        for v0 in tl.range(0, full, BLOCK_V, num_stages=STAGES):
            m, s, sum_shift, mt, st, a, b, tau, e_d, h = _stats_block(
                x_row, t_row, params_ptr, V, v0, c, ct, c2, ct2, m, s, sum_shift, mt, st, a, b, tau, e_d, h,
                KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, False)
        if full < V:
            m, s, sum_shift, mt, st, a, b, tau, e_d, h = _stats_block(
                x_row, t_row, params_ptr, V, full, c, ct, c2, ct2, m, s, sum_shift, mt, st, a, b, tau, e_d, h,
                KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, True)
    # The lanes' sums, once per row (every lane is relative to the same m, mt and tau).
    s = tl.sum(s, axis=0)
    st = tl.sum(st, axis=0)
    sum_shift = tl.sum(sum_shift, axis=0)
    a = tl.sum(a, axis=0)
    b = tl.sum(b, axis=0)
    e_d = tl.sum(e_d, axis=0)
    h = tl.sum(h, axis=0)
    # The flag comes from the sums, not from max() (a GPU max may drop a NaN): a NaN entry makes
    # its exponential NaN, a +inf entry makes the maximum +inf and its own x - m NaN, and either
    # stays NaN through every later block (r s, r = NaN after an infinite maximum). Nothing else
    # makes them NaN: x - m' <= 0 elsewhere, so every exponential is in [0, 1]. No per-entry test,
    # no block reduction for the flag.
    bad = tl.where((s != s) | (st != st), 1, 0)
    s = tl.where(bad != 0, float("nan"), s)  # a bad teacher makes s NaN too (the shard statistics' rule)
    return m, s, sum_shift, mt, st, a, b, tau, e_d, h, bad


@triton.jit
def finalize(
    m, s, x_y, sum_shift, mt, st, a, b, tau, e_d, h, bad, V, c, ct, eps, lam,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr,
):
    """Per-token loss and what pass 2 needs, from whole-row statistics (``lossspec.stats``;
    ``lse = log s``, ``lse_t = log st``, ``m``/``mt`` made finite)::

        cross_entropy      l = lse - (1-eps) c (x_y - m) - (eps/V) c sum_shift + lam (lse + c m)^2
        soft_cross_entropy l = lse - c a / st
        forward_kl         l = (ct b / st - lse_t) - (c a / st - lse)
        reverse_kl         l = e_d / s + (lse_t - lse - ct (tau - mt))
        entropy            l = lse - c h / s
        jensen_shannon     0 here: its loss needs the second pass (_row_mixture)

    Returns ``(l, m, mt, q_coef, mean_d, mean_h)`` with ``q_coef = 1 + 2 lam (lse + c m)`` (1
    without z-loss), ``mean_d = e_d / s`` and ``mean_h = h / s``; ``l`` is NaN on a bad row.
    """
    m = finite(m)
    mt = finite(mt)
    lse = tl.log(s)
    q_coef = lse * 0.0 + 1.0
    mean_d = lse * 0.0
    mean_h = lse * 0.0
    if KIND == CROSS_ENTROPY:
        loss = lse - ((1.0 - eps) * c) * (x_y - m)
        if SMOOTHING:
            loss = loss - (eps / V * c) * sum_shift
        if Z_LOSS:
            full_lse = lse + c * m
            loss = loss + lam * full_lse * full_lse
            q_coef = 1.0 + (2.0 * lam) * full_lse
    elif KIND == ENTROPY:
        mean_h = h / s
        loss = lse - c * mean_h
    else:
        lse_t = tl.log(st)
        if KIND == SOFT_CROSS_ENTROPY:
            loss = lse - c * a / st
        elif KIND == FORWARD_KL:
            loss = (ct * b / st - lse_t) - (c * a / st - lse)
        elif KIND == REVERSE_KL:
            mean_d = e_d / s
            loss = mean_d + (lse_t - lse - ct * (tau - mt))
        else:
            loss = lse * 0.0
    loss = tl.where(bad != 0, float("nan"), loss)
    return loss, m, mt, q_coef, mean_d, mean_h


@triton.jit
def _round_for_store(g, ROUND_BF16: tl.constexpr):
    """Round fp32 to bf16, to nearest even, by hand, where ``ROUND_BF16`` (bf16 gradients in the
    interpreter, whose fp32 -> bf16 cast truncates and whose ``rtne`` mode rounds half up): the
    cast on store is then exact. Compiled, the cast itself rounds to nearest even
    (``cvt.rn.bf16.f32``, subnormals kept: the same bits as this rounding, ties and subnormals
    included; ``parity_tests/test_torchloss_triton_aot.py`` checks both), so the driver leaves
    ``ROUND_BF16`` off there (~7 integer operations per entry saved). NaN and inf pass
    unchanged. fp16 needs nothing: both the interpreter (NumPy) and the GPU round it to nearest
    even."""
    if ROUND_BF16:
        bits = g.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        g = tl.where(g != g, g, bits.to(tl.float32, bitcast=True))
    return g


@triton.jit
def _grad_block(
    x_row, t_row, g_row, params_ptr, V, V_total, v0, m, mt, tau, mean_d, mean_h, kl_qm, c, ct, c2, ct2, eps,
    scale, p_scale, t_scale, h_scale, j_scale, lse, lse_t, log_beta, log_rest,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr, ROUND_BF16: tl.constexpr, MASKED: tl.constexpr,
):
    """:func:`_row_grad`'s step: the gradient of the columns ``[v0, v0 + BLOCK_V)`` stored
    (``MASKED``: the ragged tail, stored up to ``V``; a full block loads and stores unmasked)."""
    cols = v0 + tl.arange(0, BLOCK_V)
    x = _load_logits(x_row, cols, V, params_ptr, P_CAP, False, ACC, MASKED)
    if SOFTCAP:
        x, slope = _softcap_with_slope(x, tl.load(params_ptr + P_CAP))
    u = x - m
    e = tl.exp2(c2 * u)
    if KIND == CROSS_ENTROPY:
        g = e * p_scale
        if SMOOTHING:
            g = g - scale * (eps / V_total)
    elif KIND == ENTROPY:
        g = tl.where(e > 0, e * (u - mean_h), 0.0) * h_scale
    else:
        t = _load_logits(t_row, cols, V, params_ptr, P_TEACHER_CAP, TEACHER_SOFTCAP, ACC, MASKED)
        if KIND == REVERSE_KL:
            d = c * u - ct * (t - tau)
            # q == 0 (a -inf logit) is exactly 0: not 0 * inf, not 0 * NaN.
            g = tl.where(e > 0, e * (d - mean_d), 0.0) * p_scale
        elif KIND == JENSEN_SHANNON:
            log_q = c * u - lse
            log_p = ct * (t - mt) - lse_t
            q = tl.exp2(log_q * LOG2E)
            log_qm, log_pm = mixture_log_ratios(log_q - log_p, log_beta, log_rest)
            # where(q > 0, q (log_qm - kl_qm), 0) (weighted_log's clamp; kl_qm is finite, or the
            # row is bad and its scale NaN)
            g = q * (tl.maximum(log_qm, LOWEST) - kl_qm) * j_scale
        else:
            g = e * p_scale - tl.exp2(ct2 * (t - mt)) * t_scale
    if SOFTCAP:
        g = g * slope
    g = _round_for_store(g, ROUND_BF16)
    if MASKED:
        tl.store(g_row + cols, g.to(g_row.dtype.element_ty), mask=cols < V)
    else:
        tl.store(g_row + cols, g.to(g_row.dtype.element_ty))


@triton.jit
def _row_grad(
    x_row, t_row, g_row, params_ptr, y, x_y, scale, m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, bad, V, V_total, c, ct, eps,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr, ROUND_BF16: tl.constexpr, STAGES: tl.constexpr,
):
    """Pass 2: ``g_row[0:V] = scale * dl/dz`` (``scale = coef * c``) from the row's final
    statistics (finite maxima ``m``, ``mt``), formed in ``ACC`` and rounded once on store::

        cross_entropy        q_coef q - (1 - eps) onehot(y) - eps / V_total
        soft CE, forward KL  q - p
        reverse KL           q (D - e_d / s),  D = c (x - m) - ct (t - tau); 0 where q == 0
        entropy              -c q ((x - m) - h / s); 0 where q == 0
        jensen_shannon       (1 - beta) q (log q - log M - kl_qm); 0 where q == 0

    with ``q = e / s``, ``p = et / st``. ``y`` is the label's column in this row (out of
    ``[0, V)`` when another shard owns it) and ``x_y`` its raw logit, read before this pass (which
    may overwrite the logits), ``V_total`` the global vocabulary. The loop writes
    cross-entropy's ``q_coef q - eps / V_total`` everywhere; the label's entry is then written
    once more, from ``x_y`` with the one-hot term added before the one rounding (Liger-Kernel's
    fix-up: no per-entry int64 compare), after a barrier so that it lands last. A bad row
    (``bad != 0``) is NaN everywhere: a NaN loss never comes with a plausible gradient (every
    entry is a product with a scale made NaN here, no per-entry select). With ``SOFTCAP`` ``x``
    is the capped block and the gradient is multiplied by the slope (:func:`softcap_slope` of the
    raw block, 0 at ``+-inf``) before the rounding.

    Without soft caps the blocks are walked from the last to the first, the reverse of pass 1:
    the first blocks read here are the last that pass 1 read, the likeliest still in L2
    (Fast-LLM's order; at 16384 x 131072 bf16 the rows in flight far exceed L2, so in the
    forward order none of the second read hits it). The soft-capped loop keeps the forward
    order: reversed, the bf16 reverse-KL kernels spilled, and the capped kernels are bound by
    their instructions (3 to 10 per entry), not by their bytes.
    """
    scale = tl.where(bad != 0, float("nan"), scale)
    c2 = c * LOG2E  # e = exp(c u) = exp2(c2 u)
    ct2 = ct * LOG2E
    zero = scale * 0.0
    p_scale = scale / s
    t_scale = zero
    h_scale = zero
    j_scale = zero
    lse = zero
    lse_t = zero
    log_beta = zero
    log_rest = zero
    if KIND == CROSS_ENTROPY:
        p_scale = p_scale * q_coef
    if KIND == SOFT_CROSS_ENTROPY or KIND == FORWARD_KL:
        t_scale = scale / st
    if KIND == ENTROPY:
        h_scale = -c * p_scale
    if KIND == JENSEN_SHANNON:
        beta, log_beta, log_rest = load_mixture_params(params_ptr)
        lse = tl.log(s)
        lse_t = tl.log(st)
        j_scale = (1.0 - beta) * scale
    if SOFTCAP or TEACHER_SOFTCAP:
        for v0 in tl.range(0, V, BLOCK_V, num_stages=STAGES):  # every block masked (a peeled copy of the capped step spilled)
            _grad_block(x_row, t_row, g_row, params_ptr, V, V_total, v0, m, mt, tau, mean_d, mean_h, kl_qm, c, ct, c2, ct2, eps,
                        scale, p_scale, t_scale, h_scale, j_scale, lse, lse_t, log_beta, log_rest,
                        KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, ACC, ROUND_BF16, True)
    else:
        # The ragged tail (if any) masked, then the full blocks unmasked, last to first: one
        # copy of the step each (the stores commute; with the tail last ptxas spilled on a bf16
        # reverse KL).
        full = (V // BLOCK_V) * BLOCK_V
        if full < V:
            _grad_block(x_row, t_row, g_row, params_ptr, V, V_total, full, m, mt, tau, mean_d, mean_h, kl_qm, c, ct, c2, ct2, eps,
                        scale, p_scale, t_scale, h_scale, j_scale, lse, lse_t, log_beta, log_rest,
                        KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, ACC, ROUND_BF16, True)
        # int64 (2 instructions a block more than forward, not 7), also where V == 1 makes
        # ``full`` a compile-time 0 (Triton specialises an integer argument equal to 1)
        top = tl.full((), 0, tl.int64) + full - BLOCK_V
        for i in tl.range(0, full, BLOCK_V, num_stages=STAGES):
            v0 = top - i
            _grad_block(x_row, t_row, g_row, params_ptr, V, V_total, v0, m, mt, tau, mean_d, mean_h, kl_qm, c, ct, c2, ct2, eps,
                        scale, p_scale, t_scale, h_scale, j_scale, lse, lse_t, log_beta, log_rest,
                        KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, ACC, ROUND_BF16, False)
    if KIND == CROSS_ENTROPY:
        if (y >= 0) & (y < V):
            # The loop's operations on the label's entry, with the one-hot term in the same FMA
            # the per-entry select fed: e * p_scale + (eps - 1) scale, then the smoothing term.
            x_l = x_y
            if SOFTCAP:
                x_l, slope_l = _softcap_with_slope(x_l, tl.load(params_ptr + P_CAP))
            g_l = tl.exp2(c2 * (x_l - m)) * p_scale + (eps - 1.0) * scale
            if SMOOTHING:
                g_l = g_l - scale * (eps / V_total)
            if SOFTCAP:
                g_l = g_l * slope_l
            g_l = _round_for_store(g_l, ROUND_BF16)
            tl.debug_barrier()  # the loop's store of this entry (another thread's) lands first
            tl.store(g_row + y, g_l.to(g_row.dtype.element_ty))


@triton.jit
def _zero_row(g_row, V, BLOCK_V: tl.constexpr):
    """``g_row[0:V] = 0`` (rows with ``coef == 0``: exact zeros, whatever their logits hold)."""
    offs = tl.arange(0, BLOCK_V)
    zeros = tl.zeros((BLOCK_V,), tl.float32).to(g_row.dtype.element_ty)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        tl.store(g_row + cols, zeros, mask=cols < V)


@triton.jit
def _row_forward(
    x_row, t_row, y_ptr, params_ptr, row, V, c, ct, eps, lam,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr,
):
    """Pass 1 and finalize of one whole row (and jensen_shannon's second pass):
    ``(loss, m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, bad, y, x_y)`` (``y``: the label,
    ``x_y`` its raw logit, cross-entropy; 0 otherwise)."""
    m, s, sum_shift, mt, st, a, b, tau, e_d, h, bad = _row_stats(
        x_row, t_row, params_ptr, V, c, ct, KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, STAGES
    )
    y = tl.full((), 0, tl.int64)
    x_raw = s * 0.0
    x_y = s * 0.0
    if KIND == CROSS_ENTROPY:
        # The caller passes safe labels (0 where the token is masked; this row has coef != 0).
        y = tl.load(y_ptr + row).to(tl.int64)
        x_raw = tl.load(x_row + y).to(ACC)
        x_y = x_raw
        if SOFTCAP:
            x_y = softcap(x_y, tl.load(params_ptr + P_CAP))
    loss, m, mt, q_coef, mean_d, mean_h = finalize(
        m, s, x_y, sum_shift, mt, st, a, b, tau, e_d, h, bad, V, c, ct, eps, lam, KIND, SMOOTHING, Z_LOSS
    )
    kl_qm = s * 0.0
    if KIND == JENSEN_SHANNON:
        beta, log_beta, log_rest = load_mixture_params(params_ptr)
        kl_qm, kl_pm = _row_mixture(
            x_row, t_row, params_ptr, V, m, tl.log(s), mt, tl.log(st), c, ct, log_beta, log_rest, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, STAGES
        )
        loss = tl.where(bad != 0, float("nan"), beta * kl_pm + (1.0 - beta) * kl_qm)
    return loss, m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, bad, y, x_raw


# ================================================================================================
# Kernels, one per job (grid: one program per row)
# ================================================================================================


@triton.jit
def _store_final(
    fin, stride_fin, m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, KIND: tl.constexpr, Z_LOSS: tl.constexpr,
):
    """Store one row's final statistics at ``fin + FIN_<name> * stride_fin``: those that
    :func:`_load_final` reads for ``KIND`` (finite maxima; ``s`` is NaN on a bad row, as
    :func:`_row_stats` leaves it, which is how the loader knows it)."""
    tl.store(fin + FIN_M * stride_fin, m)
    tl.store(fin + FIN_S * stride_fin, s)
    if KIND == CROSS_ENTROPY:
        if Z_LOSS:
            tl.store(fin + FIN_Q_COEF * stride_fin, q_coef)
    elif KIND == ENTROPY:
        tl.store(fin + FIN_MEAN_H * stride_fin, mean_h)
    else:
        tl.store(fin + FIN_MT * stride_fin, mt)
        tl.store(fin + FIN_ST * stride_fin, st)
        if KIND == REVERSE_KL:
            tl.store(fin + FIN_TAU * stride_fin, tau)
            tl.store(fin + FIN_MEAN_D * stride_fin, mean_d)
        if KIND == JENSEN_SHANNON:
            tl.store(fin + FIN_KL_QM * stride_fin, kl_qm)


@triton.jit
def _load_final(fin, stride_fin, KIND: tl.constexpr, Z_LOSS: tl.constexpr):
    """One row's final statistics from ``fin + FIN_<name> * stride_fin`` (``torchloss._block.finalize``'s,
    or :func:`_store_final`'s): ``(m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, bad)``, the
    fields ``KIND`` does not use at their neutral values. A row is bad where ``s`` (or ``st``)
    is NaN."""
    m = tl.load(fin + FIN_M * stride_fin)
    s = tl.load(fin + FIN_S * stride_fin)
    bad = tl.where(s != s, 1, 0)
    zero = s * 0.0
    mt = zero
    st = zero
    q_coef = zero + 1.0
    tau = zero
    mean_d = zero
    mean_h = zero
    kl_qm = zero
    if KIND == CROSS_ENTROPY:
        if Z_LOSS:
            q_coef = tl.load(fin + FIN_Q_COEF * stride_fin)
    elif KIND == ENTROPY:
        mean_h = tl.load(fin + FIN_MEAN_H * stride_fin)
    else:
        mt = tl.load(fin + FIN_MT * stride_fin)
        st = tl.load(fin + FIN_ST * stride_fin)
        bad = bad | tl.where(st != st, 1, 0)
        if KIND == REVERSE_KL:
            tau = tl.load(fin + FIN_TAU * stride_fin)
            mean_d = tl.load(fin + FIN_MEAN_D * stride_fin)
        if KIND == JENSEN_SHANNON:
            kl_qm = tl.load(fin + FIN_KL_QM * stride_fin)
    return m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, bad


@triton.jit
def _grad_from_final(
    x_row, t_row, y_ptr, g_row, params_ptr, fin, stride_fin, row, scale_coef, V, V_total, offset,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    ROUND_BF16: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr,
):
    """Pass 2 of one row (:func:`_row_grad`, ``scale = scale_coef * c``) from its final statistics
    at ``fin`` (:func:`_load_final`): the label (a global id, shifted by ``offset``) and its raw
    logit where this row's columns hold it are read first, before the pass may write over the
    logits."""
    c, ct, eps, lam = load_params(params_ptr)
    m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, bad = _load_final(fin, stride_fin, KIND, Z_LOSS)
    y = tl.full((), 0, tl.int64)
    x_y = s * 0.0
    if KIND == CROSS_ENTROPY:
        y = tl.load(y_ptr + row).to(tl.int64) - offset
        owned = (y >= 0) & (y < V)
        x_y = tl.load(x_row + tl.where(owned, y, 0), mask=owned, other=0.0).to(ACC)
    _row_grad(x_row, t_row, g_row, params_ptr, y, x_y, scale_coef * c, m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, bad,
              V, V_total, c, ct, eps, KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, ACC, ROUND_BF16, STAGES)


@triton.jit
def _fused_row(
    x_ptr, t_ptr, y_ptr, coef_ptr, params_ptr, loss_ptr, grad_ptr, fin_ptr, row, V, stride_x, stride_t, stride_g, stride_fin,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, WRITE_FINAL: tl.constexpr,
    SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
    ACC: tl.constexpr, STAGES: tl.constexpr,
):
    """:func:`fused_kernel`'s work on the row ``row`` (int64)."""
    x_row = x_ptr + row * stride_x
    t_row = t_ptr + row * stride_t
    g_row = grad_ptr + row * stride_g
    coef = tl.load(coef_ptr + row)
    if coef != 0:
        c, ct, eps, lam = load_params(params_ptr)
        loss, m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, bad, y, x_y = _row_forward(
            x_row, t_row, y_ptr, params_ptr, row, V, c, ct, eps, lam, KIND, SMOOTHING, Z_LOSS, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, STAGES
        )
        tl.store(loss_ptr + row, loss)
        if WRITE_FINAL:
            _store_final(fin_ptr + row, stride_fin, m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, KIND, Z_LOSS)
        if WRITE_GRAD:
            _row_grad(x_row, t_row, g_row, params_ptr, y, x_y, coef * c, m, s, mt, st, q_coef, tau, mean_d, mean_h, kl_qm, bad,
                      V, V, c, ct, eps, KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, ACC, ROUND_BF16, STAGES)
    else:
        tl.store(loss_ptr + row, coef * 0.0)
        if WRITE_GRAD:
            _zero_row(g_row, V, BLOCK_V)


@triton.jit
def fused_kernel(
    x_ptr, t_ptr, y_ptr, coef_ptr, params_ptr, loss_ptr, grad_ptr, fin_ptr,
    N, V, stride_x, stride_t, stride_g, stride_fin,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, WRITE_FINAL: tl.constexpr,
    SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
    ACC: tl.constexpr, STAGES: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """The forward: ``loss[row] = l`` (0 where ``coef == 0``, not multiplied by ``coef``) and, with
    ``WRITE_GRAD``, ``grad[row, :] = coef * c * dl/dz`` (0 where ``coef == 0``), for the ``N``
    rows: one program per row, or with ``PERSISTENT`` fewer programs, each taking the rows
    ``pid, pid + programs, ...`` in turn (fewer rows in flight: more of each row's second read
    hits L2). With ``WRITE_FINAL`` each row with ``coef != 0`` also writes its final statistics
    to ``final[FIN_<name>, row]`` (``fin_ptr + FIN_<name> * stride_fin + row``; a few scalars a
    row), what :func:`regrad_kernel` reads instead of a second pass 1.

    Pass 2 reads a block of the logits before it writes the same block of the gradient, so
    ``grad`` may alias the logits (``inplace=True``)."""
    if PERSISTENT:
        for row in tl.range(tl.program_id(0), N, tl.num_programs(0)):
            # int64 before any offset (the interpreter's loop variable is a Python int)
            _fused_row(x_ptr, t_ptr, y_ptr, coef_ptr, params_ptr, loss_ptr, grad_ptr, fin_ptr, tl.full((), 0, tl.int64) + row, V, stride_x,
                       stride_t, stride_g, stride_fin, KIND, SMOOTHING, Z_LOSS, WRITE_GRAD, WRITE_FINAL, SOFTCAP, TEACHER_SOFTCAP, ROUND_BF16,
                       BLOCK_V, VEC, ACC, STAGES)
    else:
        _fused_row(x_ptr, t_ptr, y_ptr, coef_ptr, params_ptr, loss_ptr, grad_ptr, fin_ptr, tl.program_id(0).to(tl.int64), V, stride_x,
                   stride_t, stride_g, stride_fin, KIND, SMOOTHING, Z_LOSS, WRITE_GRAD, WRITE_FINAL, SOFTCAP, TEACHER_SOFTCAP, ROUND_BF16,
                   BLOCK_V, VEC, ACC, STAGES)


@triton.jit
def _regrad_row(
    x_ptr, t_ptr, y_ptr, coef_ptr, up_ptr, params_ptr, fin_ptr, grad_ptr, row, V, stride_x, stride_t, stride_g, stride_up, stride_fin,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    ROUND_BF16: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr,
):
    """:func:`regrad_kernel`'s work on the row ``row`` (int64)."""
    coef = tl.load(coef_ptr + row)
    up = tl.load(up_ptr + row * stride_up)
    if (coef != 0) & (up != 1):
        _grad_from_final(x_ptr + row * stride_x, t_ptr + row * stride_t, y_ptr, grad_ptr + row * stride_g, params_ptr, fin_ptr + row,
                         stride_fin, row, coef * up, V, V, 0, KIND, SMOOTHING, Z_LOSS, SOFTCAP, TEACHER_SOFTCAP, ROUND_BF16, BLOCK_V,
                         ACC, STAGES)


@triton.jit
def regrad_kernel(
    x_ptr, t_ptr, y_ptr, coef_ptr, up_ptr, params_ptr, fin_ptr, grad_ptr,
    N, V, stride_x, stride_t, stride_g, stride_up, stride_fin,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    ROUND_BF16: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """The backward of 16-bit logits for an upstream gradient ``g = up[row * stride_up]`` read on
    the device (no host synchronisation): rows with ``g != 1`` and ``coef != 0`` are rewritten
    as ``(coef * g) * c * dl/dz``, rounded once, by pass 2 alone from the final statistics that
    the forward (:func:`fused_kernel` with ``WRITE_FINAL``) kept: one read of the logits (and
    teacher) and one write a row, not pass 1 again. Rows with ``g == 1`` hold the forward's
    gradient already, rows with ``coef == 0`` its zeros: both are left alone. No loss is
    written. ``PERSISTENT``: as :func:`fused_kernel`."""
    if PERSISTENT:
        for row in tl.range(tl.program_id(0), N, tl.num_programs(0)):
            _regrad_row(x_ptr, t_ptr, y_ptr, coef_ptr, up_ptr, params_ptr, fin_ptr, grad_ptr, tl.full((), 0, tl.int64) + row, V, stride_x,
                        stride_t, stride_g, stride_up, stride_fin, KIND, SMOOTHING, Z_LOSS, SOFTCAP, TEACHER_SOFTCAP, ROUND_BF16, BLOCK_V,
                        ACC, STAGES)
    else:
        _regrad_row(x_ptr, t_ptr, y_ptr, coef_ptr, up_ptr, params_ptr, fin_ptr, grad_ptr, tl.program_id(0).to(tl.int64), V, stride_x,
                    stride_t, stride_g, stride_up, stride_fin, KIND, SMOOTHING, Z_LOSS, SOFTCAP, TEACHER_SOFTCAP, ROUND_BF16, BLOCK_V,
                    ACC, STAGES)


@triton.jit
def shard_stats_kernel(
    x_ptr, t_ptr, y_ptr, coef_ptr, params_ptr, stats_ptr,
    V, offset, stride_x, stride_t, stride_stat,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr,
):
    """Vocab-parallel pass 1: the statistics of this shard (global columns ``[offset, offset + V)``)
    into ``stats[ROW_<name>, row]`` for the statistics the kind uses (``lossspec.stats_used``).

    ``x_y`` is the label's raw logit where this shard owns the (global) label, else 0; ``n = V``
    with label smoothing (raw also with a soft cap: the caller's finalize caps it). Rows with
    ``coef == 0`` hold the empty statistics (``m = mt = tau =
    -inf``, sums 0), the identity of the combine. A bad row's ``s`` is NaN."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    t_row = t_ptr + row * stride_t
    coef = tl.load(coef_ptr + row)
    neg_inf = tl.full((), float("-inf"), ACC)
    zero = tl.full((), 0.0, ACC)
    m, s, sum_shift, mt, st, a, b, tau, e_d, h = neg_inf, zero, zero, neg_inf, zero, zero, zero, neg_inf, zero, zero
    x_y = zero
    n = zero
    if coef != 0:
        c, ct, eps, lam = load_params(params_ptr)
        m, s, sum_shift, mt, st, a, b, tau, e_d, h, bad = _row_stats(
            x_row, t_row, params_ptr, V, c, ct, KIND, SMOOTHING, SOFTCAP, TEACHER_SOFTCAP, BLOCK_V, VEC, ACC, STAGES
        )
        if KIND == CROSS_ENTROPY:
            y_local = tl.load(y_ptr + row).to(tl.int64) - offset
            owned = (y_local >= 0) & (y_local < V)
            x_y = tl.where(owned, tl.load(x_row + tl.where(owned, y_local, 0)).to(ACC), 0.0)
            n = zero + V
    out = stats_ptr + row
    tl.store(out + ROW_M * stride_stat, m)
    tl.store(out + ROW_S * stride_stat, s)
    if KIND == CROSS_ENTROPY:
        tl.store(out + ROW_X_Y * stride_stat, x_y)
        if SMOOTHING:
            tl.store(out + ROW_SUM_SHIFT * stride_stat, sum_shift)
            tl.store(out + ROW_N * stride_stat, n)
    elif KIND == ENTROPY:
        tl.store(out + ROW_H * stride_stat, h)
    else:
        tl.store(out + ROW_MT * stride_stat, mt)
        tl.store(out + ROW_ST * stride_stat, st)
        if KIND == SOFT_CROSS_ENTROPY or KIND == FORWARD_KL:
            tl.store(out + ROW_A * stride_stat, a)
        if KIND == FORWARD_KL:
            tl.store(out + ROW_B * stride_stat, b)
        if KIND == REVERSE_KL:
            tl.store(out + ROW_TAU * stride_stat, tau)
            tl.store(out + ROW_E_D * stride_stat, e_d)


@triton.jit
def shard_grad_kernel(
    x_ptr, t_ptr, y_ptr, coef_ptr, params_ptr, final_ptr, grad_ptr,
    V, V_total, offset, stride_x, stride_t, stride_g, stride_fin,
    KIND: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    ROUND_BF16: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr, STAGES: tl.constexpr,
):
    """Vocab-parallel pass 2: ``grad[row, :] = coef * c * dl/dz`` of this shard from the global
    final statistics ``final[FIN_<name>, row]`` (``torchloss._block.finalize``; ``m``/``mt``
    finite). Labels are global ids, shifted by ``offset`` here; ``eps / V_total`` uses the
    global vocabulary. A row is bad where the global ``s`` (or ``st``) is NaN; rows with
    ``coef == 0`` are zeros."""
    row = tl.program_id(0).to(tl.int64)
    g_row = grad_ptr + row * stride_g
    coef = tl.load(coef_ptr + row)
    if coef != 0:
        _grad_from_final(x_ptr + row * stride_x, t_ptr + row * stride_t, y_ptr, g_row, params_ptr, final_ptr + row, stride_fin, row, coef,
                         V, V_total, offset, KIND, SMOOTHING, Z_LOSS, SOFTCAP, TEACHER_SOFTCAP, ROUND_BF16, BLOCK_V, ACC, STAGES)
    else:
        _zero_row(g_row, V, BLOCK_V)
