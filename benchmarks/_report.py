"""Summaries, tables (plain text and Markdown) and plots of a benchmark run's results.

Every time is a spread of interleaved repetitions (min / median / max). A verdict on a target
(``met`` / ``MISS``) is given only where the spreads say it: ``ours <= k * ref`` is met when even
our slowest repetition is within k times the reference's fastest, missed when even our fastest is
beyond k times its slowest, and "within noise" otherwise."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from benchmarks._registry import BACKENDS, DISTILL, ITEMSIZE, KINDS, LABELS, MIN_REPS, SHORT_KIND, floor_bytes, nominal_hbm_bandwidth

# Targets of the issue (measured, not asserted).
CPU_PEER_RATIO = 0.6
CPU_SOL_RATIO = 1.3
MEM_UNITS = 1.0
# The fused LM head (issue #14): time <= 1.15x the three head matmuls, extra memory <= 1/8 of a
# logits buffer (plus the head's own gradients, which are outputs).
HEAD_SOL_RATIO = 1.15
HEAD_MEM_UNITS = 0.125
FUSED_HEADS = (
    "head-torchloss-fused", "head-jaxloss-fused", "head-torchloss-fused-bf16mm", "head-jaxloss-fused-bf16mm",
    "head-torchloss-fused-recompute", "head-jaxloss-fused-recompute",
)
MEM_SLACK = (0.02, 16 << 20)  # allocator/page rounding: 2% of a logits buffer or 16 MiB, whichever is larger
# GPU targets (issue 32), against the two-read-one-write floor (Spec.floor_bytes over the copy
# rate of the speed-of-light pass): cross-entropy <= 0.85x Liger's time and <= 1.1x its floor;
# every other kind <= 1.15x its floor; the Pallas kernel <= 1.1x the Triton kernel's time.
GPU_CE_LIGER_RATIO = 0.85
GPU_CE_FLOOR_RATIO = 1.1
GPU_FLOOR_RATIO = 1.15
GPU_PALLAS_TRITON_RATIO = 1.1
LOSS_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}
NOISE = "within noise"

RowKey = tuple[Any, ...]  # device, n, v, dtype, kind, framework, group, masked


def _spec_row_key(spec: dict[str, Any]) -> RowKey:
    info = BACKENDS[spec["backend"]]
    return (spec["device"], spec["n"], spec["v"], spec["dtype"], spec["kind"], info.framework, info.group, spec.get("masked"))


def _sol_key(spec: dict[str, Any]) -> tuple[Any, ...]:
    """The speed-of-light passes that bound a row: both frameworks' for the loss group (the
    hardware's floor does not depend on the framework that measures it); the head group's are the
    framework's own three matmuls (the fused head pays its framework's matmuls)."""
    info = BACKENDS[spec["backend"]]
    key = (spec["device"], spec["n"], spec["v"], spec["dtype"], spec["kind"], info.group)
    return key + (info.framework,) if info.group == "head" else key


def _ok(result: dict[str, Any] | None) -> bool:
    return result is not None and result.get("status") == "ok" and result.get("time_s") is not None


def _role(result: dict[str, Any]) -> str:
    return BACKENDS[result["spec"]["backend"]].role


def logits_bytes(spec: dict[str, Any]) -> int:
    return spec["n"] * spec["v"] * ITEMSIZE[spec["dtype"]]


def bytes_moved(spec: dict[str, Any]) -> int | None:
    """What the speed-of-light pass moves (reads the logits, and the teacher; writes a buffer)."""
    if BACKENDS[spec["backend"]].group == "head":
        return None
    return logits_bytes(spec) * (3 if spec["kind"] in DISTILL else 2)


def spec_floor_bytes(spec: dict[str, Any]) -> int | None:
    """The two-read-one-write floor's bytes of a result's spec (:func:`benchmarks._registry.floor_bytes`;
    None for the head group and the speed-of-light passes, which read no mask)."""
    if BACKENDS[spec["backend"]].group == "head" or spec.get("masked") is None:
        return None
    return floor_bytes(spec["n"], spec["v"], spec["dtype"], spec["kind"], spec["masked"])


def floor_ratio(kind: str) -> float:
    """The GPU target on ours / the two-read-one-write floor."""
    return GPU_CE_FLOOR_RATIO if kind in LABELS else GPU_FLOOR_RATIO


def spread_of(result: dict[str, Any] | None) -> tuple[float, float, float] | None:
    """(min, median, max) seconds of a measured result."""
    if not _ok(result):
        return None
    return (result.get("min_s", result["time_s"]), result["time_s"], result.get("max_s", result["time_s"]))


def verdict(ours: tuple[float, float, float], ref: tuple[float, float, float], factor: float, reps_ok: bool) -> str:
    """Whether ``ours <= factor * ref`` holds beyond the noise: ``met`` when ours' max is within
    factor x ref's min, ``MISS`` when ours' min is beyond factor x ref's max, else within noise."""
    if not reps_ok:
        return f"too few reps (< {MIN_REPS})"
    if ours[2] <= factor * ref[0]:
        return "met"
    if ours[0] > factor * ref[2]:
        return "MISS"
    return NOISE


