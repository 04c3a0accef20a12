"""The counting of ``scripts/triton_aot_report.py`` (no compile: fast): loops, instructions and
barriers read from a ``cuobjdump -sass`` listing with known counts, warp-instructions per valid
element, the HBM bytes model. The compiled kernels' report itself runs in
``test_torchloss_triton_aot.py`` (slow)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "triton_aot_report.py"


def _report_module():
    """scripts/triton_aot_report.py as a module (its top level imports lossspec only)."""
    spec = importlib.util.spec_from_file_location("triton_aot_report", SCRIPT)
    aot = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = aot  # its dataclasses look their module up while the classes are built
    spec.loader.exec_module(aot)
    return aot


def _sass(body: list[str], start: int = 0x100) -> str:
    """A cuobjdump-style listing: a prologue, ``body`` (instructions) at ``start``, then EXIT and the trap."""
    lines = ["\tcode for sm_90a", "\t\tFunction : fused_kernel"]
    code = ["LDC R1, c[0x0][0x28]"] * (start // 16) + body + ["EXIT", "BRA {here}"]
    for i, ins in enumerate(code):
        address = 16 * i
        ins = ins.format(here=hex(address), start=hex(start))
        lines.append(f"        /*{address:04x}*/                   {ins} ;   /* 0x000fe20000000a00 */")
        lines.append("                                                          /* 0x000fe20000000a00 */")
    return "\n".join(lines) + "\n"


# Two vocabulary passes (loads, barriers, a predicated forward branch inside), a zero-row loop
# (stores only): 7 + 5 instructions, 2 + 0 barriers.
_PASS_1 = ["IADD3 R0, R26, UR4, RZ", "@!P1 LDG.E.128 R16, desc[UR16][R2.64]", "FADD R0, R31, -R28",
           "BAR.SYNC.DEFER_BLOCKING 0x0", "@P0 BRA 0x{fwd:x}", "BAR.SYNC.DEFER_BLOCKING 0x0"]
_PASS_2 = ["LDG.E R4, desc[UR14][R4.64]", "MUFU.EX2 R3, R18", "F2FP.BF16.F32.PACK_AB R3, R4, R3", "STG.E desc[UR14][R2.64], R3"]
_ZERO = ["STG.E desc[UR14][R2.64], RZ", "IADD3 R0, R0, 0x1, RZ"]


def _listing(extra_in_pass_2: int = 0) -> str:
    body, starts = [], []
    for loop in (_PASS_1, _PASS_2 + ["FMUL R3, R3, R3"] * extra_in_pass_2, _ZERO):
        starts.append(0x100 + 16 * len(body))
        body += loop + [f"@!P1 BRA {hex(starts[-1])}"]
    body = [ins.replace("0x{fwd:x}", hex(starts[0] + 16 * 5)) for ins in body]
    return _sass(body)


def test_sass_loop_counts_on_a_listing_with_known_counts() -> None:
    """The report's counter (scripts/triton_aot_report.py): loops from back edges (not the trap),
    bodies counted from the target to the branch, barriers, passes = the loops that load; one
    instruction more in a pass is one more in its count (the counter is not blind to the body)."""
    aot = _report_module()
    sass = _listing()
    loops = aot.sass_loops(sass)
    assert [(l.instructions, l.barriers, l.loads, l.stores) for l in loops] == [(7, 2, 1, 0), (5, 0, 1, 1), (3, 0, 0, 1)]
    passes = aot.vocabulary_passes(loops)
    assert [l.instructions for l in passes] == [7, 5] and [l.barriers for l in passes] == [2, 0]
    mutant = aot.vocabulary_passes(aot.sass_loops(_listing(extra_in_pass_2=3)))
    assert [l.instructions for l in mutant] == [7, 8]
    row = aot.Row("fused", "cross_entropy", "bfloat16", 90, 8, 40, 32, 0, 0, 0, 4096, [7, 5], [2, 0])
    assert row.per_element == 12 * 8 / 4096
    assert aot.pass_count_problems([row]) == []
    assert aot.pass_count_problems([dataclasses.replace(row, pass_instructions=[12])]) != []
    assert aot.opcode("@!UP0 BAR.SYNC.DEFER_BLOCKING 0x0") == "BAR.SYNC.DEFER_BLOCKING"


def test_unrolled_pass_bodies_count_per_iteration() -> None:
    """ptxas unrolls a small vocabulary loop (cross-entropy's fp32 gradient pass at 16 warps: four
    iterations per body): the report divides a body by the iterations it holds, read from its
    16-byte loads over one iteration's (per thread ``block_v / (32 warps)`` logits of each tensor
    read, the teacher's too on the distillation kinds); a body that reads less is reported."""
    aot = _report_module()
    loop = aot.Loop(0, 0x1000, 175, 0, 8, 8, 8)
    assert aot.unroll_factor(loop, "cross_entropy", "float32", 4096, 16) == 4  # 2 loads an iteration
    assert aot.unroll_factor(loop, "soft_cross_entropy", "bfloat16", 4096, 8) == 2  # 2 + 2 loads an iteration
    assert aot.unroll_factor(dataclasses.replace(loop, vector_loads=3), "cross_entropy", "float32", 4096, 16) == 0
    sass = _sass(["LDG.E.128 R4, desc[UR4][R2.64]", "LDG.E.U16 R8, desc[UR4][R6.64]", "@P0 BRA 0x100"])
    assert [l.vector_loads for l in aot.sass_loops(sass)] == [1]  # a single column's load is no vector load
    row = aot.Row("shard_grad", "cross_entropy", "float32", 90, 16, 39, 0, 0, 0, 0, 4096, [175], [0], [4])
    assert row.per_element == 175 / 4 * 16 / 4096
    assert aot.pass_count_problems([row]) == []
    assert aot.pass_count_problems([dataclasses.replace(row, pass_unroll=[0])]) != []


