"""Benchmark runner: our losses against the peers users would pick, on the same inputs, in one run.

For every shape (N tokens x V vocabulary), dtype and loss kind it times forward+backward and
measures the peak extra memory of one call, for

- JAX: ``jaxloss`` (impl="xla"; on a GPU also "pallas"), optax under ``jax.grad``, and the
  speed-of-light pass (a jitted elementwise op reading the logits, and the teacher for the
  distillation kinds, and writing a logits-sized buffer faulted in beforehand);
- torch: ``torchloss`` (impl="torch"; on a GPU also "triton", with and without ``inplace=True``), ``F.cross_entropy`` /
  ``F.kl_div``, ``torch.compile`` of that expression, Liger-Kernel and flash-attn's Triton
  cross-entropy (GPU, where installed), the speed-of-light pass; and for cross-entropy with the LM
  head: ``F.linear`` + ``torchloss.cross_entropy(inplace=True)`` against
  ``F.linear_cross_entropy`` (and Liger's fused linear cross-entropy on a GPU).

Every contender runs with 30% and with 0% of the tokens masked (``--masked``): torchloss skips
the masked rows of 16-bit logits on the CPU, which the peers compute. The contenders of one cell
(framework, shape, dtype, kind) share one process and are timed in interleaved rounds (at least 7);
the report gives min / median / max and says "within noise" where the spreads overlap. On a GPU
torch is timed with CUDA events, JAX with the host's clock around ``jax.block_until_ready``; a
contender that writes its gradient into the logits (Liger's cross-entropy, ``inplace=True``) gets
fresh logits before every call, outside the timed region; each row is also set against the
two-read-one-write floor (``benchmarks/_registry.py``: ``floor_bytes``). Writes
``<out-dir>/<name>.json`` (commit, clean tree or not, load average before and after, machine,
versions, every repetition), ``<name>.md`` and ``<name>_time.png`` / ``<name>_memory.png``.

    python -m benchmarks.run --quick --name cpu_quick   # N=4096, V=32768: all kinds, fp32 and bf16 (~15 min, 2 idle cores)
    python -m benchmarks.run --max-minutes 90           # the full matrix, stopping cleanly at the budget
    python -m benchmarks.run --gpu-quick                # on a GPU: N=16384, V=131072, bf16, all kinds
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from benchmarks._registry import (  # noqa: E402
    BACKENDS,
    DISTILL,
    DTYPES,
    FULL_SHAPES,
    GPU_QUICK_SHAPES,
    HEAD_QUICK_HIDDEN,
    HEAD_QUICK_SHAPES,
    KINDS,
    MASKED_FRACTIONS,
    MIN_REPS,
    QUICK_SHAPES,
    Spec,
    nominal_hbm_bandwidth,
    parse_shape,
)

RESULTS = ROOT / "benchmarks" / "results"
WORKER = ROOT / "benchmarks" / "_worker.py"
GIB = 2**30


# ----------------------------------------------------------------------------------------------
# Machine
# ----------------------------------------------------------------------------------------------


def has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gpus() -> list[dict[str, Any]]:
    if not has_gpu():
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    gpus = []
    for line in out.strip().splitlines():
        name, driver, memory = (part.strip() for part in line.split(","))
        gpus.append({"name": name, "driver": driver, "memory_mib": int(float(memory))})
    return gpus


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git() -> dict[str, Any]:
    """The commit measured and whether the tree was clean (changed files, results excluded)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)benchmarks/results"], cwd=ROOT, capture_output=True, text=True).stdout
        changed = [line[3:] for line in status.splitlines() if line.strip()]
        return {"commit": commit or None, "dirty": bool(changed), "changed": changed}
    except OSError:
        return {"commit": None, "dirty": None, "changed": None}


def machine_info(device: str) -> dict[str, Any]:
    packages = ["numpy", "jax", "jaxlib", "jax-cuda12-plugin", "optax", "flax", "torch", "triton", "liger-kernel",
                "flash-attn", "matplotlib"]
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _mem_total(),
        "gpus": _gpus(),
        "device": device,
        "versions": {p: _version(p) for p in packages},
        "git": _git(),
    }
    if os.environ.get("FLASH_ATTN_CE_FILE"):
        info["flash_attn_ce_file"] = os.environ["FLASH_ATTN_CE_FILE"]
    return info


