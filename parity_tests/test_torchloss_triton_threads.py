"""Concurrent ``impl="triton"`` calls from several threads (Triton interpreter).

The interpreter patches ``triton.language`` for the duration of a launch, so two interpreted
launches at once used to fail (about 8 of 40 calls, with InterpreterError). ``torchloss.backends.triton``
serialises interpreted launches with a module-level lock; without it this test fails.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

import lossspec
import torchloss
from torchloss.backends import triton as _triton

THREADS = 4
CALLS = 10


@pytest.mark.skipif(not _triton.INTERPRETED, reason="the lock guards interpreted launches only")
def test_concurrent_calls_match_the_oracle() -> None:
    # Small calls, checked after the threads finish: the threads spend their time launching
    # (the interpreter patches and restores triton.language at each launch's start and end).
    cases = [lossspec.make_case("cross_entropy", "random", lead_shape=(4,), vocab=40, seed=s) for s in range(THREADS)]
    refs = [case.reference() for case in cases]
    results: list[list] = [[] for _ in range(THREADS)]
    start = threading.Barrier(THREADS)

    def work(i: int) -> None:
        case = cases[i]
        x = torch.tensor(case.logits, requires_grad=True)
        labels, mask = torch.tensor(case.target), torch.tensor(case.loss_mask)
        start.wait()
        for _ in range(CALLS):
            try:
                loss = torchloss.cross_entropy(x, labels, mask, impl="triton")
                (grad,) = torch.autograd.grad(loss, x)
                results[i].append((loss.detach().numpy(), grad.numpy()))
            except Exception as err:  # noqa: BLE001 - every failure is collected and reported
                results[i].append(f"{type(err).__name__}: {str(err)[:200]}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    # Switch threads often (the default is every 5 ms): launches interleave in every call.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    errors = [f"thread {i} call {k}: {r}" for i in range(THREADS) for k, r in enumerate(results[i]) if isinstance(r, str)]
    assert not errors, f"{len(errors)} of {THREADS * CALLS} calls failed:\n" + "\n".join(errors[:5])
    for i in range(THREADS):
        assert len(results[i]) == CALLS
        for loss, grad in results[i]:
            lossspec.assert_close_to_oracle(loss, grad, refs[i].loss, refs[i].grad, dtype="float32", g0=refs[i].g0)
    assert np.isfinite([r.loss for r in refs]).all()
