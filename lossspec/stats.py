"""The per-row statistics: one formulation, one set of names, for every backend.

Every backend (JAX XLA and Pallas, torch and Triton, and the vocab-parallel paths of both)
computes a row's loss and gradient from the statistics listed here, in fp32, in the order:
statistics of a vocabulary block (or shard) relative to its own maxima, an associative
combine of two blocks (online softmax; the same algebra merges vocabulary shards), finalize
to the per-token loss, then the gradient of each block from the final statistics. The
records (``Stats`` and ``Final`` in ``jaxloss._block`` and ``torchloss._block``) and the
Triton kernels' buffer layouts are derived from :data:`ROW_STATS` and :data:`FINAL_STATS`.

Notation (SPEC section 1): ``c = logit_scale / T``, ``ct = teacher_logit_scale / T``,
``x`` / ``t`` raw student / teacher logits of one row, ``m = max x``, ``mt = max t``,
``e = exp(c (x - m))``, ``et = exp(ct (t - mt))`` (shifted coordinates: subtract the maximum,
*then* scale, so huge logits lose nothing).

Soft caps (``logit_softcap``, ``teacher_logit_softcap``; ``None`` is off and costs nothing): with
a cap, ``x`` / ``t`` below stand for the *capped* logits ``cap * tanh(x_raw / cap)``
(:func:`softcap`), formed in fp32 from each block as it is read and never rounded; everything
else is unchanged (``tanh`` is monotonic, so the maxima are those of the capped values). Two
places see the raw values: ``x_y`` holds the label's *raw* logit, capped by :func:`finalize` (so
the blocks, shards and gathers that supply it need not know of the cap), and the gradient with
respect to the raw logits is the one below times :func:`softcap_slope`
(``d/dx_raw cap tanh(x_raw / cap) = 1 - tanh^2 = 4 e / (1 + e)^2``, ``e = exp(-2 |x_raw / cap|)``,
from the raw logits: ``1 - (x / cap)^2`` from the capped ones cancels near saturation), in fp32.
Infinite entries are left as they are: ``-inf`` keeps probability 0 (slope 0), ``+inf`` and NaN
still make the row bad.

Statistics of a block, relative to the block's own maxima:

=============  ================================================  ==========================
stat           definition                                        kinds
=============  ================================================  ==========================
``m``          ``max x`` (``-inf`` when nothing was seen)        all
``s``          ``sum e``                                         all
``x_y``        the label's raw logit (0 where the block does     cross_entropy
               not hold the label; uncapped, see above)
``sum_shift``  ``sum (x - m)``                                   cross_entropy, eps > 0
``n``          number of columns                                 cross_entropy, eps > 0
``mt``         ``max t``                                         distillation
``st``         ``sum et``                                        distillation
``a``          ``sum et (x - m)``                                soft CE, forward KL
``b``          ``sum et (t - mt)``                               forward KL
``tau``        the pivot: the teacher's raw logit at the         reverse KL
               student's argmax, the *first* column where
               ``x == m`` on ties (``argmax`` semantics)
``e_d``        ``sum e D`` with ``D = c (x - m) - ct (t - tau)``  reverse KL
``h``          ``sum e (x - m)``                                 entropy
``kl_qm``      ``sum q (log q - log M)`` (second pass, below)    jensen_shannon
``kl_pm``      ``sum p (log p - log M)`` (second pass, below)    jensen_shannon
=============  ================================================  ==========================

Combine (two blocks, or shards, of the same rows; ``m' = max(m1, m2)``): exp-sums are
multiplied by ``r = exp(c (m - m'))`` (teacher: ``exp(ct (mt - mt'))``), moments that carry
``(x - m)`` gain ``(m - m')`` times their weight sum, ``x_y`` and ``n`` add, and the pivot is
the ``tau`` of the block with the larger ``m`` (on equal ``m`` the earlier block's, the tie
rule above, so blocks, shards and a whole row agree: shards in rank / axis-index order); ``e_d`` is re-expressed on the new pivot:
``r (e_d + s (c (m - m') - ct (tau - tau')))``. A block that saw nothing (``m = -inf``)
contributes exactly 0. ``h`` is a moment of the student's weights: ``r (h + s (m - m'))``.

Per-token losses from the global statistics, with ``lse' = log s``::

  cross_entropy      l = lse' - (1-eps) c (x_y - m) - (eps/V) c sum_shift + lam (lse' + c m)^2
  soft_cross_entropy l = lse' - c a / st
  forward_kl         l = (ct b / st - log st) - (c a / st - lse')
  reverse_kl         l = e_d / s + (log st - lse' - ct (tau - mt))
  entropy            l = lse' - c h / s            (h <= 0: two terms >= 0, no cancellation)
  jensen_shannon     l = beta kl_pm + (1 - beta) kl_qm   (after the second pass)

Gradients w.r.t. ``z`` (SPEC section 1), ``q = exp(c (x - m) - lse')``,
``p = exp(ct (t - mt) - log st)``::

  cross_entropy      (1 + 2 lam (lse' + c m)) q - (1-eps) onehot(y) - eps/V
  soft CE, fwd KL    q - p
  reverse_kl         q (log q - log p - l) = q (D - e_d / s)   (0 where q == 0)
  entropy            -q (log q + l) = -c q ((x - m) - h / s)   (0 where q == 0)
  jensen_shannon     (1 - beta) q (log q - log M - kl_qm)       (0 where q == 0)

Entropy, ``l = -sum_v q_v log q_v``: ``log q = c (x - m) - lse'`` gives ``l = lse' - c E_q[x - m]``
and ``log q + l = c ((x - m) - E_q[x - m])``; ``E_q[x - m] = h / s`` is the final ``mean_h``.

Jensen-Shannon (generalised, TRL GKD's ``generalized_jsd_loss`` and Liger-Kernel's JSD):
``p`` the teacher, ``q`` the student, the mixture ``M = beta p + (1 - beta) q``::

  l = beta KL(p || M) + (1 - beta) KL(q || M) = beta kl_pm + (1 - beta) kl_qm

``beta = 0`` is forward KL ``KL(p || q)`` and ``beta = 1`` reverse KL ``KL(q || p)`` (their
definition: the end points are the limits of ``l / beta`` and ``l / (1 - beta)``, not of ``l``);
those two calls run the forward / reverse KL formulas exactly (``LossConfig.formula``), never a
``log 0``. Gradient for ``0 < beta < 1``: ``dl/dq_v = (1 - beta) (log q_v - log M_v)`` (the
``beta p / M + (1 - beta) q / M = 1`` terms cancel), through the softmax
``dl/dz = (1 - beta) q (log q - log M - kl_qm)``.

``log M_v`` needs the *global* ``log q_v`` and ``log p_v``, which a block's statistics relative
to its own maxima cannot give: a log of a sum of two exponentials does not factor through the
online rescaling. So ``jensen_shannon`` takes three passes over the vocabulary: (1) the
statistics ``m, s, mt, st`` (combined as for the other kinds) and :func:`finalize` to ``lse'``,
``log st``; (2) :data:`MIXTURE_STATS` ``kl_qm``, ``kl_pm``, plain sums of per-entry terms
(:func:`mixture_terms`) that blocks and shards simply add (no rescaling: they are relative to the
global ``lse``'s), then :func:`finalize_mixture` to ``l``; (3) the gradient. A block that is the
whole row does all three on data in cache. Per entry, with ``diff = log q - log p`` and
``g = log((1 - beta) / beta) + diff`` (``= log((1 - beta) q) - log(beta p)``)::

  log q - log M = min(-log(1 - beta), diff - log beta) - log1p(exp(-|g|))
  log p - log M = min(-log beta, -diff - log(1 - beta)) - log1p(exp(-|g|))

(``log M = max(a, b) + log1p(exp(-|a - b|))`` with ``a = log((1 - beta) q)``, ``b = log(beta p)``).
Both are bounded where their weight is non-zero (``log q - log M <= -log(1 - beta)``), so the
terms ``q (log q - log M)`` and ``p (log p - log M)`` have no cancellation and ``0 <= l <= log 2``:
an entry with ``p = 0`` gives ``-log(1 - beta)`` (``diff = +inf``), one with ``q = 0`` weight 0.

Why reverse KL is pivoted: its gradient ``q (log q - log p - l)`` cancels catastrophically
when ``l`` is large (huge logits: ``l ~ 1e4`` while the gradient needs the difference to
~1e-6). ``log q - log p = D + const`` per row, and ``D`` is exactly 0 on the student's argmax,
the entry that carries the probability mass, so nothing large is ever subtracted.

Bad rows: a NaN anywhere in a row makes its ``e`` NaN, a ``+inf`` makes ``m = +inf`` and
``x - m`` NaN there; sums propagate NaN whatever ``max`` does with it. A row is bad exactly when
``s`` (or ``st``) is NaN; kernels whose ``max`` may drop NaN (GPUs) set ``s`` to NaN from an
explicit flag. Bad rows give a NaN loss and a NaN gradient row (unless masked: then 0).

The gradient pass needs, per row, the :data:`FINAL_STATS`.
"""

