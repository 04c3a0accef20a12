"""Test-session set-up: several JAX CPU devices and the Triton interpreter on CPU machines.

Both must be set before JAX initialises its backends and before Triton kernels are defined.
"""

import os
import shutil
import subprocess

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _has_cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import faulthandler  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import pytest  # noqa: E402

# Where each xdist worker writes a fatal error's traceback (faulthandler) and, at its end, its peak
# memory; set by the controller before it starts the workers, which inherit it.
CRASH_DIR_VARIABLE = "PARITY_TESTS_CRASH_DIR"

# The fast lane (`pytest -m "not slow"`) leaves out what the developers' guide puts in the slow
# tier: interpreted kernels (Pallas interpret mode, the Triton interpreter), multi-process and
# end-to-end runs, README examples, subprocess CLIs. CI runs everything.
SLOW_FILES = {
    "test_end_to_end.py",
    "test_readme_examples.py",
    "test_distributed_torch.py",
    "test_distributed_torch_tp.py",
    "test_distributed_jax_multiprocess.py",
    "test_distributed_jax.py",  # 8 host devices: shard_map / pmap equivalence suites
    "test_jaxloss_vocab_parallel.py",
    "test_torchloss_vocab_parallel.py",
    "test_parity_cli.py",
    "test_benchmarks_smoke.py",
    "test_torchloss_triton_kernels.py",
    "test_torchloss_triton_vocab_parallel.py",
    "test_torchloss_triton_threads.py",
    "test_torchloss_triton_aot.py",
    "test_linear_head_kernels.py",  # the fused head's Pallas / Triton kernels, interpreted
    # Compile-heavy JAX suites (large-shape chunking and memory, second order, NNX training loops):
    # seconds per test, in the slow tier so that the fast lane stays under two minutes.
    "test_jaxloss_kernels.py",
    "test_jaxloss_derivatives.py",
    "test_jaxloss_nnx.py",
    "test_linear_head_edge.py",  # fused-head edges: a JAX compile per case
    # More JAX compiles per test than the fast lane's two minutes allow (each keeps a cover in
    # another fast file: transforms in test_jaxloss_oracle, the head in test_linear_head, 16-bit
    # rounding in test_torchloss_oracle, per-sequence modes in test_sequence_normalization).
    "test_jaxloss_transforms.py",
    "test_jaxloss_multisteps.py",
    "test_rounding_16bit.py",
    "test_linear_head_sequences.py",
    "test_linear_head_vocab_parallel.py",
    "test_vocab_parallel_mixture_tiles.py",
    "test_torchloss_compile.py",  # torch.compile: Inductor compiles (eager twins: test_torchloss_autograd)
    "test_jaxloss_entropy_jsd.py",  # JAX cover: test_softcap, test_sequence_normalization
    "test_jaxloss_labels.py",
    "test_jaxloss_upstream_16bit.py",
}
_INTERPRETED = re.compile(r"[\[\-_](triton|pallas)[\]\-_]|triton|pallas", re.IGNORECASE)
# The newest matrices keep their float32 cases in the fast lane; their 16-bit variants (the same
# code paths with one more rounding, checked again by test_rounding_16bit.py) run in the slow tier.
FLOAT32_FAST_FILES = {
    "test_jaxloss_oracle.py",
    "test_softcap.py",
    "test_causal_shift.py",
    "test_accumulate_split.py",
    "test_linear_head.py",
    "test_jaxloss_entropy_jsd.py",
    "test_torchloss_entropy_jsd.py",
    "test_sequence_normalization.py",
}
_SIXTEEN_BIT = re.compile(r"bfloat16|float16")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_FILES or _INTERPRETED.search(item.name):
            item.add_marker(pytest.mark.slow)
        elif item.path.name in FLOAT32_FAST_FILES and _SIXTEEN_BIT.search(item.name):
            item.add_marker(pytest.mark.slow)


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
        (Path(folder) / f"{worker}.peak.txt").write_text(f"{_peak_memory_gib():.1f}\n")


def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> None:
    """After a test file's last test (in this process), drop JAX's compiled executables.

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
        report = open(Path(folder) / f"{worker}.fatal.txt", "w")  # open until the process ends
        faulthandler.enable(file=report, all_threads=True)


def _peak_memory_gib() -> float:
    """This process's peak resident memory (``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The controller's last words: each worker's peak memory, and any fatal-error traceback a
    worker left (a worker that crashed without one was killed, most often for memory)."""
    folder = os.environ.get(CRASH_DIR_VARIABLE)
    if os.environ.get("PYTEST_XDIST_WORKER") is not None or not folder or not Path(folder).is_dir():
        return
    peaks = sorted(Path(folder).glob("*.peak.txt"))
    if peaks:
        terminalreporter.write_line(
            "workers' peak memory: " + ", ".join(f"{p.name.split('.')[0]} {p.read_text().strip()} GiB" for p in peaks)
        )
    for report in sorted(Path(folder).glob("*.fatal.txt")):
        text = report.read_text(errors="replace").strip()
        if text:
            terminalreporter.section(f"fatal error in worker {report.name.split('.')[0]}", sep="-")
            terminalreporter.write_line(_crashing_thread_first(text))
    crashed = [r for r in terminalreporter.stats.get("failed", []) if "crashed while running" in str(r.longrepr)]
    if crashed:
        terminalreporter.write_line(
            f"{len(crashed)} worker crash(es); a crash without a fatal-error traceback above is a kill "
            f"(SIGKILL: the kernel's out-of-memory killer, most often). Memory now: {_meminfo()}"
        )


def _meminfo() -> str:
    """MemTotal and MemAvailable of /proc/meminfo, in GiB (empty off Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError:
        return ""
    gib = {name: int(fields[name].split()[0]) / 2**20 for name in ("MemTotal", "MemAvailable") if name in fields}
    return ", ".join(f"{name} {value:.1f} GiB" for name, value in gib.items())


def _crashing_thread_first(report: str, max_lines: int = 80) -> str:
    """faulthandler's report with the crashing thread's stack ("Current thread ...") first, then
    the other threads', at most ``max_lines`` lines: the first lines are what a CI log shows."""
    head, *blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", report)
    blocks.sort(key=lambda block: not block.startswith("Current thread"))
    return "\n".join("\n".join([head, *blocks]).splitlines()[:max_lines])
