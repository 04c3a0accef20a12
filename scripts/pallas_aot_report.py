"""Compile jaxloss's Pallas kernels for a Hopper GPU without one, and count their instructions.

JAX lowers a ``pallas_call`` for CUDA on any machine: the lowered module holds each kernel as
Triton IR (MLIR bytecode in the backend config of its ``__gpu$xla.gpu.triton`` custom call, with
its grid, warps and stages). For every kind (the variants of ``scripts/triton_aot_report.py``) and
fp32 / bf16 logits, this script lowers the loss kernel of ``jaxloss.backends.pallas`` (the
``"fused"`` kernel: the forward, with 16-bit logits as the training forward launches it, keeping
the rows' final statistics for the backward's recompute, the "grad" mode) at the GPU defaults' blocks,
prints the IR as text in JAX's MLIR context (which knows the Triton dialect), compiles that text
with the ``triton`` package for sm_90, and reads the SASS as the Triton report does: the vocabulary
passes' bodies, barriers per block, registers and spills. Each iteration of a pass handles
``block_rows x vocab_block`` elements with ``num_warps`` warps::

    warp-instructions per valid element = sum over the passes (body instructions) * num_warps / (block_rows * vocab_block)

Next to each, our Triton kernel's figure for the same job (``fused``) and the ratio: issue 32
asks the Pallas kernels to come within 1.1x of the Triton ones' time.

A guide between GPU runs, not a timing, and not exactly what a GPU runs: XLA compiles the IR with
the Triton built into jaxlib's CUDA plugin (its own version and passes), this script with the pip
``triton`` (``python -c "import triton; print(triton.__version__)"``).

Usage::

    python scripts/pallas_aot_report.py [--json PATH] [--no-triton]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # compiled, not interpreted: before triton is imported

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # this checkout's jaxloss and the Triton report's SASS reader

import triton_aot_report as aot  # noqa: E402

ARCH = 90
# The shape the kernels are lowered at: full blocks of the GPU defaults (the kernels specialise on
# N and V; a ragged tail would add a masked copy of nothing the passes run).
ROWS, VOCAB = 64, 131072
TRITON_CALL = "__gpu$xla.gpu.triton"
LAUNCH_FIELDS = ("block_rows", "vocab_block", "num_warps", "num_stages")


@dataclasses.dataclass
class Kernel:
    """One lowered Pallas kernel: its Triton IR text and launch parameters."""

    name: str
    ir: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


def lower_kernels(fn: Any, *args: Any) -> list[Kernel]:
    """The Pallas kernels of ``jax.jit(fn)(*args)`` lowered for CUDA (``args``: shapes), in order."""
    import jax
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    configs: list[Any] = []

    def walk(op: Any) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    attrs = inner.operation.attributes
                    if inner.operation.name == "stablehlo.custom_call" and ir.StringAttr(attrs["call_target_name"]).value == TRITON_CALL:
                        configs.append(ir.DictAttr(attrs["mhlo.backend_config"]))
                    walk(inner.operation)

    walk(module.operation)
    kernels = []
    with jax_mlir.make_ir_context() as context:
        tt_dialect.register_dialect(context)
        for config in configs:
            number = lambda key: ir.IntegerAttr(config[key]).value  # noqa: E731
            text = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.get_asm(enable_debug_info=False)
            kernels.append(Kernel(ir.StringAttr(config["name"]).value, text, number("num_warps"), number("num_stages"),
                                  (number("grid_x"), number("grid_y"), number("grid_z"))))
    return kernels


def fused_kernel(variant: str, dtype: str, **launch: Any) -> tuple[Kernel, int, int]:
    """``(kernel, block_rows, vocab_block)`` of the ``"fused"`` Pallas kernel of a variant of
    :data:`triton_aot_report.VARIANTS` at the GPU defaults, or with the :class:`lossspec.Tuning`
    fields ``launch`` (``block_rows``, ``vocab_block``, ``num_warps``, ``num_stages``)."""
    import jax
    import jax.numpy as jnp

    import lossspec
    from jaxloss.backends import pallas as _pallas
    from jaxloss.backends.xla import KernelConfig

    _, kind, options = next(v for v in aot.VARIANTS if v[0] == variant)
    cfg = KernelConfig.of(lossspec.make_config(kind, **options))
    x = jax.ShapeDtypeStruct((ROWS, VOCAB), getattr(jnp, dtype))
    target = jax.ShapeDtypeStruct((ROWS,), jnp.int32) if cfg.is_ce else (x if cfg.has_teacher else jax.ShapeDtypeStruct((ROWS, 0), x.dtype))
    coef = jax.ShapeDtypeStruct((ROWS,), jnp.float32)
    tuning = lossspec.Tuning(interpret=False, **launch)
    keep_final = dtype != "float32"  # a 16-bit training forward keeps the final statistics (jaxloss._autodiff)
    [kernel] = lower_kernels(lambda x, t, c: _pallas.fused(cfg, x, t, c, tuning=tuning, keep_final=keep_final), x, target, coef)
    block_rows, vocab_block = _pallas.block_shape(tuning, ROWS, VOCAB, on_gpu=True)
    return kernel, block_rows, vocab_block


def compile_pallas(variant: str, dtype: str, arch: int = ARCH, **launch: Any) -> aot.Row:
    """Lower, compile and count one Pallas kernel (a row like the Triton report's, ``block_v`` the
    elements of one iteration, ``block_rows * vocab_block``); ``launch``: :func:`fused_kernel`'s."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel, block_rows, vocab_block = fused_kernel(variant, dtype, **launch)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{kernel.name}.ttir"
        path.write_text(kernel.ir)
        compiled = triton.compile(str(path), target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    passes = aot.vocabulary_passes(aot.sass_loops(aot.disassemble(compiled.asm["cubin"])))
    registers, stack, spill_stores, spill_loads = aot.ptxas_resources(compiled.asm["ptx"], arch)
    kind = next(v[1] for v in aot.VARIANTS if v[0] == variant)
    elements = block_rows * vocab_block  # one iteration's, over every row of the block
    unroll = [aot.unroll_factor(l, kind, dtype, elements, kernel.num_warps) for l in passes]
    return aot.Row("pallas_fused", variant, dtype, arch, kernel.num_warps, registers, int(compiled.metadata.shared), stack,
                   spill_stores, spill_loads, elements, [l.instructions for l in passes], [l.barriers for l in passes], unroll)


def markdown(rows: list[aot.Row], triton_rows: dict[tuple[str, str], aot.Row], blocks: str) -> str:
    """One line per Pallas kernel, with our Triton kernel's warp-instructions per element beside it."""
    lines = [f"| kind | logits | block ({blocks}) / warps | pass bodies (instr.) | warp-instr. / valid element | barriers / block | regs | "
             "spill st+ld | Triton `fused` | Pallas / Triton |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        unroll = r.pass_unroll or [1] * len(r.pass_instructions)
        bodies = " + ".join(f"{n}" if k == 1 else f"{n}/{k}" for n, k in zip(r.pass_instructions, unroll))
        ref = triton_rows.get((r.variant, r.dtype))
        theirs = f"{ref.per_element:.2f}" if ref else "-"
        ratio = f"{r.per_element / ref.per_element:.2f}x" if ref else "-"
        lines.append(f"| {r.variant} | {r.dtype} | {r.block_v} / {r.num_warps} | {bodies} | {r.per_element:.2f} | "
                     f"{' + '.join(map(str, r.pass_barriers))} | {r.registers} | {r.spill_stores}+{r.spill_loads} B | {theirs} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--variants", default=",".join(v[0] for v in aot.VARIANTS), help="comma list (default: every variant)")
    parser.add_argument("--dtypes", default=",".join(aot.DTYPES), help="comma list (default: float32,bfloat16)")
    parser.add_argument("--no-triton", action="store_true", help="leave out our Triton kernels' figures beside them")
    for name in LAUNCH_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"Tuning.{name} of the Pallas kernels (default: jaxloss's GPU default)")
    args = parser.parse_args(argv)
    todo = [(v, d) for v in args.variants.split(",") for d in args.dtypes.split(",")]
    launch = {name: getattr(args, name) for name in LAUNCH_FIELDS if getattr(args, name) is not None}
    rows = []
    for variant, dtype in todo:
        print(f"compiling the Pallas kernel: {variant} {dtype}", file=sys.stderr, flush=True)
        rows.append(compile_pallas(variant, dtype, **launch))
    triton_rows = {}
    if not args.no_triton:
        for row in aot.report(jobs=2, todo=[("fused", v, d, ARCH) for v, d in todo]):
            triton_rows[(row.variant, row.dtype)] = row
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    import triton

    from jaxloss.backends.pallas import GPU_DEFAULTS

    print(f"Pallas kernels (\"fused\"), sm_{ARCH} SASS, lowered by JAX for CUDA at {ROWS} x {VOCAB} and compiled with Triton "
          f"{triton.__version__} (offline static counts, not GPU timings; XLA compiles the same IR with its own Triton):\n")
    blocks = f"{launch.get('block_rows', GPU_DEFAULTS.block_rows)} x {launch.get('vocab_block', GPU_DEFAULTS.vocab_block)}"
    print(markdown(rows, triton_rows, blocks))
    expected = {variant: 3 if "jensen_shannon" in variant else 2 for variant, _ in todo}
    problems = [f"{r.variant} {r.dtype}: {len(r.pass_instructions)} vocabulary passes, expected {expected[r.variant]}"
                for r in rows if len(r.pass_instructions) != expected[r.variant] or 0 in r.pass_unroll]
    for problem in problems:
        print(f"WARNING: {problem}", file=sys.stderr)
    spilled = [r for r in rows if r.spill_stores or r.spill_loads]
    for r in spilled:
        print(f"SPILL: {r}", file=sys.stderr)
    return 1 if (spilled or problems) else 0


if __name__ == "__main__":
    sys.exit(main())