def describe_machine(info: dict[str, Any]) -> str:
    mem = info.get("memory_bytes")
    text = f"{info['cpu']}, {info.get('cpu_affinity') or info['cpu_count']} cores, {mem / GIB:.0f} GiB RAM" if mem else info["cpu"]
    if info["gpus"]:
        g = info["gpus"][0]
        text = f"{g['name']} ({g['memory_mib'] / 1024:.0f} GiB, driver {g['driver']}); host: " + text
    v = info["versions"]
    libs = ", ".join(f"{k} {v[k]}" for k in ("jax", "optax", "torch", "triton", "liger-kernel", "flash-attn") if v.get(k))
    return f"{text}; Python {info['python']}; {libs}"


# ----------------------------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one mid shape, N=4096 x V=32768 (all kinds, both dtypes)")
    mode.add_argument("--gpu-quick", action="store_true",
                      help="GPU: N=16384 x V=131072, bf16, all kinds (the shape of the GPU targets)")
    mode.add_argument("--head-quick", action="store_true",
                      help="the fused LM head: cross-entropy, N=4096 x V=32768, hidden 1024, both dtypes, the head "
                           "group only (ours fused and unfused, the peers, the three matmuls)")
    mode.add_argument("--shapes", help="comma list of NxV (default: the full matrix N in 1024,4096,16384 x V in 32768,131072)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma list of loss kinds (default: every kind of the kind table)")
    p.add_argument("--dtypes", default=None, help="comma list (default: float32,bfloat16; --gpu-quick: bfloat16)")
    p.add_argument("--backends", default=None, help=f"comma list (default: all that apply); known: {','.join(BACKENDS)}")
    p.add_argument("--skip-backends", default="", help="comma list of backends to leave out")
    p.add_argument("--no-head", action="store_true", help="leave out the LM-head group (matmul + cross-entropy)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size of the LM-head group (default: CPU 256, GPU 4096)")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--masked", default=",".join(str(m) for m in MASKED_FRACTIONS),
                   help="comma list of fractions of masked tokens, each a row of its own (default: 0.3,0.0); the "
                        "first applies to every cell, the others only to cells where one of our paths skips masked "
                        "rows (torch, 16-bit logits, CPU) unless --all-masks")
    p.add_argument("--all-masks", action="store_true", help="every --masked fraction in every cell")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per contender first (the first one compiles)")
    p.add_argument("--reps", type=int, default=MIN_REPS,
                   help=f"interleaved rounds: timed calls per contender (default and least for a verdict: {MIN_REPS})")
    p.add_argument("--sol-reps", type=int, default=3, help="speed-of-light calls per round (its floor is the best of all)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the worker processes, e.g. THP_MEM_ALLOC_ENABLE=1 (recorded); repeatable")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="time budget: cells that would not finish in it are skipped (reported), the run ends cleanly")
    p.add_argument("--mem-limit-gib", type=float, default=None,
                   help="skip backends whose estimated peak memory exceeds this (default: 20 on CPU, 90%% of the GPU's)")
    p.add_argument("--hbm-gbps", type=float, default=None,
                   help="GPU memory bandwidth in GB/s (default: from the GPU's name): the floor's rate where no "
                        "speed-of-light pass ran (else that pass's measured copy rate)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--name", default=None, help="file stem of the outputs (default: <device>_<mode>)")
    p.add_argument("--resume", type=Path, action="append", default=[], metavar="JSON",
                   help="take the measurements already in this results file (same backend, kind, shape, dtype, "
                        "device; status ok) instead of running them again; repeatable")
    p.add_argument("--report", type=Path, metavar="JSON",
                   help="measure nothing: print the tables and redraw the plots of an earlier run's results file")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its expected run time, measure nothing")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--process-per", choices=["cell", "spec"], default="cell",
                   help="cell (default): the contenders of one framework, shape, dtype and kind share a process and "
                        "are timed in interleaved rounds; spec: a fresh process each (a cross-check of the memory "
                        "figures from a never-used heap; timings not interleaved)")
    return p


