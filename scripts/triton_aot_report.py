"""Compile every Triton kernel of ``torchloss`` ahead of time for sm_80 / sm_90 and report the
registers, shared memory and spills of each (no GPU needed: Triton's own ``ptxas``).

Usage::

    python scripts/triton_aot_report.py [--arch 80 90] [--jobs N] [--json PATH]

Each kernel is compiled exactly as ``torchloss.backends.triton`` would launch it on a GPU: the
constexprs of :func:`torchloss.backends.triton.constexprs` at the GPU block size (4096 columns, the
default ``vocab_block`` of ``torchloss.backends.triton.DEFAULTS`` on a GPU) and :func:`torchloss.backends.triton.num_warps`, for fp32 and bf16
logits and every kind (cross-entropy plain and with label smoothing + z-loss; three kinds with
the soft caps compiled in). Compilation runs
with ``TRITON_INTERPRET=0`` in worker processes; ``ptxas -v`` on the generated PTX gives the
registers and spill bytes, Triton's metadata the shared memory. Exit status 1 if anything spills.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's lossspec (the kind table) and torchloss

import lossspec  # noqa: E402  (NumPy only)

GPU_BLOCK_V = 4096  # the default vocab_block of torchloss.backends.triton (DEFAULTS) when compiled for a GPU
JOBS = ("fused", "regrad", "shard_stats", "shard_grad")
DTYPES = ("float32", "bfloat16")
# (label, kind, options): every kind; cross-entropy also with its optional terms compiled in.
VARIANTS = (
    ("cross_entropy", "cross_entropy", {}),
    ("cross_entropy+ls+z", "cross_entropy", {"label_smoothing": 0.1, "z_loss": 1e-4}),
    ("soft_cross_entropy", "soft_cross_entropy", {}),
    ("forward_kl", "forward_kl", {}),
    ("reverse_kl", "reverse_kl", {}),
    ("entropy", "entropy", {}),
    ("jensen_shannon", "jensen_shannon", {"beta": 0.5}),
    # The soft caps compiled in (the student's alone; both, on the kinds with the most live values).
    ("cross_entropy+softcap", "cross_entropy", {"logit_softcap": 30.0}),
    ("reverse_kl+softcaps", "reverse_kl", {"logit_softcap": 30.0, "teacher_logit_softcap": 50.0}),
    ("jensen_shannon+softcaps", "jensen_shannon", {"beta": 0.5, "logit_softcap": 30.0, "teacher_logit_softcap": 50.0}),
)
ARCHS = (80, 90)
# The fused LM head's kernels (torchloss.backends.triton_head) at their GPU tiles, with a bias (and a
# teacher bias): the variants of the kinds with a head (the kind table's ``head``).
HEAD_JOBS = ("head_forward", "head_dh", "head_dw")
HEAD_VARIANTS = tuple(v for v in VARIANTS if lossspec.KIND_SPECS[v[1]].head)
# The bf16 matmul kernel (torchloss.backends.triton_matmul) in the three layouts the fused head launches
# it with (bf16 operands): variant -> (A's dtype, unit-stride arguments, ACCUMULATE).
#   logits  z = h W^T        A = h [R, H] bf16, B = W^T (a view: unit stride along K)
#   grad_h  dh (+)= G W      A = G [R, B] fp32 (split), B = W rows [B, H]
#   grad_w  dW += G^T h      A = G^T (a view: unit stride along M), B = h [R, H]
MATMUL_JOBS = ("matmul",)
MATMUL_VARIANTS = {
    "logits": ("bfloat16", ("stride_ak", "stride_bk", "stride_cn"), False),
    "grad_h": ("float32", ("stride_ak", "stride_bn", "stride_cn"), True),
    "grad_w": ("float32", ("stride_am", "stride_bn", "stride_cn"), True),
}
# Shared memory per block: the loss and head kernels stay under the 48 KB every launch gets; the
# matmul's pipelined stages take more, which Triton requests (at most 163 KB on sm_80, 227 KB on
# sm_90).
MAX_SHARED = {80: 166912, 90: 232448}


def tasks(archs: tuple[int, ...] = ARCHS) -> list[tuple[str, str, str, int]]:
    """Every ``(job, variant, dtype, arch)`` compiled, in the report's order."""
    out = []
    for arch in archs:
        for jobs, variants in ((JOBS, VARIANTS), (HEAD_JOBS, HEAD_VARIANTS)):
            out += [(job, variant[0], dtype, arch) for job in jobs for variant in variants for dtype in DTYPES]
        out += [(job, variant, "bfloat16", arch) for job in MATMUL_JOBS for variant in MATMUL_VARIANTS]
    return out

