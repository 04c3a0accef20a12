"""Run Python programs in fresh processes forked from a Python that has already imported the large
third-party packages (a "zygote"): what ``python -c CODE`` does, without paying the ~3-4 s of
importing JAX, torch and Flax per program. For test_readme_examples.py, whose ~26 blocks each
ran in a new interpreter (93 s of a 2-worker run's CPU time, 52 s this way), and for the gloo
ranks of ranks.py (~25 processes a run; three suites' launches 45 s of CPU, 28 s this way).

What a program sees is what ``python -c`` gives it: the module ``__main__`` with fresh globals
(an example that forgets ``import jax`` fails with ``NameError`` as before), ``sys.argv`` of
``["-c", *argv]``, its output on its own stdout and stderr, the environment the zygote was started
with (or the one its request gives), the zygote's working folder, the exit handlers (``atexit``) run and the streams flushed at its end, a
``SystemExit`` code or 1 after an uncaught exception (traceback on stderr). The differences: the
packages of :data:`PRELOADED` are in ``sys.modules`` already (none of this repository's: the
program imports ``lossspec``, ``jaxloss``, ``torchloss`` itself), and they were imported with the
zygote's environment. The zygote never initialises JAX's backends (no device, no thread pool of
XLA's yet): the program starts them, with the device count of the environment's ``XLA_FLAGS``,
as a new interpreter would; :func:`Zygote.start` checks that and that none of the repository's
packages was imported.

The protocol over the zygote's stdin/stdout: a request is one JSON line ``{"code", "stdout",
"stderr"}`` (the paths the child writes to; ``stderr`` null: with stdout), optionally ``"argv"``,
``"env"`` (the child's whole environment) and ``"wait": false``; the zygote forks, answers
``{"pid"}`` at once and, unless told not to wait, ``{"returncode"}`` when the child has ended. A
``{"poll": pid}`` request answers ``{"returncode"}`` of a child started without waiting, ``null``
while it runs.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: What the zygote imports before it forks (each a third-party package a page's example imports,
#: or one they import: ``torch._dynamo`` is most of ``import torchloss``'s time).
PRELOADED = ("numpy", "jax", "jax.numpy", "jax.sharding", "torch", "torch._dynamo", "flax.nnx")
OUR_PACKAGES = ("lossspec", "jaxloss", "torchloss", "lossparity", "benchmarks", "parity_tests")

_SERVER = r"""
import atexit, importlib, json, os, sys, traceback
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
from jax._src import xla_bridge
ours = sorted(m for m in sys.modules if m.split(".")[0] in json.loads(sys.argv[2]))
requests, replies = sys.stdin, os.fdopen(os.dup(1), "w", buffering=1)
replies.write(json.dumps({"ready": True, "backends": sorted(xla_bridge._backends), "ours": ours}) + "\n")
for line in requests:
    request = json.loads(line)
    if request.get("poll"):  # a child started with "wait": false: ended yet?
        pid, status = os.waitpid(request["poll"], os.WNOHANG)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status) if pid else None}) + "\n")
        continue
    pid = os.fork()
    if pid == 0:
        requests.close()
        replies.close()
        if request.get("env") is not None:
            os.environ.clear()
            os.environ.update(request["env"])
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.close(out)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if request["stderr"] else None
        os.dup2(1 if err is None else err, 2)
        if err is not None:
            os.close(err)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(0, closefd=False)
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler
            faulthandler.enable()
        sys.argv = ["-c", *request.get("argv", [])]
        code = 0
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
        try:
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    replies.write(json.dumps({"pid": pid}) + "\n")
    if request.get("wait", True):
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
"""


class Zygote:
    """A running zygote (see the module docstring); :meth:`run` is ``subprocess.run([python, "-c",
    code], capture_output=True, text=True)`` in a process forked from it."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="zygote_"))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(PRELOADED), json.dumps(OUR_PACKAGES)],
            cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self.runs = 0
        self._pending = b""  # answers read from the pipe, not yet returned

    def start(self, timeout: float = 300.0) -> None:
        """Wait until the zygote has imported :data:`PRELOADED`; it must not have started a JAX
        backend or imported a package of this repository."""
        ready = self._reply(timeout)
        assert ready.get("ready"), ready
        assert ready["backends"] == [], f"the zygote started JAX backends {ready['backends']}: a child would inherit them"
        assert ready["ours"] == [], f"the zygote imported {ready['ours']}: a child would not import them itself"

    def _send(self, request: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def _reply(self, timeout: float) -> dict:
        """The next answer line. Read from the pipe's descriptor into our own buffer: a buffered
        reader could hold a second answer (a fast child's exit right behind its pid) where
        ``select`` no longer sees it."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError(f"no answer from the zygote in {timeout} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the zygote ended (exit code {self.proc.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, code: str, timeout: float) -> subprocess.CompletedProcess:
        """Run ``code`` in a fresh child; its exit code, stdout and stderr (text). On ``timeout``
        the child is killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
        self.runs += 1
        out, err = self.folder / f"{self.runs}.out", self.folder / f"{self.runs}.err"
        self._send({"code": code, "stdout": str(out), "stderr": str(err)})
        pid = self._reply(30.0)["pid"]
        try:
            code_reply = self._reply(timeout)
        except TimeoutError:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended (and was reaped) just now
                pass
            self._reply(30.0)
            raise subprocess.TimeoutExpired(["<zygote child>"], timeout, out.read_text(), err.read_text()) from None
        result = subprocess.CompletedProcess(["<zygote child>"], code_reply["returncode"], out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return result

    def spawn(self, code: str, argv: list[str], env: dict[str, str], log: Path) -> int:
        """Start ``python -c code *argv`` with the environment ``env`` (the whole of it, in place
        of the zygote's), stdout and stderr to ``log``; its pid, without waiting for it (see
        :meth:`poll`). Variables that Python reads at its start act as they would there:
        ``PYTHONFAULTHANDLER`` (faulthandler enabled); ``PYTHONPATH`` and the working folder are
        the zygote's (start it with those of the children)."""
        self._send({"code": code, "argv": argv, "env": env, "stdout": str(log), "stderr": None, "wait": False})
        return self._reply(30.0)["pid"]

    def poll(self, pid: int) -> "int | None":
        """A spawned child's exit code once it has ended (``subprocess.Popen.poll``), else None."""
        self._send({"poll": pid})
        return self._reply(30.0)["returncode"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for path in self.folder.iterdir():
            path.unlink()
        self.folder.rmdir()


def started(env: dict[str, str], cwd: Path, timeout: float = 300.0) -> Zygote:
    """A started :class:`Zygote` (the caller closes it)."""
    zygote = Zygote(env, cwd)
    try:
        zygote.start(timeout)
    except BaseException:
        zygote.close()
        raise
    return zygote


__all__ = ["PRELOADED", "Zygote", "started"]