def _csv(text: str | None) -> list[str]:
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def plan(args: argparse.Namespace, device: str) -> list[Spec]:
    if args.gpu_quick:
        shapes, default_dtypes = GPU_QUICK_SHAPES, ["bfloat16"]
    elif args.quick:
        shapes, default_dtypes = QUICK_SHAPES, list(DTYPES)
    elif args.head_quick:
        shapes, default_dtypes = HEAD_QUICK_SHAPES, list(DTYPES)
    elif args.shapes:
        shapes, default_dtypes = [parse_shape(s) for s in _csv(args.shapes)], list(DTYPES)
    else:
        shapes, default_dtypes = FULL_SHAPES, list(DTYPES)
    dtypes = _csv(args.dtypes) or default_dtypes
    kinds = ["cross_entropy"] if args.head_quick else _csv(args.kinds)
    for kind in kinds:
        if kind not in KINDS:
            raise SystemExit(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    wanted = _csv(args.backends) or list(BACKENDS)
    for name in wanted + _csv(args.skip_backends):
        if name not in BACKENDS:
            raise SystemExit(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    wanted = [b for b in wanted if b not in _csv(args.skip_backends)]
    if args.no_head:
        wanted = [b for b in wanted if BACKENDS[b].group != "head"]
    if args.head_quick:
        wanted = [b for b in wanted if BACKENDS[b].group == "head"]
    hidden = args.hidden or (HEAD_QUICK_HIDDEN if args.head_quick else 4096 if device == "gpu" else 256)
    masked = [float(m) for m in _csv(args.masked)]
    if not masked or any(not 0.0 <= m < 1.0 for m in masked):
        raise SystemExit(f"--masked: fractions in [0, 1) expected; got {args.masked!r}")
    specs = []
    for n, v in sorted(shapes, key=lambda s: (s[0] * s[1], s[0])):
        for dtype in dtypes:
            for kind in kinds:
                applying = [name for name in wanted if BACKENDS[name].applies(kind, device, dtype)]
                for name in applying:
                    info = BACKENDS[name]
                    # Where none of our paths in this cell skips masked rows, every contender does
                    # the same work at any mask: the headline fraction alone.
                    skips = any(BACKENDS[o].skips_masked(dtype, device) for o in applying
                                if BACKENDS[o].framework == info.framework and BACKENDS[o].group == info.group)
                    fractions = masked if args.all_masks or skips else masked[:1]
                    # The speed-of-light pass reads no mask: one per cell.
                    for fraction in ([None] if info.role == "sol" else fractions):
                        specs.append(Spec(name, kind, n, v, dtype, device, hidden, fraction, args.warmup, args.reps,
                                          args.sol_reps, args.seed))
    return specs


# ----------------------------------------------------------------------------------------------
# Time estimates (for the ETA and the budget), calibrated as the run goes
# ----------------------------------------------------------------------------------------------


class Estimator:
    """Seconds a cell's process takes: start-up, compiles, and every call (warm-up, memory,
    rounds), from each backend's ``cpu_ns`` on a CPU or the bandwidth on a GPU; rescaled by the
    measured / predicted time of the cells run so far."""

    STARTUP = {"jax": 4.0, "torch": 5.0}
    COMPILE = {"torch-compile": 25.0, "liger": 8.0, "flash-attn-ce": 8.0, "head-liger": 8.0,
               "jaxloss-pallas": 5.0, "jaxloss-pallas-inplace": 5.0, "torchloss-triton": 5.0,
               "torchloss-triton-inplace": 5.0}

    def __init__(self, device: str) -> None:
        self.device = device
        self.predicted = 0.0
        self.actual = 0.0

    def per_call(self, spec: Spec) -> float:
        elements = spec.n * spec.v * (2 if spec.kind in DISTILL else 1)
        if self.device == "gpu":
            seconds = 2e-4 + elements * 4 / 2e12
            if spec.info.group == "head":
                seconds += 6 * spec.n * spec.v * spec.hidden / 3e14
            return seconds
        return elements * spec.info.cpu_ns * 1e-9

    def raw_cell(self, specs: list[Spec]) -> float:
        total = self.STARTUP[specs[0].info.framework] + 0.5 * len(specs)
        for backend in {spec.backend for spec in specs}:  # one compile per backend (the masks share it)
            total += self.COMPILE.get(backend, 1.0)
        for spec in specs:
            calls = spec.warmup + 1 + spec.reps * (spec.sol_reps if spec.info.role == "sol" else 1)
            total += calls * self.per_call(spec)
        return total

    @property
    def scale(self) -> float:
        return self.actual / self.predicted if self.predicted > 60 else 1.0

    def __call__(self, specs: list[Spec]) -> float:
        return self.raw_cell(specs) * self.scale

    def record(self, specs: list[Spec], seconds: float) -> None:
        self.predicted += self.raw_cell(specs)
        self.actual += seconds


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def worker_env(device: str, extra: list[str]) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    for item in extra:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def run_batch(specs: list[Spec], env: dict[str, str], timeout: float | None) -> list[dict[str, Any]]:
    """Runs the specs (one cell, or one spec) in one worker process; every spec gets a result,
    whatever happens: when the process dies (a crash, an out-of-memory kill, the budget's
    timeout) the specs without a result are reported with the reason."""
    payload = json.dumps([s.to_json() for s in specs])
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(WORKER), payload], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=timeout)
        stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        stderr, code = "", "timeout"
    results = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    if len(results) < len(specs):
        why = {"timeout": f"timed out after {timeout or 0:.0f} s"}.get(code) or (
            "killed (out of memory?)" if code in (-9, 137) else f"worker exit {code}")
        results += [{"spec": spec.to_json(), "status": "error", "error": why, "stderr_tail": stderr[-1500:]}
                    for spec in specs[len(results):]]
    wall = time.perf_counter() - start
    for r in results:
        r["process_wall_s"] = wall
    return results