_TL_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


@dataclasses.dataclass
class Row:
    job: str
    variant: str
    dtype: str
    arch: int
    num_warps: int
    registers: int
    shared: int
    stack: int
    spill_stores: int
    spill_loads: int


def _signature(job: str, kind: str, dtype: str) -> tuple[dict[str, str], dict]:
    """Argument types and alignment attributes of ``job``'s kernel, as a launch on a GPU
    specialises them: pointer element types by role, 16-byte aligned pointers, 32-bit integers
    divisible by 16."""
    from torchloss.backends import triton as _triton

    kernel = _triton.KERNELS[job]
    logits = "*" + _TL_NAMES[dtype]
    pointer_types = {
        "x_ptr": logits,
        "t_ptr": logits,  # teacher logits, or the logits as a dummy (cross-entropy)
        "y_ptr": "*i64" if kind == "cross_entropy" else "*fp32",  # labels, or coef as a dummy
        "grad_ptr": logits,
    }
    signature: dict[str, str] = {}
    attrs = {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        else:
            signature[name] = "i32"
            if name != "stride_up":  # 0 or 1 (1 is specialised to a constant)
                # Like a launch with V, strides and offsets multiples of 16 (32000, 128256, ...):
                # Triton specialises such integers, which lets it vectorise the row loads.
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _head_signature(job: str, kind: str, dtype: str) -> tuple[dict[str, str], dict]:
    """As :func:`_signature` for the head kernels: the hidden states, weights and biases in the
    inputs' dtype, labels int64, the soft caps fp32 scalars, everything else fp32 buffers."""
    from torchloss.backends import triton_head as _triton_linear

    inputs = "*" + _TL_NAMES[dtype]
    pointer_types = {name: inputs for name in ("h_ptr", "w_ptr", "b_ptr", "th_ptr", "tw_ptr", "tb_ptr")}
    pointer_types["y_ptr"] = "*i64" if lossspec.KIND_SPECS[kind].has_labels else "*fp32"
    signature: dict[str, str] = {}
    attrs = {}
    for i, param in enumerate(_triton_linear.KERNELS[job].params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("cap", "t_cap"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _compile_head(job: str, kind: str, options: dict, dtype: str, arch: int) -> tuple[Any, int]:
    """``(compiled, num_warps)`` of a head kernel as ``torchloss.backends.triton_head`` launches it on a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torchloss.backends import triton as _triton, triton_head as _triton_linear

    config = lossspec.make_config(kind, **options)
    constants = _triton_linear.constexprs(config, True, config.is_distill, _triton_linear.GPU_BLOCKS)
    signature, attrs = _head_signature(job, kind, dtype)
    warps = _triton_linear.GPU_BLOCKS[3]
    src = ASTSource(fn=_triton_linear.KERNELS[job], signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "enable_fp_fusion": _triton.FP_FUSION,
                                                                              "maxnreg": _triton_linear.MAXNREG})
    return compiled, warps


def _compile_matmul(variant: str, arch: int) -> tuple[Any, int]:
    """``(compiled, num_warps)`` of the matmul kernel as ``torchloss.backends.triton_matmul`` launches it on
    a GPU for ``variant`` (:data:`MATMUL_VARIANTS`): unit strides specialised to the constant 1,
    the other integers divisible by 16 (H, V and chunk sizes of real heads)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lossspec import linear as spec_linear
    from torchloss.backends import triton as _triton, triton_matmul as _triton_matmul

    a_dtype, unit, accumulate = MATMUL_VARIANTS[variant]
    split = 1 if a_dtype == "bfloat16" else spec_linear.HEAD_SPLIT_TERMS
    tiles = _triton_matmul.GPU_BLOCKS[a_dtype]
    constants = _triton_matmul.constexprs(split, accumulate, tiles)
    constants["UPCAST"] = False  # compiled, not interpreted
    pointer_types = {"a_ptr": "*" + _TL_NAMES[a_dtype], "b_ptr": "*bf16", "c_ptr": "*fp32"}
    signature: dict[str, str] = {}
    attrs = {}
    for i, param in enumerate(_triton_matmul._matmul_kernel.params):
        name = param.name
        if param.is_constexpr or name in unit:
            signature[name] = "constexpr"
            if name in unit:
                constants[name] = 1
        elif name.endswith("_ptr"):
            signature[name] = pointer_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=_triton_matmul._matmul_kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": tiles[4], "num_stages": tiles[5], "enable_fp_fusion": _triton.FP_FUSION}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options), tiles[4]


def compile_one(job: str, variant: str, dtype: str, arch: int) -> Row:
    """Compile one kernel (in a worker process with ``TRITON_INTERPRET=0``) and read its resources."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import lossspec
    from torchloss.backends import triton as _triton

    assert not _triton.INTERPRETED, "the AOT report must run with TRITON_INTERPRET=0"
    label, kind, options = next((v for v in VARIANTS if v[0] == variant), (variant, "", {}))
    if job in MATMUL_JOBS:
        compiled, warps = _compile_matmul(variant, arch)
    elif job in HEAD_JOBS:
        compiled, warps = _compile_head(job, kind, options, dtype, arch)
    else:
        config = lossspec.make_config(kind, **options)
        constants = _triton.constexprs(job, config, getattr(torch, dtype), GPU_BLOCK_V)
        signature, attrs = _signature(job, kind, dtype)
        warps = _triton.num_warps(GPU_BLOCK_V, job, constants["SOFTCAP"] or constants["TEACHER_SOFTCAP"])
        kernel = _triton.KERNELS[job]
        src = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "enable_fp_fusion": _triton.FP_FUSION})
    # ptxas -v as Triton runs it (same binary, architecture name and flags), for its resource report.
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(arch).path
    flags = ["--regAllocOptLevel=2"] + ([] if _triton.FP_FUSION else ["--fmad=false"])
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        cmd = [ptxas, "-v", *flags, f"--gpu-name={sm_arch_from_capability(arch)}", str(ptx), "-o", str(Path(tmp) / "kernel.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    info = out.stderr + out.stdout

    def number(pattern: str) -> int:
        found = re.search(pattern, info)
        return int(found.group(1)) if found else 0

    return Row(job, variant, dtype, arch, warps, number(r"Used (\d+) registers"), int(compiled.metadata.shared),
               number(r"(\d+) bytes stack frame"), number(r"(\d+) bytes spill stores"), number(r"(\d+) bytes spill loads"))


def _worker_init() -> None:
    os.environ["TRITON_INTERPRET"] = "0"
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's torchloss, not an installed one


def report(archs: tuple[int, ...] = ARCHS, jobs: int = 2) -> list[Row]:
    """Compile every (kernel, kind, dtype, arch) in ``jobs`` processes; rows in a fixed order."""
    todo = tasks(archs)
    # Fresh processes (spawn): triton must be imported with TRITON_INTERPRET=0.
    env_before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init) as pool:
            return list(pool.map(compile_one, *zip(*todo)))
    finally:
        if env_before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env_before


def markdown(rows: list[Row]) -> str:
    """The table of ``docs/triton_kernels.md``: one line per (kernel, kind, dtype), both archs."""
    archs = sorted({r.arch for r in rows})
    head = "| kernel | kind | logits | warps | " + " | ".join(f"sm_{a} regs / smem / spill st+ld" for a in archs) + " |"
    lines = [head, "|" + "---|" * (4 + len(archs))]
    index = {(r.job, r.variant, r.dtype, r.arch): r for r in rows}
    for job, variant, dtype in dict.fromkeys((j, v, d) for j, v, d, _ in tasks(tuple(archs))):
        cells = []
        warps = None
        for a in archs:
            r = index.get((job, variant, dtype, a))
            if r is None:
                cells.append("-")
                continue
            warps = r.num_warps
            cells.append(f"{r.registers} / {r.shared} B / {r.spill_stores}+{r.spill_loads} B")
        lines.append(f"| `{job}` | {variant} | {dtype} | {warps} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    rows = report(tuple(args.arch), args.jobs)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    print(f"BLOCK_V = {GPU_BLOCK_V}, Triton's ptxas; spill = spill stores + spill loads (bytes)\n")
    print(markdown(rows))
    spilled = [r for r in rows if r.spill_stores or r.spill_loads]
    for r in spilled:
        print(f"SPILL: {r}", file=sys.stderr)
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