def ratio_range(ours: tuple[float, float, float], ref: tuple[float, float, float]) -> tuple[float, float, float]:
    """ours / ref: (fastest ours / slowest ref, median / median, slowest ours / fastest ref)."""
    return ours[0] / ref[2], ours[1] / ref[1], ours[2] / ref[0]


def sol_floors(results: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Per (device, shape, dtype, kind, group): the speed-of-light pass with the lowest best time."""
    floors: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in results:
        if _ok(r) and _role(r) == "sol":
            key = _sol_key(r["spec"])
            if key not in floors or r["min_s"] < floors[key]["min_s"]:
                floors[key] = r
    return floors


def _rows(results: list[dict[str, Any]]) -> dict[RowKey, list[dict[str, Any]]]:
    rows: dict[RowKey, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if _role(r) != "sol":
            rows[_spec_row_key(r["spec"])].append(r)
    return rows


def annotate(results: list[dict[str, Any]], hbm_bandwidth: float | None = None) -> None:
    """Adds, per result: memory in logits buffers, median ratios to the row's best peer and to
    the speed-of-light floor, whether its best time lies below that floor (it must not), the
    two-read-one-write floor (its bytes over the copy rate of the speed-of-light pass, else over
    ``hbm_bandwidth``, the nominal one) and the time against it, loss agreement with our default
    path at the same mask, and whether every repetition gave the same loss."""
    floors = sol_floors(results)
    for r in results:
        if r.get("mem_extra_bytes") is not None:
            r["mem_logits_buffers"] = r["mem_extra_bytes"] / logits_bytes(r["spec"])
    for key, members in _rows(results).items():
        device = key[0]
        peers = [r for r in members if _ok(r) and _role(r) == "peer"]
        best = min(peers, key=lambda r: r["time_s"]) if peers else None
        ours = default_ours(members, device)
        for r in members:
            if not _ok(r):
                continue
            spec = r["spec"]
            floor = floors.get(_sol_key(spec))
            r["best_peer"] = best["spec"]["backend"] if best else None
            r["vs_best_peer"] = r["time_s"] / best["time_s"] if best else None
            r["sol_floor_backend"] = floor["spec"]["backend"] if floor else None
            r["vs_sol"] = r["time_s"] / floor["min_s"] if floor else None
            r["below_sol_floor"] = bool(floor and r.get("min_s", r["time_s"]) < floor["min_s"])
            need = spec_floor_bytes(spec)
            if need is not None:
                r["floor_bytes"] = need
                r["achieved_bytes_per_s"] = need / r["time_s"]
                rate = copy_rate(floor)
                if rate is not None:
                    r["copy_bytes_per_s"], r["floor_source"] = rate, floor["spec"]["backend"]
                elif device == "gpu" and hbm_bandwidth:
                    rate, r["floor_source"] = hbm_bandwidth, "nominal HBM bandwidth"
                if rate is not None:
                    r["floor_s"] = need / rate
                    r["vs_floor"] = r["time_s"] / r["floor_s"]
            reps = [x for x in r.get("rep_losses") or [] if x is not None]
            if reps and r.get("loss") is not None:
                tol = LOSS_TOL.get(spec["dtype"], 1e-2)
                r["loss_stable"] = all(abs(x - r["loss"]) <= tol * max(1.0, abs(r["loss"])) for x in reps)  # NaN: False
            if _ok(ours) and r.get("loss") is not None and ours.get("loss") is not None:
                ref = ours["loss"]
                rel = abs(r["loss"] - ref) / max(1.0, abs(ref))
                r["loss_rel_diff_vs_ours"] = rel
                r["loss_agrees"] = bool(rel <= LOSS_TOL.get(spec["dtype"], 1e-2))  # NaN: False


def copy_rate(floor: dict[str, Any] | None) -> float | None:
    """Bytes per second of the speed-of-light pass's best call (it reads the logits, and the
    teacher, and writes a logits-sized buffer): the measured copy rate that turns the floor's bytes
    into seconds."""
    if floor is None or bytes_moved(floor["spec"]) is None or not floor.get("min_s"):
        return None
    return bytes_moved(floor["spec"]) / floor["min_s"]


def default_ours(members: Iterable[dict[str, Any]], device: str) -> dict[str, Any] | None:
    for r in members:
        info = BACKENDS[r["spec"]["backend"]]
        if info.role == "ours" and device in info.default_on:
            return r
    return None


def summarize(results: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per (cell, masked fraction): our default path against the best peer (by median)
    and the speed-of-light floor, with spreads and the verdict on each target."""
    floors = sol_floors(results)
    rows = []
    for key, members in sorted(_rows(results).items(), key=lambda item: _row_order(item[0])):
        device, n, v, dtype, kind, framework, group, masked = key
        ours = default_ours(members, device)
        peers = [r for r in members if _ok(r) and _role(r) == "peer"]
        best = min(peers, key=lambda r: r["time_s"]) if peers else None
        floor = floors.get((device, n, v, dtype, kind, group) + ((framework,) if group == "head" else ()))
        liger_name = "head-liger" if group == "head" else "liger"  # Liger is torch-only: JAX rows compare to it too
        liger = next((r for r in results if _ok(r) and r["spec"]["backend"] == liger_name and r["spec"].get("masked") == masked
                      and _spec_row_key(r["spec"])[:5] == key[:5]), None)
        triton = next((r for r in results if _ok(r) and r["spec"]["backend"] == "torchloss-triton"
                       and r["spec"].get("masked") == masked and _spec_row_key(r["spec"])[:5] == key[:5]), None)
        row: dict[str, Any] = {
            "device": device, "n": n, "v": v, "dtype": dtype, "kind": kind, "framework": framework, "group": group,
            "masked": masked,
            "ours": ours["spec"]["backend"] if ours else None,
            "ours_status": _status_text(ours),
            "ours_spread_s": spread_of(ours),
            "ours_s": ours.get("time_s") if _ok(ours) else None,
            "ours_mem_buffers": ours.get("mem_logits_buffers") if ours else None,
            "best_peer": best["spec"]["backend"] if best else None,
            "best_peer_spread_s": spread_of(best),
            "best_peer_s": best["time_s"] if best else None,
            "best_peer_mem_buffers": best.get("mem_logits_buffers") if best else None,
            "min_peer_mem_buffers": min((p["mem_logits_buffers"] for p in peers if p.get("mem_logits_buffers") is not None),
                                        default=None),
            "sol_backend": floor["spec"]["backend"] if floor else None,
            "sol_spread_s": spread_of(floor),
            "sol_s": floor["min_s"] if floor else None,  # the floor: the best repetition
            "peers": {p["spec"]["backend"]: spread_of(p) for p in peers},
            "below_sol_floor": sorted(r["spec"]["backend"] for r in members if r.get("below_sol_floor")),
            # every contender's peak extra memory, in logits buffers (None: not measured)
            "mem_buffers": {r["spec"]["backend"]: r.get("mem_logits_buffers") for r in members if _ok(r)},
            "unstable_losses": sorted(r["spec"]["backend"] for r in members if r.get("loss_stable") is False),
            "timer": (ours or {}).get("timer"),
        }
        if _ok(ours):
            o = spread_of(ours)
            reps_ok = all(r.get("reps", 0) >= MIN_REPS for r in (ours, best) if r is not None)
            if best is not None:
                row["vs_best_peer_range"] = ratio_range(o, spread_of(best))
                row["vs_best_peer"] = row["vs_best_peer_range"][1]
            if floor is not None:
                sol = spread_of(floor)
                row["vs_sol_range"] = ratio_range(o, sol)
                row["vs_sol"] = o[1] / sol[0]  # the median against the floor
            fused_head = ours["spec"]["backend"] in FUSED_HEADS
            if floor is not None and fused_head:
                # against the matmuls' spread (not only their best call): they are a cost the head pays, not a floor
                row["head_sol_verdict"] = verdict(o, spread_of(floor), HEAD_SOL_RATIO,
                                                  reps_ok and floor.get("reps", 0) >= MIN_REPS)
            if ours.get("floor_s"):
                f = ours["floor_s"]
                row["floor_s"], row["floor_source"] = f, ours.get("floor_source")
                row["vs_floor_range"] = (o[0] / f, o[1] / f, o[2] / f)
                row["vs_floor"] = o[1] / f
                if device == "gpu":
                    row["floor_verdict"] = verdict(o, (f, f, f), floor_ratio(kind), reps_ok)
            if liger is not None:
                row["vs_liger"] = ours["time_s"] / liger["time_s"]
                if device == "gpu" and group == "loss" and kind in LABELS and framework == "torch":
                    row["liger_verdict"] = verdict(o, spread_of(liger), GPU_CE_LIGER_RATIO,
                                                   reps_ok and liger.get("reps", 0) >= MIN_REPS)
            if triton is not None and framework == "jax" and group == "loss" and ours["spec"]["backend"] == "jaxloss-pallas":
                row["vs_triton"] = ours["time_s"] / triton["time_s"]
                row["triton_verdict"] = verdict(o, spread_of(triton), GPU_PALLAS_TRITON_RATIO,
                                                reps_ok and triton.get("reps", 0) >= MIN_REPS)
            mem = ours.get("mem_extra_bytes")
            lb = n * v * ITEMSIZE[dtype]
            if device == "cpu":
                if best is not None:
                    row["peer_verdict"] = verdict(o, spread_of(best), CPU_PEER_RATIO, reps_ok)
                    # 0.6x the peer's slowest repetition still below the floor: nothing on this
                    # machine can meet that target.
                    row["peer_target_below_sol"] = bool(floor is not None and group == "loss"
                                                        and CPU_PEER_RATIO * spread_of(best)[2] < floor["min_s"])
                if floor is not None and group == "loss":
                    row["sol_verdict"] = verdict(o, spread_of(floor), CPU_SOL_RATIO,
                                                 reps_ok and floor.get("reps", 0) >= MIN_REPS)
            allowed = (HEAD_MEM_UNITS if fused_head else MEM_UNITS) * lb + max(MEM_SLACK[0] * lb, MEM_SLACK[1])
            if group == "head":  # the head's own gradients (hidden states and weight) are outputs too
                allowed += (n + v) * ours["spec"]["hidden"] * ITEMSIZE[dtype]
            row["meets_mem_target"] = mem is not None and mem <= allowed
            row["loss_disagreements"] = [r["spec"]["backend"] for r in members if r.get("loss_agrees") is False]
        rows.append(row)
    return rows