def _identity(spec: dict[str, Any]) -> tuple[Any, ...]:
    head = spec["hidden"] if BACKENDS[spec["backend"]].group == "head" else None
    return (spec["backend"], spec["kind"], spec["n"], spec["v"], spec["dtype"], spec["device"], head, spec.get("masked"),
            spec.get("reps"), spec.get("sol_reps"))


def _load_previous(paths: list[Path]) -> dict[tuple[Any, ...], dict[str, Any]]:
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["results"]:
            if r.get("status") == "ok" and "min_s" in r:  # results of this method only
                r = {k: v for k, v in r.items() if k in _MEASURED}  # drop the old run's ratios
                r["reused_from"] = r.get("reused_from") or str(path)
                found[_identity(r["spec"])] = r
    return found


_MEASURED = {"spec", "status", "pid", "setup_s", "compile_s", "xla_memory_analysis", "first_call_s", "loss", "mem_method",
             "mem_baseline_bytes", "mem_peak_upper_bound_bytes", "mem_extra_bytes", "times_s", "time_s", "min_s", "max_s",
             "reps", "rounds", "cell_s", "host", "process_wall_s", "reused_from"}


def _cell(spec: Spec) -> tuple[Any, ...]:
    """The contenders that share a process and a row group: every backend and masked fraction."""
    return (spec.n, spec.v, spec.dtype, spec.kind, spec.info.framework, spec.info.group)


def cell_bytes(specs: list[Spec]) -> int:
    """Rough peak memory of a cell's process: the shared inputs, the speed-of-light pass's
    output buffers, and the hungriest contender's extra."""
    first = specs[0]
    sol_buffers = first.logits_bytes + (first.input_bytes() if first.info.group == "head" else 0)
    return max(s.estimated_bytes() for s in specs) + sol_buffers


def _progress_line(r: dict[str, Any]) -> str:
    s = r["spec"]
    masked = "  -" if s.get("masked") is None else f"{100 * s['masked']:2.0f}%"
    head = f"{s['n']}x{s['v']} {s['dtype']:<8} {s['kind']:<18} {s['backend']:<16} {masked}"
    if r.get("status") != "ok":
        return f"{head} {r.get('status')}: {r.get('error', '')}"[:200]
    mem = r.get("mem_extra_bytes")
    lb = s["n"] * s["v"] * {"float32": 4, "bfloat16": 2, "float16": 2}[s["dtype"]]
    mem_text = "-" if mem is None else f"{mem / 2**20:.0f} MiB = {mem / lb:.2f} logits"
    loss = "" if r.get("loss") is None else f" loss {r['loss']:.5g}"
    return (f"{head} {r['min_s'] * 1e3:8.1f} / {r['time_s'] * 1e3:8.1f} / {r['max_s'] * 1e3:8.1f} ms "
            f"(min/med/max of {r['reps']})  mem +{mem_text}{loss}")


