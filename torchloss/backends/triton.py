"""The Triton path (``impl="triton"``): Python drivers of the kernels in :mod:`torchloss.backends.triton_kernels`.

Interface (the torch driver, ``torchloss.api`` and the vocab-parallel code, calls these)::

    loss [N] (compute dtype), grad [N, V] (logits dtype) or None
        = forward(config, logits [N, V], target, coef [N], need_grad=True, out=None, final=None)
    grad = regrad_(config, logits, target, coef, upstream [1] or [N], grad, final=final)
    Stats = shard_stats(config, logits [N, V_local], target, coef, offset)
    out = shard_grad(config, fin: Final, logits [N, V_local], target, coef, offset, vocab, out)

``target``: the safe int64 labels ``[N]`` (0 where the token is invalid; global ids for the shard
functions) or the teacher logits (same shape as ``logits``). ``grad = coef * c * dl/dz``, rounded
once to the logits' dtype; the loss is 0 where ``coef == 0`` (not multiplied by ``coef``).
Everything is computed in fp32 (fp64 for fp64 logits). The formulation is :mod:`lossspec.stats`;
``Stats`` / ``Final`` are ``torchloss._block``' records: the caller combines the shards'
statistics (``torchloss._block.combine``), finalises them (``torchloss._block.finalize``) and
hands the result to :func:`shard_grad`. ``final``: a :func:`final_buffer` that :func:`forward`
fills with each row's final statistics (:data:`KEEPS_FINAL`), so that :func:`regrad_` runs the
gradient pass alone.

Kernels: one per job (``fused_kernel``, ``regrad_kernel``, ``shard_stats_kernel``,
``shard_grad_kernel``), one program per row (the fused and regrad kernels: ``tuning.programs``
persistent programs instead, :func:`programs`), vocabulary blocks of up to ``tuning.vocab_block``
(:data:`DEFAULTS`) columns, loops pipelined ``tuning.num_stages`` deep (:func:`stages`); see
``docs/triton_kernels.md``.

On a machine without CUDA this module sets ``TRITON_INTERPRET=1`` (unless set already) before the
kernels are defined, so the same kernels run on CPU tensors through the Triton interpreter (slow:
for tests). The interpreter is not thread-safe (it patches ``triton.language`` while a kernel
runs), so interpreted launches are serialised by a module-level lock.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor

if not torch.cuda.is_available():
    # Must precede the @triton.jit definitions: the decorator picks the interpreter then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import lossspec  # noqa: E402
from lossspec import LossConfig, Tuning  # noqa: E402
from lossspec.tuning import check_power_of_two  # noqa: E402

from . import triton_kernels as K  # noqa: E402
from .._block import Final, Stats, compute_dtype  # noqa: E402

__all__ = ["forward", "regrad_", "final_buffer", "shard_stats", "shard_grad", "INTERPRETED", "DEFAULTS", "KEEPS_FINAL"]

#: The forward keeps each row's final statistics (``forward(..., final=final_buffer(...))``) for
#: the 16-bit backward (:func:`regrad_`): a non-unit upstream gradient then costs the gradient
#: pass alone (one read of the logits, and of the teacher, and one write), not both passes again.
KEEPS_FINAL: bool = True

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Triton's own library functions (tl.max, tl.sum, ...) are interpreted only if the variable was
# set before triton was first imported.
_LANGUAGE_INTERPRETED: bool = type(tl.max).__name__ == "InterpretedFunction"
# The default of lossspec.Tuning.vocab_block here: the largest vocabulary block of one loop
# iteration (a power of two). Tests pass a smaller one (tuning=) to run the block loop and the
# ragged tail on small vocabularies. (num_warps: see num_warps below.)
DEFAULTS = Tuning(vocab_block=1024 if INTERPRETED else 4096)

# Interpreted launches from two threads at once fail (the interpreter patches triton.language
# globally for the duration of a launch); compiled launches need no lock.
INTERPRETER_LOCK = threading.Lock()

_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}

# Let the compiler contract a * b + c into FMAs (Triton 3.9's default, stated so that 3.10's
# new default does not change the numbers): an FMA rounds once where a multiply-add rounds
# twice, e.g. at the label's entry of the cross-entropy gradient, e * (coef c / s) - coef c.
FP_FUSION: bool = True


def num_warps(block_v: int, job: str = "fused", softcap: bool = False) -> int:
    """Warps of one program (one row): ``block_v / 256`` within ``[4, 16]`` (16 at 4096 columns),
    except the fused kernel without soft caps: ``block_v / 512`` (8 at 4096). On an H200 (Triton
    3.6, 16384 x 131072 bf16, forward + backward) 8 warps beat 16 by 11% on cross-entropy and
    22% on reverse KL (``benchmarks/gpu_triton_sweep.py``; benchmarks/results/
    gpu_triton_sweep_a73ea56.json). Elsewhere 8 warps spill on sm_90 (``scripts/triton_aot_report.py``):
    ptxas caps them at 64-80 registers, which the soft-capped fused reverse KL exceeds (and the
    reverse-KL regrad kernel did while it ran pass 1 too); with 16 no kernel spills."""
    per_warp = 512 if (job == "fused" and not softcap) else 256
    return max(4, min(16, block_v // per_warp))


def block_size(width: int, tuning: Optional[Tuning] = None) -> int:
    """Columns per block: the vocabulary rounded up to a power of two, at most
    ``tuning.vocab_block`` (a power of two; default :data:`DEFAULTS`)."""
    vocab_block = (tuning or DEFAULTS).vocab_block or DEFAULTS.vocab_block
    return min(triton.next_power_of_2(max(width, 1)), check_power_of_two(vocab_block, "vocab_block", "triton"))  # type: ignore[arg-type]


def constexprs(
    job: str, config: LossConfig, logits_dtype: torch.dtype, block_v: int, *, write_grad: bool = True, write_final: bool = False,
    tuning: Optional[Tuning] = None,
) -> dict[str, Any]:
    """The ``tl.constexpr`` arguments of ``job``'s kernel for a call (shared with the AOT report,
    so that it compiles exactly what a launch specialises); ``tuning``'s ``num_stages`` and
    ``programs`` (:func:`stages`, :func:`programs`) where they are set."""
    out: dict[str, Any] = {
        "KIND": lossspec.KIND_IDS[config.kind],
        "SMOOTHING": config.kind == "cross_entropy" and config.label_smoothing > 0,
        # The soft caps are compiled in only when set (their values are runtime parameters).
        "SOFTCAP": config.logit_softcap is not None,
        "TEACHER_SOFTCAP": config.teacher_logit_softcap is not None,
    }
    if job != "shard_stats":
        out["Z_LOSS"] = config.kind == "cross_entropy" and config.z_loss > 0
    if job == "fused":
        out["WRITE_GRAD"] = write_grad
        out["WRITE_FINAL"] = write_final
    if job != "shard_stats":
        # bf16 rounded to nearest even by hand only where the cast cannot (the interpreter's
        # truncates); compiled, the cast's cvt.rn.bf16.f32 rounds the same bits.
        out["ROUND_BF16"] = logits_dtype == torch.bfloat16 and INTERPRETED
    out["BLOCK_V"] = block_v
    if job in ("fused", "shard_stats"):
        # The columns of one lane of the statistics passes (triton_kernels._stats_block): one
        # 16-byte load, which one thread holds and reduces alone.
        out["VEC"] = min(16 // logits_dtype.itemsize, block_v)
    out["ACC"] = _TL_DTYPES[compute_dtype(logits_dtype)]
    out["STAGES"] = stages(tuning)
    if job in PERSISTENT_JOBS:
        out["PERSISTENT"] = programs(tuning) is not None
    return out


#: The kernels that can run persistent programs (``Tuning.programs``): the two full-row jobs.
PERSISTENT_JOBS = ("fused", "regrad")


def stages(tuning: Optional[Tuning]) -> int:
    """The software-pipelining depth of the vocabulary loops (``tl.range(..., num_stages=)``):
    ``tuning.num_stages``, default 1 (no pipelining: each block's loads are issued when the loop
    reaches it). With 2 or more the compiler issues the next blocks' loads as asynchronous copies
    into shared memory (``cp.async``, ``LDGSTS``) while a block is computed, one buffer per stage
    (``BLOCK_V`` x itemsize bytes per tensor read). Not yet timed on a GPU: 1 stays the default
    until ``benchmarks/gpu_triton_sweep.py`` measures otherwise."""
    return (tuning.num_stages if tuning is not None else None) or 1


def programs(tuning: Optional[Tuning]) -> Optional[int]:
    """``tuning.programs``: the programs of the fused and regrad kernels, each taking every
    ``programs``-th row in turn (``None``, the default: one program per row). Fewer rows in
    flight at once let more of each row's second read come from L2; a few times the GPU's
    multiprocessor count is the range to try (``benchmarks/gpu_triton_sweep.py``)."""
    return tuning.programs if tuning is not None else None


KERNELS: dict[str, Any] = {
    "fused": K.fused_kernel,
    "regrad": K.regrad_kernel,
    "shard_stats": K.shard_stats_kernel,
    "shard_grad": K.shard_grad_kernel,
}


@functools.lru_cache(maxsize=64)
def _params(
    c: float, ct: float, eps: float, lam: float, beta: float, cap: float, teacher_cap: float, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``[c, ct, eps, lam, beta, log(beta), log(1 - beta), cap, teacher_cap]`` (order ``_triton_kernels.PARAMS``) on
    the device, in the compute dtype (exact for fp64; the logs in float64 on the host, then
    rounded once). Cached: a fresh host-to-device copy per call would synchronise the host."""
    log_beta = math.log(beta) if beta > 0 else float("-inf")  # only jensen_shannon (0 < beta < 1) reads them
    log_rest = math.log1p(-beta) if beta < 1 else float("-inf")
    values = {"c": c, "ct": ct, "eps": eps, "lam": lam, "beta": beta, "log_beta": log_beta, "log_rest": log_rest,
              "cap": cap, "teacher_cap": teacher_cap}
    return torch.tensor([values[name] for name in K.PARAMS], dtype=dtype, device=device)


