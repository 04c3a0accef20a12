"""What the launch-shape sweeps share (:mod:`benchmarks.gpu_triton_sweep`, :mod:`benchmarks.gpu_pallas_sweep`):
the loop over one kind's configurations within a time budget, a row per configuration compared
with the first's results, its printed line, and the best configuration. Framework-free: each
sweep measures with its own framework."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

#: The :class:`lossspec.Tuning` fields the sweeps vary, in the order their labels name them.
KNOBS = ("block_rows", "vocab_block", "num_warps", "num_stages", "programs")


def label(fields: dict[str, Any]) -> str:
    """``"vocab_block=4096 num_warps=8"``; ``"default"`` for no field."""
    return " ".join(f"{k}={fields[k]}" for k in KNOBS if k in fields) or "default"


def sweep_kind(
    kind: str,
    configurations: list[dict[str, Any]],
    measure: Callable[[dict[str, Any]], tuple[float, Any, list[float], dict[str, Any]]],
    grad_stats: Callable[[Any, Any], tuple[float, float]],
    *,
    started: float,
    max_seconds: Optional[float],
) -> list[dict[str, Any]]:
    """One row per configuration of ``kind`` (its Tuning fields, then the timings or the error):
    ``measure(fields)`` returns ``(loss, grad, times_ms, extra)``; the first configuration's loss
    and gradient are the reference, ``grad_stats(grad, reference_grad)`` gives ``(max |grad -
    reference|, max |reference|)``. Configurations that would start after ``max_seconds`` from
    ``started`` are skipped (a row says so). Prints a line per row and the best configuration."""
    rows: list[dict[str, Any]] = []
    reference = None
    for fields in configurations:
        if max_seconds is not None and time.perf_counter() - started > max_seconds:
            rows.append({"kind": kind, **fields, "error": "skipped: time budget"})
            continue
        try:
            loss, grad, times, extra = measure(fields)
            if reference is None:
                reference = (loss, grad)
            diff, biggest = grad_stats(grad, reference[1])
            row = {"kind": kind, **fields, "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                   **extra, "loss": loss, "loss_rel_diff": abs(loss - reference[0]) / max(abs(reference[0]), 1e-30),
                   "grad_max_abs_diff": diff, "grad_max_abs": biggest}
        except Exception as exc:  # a launch shape the compiler refuses (registers, shared memory)
            row = {"kind": kind, **fields, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        rows.append(row)
        if "error" in row:
            print(f"{kind:18} {label(fields):40}: {row['error']}", flush=True)
        else:
            print(f"{kind:18} {label(fields):40}: {row['min_ms']:8.3f} / {row['median_ms']:8.3f} / {row['max_ms']:8.3f} ms  "
                  f"loss rel diff {row['loss_rel_diff']:.1e}  grad max diff {row['grad_max_abs_diff']:.1e} "
                  f"(max |grad| {row['grad_max_abs']:.1e})", flush=True)
    ok = [r for r in rows if "error" not in r]
    if ok:
        best = min(ok, key=lambda r: r["median_ms"])
        default = next((r for r in ok if not set(r) & set(KNOBS)), None)
        print(f"{kind}: best {label(best)} {best['median_ms']:.3f} ms" + (f"; default {default['median_ms']:.3f} ms" if default else ""),
              flush=True)
    return rows
