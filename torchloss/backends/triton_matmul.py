"""bf16 matmuls with fp32 results on tensor cores for the fused head on CUDA (no jaxloss twin: XLA's dot takes bf16 operands).

The fused LM head (:mod:`torchloss.head`) multiplies bf16 ``hidden`` and ``weight`` with fp32
results, and the backward's fp32 logits gradient ``G`` with the bf16 operands. torch has no fast
primitive for either (``torch.mm(..., out_dtype=torch.float32)`` ran at ~20 TFLOP/s on an H200 with
torch 2.11, no faster than fp32 GEMMs; docs/linear_head.md), so this module has one Triton kernel::

    C (+)= A @ B        A [M, K] bf16, or fp32 split into SPLIT exact bf16 terms (in registers)
                        B [K, N] bf16, C [M, N] fp32 (ACCUMULATE: C + A @ B, one rounding)

Every product of two bf16 numbers is exact in fp32 (16 significant bits), and the tiles'
products are accumulated in fp32 by ``tl.dot``: the numbers of an fp32 matmul of the exact
upcasts, up to the order of the fp32 sums. An fp32 ``A`` (the logits gradient) is split on the fly
as :func:`torchloss.head.split_bf16` does in memory: ``SPLIT - 1`` times the remainder's top 8
significant bits (its low 16 bits masked off, exact in bf16), then the rest; three terms carry
the whole 24-bit significand, so the products stay exact and the cost is three tensor-core dots.

Tiles ``[BLOCK_M, BLOCK_N]`` of ``C``, one per program, in grouped order (``GROUP_M`` row tiles
share the column tiles of ``B`` while they are in L2); the reduction over ``K`` runs in one fixed
order in one program, so two runs give the same bits (no split-K, no atomics, no autotuning: a
timing-picked tile size would change the summation order from run to run). Offsets are int64.
Any strides: transposed operands (``G^T``, ``W^T``) are views.

On CPU tensors the kernel runs in the Triton interpreter (``torchloss.backends.triton`` decides that),
which the tests use at small tiles (:data:`INTERPRETER_BLOCKS`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from . import triton as _triton  # first: it decides TRITON_INTERPRET before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lossspec import linear as spec_linear  # noqa: E402

__all__ = ["matmul_f32", "GPU_BLOCKS", "INTERPRETER_BLOCKS"]


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` of bf16 tiles; ``UPCAST`` (the interpreter, whose ``tl.dot`` multiplies
    bf16 bit patterns as integers in Triton 3.9): the same exact products from fp32 upcasts."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _dot_terms(a, b, acc, SPLIT: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with ``b`` bf16 and ``a`` as ``SPLIT`` bf16 terms: ``SPLIT - 1`` masked heads of
    the remainder, then the rest (exact for fp32 ``a`` with 3 terms); one term is ``a`` itself for
    bf16 ``a``."""
    if SPLIT == 1:
        acc = _dot(a.to(tl.bfloat16), b, acc, UPCAST)
    else:
        rest = a
        for _ in tl.static_range(SPLIT - 1):
            head = (rest.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
            acc = _dot(head.to(tl.bfloat16), b, acc, UPCAST)
            rest = rest - head
        acc = _dot(rest.to(tl.bfloat16), b, acc, UPCAST)
    return acc


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    SPLIT: tl.constexpr, ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``C (+)= A @ B`` (module docstring)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: consecutive programs walk GROUP_M row tiles down one column of tiles.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    row_ok = rows < M
    col_ok = cols < N
    a_rows = a_ptr + rows[:, None] * stride_am
    b_cols = b_ptr + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot_terms(a, b, acc, SPLIT, UPCAST)
    out = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    out_ok = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc = tl.load(out, mask=out_ok, other=0.0) + acc
    tl.store(out, acc, mask=out_ok)


#: ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)`` per dtype of ``A`` on a GPU (the
#: Triton matmul tutorial's Hopper / Ampere shapes: 128 x 128 tiles, 8 warps; the fp32 ``A`` of
#: a split product takes a shorter ``K`` slice so that its stages fit the shared memory;
#: registers, shared memory and spills: ``scripts/triton_aot_report.py``), and in the interpreter
#: (small: the tests' shapes take several tiles of every axis and ragged tails).
GPU_BLOCKS: dict[str, tuple[int, int, int, int, int, int]] = {"bfloat16": (128, 128, 64, 8, 8, 3), "float32": (128, 128, 32, 8, 8, 3)}
INTERPRETER_BLOCKS: tuple[int, int, int, int, int, int] = (16, 16, 16, 2, 1, 1)


def blocks(a_dtype: str) -> tuple[int, int, int, int, int, int]:
    """The tiles of a launch whose ``A`` has dtype ``a_dtype`` (``"bfloat16"``, or ``"float32"``
    split into terms: :data:`GPU_BLOCKS`, or the interpreter's)."""
    return INTERPRETER_BLOCKS if _triton.INTERPRETED else GPU_BLOCKS[a_dtype]


def constexprs(split: int, accumulate: bool, tiles: tuple[int, ...]) -> dict[str, Any]:
    """The ``tl.constexpr`` arguments of a launch (shared with the AOT report)."""
    block_m, block_n, block_k, group_m = tiles[:4]
    return {"SPLIT": split, "ACCUMULATE": accumulate, "UPCAST": _triton.INTERPRETED, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m}


def matmul_f32(
    a: Tensor, b: Tensor, out: Optional[Tensor] = None, *, accumulate: bool = False, split_terms: int = spec_linear.HEAD_SPLIT_TERMS
) -> Tensor:
    """``a @ b`` in fp32 from bf16 ``b`` ``[K, N]`` and ``a`` ``[M, K]``: bf16 (each product exact), or
    fp32, multiplied as ``split_terms`` exact bf16 terms (``lossspec.HeadTuning.split_terms``,
    :data:`lossspec.linear.HEAD_SPLIT_TERMS` by default; fewer round it); the products are
    accumulated in fp32 on tensor cores.

    Returns ``out`` ``[M, N]`` fp32 (a new tensor when ``None``; any strides), holding ``a @ b``, or
    ``out + a @ b`` with ``accumulate``. Deterministic: the same bits run after run."""
    if b.dtype != torch.bfloat16 or a.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"matmul_f32 takes bf16 or fp32 a and bf16 b, got {a.dtype} and {b.dtype}")
    (m, k), (k_b, n) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"matmul_f32: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    _triton.check_runnable(a)
    if out is None:
        out = (torch.zeros if accumulate else torch.empty)((m, n), dtype=torch.float32, device=a.device)
    if out.shape != (m, n) or out.dtype != torch.float32:
        raise ValueError(f"matmul_f32: out must be fp32 {(m, n)}, got {out.dtype} {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out if accumulate else out.zero_()
    split = 1 if a.dtype == torch.bfloat16 else split_terms
    tiles = blocks("bfloat16" if a.dtype == torch.bfloat16 else "float32")
    grid = (triton.cdiv(m, tiles[0]) * triton.cdiv(n, tiles[1]),)
    guard = contextlib.ExitStack()
    if _triton.INTERPRETED:
        guard.enter_context(np.errstate(all="ignore"))
        guard.enter_context(_triton.INTERPRETER_LOCK)
    with guard:
        _matmul_kernel[grid](
            a, b, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            **constexprs(split, accumulate, tiles), num_warps=tiles[4], num_stages=tiles[5],
        )
    return out
