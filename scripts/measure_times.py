"""Measure how long the README's commands take and write docs/timings.md, the one place that states it.

    python3 scripts/measure_times.py                  # everything: about 30-60 min on 2 idle cores
    python3 scripts/measure_times.py --skip-full      # all but the whole test suite
    python3 scripts/measure_times.py --busy 2 --steps main,fast   # beside 2 spinning processes

It clones the repository's committed HEAD (uncommitted changes are not measured) into a temporary
folder and times there, one after the other:

- ``setup``: ``bash scripts/setup.sh`` creating a fresh ``.venv`` (installs every package);
- ``main``: ``bash scripts/main.sh`` (the main job: lossparity's matrix, then the two demos);
- ``fast``: the fast lane, ``.venv/bin/python -m pytest -m "not slow" -n 2 parity_tests``;
- ``full``: ``bash scripts/test.sh``, the whole suite (what CI runs).

The table records the machine (CPU model, cores), the load average before and after each step
(other people's work on a shared machine lengthens every figure), the date and the commit, and
each step's outcome (pytest's summary line). ``--venv PATH`` reuses a set-up virtualenv instead
of timing the set-up (setup.sh still runs and reinstalls into it if its stamp differs: never
point it at a virtualenv others use); ``--steps`` and ``--pytest-k`` are for checking this script
on a small part (the table then says what was left out).

``--busy N`` times the steps beside N spinning processes that this script starts and stops
(``benchmarks/spinners.py``; each also ends itself after ``--busy-seconds``), a bounded stand-in
for a shared machine, and writes its table into the page's "Beside a competing load" section,
leaving the idle table as it was (and an idle run leaves that section as it was).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.spinners (standard library only: no virtualenv needed)

from benchmarks.spinners import Spinners  # noqa: E402

BUSY_SECTION = "## Beside a competing load"
STEPS = {  # name -> (what the README calls it, command run in the clone)
    "setup": ("set-up from scratch (`bash scripts/setup.sh`, fresh `.venv`)", "bash scripts/setup.sh"),
    "main": ("the main job (`bash scripts/main.sh`: lossparity, then the two demos)", "bash scripts/main.sh"),
    "fast": ("the fast lane (`pytest -m \"not slow\" -n 2 parity_tests`)",
             ".venv/bin/python -m pytest -q -m 'not slow' -n 2 parity_tests"),
    "full": ("the whole test suite (`bash scripts/test.sh`, what CI runs)", "bash scripts/test.sh"),
}
PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|error|errors|skipped|deselected)\b.*?)\s*=*$")


def cpu_model() -> str:
    """The CPU's model name (Linux), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def minutes(seconds: float) -> str:
    """``m:ss``."""
    return f"{int(seconds // 60)}:{int(round(seconds % 60)):02d}"


def outcome(returncode: int, output: str) -> str:
    """pytest's summary line where there is one, else the exit status."""
    for line in reversed(output.splitlines()):
        match = PYTEST_SUMMARY.match(line.strip())
        if match:
            return match.group(1) + ("" if returncode == 0 else f" (exit {returncode})")
    return "ok" if returncode == 0 else f"FAILED (exit {returncode})"


def run_step(name: str, command: str, clone: Path, log: Path) -> dict[str, str]:
    """Runs one step in the clone, its output to ``log``; its row of the table."""
    env = dict(os.environ, PYTHONPATH=str(clone))  # the clone's code, whatever the venv was installed from
    print(f"[measure] {name}: {command}", flush=True)
    before = load()
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(command, shell=True, cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    row = {"step": STEPS[name][0], "time": minutes(seconds), "load": f"{before} -> {load()}",
           "result": outcome(proc.returncode, text)}
    print(f"[measure] {name}: {row['time']} ({row['result']})", flush=True)
    return row


def table_lines(rows: dict[str, dict[str, str]], commit: str, note: str) -> list[str]:
    """The machine, the date, the commit and a row per step (in the README's order)."""
    cores = os.cpu_count()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Machine: {cpu_model()}, {affinity} cores available ({cores} online), {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()} (running this script).",
        f"Measured {now}, commit `{commit}`.",
        "",
        "| step | wall time (m:ss) | load average 1/5/15 min, before -> after | result |",
        "|---|---|---|---|",
    ]
    for name, (label, _) in STEPS.items():
        r = rows.get(name)
        lines.append(f"| {label} | {r['time']} | {r['load']} | {r['result']} |" if r else f"| {label} | not measured in this run | | |")
    if note:
        lines += ["", note]
    return lines