def test_pipelined_passes_inside_a_persistent_row_loop() -> None:
    """``Tuning(num_stages=2, programs=...)``'s code: the passes load with ``LDGSTS`` (asynchronous
    copies to shared memory, 16 bytes each) and sit inside the persistent programs' row loop. The
    report finds the two passes, not the row loop, and counts the ``LDGSTS`` as 16-byte global
    loads."""
    aot = _report_module()
    pass_1 = ["LDGSTS.E.BYPASS.128 [R5], desc[UR16][R2.64]", "LDGDEPBAR", "DEPBAR.LE SB0, 0x1", "LDS.128 R8, [R5]",
              "BAR.SYNC.DEFER_BLOCKING 0x0"]
    body, starts = ["IADD3 R30, R30, UR5, RZ"], []  # the row loop's head
    for loop in (pass_1, _PASS_2):
        starts.append(0x100 + 16 * len(body))
        body += loop + [f"@!P1 BRA {hex(starts[-1])}"]
    body += ["ISETP.GE.AND P2, PT, R30, UR6, PT", "@!P2 BRA 0x100"]  # the row loop's back edge
    loops = aot.sass_loops(_sass(body))
    assert [(l.instructions, l.loads, l.vector_loads) for l in loops] == [(len(body), 2, 1), (6, 1, 1), (5, 1, 0)]
    passes = aot.vocabulary_passes(loops)
    assert [(l.instructions, l.barriers, l.loads) for l in passes] == [(6, 1, 1), (5, 0, 1)]


def test_l2_and_bytes_in_flight_model() -> None:
    """The report's model of where the second read comes from (GH100: 132 multiprocessors, 50 MiB
    of L2): occupancy from registers, warps and shared memory; L2 split evenly between the rows
    in flight, of which pass 2 walked last block first re-reads what L2 still holds, and in pass
    1's order nothing unless the whole row fits; the HBM bytes that leaves; Little's-law bytes in
    flight."""
    aot = _report_module()
    gpu = aot.GH100
    assert aot.resident_programs(40, 8, 32, gpu) == 6  # 65536 registers / (40 x 256 threads)
    assert aot.resident_programs(32, 8, 32, gpu) == 8  # 64 warp slots / 8
    assert aot.resident_programs(32, 4, 100 * 1024, gpu) == 2  # 227 KiB of shared memory / 100
    row = 131072 * 2  # a bf16 row of 131072 logits: 256 KiB
    assert aot.l2_share(132, row, gpu["l2_bytes"]) == 1.0 == aot.l2_share(132, row, gpu["l2_bytes"], reverse=False)
    assert aot.l2_share(264, row, gpu["l2_bytes"]) == (50 * 2**20 / 264) / row  # ~76%
    assert aot.l2_share(264, row, gpu["l2_bytes"], reverse=False) == 0.0
    assert aot.hbm_bytes_per_element("cross_entropy", 2, 0.0) == 6 and aot.hbm_bytes_per_element("cross_entropy", 2, 1.0) == 4
    assert aot.hbm_bytes_per_element("reverse_kl", 2, 0.5) == 10 - 2  # half of both tensors' second read
    assert aot.bytes_in_flight(2, 4096, 2, 1, 3) == 2 * 4096 * 2 * 3