from __future__ import annotations

import collections
import functools
import math
from fractions import Fraction
from typing import Any, Optional

from .config import FP32_MAX, LossConfig

# The statistics of a block, in this order (the Triton kernels' buffer layout).
ROW_STATS: tuple[str, ...] = ("m", "s", "x_y", "sum_shift", "n", "mt", "st", "a", "b", "tau", "e_d", "h", "kl_qm", "kl_pm")
# The statistics of jensen_shannon's second pass (sums relative to the global lse's).
MIXTURE_STATS: tuple[str, ...] = ("kl_qm", "kl_pm")

# What finalize returns per row and the gradient pass reads (the Triton kernels' layout).
# ``l`` loss, ``m``/``mt`` the maxima made finite (``-inf`` -> 0), ``lse = log s``,
# ``lse_t = log st``, ``q_coef = 1 + 2 lam (lse + c m)`` (1 without z-loss), ``mean_d = e_d / s``,
# ``mean_h = h / s`` (entropy), ``kl_qm`` (jensen_shannon).
FINAL_STATS: tuple[str, ...] = ("l", "m", "s", "lse", "mt", "st", "lse_t", "q_coef", "tau", "mean_d", "mean_h", "kl_qm")

ROW_STAT_INDEX: dict[str, int] = {name: i for i, name in enumerate(ROW_STATS)}
FINAL_STAT_INDEX: dict[str, int] = {name: i for i, name in enumerate(FINAL_STATS)}

