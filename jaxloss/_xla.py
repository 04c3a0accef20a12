"""The XLA path (``impl="xla"``) and the per-row statistics shared with the Pallas kernels.

Everything here works on rows ``[R, B]`` of logits in fp32 and follows ``docs/DESIGN.md``:
shifted coordinates ``d = c (x - m)`` (subtract the row maximum, *then* scale), per-row
statistics of a vocabulary block relative to the block's own maxima, an associative
``combine`` of two blocks (online softmax), ``finalize`` to the per-token loss, and the
gradient of one block from the final statistics.

Notation (SPEC section 1): ``c = logit_scale / T``, ``ct = teacher_logit_scale / T``,
``m`` / ``mt`` row maxima of the raw student / teacher logits, ``e = exp(c (x - m))``,
``et = exp(ct (t - mt))``, ``s = sum e``, ``st = sum et``, ``lse' = log s``.

=============  ==========================================  =====================
stat           definition (relative to the stats' maxima)   kinds
=============  ==========================================  =====================
``m, s``       ``max x``, ``sum e``                          all
``x_y``        the label's raw logit (0 if not in block)     cross_entropy
``sum_shift``  ``sum (x - m)``, with ``n`` columns           cross_entropy, eps > 0
``mt, st``     ``max t``, ``sum et``                         distillation
``a``          ``sum et (x - m)``                            soft CE, forward KL
``b``          ``sum et (t - mt)``                           forward KL
``tau``        the teacher's raw logit where ``x == m``      reverse KL
``e_d``        ``sum e D``, ``D = c (x - m) - ct (t - tau)``  reverse KL
=============  ==========================================  =====================

Per-token losses from the global statistics::

  cross_entropy      l = lse' - (1-eps) c (x_y - m) - (eps/V) c sum_shift + lam (lse' + c m)^2
  soft_cross_entropy l = lse' - c a / st
  forward_kl         l = (ct b / st - log st) - (c a / st - lse')
  reverse_kl         l = e_d / s + (log st - lse' - ct (tau - mt))

Reverse KL departs from DESIGN.md's ``e_s``/``e_t`` moments on purpose: its gradient
``q (log q - log p - l)`` cancels catastrophically when ``l`` is large (huge logits: ``l ~ 1e4``
while the gradient needs ``log q - log p - l`` to ~1e-6), and in fp32 ``e_t / s`` alone carries
an absolute error of ~1e-3 there. With ``r = log q - log p = D + const``, the gradient is
``q (D - e_d / s)``, and pivoting ``D`` on the student's argmax (``tau``) makes ``D`` exactly 0
on the dominant entry, so nothing large is ever subtracted. ``tau`` combines like ``x_y``'s
owner: the block (or shard) with the larger maximum supplies it.

NaN / ``+inf`` rows: a NaN anywhere makes its ``e`` NaN, a ``+inf`` makes ``m = +inf`` and
``x - m`` NaN at that entry, and sums propagate NaN whatever ``max`` does with it (it may drop
NaN on some backends). So a row is bad exactly when ``s`` (or ``st``) is NaN: the flag costs
no extra pass over the logits and survives blocks, shards and rescaling (``0 * NaN`` is NaN).

Vocab-parallel (a later issue) inserts ``pmax`` over the maxima, :func:`rescale` to them and a
``psum`` of the rescaled statistics between :func:`block_stats` and :func:`finalize`; nothing
else changes.

The XLA driver (:func:`fused`) walks the rows in chunks of ``R`` rows (``lax.fori_loop``) so
that the fp32 temporaries of one chunk stay in cache and no fp32 copy of the whole ``[N, V]``
array is ever made; a chunk of a large vocabulary is processed in vocabulary blocks (online
statistics, then a second loop that writes the gradient).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
F32 = jnp.float32
NEG_INF = float("-inf")


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

    @property
    def is_ce(self) -> bool:
        return self.kind == "cross_entropy"


@dataclasses.dataclass(frozen=True)
class XlaTuning:
    """Chunk sizes of the XLA driver (static; tests shrink them to exercise every branch).

    ``chunk_elements``: elements of one row chunk ``[R, V]`` (``R = chunk_elements // V``);
    2**20 elements (4 MiB in fp32) keeps a chunk's fp32 temporaries in L2/L3 while it is
    processed and the loop overhead low (2**19 to 2**22 measured within noise of each other on
    a 2-core CPU). Vocabularies above ``max_single_block_vocab`` are processed in blocks of
    ``vocab_block`` columns with online statistics.
    """

    chunk_elements: int = 1 << 20
    max_single_block_vocab: int = 1 << 18
    vocab_block: int = 1 << 16


TUNING = XlaTuning()


class Stats(NamedTuple):
    """Per-row statistics ``[R]`` (fp32) of a block or a whole row; ``None`` where unused."""

    m: Array
    s: Array
    x_y: Optional[Array] = None
    sum_shift: Optional[Array] = None
    n: Optional[Array] = None
    mt: Optional[Array] = None
    st: Optional[Array] = None
    a: Optional[Array] = None
    b: Optional[Array] = None
    tau: Optional[Array] = None
    e_d: Optional[Array] = None


class Final(NamedTuple):
    """What the gradient pass needs per row ``[R]``: loss ``l``, the maxima (made finite),
    the shifted log-normalisers and the bad-row flag (NaN or ``+inf`` in the row)."""

    l: Array
    m: Array
    s: Array
    lse: Array  # lse' = log s
    bad: Array
    mt: Optional[Array] = None
    st: Optional[Array] = None
    lse_t: Optional[Array] = None  # log st
    q_coef: Optional[Array] = None  # 1 + 2 lam lse (cross-entropy)
    tau: Optional[Array] = None  # reverse KL pivot
    mean_d: Optional[Array] = None  # reverse KL: e_d / s = E_q[D]


def _finite_max(m: Array) -> Array:
    """A row maximum usable as a shift: ``-inf`` (nothing but ``-inf`` seen) becomes 0."""
    return jnp.where(m == NEG_INF, 0.0, m)


def _pos_times(weight: Array, value: Array) -> Array:
    """``weight * value`` with 0 where ``weight == 0`` (so ``0 * -inf`` is 0, never NaN)."""
    return jnp.where(weight > 0, weight * value, 0.0)


def block_stats(
    cfg: KernelConfig,
    x: Array,
    t: Optional[Array] = None,
    *,
    x_y: Optional[Array] = None,
    hit: Optional[Array] = None,
    col_ok: Optional[Array] = None,
) -> tuple[Stats, Array, Optional[Array]]:
    """Statistics of one block ``x`` ``[R, B]`` (fp32) relative to the block's own maxima.

    Args:
      cfg: the kernel configuration.
      x: student logits ``[R, B]`` fp32.
      t: teacher logits ``[R, B]`` fp32 (distillation kinds).
      x_y: the label's raw logit ``[R]`` when the caller gathered it (cross-entropy);
        otherwise it is summed from ``hit``.
      hit: ``[R, B]`` bool, the label's column (cross-entropy, when ``x_y`` is not given).
      col_ok: ``[B]`` or ``[R, B]`` bool, columns that belong to this block (ragged tails,
        overlapping blocks); ``None`` for all.

    Returns:
      ``(stats, e, et)``: the statistics and ``e = exp(c (x - m))``, ``et`` (0 outside
      ``col_ok``), which a caller may reuse for the gradient when no other block follows.
    """
    c, ct = cfg.scale, cfg.teacher_scale
    if col_ok is not None:
        col_ok = jnp.broadcast_to(col_ok, x.shape)
        xm = jnp.where(col_ok, x, NEG_INF)
    else:
        xm = x
    m = jnp.max(xm, axis=-1)
    dx = xm - _finite_max(m)[:, None]  # -inf on -inf and masked columns
    e = jnp.exp(c * dx)
    s = jnp.sum(e, axis=-1)
    if cfg.is_ce:
        if x_y is None:
            x_y = jnp.sum(jnp.where(hit, x, 0.0), axis=-1)
        sum_shift = n = None
        if cfg.label_smoothing > 0:
            if col_ok is not None:
                sum_shift = jnp.sum(jnp.where(col_ok, dx, 0.0), axis=-1)
                n = jnp.sum(col_ok.astype(F32), axis=-1)
            else:
                sum_shift = jnp.sum(dx, axis=-1)
                n = jnp.full(m.shape, x.shape[-1], F32)
        return Stats(m, s, x_y=x_y, sum_shift=sum_shift, n=n), e, None
    assert t is not None
    tm = t if col_ok is None else jnp.where(col_ok, t, NEG_INF)
    mt = jnp.max(tm, axis=-1)
    dt = tm - _finite_max(mt)[:, None]
    et = jnp.exp(ct * dt)
    st = jnp.sum(et, axis=-1)
    a = b = tau = e_d = None
    if cfg.kind in ("soft_cross_entropy", "forward_kl"):
        a = jnp.sum(_pos_times(et, dx), axis=-1)
    if cfg.kind == "forward_kl":
        b = jnp.sum(_pos_times(et, dt), axis=-1)
    if cfg.kind == "reverse_kl":
        # Ties of the maximum: the largest teacher logit among them (any fixed choice works).
        tau = jnp.max(jnp.where(xm == m[:, None], tm, NEG_INF), axis=-1)
        e_d = jnp.sum(_pos_times(e, _pivot_d(cfg, dx, tm, tau)), axis=-1)
    return Stats(m, s, mt=mt, st=st, a=a, b=b, tau=tau, e_d=e_d), e, et


def _pivot_d(cfg: KernelConfig, dx: Array, t: Array, tau: Array) -> Array:
    """``D = c (x - m) - ct (t - tau)``: ``log q - log p`` up to a per-row constant, 0 on the
    student's argmax."""
    return cfg.scale * dx - cfg.teacher_scale * (t - tau[:, None])


def _shift(m_old: Array, m_new: Array, scale: float) -> tuple[Array, Array]:
    """``(exp(scale (m_old - m_new)), m_old - m_new)`` in finite-max coordinates, both 0 when
    ``m_old`` is ``-inf`` (its exp-sums and moments are 0, and ``exp`` must not overflow)."""
    empty = m_old == NEG_INF
    delta = jnp.where(empty, 0.0, _finite_max(m_old) - _finite_max(m_new))
    r = jnp.where(empty, 0.0, jnp.exp(scale * delta))
    return r, delta


def rescale(cfg: KernelConfig, st: Stats, m_new: Array, mt_new: Optional[Array] = None) -> Stats:
    """Express ``st`` relative to the (larger) maxima ``m_new`` / ``mt_new``.

    Exp-sums are multiplied by ``r = exp(c (m - m'))``; moments that carry ``(x - m)`` gain
    ``(m - m')`` times their weight sum (DESIGN.md, "the per-row statistics")."""
    r, dm = _shift(st.m, m_new, cfg.scale)
    out = st._replace(m=m_new, s=r * st.s)
    if st.sum_shift is not None:
        out = out._replace(sum_shift=st.sum_shift + st.n * dm)
    if mt_new is None:
        return out
    rt, dmt = _shift(st.mt, mt_new, cfg.teacher_scale)
    out = out._replace(mt=mt_new, st=rt * st.st)
    if st.a is not None:
        out = out._replace(a=rt * (st.a + st.st * dm))
    if st.b is not None:
        out = out._replace(b=rt * (st.b + st.st * dmt))
    return out


def _rescale_rkl(cfg: KernelConfig, st: Stats, m_new: Array, tau_new: Array) -> Array:
    """``e_d`` relative to ``(m_new, tau_new)``: ``D`` gains ``c (m - m') - ct (tau - tau')``."""
    r, dm = _shift(st.m, m_new, cfg.scale)
    shift = cfg.scale * dm - cfg.teacher_scale * (st.tau - tau_new)
    # r == 0 (an empty or far-below block) contributes exactly 0, even when tau is -inf.
    return jnp.where(r > 0, r * (st.e_d + st.s * shift), 0.0)


def add(a: Stats, b: Stats) -> Stats:
    """Sum of two :class:`Stats` already relative to the same maxima."""

    def plus(u: Optional[Array], v: Optional[Array]) -> Optional[Array]:
        return None if u is None else u + v

    return Stats(
        m=a.m,
        s=a.s + b.s,
        x_y=plus(a.x_y, b.x_y),
        sum_shift=plus(a.sum_shift, b.sum_shift),
        n=plus(a.n, b.n),
        mt=a.mt,
        st=plus(a.st, b.st),
        a=plus(a.a, b.a),
        b=plus(a.b, b.b),
        tau=a.tau,
        e_d=plus(a.e_d, b.e_d),
    )


def combine(cfg: KernelConfig, a: Stats, b: Stats) -> Stats:
    """Statistics of the union of two blocks (online softmax step; associative)."""
    m = jnp.maximum(a.m, b.m)
    mt = None if a.mt is None else jnp.maximum(a.mt, b.mt)
    out = add(rescale(cfg, a, m, mt), rescale(cfg, b, m, mt))
    if a.tau is not None:
        tau = jnp.where(b.m > a.m, b.tau, a.tau)
        out = out._replace(tau=tau, e_d=_rescale_rkl(cfg, a, m, tau) + _rescale_rkl(cfg, b, m, tau))
    return out


def empty_stats(cfg: KernelConfig, rows: int) -> Stats:
    """The identity of :func:`combine`: nothing seen yet."""
    neg = jnp.full((rows,), NEG_INF, F32)
    zero = jnp.zeros((rows,), F32)
    if cfg.is_ce:
        eps = cfg.label_smoothing > 0
        return Stats(neg, zero, x_y=zero, sum_shift=zero if eps else None, n=zero if eps else None)
    return Stats(
        neg,
        zero,
        mt=neg,
        st=zero,
        a=zero if cfg.kind in ("soft_cross_entropy", "forward_kl") else None,
        b=zero if cfg.kind == "forward_kl" else None,
        tau=neg if cfg.kind == "reverse_kl" else None,
        e_d=zero if cfg.kind == "reverse_kl" else None,
    )


def finalize(cfg: KernelConfig, st: Stats, vocab: int) -> Final:
    """Per-token loss ``l`` ``[R]`` from the global statistics (NaN on bad rows)."""
    c, ct = cfg.scale, cfg.teacher_scale
    m = _finite_max(st.m)
    lse = jnp.log(st.s)
    bad = st.s != st.s
    if cfg.is_ce:
        eps, lam = cfg.label_smoothing, cfg.z_loss
        loss = lse - (1.0 - eps) * c * (st.x_y - m)
        if eps > 0:
            loss = loss - (eps / vocab) * c * st.sum_shift
        q_coef = None
        if lam > 0:
            full_lse = lse + c * m
            loss = loss + lam * full_lse * full_lse
            q_coef = 1.0 + 2.0 * lam * full_lse
        loss = jnp.where(bad, jnp.nan, loss)
        return Final(loss, m, st.s, lse, bad, q_coef=q_coef)
    mt = _finite_max(st.mt)
    lse_t = jnp.log(st.st)
    bad = bad | (st.st != st.st)
    if cfg.kind == "soft_cross_entropy":
        loss = lse - c * st.a / st.st
    elif cfg.kind == "forward_kl":
        loss = (ct * st.b / st.st - lse_t) - (c * st.a / st.st - lse)
    else:  # reverse_kl
        mean_d = st.e_d / st.s
        loss = mean_d + (lse_t - lse - ct * (st.tau - mt))
        loss = jnp.where(bad, jnp.nan, loss)
        return Final(loss, m, st.s, lse, bad, mt=mt, st=st.st, lse_t=lse_t, tau=st.tau, mean_d=mean_d)
    loss = jnp.where(bad, jnp.nan, loss)
    return Final(loss, m, st.s, lse, bad, mt=mt, st=st.st, lse_t=lse_t)


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
) -> Array:
    """Gradient ``coef * c * dl/dz`` ``[R, B]`` (fp32) of one block w.r.t. the logits ``x``.

    ``dl/dz`` (SPEC section 1): cross-entropy ``(1 + 2 lam lse) q - (1-eps) onehot - eps/V``;
    soft CE and forward KL ``q - p``; reverse KL ``q (log q - log p - l) = q (D - E_q[D])``
    (pivoted form, see the module docstring), with
    ``q = exp(c (x - m) - lse')`` and ``p = exp(ct (t - mt) - log st)``. ``e``/``et``, when
    given, are the block's ``exp(c (x - m))`` relative to the *final* maxima (single-block
    rows), which saves recomputing the exponentials. Rows with ``coef == 0`` are exactly 0,
    bad rows (NaN / ``+inf``) NaN.
    """
    c, ct = cfg.scale, cfg.teacher_scale
    dx = x - fin.m[:, None]
    if e is None:
        q = jnp.exp(c * dx - fin.lse[:, None])
    else:
        q = e * (1.0 / fin.s)[:, None]
    if cfg.is_ce:
        eps = cfg.label_smoothing
        gq = q if fin.q_coef is None else fin.q_coef[:, None] * q
        gz = jnp.where(hit, gq - (1.0 - eps), gq)
        if eps > 0:
            gz = gz - eps / vocab
    else:
        if cfg.kind == "reverse_kl":
            gz = _pos_times(q, _pivot_d(cfg, dx, t, fin.tau) - fin.mean_d[:, None])
        else:
            dt = t - fin.mt[:, None]
            p = jnp.exp(ct * dt - fin.lse_t[:, None]) if et is None else et * (1.0 / fin.st)[:, None]
            gz = q - p
    scale = (coef * c)[:, None]
    grad = scale * gz
    grad = jnp.where(fin.bad[:, None], jnp.nan, grad)
    return jnp.where(scale != 0, grad, 0.0)


