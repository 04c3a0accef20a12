"""Compile every Triton kernel of ``torchloss`` ahead of time for sm_80 / sm_90 and report the
registers, shared memory and spills of each (no GPU needed: Triton's own ``ptxas``).

Usage::

    python scripts/triton_aot_report.py [--arch 80 90] [--jobs N] [--json PATH]
    python scripts/triton_aot_report.py --instructions-only [--copy-rate 4.2] [--shape N V]
    python scripts/triton_aot_report.py --resources-only [--json PATH]   # no disassembly: the suite's check

Each kernel is compiled exactly as ``torchloss.backends.triton`` would launch it on a GPU: the
constexprs of :func:`torchloss.backends.triton.constexprs` at the GPU block size (4096 columns, the
default ``vocab_block`` of ``torchloss.backends.triton.DEFAULTS`` on a GPU) and :func:`torchloss.backends.triton.num_warps`, for fp32 and bf16
logits and every kind (cross-entropy plain and with label smoothing + z-loss; three kinds with
the soft caps compiled in). Compilation runs
with ``TRITON_INTERPRET=0`` in worker processes; ``ptxas -v`` on the generated PTX gives the
registers and spill bytes, Triton's metadata the shared memory. Exit status 1 if anything spills.

Instruction issue (the loss kernels; ``--instructions-only`` compiles just those, for sm_90, and
Liger-Kernel's cross-entropy): the cubin Triton built is disassembled (``cuobjdump -sass``, bundled
with Triton) and every loop is found from its back edge, a ``BRA`` to an address at or before its
own (a branch to itself, the end-of-function trap, is not a loop): the loop body is the
instructions from the target to the branch, counted statically (code behind a forward branch
inside the body counts as if always run, so the count is an upper bound where a body branches).
The loops that load from global memory (``LDG``) are the vocabulary passes of a valid row (pass
1, jensen_shannon's mixture pass, pass 2); a loop that only stores is the zero-row loop of masked
rows, left out. One iteration of a pass handles ``BLOCK_V`` columns with ``num_warps`` warps, so
each warp issues the body once per ``BLOCK_V / num_warps`` elements::

    warp-instructions per valid element = sum over the passes (body instructions) * num_warps / BLOCK_V

(the instructions before and after the loops are left out: they run once per row, which a long
row amortises). Barriers per block: the ``BAR`` instructions (``BAR.SYNC``, ``BAR.RED``, ...)
in the passes' bodies, i.e. the block-wide synchronisations one vocabulary block costs. These are
static counts of the compiled code, not GPU timings. The HBM model (:func:`hbm_bytes`): a valid
row reads its logits once per pass (two passes, three for jensen_shannon), the teacher's as often
on the distillation kinds, and writes the gradient once; a masked row writes zeros only; at a
copy rate (``--copy-rate``, TB/s) that is a floor on the time. The L2 model
(:func:`markdown_l2_model`, GH100's 132 multiprocessors and 50 MiB of L2): how much of the
gradient pass's read L2 can serve (pass 2 walks a row last block first) for one program per row
and for ``Tuning(programs=, num_stages=)``, the HBM bytes and floor that leaves, and whether the
loads in flight cover the latency (``--latency-ns``); a model to be checked on a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
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
# Shared memory per block: the loss kernels stay under the 48 KB every launch gets; the
# matmul's pipelined stages take more, which Triton requests (at most 163 KB on sm_80, 227 KB on
# sm_90).
MAX_SHARED = {80: 166912, 90: 232448}


def tasks(archs: tuple[int, ...] = ARCHS) -> list[tuple[str, str, str, int]]:
    """Every ``(job, variant, dtype, arch)`` compiled, in the report's order."""
    out = []
    for arch in archs:
        out += [(job, variant[0], dtype, arch) for job in JOBS for variant in VARIANTS for dtype in DTYPES]
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
    # The loss kernels' (and Liger's) vocabulary passes in the SASS (:func:`sass_loops`): the
    # columns of one iteration, each pass's body instructions and barriers (empty elsewhere).
    block_v: int = 0
    pass_instructions: list[int] = dataclasses.field(default_factory=list)
    pass_barriers: list[int] = dataclasses.field(default_factory=list)
    # Iterations of the vocabulary loop in each pass's body (ptxas unrolls a small body): its
    # 16-byte global loads over one iteration's (:func:`unroll_factor`); empty: 1 each.
    pass_unroll: list[int] = dataclasses.field(default_factory=list)

    @property
    def per_element(self) -> float:
        """Warp-instructions per valid element: each pass's body over the iterations it holds,
        once per ``block_v / num_warps`` elements."""
        if not self.block_v:
            return float("nan")
        unroll = self.pass_unroll or [1] * len(self.pass_instructions)
        return sum(n / max(k, 1) for n, k in zip(self.pass_instructions, unroll)) * self.num_warps / self.block_v


