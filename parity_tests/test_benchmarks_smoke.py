"""The benchmark runner end to end on a tiny shape: JSON, Markdown and PNGs written, figures sane,
and the report's rules (spreads, a floor below every contender, verdicts only beyond the noise).

The real runs (``python -m benchmarks.run --quick`` and the full matrix) take minutes to hours;
this only proves the machinery: one JAX and one torch cell process, ours + the plain peers + the
speed-of-light passes, 256 x 4096 cross-entropy in bf16 (so that the 0%-masked rows are planned), two
interleaved rounds (about 20 s of CPU).
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lossspec

from benchmarks._report import NOISE, ratio_range, verdict
from benchmarks._registry import BACKENDS, KINDS, Spec
from benchmarks._worker import numpy_inputs, round_order, token_mask

ROOT = Path(__file__).resolve().parents[1]

# find_spec, not importorskip: importing JAX and torch here would cost seconds of the budget.
needs_frameworks = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("jax", "torch", "optax", "matplotlib")),
    reason="needs jax, torch, optax and matplotlib",
)


def test_verdict_only_beyond_the_noise() -> None:
    # ours <= 0.6 * ref: met only when our slowest is within 0.6x the reference's fastest.
    assert verdict((50.0, 55.0, 59.0), (100.0, 110.0, 120.0), 0.6, True) == "met"
    assert verdict((50.0, 55.0, 61.0), (100.0, 110.0, 120.0), 0.6, True) == NOISE
    # missed only when our fastest is beyond 0.6x the reference's slowest.
    assert verdict((73.0, 80.0, 90.0), (100.0, 110.0, 120.0), 0.6, True) == "MISS"
    assert verdict((71.0, 80.0, 90.0), (100.0, 110.0, 120.0), 0.6, True) == NOISE
    assert verdict((1.0, 1.0, 1.0), (100.0, 110.0, 120.0), 0.6, False).startswith("too few reps")
    assert ratio_range((2.0, 3.0, 4.0), (1.0, 2.0, 8.0)) == (0.25, 1.5, 4.0)


def test_rounds_rotate_every_contender_through_every_place() -> None:
    orders = [round_order(3, r) for r in range(3)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert all(sorted(o[k] for o in orders) == [0, 1, 2] for k in range(3))


@needs_frameworks
def test_runner_writes_sane_results(tmp_path: Path) -> None:
    backends = "jaxloss-xla,optax,jax-sol,torchloss,torch-eager,torch-sol"
    cmd = [sys.executable, "-m", "benchmarks.run", "--shapes", "256x4096", "--kinds", "cross_entropy",
           "--dtypes", "bfloat16", "--backends", backends, "--reps", "2", "--sol-reps", "2",
           "--out-dir", str(tmp_path), "--name", "smoke", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Summary" in proc.stdout and "expected run time ~" in proc.stdout

    data = json.loads((tmp_path / "smoke.json").read_text())
    meta, results, summary = data["meta"], data["results"], data["summary"]
    assert meta["machine"]["versions"]["jax"] and meta["machine"]["versions"]["torch"]
    assert meta["machine"]["cpu_count"] >= 1 and meta["finished"] and meta["expected_s"] > 0
    git = meta["machine"]["git"]
    assert len(git["commit"]) == 40 and isinstance(git["dirty"], bool)
    assert len(meta["load_average_start"]) == 3 and len(meta["load_average_end"]) == 3
    # torchloss skips masked rows of 16-bit logits: the torch cell is measured at 30% and 0% masked,
    # the JAX cell (nothing skipped) at 30% only; the speed-of-light passes read no mask.
    planned = sorted((r["spec"]["backend"], r["spec"]["masked"]) for r in results)
    assert planned == sorted([("jaxloss-xla", 0.3), ("optax", 0.3), ("jax-sol", None), ("torch-sol", None)]
                             + [(b, m) for b in ("torchloss", "torch-eager") for m in (0.3, 0.0)])
    floor = min(r["min_s"] for r in results if r["spec"]["backend"].endswith("-sol"))
    for r in results:
        assert r["status"] == "ok", r
        sol = r["spec"]["backend"].endswith("-sol")
        assert r["reps"] == (4 if sol else 2) and len(r["times_s"]) == r["reps"] and all(t > 0 for t in r["times_s"])
        assert r["min_s"] == min(r["times_s"]) <= r["time_s"] <= r["max_s"] == max(r["times_s"])
        assert r["mem_extra_bytes"] is not None and r["mem_extra_bytes"] >= 0
        assert math.isfinite(r["mem_logits_buffers"])
        if sol:  # it writes into a buffer faulted in beforehand: no fresh logits-sized output
            assert r["loss"] is None and r["mem_logits_buffers"] < 0.5, r
        else:  # every contender computes the same masked mean; none beats the floor
            assert math.isfinite(r["loss"]) and r["loss_agrees"], r
            assert r["vs_sol"] == pytest.approx(r["time_s"] / floor) and not r["below_sol_floor"]
    ours = {r["spec"]["masked"]: r for r in results if r["spec"]["backend"] == "torchloss"}
    assert ours[0.3]["loss"] != ours[0.0]["loss"]  # the masks differ
    jax_ours = next(r for r in results if r["spec"]["backend"] == "jaxloss-xla")
    assert jax_ours["xla_memory_analysis"]["output_bytes"] >= 256 * 4096 * 2  # the gradient
    assert jax_ours["best_peer"] == "optax" and jax_ours["vs_best_peer"] > 0

    assert [(r["framework"], r["masked"]) for r in summary] == [("jax", 0.3), ("torch", 0.3), ("torch", 0.0)]
    for row in summary:
        assert row["sol_s"] == floor and row["ours_spread_s"][0] <= row["ours_s"] <= row["ours_spread_s"][2]
        lo, mid, hi = row["vs_best_peer_range"]
        assert lo <= mid <= hi and "meets_mem_target" in row
        # Two repetitions: no verdict words, only the reason.
        assert row["peer_verdict"].startswith("too few reps") and row["sol_verdict"].startswith("too few reps")

    md = (tmp_path / "smoke.md").read_text()
    assert f"commit `{git['commit']}`" in md and "load average (" in md
    assert "| 256x4096 | bfloat16 | CE | torch | 0% | torchloss |" in md
    assert "Masking, both ways:" in md and "WARNING: fewer than 7 repetitions" in md
    assert "All measurements:" in md  # the summary ends where the full table starts
    for suffix in ("_time.png", "_memory.png"):
        png = tmp_path / f"smoke{suffix}"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_every_kind_of_the_table_is_benchmarked() -> None:
    """The benchmarks take their kinds from lossspec's kind table: a new kind is benchmarked by
    our backends and the eager / compiled peers without a change here."""
    assert KINDS == lossspec.ALL_KINDS
    for name in ("jaxloss-xla", "torchloss", "optax", "torch-eager", "torch-compile", "jax-sol", "torch-sol"):
        assert BACKENDS[name].kinds == KINDS, name


@needs_frameworks
@pytest.mark.parametrize("kind", ["entropy", "jensen_shannon"])
def test_entropy_and_jsd_contenders_compute_the_oracle_loss(tmp_path: Path, kind: str) -> None:
    """The peers' expressions for the newer kinds (written from their formulas) and ours give the
    float64 oracle's masked mean on the benchmark's own inputs."""
    import lossspec

    backends = "jaxloss-xla,optax,torchloss,torch-eager"
    n, v = 64, 512
    cmd = [sys.executable, "-m", "benchmarks.run", "--shapes", f"{n}x{v}", "--kinds", kind, "--dtypes", "float32",
           "--backends", backends, "--reps", "1", "--masked", "0.3", "--out-dir", str(tmp_path), "--name", "kinds",
           "--device", "cpu", "--no-plots"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "kinds.json").read_text())["results"]
    assert sorted(r["spec"]["backend"] for r in results) == sorted(backends.split(","))
    raw = numpy_inputs(Spec(backend="torchloss", kind=kind, n=n, v=v, dtype="float32"))
    logits = raw["logits_block"][:n].astype(np.float64)
    teacher = raw["teacher_block"][:n].astype(np.float64) if "teacher_block" in raw else None
    mask = token_mask(n, 0.3, 0)
    ref, _ = lossspec.oracle(kind, logits, teacher, mask)
    for r in results:
        assert r["status"] == "ok", r
        lossspec.compare_loss(np.float64(r["loss"]), ref, f"{r['spec']['backend']} {kind}").check()


@needs_frameworks
@pytest.mark.slow  # one JAX and one torch cell process, tokamax imported
def test_tensor_head_contenders_compute_the_oracle_loss(tmp_path: Path) -> None:
    """The fused heads with ``precision="tensor"`` meet the tensor contract's loss bound on the
    benchmark's own bf16 inputs (30% masked); tokamax's head, which takes no mask, is within
    bf16 rounding of the oracle's unmasked mean (its XLA dot rounds the logits to bf16)."""
    import lossspec
    from lossspec import linear as spec_linear

    backends = "head-jaxloss-fused-tensor,head-torchloss-fused-tensor,head-tokamax"
    n, v, hidden = 64, 512, 32
    cmd = [sys.executable, "-m", "benchmarks.run", "--shapes", f"{n}x{v}", "--hidden", str(hidden), "--kinds", "cross_entropy",
           "--dtypes", "bfloat16", "--backends", backends, "--reps", "1", "--masked", "0.3", "--out-dir", str(tmp_path),
           "--name", "tensor", "--device", "cpu", "--no-plots"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "tensor.json").read_text())["results"]
    assert sorted(r["spec"]["backend"] for r in results) == sorted(backends.split(","))
    raw = numpy_inputs(Spec(backend="head-jaxloss-fused-tensor", kind="cross_entropy", n=n, v=v, dtype="bfloat16", hidden=hidden))
    h, w = (lossspec.round_to_dtype(raw[name], "bfloat16") for name in ("hidden", "weight"))
    for r in results:
        assert r["status"] == "ok", r
        if r["spec"]["backend"] == "head-tokamax":
            ref, _ = lossspec.oracle("cross_entropy", spec_linear.head_logits(h, w), raw["labels"])
            assert abs(r["loss"] - ref) <= 2.0**-7 * abs(ref), (r["loss"], ref)
            continue
        ref, grads = spec_linear.oracle_head("cross_entropy", h, w, raw["labels"], token_mask(n, 0.3, 0), precision="tensor")
        spec_linear.compare_head_loss(np.float64(r["loss"]), ref, grads.loss_slack, r["spec"]["backend"]).check()