# --------------------------------------------------------------------------------------------
# The XLA driver
# --------------------------------------------------------------------------------------------


HIGHER_ORDER_16BIT_MESSAGE = (
    "jaxloss: higher-order derivatives (grad of grad, jax.hessian, jax.jvp of a gradient) need float32 or "
    "float64 logits: bfloat16/float16 logits travel through impl='xla' as raw bits, which carry no derivative "
    "(the result would be silently 0). Cast the logits to float32 before the loss, e.g. "
    "loss(logits.astype(jnp.float32), ...), and use impl='xla'."
)


def no_derivatives(fn: Callable[..., Any], message: str) -> Callable[..., Any]:
    """``fn`` (arrays in, a pytree of arrays out) unchanged, but differentiating *through* it
    raises ``NotImplementedError(message)`` instead of failing obscurely or returning a silent
    zero. The losses' own first-order ``custom_vjp`` never differentiates its kernels, so this
    only fires for higher-order derivatives (the custom_vjp's forward is then differentiated)."""
    wrapped = jax.custom_jvp(fn)

    def refuse(primals: Any, tangents: Any) -> Any:
        raise NotImplementedError(message)

    wrapped.defjvp(refuse)
    return wrapped


def _to_bits(x: Array) -> Array:
    return lax.bitcast_convert_type(x, jnp.uint16)


