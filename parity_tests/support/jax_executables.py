"""One XLA compile per distinct program in a test run: the test processes share their JAX
executables (installed by the hooks of parity_tests/support/workers.py before a test process's
first test; the library never installs it).

Why: XLA's compiles are about half of the suite's time. JAX keys its in-memory caches on the
traced program (the function, its static arguments, the jaxpr), not on what XLA compiles: two
calls whose jaxprs differ (a new closure, a ``custom_vjp`` traced under another ``jax.grad``, a
static field that only the backward reads) can lower to the same module, which XLA then
compiles again; and the two xdist workers compile the same programs where a file's tests, or two
files' programs, land on both. :func:`install` puts a cache in front of
``jax._src.compiler.compile_or_get_cached``, keyed on what JAX's own persistent cache keys an
executable on (``jax._src.cache_key.get``: the module's bytecode without its source locations, the
compile options, the backend, the devices, XLA's flags). A process keeps the executables it has
in memory; with a ``folder`` (the run's, made by the controller) it also writes each one it
compiles there, serialized, and loads what another process wrote (JAX's persistent cache does
the same, compressed, and only for compiles over a second). The same program, the same machine
code: the same bits (parity_tests/test_jax_executables_patch.py).

Never shared, compiled as JAX would: modules with host callbacks (each executable binds its own
Python functions, which the module's text does not name) and compiles under a PGLE profiler; a
program whose key, serialization or loading fails is compiled. :func:`clear` drops the
executables kept in memory; the workers call it with ``jax.clear_caches()`` at a test file's end,
which bounds a worker's memory as before.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path
from typing import Any, Optional

_EXECUTABLES: dict[str, Any] = {}
_STATE: dict[str, Any] = {"original": None, "folder": None}
#: This process's compiles, reuses of the executables it keeps, loads from the folder (another
#: process's files, or its own from before a file's end dropped them) and the compile seconds
#: those reuses and loads stood in for (the first compile's time).
COUNTS: dict[str, float] = {"compiled": 0, "reused": 0, "loaded": 0, "seconds_saved": 0.0}
_SECONDS = struct.Struct("<d")  # a file: the compile's seconds, then the serialized executable


def install(folder: Optional[Path] = None) -> None:
    """Put the cache in front of ``compile_or_get_cached`` (once a process; a later call only
    sets the folder). Imports JAX."""
    from jax._src import cache_key, compiler

    _STATE["folder"] = None if folder is None else Path(folder)
    if _STATE["original"] is not None:
        return
    original = _STATE["original"] = compiler.compile_or_get_cached

    def compile_or_reuse(backend: Any, computation: Any, devices: Any, compile_options: Any, host_callbacks: Any,
                         executable_devices: Any, pgle_profiler: Any = None) -> Any:
        args = (backend, computation, devices, compile_options, host_callbacks, executable_devices, pgle_profiler)
        if host_callbacks or pgle_profiler is not None:
            return original(*args)
        try:
            key = cache_key.get(computation, devices, compile_options, backend)
        except Exception:  # as in JAX's persistent cache: no key, an ordinary compile
            return original(*args)
        kept = _EXECUTABLES.get(key)
        if kept is not None:
            COUNTS["reused"] += 1
            COUNTS["seconds_saved"] += kept[1]
            return kept[0]
        path = None if _STATE["folder"] is None else _STATE["folder"] / key
        if path is not None and path.is_file():
            try:
                blob = path.read_bytes()
                executable = backend.deserialize_executable(blob[_SECONDS.size:], executable_devices, compile_options)
                seconds = _SECONDS.unpack_from(blob)[0]
            except Exception:  # unreadable: compile it here
                pass
            else:
                _EXECUTABLES[key] = (executable, seconds)
                COUNTS["loaded"] += 1
                COUNTS["seconds_saved"] += seconds
                return executable
        start = time.perf_counter()
        executable = original(*args)
        seconds = time.perf_counter() - start
        _EXECUTABLES[key] = (executable, seconds)
        COUNTS["compiled"] += 1
        if path is not None:
            _write(path, executable, seconds)
        return executable

    # pxla calls it through the module (compiler.compile_or_get_cached), so this reaches every jit
    compiler.compile_or_get_cached = compile_or_reuse


def _write(path: Path, executable: Any, seconds: float) -> None:
    """Write atomically (a reader sees a whole file or none); a failure only loses the sharing."""
    try:
        blob = executable.serialize()
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")  # a writer's own
        partial.write_bytes(_SECONDS.pack(seconds) + blob)
        os.replace(partial, path)
    except Exception:
        pass


def folder() -> Optional[Path]:
    """The folder this process shares its executables through (None: memory only)."""
    return _STATE["folder"]


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _STATE["original"] is not None


def kept() -> int:
    """How many executables this process keeps in memory now."""
    return len(_EXECUTABLES)


def clear() -> None:
    """Drop the executables kept in memory (JAX's own caches: ``jax.clear_caches()``); the
    folder's files stay for the other processes."""
    _EXECUTABLES.clear()
