"""The block math of the JAX paths: block statistics, combine, finalize, block gradient.

The formulation, its names and the pivot's tie rule are :mod:`lossspec.stats` (the same in
``torchloss._block``): statistics of a vocabulary block ``[R, B]`` relative to its own maxima
(:func:`block_stats`), the associative :func:`combine` of two blocks (online softmax; the same
algebra merges vocabulary shards in :mod:`jaxloss.backends.vocab_parallel`), :func:`finalize` to the
per-token loss, and :func:`grad_block` from the final statistics. The algebra between blocks
is written once in ``lossspec.stats`` for any array namespace and used here on ``jax.numpy``;
:class:`Stats` and :class:`Final` are lossspec's records. Both the XLA driver
(:mod:`jaxloss.backends.xla`) and the Pallas kernels (:mod:`jaxloss.backends.pallas`) call these functions on
fp32 blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

import lossspec
from lossspec import stats
from lossspec.stats import NEG_INF, Final, Stats

Array = jax.Array
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """What a kernel needs to know of a call (hashable, static under ``jit``).

    The normalisation and the denominator are *not* part of it: they only enter through the
    per-token coefficient ``coef``, runtime data, so a new denominator never recompiles.
    """

    kind: str
    scale: float = 1.0  # c = logit_scale / temperature
    teacher_scale: float = 1.0  # ct = teacher_logit_scale / temperature
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    beta: float = 0.5  # jensen_shannon's teacher share of the mixture (0 < beta < 1 here)
    # Soft caps of the raw logits (lossspec.stats): None is off and traces no extra op.
    logit_softcap: Optional[float] = None
    teacher_logit_softcap: Optional[float] = None

    @classmethod
    def of(cls, config: lossspec.LossConfig) -> "KernelConfig":
        """The kernel configuration of a validated :class:`lossspec.LossConfig` (its
        ``kernel_config()`` already applied where the kind changes)."""
        return cls(
            kind=config.kind,
            scale=config.student_scale,
            teacher_scale=config.teacher_scale,
            label_smoothing=config.label_smoothing,
            z_loss=config.z_loss,
            beta=config.beta,
            logit_softcap=config.logit_softcap,
            teacher_logit_softcap=config.teacher_logit_softcap,
        )

    @property
    def is_ce(self) -> bool:
        """Whether the target is integer labels (the kind table's trait)."""
        return lossspec.KIND_SPECS[self.kind].has_labels

    @property
    def has_teacher(self) -> bool:
        """Whether the kernel reads teacher logits (the kind table's trait)."""
        return lossspec.KIND_SPECS[self.kind].has_teacher

    @property
    def mixture_pass(self) -> bool:
        """Whether each row is read a second time for the mixture sums (the kind table's trait)."""
        return lossspec.KIND_SPECS[self.kind].mixture_pass

    @property
    def student_scale(self) -> float:
        """``c``, under the name ``lossspec.LossConfig`` gives it (the shared algebra reads it)."""
        return self.scale


LOG2E = 1.4426950408889634  # log2(e): exp(u) = exp2(LOG2E u)


class _Base2Numpy:
    """``jax.numpy`` whose ``exp(u)`` is ``exp2(LOG2E u)`` and ``log1p(u)`` is ``log(1 + u)``: the
    namespace handed to lossspec's shared algebra (``stats.mixture_terms``) inside the Pallas
    kernels. On a GPU ``exp`` is otherwise libdevice's ``expf`` (:func:`exp_scaled`) and ``log1p``
    its ``log1pf``, a branch per entry. The one ``log1p`` there is jensen_shannon's
    ``log1p(exp(-|.|))``, of a ``u`` in ``[0, 1]``: ``log(1 + u)`` is within about an fp32 ulp of 1
    of it, an absolute error that the soft part's difference with bounded terms takes (the Triton
    kernels compute the same)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(jnp, name)

    @staticmethod
    def exp(u: Array) -> Array:
        return jnp.exp2(u * LOG2E)

    @staticmethod
    def log1p(u: Array) -> Array:
        return jnp.log(1.0 + u)


BASE2_NUMPY = _Base2Numpy()


def exp_scaled(scale: float, d: Array, shift: Optional[Array] = None, *, base2: bool = False) -> Array:
    """``exp(scale d - shift)`` (``shift`` ``[R]``, per row; ``None``: 0), or with ``base2`` the same
    as ``exp2((LOG2E scale) d - LOG2E shift)``: the scale folded once per call, the shift once per
    row. On a GPU ``exp2`` is one ``ex2.approx`` instruction where ``exp`` is libdevice's ``expf``
    (about 8: a two-constant range reduction around the same instruction); the rounding of the folded
    constants moves ``exp``'s argument by a few fp32 ulps of ``|scale d - shift|``, which the kernel
    bounds of docs/spec.md section 6 take (the Triton kernels do the same)."""
    if not base2:
        return jnp.exp(scale * d if shift is None else scale * d - shift[:, None])
    scaled = (scale * LOG2E) * d
    return jnp.exp2(scaled if shift is None else scaled - (shift * LOG2E)[:, None])


def _pos_times(weight: Array, value: Array) -> Array:
    """``weight * value`` with 0 where ``weight == 0`` (so ``0 * -inf`` is 0, never NaN)."""
    return jnp.where(weight > 0, weight * value, 0.0)


def _pos_times_clamped(weight: Array, value: Array, select: bool = True) -> Array:
    """:func:`_pos_times` for a ``value`` that is never ``+inf`` and finite wherever ``weight > 0``:
    the shift ``d`` of the tensor whose exponential ``exp(c d)`` is the weight (``-inf`` only at a
    ``-inf`` logit, where the weight is 0), less a finite row constant. Its only ``0 * inf`` is
    ``0 * -inf``. Without ``select`` (the Pallas kernels) ``value`` is clamped to ``-FP32_MAX``
    instead: two operations per entry, not three (compare, product, select), alike on every
    platform. The same number wherever ``weight > 0``; where ``weight == 0`` a zero whose sign may
    differ, which sums and products with nonzero factors never show. A NaN ``value`` (a bad row:
    its loss and gradient are NaN from its exp-sums) may give a number. Not for a weight of one
    tensor times another's shift (soft CE's ``a``): that product is ``-inf`` where it must be."""
    if select:
        return _pos_times(weight, value)
    return weight * jnp.maximum(value, -lossspec.FP32_MAX)


def block_stats(
    cfg: KernelConfig,
    x: Array,
    t: Optional[Array] = None,
    *,
    x_y: Optional[Array] = None,
    hit: Optional[Array] = None,
    col_ok: Optional[Array] = None,
    gather: bool = True,
    base2: bool = False,
    pivot: Optional[Callable[[Array], Array]] = None,
    selects: bool = True,
    minnum: bool = False,
    running: Optional[Stats] = None,
) -> tuple[Stats, Array, Optional[Array]]:
    """Statistics of one block ``x`` ``[R, B]`` (fp32) relative to the block's own maxima.

    Args:
      cfg: the kernel configuration.
      x: student logits ``[R, B]`` fp32, raw (soft-capped here when the config says so).
      t: teacher logits ``[R, B]`` fp32 (distillation kinds), raw.
      x_y: the label's raw logit ``[R]`` when the caller gathered it (cross-entropy);
        otherwise it is summed from ``hit``. It stays raw: :func:`finalize` caps it.
      hit: ``[R, B]`` bool, the label's column (cross-entropy, when ``x_y`` is not given).
      col_ok: ``[B]`` or ``[R, B]`` bool, columns that belong to this block (ragged tails,
        overlapping blocks); ``None`` for all.
      gather: reverse KL may gather the pivot (``False`` inside Pallas kernels, which lower to
        Triton without gathers).
      pivot: reverse KL without a teacher soft cap: ``pivot(first)`` reads the teacher's raw logit
        at each row's pivot column ``first`` ``[R]`` (block-relative; ``R`` values, -inf where
        ``first`` is past the block: a NaN row), in place of the gather or the compare (a Pallas
        kernel's load of one column per row, which pass 1 just read).
      base2: the exponentials as ``exp2`` with ``log2(e)`` folded into the scale (:func:`exp_scaled`;
        the Pallas kernels: one GPU instruction each instead of libdevice's ``expf``).
      selects: ``False`` (the Pallas kernels): the weighted shifts ``h`` and ``b`` (each a weight
        times its own tensor's shift) without a select per entry (:func:`_pos_times_clamped`).
      minnum: ``jnp.minimum`` drops a NaN operand (a Pallas kernel lowered to Triton: ``lax.min``
        is ``arith.minnumf`` there, where the CPU's propagates NaN): soft CE's and forward KL's
        ``a`` is then ``min(et dx, 0)``, one operation where ``where(et > 0, et dx, 0)`` takes
        two (the Triton kernels' ``weighted_shift``). The same numbers: ``et dx <= 0`` wherever it
        is a number, ``-inf`` where it must be, and its NaN ``0 * -inf`` becomes 0.
      x: may also be ``[R, L, VEC]`` (lanes: ``VEC`` adjacent columns a lane): the sums are then
        per lane, ``[R, L]``, the maxima and pivot ``[R, 1]`` (:func:`empty_stats` with ``lanes``,
        :func:`lanes_to_rows`).
      running: the statistics of the blocks folded so far (without a pivot: not reverse KL): this
        block's are then relative to the maxima of both, the new running maxima, so that
        :func:`fold` rescales only ``running``'s sums, where :func:`combine` rescales both blocks'
        (the Triton kernels' loop).

    Returns:
      ``(stats, e, et)``: the statistics and ``e = exp(c (x - m))``, ``et`` (0 outside
      ``col_ok``), which a caller may reuse for the gradient when no other block follows.
    """
    c, ct = cfg.scale, cfg.teacher_scale
    x_raw = x
    x = softcap(x, cfg.logit_softcap)
    if t is not None:
        t = softcap(t, cfg.teacher_logit_softcap)
    if col_ok is not None:
        col_ok = jnp.broadcast_to(col_ok, x.shape)
        xm = jnp.where(col_ok, x, NEG_INF)
    else:
        xm = x
    # [R, B]: row sums; [R, L, VEC] (lanes): lane sums [R, L], the maxima still over the whole row
    block_axes = tuple(range(1, x.ndim))
    lane_sum = functools.partial(jnp.sum, axis=-1)
    per_row = functools.partial(_per_row, ndim=x.ndim)
    # a row's statistic as the Stats hold it: [R], or [R, 1] beside lane sums (they broadcast)
    held = (lambda v: v) if x.ndim == 2 else (lambda v: v[:, None])
    assert running is None or running.tau is None, "a pivot (reverse KL) folds with combine"
    m = jnp.max(xm, axis=block_axes)
    if running is not None:
        m = jnp.maximum(m, running.m.reshape(m.shape))
    dx = xm - per_row(finite_max(m))  # -inf on -inf and masked columns
    e = exp_scaled(c, dx, base2=base2)
    s = lane_sum(e)
    if cfg.is_ce:
        if x_y is None:
            x_y = jnp.sum(jnp.where(hit, x_raw, 0.0), axis=block_axes)
        sum_shift = n = None
        if cfg.label_smoothing > 0:
            if col_ok is not None:
                sum_shift = lane_sum(jnp.where(col_ok, dx, 0.0))
                n = lane_sum(col_ok.astype(F32))
            else:
                sum_shift = lane_sum(dx)
                n = jnp.full(s.shape, x.shape[-1], F32)
        return Stats(m=held(m), s=s, x_y=x_y, sum_shift=sum_shift, n=n), e, None
    if cfg.kind == "entropy":
        return Stats(m=held(m), s=s, h=lane_sum(_pos_times_clamped(e, dx, selects))), e, None
    assert t is not None
    tm = t if col_ok is None else jnp.where(col_ok, t, NEG_INF)
    mt = jnp.max(tm, axis=block_axes)
    if running is not None:
        mt = jnp.maximum(mt, running.mt.reshape(mt.shape))
    dt = tm - per_row(finite_max(mt))
    et = exp_scaled(ct, dt, base2=base2)
    st = lane_sum(et)
    a = b = tau = e_d = None
    if cfg.kind in ("soft_cross_entropy", "forward_kl"):
        # never clamped: the teacher's weight may be > 0 where the student's shift is -inf (an
        # infinite loss, which a clamp would make finite); a select, or the NaN-dropping minimum
        a = lane_sum(jnp.minimum(et * dx, 0.0) if minnum else _pos_times(et, dx))
    if cfg.kind == "forward_kl":
        b = lane_sum(_pos_times_clamped(et, dt, selects))
    if cfg.kind == "reverse_kl":
        # The pivot's column: the first column of the maximum (lossspec.stats' tie rule), a
        # min-reduce that fuses with the others; then one gather of R values (XLA), or a
        # compare and max-reduce inside a Pallas kernel (``gather=False``: no gathers there).
        width = math.prod(x.shape[1:])
        cols = lax.broadcasted_iota(jnp.int32, xm.shape, 1)
        if x.ndim == 3:  # lanes: lane l holds the columns [l VEC, (l + 1) VEC)
            cols = cols * x.shape[2] + lax.broadcasted_iota(jnp.int32, xm.shape, 2)
        first = jnp.min(jnp.where(xm == per_row(m), cols, width), axis=block_axes)
        if pivot is not None and cfg.teacher_logit_softcap is None:
            tau = pivot(first)
        elif gather:
            tau = jnp.take_along_axis(tm, jnp.minimum(first, width - 1)[:, None], axis=-1)[:, 0]
        else:
            tau = jnp.max(jnp.where(cols == per_row(first), tm, NEG_INF), axis=block_axes)
        e_d = lane_sum(_pos_times(e, _pivot_d(cfg, dx, tm, per_row(tau))))
        tau = held(tau)
    return Stats(m=held(m), s=s, mt=held(mt), st=st, a=a, b=b, tau=tau, e_d=e_d), e, et


def fold(cfg: KernelConfig, running: Stats, blk: Stats) -> Stats:
    """``running`` and the statistics ``blk`` of the next block, which :func:`block_stats` took
    relative to the maxima of both (its ``running=``): :func:`combine` with only ``running``'s sums
    rescaled (``blk``'s are already relative to the new maxima)."""
    return stats.add(rescale(cfg, running, blk.m, blk.mt), blk)


#: The :class:`Stats` fields that are a row's maxima or pivot, not sums (one value a row beside lane sums).
MAXIMA = ("m", "mt", "tau")


def _per_row(v: Array, ndim: int) -> Array:
    """A per-row value ``[R]`` shaped to broadcast against a block of ``ndim`` dimensions."""
    return v.reshape(v.shape + (1,) * (ndim - 1))


def lanes_to_rows(st: Stats) -> Stats:
    """Statistics folded with lanes (:func:`block_stats` of ``[R, L, VEC]`` blocks: the maxima and
    pivot ``[R, 1]``, the sums ``[R, L]``, every lane relative to the same maxima) as per-row
    ``[R]`` statistics: the lanes' sums added up, once per row."""
    return st._replace(**{name: (value[:, 0] if name in MAXIMA else jnp.sum(value, axis=-1))
                          for name, value in st._asdict().items() if value is not None and value.ndim == 2})


def _pivot_d(cfg: KernelConfig, dx: Array, t: Array, tau: Array) -> Array:
    """``D = c (x - m) - ct (t - tau)``: ``log q - log p`` up to a per-row constant, 0 on the
    student's argmax (``tau`` shaped to broadcast against the block)."""
    return cfg.scale * dx - cfg.teacher_scale * (t - tau)


def empty_stats(cfg: KernelConfig, rows: int, lanes: Optional[int] = None) -> Stats:
    """The identity of :func:`combine`: nothing seen yet (``lanes``: the maxima ``[R, 1]`` and the
    sums ``[R, lanes]``, as :func:`block_stats` of ``[R, lanes, VEC]`` blocks gives them)."""
    one, wide = ((rows,), (rows,)) if lanes is None else ((rows, 1), (rows, lanes))
    # the label's logit (cross-entropy) is one value a row, like the maxima
    return Stats(**{name: (jnp.full(one, NEG_INF, F32) if name in MAXIMA else jnp.zeros(one if name == "x_y" else wide, F32))
                    for name in lossspec.stats_used(cfg)})


# The algebra between blocks (and shards) is lossspec.stats', on jax.numpy arrays.
finite_max, rescale, rescale_e_d, combine, finalize, finalize_gradient, bad_rows = stats.bind(jnp)


def softcap(x: Array, cap: Optional[float]) -> Array:
    """``cap * tanh(x / cap)`` on the finite entries (``lossspec.stats.softcap``); ``x`` for ``None``."""
    return stats.softcap(jnp, x, cap)


def softcap_slope(x: Array, cap: Any) -> Array:
    """``d/dx cap tanh(x / cap)`` from the raw logits ``x`` (``lossspec.stats.softcap_slope``:
    no cancellation near saturation)."""
    return stats.softcap_slope(jnp, x, cap)


def grad_block(
    cfg: KernelConfig,
    fin: Final,
    coef: Array,
    x: Array,
    t: Optional[Array] = None,
    *,
    hit: Optional[Array] = None,
    vocab: int,
    e: Optional[Array] = None,
    et: Optional[Array] = None,
    base2: bool = False,
    selects: bool = True,
) -> Array:
    """Gradient ``coef * c * dl/dz`` ``[R, B]`` (fp32) of one block w.r.t. the logits ``x``.

    ``dl/dz`` (SPEC section 1): cross-entropy ``(1 + 2 lam lse) q - (1-eps) onehot - eps/V``;
    soft CE and forward KL ``q - p``; reverse KL ``q (log q - log p - l) = q (D - E_q[D])``
    (pivoted form, lossspec.stats), with
    ``q = exp(c (x - m) - lse')`` and ``p = exp(ct (t - mt) - log st)``. ``e``/``et``, when
    given, are the block's ``exp(c (x - m))`` relative to the *final* maxima (single-block
    rows), which saves recomputing the exponentials. Rows with ``coef == 0`` are exactly 0,
    bad rows (NaN / ``+inf``) NaN. ``x``, ``t`` are raw: with a soft cap the gradient is formed
    on the capped logits and multiplied by the cap's slope (:func:`softcap_slope`, from the raw
    ``x``). ``base2``: the exponentials ``q``, ``p`` as :func:`exp_scaled`'s ``exp2``.
    Cross-entropy with ``hit=None``: no column is the label's (a caller that writes the label's
    entry apart, as the Pallas kernels do after their gradient pass).

    ``selects=False`` (the Pallas kernels): no select per entry. A bad row's NaN comes through
    its per-row scale (``NaN * anything`` is NaN), the weighted terms are
    :func:`_pos_times_clamped`'s, and a row with ``coef == 0`` is ``0 * dl/dz``, not exactly 0:
    the caller zeroes such rows (or never computes them, as the one-row Pallas programs).
    """
    c, ct = cfg.scale, cfg.teacher_scale
    x_raw = x
    x = softcap(x, cfg.logit_softcap)
    if t is not None:
        t = softcap(t, cfg.teacher_logit_softcap)
    dx = x - fin.m[:, None]
    if e is None:
        q = exp_scaled(c, dx, fin.lse, base2=base2)
    else:
        q = e * (1.0 / fin.s)[:, None]
    if cfg.is_ce:
        eps = cfg.label_smoothing
        gq = q if fin.q_coef is None else fin.q_coef[:, None] * q
        gz = gq if hit is None else jnp.where(hit, gq - (1.0 - eps), gq)
        if eps > 0:
            gz = gz - eps / vocab
    elif cfg.kind == "entropy":
        # -q (log q + l) = -c q ((x - m) - h / s)
        gz = -c * _pos_times_clamped(q, dx - fin.mean_h[:, None], selects)
    elif cfg.kind == "jensen_shannon":
        q, _, _, log_qm = stats.mixture_terms(BASE2_NUMPY if base2 else jnp, cfg, fin, dx, t - fin.mt[:, None], selects)
        if selects:
            gz = (1.0 - cfg.beta) * _pos_times(q, log_qm - fin.kl_qm[:, None])
        else:  # log_qm is finite there (mixture_terms' clamp): q times it is 0 where q is 0
            gz = (1.0 - cfg.beta) * (q * (log_qm - fin.kl_qm[:, None]))
    else:
        if cfg.kind == "reverse_kl":
            gz = _pos_times(q, _pivot_d(cfg, dx, t, fin.tau[:, None]) - fin.mean_d[:, None])
        else:
            dt = t - fin.mt[:, None]
            p = exp_scaled(ct, dt, fin.lse_t, base2=base2) if et is None else et * (1.0 / fin.st)[:, None]
            gz = q - p
    scale = (coef * c)[:, None]
    if not selects:
        scale = jnp.where(bad_rows(fin)[:, None], jnp.nan, scale)
    grad = scale * gz
    if cfg.logit_softcap is not None:  # the chain rule to the raw logits, in fp32
        grad = grad * softcap_slope(x_raw, cfg.logit_softcap)
    if not selects:
        return grad
    grad = jnp.where(bad_rows(fin)[:, None], jnp.nan, grad)
    return jnp.where(scale != 0, grad, 0.0)




def mixture_block(
    cfg: KernelConfig, fin: Final, x: Array, t: Array, col_ok: Optional[Array] = None, *, base2: bool = False,
    selects: bool = True,
) -> tuple[Array, Array]:
    """``jensen_shannon``'s second pass over one block ``[R, B]`` (fp32) given the global
    statistics: the block's :data:`lossspec.MIXTURE_STATS` ``(kl_qm, kl_pm)`` ``[R]``, plain
    sums that blocks and shards add. ``col_ok``: the columns that belong to this block. ``x``,
    ``t`` raw (capped here). ``selects=False``: the terms without a select per entry
    (``lossspec.stats.mixture_terms``; the Pallas kernels)."""
    x, t = softcap(x, cfg.logit_softcap), softcap(t, cfg.teacher_logit_softcap)
    _, wq, wp, _ = stats.mixture_terms(BASE2_NUMPY if base2 else jnp, cfg, fin, x - fin.m[:, None], t - fin.mt[:, None], selects)
    if col_ok is not None:
        wq, wp = jnp.where(col_ok, wq, 0.0), jnp.where(col_ok, wp, 0.0)
    return jnp.sum(wq, axis=-1), jnp.sum(wp, axis=-1)


# The fp32 [R, B] blocks the fused head's XLA path holds at once per kind, so that they fit
# lossspec.linear.HEAD_MEMORY_FRACTION of the logits: XLA's temporaries of the value-and-grad
# (memory_analysis at N = 1024, V = 4096, fp32 H = 16 and bf16 H = 128) are about one block for
# cross-entropy (counted as 2), three for entropy and five for jensen_shannon (0.93 and 0.92 of
# the 1/8 in fp32 with these counts; 1.42 and 1.18 with 2 and 4).
# Larger blocks matter for time: each chunk reads the whole weight for two matmuls and adds
# G^T h to the whole fp32 weight gradient, which dominates when chunks are small.
_HEAD_LIVE_BLOCKS = {"cross_entropy": 2, "soft_cross_entropy": 4, "forward_kl": 4, "reverse_kl": 4, "entropy": 3, "jensen_shannon": 5}
# With a soft cap (every cap of the kind set) the same measurement gave 1.42 (cross-entropy), 1.18
# (forward KL), 1.24 (entropy) and 1.11 (jensen_shannon) of the 1/8 with the counts above: the
# capped block and the cap's slope are temporaries of their own. One more block each, two for
# cross-entropy.
_HEAD_LIVE_BLOCKS_SOFTCAP = {"cross_entropy": 4, "soft_cross_entropy": 5, "forward_kl": 5, "reverse_kl": 5, "entropy": 4, "jensen_shannon": 6}


def head_live_blocks(kind: str, vocab_parallel: bool, softcap: bool = False, whole_rows: bool = False) -> int:
    """The fp32 ``[R, B]`` blocks the fused head (``jaxloss.head``) holds at once for ``kind``
    (with ``softcap``, a soft cap of the student or the teacher is set): the ``live_blocks`` of
    :func:`lossspec.linear.head_plan`. A vocabulary shard's are the same (the exponentials are
    recomputed from the logits, not kept), and so are whole rows' (``whole_rows``, the twin of
    torch's argument: XLA's temporaries are counted alike either way)."""
    return (_HEAD_LIVE_BLOCKS_SOFTCAP if softcap else _HEAD_LIVE_BLOCKS)[kind]


def varying_axes(*refs: Any) -> frozenset:
    """The manual mesh axes (``shard_map``) over which any of ``refs`` varies."""
    axes: set = set()
    for ref in refs:
        aval = jax.typeof(ref)
        mat = getattr(aval, "mat", None)  # jax 0.10: ManualAxisType(varying=...)
        axes |= set(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())
    return frozenset(axes)


def varying_like(value: Any, *refs: Any) -> Any:
    """``value`` (a pytree) marked as varying over the manual mesh axes of ``refs``.

    Inside ``shard_map`` a loop carry must have the varying-axes type of what the loop body
    produces from the (sharded) inputs; fresh zeros are invariant until cast."""
    axes = varying_axes(*refs)
    if not axes:
        return value

    def cast(leaf: Array) -> Array:
        missing = axes - varying_axes(leaf)
        return lax.pcast(leaf, tuple(sorted(missing)), to="varying") if missing else leaf

    return jax.tree.map(cast, value)