def params_for(config: LossConfig, acc: torch.dtype, device: torch.device) -> Tensor:
    # A cap that is off is never read (its constexpr is False): 1.0 stands in.
    cap = 1.0 if config.logit_softcap is None else config.logit_softcap
    teacher_cap = 1.0 if config.teacher_logit_softcap is None else config.teacher_logit_softcap
    return _params(config.student_scale, config.teacher_scale, config.label_smoothing, config.z_loss, config.beta, cap, teacher_cap, acc, device)


def check_runnable(logits: Tensor) -> None:
    if logits.device.type == "cpu" and not (INTERPRETED and _LANGUAGE_INTERPRETED):
        raise RuntimeError(
            "impl='triton' on CPU tensors needs the Triton interpreter, enabled before triton is first "
            "imported: set TRITON_INTERPRET=1 in the environment, or import torchloss before anything that "
            "imports triton (torch._dynamo does); torchloss sets it itself when CUDA is unavailable"
        )


def _unit_stride(name: str, tensor: Tensor) -> None:
    if tensor.numel() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"the Triton kernels need a unit stride along the vocabulary ({name})")


def _launch(
    job: str, config: LossConfig, logits: Tensor, args: tuple, *, write_grad: bool = True, write_final: bool = False, tuning: Optional[Tuning] = None
) -> None:
    """Launch ``job``'s kernel over the rows of ``logits`` with the positional ``args``, with the
    :class:`lossspec.Tuning` fields ``vocab_block`` (:func:`block_size`), ``num_warps``
    (default :func:`num_warps`), ``num_stages`` (:func:`stages`) and ``programs``
    (:func:`programs`: the grid of the fused and regrad kernels) of ``tuning``."""
    rows, width = logits.shape
    block_v = block_size(width, tuning)
    kernel: Callable[..., Any] = KERNELS[job]
    meta = constexprs(job, config, logits.dtype, block_v, write_grad=write_grad, write_final=write_final, tuning=tuning)
    grid = (min(rows, programs(tuning)),) if meta.get("PERSISTENT") else (rows,)
    # The interpreter evaluates masked lanes with NumPy (-inf - -inf, 0 * inf) and would warn about
    # values the kernel discards by design; and it must run one launch at a time.
    guard = contextlib.ExitStack()
    if INTERPRETED:
        guard.enter_context(np.errstate(all="ignore"))
        guard.enter_context(INTERPRETER_LOCK)
    with guard:
        warps = (tuning.num_warps if tuning is not None else None) or num_warps(block_v, job, meta["SOFTCAP"] or meta["TEACHER_SOFTCAP"])
        kernel[grid](*args, **meta, num_warps=warps, enable_fp_fusion=FP_FUSION)