def report_only(path: Path, plots: bool) -> int:
    data = json.loads(path.read_text())
    meta, results = data["meta"], data["results"]
    stem = path.with_suffix("")
    summary = save(results, meta, stem, meta.get("hbm_bytes_per_s"), final=True)
    print(f"Machine: {meta['machine_text']}")
    print(_report.detail_table(results))
    print()
    print(_report.summary_table(summary))
    print(_report.summary_notes(summary, meta))
    if plots:
        for out in _report.plot(results, stem, f"{meta['machine']['device']} {meta['mode']}"):
            print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        return report_only(args.report, not args.no_plots)
    device = args.device
    if args.gpu_quick and device == "auto":
        device = "gpu"
    if device == "auto":
        device = "gpu" if has_gpu() else "cpu"
    if device == "gpu" and not has_gpu():
        raise SystemExit("--device gpu / --gpu-quick: no NVIDIA GPU found (nvidia-smi -L failed)")
    mode = "quick" if args.quick or args.gpu_quick else "head_quick" if args.head_quick else ("custom" if args.shapes else "full")
    name = args.name or f"{device}_{mode}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / name

    info = machine_info(device)
    hbm = args.hbm_gbps * 1e9 if args.hbm_gbps else (nominal_hbm_bandwidth(info["gpus"][0]["name"]) if info["gpus"] else None)
    if args.mem_limit_gib is not None:
        mem_limit = args.mem_limit_gib * GIB
    elif device == "gpu" and info["gpus"]:
        mem_limit = 0.9 * info["gpus"][0]["memory_mib"] * 2**20
    else:
        mem_limit = 20 * GIB
    specs = plan(args, device)
    if not specs:
        raise SystemExit("nothing to run: no backend applies to these kinds on this device")

    cells: dict[tuple[Any, ...], list[Spec]] = {}
    for spec in specs:
        cells.setdefault(_cell(spec), []).append(spec)
    estimate = Estimator(device)
    expected_s = sum(estimate(c) for c in cells.values() if cell_bytes(c) <= mem_limit)
    meta = {
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.run"] + (argv if argv is not None else sys.argv[1:])),
        "mode": mode,
        "machine": info,
        "machine_text": describe_machine(info),
        "load_average_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "masked_fractions": sorted({s.masked for s in specs if s.masked is not None}, reverse=True),
        "mem_limit_bytes": mem_limit,
        "hbm_bytes_per_s": hbm,
        "max_minutes": args.max_minutes,
        "expected_s": expected_s,
        "settings": {k: getattr(args, k) for k in ("warmup", "reps", "sol_reps", "seed")},
        "process_per": args.process_per,
        "worker_env": args.env,
        "hidden": specs[0].hidden,
        "backends": {b: {"framework": i.framework, "role": i.role, "group": i.group, "label": i.label}
                     for b, i in BACKENDS.items() if any(s.backend == b for s in specs)},
    }
    git = info["git"]
    print(f"benchmarks: {len(specs)} measurements in {len(cells)} cells on {device} ({meta['machine_text']})", flush=True)
    print(f"commit {git['commit']} ({'DIRTY tree: ' + ', '.join(git['changed'][:5]) if git['dirty'] else 'clean tree'}); "
          f"load average {meta['load_average_start']}", flush=True)
    print(f"expected run time ~{_fmt_duration(expected_s)} on an idle machine like the one the estimates come from "
          f"(2 cores); budget {args.max_minutes or 'none'} min; memory limit {mem_limit / GIB:.1f} GiB; "
          f"results -> {stem}.json", flush=True)
    if args.dry_run:
        for cell_specs in cells.values():
            s0 = cell_specs[0]
            print(f"  {s0.n}x{s0.v} {s0.dtype:<8} {s0.kind:<18} {s0.info.framework}/{s0.info.group}: "
                  f"{len(cell_specs)} contenders, ~{_fmt_duration(estimate(cell_specs))}"
                  + ("" if cell_bytes(cell_specs) <= mem_limit else " (skipped: memory)"))
        return 0
    if git["dirty"]:
        print("warning: the tree has uncommitted changes: these results cannot be quoted as a commit's", flush=True)
    if args.reps < MIN_REPS:
        print(f"warning: --reps {args.reps} < {MIN_REPS}: the report gives no verdicts", flush=True)

    results: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    budget = args.max_minutes * 60 if args.max_minutes is not None else None
    env = worker_env(device, args.env)
    reusable = _load_previous(args.resume)
    meta["resumed_from"] = [str(p) for p in args.resume]

    cell_list = list(cells.values())
    for index, cell_specs in enumerate(cell_list):
        elapsed = time.perf_counter() - t_start
        todo = []
        for spec in cell_specs:
            previous = reusable.get(_identity(spec.to_json()))
            if previous is not None:
                results.append(previous)
                print(f"[reused] {_progress_line(previous)}", flush=True)
            else:
                todo.append(spec)
        if not todo:
            continue
        why = None
        if cell_bytes(todo) > mem_limit:
            why = f"est. memory {cell_bytes(todo) / GIB:.1f} GiB > limit {mem_limit / GIB:.1f} GiB"
        elif budget is not None and elapsed + estimate(todo) > budget:
            why = "time budget"  # the whole cell, so that no ratio is left without its peers
        if why is not None:
            skipped = [{"spec": spec.to_json(), "status": "skipped", "error": why} for spec in todo]
            results += skipped
            for r in skipped:
                print(f"[skip] {_progress_line(r)}", flush=True)
            continue
        t0 = time.perf_counter()
        batches = [todo] if args.process_per == "cell" else [[spec] for spec in todo]
        timeout = max(60.0, budget - elapsed + 60.0) if budget is not None else None
        cell_results = [r for batch in batches for r in run_batch(batch, env, timeout)]
        estimate.record(todo, time.perf_counter() - t0)
        results += cell_results
        elapsed = time.perf_counter() - t_start
        remaining = sum(estimate(c) for c in cell_list[index + 1:] if cell_bytes(c) <= mem_limit)
        if budget is not None:
            remaining = min(remaining, max(0.0, budget - elapsed))
        pct = 100 * (index + 1) / len(cell_list)
        for r in cell_results:
            print(f"[{pct:3.0f}% {_fmt_duration(elapsed)} ETA {_fmt_duration(remaining)}] {_progress_line(r)}", flush=True)
        save(results, meta, stem, hbm, final=False)

    meta["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    meta["wall_s"] = time.perf_counter() - t_start
    meta["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    summary = save(results, meta, stem, hbm, final=True)

    print()
    print(f"Machine: {meta['machine_text']}")
    print(f"Commit {git['commit']}, {'DIRTY' if git['dirty'] else 'clean'} tree; {meta['wall_s'] / 60:.1f} min "
          f"(expected {expected_s / 60:.1f}); load average at start/end: {meta['load_average_start']} / "
          f"{meta['load_average_end']}")
    print("\nAll measurements (ms: min / median / max of forward+backward; mem: peak extra over the inputs)")
    print(_report.detail_table(results))
    print("\nSummary: our default path vs the fastest peer of the same framework and the speed-of-light floor")
    print(_report.summary_table(summary))
    print(_report.summary_notes(summary, meta))
    if not args.no_plots:
        try:
            paths = _report.plot(results, stem, f"{device} {mode}")
            for path in paths:
                print(f"wrote {path}")
        except ImportError:
            print("matplotlib not installed: no plots")
    print(f"wrote {stem}.json, {stem}.md")
    return 0


def save(results: list[dict[str, Any]], meta: dict[str, Any], stem: Path, hbm: float | None, final: bool) -> list[dict[str, Any]]:
    _report.annotate(results, hbm)
    summary = _report.summarize(results, meta)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "results": results}, indent=1) + "\n")
    if final:
        stem.with_suffix(".md").write_text(_report.markdown(meta, summary, results))
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
