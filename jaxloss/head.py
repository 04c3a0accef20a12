"""The fused LM head in JAX (the XLA path): ``linear_<kind>`` for every kind of the table with a head.

``linear_<kind>(hidden [..., H], weight [V, H], <target>, loss_mask, *, bias, ...)`` equals
``<kind>(hidden @ weight.T + bias, ...)`` with the logits in fp32 (signatures, checks and the
float64 reference: :mod:`lossspec.linear`; the twin is ``torchloss.head``).

How (``R``, ``B`` from :func:`lossspec.linear.head_plan`): the tokens are processed in chunks
of ``R`` rows (``lax.fori_loop``). When a whole row fits the block budget (``B = V``, the
common case) a chunk is one matmul ``z = h W^T + b`` ``[R, V]`` in fp32, the statistics and the
logits' gradient ``G = coef * c * dl/dz`` of :mod:`jaxloss._block` (the formulation of
:mod:`lossspec.stats`), then ``dh = G W`` and ``dW += G^T h``, ``db += sum G``: three matmuls,
no recompute. Otherwise the chunk runs over vocabulary blocks of ``B`` columns twice: an
online softmax (``combine``) for the statistics, then the gradient of each block from the
recomputed logits (five matmuls). A kind with the mixture pass (``jensen_shannon``, the kind
table's ``mixture_pass``) sums its mixture terms from the rows' final statistics in between
(:func:`jaxloss._block.mixture_block`: on the chunk's logits when a row fits, else over the
blocks once more, two more matmuls). Every product is exact and accumulated in fp32
(``preferred_element_type=float32``, ``Precision.HIGHEST``: no TF32 on a GPU): the forward
dots read bf16 hidden states and weights as they are (:func:`_dot`), other 16-bit inputs and
the backward's slices of the weight are upcast (exact); the fp32 gradients are rounded once to
the parameters' dtypes. Opt-in (``tuning=lossspec.HeadTuning(bf16_matmul_devices=("cuda",))``): on a GPU the backward of bf16
inputs reads them as they are too and multiplies the fp32 ``G`` as three exact bf16 terms
(:func:`split_bf16`, tensor cores; the same exact products accumulated in fp32).

Differentiation: a ``jax.custom_vjp``. For the reduced normalisations the forward computes the
fp32 gradients of hidden, weight and bias (the residuals) and the backward scales them by the
upstream scalar and rounds once. For ``"none"`` the upstream gradient differs per token and
enters the weight gradient inside the sum over tokens, so the backward recomputes the head with
``coef * upstream`` (the forward computes the loss only). First order only.

``recompute_logits=True`` (:func:`head_backward`): the forward keeps the rows' :class:`Final`
statistics (``[N]`` vectors) and the backward runs over vocabulary slices, each recomputing the
logits of all tokens chunk by chunk and summing its ``G^T h`` in an fp32 ``[B, H]`` buffer
rounded once into the slice's rows (the scan's stacked output): no fp32 ``[V, H]`` gradient,
one more matmul (two with a teacher). On the CPU XLA hoists the bits of the whole 16-bit weight
(:func:`_rows`) out of the loop: one copy of the weight in its dtype.

Vocab parallel (``vocab_parallel=<mesh axis>`` inside ``shard_map``; :class:`Shards`): the weight
is this replica's ``[V_local, H]`` slice; each chunk's shard statistics are combined over the
axis (``jaxloss.backends.vocab_parallel.combine_shards``: ``[R]`` vectors, never logits) before the
local gradient, and ``dh`` is ``psum``'d once (docs/linear_head.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Never, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lossspec
from lossspec import LossConfig
from lossspec import linear as spec_linear
from lossspec.stats import finalize_mixture

from . import _autodiff, _prepare, api, backends
from .backends import vocab_parallel as _vocab_parallel, xla as _xla
from ._block import (
    F32, Final, KernelConfig, block_stats, combine, empty_stats, finalize, grad_block, head_live_blocks, mixture_block, varying_axes,
    varying_like,
)

Array = jax.Array
HIGHEST = lax.Precision.HIGHEST

__all__ = [
    "linear_cross_entropy", "linear_soft_cross_entropy", "linear_forward_kl", "linear_reverse_kl", "linear_entropy", "linear_jensen_shannon",
]

# --------------------------------------------------------------------------------------------
# Matmuls in fp32
# --------------------------------------------------------------------------------------------


def _dot(a: Array, b: Array, contract: tuple[int, int]) -> Array:
    """``a`` ``[., K]``/``[K, .]`` times ``b``, contracting ``a``'s axis ``contract[0]`` with
    ``b``'s ``contract[1]``, every product exact and accumulated in fp32.

    Two bf16 operands go to the dot as they are (``preferred_element_type=float32``: a bf16
    product has 16 significant bits, exact in fp32; on the CPU XLA's bf16 x bf16 -> fp32 dot is
    about 4x its fp32 dot). Otherwise both are read as fp32 (a 16-bit operand upcast exactly).
    (Splitting an fp32 ``G`` into three exact bf16 terms for the backward dots was measured
    slower on the CPU: 3 bf16 dots against one fp32 dot of the same speed for ``G^T h``.)"""
    if a.dtype != b.dtype:
        a, b = a.astype(F32), b.astype(F32)
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=F32)


# ``HeadTuning.bf16_matmul_devices``: the platforms whose backward reads bf16 hidden states and
# weights as they are, with ``G`` split into exact bf16 terms (:func:`split_bf16`), instead of
# widening them to fp32 (a GPU's bf16 dot with fp32 results runs on tensor cores). None by
# default: on an H200 (JAX 0.11.2) the first form of the split (fp32 -> bf16 -> fp32 conversions)
# gave ``G`` rounded to bf16 (XLA's GPU compiler folds such round trips), and the bit-mask split
# that replaced it has not run on a GPU yet; ``("cuda",)`` opts in
# (parity_tests/test_linear_head_bf16_matmuls.py checks it there). On the CPU three bf16 dots are
# slower than the one fp32 dot (measured, see :func:`_dot`).


def split_bf16(g: Array, terms: int = spec_linear.HEAD_SPLIT_TERMS) -> list[Array]:
    """``g`` fp32 as ``terms`` bf16 arrays whose fp32 sum is ``g``: each term but the last is the
    remainder's top 8 significant bits (its low 16 bits masked off: exact in bf16), the remainder
    after it exact in fp32; three terms carry the whole 24-bit significand. Bit masks, not
    fp32 -> bf16 -> fp32 conversions: XLA's GPU compiler folds such round trips away (excess
    precision), which left ``G`` rounded to bf16 on an H200."""
    parts = []
    rest = g
    for _ in range(terms - 1):
        head = lax.bitcast_convert_type(lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000), F32)
        parts.append(head.astype(jnp.bfloat16))
        rest = rest - head
    parts.append(rest.astype(jnp.bfloat16))
    return parts


def _operand_dtype(*arrays: Optional[Array]) -> Any:
    """The dtype the matmuls read: bf16 when every operand is bf16 (products exact in fp32, the
    fast bf16 dots of :func:`_dot`), else fp32 (16-bit upcast exactly)."""
    present = [a.dtype for a in arrays if a is not None]
    return jnp.bfloat16 if present and all(d == jnp.bfloat16 for d in present) else F32


def _logits(h: Array, w: Array, b: Optional[Array]) -> Array:
    """``h @ w.T + b`` ``[R, B]`` fp32 (``h`` ``[R, H]``, ``w`` ``[B, H]``, ``b`` ``[B]``)."""
    z = _dot(h, w, (1, 1))
    return z if b is None else z + b[None, :].astype(F32)


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------

Head = tuple  # (hidden [N, H], weight [V, H]: both bf16 or both fp32 (_operand_dtype); bias [V] fp32 | None)


class Shards(NamedTuple):
    """A vocabulary split over the mesh axes ``axes`` (``vocab_parallel``): this replica's weight
    holds ``V_local`` rows of the ``vocab`` rows of the whole head (labels are already shifted to
    its column ids)."""

    axes: tuple
    vocab: int


def _whole_row(cfg: KernelConfig, local: Any, like: Array, shards: Optional[Shards], vocab: int) -> Any:
    """The :class:`Final` statistics of whole rows: a shard's statistics are combined over the
    vocabulary axes first (one ``pmax`` / ``psum`` round for the chunk's rows,
    :func:`jaxloss.backends.vocab_parallel.combine_shards`); the global ``V`` enters ``finalize``."""
    if shards is None:
        return finalize(cfg, local, vocab)
    return finalize(cfg, _vocab_parallel.combine_shards(cfg, local, like, shards.axes), shards.vocab)


def _with_mixture(cfg: KernelConfig, fin: Final, sums: tuple[Array, Array], like: Array, shards: Optional[Shards]) -> Final:
    """The rows' :class:`Final` statistics with the mixture pass's loss (lossspec.stats), from
    the sums ``(kl_qm, kl_pm)`` of this head's (or this shard's, then ``psum``'d) columns."""
    if shards is None:
        return finalize_mixture(jnp, cfg, fin, *sums)
    return _vocab_parallel.reduce_mixture(cfg, fin, sums, like, shards.axes)


