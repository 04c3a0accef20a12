"""Launch torch.distributed ranks for the tests as plain processes, and join the gloo group.

Why not torchrun: its elastic agent and TCP rendezvous add a layer that was seen to stall (on a
busy machine, and once in CI for the whole 600 s with nothing printed). Here each rank is a
process of its own; they meet through a FileStore (no TCP rendezvous, no hostname look-up),
gloo is pinned to the loopback interface, every collective has a timeout, and a rank that is
still running near the deadline dumps its Python stack to its log and exits. On any failure the
test shows each rank's log, so a hang explains itself instead of timing out in silence.

Not a test module (no ``test_`` prefix); used by the tests and their worker scripts.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from parity_tests.support import zygote

if TYPE_CHECKING:
    import numpy as np
    import pytest

RANK_TIMEOUT_S = 240  # a rank dumps its stack and exits after this long
COLLECTIVE_TIMEOUT_S = 120  # one gloo collective (or the rendezvous) waits at most this long
_ENV_INIT_FILE = "LOSS_TESTS_INIT_FILE"
# A rank runs ``script`` as ``__main__`` (``python script args``), after installing the test
# processes' Triton-interpreter shortcut where the interpreter is on (triton_interpreter.py:
# the ranks' interpreted Triton rows are as slow as the workers' were without it).
_RANK_BOOTSTRAP = (
    "import os, runpy, sys\n"
    "if os.environ.get('TRITON_INTERPRET') == '1':\n"
    "    from parity_tests.support import triton_interpreter\n"
    "    triton_interpreter.install()\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def launch(script: Path, args: list[str], world_size: int, log_dir: Path, timeout_s: float = RANK_TIMEOUT_S + 60) -> None:
    """Run ``python script *args`` (through :data:`_RANK_BOOTSTRAP`) as ``world_size`` ranks (RANK/WORLD_SIZE in the environment),
    each a process forked from this process's zygote (:func:`_zygote`); raise AssertionError with every rank's log unless all
    exit 0 within ``timeout_s``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    init_file = log_dir / "init_store"
    init_file.unlink(missing_ok=True)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world_size), **{_ENV_INIT_FILE: str(init_file)},
               PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p),
               PYTHONFAULTHANDLER="1")
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    logs = [log_dir / f"rank{rank}.log" for rank in range(world_size)]
    fork = _zygote(env)
    pids = [fork.spawn(_RANK_BOOTSTRAP, [str(script), *args], dict(env, RANK=str(rank)), logs[rank]) for rank in range(world_size)]
    codes: list[Optional[int]] = [None] * world_size

    def poll() -> list[Optional[int]]:
        for rank, pid in enumerate(pids):
            if codes[rank] is None:
                codes[rank] = fork.poll(pid)
        return codes

    deadline = time.monotonic() + timeout_s
    failed = ""
    while any(code is None for code in poll()):
        if time.monotonic() > deadline:
            failed = f"timed out after {timeout_s:.0f} s"
            break
        if any(code not in (None, 0) for code in codes):
            time.sleep(2)  # let the other ranks notice and write their part of the story
            failed = "a rank failed"
            break
        time.sleep(0.1)
    for rank, pid in enumerate(pids):
        if codes[rank] is None:
            os.kill(pid, signal.SIGKILL)
            while poll()[rank] is None:
                time.sleep(0.05)
    if failed or any(codes):
        report = [f"{failed or 'non-zero exit'}; exit codes {codes}"]
        for rank, log in enumerate(logs):
            report.append(f"----- rank {rank} log ({log}) -----\n{log.read_text()[-4000:]}")
        raise AssertionError("\n".join(report))


_ZYGOTES: dict[str, zygote.Zygote] = {}


def _zygote(env: dict[str, str]) -> zygote.Zygote:
    """This process's zygote for the ranks (parity_tests/support/zygote.py: a rank forked from it
    is ``python -c`` without the ~4 s of importing JAX and torch), started at the first launch with
    the ranks' environment, whose ``PYTHONPATH`` (the repository root) and ``OMP_NUM_THREADS=1``
    (read when torch loads OpenMP) it keeps; each rank gets the whole environment of its launch."""
    running = _ZYGOTES.get("ranks")
    if running is None or running.proc.poll() is not None:
        running = _ZYGOTES["ranks"] = zygote.started(env, Path.cwd())
        atexit.register(running.close)
    return running


def init_gloo() -> tuple[int, int]:
    """In a rank started by ``launch`` (FileStore) or by ``torchrun`` (its TCP store, ``env://``):
    arm the stack dump, pin gloo to loopback, join the gloo group; returns (rank, world)."""
    import torch
    import torch.distributed as dist

    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    torch.set_num_threads(1)
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_file = os.environ.get(_ENV_INIT_FILE)
    dist.init_process_group("gloo", init_method=f"file://{init_file}" if init_file else "env://", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    print(f"[rank {rank}/{world_size}] joined the gloo group", flush=True)
    return rank, world_size


def finish(rank: int) -> None:
    """End a rank without tearing the process group down: wait for every rank, then exit.

    Why not ``destroy_process_group()`` and a normal exit: freeing the last reference to a gloo
    process group joins its worker thread while holding the GIL, and that thread may still be
    releasing a finished collective's tensors, which needs the GIL: a deadlock, seen here (py-spy:
    ``~ProcessGroupGloo`` -> ``std::thread::join`` on the main thread, ``~AsyncAllgatherWork`` ->
    ``gil_scoped_acquire`` on gloo's thread) after every result had been written. The OS
    reclaims the sockets; nothing is left to flush but stdout.
    """
    import torch.distributed as dist

    dist.barrier()
    print(f"[rank {rank}] done", flush=True)
    sys.stderr.flush()
    os._exit(0)


def launch_once(name: str, script: Path, args_for: Callable[[Path], list[str]], world_size: int,
                tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, np.ndarray]]:
    """:func:`launch_dir_once`, then each rank's ``r{rank}.npz`` from its directory as a dict,
    in rank order."""
    import numpy as np

    out_dir = launch_dir_once(name, script, args_for, world_size, tmp_path_factory)
    loaded = []
    for rank in range(world_size):
        with np.load(out_dir / f"r{rank}.npz") as data:
            loaded.append({key: data[key] for key in data.files})
    return loaded


def launch_dir_once(name: str, script: Path, args_for: Callable[[Path], list[str]], world_size: int,
                    tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`launch` the ranks once per test session, whichever pytest-xdist worker asks first;
    returns the directory they wrote to (their logs are there too).

    A module-scoped fixture runs once in every worker that receives one of the module's tests, and
    xdist spreads a module's tests over its workers: under ``-n 2`` the ranks were launched twice.
    Here the first asker launches them into a directory that every worker shares (under xdist, the
    parent of the worker's base temporary directory) and marks it done; the others wait on the same
    file lock. A failed launch marks nothing: the next asker retries and shows the ranks' logs
    itself. ``args_for(out_dir)`` gives the script's arguments.
    """
    from filelock import FileLock  # a dependency of torch

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out_dir = shared / f"ranks_{name}"
    with FileLock(str(shared / f"ranks_{name}.lock")):
        done = out_dir / "done"
        if not done.exists():
            launch(script, args_for(out_dir), world_size=world_size, log_dir=out_dir)
            done.write_text("ok\n")
    return out_dir
