"""Vocab-parallel losses (``vocab_parallel=<mesh axis name>``): the vocabulary is split over a
mesh axis of ``shard_map`` (or a ``pmap`` axis) in contiguous shards in axis-index order.

Each replica holds ``x [N, V_local]`` (and the teacher's matching slice; labels are global
ids). One call is three steps, every collective explicit (never autograd through one)::

    1. local statistics of the shard       block_stats / the Pallas kernel's "stats" mode
    2. combine over the axis               pmax of the maxima (and the reverse-KL pivot),
                                           rescale to them, psum of the rescaled sums
    3. finalize, then this shard's grad    the same Final on every replica; grad_block /
                                           the Pallas kernel's "grad" mode on the local slice

``jensen_shannon`` adds a step between 2 and 3 (:func:`mixture_shards`): its mixture sums need
the global ``lse``'s, so each shard sums its terms and one more ``psum`` adds them.

The algebra is that of :mod:`lossspec.stats` (and ``lossspec.oracle_vocab_parallel``): the shards
are blocks of one row, combined exactly as the online softmax combines vocabulary blocks.

Step 2 per row, with ``m_k`` the shard maxima: ``m = max_k m_k`` (``pmax``); every exp-sum of
shard ``k`` is multiplied by ``exp(c (m_k - m))`` and the moments that carry ``(x - m_k)`` gain
``(m_k - m)`` times their weight sum (:func:`lossspec.stats.rescale`); reverse KL's pivot ``tau``
(the teacher's logit at the student's argmax) is the one of the first shard, in axis-index
order, holding the global maximum (``pmin`` of the holders' indices, then a ``psum``: the tie
rule of the blocks), and each shard's ``e_d`` is moved to it
(:func:`lossspec.stats.rescale_e_d`); the cross-entropy
label's raw logit comes from the one shard that owns the label (others add 0).

NaN / ``+inf`` rows need no flag of their own: they make the owning shard's ``s`` (or ``st``)
NaN, the ``psum`` carries it to every replica and :func:`lossspec.stats.finalize` marks the row
bad there (NaN loss and gradient on every shard).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax

from lossspec import Tuning
from lossspec.stats import finalize_mixture

from . import IMPLEMENTATIONS, xla as _xla
from .._block import (
    F32,
    Final,
    KernelConfig,
    Stats,
    block_stats,
    finalize,
    grad_block,
    mixture_block,
    rescale,
    rescale_e_d,
    varying_like,
)

Array = jax.Array
AxisName = Union[str, tuple]

# The Stats fields that are sums over the vocabulary (psum'd once rescaled to the global maxima).
SUM_FIELDS = ("s", "x_y", "sum_shift", "n", "st", "a", "b", "e_d", "h")


def axis_names(vocab_parallel: Any) -> tuple:
    """``vocab_parallel`` as a tuple of axis names (a name, or a tuple / list of names)."""
    names = tuple(vocab_parallel) if isinstance(vocab_parallel, (tuple, list)) else (vocab_parallel,)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise TypeError(
            "vocab_parallel must be a mesh axis name (str) or a tuple of them, used inside shard_map or pmap; "
            f"got {vocab_parallel!r}"
        )
    return names


def axis_size(axes: Sequence[str]) -> int:
    """The number of vocabulary shards (static); a clear error outside the axis' context."""
    size = 1
    for name in axes:
        try:
            size *= int(lax.axis_size(name))
        except NameError as err:
            raise ValueError(
                f"vocab_parallel={name!r} is not a bound axis here: call the loss inside shard_map (a mesh with that "
                "axis name) or pmap(axis_name=...)"
            ) from err
    return size


def axis_arg(axes: Sequence[str]) -> AxisName:
    return axes[0] if len(axes) == 1 else tuple(axes)


def local_stats(cfg: KernelConfig, x: Array, target: Array, impl: str, tuning: Optional[Tuning]) -> Stats:
    """Step 1: statistics ``[N]`` of this shard relative to its own maxima (no collective).

    ``target``: labels shifted into this shard's column ids (``labels - offset``; other shards'
    labels fall outside ``[0, V_local)`` and hit nothing), or the teacher's slice. ``impl``'s
    shard kernels where it has them (:data:`jaxloss.backends.IMPLEMENTATIONS`), else XLA here."""
    kernels = IMPLEMENTATIONS[impl].shard_kernels()
    if kernels is not None:
        return kernels.shard_stats(cfg, x, target, tuning=tuning)
    vocab_local = x.shape[-1]
    x32 = x.astype(F32)
    if cfg.is_ce:
        owned = (target >= 0) & (target < vocab_local)
        picked = jnp.take_along_axis(x, jnp.clip(target, 0, vocab_local - 1)[:, None], axis=1, mode="clip")[:, 0]
        stats, _, _ = block_stats(cfg, x32, x_y=jnp.where(owned, picked.astype(F32), 0.0))
        return stats
    stats, _, _ = block_stats(cfg, x32, target.astype(F32) if cfg.has_teacher else None)
    return stats