def _teacher_and_labels(config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor) -> tuple[Tensor, Tensor]:
    """``(teacher, labels)`` pointers of a launch; the unused one is a dummy of the right kind
    (the kernels never read it)."""
    if config.kind == "cross_entropy":
        return logits, target
    if not config.is_distill:  # entropy: no target at all
        return logits, coef
    _unit_stride("teacher_logits", target)
    return target, coef


def forward(
    config: LossConfig,
    logits: Tensor,
    target: Tensor,
    coef: Tensor,
    *,
    need_grad: bool = True,
    out: Tensor | None = None,
    final: Tensor | None = None,
    tuning: Optional[Tuning] = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token loss ``[N]`` (compute dtype; 0 where ``coef == 0``) and, with ``need_grad``, the
    gradient ``coef * c * dl/dz`` ``[N, V]`` in the logits' dtype (written into ``out`` when
    given; ``out`` may be ``logits`` itself). ``final``: a :func:`final_buffer` of these logits,
    where each row with ``coef != 0`` also leaves its final statistics for :func:`regrad_`.
    One ``fused_kernel`` launch."""
    check_runnable(logits)
    _unit_stride("logits", logits)
    rows, width = logits.shape
    acc = compute_dtype(logits.dtype)
    device = logits.device
    loss = torch.empty(rows, dtype=acc, device=device)
    grad = None
    if need_grad:
        grad = out if out is not None else torch.empty((rows, width), dtype=logits.dtype, device=device)
        _unit_stride("out", grad)
    if rows == 0:
        return loss, grad
    teacher, labels = _teacher_and_labels(config, logits, target, coef)
    grad_arg = grad if grad is not None else logits  # a pointer of the logits' dtype, never written
    if final is not None:
        _check_final(final, rows, acc)
    fin_arg = final if final is not None else loss  # a pointer of the compute dtype, never written
    args = (logits, teacher, labels, coef.to(acc), params_for(config, acc, device), loss, grad_arg, fin_arg,
            rows, width, logits.stride(0), teacher.stride(0), grad_arg.stride(0), fin_arg.stride(0))
    _launch("fused", config, logits, args, write_grad=grad is not None, write_final=final is not None, tuning=tuning)
    return loss, grad


def final_buffer(logits: Tensor) -> Tensor:
    """An uninitialised ``[len(lossspec.FINAL_STATS), N]`` buffer in the compute dtype of
    ``logits`` ``[N, V]``, for :func:`forward`'s ``final`` (the layout of :func:`shard_grad`'s
    statistics: statistic-major, ``FINAL_STAT_INDEX[name]`` a row; a row of the logits whose
    ``coef`` is 0 leaves its column unwritten, and :func:`regrad_` never reads it)."""
    return torch.empty((len(lossspec.FINAL_STATS), logits.shape[0]), dtype=compute_dtype(logits.dtype), device=logits.device)


def _check_final(final: Tensor, rows: int, acc: torch.dtype) -> None:
    if final.shape != (len(lossspec.FINAL_STATS), rows) or final.dtype != acc or final.stride(1) != 1:
        raise ValueError(f"final must be a contiguous [{len(lossspec.FINAL_STATS)}, {rows}] {acc} buffer (final_buffer); "
                         f"got {tuple(final.shape)} {final.dtype}")


def regrad_(
    config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, upstream: Tensor, grad: Tensor, *, final: Optional[Tensor] = None,
    tuning: Optional[Tuning] = None,
) -> Tensor:
    """Rewrite ``grad`` as the gradient for the upstream gradient ``upstream`` (``[1]``, or ``[N]``
    per token, compute dtype), rounded once from the compute dtype: ``regrad_kernel`` reads
    ``upstream`` on the device (no host synchronisation) and rewrites only the rows where it is
    not exactly 1 (and ``coef != 0``), by the gradient pass alone from ``final``, the final
    statistics :func:`forward` left (required: ``forward(..., final=final_buffer(logits))``); the
    others keep the forward's values."""
    check_runnable(logits)
    rows, width = logits.shape
    if rows == 0 or width == 0:
        return grad
    if final is None:
        raise ValueError("the Triton regrad_ reads the forward's final statistics: pass final=, the buffer forward(..., final=) filled")
    acc = compute_dtype(logits.dtype)
    _unit_stride("logits", logits)
    _unit_stride("grad", grad)
    up = upstream.detach().to(acc).reshape(-1).contiguous()
    if up.numel() not in (1, rows):
        raise ValueError(f"upstream must hold 1 or {rows} values; got {up.numel()}")
    _check_final(final, rows, acc)
    teacher, labels = _teacher_and_labels(config, logits, target, coef)
    args = (logits, teacher, labels, coef.to(acc), up, params_for(config, acc, logits.device), final, grad,
            rows, width, logits.stride(0), teacher.stride(0), grad.stride(0), 0 if up.numel() == 1 else 1, final.stride(0))
    _launch("regrad", config, logits, args, tuning=tuning)
    return grad


