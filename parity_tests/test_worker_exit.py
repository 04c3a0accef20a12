"""The start and the end of an xdist worker's session: once its tests are collected
(``workers.pytest_collection_finish``) and before it reports that it has finished
(``workers.pytest_sessionfinish``) the garbage is collected and what survives is frozen, so that
Python's full collections walk only what the tests made, and pytest's last collection does not
outlast execnet's 5 s exit allowance (a SIGINT printed as a ``KeyboardInterrupt`` in JAX's
``_xla_gc_callback`` at the end of a passing run); the worker leaves its peak memory and its
counts of JAX executables for the controller's summary (``workers.pytest_terminal_summary``),
and shares those executables with the run's other worker."""

from __future__ import annotations

import gc
import os
import re
import resource
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

from parity_tests.support import jax_executables, workers


class _Node:
    """A reference cycle: freed only by the cyclic garbage collector."""

    def __init__(self) -> None:
        self.me = self


def test_a_worker_collects_then_freezes_once_its_tests_are_collected(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the imports and the collection made is frozen: Python's full collections then walk
    only what the tests make."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    frozen_before = gc.get_freeze_count()
    gc.disable()
    try:
        garbage = _Node()
        collected = weakref.ref(garbage)
        del garbage
        survivor = _Node()
        workers.pytest_collection_finish(session=None)
        assert collected() is None  # collected first, not frozen
        assert gc.get_freeze_count() > frozen_before and survivor is not None
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_worker_collects_then_freezes_at_session_end(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    monkeypatch.setenv(workers.CRASH_DIR_VARIABLE, str(tmp_path))
    frozen_before = gc.get_freeze_count()
    gc.disable()  # no automatic collection between building the cycle and the hook
    try:
        garbage = _Node()
        collected = weakref.ref(garbage)
        del garbage
        assert collected() is not None
        workers.pytest_sessionfinish(session=None)
        assert collected() is None  # collected first: the cycle is not among the frozen objects
        assert gc.get_freeze_count() > frozen_before
        # and it leaves its peak memory for the controller's summary: this process's, in GiB
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        assert abs(float((tmp_path / f"gw7.{os.getpid()}.peak.txt").read_text()) - peak_gib) <= 0.0051
        # and its counts of JAX executables (compiled, reused, loaded, seconds saved)
        counts = jax_executables.COUNTS
        written = (tmp_path / f"gw7.{os.getpid()}.executables.txt").read_text().split()
        assert written == [str(counts[name]) for name in ("compiled", "reused", "loaded", "seconds_saved")]
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_run_without_workers_is_left_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv(workers.CRASH_DIR_VARIABLE, str(tmp_path))
    frozen_before = gc.get_freeze_count()  # an xdist worker froze its imports after collection
    gc.disable()
    try:
        garbage = _Node()
        collected = weakref.ref(garbage)
        del garbage
        workers.pytest_collection_finish(session=None)
        workers.pytest_sessionfinish(session=None)
        assert collected() is not None and gc.get_freeze_count() == frozen_before
        assert not list(tmp_path.iterdir())
    finally:
        gc.collect()
        gc.enable()


CRASHING_TESTS = '''
import faulthandler
import os
import signal


def test_passes():
    pass


def test_segfaults():
    faulthandler._sigsegv()


def test_is_killed():
    os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.mark.slow  # a pytest run with two xdist workers in a subprocess
def test_a_crashed_workers_traceback_and_the_peaks_end_the_run(tmp_path: Path) -> None:
    """xdist alone reports a dead worker as one line; the run's end shows the fatal error's
    traceback (faulthandler, naming the test), says that a crash without one was a kill, and
    gives each worker's peak memory."""
    (tmp_path / "test_crashing.py").write_text(CRASHING_TESTS)
    env = dict(os.environ, PYTHONPATH=str(Path(workers.__file__).parents[2]))
    env.pop(workers.CRASH_DIR_VARIABLE, None)
    env.pop("PYTEST_XDIST_WORKER", None)
    env["TMPDIR"] = str(tmp_path)  # where the run makes its folder of reports (removed at its end)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "parity_tests.support.workers", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_crashing.py")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "1 passed" in out and "2 failed" in out, out
    assert "fatal error in worker gw" in out and "Segmentation fault" in out, out
    assert 'test_crashing.py", line 12 in test_segfaults' in out, out
    assert "2 worker crash(es); a crash without a fatal-error traceback above is a kill" in out, out
    assert not list(tmp_path.glob("parity_tests_workers_*")), "the run's folder of reports is left behind"
    peaks = re.search(r"workers' peak memory: (.*)", out)
    assert peaks is not None and re.fullmatch(r"gw\d+ \d+\.\d\d GiB(, gw\d+ \d+\.\d\d GiB)*", peaks.group(1)), out


SHARING_TESTS = """
import jax
import numpy as np
import pytest


@pytest.mark.parametrize("copy", range(4))
def test_the_same_program(copy):
    x = np.arange(6, dtype=np.float32)
    out = jax.jit(lambda v: v * 3.0 + 1.0)(x)  # a new function each time: JAX alone compiles it 4 times
    np.testing.assert_array_equal(np.asarray(out), x * 3.0 + 1.0)
"""


@pytest.mark.slow  # a pytest run with two xdist workers in a subprocess
def test_the_workers_share_their_jax_executables(tmp_path: Path) -> None:
    """Four tests, one program, two workers: compiled once or, where both workers got there
    first, twice; every other call takes a kept or a loaded executable, and the run's end says
    so (its folder of executables removed with the reports)."""
    (tmp_path / "test_sharing.py").write_text(SHARING_TESTS)
    env = dict(os.environ, PYTHONPATH=str(Path(workers.__file__).parents[2]), TMPDIR=str(tmp_path))
    env.pop(workers.CRASH_DIR_VARIABLE, None)
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "parity_tests.support.workers", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_sharing.py")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )
    out = run.stdout
    assert run.returncode == 0 and "4 passed" in out, out + run.stderr
    line = re.search(r"JAX executables: (\d+) compiled, (\d+) reused in their process, (\d+) loaded from the run's folder "
                     r"\(~\d+ s of compiles saved\)", out)
    assert line is not None, out
    compiled, reused, loaded = (int(n) for n in line.groups())
    assert compiled in (1, 2) and compiled + reused + loaded == 4, out
    assert not list(tmp_path.glob("parity_tests_workers_*")), "the run's folder of executables is left behind"


def test_jax_caches_are_dropped_after_each_files_last_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two tests of one file JAX keeps its compiled executables; after a file's last test
    (the next test is in another file, or there is none) they are dropped, with those that
    parity_tests/support/jax_executables.py keeps in memory."""
    import jax

    drops = []
    monkeypatch.setattr(jax, "clear_caches", lambda: drops.append("jax"))
    monkeypatch.setattr(jax_executables, "clear", lambda: drops.append("shared"))
    first, second, other = (SimpleNamespace(path=Path(name)) for name in ("test_a.py", "test_a.py", "test_b.py"))
    workers.pytest_runtest_teardown(first, second)
    assert drops == []
    workers.pytest_runtest_teardown(second, other)
    assert sorted(drops) == ["jax", "shared"]
    workers.pytest_runtest_teardown(other, None)
    assert sorted(drops) == ["jax", "jax", "shared", "shared"]


FAULTHANDLER_REPORT = """Fatal Python error: Segmentation fault

Thread 0x00007f00000000aa (most recent call first):
  File "/x/execnet/gateway_base.py", line 534 in read

Current thread 0x00007f00000000bb (most recent call first):
""" + "".join(f'  File "/x/jax/_src/inner{i}.py", line {i} in f{i}\n' for i in range(20)) + """  File "/repo/parity_tests/test_rounding_16bit.py", line 99 in _grad
  File "/repo/parity_tests/test_rounding_16bit.py", line 150 in test_rounded
  File "/x/_pytest/python.py", line 187 in pytest_pyfunc_call
"""


def test_the_crash_report_names_the_test_below_deep_frames() -> None:
    """A CI log shows its last lines: the crash report keeps to the crashing thread's innermost
    frames and, beyond them, its innermost frame in a test file."""
    lines = workers.crashing_thread(FAULTHANDLER_REPORT, max_frames=12).splitlines()
    assert lines[0] == "Fatal Python error: Segmentation fault"
    assert lines[1].startswith("Current thread 0x00007f00000000bb")
    assert lines[2:14] == [f'  File "/x/jax/_src/inner{i}.py", line {i} in f{i}' for i in range(12)]
    assert lines[14:] == [
        "  ... 8 frames",
        '  File "/repo/parity_tests/test_rounding_16bit.py", line 99 in _grad',
        "  ... 2 outer frames",
        "(1 other thread(s) not shown)",
    ]


def test_longest_tests_named_first_exist() -> None:
    """Every test that ``longest_first`` moves to the front is one the suite has (a misspelt or
    renamed one would silently lose the ordering's gain), and the sort keeps the others' order."""
    import ast
    from types import SimpleNamespace

    from parity_tests.support.workers import LONGEST_FIRST, longest_first

    here = Path(__file__).parent
    for name in LONGEST_FIRST:
        file, test = name.split("::")
        tree = ast.parse((here / file).read_text())
        assert test in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, name
    items = [SimpleNamespace(path=Path(f"/x/{n.split('::')[0]}"), name=n.split("::")[1]) for n in ("a.py::t1", LONGEST_FIRST[1], "b.py::t2", LONGEST_FIRST[0])]
    longest_first(items)  # type: ignore[arg-type]
    assert [f"{i.path.name}::{i.name}" for i in items] == [LONGEST_FIRST[0], LONGEST_FIRST[1], "a.py::t1", "b.py::t2"]