def _status_text(result: dict[str, Any] | None) -> str:
    if result is None:
        return "not run"
    status = result.get("status", "?")
    if status == "skipped":
        return "skipped: " + ("memory" if "memory" in result.get("error", "") else "budget")
    return status


def _row_order(key: RowKey) -> tuple[Any, ...]:
    device, n, v, dtype, kind, framework, group, masked = key
    return (device, n * v, n, dtype != "float32", KINDS.index(kind), group != "loss", framework, -(masked or 0.0))


# ----------------------------------------------------------------------------------------------
# Text and Markdown tables
# ----------------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def _ms3(spread: tuple[float, float, float] | None) -> str:
    """min / median / max in ms."""
    return "-" if spread is None else " / ".join(_ms(t) for t in spread)


def _x(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(rng: tuple[float, float, float] | None) -> str:
    """The median ratio with its range: 0.72 [0.65-0.80]."""
    return "-" if rng is None else f"{rng[1]:.2f} [{rng[0]:.2f}-{rng[2]:.2f}]"


def _pct(masked: float | None) -> str:
    return "-" if masked is None else f"{100 * masked:.0f}%"


def _peer_word(row: dict[str, Any]) -> str:
    word = row.get("peer_verdict")
    if word == "MISS" and row.get("peer_target_below_sol"):
        return "MISS*"  # out of reach: below the floor
    return word or ""


def summary_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    gpu = any(r["device"] == "gpu" for r in rows)
    head = ["shape NxV", "dtype", "kind", "fw", "masked", "ours", "ours ms min/med/max", "best peer", "peer ms min/med/max",
            "ours/peer [range]", "SOL floor ms min/med/max", "ours/floor [range]", "mem ours", "mem peer"]
    if gpu:
        head += ["2R1W floor ms", "ours/2R1W floor [range]", "ours/liger", "pallas/triton", "mem every contender"]
    lines = []
    for r in rows:
        fw = r["framework"] + ("+head" if r["group"] == "head" else "")
        loss_group = r["group"] == "loss"
        sol = _ms3(r["sol_spread_s"]) if r.get("sol_spread_s") else "-"
        if not r.get("ours_s"):
            ours_cell = r["ours_status"] if r["ours_status"] != "ok" else "-"
            cells = [f"{r['n']}x{r['v']}", r["dtype"], SHORT_KIND[r["kind"]], fw, _pct(r["masked"]), r["ours"] or "-",
                     ours_cell, r["best_peer"] or "-", _ms3(r["best_peer_spread_s"]), "-", sol, "-", "-",
                     _x(r["best_peer_mem_buffers"])]
            if gpu:
                cells += ["-", "-", "-", "-", _mems(r)]
            lines.append(cells)
            continue
        cpu = r["device"] == "cpu"
        peer_word = (" " + _peer_word(r)) if cpu and _peer_word(r) else ""
        sol_word = (" " + r["sol_verdict"]) if cpu and r.get("sol_verdict") else ""
        if r.get("head_sol_verdict"):
            sol_word = f" {r['head_sol_verdict']} (<= {HEAD_SOL_RATIO}x)"
        cells = [
            f"{r['n']}x{r['v']}", r["dtype"], SHORT_KIND[r["kind"]], fw, _pct(r["masked"]), r["ours"],
            _ms3(r["ours_spread_s"]), r["best_peer"] or "-", _ms3(r["best_peer_spread_s"]),
            _ratio(r.get("vs_best_peer_range")) + peer_word,
            sol, (_ratio(r.get("vs_sol_range")) + sol_word) if loss_group or r.get("head_sol_verdict") else "-",
            _x(r.get("ours_mem_buffers")) + ("" if r.get("meets_mem_target") is None else
                                             " ok" if r["meets_mem_target"] else " MISS"),
            _x(r.get("best_peer_mem_buffers")),
        ]
        if gpu:
            cells += [_ms(r.get("floor_s")),
                      _ratio(r.get("vs_floor_range")) + (f" {r['floor_verdict']}" if r.get("floor_verdict") else ""),
                      _x(r.get("vs_liger")) + (f" {r['liger_verdict']}" if r.get("liger_verdict") else ""),
                      _x(r.get("vs_triton")) + (f" {r['triton_verdict']}" if r.get("triton_verdict") else ""),
                      _mems(r)]
        if r.get("loss_disagreements"):
            cells[5] += " (loss differs: " + ",".join(r["loss_disagreements"]) + ")"
        lines.append(cells)
    return _render(head, lines, markdown)


def _timers(rows: list[dict[str, Any]]) -> str:
    """The clocks of our rows, per framework (results from before CUDA-event timing recorded none)."""
    seen: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        seen[r["framework"]].add(r.get("timer") or "host wall clock (not recorded: an earlier run)")
    return "; ".join(f"{fw}: {', '.join(sorted(t))}" for fw, t in sorted(seen.items()))


def _mems(row: dict[str, Any]) -> str:
    """Every contender's peak extra memory in logits buffers: ``liger 0.00, torchloss-triton 1.00``."""
    return ", ".join(f"{name} {_x(mem)}" for name, mem in sorted((row.get("mem_buffers") or {}).items())) or "-"


def _tally(rows: list[dict[str, Any]], field: str) -> str:
    words = [r[field] for r in rows if r.get(field)]
    counts = {w: words.count(w) for w in dict.fromkeys(words)}
    return ", ".join(f"{w} {c}" for w, c in counts.items()) + f" (of {len(words)} rows)"


def summary_notes(rows: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> str:
    """How to read :func:`summary_table`: the floor, the verdict words, what our code skips, the
    tally of each target, and anything that contradicts the method (a contender below the floor)."""
    measured = [r for r in rows if r.get("ours_s")]
    if not measured:
        return ""
    sol_reps = (meta or {}).get("settings", {}).get("sol_reps")
    reps = (meta or {}).get("settings", {}).get("reps")
    lines = [
        f"Times: min / median / max of {reps or 'the'} interleaved repetitions per contender. SOL floor: the best of "
        f"{'the ' + str(reps * sol_reps) if reps and sol_reps else 'all'} calls of an elementwise pass that reads the logits "
        "(and teacher) and writes a pre-faulted logits-sized buffer, the faster framework's: no contender can beat it, "
        "since each writes a fresh gradient. Ratios: median / median (ours/floor: median / floor), with [fastest ours / "
        "slowest reference - slowest ours / fastest reference]. A target verdict (`met`, `MISS`) is given only where "
        f"these spreads do not overlap the target; otherwise `{NOISE}`.",
    ]
    cpu = [r for r in measured if r["device"] == "cpu"]
    if cpu:
        lines.append(f"Targets (CPU): ours/peer <= {CPU_PEER_RATIO}: {_tally(cpu, 'peer_verdict')}; ours/floor <= "
                     f"{CPU_SOL_RATIO}: {_tally(cpu, 'sol_verdict')}; memory <= 1 logits buffer: "
                     f"ok {sum(bool(r.get('meets_mem_target')) for r in cpu)} of {len(cpu)}.")
        heads = [r for r in measured if r.get("head_sol_verdict")]
        if heads:
            lines.append(f"Fused head targets: time <= {HEAD_SOL_RATIO}x its framework's three head matmuls (median vs "
                         f"median range): {_tally(heads, 'head_sol_verdict')}; extra memory <= {HEAD_MEM_UNITS} logits "
                         "buffer plus the head's own gradients: ok "
                         f"{sum(bool(r.get('meets_mem_target')) for r in heads)} of {len(heads)}.")
        if any(_peer_word(r) == "MISS*" for r in cpu):
            lines.append(f"`MISS*`: {CPU_PEER_RATIO}x the peer's slowest repetition is below the floor, so nothing on this "
                         "machine can meet that target.")
    gpu = [r for r in measured if r["device"] == "gpu"]
    if gpu:
        ce = [r for r in gpu if r["kind"] in LABELS]
        others = [r for r in gpu if r["kind"] not in LABELS]
        lines.append(
            "Two-read-one-write floor (2R1W, GPU): each valid row reads its logits (and teacher) twice and writes its "
            "gradient once, a masked row writes zeros only; those bytes over the copy rate of the speed-of-light pass's "
            f"best call (the nominal HBM bandwidth where no pass ran). Clocks: {_timers(gpu)}. Targets (GPU): cross-entropy <= "
            f"{GPU_CE_LIGER_RATIO}x Liger (torch): {_tally(ce, 'liger_verdict')}; cross-entropy <= {GPU_CE_FLOOR_RATIO}x "
            f"its floor: {_tally(ce, 'floor_verdict')}; other kinds <= {GPU_FLOOR_RATIO}x their floor: "
            f"{_tally(others, 'floor_verdict')}; Pallas <= {GPU_PALLAS_TRITON_RATIO}x Triton: {_tally(gpu, 'triton_verdict')}.")
    masks = sorted({r["masked"] for r in measured if r["masked"] is not None}, reverse=True)
    if len(masks) > 1:
        pairs = []
        for r in measured:
            if r["masked"] != masks[0]:
                continue
            other = next((o for o in measured if o["masked"] == masks[-1] and
                          all(o[k] == r[k] for k in ("device", "n", "v", "dtype", "kind", "framework", "group"))), None)
            if other is not None:
                pairs.append(f"{r['framework']}{'+head' if r['group'] == 'head' else ''} {r['dtype']} {SHORT_KIND[r['kind']]} "
                             f"{other['ours_s'] / r['ours_s']:.2f}")
        lines.append(f"Masking, both ways: torchloss skips the masked rows of 16-bit logits on the CPU (once >= 12.5% of the "
                     f"rows are masked); the peers, and jaxloss, compute every row. Where one of our paths skips, every "
                     f"contender is measured with {' and '.join(_pct(m) for m in masks)} of the tokens masked (elsewhere "
                     f"all do the same work at any mask: {_pct(masks[0])} only, unless `--all-masks`). Our median at "
                     f"{_pct(masks[-1])} / at {_pct(masks[0])}: " + "; ".join(pairs) + ".")
    unstable = [f"{r['n']}x{r['v']} {r['dtype']} {SHORT_KIND[r['kind']]} {_pct(r['masked'])}: {', '.join(r['unstable_losses'])}"
                for r in rows if r.get("unstable_losses")]
    if unstable:
        lines.append("WARNING: a contender's loss changed between repetitions of the same inputs (did a call see an "
                     "earlier call's output?): " + "; ".join(unstable) + ".")
    below = [f"{r['n']}x{r['v']} {r['dtype']} {SHORT_KIND[r['kind']]} {_pct(r['masked'])}: {', '.join(r['below_sol_floor'])}"
             for r in rows if r.get("below_sol_floor")]
    if below:
        lines.append("WARNING: measured below the SOL floor (the floor is then not a floor; distrust this run): "
                     + "; ".join(below) + ".")
    if meta is not None:
        git = meta.get("machine", {}).get("git", {})
        if git.get("dirty") or not git.get("commit"):
            lines.append("WARNING: the tree was not clean (or no commit known): these figures belong to no commit.")
        if meta.get("settings", {}).get("reps", MIN_REPS) < MIN_REPS:
            lines.append(f"WARNING: fewer than {MIN_REPS} repetitions: no verdicts.")
    return "\n\n".join(lines)


def detail_table(results: list[dict[str, Any]], markdown: bool = False) -> str:
    head = ["shape NxV", "dtype", "kind", "masked", "backend", "role", "ms min/med/max", "reps", "x best peer", "x SOL floor",
            "x 2R1W floor", "mem MiB", "mem (logits)", "XLA temp+out MiB", "loss", "status"]
    lines = []
    order = list(BACKENDS)
    for r in sorted(results, key=lambda r: (_row_order(_spec_row_key(r["spec"])[:7] + (None,)), order.index(r["spec"]["backend"]),
                                            -(r["spec"].get("masked") or 0.0))):
        s = r["spec"]
        info = BACKENDS[s["backend"]]
        mem = r.get("mem_extra_bytes")
        analysis = r.get("xla_memory_analysis")
        status = r.get("status", "?")
        if status != "ok":
            status = f"{status}: {r.get('error', '')}"[:70]
        lines.append([
            f"{s['n']}x{s['v']}", s["dtype"], SHORT_KIND[s["kind"]], _pct(s.get("masked")), s["backend"], info.role,
            _ms3(spread_of(r)), str(r.get("reps", "-")), _x(r.get("vs_best_peer")), _x(r.get("vs_sol")), _x(r.get("vs_floor")),
            "-" if mem is None else f"{mem / 2**20:.0f}", _x(r.get("mem_logits_buffers")),
            "-" if not analysis else f"{(analysis['temp_bytes'] + analysis['output_bytes']) / 2**20:.0f}",
            "-" if r.get("loss") is None else f"{r['loss']:.5g}" + ("" if r.get("loss_agrees", True) else " !"),
            status,
        ])
    return _render(head, lines, markdown)


def markdown(meta: dict[str, Any], summary: list[dict[str, Any]], results: list[dict[str, Any]]) -> str:
    """The results file in Markdown: provenance, summary, notes, every measurement."""
    git = meta["machine"].get("git", {})
    tree = "clean tree" if git.get("dirty") is False else "DIRTY tree (" + ", ".join((git.get("changed") or [])[:8]) + ")"
    env = f"; worker environment {' '.join(meta['worker_env'])}" if meta.get("worker_env") else ""
    lines = [
        f"Machine: {meta['machine_text']}", "",
        f"Command: `{meta['command']}`; commit `{git.get('commit')}` ({tree}); started {meta['started']}, "
        f"{meta.get('wall_s', 0) / 60:.1f} min (expected {meta.get('expected_s', 0) / 60:.1f}); load average "
        f"{_load(meta.get('load_average_start'))} -> {_load(meta.get('load_average_end'))}{env}", "",
        "Summary (ms: forward+backward, min / median / max; mem: peak extra memory in logits-sized buffers):", "",
        summary_table(summary, markdown=True), "", summary_notes(summary, meta), "", "All measurements:", "",
        detail_table(results, markdown=True), "",
    ]
    return "\n".join(lines)


def _load(value: Any) -> str:
    return "-" if not value else "(" + ", ".join(f"{x:.2f}" for x in value) + ")"


def _render(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
        return "\n".join(out)
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) if rows else len(head[i]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows])


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------


def plot(results: list[dict[str, Any]], stem: Path, title: str) -> list[Path]:
    """Two PNGs (time, memory): rows = loss kinds, columns = (dtype, framework/group); x = N,
    one line per backend and vocabulary (colour = backend; solid: ours, dashed: peers, dotted: the
    speed-of-light pass; marker: V)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if _ok(r)]
    if not ok:
        return []
    masks = sorted({r["spec"].get("masked") for r in ok if r["spec"].get("masked") is not None}, reverse=True)
    kinds = [k for k in KINDS if any(r["spec"]["kind"] == k for r in ok)]
    columns = []
    for dtype in ("float32", "bfloat16", "float16"):
        for fw, group in (("jax", "loss"), ("torch", "loss"), ("torch", "head")):
            if any(r["spec"]["dtype"] == dtype and BACKENDS[r["spec"]["backend"]].framework == fw
                   and BACKENDS[r["spec"]["backend"]].group == group for r in ok):
                columns.append((dtype, fw, group))
    vocabs = sorted({r["spec"]["v"] for r in ok})
    markers = ["o", "s", "^", "D"]
    names = [b for b in BACKENDS if any(r["spec"]["backend"] == b for r in ok)]
    palette = {"ours": ["tab:blue", "tab:purple"], "peer": ["tab:orange", "tab:green", "tab:brown", "tab:olive", "tab:cyan",
                                                           "tab:pink"], "sol": ["black", "gray"]}
    colors, used = {}, {"jax": defaultdict(int), "torch": defaultdict(int)}
    for name in names:
        info = BACKENDS[name]
        options = palette[info.role]
        colors[name] = options[used[info.framework][info.role] % len(options)]
        used[info.framework][info.role] += 1
    linestyle = {"ours": "-", "peer": "--", "sol": ":"}
    single_shape = len({(r["spec"]["n"], r["spec"]["v"]) for r in ok}) == 1
    written = []
    for metric, label in (("time_s", "forward+backward time (ms): median, bar min-max"),
                          ("mem_extra_bytes", "peak extra memory (MiB)")):
        if single_shape:  # one shape (--quick): bars per backend and mask read better than lone points
            written.append(_bars(plt, ok, kinds, columns, names, colors, metric, label, stem, title))
            continue
        # Lines: the headline mask only (the JSON and tables have the others).
        headline = masks[0] if masks else None
        line_ok = [r for r in ok if r["spec"].get("masked") in (None, headline)]
        fig, axes = plt.subplots(len(kinds), len(columns), figsize=(3.6 * len(columns), 2.9 * len(kinds)), squeeze=False)
        for i, kind in enumerate(kinds):
            for j, (dtype, fw, group) in enumerate(columns):
                ax = axes[i][j]
                drew = False
                for name in names:
                    info = BACKENDS[name]
                    if info.framework != fw or info.group != group:
                        continue
                    for k, v in enumerate(vocabs):
                        pts = sorted((r["spec"]["n"], r[metric], r.get("min_s"), r.get("max_s")) for r in line_ok
                                     if r["spec"]["backend"] == name and r["spec"]["kind"] == kind
                                     and r["spec"]["dtype"] == dtype and r["spec"]["v"] == v and r.get(metric) is not None)
                        if not pts:
                            continue
                        xs = [p[0] for p in pts]
                        scale = 1e3 if metric == "time_s" else 1 / 2**20
                        ys = [max(p[1] * scale, 1e-3) for p in pts]
                        width = 2.4 if info.role == "ours" else 1.2
                        ax.plot(xs, ys, linestyle[info.role], marker=markers[k % len(markers)], ms=4, lw=width,
                                color=colors[name], label=f"{name} V={v}")
                        if metric == "time_s" and all(p[2] is not None for p in pts):
                            lo = [max(y - p[2] * scale, 0.0) for y, p in zip(ys, pts)]
                            hi = [max(p[3] * scale - y, 0.0) for y, p in zip(ys, pts)]
                            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor=colors[name], lw=0.8, capsize=2)
                        drew = True
                if drew:
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.legend(fontsize=5.5, loc="upper left")
                    ax.grid(alpha=0.3, which="both")
                else:
                    ax.axis("off")
                if i == 0:
                    ax.set_title(f"{fw}{' LM head' if group == 'head' else ''}, {dtype}, {_pct(headline)} masked", fontsize=9)
                if j == 0:
                    ax.set_ylabel(f"{SHORT_KIND[kind]}\n{label}", fontsize=8)
                if i == len(kinds) - 1:
                    ax.set_xlabel("tokens N", fontsize=8)
        fig.suptitle(f"{title}: {label}", fontsize=10)
        fig.tight_layout()
        path = stem.with_name(stem.name + ("_time.png" if metric == "time_s" else "_memory.png"))
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _bars(plt: Any, ok: list[dict[str, Any]], kinds: list[str], columns: list[tuple[str, str, str]], names: list[str],
          colors: dict[str, Any], metric: str, label: str, stem: Path, title: str) -> Path:
    n, v = ok[0]["spec"]["n"], ok[0]["spec"]["v"]
    fig, axes = plt.subplots(len(kinds), len(columns), figsize=(3.6 * len(columns), 2.8 * len(kinds)), squeeze=False)
    scale = 1e3 if metric == "time_s" else 1 / 2**20
    for i, kind in enumerate(kinds):
        for j, (dtype, fw, group) in enumerate(columns):
            ax = axes[i][j]
            rows = [(name, r) for name in names
                    for r in sorted(ok, key=lambda r: -(r["spec"].get("masked") or 0.0))
                    if r["spec"]["backend"] == name and r["spec"]["kind"] == kind and r["spec"]["dtype"] == dtype
                    and BACKENDS[name].framework == fw and BACKENDS[name].group == group and r.get(metric) is not None]
            if not rows:
                ax.axis("off")
                continue
            rows = rows[::-1]
            labels = [name + ("" if r["spec"].get("masked") is None else f" {_pct(r['spec']['masked'])}") for name, r in rows]
            values = [r[metric] * scale for _, r in rows]
            bars = ax.barh(range(len(rows)), values, color=[colors[name] for name, _ in rows])
            if metric == "time_s":
                lo = [max(v - r.get("min_s", r["time_s"]) * scale, 0.0) for v, (_, r) in zip(values, rows)]
                hi = [max(r.get("max_s", r["time_s"]) * scale - v, 0.0) for v, (_, r) in zip(values, rows)]
                ax.errorbar(values, range(len(rows)), xerr=[lo, hi], fmt="none", ecolor="black", lw=0.7, capsize=1.5)
            ax.set_yticks(range(len(rows)), labels)
            for bar, value, (_, r) in zip(bars, values, rows):
                right = max(value, r.get("max_s", 0.0) * scale) if metric == "time_s" else value  # past the spread
                ax.text(right, bar.get_y() + bar.get_height() / 2, f" {value:.0f}", va="center", fontsize=5.5)
            top = max(values + [r.get("max_s", 0) * scale for _, r in rows] if metric == "time_s" else values)
            ax.set_xlim(0, top * 1.3)
            ax.tick_params(labelsize=6.5)
            if i == 0:
                ax.set_title(f"{fw}{' LM head' if group == 'head' else ''}, {dtype}", fontsize=9)
            if j == 0:
                ax.set_ylabel(SHORT_KIND[kind], fontsize=9)
            if i == len(kinds) - 1:
                ax.set_xlabel(label, fontsize=7)
    fig.suptitle(f"{title}: {label}, N={n}, V={v}", fontsize=10)
    fig.tight_layout()
    path = stem.with_name(stem.name + ("_time.png" if metric == "time_s" else "_memory.png"))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["annotate", "summarize", "summary_table", "summary_notes", "detail_table", "markdown", "plot", "verdict",
           "ratio_range", "spread_of", "sol_floors", "nominal_hbm_bandwidth"]
