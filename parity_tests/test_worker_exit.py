"""The end of an xdist worker's session (``conftest.pytest_sessionfinish``): the garbage is
collected before the worker reports that it has finished, and what survives is frozen, so that
pytest's last collection does not outlast execnet's 5 s exit allowance (a SIGINT printed as a
``KeyboardInterrupt`` in JAX's ``_xla_gc_callback`` at the end of a passing run)."""

from __future__ import annotations

import gc
import weakref

import conftest
import pytest


class _Node:
    """A reference cycle: freed only by the cyclic garbage collector."""

    def __init__(self) -> None:
        self.me = self


def test_a_worker_collects_then_freezes_at_session_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    frozen_before = gc.get_freeze_count()
    gc.disable()  # no automatic collection between building the cycle and the hook
    try:
        garbage = _Node()
        collected = weakref.ref(garbage)
        del garbage
        assert collected() is not None
        conftest.pytest_sessionfinish(session=None)
        assert collected() is None  # collected first: the cycle is not among the frozen objects
        assert gc.get_freeze_count() > frozen_before
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_run_without_workers_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    gc.disable()
    try:
        garbage = _Node()
        collected = weakref.ref(garbage)
        del garbage
        conftest.pytest_sessionfinish(session=None)
        assert collected() is not None and gc.get_freeze_count() == 0
    finally:
        gc.collect()
        gc.enable()