def test_hbm_bytes_model() -> None:
    """Two reads and one write of the logits per valid row; the teacher read on both passes; a
    third pass for jensen_shannon; masked rows write zeros only."""
    aot = _report_module()
    assert aot.hbm_bytes("cross_entropy", 2, 1000, 3, 1) == (3 * 3 + 1) * 1000 * 2
    assert aot.hbm_bytes("entropy", 4, 10, 1) == 3 * 10 * 4
    assert aot.hbm_bytes("reverse_kl", 2, 10, 1) == 5 * 10 * 2
    assert aot.hbm_bytes("jensen_shannon", 2, 10, 1) == 7 * 10 * 2


KERNELS = ROOT / "torchloss" / "backends" / "triton_kernels.py"


def _hand_rounding_line() -> str:
    """The right-hand side of the hand rounding in the kernel source (``_round_for_store``)."""
    lines = [line.strip() for line in KERNELS.read_text().splitlines() if line.strip().startswith("bits = ((bits + 0x7FFF")]
    assert len(lines) == 1, lines
    return lines[0].split("=", 1)[1]


def test_bf16_hand_rounding_is_round_to_nearest_even() -> None:
    """The kernels' hand rounding (the interpreter's path, the kernel's own expression evaluated on
    uint32 like the GPU's integer unit) gives the bits of an IEEE round-to-nearest-even fp32 ->
    bf16 cast (torch's, the conversion ``cvt.rn.bf16.f32`` also makes) on every tie of every
    exponent (subnormals included, both parities), one unit either side of the ties, the
    subnormals, the overflow to inf and random patterns: so the compiled path, which leaves the
    rounding to the cast, stores the same bits."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    exponents = np.arange(255, dtype=np.uint32)  # 0: subnormals (and zero); 255 (inf / NaN) below
    high = np.array([0, 1, 2, 0x3F, 0x40, 0x7E, 0x7F], dtype=np.uint32)  # bf16's 7 mantissa bits
    low = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)  # 0x8000: the ties
    grid = (exponents[:, None, None] << 23) | (high[None, :, None] << 16) | low[None, None, :]
    bits = np.concatenate([grid.ravel(), rng.integers(0, 1 << 23, 4096, dtype=np.uint32),  # subnormals
                           rng.integers(0, 0x7F800001, 65536, dtype=np.uint32), np.array([0x7F800000], np.uint32)])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])  # both signs
    values = bits.view(np.float32)
    assert not np.isnan(values).any()
    rounded = eval(_hand_rounding_line(), {"bits": bits.copy()})  # noqa: S307  (the kernel's expression)
    assert rounded.dtype == np.uint32
    reference = torch.from_numpy(values.copy()).to(torch.bfloat16).float().numpy().view(np.uint32)
    np.testing.assert_array_equal(rounded, reference)
    ties = (bits & 0xFFFF) == 0x8000
    assert ties.sum() >= 2 * 255 * 7 and ((bits >> 23) & 0xFF == 0)[ties].any()  # subnormal ties checked
    assert np.isinf(rounded.view(np.float32)).sum() > 2  # the overflow to inf checked
    # Ties go to the even neighbour: 1 + 2**-8 lies halfway between 1 and 1 + 2**-7.
    one_tie = np.array([0x3F808000, 0x3F818000], np.uint32)
    np.testing.assert_array_equal(eval(_hand_rounding_line(), {"bits": one_tie}), [0x3F800000, 0x3F820000])  # noqa: S307


def test_ptxas_report_parsing() -> None:
    """The resources of a ``ptxas -v`` report (as Triton prints it with TRITON_DUMP_PTXAS_LOG, or
    as ``ptxas_resources`` reads it), and no resources from text without one (a kernel from
    Triton's cache: the report then assembles the PTX itself)."""
    aot = _report_module()
    report = ("ptxas info    : 0 bytes gmem\n"
              "ptxas info    : Compiling entry function 'fused_kernel' for 'sm_90a'\n"
              "ptxas info    : Function properties for fused_kernel\n"
              "    24 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads\n"
              "ptxas info    : Used 96 registers, used 1 barriers, 24 bytes cumulative stack size\n")
    assert aot.parse_ptxas_report(report) == (96, 24, 8, 16)
    assert aot.parse_ptxas_report(report.replace("24 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads",
                                                 "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")) == (96, 0, 0, 0)
    assert aot.parse_ptxas_report("") is None
    assert aot.parse_ptxas_report("ptxas info    : 0 bytes gmem\n") is None