def _bf16_bits(x: Array, start: Any, rows: int) -> Array:
    """Rows ``start : start + rows`` of a bf16 ``x`` as their bits (``uint16``). XLA's CPU
    compiler normalises a bf16 ``dynamic_slice`` (and ``gather``) through fp32, so the slice
    is taken from the bits; and it hoists the loop-invariant conversion of the whole array out
    of the loop (a copy of it: fp32, or the ``uint16`` bits). The ``optimization_barrier``,
    which ties ``x`` to the loop-varying ``start``, keeps the conversion inside, fused into the
    slice: only ``rows`` rows are read. (At N = 1024, H = 256, V = 8192 bf16 it took XLA's
    temporaries for the ``recompute_logits`` value-and-grad from 7.8 to 3.5 MiB.)"""
    x, start = lax.optimization_barrier((x, start))
    return lax.dynamic_slice_in_dim(lax.bitcast_convert_type(x, jnp.uint16), start, rows, 0)


def _rows(x: Array, start: Any, rows: int) -> Array:
    """Rows ``start : start + rows`` of ``x`` (bf16: through their bits, :func:`_bf16_bits`)."""
    if x.dtype != jnp.bfloat16:
        return lax.dynamic_slice_in_dim(x, start, rows, 0)
    return lax.bitcast_convert_type(_bf16_bits(x, start, rows), jnp.bfloat16)


def _rows_f32(x: Array, start: Any, rows: int) -> Array:
    """:func:`_rows` in fp32 (exact; a bf16 slice is widened by a shift of its bits, so that no
    bf16 operation is left for the CPU compiler to normalise and hoist)."""
    if x.dtype != jnp.bfloat16:
        return _rows(x, start, rows).astype(F32)
    return lax.bitcast_convert_type(_bf16_bits(x, start, rows).astype(jnp.uint32) << 16, F32)


def _stack(slices: Array, vocab: int) -> Array:
    """``[S, B, ...]`` gradients of vocabulary slices -> ``[V, ...]``; the last slice ends at
    ``V`` (moved back), so only its last ``V - (S - 1) B`` rows are new. A free reshape when
    ``B`` divides ``V`` (:func:`lossspec.linear.head_plan_recompute` prefers such a ``B``),
    else one copy."""
    num, width = slices.shape[:2]
    if num * width == vocab:
        return slices.reshape((vocab,) + slices.shape[2:])
    head = slices[:-1].reshape(((num - 1) * width,) + slices.shape[2:])
    return jnp.concatenate([head, slices[-1, width - (vocab - (num - 1) * width) :]], axis=0)