_KIND_STATS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("m", "s", "x_y"),
    "soft_cross_entropy": ("m", "s", "mt", "st", "a"),
    "forward_kl": ("m", "s", "mt", "st", "a", "b"),
    "reverse_kl": ("m", "s", "mt", "st", "tau", "e_d"),
    "entropy": ("m", "s", "h"),
    "jensen_shannon": ("m", "s", "mt", "st"),  # pass 1; MIXTURE_STATS in pass 2
}

# Integer ids of the kinds (Triton ``constexpr``s are named after them, never compared with
# bare numbers).
KIND_IDS: dict[str, int] = {
    "cross_entropy": 0,
    "soft_cross_entropy": 1,
    "forward_kl": 2,
    "reverse_kl": 3,
    "entropy": 4,
    "jensen_shannon": 5,
}


def stats_used(config: LossConfig) -> tuple[str, ...]:
    """The statistics a call computes in its first pass (in :data:`ROW_STATS` order); the others
    are ``None`` (``jensen_shannon``'s :data:`MIXTURE_STATS` come from the second pass)."""
    used = set(_KIND_STATS[config.kind])
    if config.kind == "cross_entropy" and config.label_smoothing > 0:
        used |= {"sum_shift", "n"}
    return tuple(name for name in ROW_STATS if name in used)


def final_used(config: LossConfig) -> tuple[str, ...]:
    """The :data:`FINAL_STATS` fields a call has once every pass has run (:func:`finalize`, and
    :func:`finalize_mixture` for a kind with the mixture pass), in that order, ``l`` included:
    what a backend that keeps the rows' final statistics for a later gradient pass stores
    (the fused head's ``recompute_logits``, its kernels)."""
    import numpy as np

    one = np.ones(1)
    fin = finalize(np, config, Stats(**{name: one for name in stats_used(config)}), 1)
    if config.mixture_pass:
        fin = finalize_mixture(np, config, fin, one, one)
    return tuple(name for name in FINAL_STATS if getattr(fin, name) is not None)