# Liger-Kernel's cross-entropy (liger_kernel.ops.cross_entropy, 0.8.5) as it launches on a Hopper
# GPU: BLOCK_SIZE = min(32768, next_power_of_2(V)) and 32 warps for every dtype (its
# cross_entropy_forward), mean reduction, no weights, no smoothing / z-loss / soft cap, gradients on.
LIGER_JOB = "liger"
LIGER_BLOCK = 32768
LIGER_WARPS = 32
# Vocabulary passes of a valid row per job: pass 1 (statistics), jensen_shannon's mixture pass, pass 2
# (the regrad job runs pass 2 alone, from the final statistics the fused job kept).
EXPECTED_PASSES = {"fused": 2, "regrad": 1, "shard_stats": 1, "shard_grad": 1, LIGER_JOB: 2}


# --- SASS: loops, their bodies and barriers -------------------------------------------------------

_SASS_INSTRUCTION = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+([^;]*?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop of the SASS: the body runs from ``start`` (the back edge's target) to ``end`` (the
    back edge, a ``BRA``), both addresses included."""

    start: int
    end: int
    instructions: int
    barriers: int  # BAR.SYNC, BAR.RED, BAR.ARV, ...
    loads: int  # LDG: reads global memory (a vocabulary pass)
    stores: int  # STG
    vector_loads: int = 0  # LDG.E.128: 16-byte loads (a block's logits; not a single column)


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of the first function in ``cuobjdump -sass`` output, in order
    (the instruction without its ``;`` and encoding)."""
    out: list[tuple[int, str]] = []
    for line in sass.splitlines():
        if "Function :" in line and out:
            break  # a second function: its addresses start at 0 again
        found = _SASS_INSTRUCTION.search(line)
        if found:
            out.append((int(found.group(1), 16), found.group(2).strip()))
    return out


def opcode(instruction: str) -> str:
    """The opcode with its modifiers (``BAR.SYNC.DEFER_BLOCKING``), predicate removed."""
    return _PREDICATE.sub("", instruction).split(None, 1)[0]


def sass_loops(sass: str) -> list[Loop]:
    """The loops of ``sass`` (``cuobjdump -sass``), in address order: one per back edge, a ``BRA``
    whose target lies before it (a ``BRA`` to itself is the trap after ``EXIT``, not a loop)."""
    code = sass_instructions(sass)
    loops = []
    for address, instruction in code:
        if opcode(instruction).split(".")[0] != "BRA":
            continue
        targets = re.findall(r"0x([0-9a-fA-F]+)", _PREDICATE.sub("", instruction))
        if not targets:
            continue
        target = int(targets[-1], 16)
        if target >= address:
            continue
        body = [opcode(i) for a, i in code if target <= a <= address]
        loads = [op for op in body if op.split(".")[0] in _GLOBAL_LOADS]
        loops.append(Loop(target, address, len(body), sum(op.split(".")[0] == "BAR" for op in body),
                          len(loads), sum(op.split(".")[0] == "STG" for op in body),
                          sum(op.endswith(".128") for op in loads)))
    return sorted(loops, key=lambda loop: loop.start)


# Global loads: LDG, and LDGSTS (the asynchronous copy to shared memory of a pipelined loop,
# ``Tuning.num_stages`` >= 2).
_GLOBAL_LOADS = ("LDG", "LDGSTS")


def _inside(inner: Loop, outer: Loop) -> bool:
    return inner is not outer and outer.start <= inner.start and inner.end <= outer.end


def vocabulary_passes(loops: list[Loop]) -> list[Loop]:
    """The loops a valid row runs: the outermost loops that read global memory (the zero-row loop
    of masked rows only stores), once the row loop of persistent programs (``Tuning.programs``:
    a loop holding two or more loops that read) is set aside."""
    reading = [l for l in loops if l.loads]
    row_loops = [o for o in reading if sum(_inside(l, o) for l in reading) >= 2]
    rest = [l for l in reading if l not in row_loops]
    return [l for l in rest if not any(_inside(l, o) for o in rest)]


def disassemble(cubin: bytes) -> str:
    """``cuobjdump -sass`` of ``cubin`` (Triton's bundled binary)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"cuobjdump -sass failed ({out.returncode}):\n{out.stderr}")
    return out.stdout


def bf16_conversions(ptx: str, sass: str) -> dict[str, list[str]]:
    """The fp32 -> bf16 conversions of a compiled kernel: the PTX ``cvt`` instructions to bf16
    (``cvt.rn.bf16.f32``, ``cvt.rn.bf16x2.f32``: round to nearest even, subnormals kept; a
    ``.rz`` or ``.ftz`` would show here), the SASS opcodes that carry them out (``F2FP.BF16...``)
    and the PTX lines of the hand rounding's ``+ 0x7FFF`` (``_round_for_store``), if compiled in."""
    return {
        "ptx_cvt": sorted(set(re.findall(r"\bcvt(?:\.(?:rni?|rzi?|rmi?|rpi?|rna|rs|ftz|sat|relu|satfinite))*\.bf16(?:x2)?\.f32\b", ptx))),
        "sass_f2fp": sorted({opcode(i) for _, i in sass_instructions(sass) if opcode(i).startswith("F2FP")}),
        "hand_rounding": [line.strip() for line in ptx.splitlines() if re.search(r"\b(32767|0x7[fF]{3})\b", line)],
    }


def hbm_bytes(kind: str, itemsize: int, vocab: int, valid_rows: int, masked_rows: int = 0) -> int:
    """HBM traffic of the fused forward over ``valid_rows + masked_rows`` rows of ``vocab``
    logits of ``itemsize`` bytes: a valid row reads its logits once per pass (2; 3 with a
    mixture pass), the teacher's as often (distillation kinds), and writes its gradient once; a
    masked row writes zeros only (labels, coefficients and losses, ``O(rows)``, left out)."""
    spec = lossspec.KIND_SPECS[kind]
    passes = 3 if spec.mixture_pass else 2
    reads = passes * (2 if spec.has_teacher else 1)
    return (valid_rows * (reads + 1) + masked_rows) * vocab * itemsize


def regrad_hbm_bytes(kind: str, itemsize: int, vocab: int, valid_rows: int) -> int:
    """HBM traffic of the 16-bit backward's recompute for a non-unit upstream gradient
    (``regrad_kernel``) over ``valid_rows`` rows: pass 2 alone, from the final statistics the
    forward kept, reads the logits (and the teacher's) once and writes the gradient once; before
    the statistics were kept it ran every pass again (:func:`hbm_bytes`' count)."""
    reads = 2 if lossspec.KIND_SPECS[kind].has_teacher else 1
    return valid_rows * (reads + 1) * vocab * itemsize


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


def _compile_liger(dtype: str, arch: int) -> tuple[Any, int]:
    """``(compiled, num_warps)`` of Liger-Kernel's cross-entropy kernel as its
    ``cross_entropy_forward`` launches it for long rows on Hopper (:data:`LIGER_BLOCK`,
    :data:`LIGER_WARPS`): ``None`` arguments and unit strides specialised to constants, the row
    stride and ``n_cols`` divisible by 16, the loss in the logits' dtype."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from liger_kernel.ops import cross_entropy as liger_ce

    from torchloss.backends import triton as _triton

    kernel = liger_ce.liger_cross_entropy_kernel
    constants: dict[str, Any] = {
        "Y_stride": 1, "loss_stride": 1, "weight_ptr": None, "z_loss_ptr": None, "token_accuracy_ptr": None,
        "predicted_tokens_ptr": None, "softcap": None, "lse_square_scale": 0.0, "label_smoothing": 0.0, "reduction": "mean",
        "RETURN_Z_LOSS": False, "RETURN_TOKEN_ACCURACY": False, "RETURN_PREDICTED_TOKENS": False, "BLOCK_SIZE": LIGER_BLOCK,
        "HAS_WEIGHT": False, "HAS_SOFTCAPPING": False, "HAS_GRADIENTS": True,
    }
    logits = "*" + _TL_NAMES[dtype]
    signature: dict[str, str] = {}
    attrs = {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr or name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = {"X_ptr": logits, "Y_ptr": "*i64", "loss_ptr": logits}[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "weight_sum":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name in ("X_stride", "n_cols"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": LIGER_WARPS, "enable_fp_fusion": _triton.FP_FUSION}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options), LIGER_WARPS


def liger_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def compile_kernel(job: str, variant: str, dtype: str, arch: int, **overrides: Any) -> tuple[Any, int, int]:
    """``(compiled, num_warps, block_v)`` of one kernel as a GPU launch specialises it
    (``block_v``: the columns of one vocabulary pass, 0 for the matmul kernels); a loss
    kernel's constexprs replaced by ``overrides`` (tests). Needs ``TRITON_INTERPRET=0`` when
    triton is first imported."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import lossspec
    from torchloss.backends import triton as _triton

    assert not _triton.INTERPRETED, "the AOT report must run with TRITON_INTERPRET=0"
    label, kind, options = next((v for v in VARIANTS if v[0] == variant), (variant, "", {}))
    if job == LIGER_JOB:
        return (*_compile_liger(dtype, arch), LIGER_BLOCK)
    if job in MATMUL_JOBS:
        return (*_compile_matmul(variant, arch), 0)
    config = lossspec.make_config(kind, **options)
    # 16-bit training forwards keep the rows' final statistics for the backward (WRITE_FINAL)
    write_final = job == "fused" and dtype != "float32"
    constants = {**_triton.constexprs(job, config, getattr(torch, dtype), GPU_BLOCK_V, write_final=write_final), **overrides}
    signature, attrs = _signature(job, kind, dtype)
    warps = _triton.num_warps(GPU_BLOCK_V, job, constants["SOFTCAP"] or constants["TEACHER_SOFTCAP"])
    src = ASTSource(fn=_triton.KERNELS[job], signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "enable_fp_fusion": _triton.FP_FUSION})
    return compiled, warps, GPU_BLOCK_V