def combine_shards(cfg: KernelConfig, local: Stats, x: Array, axes: Sequence[str]) -> Stats:
    """Step 2: the statistics of the whole row, identical on every shard (pmax, psum)."""
    axis = axis_arg(axes)
    local = varying_like(local, x)  # psum / pmax reduce values that vary over the axis
    # A NaN maximum (NaN in the shard) competes as +inf; its NaN sums mark the row bad anyway.
    m = lax.pmax(jnp.where(local.m != local.m, jnp.inf, local.m), axis)
    mt = None if local.mt is None else lax.pmax(jnp.where(local.mt != local.mt, jnp.inf, local.mt), axis)
    glob = rescale(cfg, local, m, mt)
    if local.tau is not None:
        # The pivot of the first shard (in axis-index order) holding the maximum (lossspec.stats).
        index = lax.axis_index(axis)
        first = lax.pmin(jnp.where(local.m == m, index, jnp.iinfo(jnp.int32).max), axis)
        tau = lax.psum(jnp.where(index == first, local.tau, 0.0), axis)
        glob = glob._replace(tau=tau, e_d=rescale_e_d(cfg, local, m, tau))
    sums = {name: getattr(glob, name) for name in SUM_FIELDS if getattr(glob, name) is not None}
    sums = lax.psum(varying_like(sums, x), axis)
    return glob._replace(**sums)


def shift_labels(labels: Array, vocab_local: int, axes: Sequence[str]) -> Array:
    """Global label ids -> this shard's column ids (``labels - axis_index * V_local``)."""
    offset = lax.axis_index(axis_arg(axes)) * vocab_local
    return labels - offset.astype(labels.dtype)


def losses(
    cfg: KernelConfig,
    x: Array,
    target: Array,
    coef: Array,
    *,
    axes: Sequence[str],
    vocab: int,
    impl: str,
    tuning: Optional[Tuning],
    with_grad: bool,
) -> tuple[Array, Optional[Array], Final]:
    """Per-token loss ``[N]`` (the same on every shard; 0 where ``coef == 0``), this shard's
    gradient ``coef * c * dl/dz`` ``[N, V_local]`` in the logits' dtype (or ``None``), and the
    :class:`Final` statistics (kept for a backward that recomputes the gradient)."""
    n = x.shape[0]
    if n == 0:
        empty = jnp.zeros((0,), F32)
        fin = Final(l=empty, m=empty, s=empty, lse=empty)
        return empty, (jnp.zeros(x.shape, x.dtype) if with_grad else None), fin
    fin = finalize(cfg, combine_shards(cfg, local_stats(cfg, x, target, impl, tuning), x, axes), vocab)
    if cfg.mixture_pass:
        fin = mixture_shards(cfg, fin, x, target, axes, tuning)
    loss = jnp.where(coef != 0, fin.l, 0.0)
    if not with_grad:
        return loss, None, fin
    return loss, shard_grad(cfg, fin, x, target, coef, vocab=vocab, impl=impl, tuning=tuning), fin


def mixture_shards(cfg: KernelConfig, fin: Final, x: Array, target: Array, axes: Sequence[str], tuning: Optional[Tuning] = None) -> Final:
    """``jensen_shannon``'s second pass (:mod:`lossspec.stats`): each shard's mixture sums from the
    global ``lse``'s (:func:`mixture_shard_sums`, tiled by ``tuning``'s XLA fields; no collective),
    one ``psum`` of the two ``[N]`` sums, then the loss. The same code for both impls (it reads the
    shard once more)."""
    return reduce_mixture(cfg, fin, mixture_shard_sums(cfg, fin, x, target, tuning), x, axes)