def _fake(backend: str, seconds: tuple[float, float, float], mem: int | None = None, masked: float | None = 0.3) -> dict:
    spec = {"backend": backend, "kind": "cross_entropy", "n": 4096, "v": 32768, "dtype": "float32", "device": "cpu",
            "hidden": 1024, "masked": None if backend.endswith("sol") else masked}
    return {"spec": spec, "status": "ok", "min_s": seconds[0], "time_s": seconds[1], "max_s": seconds[2], "reps": 7,
            "mem_extra_bytes": mem}


def test_fused_head_rows_judge_against_their_own_frameworks_matmuls() -> None:
    from benchmarks._report import annotate, summarize

    logits = 4096 * 32768 * 4
    head_grads = (4096 + 32768) * 1024 * 4
    results = [
        _fake("head-torchloss-fused", (1.10, 1.12, 1.14), mem=head_grads + logits // 10),
        _fake("head-torchloss", (1.5, 1.6, 1.7), mem=logits),
        _fake("head-eager", (2.0, 2.1, 2.2), mem=3 * logits),
        _fake("head-matmul-sol", (1.00, 1.01, 1.02)),
        _fake("head-jaxloss-fused", (1.40, 1.45, 1.50), mem=head_grads + logits // 4),
        # faster matmuls in the other framework must not judge torch's head
        _fake("head-jax-matmul-sol", (0.5, 0.5, 0.5)),
    ]
    annotate(results)
    rows = {r["framework"]: r for r in summarize(results) if r["dtype"] == "float32"}
    torch_row, jax_row = rows["torch"], rows["jax"]
    assert torch_row["ours"] == "head-torchloss-fused" and torch_row["best_peer"] == "head-eager"
    assert torch_row["head_sol_verdict"] == "met"  # 1.14 <= 1.15 * 1.00
    assert torch_row["meets_mem_target"] is True  # 1/10 of a logits buffer + the head's gradients
    assert jax_row["head_sol_verdict"] == "MISS"  # 1.40 > 1.15 * 0.5
    assert jax_row["meets_mem_target"] is False  # 1/4 of a logits buffer > 1/8
    assert math.isclose(torch_row["vs_sol"], 1.12 / 1.00)


def test_busy_summary_ratios_are_medians_over_medians() -> None:
    from benchmarks.busy import summary

    times = {"quiet": {"torchloss": [0.1, 0.3, 0.2], "F.cross_entropy": [0.4, 0.5, 0.6]},
             "busy": {"torchloss": [0.9, 0.6, 0.8], "F.cross_entropy": [1.0, 2.0, 1.5]}}
    rows = summary(times)
    assert math.isclose(rows["torchloss"]["quiet_ms"], 200.0) and math.isclose(rows["torchloss"]["busy_ms"], 800.0)
    assert math.isclose(rows["torchloss"]["busy_over_quiet"], 4.0)
    assert math.isclose(rows["F.cross_entropy"]["busy_over_quiet"], 3.0)
    assert math.isclose(rows["torchloss"]["quiet_vs_eager"], 0.4) and math.isclose(rows["torchloss"]["busy_vs_eager"], 0.8 / 1.5)


def test_busy_spinners_are_always_stopped() -> None:
    """The competing load is bounded: stopped when the block ends, even by an exception, and each
    spinner ends itself at its deadline anyway."""
    from benchmarks.spinners import Spinners

    with pytest.raises(RuntimeError):
        with Spinners(2, 60.0) as spinners:
            procs = list(spinners.procs)
            assert len(procs) == 2 and all(p.poll() is None for p in procs)  # spinning
            raise RuntimeError("a contender failed")
    assert all(p.returncode is not None for p in procs)
    with Spinners(1, 0.5) as spinners:
        (proc,) = spinners.procs
        assert proc.wait(timeout=30) == 0  # its own deadline ends it


@needs_frameworks
def test_busy_benchmark_writes_its_row(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.busy", "--shapes", "64x2048,32x1024", "--calls", "2", "--reps", "1", "--busy", "1",
           "--busy-seconds", "60", "--out-dir", str(tmp_path), "--name", "busy_smoke"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "busy_smoke.json").read_text())
    assert [run["shape"] for run in record["runs"]] == [[64, 2048], [32, 1024]]
    for run in record["runs"]:
        assert set(run["times_s"]) == {"quiet", "busy"}
        assert all(len(times) == 2 and min(times) > 0 for cond in run["times_s"].values() for times in cond.values())
    assert (tmp_path / "busy_smoke.md").read_text().count("| torchloss |") == 2


def test_timings_page_keeps_the_idle_and_the_busy_tables_apart(tmp_path: Path) -> None:
    """scripts/measure_times.py: an idle run rewrites the idle table and keeps the section beside a
    competing load; a ``--busy`` run rewrites only that section."""
    from scripts.measure_times import BUSY_SECTION, write_table

    page = tmp_path / "timings.md"
    row = {"fast": {"time": "1:00", "load": "0 -> 0", "result": "10 passed"}}
    write_table(page, row, "aaaaaaa", "")
    assert BUSY_SECTION not in page.read_text() and "| 1:00 |" in page.read_text()
    write_table(page, {"fast": dict(row["fast"], time="3:00")}, "bbbbbbb", "", busy=2)
    text = page.read_text()
    idle, busy = text.split(BUSY_SECTION)
    assert "| 1:00 |" in idle and "`aaaaaaa`" in idle and "| 3:00 |" in busy and "`bbbbbbb`" in busy and "--busy 2" in busy
    write_table(page, {"fast": dict(row["fast"], time="2:00")}, "ccccccc", "")
    idle, busy = page.read_text().split(BUSY_SECTION)
    assert "| 2:00 |" in idle and "| 1:00 |" not in idle and "| 3:00 |" in busy and "`bbbbbbb`" in busy


def test_in_place_contender_is_timed_on_fresh_logits_and_without_the_copy() -> None:
    """An in-place contender (Liger's cross-entropy, our ``inplace=True``) writes its gradient into
    the logits: before every call ``prepare`` restores them from the pristine ones, and the clock
    does not see that copy."""
    import time

    import torch

    from benchmarks._worker import Bench, FreshLogits, _call

    pristine = torch.arange(12, dtype=torch.float32).reshape(3, 4).requires_grad_(True)
    fresh = FreshLogits(pristine, leaf=True)
    seen: list[torch.Tensor] = []

    def slow_restore() -> None:
        time.sleep(0.2)  # a copy far slower than the call: it must not be in the timed seconds
        fresh.restore()

    def step() -> float:
        logits = fresh()
        seen.append(logits.detach().clone())
        with torch.no_grad():
            logits.mul_(-1e-3)  # the "gradient", written over the logits
        return 1.0

    bench = Bench()
    bench.step, bench.prepare, bench.loss_value = step, slow_restore, float
    timed = [_call(bench) for _ in range(3)]
    assert all(seconds < 0.2 and loss == 1.0 for seconds, loss in timed), timed
    assert len(seen) == 3 and all(torch.equal(x, pristine.detach()) for x in seen)
    assert torch.equal(pristine.detach(), torch.arange(12, dtype=torch.float32).reshape(3, 4))  # never written
    # Our inplace=True refuses a leaf: its copies are the output of an operation.
    fresh = FreshLogits(pristine, leaf=False)
    fresh.restore()
    assert not fresh().is_leaf and fresh().is_contiguous() and fresh().data_ptr() != pristine.data_ptr()


def test_liger_cross_entropy_sees_the_cells_logits_in_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's Liger contender end to end, with a stand-in for Liger's cross-entropy that, like
    Liger's, writes the gradient into its input (and records what it received): the warm-up, the
    memory call and every timed repetition get the cell's logits, never an earlier call's gradient,
    and every repetition's loss is the same."""
    import types

    import torch

    from benchmarks import _worker

    received: list[torch.Tensor] = []

    class InPlaceCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, labels):  # type: ignore[override]
            received.append(x.detach().clone())
            valid = labels != -100
            safe = torch.where(valid, labels, 0)
            log_p = torch.log_softmax(x, -1)
            count = valid.sum()
            loss = -(log_p.gather(1, safe[:, None])[:, 0] * valid).sum() / count
            grad = (log_p.exp() - torch.nn.functional.one_hot(safe, x.shape[1])) * valid[:, None] / count
            x.copy_(grad)  # as Liger: the gradient goes into the logits' buffer
            ctx.save_for_backward(x.detach())
            return loss

        @staticmethod
        def backward(ctx, upstream):  # type: ignore[override]
            (grad,) = ctx.saved_tensors
            return grad * upstream, None

    functional = types.SimpleNamespace(liger_cross_entropy=InPlaceCrossEntropy.apply)
    package = types.ModuleType("liger_kernel")
    transformers = types.ModuleType("liger_kernel.transformers")
    transformers.functional = functional  # type: ignore[attr-defined]
    package.transformers = transformers  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers)

    class NoMemory:  # the test process's own peak counter is not reset (the suite reports it)
        method = "none"

        def start(self) -> None: ...

        def stop(self) -> None:
            return None

        def baseline(self) -> None:
            return None

    monkeypatch.setattr(_worker, "HostMemory", NoMemory)
    spec = Spec("liger", "cross_entropy", 64, 128, "float32", device="cpu", reps=3)
    (result,) = _worker.measure_cell([spec])
    assert result["status"] == "ok", result
    pristine = torch.from_numpy(numpy_inputs(spec)["logits_block"])
    assert len(received) == 1 + 1 + 3  # warm-up, memory, three repetitions
    assert all(torch.equal(x, pristine) for x in received)
    assert result["rep_losses"] == [result["loss"]] * 3 and result["timer"].startswith("host wall clock")


