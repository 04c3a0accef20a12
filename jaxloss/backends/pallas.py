"""Pallas kernels (``impl="pallas"``) for the loss kinds.

One kernel source for all kinds (the kind is static)::

    per_token_loss [N] fp32, grad [N, V] (logits dtype) = kernel(kind, x [N, V], target, coef [N] fp32)

with ``target`` the safe labels ``[N]`` int32 or the teacher logits ``[N, V]``.

* One program per block of ``block_rows`` rows (``grid = cdiv(N, block_rows)``); rows past
  ``N`` are masked on every load and store. ``Tuning(programs=P)``: ``P`` persistent programs
  instead, each taking every ``P``-th block of rows (fewer rows in flight: more of each row's
  second read can come from L2; the Triton kernels' ``programs`` too). The kernel sees whole arrays and addresses a
  ``[block_rows, vocab_block]`` tile with row and column index vectors.
* Pass 1 loops over vocabulary blocks of ``vocab_block`` columns and folds their statistics
  with the online-softmax algebra of :mod:`jaxloss._block` (:func:`~jaxloss._block.block_stats`,
  :func:`~jaxloss._block.fold`; reverse KL :func:`~jaxloss._block.combine`). It reads a block as
  ``[block_rows, lanes, VEC]``, ``VEC`` adjacent columns (16 bytes) a lane that one thread sums
  alone: the sums are per-lane partial sums, added up once per row after the loop
  (:func:`~jaxloss._block.lanes_to_rows`), and a block's only cross-thread reductions are its
  maxima (the Triton kernels' lanes). Pass 2 loops again, last block first (the blocks pass 1
  read last are the likeliest still in L2), and writes ``coef * c * dl/dz``, fp32 inside and
  cast once on store. Ragged vocabulary tails are masked loads/stores.
  ``jensen_shannon`` loops once more in between (its mixture sums need the global ``lse``'s,
  :mod:`lossspec.stats`); ``entropy`` reads no target (an empty ``[N, 0]`` stand-in).
* Rows with ``coef == 0`` (masked, or ``D == 0``) are never read: their lanes are masked off every
  load and their zero gradient is stored; a block of such rows skips the passes (``pl.when``) and
  stores zeros only (the Triton kernels' ``_zero_row``). The "stats" mode, which has no ``coef``,
  reads every row.
* ``inplace`` (the losses' ``inplace=True``): the gradient output aliases ``x``
  (``input_output_aliases``); pass 2 writes a block only after both passes have read it.
* Cross-entropy reads the label's logit with one masked load per row at ``(row, label)`` before
  pass 1 (a label outside this array's columns, a vocab-parallel shard's, reads 0); pass 2 writes
  every column without the one-hot term and the label's entry is written again after it, behind a
  barrier (no per-column compare in either pass: the Triton kernels' fix-up). The kernel needs nothing
  beyond loads, stores, elementwise math and row reductions. Exponentials are ``exp2`` with
  ``log2(e)`` folded into the scale (:func:`jaxloss._block.exp_scaled`).
* Offsets: the kernel indexes with (row, column) pairs and never forms ``row * V`` itself;
  the Pallas Triton lowering turns them into pointer offsets and switches to 64-bit offsets
  when an operand exceeds 2**32 bytes, so ``N * V`` beyond int32 is safe.
* GPU lowering: Pallas' **Triton** backend (``jax.experimental.pallas.triton``:
  ``CompilerParams(num_warps, num_stages)``, masked ``load``/``store``). On other backends
  the same kernel runs in Pallas interpret mode (``interpret=True``), which the tests use.
* ``mode`` (static): ``"fused"`` (pass 1, finalize, pass 2) is what the losses use;
  vocab-parallel calls run ``"stats"`` (pass 1 only: the per-row :class:`~lossspec.stats.Stats`
  of this shard out, see :func:`shard_stats`) and, once the statistics are combined over the
  mesh axis, ``"grad"`` (the global :class:`~lossspec.stats.Final` in, pass 2 only:
  :func:`shard_grad`). The collectives stay outside the kernel.
* ``keep_final`` (:data:`KEEPS_FINAL`): the "fused" mode also stores each row's final statistics
  (:func:`lossspec.final_used`), so that the 16-bit backward's recompute
  (``jaxloss._autodiff``) is the "grad" mode alone: one read of the logits (and teacher) and one
  write, not both passes again (the Triton kernels' ``WRITE_FINAL``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import lossspec
from lossspec import DEFAULT_TUNING, Tuning
from lossspec.stats import finalize_mixture
from lossspec.tuning import check_power_of_two

from .._block import (
    F32,
    NEG_INF,
    Final,
    KernelConfig,
    Stats,
    block_stats,
    combine,
    empty_stats,
    finalize,
    fold,
    grad_block,
    lanes_to_rows,
    mixture_block,
    varying_axes,
    varying_like,
)
from .xla import no_derivatives

Array = jax.Array
MODES = ("fused", "stats", "grad")
#: ``fused(..., keep_final=True)`` returns the rows' final statistics, which :func:`shard_grad`
#: turns into the gradient for another ``coef`` without pass 1 (``jaxloss._autodiff``'s 16-bit
#: recompute; ``jaxloss.backends.xla`` recomputes both passes).
KEEPS_FINAL: bool = True
HIGHER_ORDER_MESSAGE = (
    "jaxloss: impl='pallas' supports first-order reverse-mode derivatives only (jax.grad, jax.vjp, "
    "jax.value_and_grad): the Pallas kernels have no derivative rules of their own. For higher-order "
    "derivatives (grad of grad, jax.hessian, jax.jvp of a gradient) use impl='xla' with float32 logits."
)


#: The defaults of the :class:`lossspec.Tuning` fields the Pallas kernels read (``None`` there):
#: ``block_rows``, ``vocab_block`` (powers of two), ``num_warps`` and ``num_stages`` (``None``:
#: Triton's), per lowering. On a GPU one row x up to 4096 columns per program, 4 warps, 8 for the
#: kinds that read a teacher, 16 with a soft cap (:func:`_num_warps`; the Triton kernels' launch);
#: interpreted (CPU) 8 rows x up to 128 columns, so the tests' small vocabularies still take several
#: blocks and a ragged tail. ``interpret`` (``None``: per lowering platform) and ``debug`` are read
#: from the call's tuning.
#:
#: Chosen offline, from the sm_90 SASS of ``scripts/pallas_aot_report.py`` (not yet timed on a GPU:
#: ``benchmarks/gpu_pallas_sweep.py`` will). One row per program reduces each statistic once per
#: 4096 columns instead of once per 1024 columns of each of 4 rows: bf16 cross-entropy 0.87 -> 0.64
#: warp-instructions per element, reverse KL 2.11 -> 1.74. With 4 warps (32 values per thread and
#: tensor) the teacher kinds took up to 255 registers and the soft-capped kernels spilled; with 8
#: and 16 every kernel stays at 128 registers or fewer, without spills. Since the per-lane sums,
#: 4 warps spill nothing but the soft-capped kernels still take 166-245 registers (bf16
#: jensen_shannon with both caps spills 4 B at 8 warps); 16 keep them at 58-74, within 3% of the
#: others' instruction counts.
GPU_DEFAULTS = Tuning(block_rows=1, vocab_block=4096, num_warps=4)
INTERPRET_DEFAULTS = Tuning(block_rows=8, vocab_block=128, num_warps=4)
GPU_TEACHER_WARPS = 8
GPU_SOFTCAP_WARPS = 16


def _num_warps(cfg: KernelConfig, tuning: Tuning) -> int:
    """The kernel's warps: the call's ``Tuning.num_warps``, else the GPU default of its kind (more
    warps, fewer values per thread, where a teacher or a soft cap keeps more of them live)."""
    if tuning.num_warps:
        return tuning.num_warps
    if cfg.logit_softcap is not None or cfg.teacher_logit_softcap is not None:
        return GPU_SOFTCAP_WARPS
    return GPU_TEACHER_WARPS if cfg.has_teacher else GPU_DEFAULTS.num_warps


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_shape(tuning: Tuning, rows: int, vocab: int, *, on_gpu: bool) -> tuple[int, int]:
    """``(block_rows, vocab_block)`` of a kernel over ``rows`` x ``vocab``: the call's tuning, else
    the defaults of the lowering (GPU or interpreted), no wider than the array."""
    defaults = GPU_DEFAULTS if on_gpu else INTERPRET_DEFAULTS
    block_rows = check_power_of_two(tuning.block_rows or defaults.block_rows, "block_rows", "pallas")
    block_vocab = check_power_of_two(tuning.vocab_block or defaults.vocab_block, "vocab_block", "pallas")
    # No wider than needed: a small vocabulary or batch takes one (masked) block.
    return min(block_rows, _next_pow2(max(rows, 1))), min(block_vocab, _next_pow2(vocab))


def _kernel(
    *refs,
    cfg: KernelConfig,
    n_rows: int,
    n_cols: int,
    vocab: int,
    block_rows: int,
    block_vocab: int,
    mode: str,
    fields: tuple[str, ...],
    programs: Optional[int] = None,
    compiled: bool = False,
) -> None:
    """One program: rows ``[pid * block_rows, (pid + 1) * block_rows)`` of ``[N, n_cols]``; with
    ``programs`` (``Tuning.programs``, persistent programs) every ``programs``-th block of
    ``block_rows`` rows from the ``pid``-th on, one after the other.

    The refs are the whole arrays, by mode (``t``: labels ``[N]`` or teacher ``[N, n_cols]``)::

        "fused"  x, t, coef                    -> loss [N], [one [N] array per Final field in ``fields``], grad [N, n_cols]
        "stats"  x, t                          -> one [N] array per Stats field in ``fields``
        "grad"   x, t, coef, Final ``fields``  -> grad [N, n_cols]

    ``n_cols`` is the width of ``x`` (a vocab-parallel shard's ``V_local``), ``vocab`` the
    global ``V`` (label smoothing's ``eps / V``); labels are this array's column ids (a shard's
    labels are shifted by its offset, so other shards' labels hit no column). Blocks are
    addressed with (row, column) index vectors and masks, never with slices: masked lanes are
    out of bounds, so a masked store can never alias a valid element, and the interpreter needs
    no padding (which ``shard_map``'s varying-axes checks reject). ``compiled``: lowered to Triton
    (not interpreted), where the label fix-up needs a barrier behind pass 2.
    """
    ce = cfg.is_ce
    x_ref, t_ref = refs[0], refs[1]

    def rows_block(row_block: Array) -> None:
        """The work of the rows ``[row_block * block_rows, (row_block + 1) * block_rows)``."""
        rows = row_block * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
        row_ok = rows < n_rows
        # A row with coef == 0 (masked, or D == 0) needs only its zero gradient written: neither pass
        # reads its logits (or teacher), like the Triton kernels' _zero_row. Its lanes are masked off
        # every load, and a block with no such live row skips both passes (see the end). The "stats"
        # mode has no coef: every row is live.
        coef = None if mode == "stats" else plgpu.load(refs[2].at[rows], mask=row_ok, other=0.0)
        live = row_ok if coef is None else row_ok & (coef != 0)
        labels = plgpu.load(t_ref.at[rows], mask=live, other=0) if ce else None
        if ce:
            # The label's logit, read once per row before anything is written (a shard's labels may
            # name no column of its own: 0 then, as a compare against every column would give):
            # pass 1's x_y, instead of a compare, a select and a row sum in every block, and the
            # input of the label entry's gradient, which pass 2 leaves out and label_fixup writes.
            label_ok = live & (labels >= 0) & (labels < n_cols)
            label_logit = plgpu.load(x_ref.at[rows, labels], mask=label_ok, other=0.0).astype(F32)
        num_blocks = pl.cdiv(n_cols, block_vocab)

        # Pass 1 (and jensen_shannon's mixture pass) reads a block as [block_rows, lanes, VEC]: VEC
        # adjacent columns (one 16-byte load) a lane, which one thread holds and sums alone, so a
        # block's sums are per-lane partial sums ([block_rows, lanes], rescaled by the row's maxima
        # as blocks are folded) added up once per row after the loop; a block's only cross-thread
        # reductions are its maxima (and reverse KL's pivot). The Triton kernels' lanes.
        vec = min(block_vocab, max(1, 16 // jnp.dtype(x_ref.dtype).itemsize))
        lanes = block_vocab // vec

        def columns(j: Array, by_lane: bool = False) -> tuple[tuple[Array, Array], Array, Array, Array]:
            """Block ``j``'s (row, column) index, ``col_ok`` (its columns inside the array), store mask
            and read mask (live rows only), ``[block_rows, block_vocab]``, or with ``by_lane``
            ``[block_rows, lanes, VEC]`` (lane ``l``: the block's columns ``[l VEC, (l + 1) VEC)``)."""
            if by_lane:
                offsets = jnp.arange(lanes, dtype=jnp.int32)[:, None] * vec + jnp.arange(vec, dtype=jnp.int32)[None, :]
            else:
                offsets = jnp.arange(block_vocab, dtype=jnp.int32)
            cols = j * block_vocab + offsets
            col_ok = (cols < n_cols)[None]
            per_row = (slice(None),) + (None,) * cols.ndim
            return (rows[per_row], cols[None]), col_ok, row_ok[per_row] & col_ok, live[per_row] & col_ok

        def load(j: Array, by_lane: bool = False) -> tuple[tuple[Array, Array], Array, Array, Array, Optional[Array]]:
            index, col_ok, mask, read = columns(j, by_lane)
            # Masked lanes read 0 (finite); block_stats masks them to -inf through col_ok.
            x = plgpu.load(x_ref.at[index], mask=read, other=0.0).astype(F32)
            t = plgpu.load(t_ref.at[index], mask=read, other=0.0).astype(F32) if cfg.has_teacher else None
            return index, col_ok, mask, x, t

        def pivot_logit(j: Array, first: Array) -> Array:
            """Reverse KL: the teacher's raw logit at each row's pivot column ``first`` of block ``j``
            (one load per row of a column pass 1 just read, in place of a compare and a row
            reduction over the block); -inf where ``first`` is past the block (a NaN row), and 0 on
            a dead row, whose teacher is never read (what the compare gave on its zeros)."""
            col = j * block_vocab + first
            found = (first < block_vocab) & (col < n_cols)
            teacher = plgpu.load(t_ref.at[rows, col], mask=live & found, other=0.0).astype(F32)
            return jnp.where(found, teacher, NEG_INF)

        def pass1() -> Stats:
            no_label = jnp.zeros((block_rows, 1), F32) if ce else None  # the label's logit comes apart

            def body(j: Array, acc: Stats) -> Stats:
                _, col_ok, _, x, t = load(j, by_lane=True)
                if acc.tau is not None:  # reverse KL: its pivot and e_d fold with combine's algebra
                    blk, _, _ = block_stats(cfg, x, t, col_ok=col_ok, gather=False, base2=True,
                                            pivot=functools.partial(pivot_logit, j), selects=False)
                    return combine(cfg, acc, blk)
                # the block's sums relative to the new running maxima: only acc's are rescaled
                blk, _, _ = block_stats(cfg, x, t, x_y=no_label, col_ok=col_ok, base2=True, selects=False, minnum=compiled,
                                        running=acc)
                return fold(cfg, acc, blk)

            stats = lanes_to_rows(lax.fori_loop(0, num_blocks, body, empty_stats(cfg, block_rows, lanes)))
            return stats._replace(x_y=label_logit) if ce else stats

        def mixture_pass(fin: Final) -> Final:
            """jensen_shannon's second pass (lossspec.stats): the mixture sums, then its loss."""

            # per-lane sums too (by_lane); the per-row statistics as [R, 1] columns, which the
            # shared per-entry algebra's [:, None] turns into [R, 1, 1] against the lanes' blocks
            columns = Final(**{name: None if v is None else v[:, None] for name, v in fin._asdict().items()})

            def body(j: Array, acc: tuple[Array, Array]) -> tuple[Array, Array]:
                _, col_ok, _, x, t = load(j, by_lane=True)
                kl_qm, kl_pm = mixture_block(cfg, columns, x, t, col_ok=col_ok, base2=True, selects=False)
                return acc[0] + kl_qm, acc[1] + kl_pm

            zero = jnp.zeros((block_rows, lanes), F32)
            kl_qm, kl_pm = lax.fori_loop(0, num_blocks, body, (zero, zero))
            return finalize_mixture(jnp, cfg, fin, jnp.sum(kl_qm, axis=-1), jnp.sum(kl_pm, axis=-1))

        def pass2(fin: Final, coef: Array, grad_ref) -> None:
            def body(j: Array, carry: int) -> int:
                # last block first: the blocks pass 1 read last are the likeliest still in L2 (as
                # in the Triton kernels); every entry is computed alike in either order
                index, _, mask, x, t = load(num_blocks - 1 - j)
                # No select per entry (grad_block's selects=False): a bad row is NaN through its
                # scale, and a dead row (coef == 0) is zeroed here, where the block holds several
                # rows (with one row a program, this pass runs on live rows only).
                grad = grad_block(cfg, fin, coef, x, t, vocab=vocab, base2=True, selects=False)
                if block_rows > 1:
                    # where, not coef *: a dead row's stand-in zeros against the global statistics
                    # ("grad" mode; NaN for a masked row of garbage) may overflow
                    grad = jnp.where(live[:, None], grad, 0.0)
                plgpu.store(grad_ref.at[index], grad.astype(grad_ref.dtype), mask=mask)
                return carry

            lax.fori_loop(0, num_blocks, body, 0)
            if ce:
                label_fixup(fin, coef, grad_ref)

        def label_fixup(fin: Final, coef: Array, grad_ref) -> None:
            """Cross-entropy: the label's entry of each row, written again after pass 2 (which wrote
            it without the one-hot term, as every other column) from the logit read before pass 1,
            with grad_block's operations on a one-column block; behind a barrier, so that it lands
            after pass 2's store of the same entry by another thread (the Triton kernels' fix-up)."""
            grad = grad_block(cfg, fin, coef, label_logit[:, None], hit=jnp.ones((block_rows, 1), bool), vocab=vocab, base2=True)
            grad = jnp.where(live[:, None], grad, 0.0)[:, 0]
            if compiled:  # interpreted, the stores already run in program order (and it has no barrier)
                plgpu.debug_barrier()
            plgpu.store(grad_ref.at[rows, labels], grad.astype(grad_ref.dtype), mask=label_ok)

        def zero_grad(grad_ref) -> None:
            def body(j: Array, carry: int) -> int:
                index, _, mask, _ = columns(j)
                plgpu.store(grad_ref.at[index], jnp.zeros((block_rows, block_vocab), grad_ref.dtype), mask=mask)
                return carry

            lax.fori_loop(0, num_blocks, body, 0)

        if mode == "stats":
            stats = pass1()
            for name, out_ref in zip(fields, refs[2:]):
                plgpu.store(out_ref.at[rows], getattr(stats, name), mask=row_ok)
            return
        grad_ref = refs[-1]
        any_live = jnp.sum(live.astype(jnp.int32)) > 0

        @pl.when(any_live)
        def _live_block() -> None:
            if mode == "grad":
                values = {name: plgpu.load(ref.at[rows], mask=row_ok, other=0.0) for name, ref in zip(fields, refs[3:-1])}
                pass2(Final(**values), coef, grad_ref)
                return
            fin = finalize(cfg, pass1(), vocab)
            if cfg.kind == "jensen_shannon":
                fin = mixture_pass(fin)
            plgpu.store(refs[3].at[rows], jnp.where(coef != 0, fin.l, 0.0), mask=row_ok)
            for name, out_ref in zip(fields, refs[4:-1]):  # keep_final: what the "grad" mode reads back
                plgpu.store(out_ref.at[rows], getattr(fin, name), mask=row_ok)
            pass2(fin, coef, grad_ref)

        @pl.when(jnp.logical_not(any_live))
        def _dead_block() -> None:  # every row masked: zeros out, nothing read
            if mode == "fused":
                plgpu.store(refs[3].at[rows], jnp.zeros((block_rows,), F32), mask=row_ok)
            zero_grad(grad_ref)

    if programs is None:
        rows_block(pl.program_id(0))
        return
    # Persistent programs (Tuning.programs): program pid takes the row blocks pid, pid + P, ...
    first, step = pl.program_id(0), pl.num_programs(0)
    count = pl.cdiv(pl.cdiv(n_rows, block_rows) - first, step)

    def each(k: Array, carry: int) -> int:
        rows_block(first + k * step)
        return carry

    lax.fori_loop(0, count, each, 0)


def _call(
    cfg: KernelConfig,
    mode: str,
    inputs: tuple[Array, ...],
    out_shapes: tuple[tuple[tuple[int, ...], jnp.dtype], ...],
    *,
    n_cols: int,
    vocab: int,
    fields: tuple[str, ...] = (),
    tuning: Optional[Tuning] = None,
    aliases: Optional[dict[int, int]] = None,
) -> tuple[Array, ...]:
    """Run the kernel in ``mode`` over ``inputs`` (``inputs[0]`` is ``x [N, n_cols]``), with the
    :class:`lossspec.Tuning` fields ``block_rows``, ``vocab_block``, ``num_warps``, ``num_stages``,
    ``programs`` (persistent programs), ``interpret`` and ``debug`` of ``tuning`` (``None``: :data:`GPU_DEFAULTS` /
    :data:`INTERPRET_DEFAULTS`). ``aliases``: ``{input index: output index}``, outputs written into
    their input's buffer (``pallas_call``'s ``input_output_aliases``; XLA copies an input that is
    still needed)."""
    tuning = tuning or DEFAULT_TUNING
    n = inputs[0].shape[0]
    # Inside shard_map (check_vma) every operand and result must carry the same varying axes.
    axes = varying_axes(*inputs)
    inputs = varying_like(inputs, *inputs)
    mat = jax.sharding.ManualAxisType(varying=axes)

    def call(interpret: bool, typed: bool = True) -> Callable[..., tuple[Array, ...]]:
        block_rows, block_vocab = block_shape(tuning, n, n_cols, on_gpu=not interpret)
        row_blocks = pl.cdiv(n, block_rows)
        kernel = functools.partial(
            _kernel, cfg=cfg, n_rows=n, n_cols=n_cols, vocab=vocab, block_rows=block_rows,
            block_vocab=block_vocab, mode=mode, fields=fields, programs=tuning.programs, compiled=not interpret,
        )
        return pl.pallas_call(
            kernel,
            out_shape=tuple(
                jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat if typed else None) for shape, dtype in out_shapes
            ),
            grid=(row_blocks if tuning.programs is None else min(row_blocks, tuning.programs),),
            input_output_aliases=dict(aliases or {}),
            interpret=interpret,
            debug=tuning.debug,
            compiler_params=plgpu.CompilerParams(num_warps=_num_warps(cfg, tuning), num_stages=tuning.num_stages),
            name=f"jaxloss_{cfg.kind}_{mode}",
        )

    def interpreted(*inputs: Array) -> tuple[Array, ...]:
        if not axes:
            return tuple(call(True)(*inputs))
        return _interpret_in_shard_map(call(True, typed=False), inputs, axes)

    def run(*inputs: Array) -> tuple[Array, ...]:
        if tuning.interpret is not None:
            return tuple(interpreted(*inputs) if tuning.interpret else call(False)(*inputs))
        # Decided when lowering, per platform: the Triton kernel for CUDA/ROCm, interpret mode
        # elsewhere. So a CPU host can also export or cross-compile the GPU kernel.
        return tuple(lax.platform_dependent(*inputs, cuda=call(False), rocm=call(False), default=interpreted))

    # The kernels are never differentiated by the losses' first-order custom_vjp; a higher-order
    # derivative would differentiate pallas_call (a bare AssertionError in JAX 0.10): refuse.
    return tuple(no_derivatives(run, HIGHER_ORDER_MESSAGE)(*inputs))


def _interpret_in_shard_map(kernel: Callable[..., tuple[Array, ...]], inputs: tuple[Array, ...], axes: frozenset) -> tuple[Array, ...]:
    """Run an interpret-mode ``kernel`` on operands that vary over the manual mesh ``axes``.

    Pallas' interpreter evaluates the kernel's jaxpr (traced without varying-axes types) on
    the varying operands, which ``shard_map``'s default ``check_vma=True`` rejects (JAX 0.10.2:
    "Primitive gather requires varying manual axes to match ... open an issue"). The kernel is
    per device and needs no collective, so it runs inside a nested ``shard_map`` over no further
    axes with ``check_vma=False`` (operands re-typed as device-local by a no-op add there),
    and its results are typed as varying over ``axes`` again (``pcast``, a no-op at run time).
    The Triton lowering (GPU) needs none of this: it takes the typed operands directly.
    """
    from jax.sharding import PartitionSpec

    def local(*args: Array) -> tuple[Array, ...]:
        # Under check_vma=False a primitive's result carries no varying axes.
        return tuple(kernel(*(a + jnp.zeros((), a.dtype) for a in args)))

    outs = jax.shard_map(
        local, mesh=jax.sharding.get_abstract_mesh(), in_specs=PartitionSpec(), out_specs=PartitionSpec(),
        axis_names=frozenset(), check_vma=False,
    )(*inputs)
    return tuple(lax.pcast(out, tuple(sorted(axes)), to="varying") for out in outs)


def _target_operand(cfg: KernelConfig, target: Array) -> Array:
    """The kernel's ``t`` operand: ``entropy`` has no target (an empty ``[N, 0]`` stand-in, which
    the interpreter cannot block), so it gets ``[N]`` zeros that the kernel never reads."""
    if cfg.is_ce or cfg.has_teacher:
        return target
    return jnp.zeros(target.shape[:1], jnp.int32)


def fused(
    cfg: KernelConfig,
    x: Array,
    target: Array,
    coef: Array,
    *,
    with_grad: bool = True,
    tuning: Optional[Tuning] = None,
    inplace: bool = False,
    keep_final: bool = False,
    mode: str = "fused",
) -> tuple[Any, ...]:
    """Per-token loss ``[N]`` fp32 (0 where ``coef == 0``, not multiplied by ``coef``) and the
    gradient ``coef * c * dl/dz`` ``[N, V]`` in the logits' dtype (see :func:`jaxloss.backends.xla.fused`);
    with ``keep_final`` also the rows' :class:`Final` statistics (the fields of
    :func:`lossspec.final_used`, ``[N]`` fp32; a row with ``coef == 0`` holds no meaningful
    values), which :func:`shard_grad` reads back.

    The kernel always writes the gradient; ``with_grad=False`` only drops it. ``inplace``: the
    gradient is written into the buffer of ``x`` (``input_output_aliases``): no new logits-sized
    buffer where ``x`` dies at this call (an intermediate under ``jax.jit``, or donated); where it
    is still needed XLA copies it first. Each block of columns is read by both passes before pass 2
    overwrites it, so the aliased kernel computes the same numbers. (The "stats" and "grad" modes
    are :func:`shard_stats` and :func:`shard_grad`.)
    """
    if mode != "fused":
        raise NotImplementedError(f"kernel mode {mode!r} in fused(); the modes are {', '.join(MODES)} "
                                  "(\"stats\": shard_stats, \"grad\": shard_grad)")
    n, vocab = x.shape
    fields = lossspec.final_used(cfg) if keep_final else ()
    if n == 0:
        outs: tuple[Array, ...] = (jnp.zeros((0,), F32), *(jnp.zeros((0,), F32) for _ in fields), jnp.zeros(x.shape, x.dtype))
    else:
        out_shapes = (((n,), F32), *(((n,), F32) for _ in fields), ((n, vocab), x.dtype))
        outs = _call(cfg, "fused", (x, _target_operand(cfg, target), coef), out_shapes, n_cols=vocab, vocab=vocab, fields=fields,
                     tuning=tuning, aliases={0: len(out_shapes) - 1} if inplace else None)
    loss, grad = outs[0], (outs[-1] if with_grad else None)
    if keep_final:
        return loss, grad, Final(**dict(zip(fields, outs[1:-1])))
    return loss, grad


def stats_fields(cfg: KernelConfig) -> tuple[str, ...]:
    """The :class:`Stats` fields a kind uses (the others stay ``None``)."""
    template = empty_stats(cfg, 1)
    return tuple(name for name in Stats._fields if getattr(template, name) is not None)


def shard_stats(cfg: KernelConfig, x: Array, target: Array, *, tuning: Optional[Tuning] = None) -> Stats:
    """Mode "stats": pass 1 only, the per-row :class:`Stats` ``[N]`` of ``x`` ``[N, V_local]``
    relative to its own maxima (a vocab-parallel shard; ``target``: shifted labels or the
    teacher's slice). No collective; :mod:`jaxloss.backends.vocab_parallel` combines the shards."""
    n, width = x.shape
    fields = stats_fields(cfg)
    outs = _call(cfg, "stats", (x, _target_operand(cfg, target)), tuple(((n,), F32) for _ in fields), n_cols=width, vocab=width,
                 fields=fields, tuning=tuning)
    return Stats(**dict(zip(fields, outs)))


def shard_grad(
    cfg: KernelConfig, fin: Final, x: Array, target: Array, coef: Array, *, vocab: int,
    tuning: Optional[Tuning] = None,
) -> Array:
    """Mode "grad": pass 2 only, ``coef * c * dl/dz`` ``[N, V_local]`` (logits' dtype) of this
    shard from the global :class:`Final` statistics; ``vocab`` is the global ``V``."""
    n, width = x.shape
    if n == 0 or width == 0:  # no program to launch (the 16-bit backward of an empty batch traces this)
        return jnp.zeros(x.shape, x.dtype)
    fields = tuple(name for name in Final._fields if getattr(fin, name) is not None)
    values = tuple(getattr(fin, name).astype(F32) for name in fields)
    (grad,) = _call(cfg, "grad", (x, _target_operand(cfg, target), coef, *values), (((n, width), x.dtype),), n_cols=width, vocab=vocab,
                    fields=fields, tuning=tuning)
    return grad