def reduce_mixture(cfg: KernelConfig, fin: Final, sums: tuple[Array, Array], x: Array, axes: Sequence[str]) -> Final:
    """``jensen_shannon``'s loss from this shard's mixture sums ``(kl_qm, kl_pm)`` ``[N]``: one
    ``psum`` over the axes (``x``: an array of the shard, for the sums' varying-axes type), then
    :func:`lossspec.stats.finalize_mixture`. Shared with the fused head (``jaxloss.head``)."""
    kl_qm, kl_pm = lax.psum(varying_like(sums, x), axis_arg(axes))
    return finalize_mixture(jnp, cfg, fin, kl_qm, kl_pm)


def mixture_shard_sums(
    cfg: KernelConfig, fin: Final, x: Array, target: Array, tuning: Optional[Tuning] = None
) -> tuple[Array, Array]:
    """This shard's :data:`lossspec.MIXTURE_STATS` ``(kl_qm, kl_pm)`` ``[N]`` fp32 from the global
    :class:`Final`, tiled like the XLA driver (:func:`jaxloss.backends.xla.blocking`, whatever the impl): chunks of
    ``R = chunk_elements // B`` rows, each in column blocks of ``B = vocab_block`` columns when
    the shard is wider than ``single_block_vocab`` (else the whole width), so the fp32
    temporaries are one ``[R, B]`` block, whatever the shard's width. The sums are plain sums
    relative to the global ``lse``'s: blocks add. As in the driver, the last chunk / block is
    moved back to end at ``N`` / ``V_local`` (rows written twice get the same values; columns
    read twice are masked out of the sum), so no padded copy is made."""
    n, width = x.shape
    zero = jnp.zeros((n,), F32)
    if n == 0 or width == 0:
        return zero, zero
    _, block, rows = _xla.blocking(tuning, n, width)
    num_chunks, num_blocks = -(-n // rows), -(-width // block)
    x_store, x_logical = _xla.storage(x)
    t_store, t_logical = _xla.storage(target)

    def chunk(i: Array, acc: tuple[Array, Array]) -> tuple[Array, Array]:
        start = jnp.minimum(i * rows, n - rows)
        part = Final(*(None if v is None else lax.dynamic_slice_in_dim(v, start, rows, 0) for v in fin))
        xc = lax.dynamic_slice_in_dim(x_store, start, rows, 0)
        tc = lax.dynamic_slice_in_dim(t_store, start, rows, 0)

        def column_block(j: Array, sums: tuple[Array, Array]) -> tuple[Array, Array]:
            c0 = jnp.minimum(j * block, width - block)
            cols = c0 + lax.broadcasted_iota(jnp.int32, (1, block), 1)
            xb = _xla.load_block(lax.dynamic_slice_in_dim(xc, c0, block, 1), x_logical)
            tb = _xla.load_block(lax.dynamic_slice_in_dim(tc, c0, block, 1), t_logical)
            kl_qm, kl_pm = mixture_block(cfg, part, xb, tb, col_ok=cols >= j * block)
            return sums[0] + kl_qm, sums[1] + kl_pm

        row_zero = jnp.zeros((rows,), F32)
        kl_qm, kl_pm = lax.fori_loop(0, num_blocks, column_block, varying_like((row_zero, row_zero), x, target))
        return lax.dynamic_update_slice_in_dim(acc[0], kl_qm, start, 0), lax.dynamic_update_slice_in_dim(acc[1], kl_pm, start, 0)

    return lax.fori_loop(0, num_chunks, chunk, varying_like((zero, zero), x, target))


def shard_grad(
    cfg: KernelConfig, fin: Final, x: Array, target: Array, coef: Array, *, vocab: int, impl: str, tuning: Optional[Tuning]
) -> Array:
    """Step 3: this shard's gradient from the global :class:`Final` (no collective).
    ``target`` as in :func:`local_stats` (labels already shifted)."""
    kernels = IMPLEMENTATIONS[impl].shard_kernels()
    if kernels is not None:
        return kernels.shard_grad(cfg, fin, x, target, coef, vocab=vocab, tuning=tuning)
    x32 = x.astype(F32)
    if cfg.is_ce:
        hit = lax.broadcasted_iota(jnp.int32, x.shape, 1) == target[:, None]
        grad = grad_block(cfg, fin, coef, x32, hit=hit, vocab=vocab)
    else:
        grad = grad_block(cfg, fin, coef, x32, target.astype(F32) if cfg.has_teacher else None, vocab=vocab)
    return grad.astype(x.dtype)
