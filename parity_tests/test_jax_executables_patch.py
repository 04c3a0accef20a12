"""The test processes' sharing of JAX executables (parity_tests/support/jax_executables.py): two
jitted functions that lower to the same program run one executable, compiled once, and give the
same bits, in one process or loaded from the file another process wrote; a program that differs
in a constant, in its compile options, or that calls back into Python (the callback is not part
of the program's text) gets its own compile, and so does one whose file is unreadable."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parity_tests.support import jax_executables

X = np.linspace(-3.0, 5.0, 7 * 13, dtype=np.float32).reshape(7, 13)


def _counts() -> tuple[int, int]:
    """This process's executables new to it (compiled, or loaded from the run's other process),
    and its reuses of those it keeps."""
    counts = jax_executables.COUNTS
    return int(counts["compiled"] + counts["loaded"]), int(counts["reused"])


def _affine(offset: float) -> Callable[[Any], Any]:
    # a new closure each call: JAX traces and lowers it anew, to the same module for the same offset
    return jax.jit(lambda x: jnp.tanh(x * 1.8125 + offset))


def test_the_sharing_is_installed_in_this_worker() -> None:
    assert jax_executables.installed()


def test_equal_programs_share_one_executable_and_others_compile_their_own() -> None:
    compiled, reused = _counts()
    first = np.asarray(_affine(0.4375)(X))
    assert _counts() == (compiled + 1, reused)
    again = np.asarray(_affine(0.4375)(X))  # another function, the same program: no compile
    assert _counts() == (compiled + 1, reused + 1)
    assert again.tobytes() == first.tobytes()
    np.testing.assert_allclose(first, np.tanh(X.astype(np.float64) * 1.8125 + 0.4375), rtol=1e-6, atol=1e-6)
    other = np.asarray(_affine(-0.4375)(X))  # another constant: another program
    assert _counts() == (compiled + 2, reused + 1)
    np.testing.assert_allclose(other, np.tanh(X.astype(np.float64) * 1.8125 - 0.4375), rtol=1e-6, atol=1e-6)


def test_other_compile_options_compile_anew() -> None:
    lowered = _affine(0.5625).lower(X)
    compiled, reused = _counts()
    plain = lowered.compile()
    with_options = lowered.compile(compiler_options={"xla_cpu_enable_fast_min_max": True})
    assert _counts() == (compiled + 2, reused)
    assert np.asarray(with_options(X)).tobytes() == np.asarray(plain(X)).tobytes()


def test_programs_with_host_callbacks_are_never_shared() -> None:
    """Both programs below have the same text (the callback is an index into the executable's
    own list of Python functions): shared, the second would call the first's function."""

    def scaled_by(factor: float) -> Callable[[Any], Any]:
        def host(x: np.ndarray) -> np.ndarray:
            return np.asarray(x * factor, np.float32)

        return jax.jit(lambda x: jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x))

    np.testing.assert_array_equal(np.asarray(scaled_by(2.0)(X)), X * 2.0)
    np.testing.assert_array_equal(np.asarray(scaled_by(3.0)(X)), X * 3.0)


def test_clear_drops_the_kept_executables() -> None:
    _affine(0.6875)(X)
    assert jax_executables.kept() > 0
    jax_executables.clear()
    assert jax_executables.kept() == 0
    compiled, reused = _counts()
    _affine(0.6875)(X)  # the same program as above: not reused (compiled again, or loaded in an xdist run)
    assert _counts() == (compiled + 1, reused)


@pytest.fixture
def shared_through(tmp_path: Path) -> Iterator[Path]:
    """This process shares through ``tmp_path`` (another process's files: written there, then
    dropped from memory), and through its own folder again afterwards."""
    previous = jax_executables.folder()
    jax_executables.install(tmp_path)
    try:
        yield tmp_path
    finally:
        jax_executables.install(previous)


def test_a_program_another_process_compiled_is_loaded_with_the_same_bits(shared_through: Path) -> None:
    compiled, loaded = jax_executables.COUNTS["compiled"], jax_executables.COUNTS["loaded"]
    first = np.asarray(_affine(0.8125)(X))
    assert (jax_executables.COUNTS["compiled"], jax_executables.COUNTS["loaded"]) == (compiled + 1, loaded)
    assert len([p for p in shared_through.iterdir() if p.name.startswith("jit_")]) == 1
    jax_executables.clear()  # as if this process had never compiled it
    again = np.asarray(_affine(0.8125)(X))
    assert (jax_executables.COUNTS["compiled"], jax_executables.COUNTS["loaded"]) == (compiled + 1, loaded + 1)
    assert again.tobytes() == first.tobytes()


def test_an_unreadable_file_is_compiled_anew(shared_through: Path) -> None:
    first = np.asarray(_affine(0.9375)(X))
    (written,) = [p for p in shared_through.iterdir() if p.name.startswith("jit_")]
    written.write_bytes(b"\0" * 8 + b"not an executable")
    jax_executables.clear()
    compiled, loaded = jax_executables.COUNTS["compiled"], jax_executables.COUNTS["loaded"]
    again = np.asarray(_affine(0.9375)(X))
    assert (jax_executables.COUNTS["compiled"], jax_executables.COUNTS["loaded"]) == (compiled + 1, loaded)
    assert again.tobytes() == first.tobytes()