def shard_stats(config: LossConfig, logits: Tensor, target: Tensor, coef: Tensor, offset: int, tuning: Optional[Tuning] = None) -> Any:
    """Vocab-parallel pass 1 (``shard_stats_kernel``): this shard's per-row statistics, a
    ``torchloss._block.Stats`` with the fields ``lossspec.stats_used(config)`` (the others
    ``None``), each a contiguous ``[N]`` tensor in the compute dtype, in lossspec's convention
    (raw maxima; ``m = -inf`` for a row that saw nothing).

    ``x_y`` is the label's raw logit where this shard (global ids ``[offset, offset + V_local)``)
    owns it, else 0; ``n = V_local`` with label smoothing. Rows with ``coef == 0`` hold the
    empty statistics (``torchloss._block.empty_stats``); a row with NaN or ``+inf`` has
    ``s = NaN``. No collective: the caller combines the shards (``torchloss._block.combine``)."""
    check_runnable(logits)
    _unit_stride("logits", logits)
    rows, width = logits.shape
    acc = compute_dtype(logits.dtype)
    device = logits.device
    buf = torch.empty((len(lossspec.ROW_STATS), rows), dtype=acc, device=device)
    if rows:
        teacher, labels = _teacher_and_labels(config, logits, target, coef)
        args = (logits, teacher, labels, coef.to(acc), params_for(config, acc, device), buf,
                width, offset, logits.stride(0), teacher.stride(0), buf.stride(0))
        _launch("shard_stats", config, logits, args, tuning=tuning)
    return Stats(**{name: buf[lossspec.ROW_STAT_INDEX[name]] for name in lossspec.stats_used(config)})