# --------------------------------------------------------------------------------------------
# The algebra between the blocks, written once for every array namespace ``xp`` (NumPy,
# ``jax.numpy``, ``torch``: each has ``where``, ``exp``, ``log``, ``maximum``, ``isnan``). The
# per-block work (block statistics, block gradient) is each backend's own, for speed.
# --------------------------------------------------------------------------------------------

NEG_INF = float("-inf")

Stats = collections.namedtuple("Stats", ROW_STATS, defaults=(None,) * len(ROW_STATS))  # type: ignore[misc]
Stats.__doc__ = "Per-row statistics ``[R]`` of a block (:data:`ROW_STATS`); ``None`` where unused."
Final = collections.namedtuple("Final", FINAL_STATS, defaults=(None,) * len(FINAL_STATS))  # type: ignore[misc]
Final.__doc__ = "What the gradient pass needs per row ``[R]`` (:data:`FINAL_STATS`)."

SUM_STATS: tuple[str, ...] = ("s", "x_y", "sum_shift", "n", "st", "a", "b", "e_d", "h", "kl_qm", "kl_pm")


def tanh_series(terms: int) -> tuple[float, ...]:
    """The first ``terms`` coefficients of ``tanh(u) / u`` as a series in ``u^2`` (the Maclaurin
    series of ``tanh``, ``2^2n (2^2n - 1) B_2n / (2n)!`` with the Bernoulli numbers ``B``
    computed exactly here): ``1, -1/3, 2/15, -17/315, ...``."""
    bern = [Fraction(1)]
    for m in range(1, 2 * terms + 1):
        bern.append(-sum(math.comb(m + 1, k) * bern[k] for k in range(m)) / (m + 1))
    return tuple(float(Fraction(4**n * (4**n - 1)) * bern[2 * n] / math.factorial(2 * n)) for n in range(1, terms + 1))


# One tanh for every backend (the soft cap's): below TANH_SERIES_LIMIT the series (8 terms:
# truncation < 1e-8 relative there), above it (1 - e) / (1 + e) with e = exp(-2 |u|) <= 1/3 (no
# cancellation). Within 2 fp32 ulps of tanh on NumPy, XLA, torch and the Triton interpreter; XLA's own f32 tanh is off by up to 4.4 ulps (2.6e-7 near |u| = 5.7), which at a cap
# of 30 moves a capped logit by 8e-6, more than the SPEC bound allows.
TANH_SERIES: tuple[float, ...] = tanh_series(8)
TANH_SERIES_LIMIT = 0.55


def tanh(xp: Any, u: Any) -> Any:
    """``tanh(u)`` from ``exp`` and the series (:data:`TANH_SERIES`), the same arithmetic on
    every namespace (and in the Triton kernels)."""
    z = u * u
    series = TANH_SERIES[-1]
    for coefficient in TANH_SERIES[-2:0:-1]:
        series = series * z + coefficient
    small = u + u * (z * series)
    e = xp.exp(-2.0 * xp.abs(u))
    big = (1.0 - e) / (1.0 + e)
    return xp.where(xp.abs(u) < TANH_SERIES_LIMIT, small, xp.where(u < 0, -big, big))


def softcap(xp: Any, x: Any, cap: Optional[float]) -> Any:
    """``cap * tanh(x / cap)`` on the finite entries of ``x``; ``+-inf`` and NaN unchanged (a
    banned ``-inf`` entry stays banned, a ``+inf`` or NaN row stays bad). ``cap = None``:
    ``x`` itself (no work)."""
    if cap is None:
        return x
    return xp.where(x - x == 0, cap * tanh(xp, x / cap), x)