def _head_grads(
    dh: Array, dw: Array, start: Any, g: Array, h: Array, w: Array, slice_rows: int, tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING
) -> tuple[Array, Array]:
    """The backward of a block of ``B`` vocabulary columns starting at ``start``: ``dh += g W_blk``
    and ``dw[start : start + B] += g^T h`` (``g`` ``[R, B]`` fp32, ``h`` ``[R, H]``, ``w``
    ``[V, H]``, ``dh`` ``[R, H]`` and ``dw`` ``[V, H]`` fp32), over slices of ``slice_rows``
    vocabulary rows. XLA writes a dot's result to a buffer of its own before the addition, so one
    product of the whole ``[B, H]`` would be a second weight gradient in memory; and a 16-bit
    weight is upcast one slice at a time (no fp32 copy of the weight). The last slice is moved
    back to end at ``B``; its columns already counted are zeroed (they add exact zeros). On the
    platforms of ``tuning.bf16_matmul_devices`` bf16 ``h`` and ``w`` are read as they are and
    ``g`` as ``tuning.split_terms`` exact bf16 terms."""
    width = g.shape[1]
    slice_rows = min(slice_rows, width)
    num_slices = -(-width // slice_rows)
    h32 = h.astype(F32)

    def widened(g_slice: Array, at: Array) -> tuple[Array, Array]:
        return _dot(g_slice, _rows_f32(w, at, slice_rows), (1, 0)), _dot(g_slice, h32, (0, 0))

    def split(g_slice: Array, at: Array) -> tuple[Array, Array]:
        # bf16 x bf16 dots with fp32 results (tensor cores), G as exact bf16 terms
        w_slice = _rows(w, at, slice_rows)
        terms = split_bf16(g_slice, tuning.split_terms)
        d_h, d_w = _dot(terms[0], w_slice, (1, 0)), _dot(terms[0], h, (0, 0))
        for term in terms[1:]:
            d_h, d_w = d_h + _dot(term, w_slice, (1, 0)), d_w + _dot(term, h, (0, 0))
        return d_h, d_w

    platforms = tuning.bf16_matmul_devices
    bf16 = w.dtype == h.dtype == jnp.bfloat16 and platforms

    def products(g_slice: Array, at: Array) -> tuple[Array, Array]:
        if not bf16:
            return widened(g_slice, at)
        return lax.platform_dependent(g_slice, at, default=widened, **{p: split for p in platforms})

    def add(j: Any, carry: tuple) -> tuple:
        dh, dw = carry
        offset = jnp.minimum(j * slice_rows, width - slice_rows)
        fresh = offset + lax.broadcasted_iota(jnp.int32, (1, slice_rows), 1) >= j * slice_rows
        g_slice = jnp.where(fresh, lax.dynamic_slice_in_dim(g, offset, slice_rows, 1), 0.0)
        at = start + offset
        d_h, d_w = products(g_slice, at)
        dh = dh + d_h
        dw = lax.dynamic_update_slice_in_dim(dw, lax.dynamic_slice_in_dim(dw, at, slice_rows, 0) + d_w, at, 0)
        return dh, dw

    if num_slices == 1:
        return add(0, (dh, dw))
    return lax.fori_loop(0, num_slices, add, (dh, dw))


def _slice_head(head: Head, start: Any, width: int) -> Head:
    """Rows ``start : start + width`` of the weight and bias (a vocabulary block)."""
    h, w, b = head
    w = lax.dynamic_slice_in_dim(w, start, width, 0)
    return h, w, None if b is None else lax.dynamic_slice_in_dim(b, start, width, 0)


def _chunk_whole(
    cfg: KernelConfig, student: Head, teacher: Optional[Head], y: Optional[Array], coef: Array, with_grad: bool, shards: Optional[Shards] = None
) -> tuple:
    """One chunk whose rows fit whole (or a shard's whole slice of them): ``(loss [R], G [R, V]
    fp32 or None, the rows' Final statistics)``."""
    h, w, b = student
    z = _logits(h, w, b)
    vocab = z.shape[1]
    t = None if teacher is None else _logits(*teacher)
    if cfg.is_ce:
        # A shard owns only the labels in [0, V_local) of its column ids; the others add 0.
        owned = (y >= 0) & (y < vocab)
        x_y = jnp.where(owned, jnp.take_along_axis(z, jnp.clip(y, 0, vocab - 1)[:, None], axis=1)[:, 0], 0.0)
        st, e, et = block_stats(cfg, z, x_y=x_y)
    else:
        st, e, et = block_stats(cfg, z, t)
    fin = _whole_row(cfg, st, z, shards, vocab)
    if cfg.mixture_pass:  # its second pass (lossspec.stats), on the same logits
        fin = _with_mixture(cfg, fin, mixture_block(cfg, fin, z, t), z, shards)
    loss = jnp.where(coef != 0, fin.l, 0.0)
    if not with_grad:
        return loss, None, fin
    if shards is not None:  # the exponentials are relative to the shard's maxima, not the row's
        e = et = None
    hit = (lax.broadcasted_iota(jnp.int32, z.shape, 1) == y[:, None]) if cfg.is_ce else None
    return loss, grad_block(cfg, fin, coef, z, t, hit=hit, vocab=vocab if shards is None else shards.vocab, e=e, et=et), fin


def _g_in_bf16(tuning: spec_linear.HeadTuning, operand: Any) -> bool:
    """Whether every device's backward reads ``G`` as one bf16 term (the ``"tensor"`` contract:
    bf16 hidden states and weight, ``split_terms == 1`` on every platform of
    :data:`lossspec.linear.HEAD_TENSOR_DEVICES`): then ``G`` may be stored rounded (to nearest
    even, as the products would round it) and takes half the memory of fp32."""
    devices = set(tuning.bf16_matmul_devices or ())
    return operand == jnp.bfloat16 and tuning.split_terms == 1 and set(spec_linear.HEAD_TENSOR_DEVICES) <= devices


def _whole_parts(rows: int, n: int, live: int, g_bf16: bool) -> tuple[int, int]:
    """``(rows of a token chunk, parts)`` of the whole-row plan: with ``G`` stored in bf16 a
    chunk of the plan's ``rows`` is cut in half and ``parts`` such halves make one chunk. Each
    part's ``live`` fp32 blocks take half the budget, the chunk's bf16 ``G`` the other half, so
    the backward's two matmuls contract over up to ``live`` times the plan's rows.

    Why: on the CPU the weight gradient's ``dW += G^T h`` of a chunk reads and writes the whole
    fp32 ``[V, H]`` (XLA writes the product to a buffer, then adds); at 4096 x 1024 x 32768 bf16
    the plan's 128-row chunks made that traffic the head's largest cost (2.47 s against 1.99 s
    with 256 rows). Otherwise ``(rows, 1)``: one part, as planned."""
    if not g_bf16 or rows >= n or rows < 2:
        return rows, 1
    half = rows // 2
    parts = min(2 * live, n // half)
    return (parts * half, parts) if parts * half > rows else (rows, 1)


def _chunk_whole_parts(
    cfg: KernelConfig, parts: int, student: Head, teacher: Optional[Head], y: Optional[Array], coef: Array, shards: Optional[Shards],
    with_bias: bool,
) -> tuple:
    """:func:`_chunk_whole` over ``parts`` equal parts of the chunk's rows in turn, ``G`` kept in
    bf16 (rounded once, to nearest even: what the ``"tensor"`` products read): ``(loss [R],
    G [R, V] bf16, the rows' Final statistics, the column sums of the fp32 G [V] | None)``."""
    h, w, b = student
    rows = h.shape[0]
    part_rows = rows // parts
    cut = lambda a, at: None if a is None else lax.dynamic_slice_in_dim(a, at, part_rows, 0)  # noqa: E731
    put = lambda buf, new, at: lax.dynamic_update_slice_in_dim(buf, new, at, 0)  # noqa: E731

    def part(at: Any) -> tuple:
        tt = None if teacher is None else (cut(teacher[0], at),) + tuple(teacher[1:])
        loss, g, fin = _chunk_whole(cfg, (cut(h, at), w, b), tt, cut(y, at), cut(coef, at), True, shards)
        return loss, g.astype(jnp.bfloat16), fin, jnp.sum(g, axis=0) if with_bias else None

    def step(i: Array, carry: tuple) -> tuple:
        at = i * part_rows
        loss, g, fin, g_sum = part(at)
        loss_buf, g_buf, final, col_sum = carry
        final = Final(*(None if buf is None else put(buf, new, at) for buf, new in zip(final, fin)))
        return put(loss_buf, loss, at), put(g_buf, g, at), final, None if col_sum is None else col_sum + g_sum

    # The first part outside the loop: the buffers take its values' varying-axes types (inside
    # shard_map a shard's statistics vary over the vocabulary axes, the combined ones do not).
    loss, g, fin, g_sum = part(0)
    whole = lambda new: put(varying_like(jnp.zeros((rows,) + new.shape[1:], new.dtype), new), new, 0)  # noqa: E731
    start = (whole(loss), whole(g), Final(*(None if f is None else whole(f) for f in fin)), g_sum)
    return lax.fori_loop(1, parts, step, start)


def _chunk_blocked(
    cfg: KernelConfig,
    width: int,
    student: Head,
    teacher: Optional[Head],
    y: Optional[Array],
    coef: Array,
    with_grad: bool,
    dw: Any,
    db: Any,
    shards: Optional[Shards] = None,
    slice_rows: int = 1 << 30,
    tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING,
) -> tuple:
    """One chunk over vocabulary blocks of ``width`` columns: pass 1 folds the blocks'
    statistics (online softmax), pass 2 recomputes each block's logits for its gradient.
    Returns ``(loss [R], dh [R, H] fp32, dw, db, the rows' Final statistics)`` with the
    blocks' ``G^T h`` added to ``dw``, ``db``. The last block is moved back to end at ``V``; the columns it shares with the
    previous block are masked out (``col_ok``) in both passes, so nothing is counted twice.
    ``shards``: the weight is a vocabulary shard; its folded statistics are combined over the
    shards between the two passes."""
    h = student[0]
    vocab = student[1].shape[0]
    num_blocks = -(-vocab // width)

    def window(j: Array) -> tuple:
        start = jnp.minimum(j * width, vocab - width)
        cols = start + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        z = _logits(*_slice_head(student, start, width))
        t = None if teacher is None else _logits(*_slice_head(teacher, start, width))
        return start, cols, cols >= j * width, z, t

    def pass1(j: Array, acc: Any) -> Any:
        _, cols, col_ok, z, t = window(j)
        hit = (cols == y[:, None]) & col_ok if cfg.is_ce else None
        blk, _, _ = block_stats(cfg, z, t, hit=hit, col_ok=col_ok)
        return combine(cfg, acc, blk)

    # Inside shard_map (data, sequence or vocabulary axes) a carry has the varying-axes type of
    # everything the body reads; fresh zeros are invariant until cast (a no-op outside).
    refs = [a for a in (h, student[1], student[2], coef, y) + (teacher or ()) if a is not None]
    acc = varying_like(empty_stats(cfg, h.shape[0]), *refs)
    fin = _whole_row(cfg, lax.fori_loop(0, num_blocks, pass1, acc), h, shards, vocab)
    if cfg.mixture_pass:
        # The second pass (lossspec.stats): log M needs the rows' global lse's of pass 1.
        def pass_mix(j: Array, sums: tuple[Array, Array]) -> tuple[Array, Array]:
            _, _, col_ok, z, t = window(j)
            kl_qm, kl_pm = mixture_block(cfg, fin, z, t, col_ok=col_ok)
            return sums[0] + kl_qm, sums[1] + kl_pm

        zero = jnp.zeros((h.shape[0],), F32)
        fin = _with_mixture(cfg, fin, lax.fori_loop(0, num_blocks, pass_mix, varying_like((zero, zero), *refs)), h, shards)
    vocab_total = vocab if shards is None else shards.vocab
    loss = jnp.where(coef != 0, fin.l, 0.0)
    if not with_grad:
        return loss, None, dw, db, fin

    def pass2(j: Array, carry: tuple) -> tuple:
        dh, dw, db = carry
        start, cols, col_ok, z, t = window(j)
        hit = (cols == y[:, None]) if cfg.is_ce else None
        g = jnp.where(col_ok, grad_block(cfg, fin, coef, z, t, hit=hit, vocab=vocab_total), 0.0)
        dh, dw = _head_grads(dh, dw, start, g, h, student[1], slice_rows, tuning)
        if db is not None:
            db = lax.dynamic_update_slice_in_dim(db, lax.dynamic_slice_in_dim(db, start, width, 0) + jnp.sum(g, axis=0), start, 0)
        return dh, dw, db

    dh0 = varying_like(jnp.zeros(h.shape, F32), *refs)
    dh, dw, db = lax.fori_loop(0, num_blocks, pass2, (dh0, dw, db))
    return loss, dh, dw, db, fin


def _softcapped(cfg: KernelConfig) -> bool:
    """Whether a soft cap of the student or the teacher is set (more live blocks: ``_block.head_live_blocks``)."""
    return cfg.logit_softcap is not None or cfg.teacher_logit_softcap is not None


def _plan(cfg: KernelConfig, hidden: Array, weight: Array, tuning: spec_linear.HeadTuning, shards: Optional[Shards]) -> tuple[int, int]:
    """``(R, B)`` of :func:`lossspec.linear.head_plan` for these inputs (JAX's live blocks; the
    budget is in the inputs' dtype; ``tuning.block_elements`` / ``blocked_rows`` where given)."""
    live = head_live_blocks(cfg.kind, shards is not None, _softcapped(cfg))
    logits_itemsize = jnp.promote_types(hidden.dtype, weight.dtype).itemsize
    blocked_rows = spec_linear.head_blocked_rows(tuning)
    return spec_linear.head_plan(hidden.shape[0], weight.shape[0], tuning.block_elements, blocked_rows, live, logits_itemsize)


def _final_buffers(cfg: KernelConfig, n: int, refs: list) -> Final:
    """Zeros ``[N]`` for each field of the :class:`Final` statistics ``cfg`` has after every pass
    (:func:`lossspec.final_used`; ``None`` elsewhere), with the varying-axes type of ``refs``."""
    used = lossspec.final_used(cfg)
    return Final(**{name: varying_like(jnp.zeros((n,), F32), *refs) for name in used})


def head_forward(
    cfg: KernelConfig,
    hidden: Array,
    weight: Array,
    bias: Optional[Array],
    labels: Optional[Array],
    teacher: Optional[tuple],
    coef: Array,
    *,
    with_grad: bool,
    tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING,
    shards: Optional[Shards] = None,
    keep_final: bool = False,
) -> tuple:
    """Per-token loss and the fp32 gradients of the head.

    Args:
      cfg: the kernel configuration.
      hidden: ``[N, H]``; weight ``[V, H]``; bias ``[V]`` or ``None`` (any float dtype).
      labels: safe labels ``[N]`` int32 (cross-entropy) or ``None``.
      teacher: ``(teacher_hidden [N, Ht], teacher_weight [V, Ht], teacher_bias | None)`` or ``None``.
      coef: ``[N]`` fp32, the per-token coefficient.
      with_grad: also compute the gradients.
      tuning: the call's :class:`lossspec.HeadTuning`: the plan's budget ``block_elements``,
        ``blocked_rows`` (:func:`lossspec.linear.head_plan`) and the opt-in bf16 backward
        (``bf16_matmul_devices``, ``split_terms``).
      shards: ``vocab_parallel``: ``weight`` ``[V_local, H]`` (and bias, the teacher's weight and
        bias) is this replica's contiguous slice of the head along ``V`` (Megatron's
        column-parallel head), ``hidden`` is replicated and ``labels`` are global ids. Each chunk
        computes the shard's statistics from its local logits, combines them over
        ``shards.axes`` (one ``pmax`` / ``psum`` round per chunk: ``[R]`` vectors, never the
        logits), then the local gradient; ``dh`` is summed over the axes once at the end
        (``psum``); ``dW``, ``db`` stay local.
      keep_final: (without ``with_grad``) also return the rows' :class:`Final` statistics, what
        :func:`head_backward` needs (``recompute_logits``).

    Returns:
      ``(l [N], dh [N, H], dW [V, H], db [V] | None)``: the per-token loss (0 where
      ``coef == 0``; not multiplied by ``coef``) and, with ``with_grad``, the fp32 gradients of
      ``sum_i coef_i l_i`` (``G = coef * c * dl/dz``: ``dh = G W``, ``dW = G^T h``, ``db = sum G``;
      with ``shards``, ``dW`` and ``db`` of the local slice and ``dh`` the whole ``sum_k G_k W_k``).
      With ``keep_final``: ``(l [N], Final of [N] vectors)``.
    """
    n, width = hidden.shape
    vocab = weight.shape[0]
    # bf16 hidden and weight stay bf16 (exact products, fp32 accumulation: _dot); other 16-bit
    # inputs are upcast to fp32 (exact). The bias is added in fp32.
    operand = _operand_dtype(hidden, weight)
    t_operand = None if teacher is None else _operand_dtype(teacher[0], teacher[1])
    up = lambda a, dtype=F32: None if a is None else a.astype(dtype)  # noqa: E731
    student = (None, up(weight, operand), up(bias))
    teacher32 = None if teacher is None else (None, up(teacher[1], t_operand), up(teacher[2]))
    # (JAX's shards are even: every replica's plan is the same.)
    plan_rows, block = _plan(cfg, hidden, weight, tuning, shards)
    rows, parts = plan_rows, 1
    if block == vocab and with_grad:
        rows, parts = _whole_parts(plan_rows, n, head_live_blocks(cfg.kind, shards is not None, _softcapped(cfg)), _g_in_bf16(tuning, operand))
    # Inside shard_map (data, sequence or vocabulary axes) a loop carry has the varying-axes type
    # of what the body writes into it, i.e. of every input it reads; fresh zeros are invariant
    # until cast (varying_like is a no-op outside shard_map).
    refs = [a for a in (hidden, weight, bias, coef, labels) + tuple(teacher or ()) if a is not None]
    local = lambda a: varying_like(a, *refs)  # noqa: E731
    dw = local(jnp.zeros((vocab, width), F32)) if with_grad else None
    db = local(jnp.zeros((vocab,), F32)) if (with_grad and bias is not None) else None
    dh = local(jnp.zeros((n, width), F32)) if with_grad else None
    # The loss of a vocabulary-parallel head is combined over the shards: it does not vary with them.
    loss_refs = refs if shards is None else [a for a in (hidden, coef, labels) + tuple((teacher or (None,))[:1]) if a is not None]
    final = _final_buffers(cfg, n, loss_refs) if keep_final else None
    if n == 0:
        return (jnp.zeros((0,), F32), final) if keep_final else (jnp.zeros((0,), F32), dh, dw, db)
    if shards is not None and labels is not None:
        labels = _vocab_parallel.shift_labels(labels, vocab, shards.axes)  # global ids -> this shard's columns
    num_chunks = -(-n // rows)
    # The backward runs over vocabulary slices whose two [slice, H] fp32 temporaries (the weight's
    # rows, their G^T h) fit half a block together, beside the chunk's blocks (_head_grads).
    slice_rows = max(1, (plan_rows * block) // (4 * width)) if width else vocab

    def chunk(i: Array, carry: tuple) -> tuple:
        loss_buf, dh, dw, db, final = carry
        # The last chunk is moved back to end at row N; rows it shares with the previous
        # chunk get coefficient 0 (no second contribution to dW) and keep their values.
        start = jnp.minimum(i * rows, n - rows)
        fresh = start + jnp.arange(rows) >= i * rows
        cc = jnp.where(fresh, lax.dynamic_slice_in_dim(coef, start, rows, 0), 0.0)
        hc = _rows(hidden, start, rows).astype(operand)
        yc = None if labels is None else lax.dynamic_slice_in_dim(labels, start, rows, 0)
        st = (hc,) + student[1:]
        tt = None
        if teacher is not None:
            tt = (_rows(teacher[0], start, rows).astype(t_operand),) + teacher32[1:]
        if block == vocab:
            if parts > 1:
                loss, g, fin, g_sum = _chunk_whole_parts(cfg, parts, st, tt, yc, cc, shards, db is not None)
            else:
                loss, g, fin = _chunk_whole(cfg, st, tt, yc, cc, with_grad, shards)
                g_sum = None if db is None else jnp.sum(g, axis=0)
            if with_grad:
                dh_c, dw = _head_grads(local(jnp.zeros(hc.shape, F32)), dw, 0, g, hc, student[1], slice_rows, tuning)
                db = None if db is None else db + g_sum
        else:
            loss, dh_c, dw, db, fin = _chunk_blocked(cfg, block, st, tt, yc, cc, with_grad, dw, db, shards, slice_rows, tuning)
        keep = lambda buf, new: lax.dynamic_update_slice_in_dim(  # noqa: E731
            buf, jnp.where(fresh.reshape((rows,) + (1,) * (new.ndim - 1)), new, lax.dynamic_slice_in_dim(buf, start, rows, 0)), start, 0
        )
        loss_buf = keep(loss_buf, loss)
        if with_grad:
            dh = keep(dh, dh_c)
        if final is not None:
            final = Final(*(None if buf is None else keep(buf, new) for buf, new in zip(final, fin)))
        return loss_buf, dh, dw, db, final

    loss, dh, dw, db, final = lax.fori_loop(0, num_chunks, chunk, (varying_like(jnp.zeros((n,), F32), *loss_refs), dh, dw, db, final))
    if keep_final:
        return loss, final
    if shards is not None and with_grad:
        # hidden feeds every shard: its gradient is the sum of the shards' G_k W_k (one psum).
        dh = lax.psum(dh, _vocab_parallel.axis_arg(shards.axes))  # the stored gradient's
    return loss, dh, dw, db


def head_backward(
    cfg: KernelConfig,
    hidden: Array,
    weight: Array,
    bias: Optional[Array],
    labels: Optional[Array],
    teacher: Optional[tuple],
    coef: Array,
    final: Final,
    probes: tuple,
    *,
    tuning: spec_linear.HeadTuning = spec_linear.DEFAULT_HEAD_TUNING,
    shards: Optional[Shards] = None,
) -> tuple[Array, Array, Optional[Array]]:
    """The gradients of ``sum_i coef_i l_i`` from the rows' statistics (``recompute_logits``).

    The vocabulary is the outer loop: for each slice of ``B`` columns the logits of all tokens
    are recomputed chunk by chunk (``[R, B]`` blocks, :func:`lossspec.linear.head_plan_recompute`),
    ``G = coef * c * dl/dz`` follows from ``final`` (:func:`grad_block`), ``dh += G W_slice``
    and the slice's ``dW = G^T h`` is summed over all tokens in fp32 ``[B, H]``, then (summed
    over the data axes its weight is replicated on, ``probes``) rounded once to the weight's
    dtype and written. No fp32 ``[V, H]`` buffer exists; one more matmul than
    :func:`head_forward` with ``with_grad`` (two with a teacher).

    Args:
      cfg, hidden, weight, bias, labels, teacher, tuning, shards: as for :func:`head_forward`
        (the same plan's budget; ``tuning.recompute_plan``: this pass's ``(R, B)`` instead of the
        planned ones).
      coef: ``[N]`` fp32, the per-token coefficient times the upstream gradient.
      final: the rows' :class:`Final` statistics (``head_forward(..., keep_final=True)``).
      probes: empty slices of ``(hidden, weight, bias)`` (:func:`_type_probes`).

    Returns:
      ``(dh [N, H] fp32, dW [V, H] in weight.dtype, db [V] in bias.dtype | None)``; with
      ``shards``, ``dh`` summed over the shards, ``dW`` and ``db`` of the local slice.
    """
    n, width = hidden.shape
    vocab = weight.shape[0]
    operand = _operand_dtype(hidden, weight)
    t_operand = None if teacher is None else _operand_dtype(teacher[0], teacher[1])
    plan_rows, plan_block = _plan(cfg, hidden, weight, tuning, shards)
    # The forward's live blocks (XLA's temporaries per [R, B] block, as counted there) and the
    # [B, H] slices: the widened weight rows, the gradient, its product before the addition, the teacher's rows.
    live = head_live_blocks(cfg.kind, shards is not None, _softcapped(cfg))
    # 16-bit hidden states: the fp32 dh [N, H] and each chunk's rows widened to fp32 for G^T h
    # share the budget too, as in torch.
    budget = spec_linear.head_recompute_budget(plan_rows * plan_block * live, n, width, hidden.dtype != F32)
    row_elements = width if hidden.dtype != F32 else 0  # the backward's h32
    if teacher is not None and teacher[0].dtype != F32 and t_operand == F32:
        row_elements += teacher[0].shape[1]  # the teacher's rows, upcast for its logits
    rows, cols = tuning.recompute_plan or spec_linear.head_plan_recompute(n, vocab, width, budget, live, 3 + (teacher is not None), row_elements)
    rows, cols = min(rows, max(1, n)), min(cols, vocab)
    refs = [a for a in (hidden, weight, bias, coef, labels) + tuple(teacher or ()) if a is not None]
    dh = varying_like(jnp.zeros((n, width), F32), *refs)
    if n == 0:
        dw = varying_like(jnp.zeros((vocab, width), weight.dtype), weight)
        return dh, dw, None if bias is None else varying_like(jnp.zeros((vocab,), bias.dtype), bias)
    if shards is not None and labels is not None:
        labels = _vocab_parallel.shift_labels(labels, vocab, shards.axes)
    vocab_total = vocab if shards is None else shards.vocab
    num_chunks = -(-n // rows)
    cut = lambda a, start, size: None if a is None else lax.dynamic_slice_in_dim(a, start, size, 0)  # noqa: E731

    def vocab_slice(dh: Array, j: Array) -> tuple:
        # The last slice is moved back to end at V; the columns it shares with the previous one
        # get G = 0 (nothing added to dh twice) and their rows of its dW are dropped (_stack).
        v0 = jnp.minimum(j * cols, vocab - cols)
        col_ids = v0 + lax.broadcasted_iota(jnp.int32, (1, cols), 1)
        col_ok = col_ids >= j * cols
        w_j = _rows(weight, v0, cols).astype(operand)
        b_j = None if bias is None else cut(bias, v0, cols).astype(F32)
        tw_j = None if teacher is None else _rows(teacher[1], v0, cols).astype(t_operand)
        tb_j = None if teacher is None or teacher[2] is None else cut(teacher[2], v0, cols).astype(F32)

        def token_chunk(i: Any, carry: tuple) -> tuple:
            dh, dw_j, db_j = carry
            # The last chunk is moved back to end at row N; rows it shares with the previous
            # chunk get coefficient 0 (G = 0: nothing added twice).
            r0 = jnp.minimum(i * rows, n - rows)
            cc = jnp.where(r0 + jnp.arange(rows) >= i * rows, cut(coef, r0, rows), 0.0)
            hc = _rows(hidden, r0, rows).astype(operand)
            z = _logits(hc, w_j, b_j)
            t = None if teacher is None else _logits(_rows(teacher[0], r0, rows).astype(t_operand), tw_j, tb_j)
            fin = Final(*(cut(f, r0, rows) for f in final))
            hit = (col_ids == cut(labels, r0, rows)[:, None]) if cfg.is_ce else None
            g = jnp.where(col_ok, grad_block(cfg, fin, cc, z, t, hit=hit, vocab=vocab_total), 0.0)
            dh_c, dw_j = _head_grads(cut(dh, r0, rows), dw_j, 0, g, hc, w_j, cols, tuning)
            dh = lax.dynamic_update_slice_in_dim(dh, dh_c, r0, 0)
            return dh, dw_j, None if db_j is None else db_j + jnp.sum(g, axis=0)

        dw_j = varying_like(jnp.zeros((cols, width), F32), *refs)
        db_j = None if bias is None else varying_like(jnp.zeros((cols,), F32), *refs)
        dh, dw_j, db_j = lax.fori_loop(0, num_chunks, token_chunk, (dh, dw_j, db_j))
        # The one rounding of the slice's gradients, after their sums over the data replicas.
        dw_j = _as_primal_type(dw_j, probes[1]).astype(weight.dtype)
        db_j = None if db_j is None else _as_primal_type(db_j, probes[2]).astype(bias.dtype)
        return dh, (dw_j, db_j)

    # The slices' gradients are the scan's stacked outputs, not a [V, H] carry updated in place:
    # XLA's CPU compiler runs a 16-bit dynamic_update_slice through fp32 (a copy of the carry).
    dh, (dw, db) = lax.scan(vocab_slice, dh, jnp.arange(-(-vocab // cols)))
    dw, db = _stack(dw, vocab), None if db is None else _stack(db, vocab)
    if shards is not None:
        dh = lax.psum(dh, _vocab_parallel.axis_arg(shards.axes))  # the recompute backward's
    return dh, dw, db


# --------------------------------------------------------------------------------------------
# custom_vjp
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    """What the head's ``custom_vjp`` takes as static (hashable): the kernel's config, whether
    the loss is reduced (not ``"none"``), the plan (:class:`lossspec.linear.HeadPlan`, its impl
    resolved, the call's :class:`lossspec.HeadTuning` inside), the inputs' dtypes and the
    vocabulary shards."""

    config: KernelConfig
    reduced: bool
    plan: spec_linear.HeadPlan
    dtypes: tuple  # (hidden, weight, bias)
    shards: Optional[Shards]


def _weighted(coef: Array, loss: Array, reduced: bool) -> Array:
    tokens = jnp.where(coef != 0, coef * loss, 0.0)
    return jnp.sum(tokens) if reduced else tokens


def _run(spec: Spec, args: tuple, coef: Array, with_grad: bool) -> tuple:
    cfg, plan, shards = spec.config, spec.plan, spec.shards
    hidden, weight, bias, labels, teacher = args
    return head_forward(
        cfg,
        hidden,
        weight,
        bias,
        labels,
        teacher,
        coef,
        with_grad=with_grad,
        tuning=plan.tuning,
        shards=shards,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head(spec: Spec, hidden: Array, weight: Array, bias: Any, labels: Any, teacher: Any, coef: Array) -> Array:
    """``sum_i coef_i l_i`` (reduced) or the per-token ``coef_i l_i`` ``[N]`` (``"none"``)."""
    loss = _run(spec, (hidden, weight, bias, labels, teacher), coef, with_grad=False)[0]
    return _weighted(coef, loss, spec.reduced)


HEAD_HIGHER_ORDER_16BIT_MESSAGE = (
    "jaxloss: higher-order derivatives (grad of grad, jax.hessian, jax.jvp of a gradient) of the fused head need "
    "float32 or float64 hidden states, weight and bias: 16-bit ones travel through impl='xla' as raw bits, which "
    "carry no derivative (the result would be silently wrong or 0). Cast them to float32 before the call, e.g. "
    "linear_cross_entropy(hidden.astype(jnp.float32), weight.astype(jnp.float32), ...), and use impl='xla'."
)


def _first_order_inputs(spec: Spec, hidden: Array, weight: Array, bias: Any) -> tuple[Array, Array, Any]:
    """``(hidden, weight, bias)`` unchanged, except that where the head's second derivatives
    would be wrong or fail obscurely (16-bit inputs, read as raw bits; ``vocab_parallel``'s
    collectives), differentiating through them raises a
    ``NotImplementedError`` that says so. Only a higher-order derivative differentiates the
    custom_vjp's forward (and so these inputs); first order never does. ``impl="xla"`` with
    float32 / float64 inputs keeps its (correct) second derivatives, as the unfused losses."""
    dtypes, shards = spec.dtypes, spec.shards
    if shards is not None:
        message = _autodiff.VOCAB_PARALLEL_HIGHER_ORDER_MESSAGE
    elif any(dtype is not None and jnp.dtype(dtype).itemsize == 2 for dtype in dtypes):
        message = HEAD_HIGHER_ORDER_16BIT_MESSAGE
    else:
        return hidden, weight, bias
    return _xla.no_derivatives(lambda *arrays: arrays, message)(hidden, weight, bias)


def _head_fwd(spec: Spec, hidden: Array, weight: Array, bias: Any, labels: Any, teacher: Any, coef: Array) -> tuple:
    hidden, weight, bias = _first_order_inputs(spec, hidden, weight, bias)
    args = (hidden, weight, bias, labels, teacher)
    # The residuals hold the inputs themselves: JAX arrays are immutable, so the backward that
    # recomputes the head (recompute_logits, "none") reads exactly what the forward read (torch
    # needs autograd's saved tensors and their version check for that: torchloss.head).
    if spec.plan.recompute_logits:  # the rows' statistics only; the backward computes the gradients
        loss, final = head_forward(
            spec.config, *args, coef, with_grad=False, tuning=spec.plan.tuning, shards=spec.shards, keep_final=True
        )
        return _weighted(coef, loss, spec.reduced), (args, coef, final)
    if not spec.reduced:  # "none": the backward recomputes with coef * upstream
        loss = _run(spec, args, coef, with_grad=False)[0]
        return _weighted(coef, loss, False), (args, coef)
    loss, dh, dw, db = _run(spec, args, coef, with_grad=True)
    return _weighted(coef, loss, True), (dh, dw, db, _type_probes(args))


def _type_probes(args: tuple) -> tuple:
    """Empty slices of hidden, weight and bias: they carry the inputs' varying-axes types
    (``shard_map``) into the backward pass at no cost."""
    hidden, weight, bias = args[:3]
    return tuple(None if a is None else a[:0] for a in (hidden, weight, bias))


def _as_primal_type(grad: Any, probe: Any) -> Any:
    """Sum ``grad`` over the mesh axes it varies over but its input does not: the gradient of
    an input replicated over a ``shard_map`` axis (a weight under data parallelism) is the sum
    of the replicas' contributions, as JAX's own transpose of the implicit broadcast gives."""
    if grad is None:
        return None
    missing = varying_axes(grad) - varying_axes(probe)
    return lax.psum(grad, tuple(sorted(missing))) if missing else grad


def _head_bwd(spec: Spec, res: tuple, g: Array) -> tuple:
    cfg, reduced, plan, shards = spec.config, spec.reduced, spec.plan, spec.shards
    h_dtype, w_dtype, b_dtype = spec.dtypes
    if plan.recompute_logits:  # the gradients of sum_i coef_i g_i l_i, dW and db already rounded
        args, coef, final = res
        probes = _type_probes(args)
        dh, dw, db = head_backward(
            cfg, *args, jnp.where(coef != 0, coef * g.astype(F32), 0.0), final, probes,
            tuning=plan.tuning, shards=shards,
        )
        return _as_primal_type(dh, probes[0]).astype(h_dtype), dw, db, None, None, None
    if reduced:
        dh, dw, db, probes = res
        scale = g.astype(F32)
    else:
        args, coef = res
        _, dh, dw, db = _run(spec, args, jnp.where(coef != 0, coef * g.astype(F32), 0.0), with_grad=True)
        scale, probes = jnp.ones((), F32), _type_probes(args)
    # The one rounding of each gradient to its parameter's dtype.
    cast = lambda a, probe, dtype: None if a is None else _as_primal_type(a * scale, probe).astype(dtype)  # noqa: E731
    return cast(dh, probes[0], h_dtype), cast(dw, probes[1], w_dtype), cast(db, probes[2], b_dtype), None, None, None


_head.defvjp(_head_fwd, _head_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _head_tokens(spec: Spec, hidden: Array, weight: Array, bias: Any, labels: Any, teacher: Any, coef: Array) -> Array:
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if teacher is not None:
        t_hidden, t_weight, t_bias = teacher
        teacher = (jax.lax.stop_gradient(t_hidden.reshape(-1, t_hidden.shape[-1])), jax.lax.stop_gradient(t_weight), None if t_bias is None else jax.lax.stop_gradient(t_bias))
    return _head(spec, hidden, weight, bias, labels, teacher, coef)


# --------------------------------------------------------------------------------------------
# Public functions: argument handling as in jaxloss.api (jaxloss._prepare; checks from lossspec)
# --------------------------------------------------------------------------------------------


def _optional(value: Any) -> Any:
    return None if value is None else _prepare.as_array(value)


def _check_same_device(name: str, value: Any, ref: Any) -> None:
    """Concrete arrays committed to different devices than ``hidden`` are refused clearly."""
    if value is None or not isinstance(value, jax.Array) or not isinstance(ref, jax.Array) or isinstance(value, jax.core.Tracer):
        return
    if isinstance(ref, jax.core.Tracer) or not (value.committed and ref.committed):
        return
    if value.devices() != ref.devices():
        raise ValueError(spec_linear.device_message(name, value.devices(), ref.devices()))


def _denominator(config: LossConfig, denominator: Any) -> Any:
    """The checked denominator as a 0-d fp32 array (as in the losses: :func:`jaxloss._prepare.checked_denominator`)."""
    lossspec.check_denominator_allowed(config, denominator)
    return _prepare.checked_denominator(denominator)


def _linear_loss(kind: str, **args: Any) -> Array:
    """Body of the ``linear_*`` functions (signatures: :mod:`lossspec.linear`)."""
    spec = lossspec.KIND_SPECS[kind]
    options = {name: args[name] for name in spec.option_names}
    config = lossspec.make_config(kind, normalization=args["normalization"], **options)
    args["tuning"] = lossspec.check_head_tuning(args["tuning"])
    ce = config.has_labels
    hidden, weight, bias = _prepare.as_array(args["hidden"]), _prepare.as_array(args["weight"]), _optional(args["bias"])
    teacher = None
    if spec.has_teacher:
        teacher = (_prepare.as_array(args["teacher_hidden"]), _prepare.as_array(args["teacher_weight"]), _optional(args["teacher_bias"]))
    meta = lambda a: None if a is None else _prepare.array_meta(a)  # noqa: E731
    logits_meta, teacher_meta = spec_linear.check_head(
        kind, meta(hidden), meta(weight), meta(bias), None if teacher is None else tuple(meta(a) for a in teacher), args["precision"]
    )
    labels = _prepare.as_array(args["labels"]) if ce else None
    loss_mask = _optional(args["loss_mask"])
    segment_ids = _optional(args["segment_ids"])
    lossspec.check_inputs(config, logits_meta, meta(labels) if ce else teacher_meta, meta(loss_mask), meta(segment_ids))
    loss_mask = _prepare.broadcast_mask(loss_mask, tuple(logits_meta.shape[:-1]))
    named = [("weight", weight), ("bias", bias), ("labels", labels), ("loss_mask", loss_mask), ("segment_ids", segment_ids)]
    if teacher is not None:
        named += list(zip(("teacher_hidden", "teacher_weight", "teacher_bias"), teacher))
    for name, value in named:
        _check_same_device(name, value, hidden)
    denominator = _denominator(config, args["denominator"])
    if loss_mask is not None and _prepare.is_concrete(loss_mask):
        lossspec.check_weights(np.asarray(loss_mask)[..., 1:] if config.causal_shift else np.asarray(loss_mask))
    lead, vocab = tuple(hidden.shape[:-1]), int(weight.shape[0])
    shards = None
    if args["vocab_parallel"] is not None:
        # weight is this replica's [V_local, H] slice: the labels are global ids of V_local * P.
        axes = _vocab_parallel.axis_names(args["vocab_parallel"])
        vocab = vocab * _vocab_parallel.axis_size(axes)
        shards = Shards(axes, vocab)
    host_flags = None
    concrete_ids = segment_ids is None or _prepare.is_concrete(segment_ids)
    if ce and _prepare.is_concrete(labels) and (loss_mask is None or _prepare.is_concrete(loss_mask)) and concrete_ids:
        labels_host = np.asarray(labels)
        mask_host = None if loss_mask is None else np.asarray(loss_mask)
        ids_host = None if segment_ids is None else lossspec.scored_segment_ids(np.asarray(segment_ids), lead, config.causal_shift)
        if config.causal_shift:
            labels_host, mask_host = lossspec.shift_targets(labels_host, mask_host, lead)
        valid, _ = lossspec.token_weights(config, labels_host, mask_host, lead, ids_host)
        lossspec.check_labels(labels_host, valid, vocab, config.causal_shift)
    if ce and isinstance(labels, np.ndarray):
        labels, host_flags = _prepare.host_labels(labels, config.ignore_index, vocab)
    # The teacher's logits are never formed: _prepare gets a [..., 1] stand-in (it only reads
    # the leading shape of a target that is not labels; a kind without a target has none).
    target = _prepare.to_device(labels) if ce else jnp.zeros(lead + (1,), F32)
    coef, safe_labels, bad = _prepare.prepare(
        config.counting_config(),
        vocab,
        None,  # no sequence_parallel axes for the head (yet)
        target,
        None if loss_mask is None else _prepare.to_device(loss_mask),
        _prepare.device_ids(segment_ids, None),
        None if denominator is None else _prepare.to_device(denominator),
        host_flags,
    )
    kcfg = KernelConfig.of(config.kernel_config())  # jensen_shannon at beta = 0 / 1: the KL kinds, exactly
    dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    backend = backends.resolve(args["impl"], head=True)  # the one resolution of this call's impl
    recompute = spec_linear.check_recompute_logits(args["recompute_logits"])
    plan = spec_linear.HeadPlan(backend.name, recompute, spec_linear.head_matmul_tuning(args["tuning"], args["precision"]), args["precision"])
    head_spec = Spec(kcfg, config.normalization != "none", plan, dtypes, shards)
    device = lambda a: None if a is None else _prepare.to_device(a)  # noqa: E731
    teacher_arrays = None if teacher is None else tuple(device(a) for a in teacher)
    try:
        tokens = _head_tokens(head_spec, device(hidden), device(weight), device(bias), safe_labels if ce else None, teacher_arrays, coef)
    except TypeError as err:
        if "forward-mode" not in str(err):
            raise
        raise NotImplementedError(api.FORWARD_MODE_MESSAGE) from err
    return _prepare.finish(lead if config.normalization == "none" else None, tokens, bad)


def linear_cross_entropy(
    hidden: api.ArrayLike,
    weight: api.ArrayLike,
    labels: api.ArrayLike,
    loss_mask: Optional[api.ArrayLike] = None,
    *,
    bias: Optional[api.ArrayLike] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[api.ArrayLike] = None,
    segment_ids: Optional[api.ArrayLike] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[api.AxisNames] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Array:
    """Fused LM head + cross_entropy: ``cross_entropy(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked cross-entropy with integer labels, label smoothing and z-loss.

        l = lse - (1 - eps) z_y - (eps / V) sum_v z_v + lam lse^2
        dl/dz = (1 + 2 lam lse) q - (1 - eps) onehot(y) - eps / V

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      labels: ``[...]`` integers, the leading shape of ``hidden``; masked tokens' labels are never read as indices.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      ignore_index: label value of ignored tokens: an ``int`` in the int64 range, compared exactly (a label equals it
        only if the labels' dtype can hold it).
      label_smoothing: ``eps`` in ``[0, 1]``.
      z_loss: ``lam >= 0``.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the head is split along ``V``,
        inside ``shard_map`` / ``pmap`` (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``,
        ``teacher_bias``) is this replica's contiguous slice ``[V_local, H]`` (shards in axis-index order,
        ``V = V_local * P``), ``hidden`` (and ``teacher_hidden``) the same on every replica, labels global ids. The loss
        is the same on every replica; the gradient of ``hidden`` is the whole one (summed over the axis inside the
        call), those of ``weight`` and ``bias`` the replica's slices. Only ``[N]`` row statistics cross the axis, never
        logits.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_cross_entropy", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "cross_entropy",
        hidden=hidden, weight=weight, labels=labels, loss_mask=loss_mask, bias=bias, ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, logit_scale=logit_scale, logit_softcap=logit_softcap,
        causal_shift=causal_shift, normalization=normalization, denominator=denominator, segment_ids=segment_ids,
        impl=impl, recompute_logits=recompute_logits, precision=precision, vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_soft_cross_entropy(
    hidden: api.ArrayLike,
    weight: api.ArrayLike,
    teacher_hidden: api.ArrayLike,
    teacher_weight: api.ArrayLike,
    loss_mask: Optional[api.ArrayLike] = None,
    *,
    bias: Optional[api.ArrayLike] = None,
    teacher_bias: Optional[api.ArrayLike] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[api.ArrayLike] = None,
    segment_ids: Optional[api.ArrayLike] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[api.AxisNames] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Array:
    """Fused LM head + soft_cross_entropy: ``soft_cross_entropy(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked cross-entropy against the teacher's distribution p.

        l = lse - sum_v p_v z_v
        dl/dz = q - p

    The teacher logits are ``teacher_hidden @ teacher_weight.T + teacher_bias``.

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      teacher_hidden: ``[..., Ht]`` floating point, the leading shape of ``hidden``; gets no gradient.
      teacher_weight: ``[V, Ht]``, the dtype of ``teacher_hidden``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      teacher_bias: ``None`` or ``[V]``, the dtype of ``teacher_weight``; gets no gradient.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the head is split along ``V``,
        inside ``shard_map`` / ``pmap`` (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``,
        ``teacher_bias``) is this replica's contiguous slice ``[V_local, H]`` (shards in axis-index order,
        ``V = V_local * P``), ``hidden`` (and ``teacher_hidden``) the same on every replica, labels global ids. The loss
        is the same on every replica; the gradient of ``hidden`` is the whole one (summed over the axis inside the
        call), those of ``weight`` and ``bias`` the replica's slices. Only ``[N]`` row statistics cross the axis, never
        logits.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_soft_cross_entropy", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "soft_cross_entropy",
        hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, loss_mask=loss_mask,
        bias=bias, teacher_bias=teacher_bias, temperature=temperature, logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale, logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap, causal_shift=causal_shift, normalization=normalization,
        denominator=denominator, segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision,
        vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_forward_kl(
    hidden: api.ArrayLike,
    weight: api.ArrayLike,
    teacher_hidden: api.ArrayLike,
    teacher_weight: api.ArrayLike,
    loss_mask: Optional[api.ArrayLike] = None,
    *,
    bias: Optional[api.ArrayLike] = None,
    teacher_bias: Optional[api.ArrayLike] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[api.ArrayLike] = None,
    segment_ids: Optional[api.ArrayLike] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[api.AxisNames] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Array:
    """Fused LM head + forward_kl: ``forward_kl(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked forward KL, KL(p || q), of the student q from the teacher p (mean seeking).

        l = sum_v p_v (log p_v - log q_v)
        dl/dz = q - p

    The teacher logits are ``teacher_hidden @ teacher_weight.T + teacher_bias``.

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      teacher_hidden: ``[..., Ht]`` floating point, the leading shape of ``hidden``; gets no gradient.
      teacher_weight: ``[V, Ht]``, the dtype of ``teacher_hidden``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      teacher_bias: ``None`` or ``[V]``, the dtype of ``teacher_weight``; gets no gradient.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the head is split along ``V``,
        inside ``shard_map`` / ``pmap`` (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``,
        ``teacher_bias``) is this replica's contiguous slice ``[V_local, H]`` (shards in axis-index order,
        ``V = V_local * P``), ``hidden`` (and ``teacher_hidden``) the same on every replica, labels global ids. The loss
        is the same on every replica; the gradient of ``hidden`` is the whole one (summed over the axis inside the
        call), those of ``weight`` and ``bias`` the replica's slices. Only ``[N]`` row statistics cross the axis, never
        logits.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_forward_kl", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "forward_kl",
        hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, loss_mask=loss_mask,
        bias=bias, teacher_bias=teacher_bias, temperature=temperature, logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale, logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap, causal_shift=causal_shift, normalization=normalization,
        denominator=denominator, segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision,
        vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_reverse_kl(
    hidden: api.ArrayLike,
    weight: api.ArrayLike,
    teacher_hidden: api.ArrayLike,
    teacher_weight: api.ArrayLike,
    loss_mask: Optional[api.ArrayLike] = None,
    *,
    bias: Optional[api.ArrayLike] = None,
    teacher_bias: Optional[api.ArrayLike] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[api.ArrayLike] = None,
    segment_ids: Optional[api.ArrayLike] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[api.AxisNames] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Array:
    """Fused LM head + reverse_kl: ``reverse_kl(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked reverse KL, KL(q || p), of the student q from the teacher p (mode seeking).

        l = sum_v q_v (log q_v - log p_v)
        dl/dz = q (log q - log p - l)   (0 where q == 0)

    The teacher logits are ``teacher_hidden @ teacher_weight.T + teacher_bias``.

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      teacher_hidden: ``[..., Ht]`` floating point, the leading shape of ``hidden``; gets no gradient.
      teacher_weight: ``[V, Ht]``, the dtype of ``teacher_hidden``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      teacher_bias: ``None`` or ``[V]``, the dtype of ``teacher_weight``; gets no gradient.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the head is split along ``V``,
        inside ``shard_map`` / ``pmap`` (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``,
        ``teacher_bias``) is this replica's contiguous slice ``[V_local, H]`` (shards in axis-index order,
        ``V = V_local * P``), ``hidden`` (and ``teacher_hidden``) the same on every replica, labels global ids. The loss
        is the same on every replica; the gradient of ``hidden`` is the whole one (summed over the axis inside the
        call), those of ``weight`` and ``bias`` the replica's slices. Only ``[N]`` row statistics cross the axis, never
        logits.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_reverse_kl", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "reverse_kl",
        hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, loss_mask=loss_mask,
        bias=bias, teacher_bias=teacher_bias, temperature=temperature, logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale, logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap, causal_shift=causal_shift, normalization=normalization,
        denominator=denominator, segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision,
        vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_entropy(
    hidden: api.ArrayLike,
    weight: api.ArrayLike,
    loss_mask: Optional[api.ArrayLike] = None,
    *,
    bias: Optional[api.ArrayLike] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[api.ArrayLike] = None,
    segment_ids: Optional[api.ArrayLike] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[api.AxisNames] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Array:
    """Fused LM head + entropy: ``entropy(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked entropy of the student's distribution q (the entropy regulariser of policy-gradient trainers).

        l = -sum_v q_v log q_v
        dl/dz = -q (log q + l)   (0 where q == 0)

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      temperature: ``T > 0``, divides the student's logits.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the head is split along ``V``,
        inside ``shard_map`` / ``pmap`` (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``,
        ``teacher_bias``) is this replica's contiguous slice ``[V_local, H]`` (shards in axis-index order,
        ``V = V_local * P``), ``hidden`` (and ``teacher_hidden``) the same on every replica, labels global ids. The loss
        is the same on every replica; the gradient of ``hidden`` is the whole one (summed over the axis inside the
        call), those of ``weight`` and ``bias`` the replica's slices. Only ``[N]`` row statistics cross the axis, never
        logits.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_entropy", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "entropy",
        hidden=hidden, weight=weight, loss_mask=loss_mask, bias=bias, temperature=temperature, logit_scale=logit_scale,
        logit_softcap=logit_softcap, causal_shift=causal_shift, normalization=normalization, denominator=denominator,
        segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision, vocab_parallel=vocab_parallel,
        tuning=tuning,
    )


def linear_jensen_shannon(
    hidden: api.ArrayLike,
    weight: api.ArrayLike,
    teacher_hidden: api.ArrayLike,
    teacher_weight: api.ArrayLike,
    loss_mask: Optional[api.ArrayLike] = None,
    *,
    bias: Optional[api.ArrayLike] = None,
    teacher_bias: Optional[api.ArrayLike] = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    teacher_logit_softcap: Optional[float] = None,
    causal_shift: bool = False,
    normalization: str = "valid_tokens",
    denominator: Optional[api.ArrayLike] = None,
    segment_ids: Optional[api.ArrayLike] = None,
    impl: str = "auto",
    recompute_logits: bool = False,
    precision: str = "exact",
    vocab_parallel: Optional[api.AxisNames] = None,
    tuning: Optional[lossspec.HeadTuning] = None,
    **unexpected: Never,
) -> Array:
    """Fused LM head + jensen_shannon: ``jensen_shannon(hidden @ weight.T + bias, ...)`` without the ``[N, V]`` logits.

    Masked generalised Jensen-Shannon divergence of the student q and the teacher p (on-policy distillation).

        l = beta KL(p || M) + (1 - beta) KL(q || M),  M = beta p + (1 - beta) q;
        beta = 0: KL(p || q) (forward KL), beta = 1: KL(q || p) (reverse KL), computed as those kinds
        dl/dz = (1 - beta) q (log q - log M - KL(q || M))   (0 where q == 0; the KL kinds' at beta = 0, 1)

    The teacher logits are ``teacher_hidden @ teacher_weight.T + teacher_bias``.

    Args:
      hidden: ``[..., H]`` floating point (float32, bfloat16, float16; float64 in torch): the hidden states. The logits
        ``hidden @ weight.T + bias`` are computed in fp32 (16-bit inputs: products exact, fp32 accumulation) chunk by
        chunk, never as one ``[N, V]`` buffer.
      weight: ``[V, H]``, the dtype of ``hidden`` (the layout of ``nn.Linear.weight`` and of a tied embedding).
      teacher_hidden: ``[..., Ht]`` floating point, the leading shape of ``hidden``; gets no gradient.
      teacher_weight: ``[V, Ht]``, the dtype of ``teacher_hidden``; gets no gradient.
      loss_mask: ``[...]`` boolean, or float weights ``>= 0``, or ``None``. Float weights must be 0 or normal float32
        numbers with a finite float32 sum (``lossspec.check_weights``). The mask is data, like the labels: no gradient
        flows to it.
      bias: ``None`` or ``[V]``, the dtype of ``weight``.
      teacher_bias: ``None`` or ``[V]``, the dtype of ``teacher_weight``; gets no gradient.
      beta: ``beta`` in ``[0, 1]``, the teacher's share of the mixture ``M = beta p + (1 - beta) q`` (TRL's GKD and
        Liger-Kernel's JSD): 0.5 the symmetric JSD, 0 forward KL ``KL(p || q)``, 1 reverse KL ``KL(q || p)``.
      temperature: ``T > 0``, divides student and teacher alike.
      logit_scale: ``> 0``, multiplies the student's logits (before the temperature).
      teacher_logit_scale: ``> 0``, multiplies the teacher's logits.
      logit_softcap: ``None`` (default: off) or a cap ``> 0``: the student's raw logits become ``cap * tanh(x / cap)``
        before ``logit_scale`` and the temperature (Gemma 2's final-logit soft-capping); the gradient is taken through
        the cap. Infinite logits are left as they are (``-inf`` keeps probability 0, ``+inf`` a NaN loss).
      teacher_logit_softcap: ``None`` (default: off) or a cap ``> 0``: the same soft cap on the teacher's raw logits,
        before ``teacher_logit_scale`` and the temperature.
      causal_shift: ``False`` (default) or ``True``: causal-LM shift. ``labels`` and ``loss_mask`` are given per input
        token (e.g. ``labels=input_ids``; the last leading axis is time ``T``): the logits at position ``t`` are scored
        against ``labels[..., t + 1]`` with weight ``loss_mask[..., t + 1]``, and the last position of each row is
        ignored (loss 0, gradient 0). Teacher logits are not shifted (both models' position ``t`` predicts token
        ``t + 1``). ``"tokens"`` counts ``prod(lead[:-1]) * (T - 1)`` positions. No copy of the logits is made. Needs
        ``logits [..., T, V]``.
      normalization: ``"valid_tokens"`` (default), ``"tokens"``, ``"sum"`` or ``"none"``: the denominator ``D`` of
        ``sum_i w_i l_i / D`` (docs/spec.md), or per-token losses; or per sequence, ``"sequence_mean"``
        ``(1/S) sum_s (1/n_s) sum_{i in s} w_i l_i`` and ``"sequence_sum"`` ``(1/S) sum_s sum_{i in s} w_i l_i``, with
        ``n_s`` the sequence's weight sum and ``S`` the number of sequences with ``n_s > 0`` (each row of the leading
        shape, or ``segment_ids``; lossspec.sequences).
      denominator: the global ``D`` (number or 0-d array/tensor, ``>= 0``) overriding ``D`` of the reduced modes (``S``
        of the sequence modes); ``None`` counts this call's own tokens (``D = 1`` for ``"sum"``). Pass the sum of
        ``count_denominator`` over every micro-batch and replica. Not accepted with ``"none"``. 0 or a normal float32
        number; data (no gradient flows to it).
      segment_ids: ``[...]`` integers (the labels' shape) or ``None``: the tokens of one row with the same id ``>= 0``
        form one sequence (packed documents); an id ``< 0`` is padding (weight 0, in every normalisation). Given per
        input token like the labels: with ``causal_shift`` position ``t`` is scored only if
        ``segment_ids[..., t] == segment_ids[..., t + 1]`` (never across a document boundary) and belongs to that
        sequence. Data: no gradient.
      impl: ``"auto"`` or ``"xla"`` (jaxloss) / ``"torch"`` (torchloss): the framework's matmuls, on every device.
        ``"pallas"`` / ``"triton"`` raise a ``ValueError``: the head kernels were retired (their exact fp32 tiles ran
        about 300x slower than the three bf16 matmuls on an H200; docs/linear_head.md).
      recompute_logits: ``False``: the forward computes the loss and the fp32 gradients of ``hidden``, ``weight`` and
        ``bias`` (three matmuls; the gradients are summed over token chunks in fp32 and rounded once). ``True``: the
        forward keeps only ``[N]`` statistics per token; the backward recomputes the logits a vocabulary slice at a time
        over all tokens and writes each slice of the weight gradient in the weight's dtype, so no fp32 ``[V, H]``
        accumulator exists (for 16-bit weights, 4 V H bytes less at the peak) for one more matmul (two with a teacher).
        Same bounds either way; the XLA / torch path only.
      precision: ``"exact"`` (default): every product exact, accumulated in fp32 (a bf16 head's backward multiplies
        the fp32 logits gradient ``G`` exactly, in fp32). ``"tensor"`` (bfloat16 ``hidden`` and ``weight`` only; a
        ``ValueError`` otherwise): ``G`` is rounded once to bf16, to nearest even, so that all three matmuls are bf16 x
        bf16 products accumulated in fp32, the form tensor cores run at their bf16 speed; the gradients then meet the
        exact contract's bound plus ``2^-8`` of their componentwise magnitude, the loss section 6's plus the logits'
        error carried to it (docs/spec.md section 8). On the CPU the same numbers come from exact fp32 products.
      vocab_parallel: ``None``, or the mesh axis name (or a tuple of names) over which the head is split along ``V``,
        inside ``shard_map`` / ``pmap`` (Megatron's column-parallel head): ``weight`` (and ``bias``, ``teacher_weight``,
        ``teacher_bias``) is this replica's contiguous slice ``[V_local, H]`` (shards in axis-index order,
        ``V = V_local * P``), ``hidden`` (and ``teacher_hidden``) the same on every replica, labels global ids. The loss
        is the same on every replica; the gradient of ``hidden`` is the whole one (summed over the axis inside the
        call), those of ``weight`` and ``bias`` the replica's slices. Only ``[N]`` row statistics cross the axis, never
        logits.
      tuning: ``None`` (the defaults) or a :class:`lossspec.HeadTuning`: the block budget of the XLA / torch path
        (``block_elements``, ``blocked_rows``, ``recompute_plan``), its opt-in bf16 matmuls (``bf16_matmul_devices``,
        ``split_terms``; torch: ``triton_matmul_devices``); each
        path ignores the fields it does not read (the table: :class:`lossspec.HeadTuning`). Static in JAX (a new value
        compiles anew). It changes how the work is split, which may move the result by a rounding, never what is
        computed.
      **unexpected: none: any other keyword is a ``TypeError``, which names the argument to write instead of torch's
        ``reduction=`` and Liger-Kernel's option names (``lossspec.foreign_keyword_hint``).

    Returns:
      The loss ``sum_i w_i l_i / D`` (a 0-d fp32 array/tensor; per sequence for the sequence modes), or the
      per-token ``w_i l_i`` with ``labels``' leading shape for ``normalization="none"`` (0 at masked tokens).
      Gradients flow to ``hidden``, ``weight`` and ``bias`` (accumulated in fp32 and rounded once to their
      dtypes), computed in the forward pass and scaled by the upstream gradient in the backward (with
      ``recompute_logits=True``: computed in the backward).
    """
    lossspec.begin_call("linear_jensen_shannon", unexpected, normalization, causal_shift, denominator)
    return _linear_loss(
        "jensen_shannon",
        hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, loss_mask=loss_mask,
        bias=bias, teacher_bias=teacher_bias, beta=beta, temperature=temperature, logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale, logit_softcap=logit_softcap,
        teacher_logit_softcap=teacher_logit_softcap, causal_shift=causal_shift, normalization=normalization,
        denominator=denominator, segment_ids=segment_ids, impl=impl, recompute_logits=recompute_logits, precision=precision,
        vocab_parallel=vocab_parallel,
        tuning=tuning,
    )