def _storage(x: Array) -> tuple[Array, Optional[jnp.dtype]]:
    """16-bit arrays travel through the loops as ``uint16``: XLA's CPU backend upcasts bf16 /
    fp16 dynamic-slices and dynamic-update-slices to fp32, which would convert the whole
    ``[N, V]`` array (or the gradient buffer, once per chunk). Bit patterns are exact. A
    bitcast has no derivative: differentiating through it (only higher-order derivatives do)
    raises a clear ``NotImplementedError`` (:data:`HIGHER_ORDER_16BIT_MESSAGE`)."""
    if x.dtype.itemsize == 2:
        return no_derivatives(_to_bits, HIGHER_ORDER_16BIT_MESSAGE)(x), x.dtype
    return x, None


def _load(block: Array, logical: Optional[jnp.dtype]) -> Array:
    if logical is not None:
        block = lax.bitcast_convert_type(block, logical)
    return block.astype(F32)


def _store(grad: Array, dtype: jnp.dtype, stored_as_bits: bool) -> Array:
    grad = grad.astype(dtype)  # the one rounding to the logits' dtype
    return lax.bitcast_convert_type(grad, jnp.uint16) if stored_as_bits else grad


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


def fused(
    cfg: KernelConfig,
    x: Array,
    target: Array,
    coef: Array,
    *,
    with_grad: bool = True,
    tuning: Optional[XlaTuning] = None,
) -> tuple[Array, Optional[Array]]:
    """Per-token loss and gradient in one pass over the logits (XLA).

    Args:
      cfg: the kernel configuration.
      x: logits ``[N, V]`` (any float dtype).
      target: safe labels ``[N]`` int32 (0 where invalid) or teacher logits ``[N, V]``.
      coef: per-token coefficient ``[N]`` fp32 (``weight / D``, or ``weight`` for "none").
      with_grad: also compute the gradient.
      tuning: chunk sizes (default :data:`TUNING`).

    Returns:
      ``(l, grad)``: the per-token loss ``l`` ``[N]`` fp32 (0 where ``coef == 0``; *not*
      multiplied by ``coef``) and ``grad = coef * c * dl/dz`` ``[N, V]`` in the logits'
      dtype (rounded once from fp32), or ``None``.
    """
    tuning = tuning or TUNING
    n, vocab = x.shape
    if n == 0:
        return jnp.zeros((0,), F32), (jnp.zeros(x.shape, x.dtype) if with_grad else None)
    blocked = vocab > tuning.max_single_block_vocab
    width = min(vocab, tuning.vocab_block) if blocked else vocab
    rows = max(1, min(n, tuning.chunk_elements // width))
    num_chunks = -(-n // rows)
    x_store, x_logical = _storage(x)
    distill = cfg.kind != "cross_entropy"
    t_store, t_logical = _storage(target) if distill else (target, None)

    def chunk(i: Array, carry: tuple[Array, Optional[Array]]) -> tuple[Array, Optional[Array]]:
        loss_buf, grad_buf = carry
        # The last chunk is moved back to end at row n: rows computed twice are written twice
        # with identical values, so no padding copy of the logits is needed.
        start = jnp.minimum(i * rows, n - rows)
        xc = lax.dynamic_slice_in_dim(x_store, start, rows, 0)
        tc = lax.dynamic_slice_in_dim(t_store, start, rows, 0)
        cc = lax.dynamic_slice_in_dim(coef, start, rows, 0)
        if blocked:
            loss, grad_buf = _chunk_blocked(cfg, tuning, xc, x_logical, tc, t_logical, cc, grad_buf, start, x.dtype)
        else:
            loss, grad = _chunk_single(cfg, xc, x_logical, tc, t_logical, cc, with_grad, x.dtype)
            if with_grad:
                grad_buf = lax.dynamic_update_slice_in_dim(grad_buf, grad, start, 0)
        loss_buf = lax.dynamic_update_slice_in_dim(loss_buf, loss, start, 0)
        return loss_buf, grad_buf

    grad_buf = jnp.zeros(x.shape, x_store.dtype) if with_grad else None
    init = varying_like((jnp.zeros((n,), F32), grad_buf), x, target, coef)
    loss, grad_buf = lax.fori_loop(0, num_chunks, chunk, init)
    if grad_buf is not None and x_logical is not None:
        grad_buf = lax.bitcast_convert_type(grad_buf, x_logical)
    return loss, grad_buf


def _chunk_single(
    cfg: KernelConfig,
    xc: Array,
    x_logical: Optional[jnp.dtype],
    tc: Array,
    t_logical: Optional[jnp.dtype],
    cc: Array,
    with_grad: bool,
    dtype: jnp.dtype,
) -> tuple[Array, Optional[Array]]:
    """Rows whose whole vocabulary is one block: the exponentials are computed once and reused
    by the gradient."""
    vocab = xc.shape[1]
    x32 = _load(xc, x_logical)
    if cfg.is_ce:
        # A gather of R elements, not a one-hot reduction over the chunk.
        x_y = _load(jnp.take_along_axis(xc, jnp.clip(tc, 0, vocab - 1)[:, None], axis=1, mode="clip")[:, 0], x_logical)
        st, e, et = block_stats(cfg, x32, x_y=x_y)
        t32 = None
    else:
        t32 = _load(tc, t_logical)
        st, e, et = block_stats(cfg, x32, t32)
    fin = finalize(cfg, st, vocab)
    loss = jnp.where(cc != 0, fin.l, 0.0)
    if not with_grad:
        return loss, None
    hit = (lax.broadcasted_iota(jnp.int32, xc.shape, 1) == tc[:, None]) if cfg.is_ce else None
    grad = grad_block(cfg, fin, cc, x32, t32, hit=hit, vocab=vocab, e=e, et=et)
    return loss, _store(grad, dtype, x_logical is not None)


def _chunk_blocked(
    cfg: KernelConfig,
    tuning: XlaTuning,
    xc: Array,
    x_logical: Optional[jnp.dtype],
    tc: Array,
    t_logical: Optional[jnp.dtype],
    cc: Array,
    grad_buf: Optional[Array],
    row_start: Array,
    dtype: jnp.dtype,
) -> tuple[Array, Optional[Array]]:
    """Rows of a large vocabulary: pass 1 folds the statistics of vocabulary blocks (online
    max and sum-exp), pass 2 writes the gradient block by block."""
    rows, vocab = xc.shape
    width = min(vocab, tuning.vocab_block)
    num_blocks = -(-vocab // width)

    def window(j: Array) -> tuple[Array, Array, Array, Array]:
        # As for rows, the last block is moved back to end at V; in pass 1 the columns it
        # shares with the previous block are masked out (col_ok), in pass 2 they are rewritten.
        start = jnp.minimum(j * width, vocab - width)
        cols = start + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        x32 = _load(lax.dynamic_slice_in_dim(xc, start, width, 1), x_logical)
        t32 = None if cfg.is_ce else _load(lax.dynamic_slice_in_dim(tc, start, width, 1), t_logical)
        return start, cols, x32, t32

    x_y = None
    if cfg.is_ce:
        x_y = _load(jnp.take_along_axis(xc, jnp.clip(tc, 0, vocab - 1)[:, None], axis=1, mode="clip")[:, 0], x_logical)

    def pass1(j: Array, acc: Stats) -> Stats:
        _, cols, x32, t32 = window(j)
        col_ok = cols >= j * width
        blk, _, _ = block_stats(cfg, x32, t32, x_y=jnp.zeros_like(x_y) if cfg.is_ce else None, col_ok=col_ok)
        return combine(cfg, acc, blk)

    stats = lax.fori_loop(0, num_blocks, pass1, varying_like(empty_stats(cfg, rows), xc, tc, cc))
    if cfg.is_ce:
        stats = stats._replace(x_y=x_y)
    fin = finalize(cfg, stats, vocab)
    loss = jnp.where(cc != 0, fin.l, 0.0)
    if grad_buf is None:
        return loss, None

    def pass2(j: Array, buf: Array) -> Array:
        start, cols, x32, t32 = window(j)
        hit = (cols == tc[:, None]) if cfg.is_ce else None
        grad = grad_block(cfg, fin, cc, x32, t32, hit=hit, vocab=vocab)
        return lax.dynamic_update_slice(buf, _store(grad, dtype, x_logical is not None), (row_start, start))

    return loss, lax.fori_loop(0, num_blocks, pass2, grad_buf)