def softcap_slope(xp: Any, x: Any, cap: Any) -> Any:
    """``d softcap(x) / dx = 1 - tanh(u)^2 = 4 e / (1 + e)^2`` with ``u = x / cap`` and
    ``e = exp(-2 |u|)``, from the *raw* logits ``x`` (0 at ``+-inf``, NaN at NaN): the factor
    from the gradient w.r.t. the capped logits to the raw ones. Not ``1 - (y / cap)^2`` from the
    capped ``y``: near saturation that difference cancels in fp32 (one ulp of ``y / cap`` is
    the whole slope at ``|u| ~ 8``), while every factor here keeps its relative precision."""
    e = xp.exp(-2.0 * xp.abs(x / cap))
    return 4.0 * e / ((1.0 + e) * (1.0 + e))


def finite_max(xp: Any, m: Any) -> Any:
    """A row maximum usable as a shift: ``-inf`` (nothing but ``-inf`` seen) becomes 0."""
    return xp.where(m == NEG_INF, 0.0, m)


def _shift(xp: Any, m_old: Any, m_new: Any, scale: float) -> tuple[Any, Any]:
    """``(exp(scale (m_old - m_new)), m_old - m_new)``, both 0 where ``m_old`` is ``-inf`` (a
    block that saw nothing: its sums are 0 and ``exp`` must not see ``-inf - -inf``)."""
    empty = m_old == NEG_INF
    delta = xp.where(empty, 0.0, finite_max(xp, m_old) - finite_max(xp, m_new))
    return xp.where(empty, 0.0, xp.exp(scale * delta)), delta


def rescale(xp: Any, config: LossConfig, st: Any, m_new: Any, mt_new: Optional[Any] = None) -> Any:
    """``st`` relative to the (larger) maxima ``m_new`` / ``mt_new``, except ``e_d``
    (:func:`rescale_e_d`): exp-sums times ``r``, moments carrying ``(x - m)`` plus ``(m - m')``
    times their weight sum."""
    r, dm = _shift(xp, st.m, m_new, config.student_scale)
    out = st._replace(m=m_new, s=r * st.s)
    if st.h is not None:
        out = out._replace(h=r * (st.h + st.s * dm))
    if st.sum_shift is not None:
        out = out._replace(sum_shift=st.sum_shift + st.n * dm)
    if mt_new is None:
        return out
    rt, dmt = _shift(xp, st.mt, mt_new, config.teacher_scale)
    out = out._replace(mt=mt_new, st=rt * st.st)
    if st.a is not None:
        out = out._replace(a=rt * (st.a + st.st * dm))
    if st.b is not None:
        out = out._replace(b=rt * (st.b + st.st * dmt))
    return out


def rescale_e_d(xp: Any, config: LossConfig, st: Any, m_new: Any, tau_new: Any) -> Any:
    """``e_d`` relative to ``(m_new, tau_new)``: ``D`` gains ``c (m - m') - ct (tau - tau')``. A
    block with ``r == 0`` (empty, or far below) contributes exactly 0, even where ``tau`` is
    ``-inf``."""
    r, dm = _shift(xp, st.m, m_new, config.student_scale)
    shift = config.student_scale * dm - config.teacher_scale * (st.tau - tau_new)
    return xp.where(r > 0, r * (st.e_d + st.s * shift), 0.0)


def add(a: Any, b: Any) -> Any:
    """Sum of two :class:`Stats` relative to the same maxima (and pivot)."""
    return a._replace(**{name: getattr(a, name) + getattr(b, name) for name in SUM_STATS if getattr(a, name) is not None})


def pivot(xp: Any, a_m: Any, a_tau: Any, b_m: Any, b_tau: Any) -> Any:
    """The pivot of two blocks, ``a`` before ``b`` in the row: the one with the larger maximum
    supplies it; on equal maxima the first (the tie rule above)."""
    return xp.where(b_m > a_m, b_tau, a_tau)


def combine(xp: Any, config: LossConfig, a: Any, b: Any) -> Any:
    """Statistics of the union of two blocks of the same rows, ``a`` before ``b`` (online
    softmax; associative)."""
    m = xp.maximum(a.m, b.m)
    mt = None if a.mt is None else xp.maximum(a.mt, b.mt)
    out = add(rescale(xp, config, a, m, mt), rescale(xp, config, b, m, mt))
    if a.tau is not None:
        tau = pivot(xp, a.m, a.tau, b.m, b.tau)
        out = out._replace(tau=tau, e_d=rescale_e_d(xp, config, a, m, tau) + rescale_e_d(xp, config, b, m, tau))
    return out