def test_two_read_one_write_floor_and_the_gpu_targets() -> None:
    """The floor's bytes (issue 32's figures at 16384 x 131072 bf16, 30% masked), its seconds from
    the copy rate of the speed-of-light pass, and the GPU verdicts: cross-entropy against Liger
    (0.85x) and its floor (1.1x), the other kinds against theirs (1.15x), Pallas against Triton
    (1.1x); every contender's memory in the row; a loss that moves between repetitions flagged."""
    from benchmarks._registry import floor_bytes
    from benchmarks._report import annotate, summarize, summary_notes, summary_table

    n, v = 16384, 131072
    assert round(floor_bytes(n, v, "bfloat16", "cross_entropy", 0.3) / 1e9, 1) == 10.3
    assert round(floor_bytes(n, v, "bfloat16", "entropy", 0.3) / 1e9, 1) == 10.3
    assert round(floor_bytes(n, v, "bfloat16", "forward_kl", 0.3) / 1e9, 1) == 16.3
    assert floor_bytes(n, v, "bfloat16", "cross_entropy", 0.0) == 3 * n * v * 2

    def gpu(backend: str, kind: str, seconds: tuple[float, float, float], mem: float | None = 1.0) -> dict:
        spec = {"backend": backend, "kind": kind, "n": n, "v": v, "dtype": "bfloat16", "device": "gpu", "hidden": 4096,
                "masked": None if backend.endswith("sol") else 0.3}
        lb = n * v * 2
        return {"spec": spec, "status": "ok", "min_s": seconds[0], "time_s": seconds[1], "max_s": seconds[2], "reps": 7,
                "mem_extra_bytes": None if mem is None else int(mem * lb), "loss": 1.0, "rep_losses": [1.0] * 7}

    copy = 2 * n * v * 2 / 2.0e-3  # the CE pass moves 2 buffers in 2 ms
    ce_floor = floor_bytes(n, v, "bfloat16", "cross_entropy", 0.3) / copy
    kl_floor = floor_bytes(n, v, "bfloat16", "forward_kl", 0.3) / (3 * n * v * 2 / 3.0e-3)
    results = [
        gpu("torch-sol", "cross_entropy", (2.0e-3, 2.1e-3, 2.2e-3), mem=0.0),
        gpu("torchloss-triton", "cross_entropy", (1.00 * ce_floor, 1.02 * ce_floor, 1.05 * ce_floor)),
        gpu("torchloss-triton-inplace", "cross_entropy", (1.0 * ce_floor, 1.02 * ce_floor, 1.05 * ce_floor), mem=0.0),
        gpu("liger", "cross_entropy", (1.3 * ce_floor, 1.35 * ce_floor, 1.4 * ce_floor), mem=0.0),
        gpu("jax-sol", "cross_entropy", (2.5e-3, 2.6e-3, 2.7e-3), mem=0.0),
        gpu("jaxloss-pallas", "cross_entropy", (1.2 * ce_floor, 1.25 * ce_floor, 1.3 * ce_floor)),
        gpu("torch-sol", "forward_kl", (3.0e-3, 3.1e-3, 3.2e-3), mem=0.0),
        gpu("torchloss-triton", "forward_kl", (1.2 * kl_floor, 1.25 * kl_floor, 1.3 * kl_floor)),
        gpu("torch-eager", "forward_kl", (3 * kl_floor, 3 * kl_floor, 3 * kl_floor), mem=3.0),
    ]
    results[-1]["rep_losses"][3] = 7.0  # a stale input
    annotate(results)
    triton = results[1]
    assert triton["floor_source"] == "torch-sol" and math.isclose(triton["floor_s"], ce_floor)
    assert math.isclose(triton["vs_floor"], 1.02)
    rows = {(r["framework"], r["kind"]): r for r in summarize(results)}
    ce, pallas, kl = rows[("torch", "cross_entropy")], rows[("jax", "cross_entropy")], rows[("torch", "forward_kl")]
    assert ce["floor_verdict"] == "met" and ce["liger_verdict"] == "met"  # 1.05 <= 1.1; 1.05 <= 0.85 * 1.3
    assert ce["mem_buffers"] == {"torchloss-triton": 1.0, "torchloss-triton-inplace": 0.0, "liger": 0.0}
    assert pallas["floor_verdict"] == "MISS" and "liger_verdict" not in pallas  # 1.2 > 1.1
    assert pallas["triton_verdict"] == "MISS" and math.isclose(pallas["vs_triton"], 1.25 / 1.02)
    assert kl["floor_verdict"] == "MISS" and kl["unstable_losses"] == ["torch-eager"]  # 1.2 > 1.15
    table, notes = summary_table(list(rows.values())), summary_notes(list(rows.values()))
    assert "liger 0.00" in table and "torchloss-triton-inplace 0.00" in table
    assert "cross-entropy <= 0.85x Liger (torch): met 1" in notes and "Pallas <= 1.1x Triton: MISS 1" in notes
    assert "loss changed between repetitions" in notes and "HBM bandwidth:" not in notes


