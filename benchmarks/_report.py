"""Summaries, tables (plain text and Markdown) and plots of a benchmark run's results."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from benchmarks._registry import BACKENDS, DISTILL, ITEMSIZE, KINDS, SHORT_KIND, nominal_hbm_bandwidth

# Targets of the issue (measured, not asserted).
CPU_PEER_RATIO = 0.6
CPU_SOL_RATIO = 1.3
MEM_UNITS = 1.0
MEM_SLACK = (0.02, 16 << 20)  # allocator/page rounding: 2% of a logits buffer or 16 MiB, whichever is larger
GPU_HBM_FRACTION = 0.85
LOSS_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}

CellKey = tuple[str, int, int, str, str, str, str]  # device, n, v, dtype, kind, framework, group


def cell_key(result: dict[str, Any]) -> CellKey:
    s = result["spec"]
    info = BACKENDS[s["backend"]]
    return (s["device"], s["n"], s["v"], s["dtype"], s["kind"], info.framework, info.group)


def _ok(result: dict[str, Any] | None) -> bool:
    return result is not None and result.get("status") == "ok" and result.get("time_s") is not None


def logits_bytes(spec: dict[str, Any]) -> int:
    return spec["n"] * spec["v"] * ITEMSIZE[spec["dtype"]]


def bytes_moved(spec: dict[str, Any]) -> int | None:
    if BACKENDS[spec["backend"]].group == "head":
        return None
    return logits_bytes(spec) * (3 if spec["kind"] in DISTILL else 2)


def annotate(results: list[dict[str, Any]], hbm_bandwidth: float | None = None) -> None:
    """Adds, per result: memory in logits buffers, ratios to the cell's best peer and to its
    speed-of-light pass, achieved bandwidth (GPU), loss agreement with our default path."""
    cells: dict[CellKey, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        cells[cell_key(result)].append(result)
    for key, members in cells.items():
        device = key[0]
        peers = [r for r in members if _ok(r) and BACKENDS[r["spec"]["backend"]].role == "peer"]
        best = min(peers, key=lambda r: r["time_s"]) if peers else None
        sol = next((r for r in members if _ok(r) and BACKENDS[r["spec"]["backend"]].role == "sol"), None)
        ours = default_ours(members, device)
        for r in members:
            spec = r["spec"]
            if r.get("mem_extra_bytes") is not None:
                r["mem_logits_buffers"] = r["mem_extra_bytes"] / logits_bytes(spec)
            if not _ok(r):
                continue
            r["best_peer"] = best["spec"]["backend"] if best else None
            r["vs_best_peer"] = r["time_s"] / best["time_s"] if best else None
            r["vs_sol"] = r["time_s"] / sol["time_s"] if sol else None
            moved = bytes_moved(spec)
            if moved is not None:
                r["bytes_moved"] = moved
                r["achieved_bytes_per_s"] = moved / r["time_s"]
                if device == "gpu" and hbm_bandwidth:
                    r["hbm_fraction"] = moved / r["time_s"] / hbm_bandwidth
                    r["hbm_bound_s"] = moved / hbm_bandwidth
            if ours is not None and _ok(ours) and r.get("loss") is not None and ours.get("loss") is not None:
                ref = ours["loss"]
                rel = abs(r["loss"] - ref) / max(1.0, abs(ref))
                r["loss_rel_diff_vs_ours"] = rel
                r["loss_agrees"] = bool(rel <= LOSS_TOL.get(spec["dtype"], 1e-2))  # NaN: False


def default_ours(members: Iterable[dict[str, Any]], device: str) -> dict[str, Any] | None:
    for r in members:
        info = BACKENDS[r["spec"]["backend"]]
        if info.role == "ours" and device in info.default_on:
            return r
    return None


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: our default path against the best peer and the speed-of-light pass,
    with the verdict on each target."""
    cells: dict[CellKey, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        cells[cell_key(result)].append(result)
    rows = []
    for key in sorted(cells, key=_cell_order):
        device, n, v, dtype, kind, framework, group = key
        members = cells[key]
        ours = default_ours(members, device)
        peers = [r for r in members if _ok(r) and BACKENDS[r["spec"]["backend"]].role == "peer"]
        best = min(peers, key=lambda r: r["time_s"]) if peers else None
        sol = next((r for r in members if _ok(r) and BACKENDS[r["spec"]["backend"]].role == "sol"), None)
        liger_name = "head-liger" if group == "head" else "liger"  # Liger is torch-only: JAX rows compare to it too
        liger = next((r for r in results if _ok(r) and r["spec"]["backend"] == liger_name
                      and cell_key(r)[:5] == key[:5]), None)
        row: dict[str, Any] = {
            "device": device, "n": n, "v": v, "dtype": dtype, "kind": kind, "framework": framework, "group": group,
            "ours": ours["spec"]["backend"] if ours else None,
            "ours_status": _status_text(ours),
            "ours_s": ours.get("time_s") if ours else None,
            "ours_mem_buffers": ours.get("mem_logits_buffers") if ours else None,
            "best_peer": best["spec"]["backend"] if best else None,
            "best_peer_s": best["time_s"] if best else None,
            "best_peer_mem_buffers": best.get("mem_logits_buffers") if best else None,
            "min_peer_mem_buffers": min((p["mem_logits_buffers"] for p in peers if p.get("mem_logits_buffers") is not None),
                                        default=None),
            "sol_s": sol["time_s"] if sol else None,
            "peers": {p["spec"]["backend"]: p["time_s"] for p in peers},
        }
        if _ok(ours):
            row["vs_best_peer"] = ours["time_s"] / best["time_s"] if best else None
            row["vs_sol"] = ours["time_s"] / sol["time_s"] if sol and group == "loss" else None
            row["hbm_fraction"] = ours.get("hbm_fraction")
            if liger is not None:
                row["vs_liger"] = ours["time_s"] / liger["time_s"]
            mem = ours.get("mem_extra_bytes")
            lb = n * v * ITEMSIZE[dtype]
            if device == "cpu":
                row["meets_peer_target"] = row["vs_best_peer"] is not None and row["vs_best_peer"] <= CPU_PEER_RATIO
                # 0.6x the fastest peer can lie below the speed-of-light pass itself (the peer is
                # within 1 / 0.6 = 1.67x of it): then no implementation on this backend meets it.
                row["peer_target_below_sol"] = (best is not None and sol is not None and group == "loss"
                                                and CPU_PEER_RATIO * best["time_s"] < sol["time_s"])
                row["meets_sol_target"] = row["vs_sol"] is not None and row["vs_sol"] <= CPU_SOL_RATIO
            else:
                if group == "loss":
                    row["meets_hbm_target"] = row["hbm_fraction"] is not None and row["hbm_fraction"] >= GPU_HBM_FRACTION
                row["faster_than_liger"] = row.get("vs_liger") is not None and row["vs_liger"] < 1.0
            allowed = MEM_UNITS * lb + max(MEM_SLACK[0] * lb, MEM_SLACK[1])
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


def _cell_order(key: CellKey) -> tuple[Any, ...]:
    device, n, v, dtype, kind, framework, group = key
    return (device, n * v, n, dtype != "float32", KINDS.index(kind), group != "loss", framework)


# ----------------------------------------------------------------------------------------------
# Text and Markdown tables
# ----------------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def _x(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ok" if ok else " MISS")


def _out_of_reach(row: dict[str, Any]) -> bool:
    """A missed peer target that lies below the speed-of-light pass (marked ``MISS*``)."""
    return bool(row.get("peer_target_below_sol")) and not row.get("meets_peer_target")


def summary_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    gpu = any(r["device"] == "gpu" for r in rows)
    head = ["shape NxV", "dtype", "kind", "fw", "ours", "ours ms", "best peer", "peer ms", "ours/peer",
            "SOL ms", "ours/SOL", "mem ours", "mem peer"]
    if gpu:
        head += ["%HBM", "ours/liger"]
    lines = []
    for r in rows:
        fw = r["framework"] + ("+head" if r["group"] == "head" else "")
        if not r.get("ours_s"):
            ours_cell = r["ours_status"] if r["ours_status"] != "ok" else "-"
            cells = [f"{r['n']}x{r['v']}", r["dtype"], SHORT_KIND[r["kind"]], fw, r["ours"] or "-", ours_cell,
                     r["best_peer"] or "-", _ms(r["best_peer_s"]), "-", _ms(r["sol_s"]), "-", "-",
                     _x(r["best_peer_mem_buffers"])]
            if gpu:
                cells += ["-", "-"]
            lines.append(cells)
            continue
        cpu = r["device"] == "cpu"
        cells = [
            f"{r['n']}x{r['v']}", r["dtype"], SHORT_KIND[r["kind"]], fw, r["ours"], _ms(r["ours_s"]),
            r["best_peer"] or "-", _ms(r["best_peer_s"]),
            _x(r.get("vs_best_peer")) + (_mark(r.get("meets_peer_target")) if cpu else "")
            + ("*" if cpu and _out_of_reach(r) else ""),
            _ms(r["sol_s"]) if r["group"] == "loss" else "-",
            _x(r.get("vs_sol")) + (_mark(r.get("meets_sol_target")) if cpu and r["group"] == "loss" else ""),
            _x(r.get("ours_mem_buffers")) + _mark(r.get("meets_mem_target")),
            _x(r.get("best_peer_mem_buffers")),
        ]
        if gpu:
            frac = r.get("hbm_fraction")
            cells += [("-" if frac is None else f"{100 * frac:.0f}%") + _mark(r.get("meets_hbm_target")),
                      _x(r.get("vs_liger"))]
        if r.get("loss_disagreements"):
            cells[4] += " (loss differs: " + ",".join(r["loss_disagreements"]) + ")"
        lines.append(cells)
    return _render(head, lines, markdown)


def summary_notes(rows: list[dict[str, Any]]) -> str:
    """The footnote of :func:`summary_table`'s marks, and the tally of each target."""
    cpu = [r for r in rows if r["device"] == "cpu" and r.get("ours_s")]
    if not cpu:
        return ""
    loss_rows = [r for r in cpu if r["group"] == "loss"]
    below = [r for r in loss_rows if _out_of_reach(r)]
    lines = [
        f"Targets (CPU): ours/peer <= {CPU_PEER_RATIO} met in {sum(bool(r.get('meets_peer_target')) for r in cpu)} of "
        f"{len(cpu)} rows; ours/SOL <= {CPU_SOL_RATIO} in {sum(bool(r.get('meets_sol_target')) for r in loss_rows)} of "
        f"{len(loss_rows)}; memory <= 1 logits buffer in {sum(bool(r.get('meets_mem_target')) for r in cpu)} of {len(cpu)}.",
    ]
    if below:
        lines.append(f"`MISS*`: {CPU_PEER_RATIO}x the fastest peer is less than the speed-of-light pass itself (the peer "
                     f"runs within {1 / CPU_PEER_RATIO:.2f}x of the bound), so nothing on this backend can meet that target "
                     f"({len(below)} of the {sum(not r.get('meets_peer_target') for r in cpu)} misses).")
    return "\n".join(lines)


def detail_table(results: list[dict[str, Any]], markdown: bool = False) -> str:
    head = ["shape NxV", "dtype", "kind", "backend", "role", "ms (median)", "reps", "x best peer", "x SOL",
            "mem MiB", "mem (logits)", "XLA temp+out MiB", "loss", "status"]
    lines = []
    for r in sorted(results, key=lambda r: (_cell_order(cell_key(r)), list(BACKENDS).index(r["spec"]["backend"]))):
        s = r["spec"]
        info = BACKENDS[s["backend"]]
        mem = r.get("mem_extra_bytes")
        analysis = r.get("xla_memory_analysis")
        status = r.get("status", "?")
        if status != "ok":
            status = f"{status}: {r.get('error', '')}"[:70]
        lines.append([
            f"{s['n']}x{s['v']}", s["dtype"], SHORT_KIND[s["kind"]], s["backend"], info.role,
            _ms(r.get("time_s")), str(r.get("reps", "-")), _x(r.get("vs_best_peer")), _x(r.get("vs_sol")),
            "-" if mem is None else f"{mem / 2**20:.0f}", _x(r.get("mem_logits_buffers")),
            "-" if not analysis else f"{(analysis['temp_bytes'] + analysis['output_bytes']) / 2**20:.0f}",
            "-" if r.get("loss") is None else f"{r['loss']:.5g}" + ("" if r.get("loss_agrees", True) else " !"),
            status,
        ])
    return _render(head, lines, markdown)


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
    for metric, label in (("time_s", "forward+backward time (ms)"), ("mem_extra_bytes", "peak extra memory (MiB)")):
        if single_shape:  # one shape (--quick): bars per backend read better than lone points
            written.append(_bars(plt, ok, kinds, columns, names, colors, metric, label, stem, title))
            continue
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
                        pts = sorted((r["spec"]["n"], r[metric]) for r in ok if r["spec"]["backend"] == name
                                     and r["spec"]["kind"] == kind and r["spec"]["dtype"] == dtype
                                     and r["spec"]["v"] == v and r.get(metric) is not None)
                        if not pts:
                            continue
                        xs = [p[0] for p in pts]
                        scale = 1e3 if metric == "time_s" else 1 / 2**20
                        ys = [max(p[1] * scale, 1e-3) for p in pts]
                        width = 2.4 if info.role == "ours" else 1.2
                        ax.plot(xs, ys, linestyle[info.role], marker=markers[k % len(markers)], ms=4, lw=width,
                                color=colors[name], label=f"{name} V={v}")
                        drew = True
                if drew:
                    ax.set_xscale("log", base=2)
                    ax.set_yscale("log")
                    ax.legend(fontsize=5.5, loc="upper left")
                    ax.grid(alpha=0.3, which="both")
                else:
                    ax.axis("off")
                if i == 0:
                    ax.set_title(f"{fw}{' LM head' if group == 'head' else ''}, {dtype}", fontsize=9)
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
    fig, axes = plt.subplots(len(kinds), len(columns), figsize=(3.4 * len(columns), 2.2 * len(kinds)), squeeze=False)
    scale = 1e3 if metric == "time_s" else 1 / 2**20
    for i, kind in enumerate(kinds):
        for j, (dtype, fw, group) in enumerate(columns):
            ax = axes[i][j]
            rows = [(name, r[metric] * scale) for name in names for r in ok
                    if r["spec"]["backend"] == name and r["spec"]["kind"] == kind and r["spec"]["dtype"] == dtype
                    and BACKENDS[name].framework == fw and BACKENDS[name].group == group and r.get(metric) is not None]
            if not rows:
                ax.axis("off")
                continue
            labels = [name for name, _ in rows][::-1]
            values = [value for _, value in rows][::-1]
            bars = ax.barh(labels, values, color=[colors[name] for name in labels])
            for bar, value in zip(bars, values):
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.0f}", va="center", fontsize=6)
            ax.set_xlim(0, max(values) * 1.25)
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


__all__ = ["annotate", "summarize", "summary_table", "summary_notes", "detail_table", "plot", "nominal_hbm_bandwidth"]