def bad_rows(xp: Any, fin: Any) -> Any:
    """Rows holding NaN or ``+inf`` (student or teacher): their exp-sums are NaN."""
    bad = xp.isnan(fin.s)
    return bad if fin.st is None else bad | xp.isnan(fin.st)


def finalize_gradient(xp: Any, config: LossConfig, st: Any) -> Any:
    """What the gradient pass reads from the global statistics, without the loss: ``s``,
    ``st``, the *raw* maxima ``m``, ``mt`` (a shift is ``finite_max`` of them), and
    ``q_coef`` (z-loss), ``mean_h`` (entropy), ``tau`` and ``mean_d`` (reverse KL), or every
    final statistic but ``l`` (jensen_shannon, whose second pass reads them).

    :func:`finalize` is this plus the loss. A backend whose per-row algebra costs a fixed time
    per tile (the torch path on the CPU: each tiny op is microseconds of dispatch under the GIL)
    calls this per tile and :func:`finalize` once over all rows."""
    kind = config.kind
    if kind == "jensen_shannon":
        return finalize(xp, config, st, 0)
    fin = Final(m=st.m, s=st.s, mt=st.mt, st=st.st)
    if kind == "cross_entropy" and config.z_loss > 0:
        full_lse = xp.log(st.s) + config.student_scale * finite_max(xp, st.m)
        return fin._replace(q_coef=1.0 + (2.0 * config.z_loss) * full_lse)
    if kind == "entropy":
        return fin._replace(mean_h=st.h / st.s)
    if kind == "reverse_kl":
        return fin._replace(tau=st.tau, mean_d=st.e_d / st.s)
    return fin


def finalize(xp: Any, config: LossConfig, st: Any, vocab: int) -> Any:
    """Per-token loss ``l`` ``[R]`` and what the gradient needs, from the global statistics
    (the formulas above; NaN on bad rows). ``vocab`` is read by label smoothing only."""
    c, ct = config.student_scale, config.teacher_scale
    m = finite_max(xp, st.m)
    lse = xp.log(st.s)
    if config.kind == "cross_entropy":
        eps, lam = config.label_smoothing, config.z_loss
        x_y = softcap(xp, st.x_y, config.logit_softcap)  # x_y is the raw logit (above)
        loss = lse - ((1.0 - eps) * c) * (x_y - m)
        if eps > 0:
            loss = loss - (eps / vocab * c) * st.sum_shift
        q_coef = finalize_gradient(xp, config, st).q_coef  # None without z-loss
        if lam > 0:
            full_lse = lse + c * m
            loss = loss + lam * full_lse * full_lse
        return Final(l=xp.where(xp.isnan(st.s), float("nan"), loss), m=m, s=st.s, lse=lse, q_coef=q_coef)
    if config.kind == "entropy":
        mean_h = finalize_gradient(xp, config, st).mean_h
        loss = xp.where(xp.isnan(st.s), float("nan"), lse - c * mean_h)
        return Final(l=loss, m=m, s=st.s, lse=lse, mean_h=mean_h)
    mt = finite_max(xp, st.mt)
    lse_t = xp.log(st.st)
    tau = mean_d = None
    if config.kind == "soft_cross_entropy":
        loss = lse - c * st.a / st.st
    elif config.kind == "forward_kl":
        loss = (ct * st.b / st.st - lse_t) - (c * st.a / st.st - lse)
    elif config.kind == "jensen_shannon":
        fin = Final(m=m, s=st.s, lse=lse, mt=mt, st=st.st, lse_t=lse_t)
        if st.kl_qm is None:  # the second pass has not run yet: no loss
            return fin
        return finalize_mixture(xp, config, fin, st.kl_qm, st.kl_pm)
    else:
        pivoted = finalize_gradient(xp, config, st)
        tau, mean_d = pivoted.tau, pivoted.mean_d
        loss = mean_d + (lse_t - lse - ct * (st.tau - mt))
    loss = xp.where(xp.isnan(st.s) | xp.isnan(st.st), float("nan"), loss)
    return Final(l=loss, m=m, s=st.s, lse=lse, mt=mt, st=st.st, lse_t=lse_t, tau=tau, mean_d=mean_d)