def test_gpu_check_short_dry_run_plans_without_running() -> None:
    """``benchmarks/gpu_check.sh --short --dry-run`` parses, prints its plan (the kernel suites, the
    sweep, the benchmark rows at the issue's shape) and exits 0 without running anything; without
    a GPU it says so."""
    import shutil

    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    proc = subprocess.run(["bash", str(script), "--short", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "plan (short mode, budget 360 s)" in out and "dry run: nothing run" in out
    assert "test_jaxloss_kernels.py" in out and "benchmarks.gpu_triton_sweep --max-seconds 45 --grid pipeline --reps 10" in out
    assert "test_contract_kinds.py::test_nan_and_inf_rows" in out  # the Pallas kernels' NaN rows on the GPU
    assert "test_jaxloss_upstream_16bit.py" in out  # the Pallas 16-bit backward from the kept statistics
    assert "benchmarks.run --gpu-quick --name gpu_quick_short --no-head" in out
    if shutil.which("nvidia-smi") is None:
        assert "no NVIDIA GPU visible" in out


def test_gpu_check_full_dry_run_plans_both_sweeps() -> None:
    """``benchmarks/gpu_check.sh --dry-run`` (the full mode): the Triton sweep's two grids with the
    head, then the Pallas sweep, then the benchmark."""
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "plan (full mode, budget 600 s)" in out
    triton, pallas, bench = (out.index(s) for s in ("benchmarks.gpu_triton_sweep --max-seconds 60 --grid all --head",
                                                     "benchmarks.gpu_pallas_sweep --max-seconds 45", "benchmarks.run --gpu-quick"))
    assert triton < pallas < bench


def test_gpu_check_head_dry_run_plans_the_head_rows() -> None:
    """``benchmarks/gpu_check.sh --head --dry-run``: issue 33's plan (the head's suites, the matmul
    probe, the head rows at the GPU shape), every contender it names known to the registry and a
    head contender (a misspelt name would measure nothing on a lent GPU's only run)."""
    import re

    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--head", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "plan (head mode, budget 360 s)" in out and "test_linear_head_tensor.py" in out and "benchmarks.gpu_matmul_probe" in out
    named = re.search(r"--backends (\S+)", out).group(1).split(",")
    assert {"head-torchloss-fused-tensor", "head-jaxloss-fused-tensor", "head-liger", "head-cce", "head-tokamax"} <= set(named)
    assert all(name in BACKENDS and BACKENDS[name].group == "head" and "gpu" in BACKENDS[name].devices for name in named), named


@pytest.mark.slow  # interpreted Triton kernels, 12 launch configurations
def test_triton_sweep_pipeline_grid_runs_and_changes_no_bit(tmp_path: Path) -> None:
    """``python -m benchmarks.gpu_triton_sweep --grid pipeline`` (what ``gpu_check.sh --short``
    runs on a lent GPU, whose one run must not be lost to a broken script), here on CPU tensors
    through the Triton interpreter: every configuration (num_stages 1-3 x programs: one per row,
    1, 2, 4 x the multiprocessors) runs, and gives the default's loss and gradient bit for bit."""
    from benchmarks import gpu_triton_sweep

    out = tmp_path / "sweep.json"
    assert gpu_triton_sweep.main(["--n", "6", "--v", "40", "--reps", "1", "--kinds", "cross_entropy", "--grid", "pipeline",
                                  "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(gpu_triton_sweep.STAGES) * len(gpu_triton_sweep.PROGRAMS_PER_SM)
    assert {(r.get("num_stages", 1), r.get("programs")) for r in rows} == {
        (stages, None if per_sm is None else 2 * per_sm) for stages in gpu_triton_sweep.STAGES for per_sm in gpu_triton_sweep.PROGRAMS_PER_SM}
    for r in rows:
        assert "error" not in r, r
        assert r["loss_rel_diff"] == 0 and r["grad_max_abs_diff"] == 0 and r["grad_max_abs"] > 0, r
    # the 16-bit backward with a non-unit upstream gradient, timed beside the unit one
    [upstream] = json.loads(out.read_text())["upstream"]
    assert upstream["kind"] == "cross_entropy" and upstream["unit_ms"] > 0 and upstream["half_ms"] > 0


@pytest.mark.slow  # interpreted Pallas kernels, a JAX compile per configuration
def test_pallas_sweep_programs_grid_runs_and_changes_no_bit(tmp_path: Path) -> None:
    """``python -m benchmarks.gpu_pallas_sweep --grid programs`` (``gpu_check.sh``'s full mode on
    a lent GPU) in Pallas interpret mode: every configuration (one program per block of rows,
    1, 2, 4 x the multiprocessors) runs and gives the default's loss and gradient bit for bit,
    and the shapes grid names valid block shapes."""
    from benchmarks import gpu_pallas_sweep

    out = tmp_path / "sweep.json"
    assert gpu_pallas_sweep.main(["--n", "6", "--v", "40", "--reps", "1", "--kinds", "reverse_kl", "--grid", "programs",
                                  "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r.get("programs") for r in rows] == [None, 2, 4, 8]  # 2 "multiprocessors" off a GPU
    for r in rows:
        assert "error" not in r, r
        assert r["loss_rel_diff"] == 0 and r["grad_max_abs_diff"] == 0 and r["grad_max_abs"] > 0, r
    shapes = gpu_pallas_sweep.configs("shapes", 132)
    assert len(shapes) == 24 and all(lossspec.Tuning(**fields) for fields in shapes)
