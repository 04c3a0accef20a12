"""Pallas kernels of the fused LM head (``linear_<kind>(..., impl="pallas")``).

The logits ``z = h W^T + b`` are never stored: every kernel computes its ``[block_rows,
block_vocab]`` tiles of them in fp32 (dots over ``block_hidden`` slices of the hidden axis,
``Precision.HIGHEST``, fp32 accumulation) and uses them at once, as Cut Cross-Entropy does. The
block math is :mod:`jaxloss._block` (:func:`~jaxloss._block.block_stats`,
:func:`~jaxloss._block.combine`, :func:`~jaxloss._block.finalize`,
:func:`~jaxloss._block.grad_block`: the formulation of :mod:`lossspec.stats`), the same calls as
the unfused kernels of :mod:`jaxloss.backends.pallas`::

    forward  grid: token blocks. For each vocabulary block: the tile z (and the teacher's tile
             t = h_t W_t^T + b_t) folded into the rows' statistics (online softmax); finalize
             (a kind with the mixture pass, jensen_shannon: the tiles once more for its mixture
             sums, :func:`~jaxloss._block.mixture_block`): loss [N] and the Final fields the
             gradient needs, one [N] array each
    dh       grid: token blocks. For each vocabulary block: the tiles again, G = coef * c * dl/dz,
             dh[rows] += G W[cols] (fp32, the program's own rows, blocks in order)
    dw       grid: vocabulary blocks. For each token block: the tiles again, G,
             dW[cols] += G^T h[rows], db[cols] += sum G (the program's own columns)

No atomics: each output element is written by one program, its terms added in loop order, so
two runs give the same bits. The kernels index with (row, column) vectors and masks (as
:mod:`jaxloss.backends.pallas`): the Triton lowering turns them into 64-bit pointer offsets when an
operand exceeds 2**32 bytes. The coefficients ``coef`` (normalisation, denominator, upstream
gradient) and the soft caps are runtime operands; ``has_softcap`` is static.

GPU lowering: Pallas' Triton backend; elsewhere interpret mode (the tests), decided per
platform when lowering (``lax.platform_dependent``), as in :mod:`jaxloss.backends.pallas`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import lossspec
from lossspec.stats import finalize_mixture

from .._block import F32, Final, KernelConfig, Stats, block_stats, combine, empty_stats, finalize, grad_block, mixture_block, softcap, softcap_slope

Array = jax.Array
HIGHEST = lax.Precision.HIGHEST


#: The tiles ``(block_rows, block_vocab, block_hidden)`` where :class:`lossspec.HeadTuning` leaves
#: them ``None`` (its fields are powers of two, checked there; >= 16 for the GPU's ``tl.dot``): on a
#: GPU 32 x 32 x 16, 4 warps, as the Triton head kernels; in interpret mode 16 x 16 x 16, so the
#: tests' small shapes take several blocks on every axis and ragged tails.
GPU_BLOCKS: tuple[int, int, int] = (32, 32, 16)
INTERPRET_BLOCKS: tuple[int, int, int] = (16, 16, 16)


def _blocks(tuning: lossspec.HeadTuning, on_gpu: bool) -> tuple[int, int, int]:
    default = GPU_BLOCKS if on_gpu else INTERPRET_BLOCKS
    return (tuning.block_rows or default[0], tuning.block_vocab or default[1], tuning.block_hidden or default[2])


@dataclasses.dataclass(frozen=True)
class HeadShape:
    """Static facts of one call (hashable)."""

    n: int
    vocab: int
    width: int
    t_width: int  # the teacher's hidden width (0: no teacher)
    has_bias: bool
    has_t_bias: bool
    has_softcap: bool
    has_t_softcap: bool


def _dot(a: Array, b: Array, contract: tuple[int, int]) -> Array:
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=F32)


def _index(block: int, start: Any, size: int) -> tuple[Array, Array]:
    """``(ids [block] int32, inside [block] bool)`` of ``start + arange(block)`` within ``size``."""
    ids = start + jnp.arange(block, dtype=jnp.int32)
    return ids, ids < size


def _tile_logits(x_ref: Any, w_ref: Any, b_ref: Any, rows: tuple, cols: tuple, width: int, block_hidden: int, has_bias: bool,
                 cap: Optional[Array]) -> Array:
    """``x[rows] @ w[cols]^T + b[cols]`` ``[R, B]`` fp32 (entries outside read 0), then
    ``cap tanh(z / cap)`` when ``cap`` is given."""
    (r, r_ok), (c, c_ok) = rows, cols

    def body(k: Any, acc: Array) -> Array:
        ks, k_ok = _index(block_hidden, k * block_hidden, width)
        xb = plgpu.load(x_ref.at[r[:, None], ks[None, :]], mask=r_ok[:, None] & k_ok[None, :], other=0.0).astype(F32)
        wb = plgpu.load(w_ref.at[c[:, None], ks[None, :]], mask=c_ok[:, None] & k_ok[None, :], other=0.0).astype(F32)
        return acc + _dot(xb, wb, (1, 1))

    z = lax.fori_loop(0, pl.cdiv(width, block_hidden), body, jnp.zeros((r.shape[0], c.shape[0]), F32))
    if has_bias:
        z = z + plgpu.load(b_ref.at[c], mask=c_ok, other=0.0).astype(F32)[None, :]
    if cap is not None:
        z = softcap(z, cap)  # the shared cap (lossspec.stats.softcap: one tanh on every backend)
    return z


def _refs(cfg: KernelConfig, shape: HeadShape, refs: tuple) -> tuple[dict[str, Any], tuple]:
    """Split the operand refs: ``h, w, [b], [y] | [th, tw, [tb]], coef, caps`` and the rest."""
    names = ["h", "w"] + (["b"] if shape.has_bias else [])
    if cfg.is_ce:
        names.append("y")
    if cfg.has_teacher:
        names += ["th", "tw"] + (["tb"] if shape.has_t_bias else [])
    names += ["coef", "caps"]
    return dict(zip(names, refs)), refs[len(names):]


def _cap(ops: dict[str, Any], rows: tuple, which: int) -> Array:
    """The soft cap ``which`` (0: the student's, 1: the teacher's) as an ``[R, 1]`` column, one
    load per row of the same element: Pallas' Triton lowering has no ``slice`` to take one
    element of a loaded vector (the interpreter has)."""
    return plgpu.load(ops["caps"].at[rows[0] * 0 + which])[:, None]


def _tiles(cfg: KernelConfig, shape: HeadShape, ops: dict[str, Any], rows: tuple, cols: tuple, block_hidden: int,
           cap_student: bool = True) -> tuple:
    """``(z, t)`` tiles of the rows and columns (``t``: ``None`` without a teacher); ``z`` raw
    (never capped) with ``cap_student=False``."""
    z = _tile_logits(ops["h"], ops["w"], ops.get("b"), rows, cols, shape.width, block_hidden, shape.has_bias,
                     _cap(ops, rows, 0) if shape.has_softcap and cap_student else None)
    if not cfg.has_teacher:
        return z, None
    t = _tile_logits(ops["th"], ops["tw"], ops.get("tb"), rows, cols, shape.t_width, block_hidden, shape.has_t_bias,
                     _cap(ops, rows, 1) if shape.has_t_softcap else None)
    return z, t


def _grad_tile(cfg: KernelConfig, shape: HeadShape, ops: dict[str, Any], fin: Final, coef: Array, y: Optional[Array], rows: tuple,
               cols: tuple, block_hidden: int) -> Array:
    """``G = coef * c * dl/dz_raw`` ``[R, B]`` fp32 (:func:`~jaxloss._block.grad_block`, times
    the cap's slope from the raw ``z`` with a soft cap); exactly 0 outside the arrays."""
    z_raw, t = _tiles(cfg, shape, ops, rows, cols, block_hidden, cap_student=False)
    z = softcap(z_raw, _cap(ops, rows, 0)) if shape.has_softcap else z_raw
    hit = (cols[0][None, :] == y[:, None]) if cfg.is_ce else None
    g = grad_block(cfg, fin, coef, z, t, hit=hit, vocab=shape.vocab)
    if shape.has_softcap:
        g = g * softcap_slope(z_raw, _cap(ops, rows, 0))  # from the raw z: no cancellation near saturation
    return jnp.where(rows[1][:, None] & cols[1][None, :], g, 0.0)


def _final_fields(cfg: KernelConfig) -> tuple[str, ...]:
    """The :class:`Final` fields the gradient reads (:func:`lossspec.final_used`, ``l`` excluded)."""
    return tuple(name for name in lossspec.final_used(cfg) if name != "l")


def _load_rows(ops: dict[str, Any], rows: tuple, fin_refs: tuple, cfg: KernelConfig) -> tuple[Final, Array, Optional[Array]]:
    r, r_ok = rows
    values = {name: plgpu.load(ref.at[r], mask=r_ok, other=0.0) for name, ref in zip(_final_fields(cfg), fin_refs)}
    coef = plgpu.load(ops["coef"].at[r], mask=r_ok, other=0.0)
    y = plgpu.load(ops["y"].at[r], mask=r_ok, other=0) if cfg.is_ce else None
    return Final(**values), coef, y


def _forward_kernel(*refs: Any, cfg: KernelConfig, shape: HeadShape, blocks: tuple[int, int, int]) -> None:
    block_rows, block_vocab, block_hidden = blocks
    ops, outs = _refs(cfg, shape, refs)
    loss_ref, fin_refs = outs[0], outs[1:]
    rows = _index(block_rows, pl.program_id(0) * block_rows, shape.n)
    coef = plgpu.load(ops["coef"].at[rows[0]], mask=rows[1], other=0.0)
    y = plgpu.load(ops["y"].at[rows[0]], mask=rows[1], other=0) if cfg.is_ce else None

    def body(j: Any, acc: Stats) -> Stats:
        cols = _index(block_vocab, j * block_vocab, shape.vocab)
        z, t = _tiles(cfg, shape, ops, rows, cols, block_hidden)
        hit = (cols[0][None, :] == y[:, None]) if cfg.is_ce else None
        blk, _, _ = block_stats(cfg, z, t, hit=hit, col_ok=cols[1][None, :], gather=False)
        return combine(cfg, acc, blk)

    stats = lax.fori_loop(0, pl.cdiv(shape.vocab, block_vocab), body, empty_stats(cfg, block_rows))
    fin = finalize(cfg, stats, shape.vocab)
    if cfg.mixture_pass:  # the second pass (lossspec.stats): the tiles again, from the rows' lse's

        def mixture(j: Any, sums: tuple[Array, Array]) -> tuple[Array, Array]:
            cols = _index(block_vocab, j * block_vocab, shape.vocab)
            z, t = _tiles(cfg, shape, ops, rows, cols, block_hidden)
            kl_qm, kl_pm = mixture_block(cfg, fin, z, t, col_ok=cols[1][None, :])
            return sums[0] + kl_qm, sums[1] + kl_pm

        zero = jnp.zeros((block_rows,), F32)
        fin = finalize_mixture(jnp, cfg, fin, *lax.fori_loop(0, pl.cdiv(shape.vocab, block_vocab), mixture, (zero, zero)))
    plgpu.store(loss_ref.at[rows[0]], jnp.where(coef != 0, fin.l, 0.0), mask=rows[1])
    for name, ref in zip(_final_fields(cfg), fin_refs):
        plgpu.store(ref.at[rows[0]], getattr(fin, name), mask=rows[1])


def _dh_kernel(*refs: Any, cfg: KernelConfig, shape: HeadShape, blocks: tuple[int, int, int]) -> None:
    block_rows, block_vocab, block_hidden = blocks
    ops, rest = _refs(cfg, shape, refs)
    # rest: the Final fields, the zeros aliased to the output, the output dh
    fin_refs, dh_ref = rest[: len(_final_fields(cfg))], rest[-1]
    rows = _index(block_rows, pl.program_id(0) * block_rows, shape.n)
    fin, coef, y = _load_rows(ops, rows, fin_refs, cfg)

    def body(j: Any, carry: int) -> int:
        cols = _index(block_vocab, j * block_vocab, shape.vocab)
        g = _grad_tile(cfg, shape, ops, fin, coef, y, rows, cols, block_hidden)

        def add(k: Any, carry: int) -> int:
            ks, k_ok = _index(block_hidden, k * block_hidden, shape.width)
            wb = plgpu.load(ops["w"].at[cols[0][:, None], ks[None, :]], mask=cols[1][:, None] & k_ok[None, :], other=0.0).astype(F32)
            index, ok = (rows[0][:, None], ks[None, :]), rows[1][:, None] & k_ok[None, :]
            plgpu.store(dh_ref.at[index], plgpu.load(dh_ref.at[index], mask=ok, other=0.0) + _dot(g, wb, (1, 0)), mask=ok)
            return carry

        return lax.fori_loop(0, pl.cdiv(shape.width, block_hidden), add, carry)

    lax.fori_loop(0, pl.cdiv(shape.vocab, block_vocab), body, 0)


def _dw_kernel(*refs: Any, cfg: KernelConfig, shape: HeadShape, blocks: tuple[int, int, int]) -> None:
    block_rows, block_vocab, block_hidden = blocks
    ops, rest = _refs(cfg, shape, refs)
    # rest: the Final fields, the zeros aliased to the outputs, the outputs dW (and db)
    fin_refs = rest[: len(_final_fields(cfg))]
    if shape.has_bias:
        dw_ref, db_ref = rest[-2], rest[-1]
    else:
        dw_ref, db_ref = rest[-1], None
    cols = _index(block_vocab, pl.program_id(0) * block_vocab, shape.vocab)

    def body(i: Any, db: Array) -> Array:
        rows = _index(block_rows, i * block_rows, shape.n)
        fin, coef, y = _load_rows(ops, rows, fin_refs, cfg)
        g = _grad_tile(cfg, shape, ops, fin, coef, y, rows, cols, block_hidden)

        def add(k: Any, carry: int) -> int:
            ks, k_ok = _index(block_hidden, k * block_hidden, shape.width)
            hb = plgpu.load(ops["h"].at[rows[0][:, None], ks[None, :]], mask=rows[1][:, None] & k_ok[None, :], other=0.0).astype(F32)
            index, ok = (cols[0][:, None], ks[None, :]), cols[1][:, None] & k_ok[None, :]
            plgpu.store(dw_ref.at[index], plgpu.load(dw_ref.at[index], mask=ok, other=0.0) + _dot(g, hb, (0, 0)), mask=ok)
            return carry

        lax.fori_loop(0, pl.cdiv(shape.width, block_hidden), add, 0)
        return db + jnp.sum(g, axis=0)

    db = lax.fori_loop(0, pl.cdiv(shape.n, block_rows), body, jnp.zeros((block_vocab,), F32))
    if db_ref is not None:
        plgpu.store(db_ref.at[cols[0]], db, mask=cols[1])


def _call(kernel: Callable[..., None], name: str, grid_of: Callable[[tuple[int, int, int]], int], cfg: KernelConfig, shape: HeadShape,
          inputs: tuple, out_shapes: tuple, tuning: lossspec.HeadTuning, aliases: Optional[dict[int, int]] = None) -> tuple:
    """Run ``kernel`` (Triton on CUDA/ROCm, interpret mode elsewhere unless ``tuning`` says)."""

    def call(interpret: bool) -> Callable[..., Any]:
        blocks = _blocks(tuning, on_gpu=not interpret)
        return pl.pallas_call(
            functools.partial(kernel, cfg=cfg, shape=shape, blocks=blocks),
            out_shape=tuple(jax.ShapeDtypeStruct(s, d) for s, d in out_shapes),
            grid=(grid_of(blocks),),
            interpret=interpret,
            input_output_aliases=aliases or {},
            compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps or 4, num_stages=tuning.num_stages),
            name=f"jaxloss_linear_{cfg.kind}_{name}",
        )

    if tuning.interpret is not None:
        return tuple(call(tuning.interpret)(*inputs))
    return tuple(lax.platform_dependent(*inputs, cuda=call(False), rocm=call(False), default=call(True)))


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
    softcaps: tuple[Optional[float], Optional[float]] = (None, None),
    tuning: lossspec.HeadTuning = lossspec.DEFAULT_HEAD_TUNING,
) -> tuple[Array, Optional[Array], Optional[Array], Optional[Array]]:
    """``jaxloss.head.head_forward`` on the Pallas kernels: ``(l [N], dh [N, H], dW [V, H],
    db [V] | None)``, fp32 (the loss 0 where ``coef == 0``; with ``with_grad`` the gradients of
    ``sum_i coef_i l_i``). ``softcaps``: ``(logit_softcap, teacher_logit_softcap)``. ``tuning``:
    the call's :class:`lossspec.HeadTuning`, of which the kernels read ``block_rows``,
    ``block_vocab``, ``block_hidden``, ``num_warps``, ``num_stages`` and ``interpret``."""
    n, width = hidden.shape
    vocab = weight.shape[0]
    ce, distill = cfg.is_ce, cfg.has_teacher
    cap, t_cap = softcaps
    # The kernels apply the caps themselves (runtime operands): the shared block math they call
    # must not apply them a second time.
    cfg = dataclasses.replace(cfg, logit_softcap=None, teacher_logit_softcap=None)
    shape = HeadShape(
        n=n, vocab=vocab, width=width, t_width=teacher[0].shape[1] if distill else 0, has_bias=bias is not None,
        has_t_bias=distill and teacher[2] is not None, has_softcap=cap is not None, has_t_softcap=distill and t_cap is not None,
    )
    if n == 0:
        zeros = lambda *s: jnp.zeros(s, F32) if with_grad else None  # noqa: E731
        return jnp.zeros((0,), F32), zeros(n, width), zeros(vocab, width), (zeros(vocab) if bias is not None else None)
    inputs: tuple = (hidden, weight) + ((bias,) if bias is not None else ())
    inputs += (labels.astype(jnp.int32),) if ce else ()
    inputs += tuple(a for a in teacher if a is not None) if distill else ()
    caps = jnp.asarray([1.0 if cap is None else cap, 1.0 if t_cap is None else t_cap], F32)
    inputs += (coef.astype(F32), caps)
    fields = _final_fields(cfg)
    by_rows = lambda blocks: pl.cdiv(n, blocks[0])  # noqa: E731
    outs = _call(_forward_kernel, "forward", by_rows, cfg, shape, inputs, (((n,), F32),) + tuple(((n,), F32) for _ in fields), tuning)
    loss, fin = outs[0], outs[1:]
    if not with_grad:
        return loss, None, None, None
    # The gradients are accumulated in place into zero-initialised outputs (aliased inputs).
    first = len(inputs) + len(fin)
    (dh,) = _call(_dh_kernel, "dh", by_rows, cfg, shape, inputs + fin + (jnp.zeros((n, width), F32),), (((n, width), F32),), tuning,
                  {first: 0})
    grads = (jnp.zeros((vocab, width), F32),) + ((jnp.zeros((vocab,), F32),) if bias is not None else ())
    out_shapes = (((vocab, width), F32),) + ((((vocab,), F32),) if bias is not None else ())
    by_cols = lambda blocks: pl.cdiv(vocab, blocks[1])  # noqa: E731
    dw_db = _call(_dw_kernel, "dw", by_cols, cfg, shape, inputs + fin + grads, out_shapes, tuning,
                  {first + i: i for i in range(len(grads))})
    return loss, dh, dw_db[0], (dw_db[1] if bias is not None else None)
