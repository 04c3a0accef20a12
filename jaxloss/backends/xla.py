"""The XLA path (``impl="xla"``): the chunked driver over the block math of ``jaxloss._block``.

The driver (:func:`fused`) walks the rows in chunks of ``R`` rows (``lax.fori_loop``) so that
the fp32 temporaries of one chunk stay in cache and no fp32 copy of the whole ``[N, V]`` array
is ever made; a chunk of a large vocabulary is processed in vocabulary blocks (online
statistics, then a second loop that writes the gradient). The per-row statistics, their
combination and the gradient of a block are :mod:`jaxloss._block` (the formulation of
:mod:`lossspec.stats`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from lossspec import Tuning
from lossspec import stats as _shared

from .._block import F32, KernelConfig, Stats, block_stats, combine, empty_stats, finalize, grad_block, mixture_block, varying_like

Array = jax.Array


#: The defaults of the :class:`lossspec.Tuning` fields the XLA driver reads (``None`` there).
#: ``chunk_elements``: 2**20 elements (4 MiB in fp32) keeps a chunk's fp32 temporaries in L2/L3
#: while it is processed and the loop overhead low (2**19 to 2**22 measured within noise of each
#: other on a 2-core CPU). Rows wider than ``single_block_vocab`` are processed in blocks of
#: ``vocab_block`` columns with online statistics. One exception (:func:`blocking`'s ``whole``):
#: plain cross-entropy on fp32 logits whose rows are one block takes all rows at once.
DEFAULTS = Tuning(vocab_block=1 << 16, single_block_vocab=1 << 18, chunk_elements=1 << 20)


def blocking(tuning: Optional[Tuning], rows: int, width: int, whole: bool = False) -> tuple[bool, int, int]:
    """``(blocked, B, R)`` for ``rows`` rows of ``width`` columns: whether a row is processed in
    vocabulary blocks (it is wider than ``single_block_vocab``), the columns of one block
    (``vocab_block``; the whole row if not blocked) and the rows of one chunk
    (``R = chunk_elements // B``), from ``tuning``'s fields or :data:`DEFAULTS`.

    ``whole``: the call's only ``[N, V]`` temporary is its output (plain cross-entropy on fp32
    logits, :func:`_output_is_the_only_temporary`: XLA writes the exponentials into the
    gradient's buffer and finishes the gradient in place). Unblocked rows then default to one
    chunk of every row (``chunk_elements`` unset): no loop, whose gradient buffer is zeroed first
    and filled one chunk at a time by a dynamic-update-slice that XLA's CPU backend runs on one
    thread. Measured on a 2-core CPU
    (fp32, forward + backward, 4096 x 32768, 1024 x 131072, 131072 x 1024, 16384 x 32768): 25-30%
    less time than 2**20-element chunks, the same bits and the same memory (docs/benchmarks.md).
    The other calls keep their chunks: all rows at once would hold one to three fp32 ``[N, V]``
    temporaries (the teacher's exponentials, the fp32 copy of 16-bit logits)."""
    tuning = tuning or Tuning()
    single = tuning.single_block_vocab or DEFAULTS.single_block_vocab
    blocked = width > single
    block = min(width, tuning.vocab_block or DEFAULTS.vocab_block) if blocked else width
    if whole and not blocked and tuning.chunk_elements is None:
        return blocked, block, max(1, rows)
    return blocked, block, max(1, min(rows, (tuning.chunk_elements or DEFAULTS.chunk_elements) // max(block, 1)))


#: Whether ``fused`` can keep the rows' final statistics for the 16-bit backward
#: (``jaxloss.backends.pallas.KEEPS_FINAL``): not here; the recompute runs :func:`fused` again, the
#: same code and numbers (the twin of ``torchloss.backends.torch.KEEPS_FINAL``).
KEEPS_FINAL: bool = False

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


def storage(x: Array) -> tuple[Array, Optional[jnp.dtype]]:
    """16-bit arrays travel through the loops as ``uint16``: XLA's CPU backend upcasts bf16 /
    fp16 dynamic-slices and dynamic-update-slices to fp32, which would convert the whole
    ``[N, V]`` array (or the gradient buffer, once per chunk). Bit patterns are exact. A
    bitcast has no derivative: differentiating through it (only higher-order derivatives do)
    raises a clear ``NotImplementedError`` (:data:`HIGHER_ORDER_16BIT_MESSAGE`)."""
    if x.dtype.itemsize == 2:
        return no_derivatives(_to_bits, HIGHER_ORDER_16BIT_MESSAGE)(x), x.dtype
    return x, None


def load_block(block: Array, logical: Optional[jnp.dtype]) -> Array:
    if logical is not None:
        block = lax.bitcast_convert_type(block, logical)
    return block.astype(F32)


def _store(grad: Array, dtype: jnp.dtype, stored_as_bits: bool) -> Array:
    grad = grad.astype(dtype)  # the one rounding to the logits' dtype
    return lax.bitcast_convert_type(grad, jnp.uint16) if stored_as_bits else grad


def _output_is_the_only_temporary(cfg: KernelConfig, dtype: jnp.dtype) -> bool:
    """Whether XLA computes this call over all rows at once with no ``[N, V]`` temporary but its
    output (:func:`blocking`'s ``whole``): cross-entropy on fp32 logits without label smoothing
    or a soft cap, whose compiled memory was measured (parity_tests/test_jaxloss_kernels.py).
    Label smoothing, a soft cap and fp64 logits (fp32 exponentials beside an fp64 gradient) each
    add an fp32 ``[N, V]`` buffer, 16-bit logits an fp32 copy."""
    return cfg.is_ce and jnp.dtype(dtype) == jnp.float32 and cfg.label_smoothing == 0 and cfg.logit_softcap is None


def fused(
    cfg: KernelConfig,
    x: Array,
    target: Array,
    coef: Array,
    *,
    with_grad: bool = True,
    tuning: Optional[Tuning] = None,
    inplace: bool = False,
) -> tuple[Array, Optional[Array]]:
    """Per-token loss and gradient in one pass over the logits (XLA).

    Args:
      cfg: the kernel configuration.
      x: logits ``[N, V]`` (any float dtype).
      target: safe labels ``[N]`` int32 (0 where invalid) or teacher logits ``[N, V]``.
      coef: per-token coefficient ``[N]`` fp32 (``weight / D``, or ``weight`` for "none").
      with_grad: also compute the gradient.
      tuning: the block and chunk sizes (:func:`blocking`: the fields ``vocab_block``,
        ``single_block_vocab`` and ``chunk_elements`` of :class:`lossspec.Tuning`; ``None`` or a
        ``None`` field: :data:`DEFAULTS`).
      inplace: the gradient may take the logits' buffer (the losses' ``inplace=True``). Read by
        the Pallas kernels only: here XLA's buffer assignment decides (nothing is aliased).

    Returns:
      ``(l, grad)``: the per-token loss ``l`` ``[N]`` fp32 (0 where ``coef == 0``; *not*
      multiplied by ``coef``) and ``grad = coef * c * dl/dz`` ``[N, V]`` in the logits'
      dtype (rounded once from fp32), or ``None``.
    """
    n, vocab = x.shape
    if n == 0:
        return jnp.zeros((0,), F32), (jnp.zeros(x.shape, x.dtype) if with_grad else None)
    blocked, width, rows = blocking(tuning, n, vocab, whole=_output_is_the_only_temporary(cfg, x.dtype))
    num_chunks = -(-n // rows)
    x_store, x_logical = storage(x)
    t_store, t_logical = storage(target) if cfg.has_teacher else (target, None)

    def chunk(i: Array, carry: tuple[Array, Optional[Array]]) -> tuple[Array, Optional[Array]]:
        loss_buf, grad_buf = carry
        # The last chunk is moved back to end at row n: rows computed twice are written twice
        # with identical values, so no padding copy of the logits is needed.
        start = jnp.minimum(i * rows, n - rows)
        xc = lax.dynamic_slice_in_dim(x_store, start, rows, 0)
        tc = lax.dynamic_slice_in_dim(t_store, start, rows, 0)
        cc = lax.dynamic_slice_in_dim(coef, start, rows, 0)
        if blocked:
            loss, grad_buf = _chunk_blocked(cfg, width, xc, x_logical, tc, t_logical, cc, grad_buf, start, x.dtype)
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
    x32 = load_block(xc, x_logical)
    t32 = None
    if cfg.is_ce:
        # A gather of R elements, not a one-hot reduction over the chunk.
        x_y = load_block(jnp.take_along_axis(xc, jnp.clip(tc, 0, vocab - 1)[:, None], axis=1, mode="clip")[:, 0], x_logical)
        st, e, et = block_stats(cfg, x32, x_y=x_y)
    elif cfg.has_teacher:
        t32 = load_block(tc, t_logical)
        st, e, et = block_stats(cfg, x32, t32)
    else:  # entropy: no target
        st, e, et = block_stats(cfg, x32)
    fin = finalize(cfg, st, vocab)
    if cfg.mixture_pass:  # its second pass (lossspec.stats), on the same block
        fin = _shared.finalize_mixture(jnp, cfg, fin, *mixture_block(cfg, fin, x32, t32))
    loss = jnp.where(cc != 0, fin.l, 0.0)
    if not with_grad:
        return loss, None
    hit = (lax.broadcasted_iota(jnp.int32, xc.shape, 1) == tc[:, None]) if cfg.is_ce else None
    grad = grad_block(cfg, fin, cc, x32, t32, hit=hit, vocab=vocab, e=e, et=et)
    return loss, _store(grad, dtype, x_logical is not None)


def _chunk_blocked(
    cfg: KernelConfig,
    width: int,
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
    max and sum-exp), pass 2 writes the gradient block by block, ``width`` columns a block."""
    rows, vocab = xc.shape
    num_blocks = -(-vocab // width)

    def window(j: Array) -> tuple[Array, Array, Array, Array]:
        # As for rows, the last block is moved back to end at V; in pass 1 the columns it
        # shares with the previous block are masked out (col_ok), in pass 2 they are rewritten.
        start = jnp.minimum(j * width, vocab - width)
        cols = start + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        x32 = load_block(lax.dynamic_slice_in_dim(xc, start, width, 1), x_logical)
        t32 = load_block(lax.dynamic_slice_in_dim(tc, start, width, 1), t_logical) if cfg.has_teacher else None
        return start, cols, x32, t32

    x_y = None
    if cfg.is_ce:
        x_y = load_block(jnp.take_along_axis(xc, jnp.clip(tc, 0, vocab - 1)[:, None], axis=1, mode="clip")[:, 0], x_logical)

    def pass1(j: Array, acc: Stats) -> Stats:
        _, cols, x32, t32 = window(j)
        col_ok = cols >= j * width
        blk, _, _ = block_stats(cfg, x32, t32, x_y=jnp.zeros_like(x_y) if cfg.is_ce else None, col_ok=col_ok)
        return combine(cfg, acc, blk)

    stats = lax.fori_loop(0, num_blocks, pass1, varying_like(empty_stats(cfg, rows), xc, tc, cc))
    if cfg.is_ce:
        stats = stats._replace(x_y=x_y)
    fin = finalize(cfg, stats, vocab)
    if cfg.mixture_pass:
        # The second pass (lossspec.stats): log M needs the global lse's of pass 1.
        def pass_mix(j: Array, acc: tuple[Array, Array]) -> tuple[Array, Array]:
            _, cols, x32, t32 = window(j)
            kl_qm, kl_pm = mixture_block(cfg, fin, x32, t32, col_ok=cols >= j * width)
            return acc[0] + kl_qm, acc[1] + kl_pm

        zero = jnp.zeros((rows,), F32)
        sums = lax.fori_loop(0, num_blocks, pass_mix, varying_like((zero, zero), xc, tc, cc))
        fin = _shared.finalize_mixture(jnp, cfg, fin, *sums)
    loss = jnp.where(cc != 0, fin.l, 0.0)
    if grad_buf is None:
        return loss, None

    def pass2(j: Array, buf: Array) -> Array:
        start, cols, x32, t32 = window(j)
        hit = (cols == tc[:, None]) if cfg.is_ce else None
        grad = grad_block(cfg, fin, cc, x32, t32, hit=hit, vocab=vocab)
        return lax.dynamic_update_slice(buf, _store(grad, dtype, x_logical is not None), (row_start, start))

    return loss, lax.fori_loop(0, num_blocks, pass2, grad_buf)
