"""GPU readiness without a GPU: every Triton kernel of torchloss (the losses' and the fused head's
bf16 matmul, ``torchloss.backends.triton_matmul``) compiles ahead of time for sm_80 and sm_90 (Triton's
bundled ptxas), fp32 and bf16 inputs, every kind, at the GPU block sizes and ``num_warps``, without
register spills; ``docs/triton_kernels.md`` holds the current table.

Runs ``scripts/triton_aot_report.py`` in a subprocess (``TRITON_INTERPRET=0``: this test session
has the interpreter on).
"""

from __future__ import annotations

import json
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.support.aot import NEEDS_PTXAS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "triton_aot_report.py"
DOC = ROOT / "docs" / "triton_kernels.md"


@pytest.mark.slow
@NEEDS_PTXAS
def test_every_kernel_compiles_for_sm80_sm90_without_spills(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("triton_aot_report", SCRIPT)
    aot = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = aot  # its dataclasses look their module up while the classes are built
    spec.loader.exec_module(aot)
    out = tmp_path / "rows.json"
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    # resources only: the disassembly and instruction counts (tested on their own below and in
    # test_torchloss_aot_counting.py) took this test from 24 s to 66 s
    proc = subprocess.run([sys.executable, str(SCRIPT), "--resources-only", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [aot.Row(**r) for r in json.loads(out.read_text())]
    expected = set(aot.tasks())  # the loss kernels x every kind, the matmul x its layouts
    if aot.liger_available():  # and Liger-Kernel's cross-entropy, compiled the same way for comparison
        expected |= {(aot.LIGER_JOB, "cross_entropy", dtype, arch) for dtype in aot.DTYPES for arch in aot.ARCHS}
    assert {(r.job, r.variant, r.dtype, r.arch) for r in rows} == expected
    for r in rows:
        assert r.spill_stores == 0 and r.spill_loads == 0, r
        # the matmul's pipelined stages need more than the 48 KB every launch gets (Triton asks)
        shared_limit = aot.MAX_SHARED[r.arch] if r.job in aot.MATMUL_JOBS else 48 * 1024
        assert 0 < r.registers <= 255 and r.shared < shared_limit, r
    # The documented table is the current one (regenerate: python scripts/triton_aot_report.py).
    assert aot.markdown(rows) in DOC.read_text(), "docs/triton_kernels.md holds an outdated AOT table"


# A subprocess (TRITON_INTERPRET=0) loads the report module from its path, sys.argv[1], then compiles.
_LOAD_REPORT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("triton_aot_report", sys.argv[1])
aot = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = aot
spec.loader.exec_module(aot)
"""
_CONVERSIONS = _LOAD_REPORT + """out = {}
for name, job, variant, overrides in (("fused", "fused", "cross_entropy", {}), ("shard_grad", "shard_grad", "cross_entropy", {}),
                                      ("hand", "fused", "cross_entropy", {"ROUND_BF16": True})):
    compiled, _, _ = aot.compile_kernel(job, variant, "bfloat16", 90, **overrides)
    out[name] = aot.bf16_conversions(compiled.asm["ptx"], aot.disassemble(compiled.asm["cubin"]))
print(json.dumps(out))
"""


@pytest.mark.slow
@NEEDS_PTXAS
def test_compiled_bf16_store_is_the_hardware_round_to_nearest_even() -> None:
    """Compiled for a GPU, the kernels leave the bf16 rounding to the cast (``ROUND_BF16`` off):
    every fp32 -> bf16 conversion is ``cvt.rn.bf16(x2).f32`` (round to nearest even; no ``.rz``,
    no ``.ftz``: subnormals kept), carried out by ``F2FP.BF16.F32.PACK_AB`` in the sm_90 SASS,
    and the hand rounding's ``+ 0x7FFF`` is not compiled in (the interpreter's setting compiles
    it, which shows that the check sees it). That this rounding equals the hand rounding bit for
    bit, ties and subnormals included, is ``test_torchloss_aot_counting.py``'s
    ``test_bf16_hand_rounding_is_round_to_nearest_even``."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CONVERSIONS, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("fused", "shard_grad"):
        assert found[name]["ptx_cvt"] and set(found[name]["ptx_cvt"]) <= {"cvt.rn.bf16.f32", "cvt.rn.bf16x2.f32"}, found[name]
        assert found[name]["sass_f2fp"] == ["F2FP.BF16.F32.PACK_AB"], found[name]
        assert found[name]["hand_rounding"] == [], found[name]
    assert found["hand"]["hand_rounding"], found["hand"]


_PIPELINED = _LOAD_REPORT + """out = {}
for kind in ("cross_entropy", "reverse_kl"):
    for name, overrides in (("default", {}), ("pipelined", {"STAGES": 2, "PERSISTENT": True})):
        compiled, _, _ = aot.compile_kernel("fused", kind, "bfloat16", 90, **overrides)
        sass = aot.disassemble(compiled.asm["cubin"])
        passes = aot.vocabulary_passes(aot.sass_loops(sass))
        code = aot.sass_instructions(sass)
        async_loads = [sum(aot.opcode(i).startswith("LDGSTS") for a, i in code if l.start <= a <= l.end) for l in passes]
        out[kind + " " + name] = {"passes": len(passes), "async_loads": async_loads, "shared": int(compiled.metadata.shared)}
print(json.dumps(out))
"""


@pytest.mark.slow
@NEEDS_PTXAS
def test_pipelined_persistent_kernels_compile_to_async_copies() -> None:
    """``Tuning(num_stages=2, programs=...)`` compiled for sm_90 (the fused kernel, cross-entropy
    and reverse KL, bf16): both vocabulary passes load with asynchronous copies (``LDGSTS``, the
    software pipelining of ``tl.range(..., num_stages=2)``) inside the persistent programs' row
    loop, in one buffer a stage that fits the 48 KB of shared memory every launch gets; the
    default launch has neither (plain ``LDG`` loads, no staging buffer). Unpipelined, the knob
    would measure nothing on a GPU."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _PIPELINED, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind in ("cross_entropy", "reverse_kl"):
        default, pipelined = found[kind + " default"], found[kind + " pipelined"]
        assert default["passes"] == 2 and default["async_loads"] == [0, 0] and default["shared"] < 1024, default
        assert pipelined["passes"] == 2 and all(n > 0 for n in pipelined["async_loads"]), pipelined
        assert 8 * 1024 <= pipelined["shared"] < 48 * 1024, pipelined