# Values of Final fields a kind does not compute (the kernel reads only the ones it uses).
_FINAL_DEFAULTS = {"q_coef": 1.0}


def shard_grad(
    config: LossConfig, fin: Final, logits: Tensor, target: Tensor, coef: Tensor, offset: int, vocab: int, out: Tensor,
    tuning: Optional[Tuning] = None,
) -> Tensor:
    """Vocab-parallel pass 2 (``shard_grad_kernel``): this shard's ``coef * c * dl/dz`` from the
    global statistics ``fin`` (a ``torchloss._block.Final`` from ``finalize(config, stats,
    vocab)``), rounded once into ``out``. Labels are global ids; ``vocab`` is the global ``V``.
    Rows with ``coef == 0`` are zeros, bad rows (``fin.s`` or ``fin.st`` NaN) NaN."""
    check_runnable(logits)
    _unit_stride("logits", logits)
    _unit_stride("out", out)
    rows, width = logits.shape
    if rows == 0 or width == 0:
        return out
    acc = compute_dtype(logits.dtype)
    device = logits.device
    final = final_buffer(logits)
    for name, i in lossspec.FINAL_STAT_INDEX.items():
        value = getattr(fin, name)
        if value is None:
            final[i].fill_(_FINAL_DEFAULTS.get(name, 0.0))
        else:
            final[i].copy_(value)
    teacher, labels = _teacher_and_labels(config, logits, target, coef)
    args = (logits, teacher, labels, coef.to(acc), params_for(config, acc, device), final, out,
            width, vocab, offset, logits.stride(0), teacher.stride(0), out.stride(0), final.stride(0))
    _launch("shard_grad", config, logits, args, tuning=tuning)
    return out