def mixture_log_ratios(xp: Any, config: LossConfig, diff: Any, selects: bool = True) -> tuple[Any, Any]:
    """``(log q - log M, log p - log M)`` per entry from ``diff = log q - log p`` (the formulas
    above; finite wherever the entry's own weight is non-zero, NaN where ``p = q = 0``).
    ``selects=False``: the bounds by ``xp.minimum`` (one operation, not a compare and a select;
    ``jax.numpy`` and NumPy take a float bound, ``torch.minimum`` does not)."""
    beta = config.beta
    log_beta, log_rest = math.log(beta), math.log1p(-beta)
    soft = xp.log1p(xp.exp(-xp.abs(diff + (log_rest - log_beta))))
    q_side = diff - log_beta
    p_side = -diff - log_rest
    if not selects:
        # min(side, bound): where(side < bound, side, bound) but where side is NaN (p = q = 0),
        # whose soft part is NaN as well
        return xp.minimum(q_side, -log_rest) - soft, xp.minimum(p_side, -log_beta) - soft
    log_qm = xp.where(q_side < -log_rest, q_side, -log_rest) - soft
    log_pm = xp.where(p_side < -log_beta, p_side, -log_beta) - soft
    return log_qm, log_pm


def mixture_terms(xp: Any, config: LossConfig, fin: Any, dx: Any, dt: Any, selects: bool = True) -> tuple[Any, Any, Any, Any]:
    """``jensen_shannon``'s per-entry terms of a block ``[R, B]``, from ``dx = x - m`` and
    ``dt = t - mt`` relative to the *global* maxima and the final ``lse``'s ``[R]``:
    ``(q, q (log q - log M), p (log p - log M), log q - log M)``, each product 0 where its
    weight is 0 (so ``0 * inf`` never appears). Sums over the block of the middle two are its
    :data:`MIXTURE_STATS`; the gradient reads ``q`` and ``log q - log M``.

    ``selects=False`` (a GPU kernel, where a select per entry costs instructions): ``log q`` and
    ``log p`` are clamped to ``-FP32_MAX`` before the log-ratios, which are then finite in a
    clean row (no ``-inf``, no NaN where ``p = q = 0``), and the products are taken without a
    select. The same numbers wherever the weight is non-zero (its log is finite there), and a
    zero, of either sign, where it is 0."""
    log_q = config.student_scale * dx - fin.lse[:, None]
    log_p = config.teacher_scale * dt - fin.lse_t[:, None]
    q, p = xp.exp(log_q), xp.exp(log_p)
    if not selects:
        log_q, log_p = xp.maximum(log_q, -FP32_MAX), xp.maximum(log_p, -FP32_MAX)
    log_qm, log_pm = mixture_log_ratios(xp, config, log_q - log_p, selects)
    if not selects:
        return q, q * log_qm, p * log_pm, log_qm
    return q, xp.where(q > 0, q * log_qm, 0.0), xp.where(p > 0, p * log_pm, 0.0), log_qm


def finalize_mixture(xp: Any, config: LossConfig, fin: Any, kl_qm: Any, kl_pm: Any) -> Any:
    """``jensen_shannon``'s loss from the summed :data:`MIXTURE_STATS` of every block / shard:
    ``l = beta kl_pm + (1 - beta) kl_qm`` (NaN on bad rows), and ``kl_qm`` for the gradient."""
    loss = config.beta * kl_pm + (1.0 - config.beta) * kl_qm
    loss = xp.where(xp.isnan(fin.s) | xp.isnan(fin.st), float("nan"), loss)
    return fin._replace(l=loss, kl_qm=kl_qm)


def bind(xp: Any) -> tuple[Any, ...]:
    """``(finite_max, rescale, rescale_e_d, combine, finalize, finalize_gradient, bad_rows)`` on
    the namespace ``xp``: what a framework's ``_block`` module exports."""
    return tuple(functools.partial(f, xp) for f in (finite_max, rescale, rescale_e_d, combine, finalize, finalize_gradient, bad_rows))
