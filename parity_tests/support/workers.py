"""The hooks of the test processes' lives, registered by parity_tests/conftest.py (which imports
them by name) and loadable as a plugin (``-p parity_tests.support.workers``):

* an xdist worker's start and end: collect the garbage, then freeze the survivors
  (:func:`pytest_collection_finish`, :func:`pytest_sessionfinish`);
* JAX's executables shared by the run's processes (:func:`pytest_runtest_setup`,
  parity_tests/support/jax_executables.py), and those kept in memory dropped after each test file
  (:func:`pytest_runtest_teardown`);
* a dead worker's fatal-error traceback and every worker's peak memory at the end of the run
  (:func:`pytest_configure`, :func:`pytest_terminal_summary`, :func:`pytest_unconfigure`).
"""

from __future__ import annotations

import faulthandler
import os
import re
import resource
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import pytest

from parity_tests.support import jax_executables

# Where each xdist worker writes a fatal error's traceback (faulthandler) and, at its end, its peak
# memory; set by the controller before it starts the workers, which inherit it.
CRASH_DIR_VARIABLE = "PARITY_TESTS_CRASH_DIR"


# The longest tests of a whole run (30 s to 100 s each on 2 cores, --durations), run first: xdist
# hands the first tests out to the workers in turn, so they start together on both instead of one
# of them ending the run alone (longest first: a 2-worker run's tail shrinks by up to the longest
# test's time). Only the order changes (parity_tests/test_worker_exit.py checks the names exist).
LONGEST_FIRST = (
    "test_parity_cli.py::test_full_matrix_every_backend",
    "test_torchloss_triton_aot.py::test_every_kernel_compiles_for_sm80_sm90_without_spills",
    "test_end_to_end.py::test_jax_and_torch_train_identically",
    "test_parity_cli.py::test_inputs_from_jax_and_torch_programs",
)


def longest_first(items: list[pytest.Item]) -> None:
    """Move the tests of :data:`LONGEST_FIRST` to the front of ``items``, in that order (a stable
    sort: every other test keeps its place; every process sorts the same collection alike)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(f"{item.path.name}::{item.name}", len(rank)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """An xdist worker, its tests collected: collect the garbage, then freeze what survives (the
    imported packages, the collected tests: ~400k objects that live as long as the worker).

    Why: each of Python's full collections walks every tracked object; with these frozen, a full
    collection walks only what the tests made since (a JAX-heavy subset: full collections 3.3 s
    of 72 s unfrozen, 2.1 s frozen)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker's last act before it reports that it has finished: collect the garbage now,
    then freeze what survives (``gc.freeze``: later collections skip it).

    Why: once every worker has reported, xdist closes the workers, and execnet gives each one 5 s
    to return before it sends itself a SIGINT. What a worker still does then is pytest's final
    ``gc.collect()`` (flushing unraisable exceptions), over the ~550k objects that JAX, torch and
    the test modules leave: 1-2 s at a load of 18 on 2 cores, more under heavier load. A SIGINT
    that arrives during the collection (C code) is raised at the next Python code, which is the
    ``gc.callbacks`` hook JAX registers (``_xla_gc_callback``); an exception there is printed as
    "Exception ignored in ... KeyboardInterrupt" at the end of a passing run. Collecting here,
    before the countdown, with pytest's unraisable-exception hook still installed, reports what
    the collection finds exactly as before; frozen objects are the live ones (the process ends
    next), so the final collection only walks what is created after this point.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    import gc

    gc.collect()
    gc.freeze()
    folder = os.environ.get(CRASH_DIR_VARIABLE)
    if folder and Path(folder).is_dir():
        (Path(folder) / f"{worker}.{os.getpid()}.peak.txt").write_text(f"{_peak_memory_gib():.2f}\n")
        counts = jax_executables.COUNTS
        (Path(folder) / f"{worker}.{os.getpid()}.executables.txt").write_text(
            " ".join(str(counts[name]) for name in ("compiled", "reused", "loaded", "seconds_saved")) + "\n"
        )