def write_table(path: Path, rows: dict[str, dict[str, str]], commit: str, note: str, busy: int = 0) -> None:
    """docs/timings.md: the idle table, then the section beside a competing load; a run replaces its
    own part and keeps the other."""
    old = path.read_text() if path.exists() else ""
    idle_part, _, busy_part = old.partition(BUSY_SECTION)
    idle_lines = idle_part.rstrip("\n").split("\n")
    if busy:
        busy_lines = [
            f"Each step beside {busy} spinning processes (`--busy {busy}`: busy loops that this script starts",
            "before the step and stops after it), on top of whatever else the machine ran.",
            "",
        ] + table_lines(rows, commit, note)
    else:
        idle_lines = [
            "# How long things take",
            "",
            "The one place that states the project's times; every other page links here. Written by",
            "`python3 scripts/measure_times.py` (a fresh clone in a temporary folder, each step timed in turn);",
            "rerun it to refresh the table. Wall-clock times on the machine below: other people's work on a",
            "shared machine lengthens them (the load averages say how busy it was), and the set-up's downloads",
            "depend on the network and on pip's cache.",
            "",
        ] + table_lines(rows, commit, note)
        busy_lines = busy_part.strip("\n").split("\n") if busy_part.strip() else []
    text = "\n".join(idle_lines) + "\n"
    if busy_lines:
        text += "\n" + BUSY_SECTION + "\n\n" + "\n".join(busy_lines) + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 scripts/measure_times.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma list of steps (default: {','.join(STEPS)})")
    parser.add_argument("--skip-full", action="store_true", help="leave out the whole test suite")
    parser.add_argument("--venv", help="reuse this set-up virtualenv (symlinked into the clone) instead of timing the set-up")
    parser.add_argument("--python", default=None, help="the Python that setup.sh creates .venv with (its PYTHON)")
    parser.add_argument("--pytest-k", default=None, help="only the fast-lane tests matching this -k expression (a check of this script)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "timings.md"), help="the table to write (default docs/timings.md)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary clone and the logs (kept anyway when a step fails)")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes beside every step (default 0: idle)")
    parser.add_argument("--busy-seconds", type=float, default=7200.0, help="hard limit of each spinner's life (default 7200)")
    args = parser.parse_args(argv)
    if args.busy < 0:
        parser.error("--busy must be at least 0")
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}; known: {list(STEPS)}")
    if args.skip_full and "full" in steps:
        steps.remove("full")
    if args.venv and "setup" in steps:
        steps.remove("setup")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                      text=True).stdout.strip():
        print(f"[measure] note: uncommitted changes are not measured (the clone is commit {commit})", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="measure_times_"))
    clone = tmp / "repo"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    if args.venv:
        (clone / ".venv").symlink_to(Path(args.venv).resolve())
    if args.python:
        os.environ["PYTHON"] = args.python
    rows: dict[str, dict[str, str]] = {}
    for name in steps:
        command = STEPS[name][1]
        if name == "fast" and args.pytest_k:
            command += f" -k {shlex.quote(args.pytest_k)}"
        with Spinners(args.busy, args.busy_seconds):
            rows[name] = run_step(name, command, clone, tmp / f"{name}.log")
        if name == "setup":  # what the set-up installed: the size of the fresh .venv
            size = subprocess.run(["du", "-sh", str(clone / ".venv")], capture_output=True, text=True).stdout.split()
            if size:
                rows[name]["result"] += f"; `.venv` {size[0]}B"
    notes = []
    if args.venv:
        notes.append("The set-up was not timed: an existing virtualenv was reused.")
    if args.pytest_k:
        notes.append(f"The fast lane ran only the tests matching `-k {args.pytest_k}` (a check of the script, not a figure).")
    write_table(Path(args.out), rows, commit, " ".join(notes), args.busy)
    failed = [name for name, r in rows.items() if "exit" in r["result"]]
    for name in failed:  # the failing tests' names, and the logs kept: a failure is worth reading
        for line in (tmp / f"{name}.log").read_text(errors="replace").splitlines():
            if line.startswith(("FAILED ", "ERROR ")):
                print(f"[measure] {name}: {line}", flush=True)
    keep = args.keep or bool(failed)
    print(f"[measure] wrote {args.out}" + (f"; clone and logs in {tmp}" if keep else ""), flush=True)
    if not keep:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