def unroll_factor(loop: Loop, kind: str, dtype: str, block_v: int, num_warps: int) -> int:
    """Iterations of the vocabulary loop in ``loop``'s body: its 16-byte loads over those of one
    iteration (each thread reads its ``block_v / (32 num_warps)`` logits of each tensor, the
    student's and, on the distillation kinds, the teacher's, in 16-byte loads). ptxas unrolls a
    small body (cross-entropy's fp32 gradient pass at 16 warps: 4 iterations per body); 0 where
    the body reads less than one iteration (a parse gone wrong, counted as 1 and reported by
    :func:`pass_count_problems`)."""
    itemsize = 4 if dtype == "float32" else 2
    tensors = 2 if lossspec.KIND_SPECS[kind].has_teacher else 1
    per_iteration = tensors * max(1, block_v * itemsize // (16 * 32 * num_warps))
    return loop.vector_loads // per_iteration if loop.vector_loads % per_iteration == 0 else 0


def compile_one(job: str, variant: str, dtype: str, arch: int, sass: bool = True) -> Row:
    """Compile one kernel (in a worker process with ``TRITON_INTERPRET=0``) and read its resources
    (and, with ``sass``, its vocabulary passes' instructions and barriers from the disassembly)."""
    from torchloss.backends import triton as _triton

    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # Triton prints its ptxas -v report (TRITON_DUMP_PTXAS_LOG, _worker_init)
        compiled, warps, block_v = compile_kernel(job, variant, dtype, arch)
    passes = vocabulary_passes(sass_loops(disassemble(compiled.asm["cubin"]))) if (block_v and sass) else []
    # Triton's own ptxas run (its -v report) gives the resources; a kernel from Triton's cache ran
    # no ptxas, and is assembled again here with the same flags.
    resources = parse_ptxas_report(log.getvalue())
    if resources is None:
        resources = ptxas_resources(compiled.asm["ptx"], arch, _triton.FP_FUSION)
    registers, stack, spill_stores, spill_loads = resources
    kind = next((v[1] for v in VARIANTS if v[0] == variant), variant)
    return Row(job, variant, dtype, arch, warps, registers, int(compiled.metadata.shared), stack, spill_stores, spill_loads,
               block_v, [l.instructions for l in passes], [l.barriers for l in passes],
               [unroll_factor(l, kind, dtype, block_v, warps) for l in passes])


def ptxas_resources(ptx: str, arch: int, fp_fusion: bool = True) -> tuple[int, int, int, int]:
    """``(registers, stack frame bytes, spill store bytes, spill load bytes)`` of a kernel's PTX,
    from ``ptxas -v`` as Triton runs it (the same binary, architecture name and flags)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(arch).path
    flags = ["--regAllocOptLevel=2"] + ([] if fp_fusion else ["--fmad=false"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        cmd = [ptxas, "-v", *flags, f"--gpu-name={sm_arch_from_capability(arch)}", str(path), "-o", str(Path(tmp) / "kernel.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    resources = parse_ptxas_report(out.stderr + out.stdout)
    if resources is None:
        raise RuntimeError(f"{' '.join(cmd)} printed no resource report:\n{out.stderr}{out.stdout}")
    return resources


def parse_ptxas_report(info: str) -> tuple[int, int, int, int] | None:
    """``(registers, stack frame bytes, spill store bytes, spill load bytes)`` from the report of
    ``ptxas -v`` of one kernel (``None``: no report in ``info``)."""
    if re.search(r"Used \d+ registers", info) is None:
        return None

    def number(pattern: str) -> int:
        found = re.search(pattern, info)
        return int(found.group(1)) if found else 0

    return (number(r"Used (\d+) registers"), number(r"(\d+) bytes stack frame"), number(r"(\d+) bytes spill stores"),
            number(r"(\d+) bytes spill loads"))


def _triton_version() -> str:
    import triton

    return triton.__version__


def _worker_init() -> None:
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # compile_one reads the resources from Triton's own ptxas run
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's torchloss, not an installed one


def instruction_tasks(arch: int = 90, liger: bool = True) -> list[tuple[str, str, str, int]]:
    """The loss kernels for ``arch`` (every job, variant and dtype) and, with ``liger``, Liger's
    cross-entropy: what ``--instructions-only`` compiles."""
    out = [(job, variant[0], dtype, arch) for job in JOBS for variant in VARIANTS for dtype in DTYPES]
    return out + ([(LIGER_JOB, "cross_entropy", dtype, arch) for dtype in DTYPES] if liger else [])


def report(archs: tuple[int, ...] = ARCHS, jobs: int = 2, todo: list[tuple[str, str, str, int]] | None = None, sass: bool = True) -> list[Row]:
    """Compile every (kernel, kind, dtype, arch) in ``jobs`` processes (or the tasks ``todo``);
    rows in a fixed order (without ``sass``: resources only, no disassembly)."""
    todo = tasks(archs) if todo is None else todo
    # Fresh processes (spawn): triton must be imported with TRITON_INTERPRET=0.
    env_before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init) as pool:
            return list(pool.map(compile_one, *zip(*todo), [sass] * len(todo)))
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


def markdown_instructions(rows: list[Row], arch: int = 90) -> str:
    """Per loss kernel (and Liger's) on ``arch``: the passes' body instructions and barriers per
    block, warp-instructions per valid element, registers and spills."""
    lines = ["| kernel | kind | logits | BLOCK_V / warps | pass bodies (instr.) | warp-instr. / valid element | barriers / block | regs | spill st+ld |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.arch != arch or not r.block_v:
            continue
        unroll = r.pass_unroll or [1] * len(r.pass_instructions)
        bodies = " + ".join(f"{n}" if k == 1 else f"{n}/{k}" for n, k in zip(r.pass_instructions, unroll)) or "-"
        barriers = " + ".join(map(str, r.pass_barriers)) or "-"
        lines.append(f"| `{r.job}` | {r.variant} | {r.dtype} | {r.block_v} / {r.num_warps} | {bodies} | {r.per_element:.2f} | "
                     f"{barriers} | {r.registers} | {r.spill_stores}+{r.spill_loads} B |")
    return "\n".join(lines)


def pass_count_problems(rows: list[Row]) -> list[str]:
    """Rows whose SASS does not show the expected number of vocabulary passes (a loop split or
    unrolled by ptxas, or a parse that missed one): their counts would be wrong."""
    out = []
    for r in rows:
        if not r.block_v:
            continue
        expected = EXPECTED_PASSES[r.job] + (1 if r.job == "fused" and "jensen_shannon" in r.variant else 0)
        if len(r.pass_instructions) != expected:
            out.append(f"{r.job} {r.variant} {r.dtype} sm_{r.arch}: {len(r.pass_instructions)} passes found, {expected} expected")
        if 0 in r.pass_unroll:
            out.append(f"{r.job} {r.variant} {r.dtype} sm_{r.arch}: a pass body reads less than one iteration's logits")
    return out


def targets(rows: list[Row], arch: int = 90, ratio: float = 1.5) -> list[tuple[str, bool]]:
    """The targets of issue 32 on ``arch``, each ``(statement, met)``: the fused cross-entropy
    issues no more warp-instructions per valid element than Liger's (per dtype, where Liger was
    compiled); every kind's fused kernel at most ``ratio`` times cross-entropy's; no spills."""
    index = {(r.job, r.variant, r.dtype): r for r in rows if r.arch == arch}
    out = []
    for dtype in DTYPES:
        ce = index.get(("fused", "cross_entropy", dtype))
        liger = index.get((LIGER_JOB, "cross_entropy", dtype))
        if ce is None:
            continue
        if liger is not None:
            out.append((f"{dtype}: cross_entropy {ce.per_element:.2f} <= Liger {liger.per_element:.2f}", ce.per_element <= liger.per_element))
        for label, kind, options in VARIANTS:
            r = index.get(("fused", label, dtype))
            if r is not None and label == kind and kind != "cross_entropy":
                out.append((f"{dtype}: {kind} {r.per_element:.2f} <= {ratio} x cross_entropy = {ratio * ce.per_element:.2f}",
                            r.per_element <= ratio * ce.per_element))
    spilled = [r for r in rows if r.spill_stores or r.spill_loads]
    out.append((f"no spills ({len(spilled)} of {len(rows)} kernels spill)", not spilled))
    return out


# --- Where the second read comes from: L2 reuse and bytes in flight (a model, not a measurement) ---

#: GH100 (H100 SXM, H200): multiprocessors, L2 bytes, and the per-multiprocessor limits of occupancy.
GH100 = {"sms": 132, "l2_bytes": 50 * 2**20, "warps": 64, "registers": 65536, "shared": 227 * 1024, "programs": 32}


def resident_programs(registers: int, num_warps: int, shared: int, gpu: dict = GH100) -> int:
    """Programs one multiprocessor holds at once: the least of its warp slots, registers (per
    thread, ``32 * num_warps`` threads a program), shared memory and program slots."""
    by_regs = gpu["registers"] // max(1, registers * 32 * num_warps)
    by_shared = gpu["shared"] // shared if shared else gpu["programs"]
    return max(1, min(gpu["warps"] // num_warps, by_regs, by_shared, gpu["programs"]))


def l2_share(rows_in_flight: int, row_read_bytes: int, l2_bytes: int, reverse: bool = True) -> float:
    """The share of a row's second read that L2 can still hold when pass 2 starts: L2 split evenly
    between the rows in flight, each keeping its most recently read bytes (LRU). Walked last
    block first (``reverse``), a row re-reads those first: ``min(1, share / row)``; walked in pass
    1's order, it re-reads its oldest bytes first, evicted before they are reached unless the whole
    row fits (then 1, else 0)."""
    fraction = min(1.0, l2_bytes / max(1, rows_in_flight) / row_read_bytes)
    return fraction if reverse or fraction >= 1.0 else 0.0


def hbm_bytes_per_element(kind: str, itemsize: int, share: float) -> float:
    """:func:`hbm_bytes` per valid element with ``share`` of the last read pass (the gradient
    pass: the logits, and the teacher's) served by L2."""
    tensors = 2 if lossspec.KIND_SPECS[kind].has_teacher else 1
    return hbm_bytes(kind, itemsize, 1, 1) - share * tensors * itemsize


def bytes_in_flight(programs_per_sm: int, block_v: int, itemsize: int, tensors: int, stages: int) -> int:
    """Bytes of loads one multiprocessor has outstanding: each program waits on one block of each
    tensor it reads, ``stages`` blocks when its loop is pipelined (``Tuning.num_stages``)."""
    return programs_per_sm * block_v * itemsize * tensors * stages


def markdown_l2_model(rows: list[Row], vocab: int, rate_tb_s: float, latency_ns: float, gpu: dict = GH100) -> str:
    """The model's table for the bf16 fused kernels (cross-entropy, reverse KL) at ``vocab``: for
    one program per row (occupancy from the compiled registers and shared memory) and for
    ``Tuning(programs=k x SMs)``, with 1-3 pipeline stages: rows in flight, the second read's L2
    share, HBM bytes per valid element, the floor at ``rate_tb_s``, and the bytes in flight per
    multiprocessor against what Little's law asks to keep ``rate_tb_s`` busy at ``latency_ns``."""
    needed = rate_tb_s * 1e12 / gpu["sms"] * latency_ns * 1e-9
    lines = [f"| kind | programs | stages | rows in flight | 2nd read from L2 (reverse; forward) | HBM B / element | floor at {rate_tb_s} TB/s, 16384 rows: ms "
             f"| in flight / SM: KiB (needed {needed / 1024:.0f}) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.job != "fused" or r.dtype != "bfloat16" or r.variant not in ("cross_entropy", "reverse_kl"):
            continue
        tensors = 2 if lossspec.KIND_SPECS[r.variant].has_teacher else 1
        for per_sm in (None, 1, 2, 4):
            for stages in (1, 2, 3):
                if per_sm is None and stages > 1:
                    continue
                # each stage adds a block of each tensor to the program's shared memory
                shared = r.shared + (stages - 1) * r.block_v * 2 * tensors if stages > 1 else r.shared
                resident = min(per_sm or gpu["programs"], resident_programs(r.registers, r.num_warps, shared, gpu))
                in_flight_rows = resident * gpu["sms"]
                share = l2_share(in_flight_rows, vocab * 2 * tensors, gpu["l2_bytes"])
                forward = l2_share(in_flight_rows, vocab * 2 * tensors, gpu["l2_bytes"], reverse=False)
                per_element = hbm_bytes_per_element(r.variant, 2, share)
                floor_ms = per_element * vocab * 16384 / (rate_tb_s * 1e12) * 1e3
                flight = bytes_in_flight(resident, r.block_v, 2, tensors, stages)
                label = "one per row" if per_sm is None else f"{per_sm} x SMs"
                lines.append(f"| {r.variant} | {label} | {stages} | {in_flight_rows} | {share:.0%}; {forward:.0%} | {per_element:.2f} | "
                             f"{floor_ms:.2f} | {flight / 1024:.0f}{'' if flight >= needed else ' (latency-bound)'} |")
    return "\n".join(lines)


def markdown_hbm(vocab: int, rows_valid: int, rows_masked: int, rate_tb_s: float) -> str:
    """:func:`hbm_bytes` per kind for fp32 and bf16 logits, and the time it takes at ``rate_tb_s``."""
    lines = [f"| kind | bytes / valid element (fp32, bf16) | {rows_valid} + {rows_masked} masked rows x {vocab}: GB (fp32, bf16) | "
             f"floor at {rate_tb_s} TB/s: ms (fp32, bf16) | bf16 backward, non-unit upstream (regrad): GB, ms (all passes again: GB) |",
             "|---|---|---|---|---|"]
    for kind in lossspec.KIND_SPECS:
        per = [hbm_bytes(kind, size, 1, 1) for size in (4, 2)]
        total = [hbm_bytes(kind, size, vocab, rows_valid, rows_masked) for size in (4, 2)]
        regrad = regrad_hbm_bytes(kind, 2, vocab, rows_valid)
        lines.append(f"| {kind} | {per[0]}, {per[1]} | {total[0] / 1e9:.2f}, {total[1] / 1e9:.2f} | "
                     f"{total[0] / (rate_tb_s * 1e12) * 1e3:.3f}, {total[1] / (rate_tb_s * 1e12) * 1e3:.3f} | "
                     f"{regrad / 1e9:.2f}, {regrad / (rate_tb_s * 1e12) * 1e3:.3f} ({hbm_bytes(kind, 2, vocab, rows_valid) / 1e9:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--instructions-only", action="store_true",
                        help="only the loss kernels for sm_90 (and Liger's): instructions, barriers, HBM model, targets")
    parser.add_argument("--copy-rate", type=float, default=4.2, help="HBM copy rate of the floor time, TB/s (default 4.2)")
    parser.add_argument("--shape", type=int, nargs=2, default=(16384, 131072), metavar=("ROWS", "V"),
                        help="rows and vocabulary of the HBM model (default 16384 131072)")
    parser.add_argument("--masked", type=float, default=0.0, help="fraction of masked rows in the HBM model (default 0)")
    parser.add_argument("--latency-ns", type=float, default=800.0,
                        help="HBM load latency of the bytes-in-flight model, ns (default 800)")
    parser.add_argument("--no-liger", action="store_true", help="leave Liger-Kernel's cross-entropy out")
    parser.add_argument("--resources-only", action="store_true",
                        help="registers, shared memory and spills only: no disassembly, no instruction counts (the suite's check)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    liger = not args.no_liger and liger_available()
    if args.instructions_only:
        rows = report(jobs=args.jobs, todo=instruction_tasks(90, liger))
    else:
        sass = not args.resources_only
        rows = report(tuple(args.arch), args.jobs, sass=sass)
        if liger:
            rows += report(jobs=args.jobs, todo=[(LIGER_JOB, "cross_entropy", d, a) for a in args.arch for d in DTYPES], sass=sass)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    if args.resources_only:
        print(markdown([r for r in rows if r.job != LIGER_JOB]))
        spilled = [r for r in rows if r.spill_stores or r.spill_loads]
        for r in spilled:
            print(f"SPILL: {r}", file=sys.stderr)
        return 1 if spilled else 0
    if not args.instructions_only:
        print(f"BLOCK_V = {GPU_BLOCK_V}, Triton's ptxas; spill = spill stores + spill loads (bytes)\n")
        print(markdown([r for r in rows if r.job != LIGER_JOB]))
        print()
    arch = 90 if 90 in {r.arch for r in rows} else max(r.arch for r in rows)
    print(f"Instruction issue, sm_{arch} SASS (offline static counts, not GPU timings; Triton {_triton_version()}):\n")
    print(markdown_instructions(rows, arch))
    if not liger:
        print("\n(Liger-Kernel not installed or left out: pip install --no-deps liger-kernel==0.8.5)")
    for problem in pass_count_problems(rows):
        print(f"WARNING: {problem}", file=sys.stderr)
    n_rows, vocab = args.shape
    masked = round(n_rows * args.masked)
    print("\nHBM bytes model (two reads + one write per valid row, the teacher read too, masked rows write zeros):\n")
    print(markdown_hbm(vocab, n_rows - masked, masked, args.copy_rate))
    print(f"\nWhere the second read comes from (a model for {GH100['sms']} SMs and {GH100['l2_bytes'] >> 20} MiB of L2, "
          f"V = {vocab}, bf16; not a measurement):\n")
    print(markdown_l2_model(rows, vocab, args.copy_rate, args.latency_ns))
    print(f"\nTargets (sm_{arch}):")
    for statement, met in targets(rows, arch):
        print(f"  {'MET' if met else 'MISSED':6}  {statement}")
    spilled = [r for r in rows if r.spill_stores or r.spill_loads]
    for r in spilled:
        print(f"SPILL: {r}", file=sys.stderr)
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