def executables_folder() -> Optional[Path]:
    """Where this run's processes share their JAX executables: ``executables/`` in the run's
    folder of reports (an xdist run's; a run without workers keeps its executables in memory)."""
    folder = os.environ.get(CRASH_DIR_VARIABLE)
    return Path(folder) / "executables" if folder else None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a process's first test: share its JAX executables
    (:mod:`parity_tests.support.jax_executables`; this imports JAX, which the first test may
    import only in its body: the CLI's full matrix, the first test of a run)."""
    if not jax_executables.installed():
        folder = executables_folder()
        if folder is not None:
            folder.mkdir(exist_ok=True)
        jax_executables.install(folder)


def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> None:
    """After a test file's last test (in this process), drop JAX's compiled executables (those
    that JAX keeps and those that :mod:`parity_tests.support.jax_executables` keeps in memory).

    Why: every jitted function, shape and static argument compiles anew and JAX keeps each
    executable for the life of the process; over the ~5600 tests a worker's memory grew to 6 GB
    (2 workers, a 24 GiB machine, beside the multi-process tests' ranks and the CLI's
    subprocesses). Files rarely share compiled functions, so clearing at a file's end costs few
    recompilations; clearing after every test costs ten times the run time.
    """
    if nextitem is not None and nextitem.path == item.path:
        return
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
        jax_executables.clear()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """The controller makes a folder for the workers' crash reports; each worker sends
    faulthandler's fatal-error tracebacks (segmentation fault, abort) to its own file there, so
    that the end of the run can show them (xdist alone prints only "worker 'gw0' crashed")."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        if getattr(config.option, "numprocesses", None):
            os.environ[CRASH_DIR_VARIABLE] = tempfile.mkdtemp(prefix="parity_tests_workers_")
        return
    folder = os.environ.get(CRASH_DIR_VARIABLE)
    if folder:
        # named by process too: a replacement worker, or a pytest run inside a test (which inherits
        # PYTEST_XDIST_WORKER), never overwrites another process's report
        report = open(Path(folder) / f"{worker}.{os.getpid()}.fatal.txt", "w")  # open until the process ends
        faulthandler.enable(file=report, all_threads=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller removes the folder it made (after its summary has read it)."""
    folder = os.environ.get(CRASH_DIR_VARIABLE)
    if os.environ.get("PYTEST_XDIST_WORKER") is None and getattr(config.option, "numprocesses", None) and folder:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[CRASH_DIR_VARIABLE]


def _peak_memory_gib() -> float:
    """This process's peak resident memory (``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@pytest.hookimpl(trylast=True)  # after --durations: right above the short test summary
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The controller's last words, kept short because a CI log often shows only its last ~50
    lines: any fatal-error traceback a worker left (the crashing thread's innermost frames), that
    a worker which crashed without one was killed (most often for memory), and each worker's peak
    memory."""
    folder = os.environ.get(CRASH_DIR_VARIABLE)
    if os.environ.get("PYTEST_XDIST_WORKER") is not None or not folder or not Path(folder).is_dir():
        return
    for report in sorted(Path(folder).glob("*.fatal.txt")):
        text = report.read_text(errors="replace").strip()
        if text:
            terminalreporter.section(f"fatal error in worker {report.name.split('.')[0]}", sep="-")
            terminalreporter.write_line(crashing_thread(text))
    crashed = [r for r in terminalreporter.stats.get("failed", []) if "crashed while running" in str(r.longrepr)]
    if crashed:
        terminalreporter.write_line(
            f"{len(crashed)} worker crash(es); a crash without a fatal-error traceback above is a kill "
            f"(SIGKILL: the kernel's out-of-memory killer, most often). Memory now: {_meminfo()}"
        )
    shared = [p.read_text().split() for p in Path(folder).glob("*.executables.txt")]
    if shared:
        compiled, reused, loaded = (sum(int(float(row[i])) for row in shared) for i in range(3))
        saved = sum(float(row[3]) for row in shared)
        terminalreporter.write_line(
            f"JAX executables: {compiled} compiled, {reused} reused in their process, {loaded} loaded from the run's folder "
            f"(~{saved:.0f} s of compiles saved)"
        )
    peaks = sorted(Path(folder).glob("*.peak.txt"))
    if peaks:
        terminalreporter.write_line(
            "workers' peak memory: " + ", ".join(f"{p.name.split('.')[0]} {p.read_text().strip()} GiB" for p in peaks)
        )


def _meminfo() -> str:
    """MemTotal and MemAvailable of /proc/meminfo, in GiB (empty off Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError:
        return ""
    gib = {name: int(fields[name].split()[0]) / 2**20 for name in ("MemTotal", "MemAvailable") if name in fields}
    return ", ".join(f"{name} {value:.1f} GiB" for name, value in gib.items())


def crashing_thread(report: str, max_frames: int = 12) -> str:
    """The part of faulthandler's ``report`` that says where the process died: the error line,
    the crashing thread's ("Current thread ...") ``max_frames`` innermost frames and, if deeper,
    its innermost frame in a ``test_*.py`` file (which test); the other threads are counted, not
    shown."""
    head, *blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", report)
    current = [block for block in blocks if block.startswith("Current thread")]
    lines = head.strip().splitlines()
    if current:
        title, *frames = current[0].strip().splitlines()
        frames = [frame for frame in frames if frame.strip()]
        lines += [title, *frames[:max_frames]]
        in_tests = [i for i, frame in enumerate(frames) if re.search(r'/test_[^/"]*\.py"', frame)]
        if in_tests and in_tests[0] >= max_frames:
            lines += [f"  ... {in_tests[0] - max_frames} frames", frames[in_tests[0]]]
        shown = max(max_frames, in_tests[0] + 1 if in_tests else 0)
        if len(frames) > shown:
            lines.append(f"  ... {len(frames) - shown} outer frames")
    lines.append(f"({len(blocks) - len(current)} other thread(s) not shown)")
    return "\n".join(lines)
