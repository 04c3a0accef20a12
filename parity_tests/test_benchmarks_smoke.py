"""The benchmark runner end to end on a tiny shape: JSON, Markdown and PNGs written, figures sane.

The real runs (``python -m benchmarks.run --quick`` and the full matrix) take minutes to hours;
this only proves the machinery: one JAX and one torch worker process (``--one-process-per-framework``),
one or two repetitions, ours + the plain peers + the speed-of-light passes, cross-entropy (about
10 s of CPU).
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# find_spec, not importorskip: importing JAX and torch here would cost seconds of the budget.
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("jax", "torch", "optax", "matplotlib")),
    reason="needs jax, torch, optax and matplotlib",
)


def test_runner_writes_sane_results(tmp_path: Path) -> None:
    backends = "jaxloss-xla,optax,jax-sol,torchloss,torch-eager,torch-sol"
    cmd = [sys.executable, "-m", "benchmarks.run", "--shapes", "64x512", "--kinds", "cross_entropy",
           "--dtypes", "float32", "--backends", backends, "--warmup", "1", "--min-reps", "1", "--max-reps", "2",
           "--rep-seconds", "0", "--out-dir", str(tmp_path), "--name", "smoke", "--device", "cpu",
           "--one-process-per-framework"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Summary" in proc.stdout

    data = json.loads((tmp_path / "smoke.json").read_text())
    meta, results, summary = data["meta"], data["results"], data["summary"]
    assert meta["machine"]["versions"]["jax"] and meta["machine"]["versions"]["torch"]
    assert meta["machine"]["cpu_count"] >= 1 and meta["finished"]
    assert len(results) == 6  # 6 backends, each measured
    for r in results:
        assert r["status"] == "ok", r
        assert 0 < r["time_s"] < 30 and r["reps"] >= 1 and all(t > 0 for t in r["times_s"])
        assert r["mem_extra_bytes"] is not None and r["mem_extra_bytes"] >= 0
        assert math.isfinite(r["mem_logits_buffers"])
        if r["spec"]["backend"].endswith("-sol"):
            assert r["loss"] is None
        else:  # every contender computes the same masked mean
            assert math.isfinite(r["loss"]) and r["loss_agrees"], r
    jax_ours = next(r for r in results if r["spec"]["backend"] == "jaxloss-xla" and r["spec"]["kind"] == "cross_entropy")
    assert jax_ours["xla_memory_analysis"]["output_bytes"] >= 64 * 512 * 4  # the gradient
    assert jax_ours["best_peer"] == "optax" and jax_ours["vs_best_peer"] > 0 and jax_ours["vs_sol"] > 0

    assert len(summary) == 2  # jax, torch
    for row in summary:
        assert row["ours_s"] > 0 and row["best_peer_s"] > 0 and row["sol_s"] > 0
        assert row["vs_best_peer"] > 0 and "meets_mem_target" in row
        # The peer target is flagged as out of reach exactly when 0.6x the peer is below the SOL pass.
        assert row["peer_target_below_sol"] == (0.6 * row["best_peer_s"] < row["sol_s"])

    md = (tmp_path / "smoke.md").read_text()
    assert "| 64x512 | float32 | CE | jax | jaxloss-xla |" in md
    assert "Targets (CPU): ours/peer <= 0.6 met in " in md and " of 2 rows;" in md
    for suffix in ("_time.png", "_memory.png"):
        png = tmp_path / f"smoke{suffix}"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
