"""JAX multi-process: 2 processes (jax.distributed.initialize, coordinator on 127.0.0.1, gloo CPU
collectives) run the data-parallel step and match the single-process full batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

import lossspec
from parity_tests.support.jax_problem import make_loss_fn, make_problem

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_jax_processes_match_one(tmp_path: Path) -> None:
    out = tmp_path / "results.npz"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "support" / "jax_multiprocess_worker.py"), str(i), str(port), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    with np.load(out) as data:
        results = {key: data[key] for key in data.files}
    for kind in ("cross_entropy", "reverse_kl"):
        params, batch = make_problem(kind)
        loss_fn = make_loss_fn(kind, "valid_tokens")
        ref_loss, ref_grads = jax.value_and_grad(lambda p: loss_fn(p, batch, None))(params)
        lossspec.compare_loss(results[f"{kind}/loss"], np.asarray(ref_loss), f"{kind} loss").check()
        for name, ref in ref_grads.items():
            lossspec.compare_grad(results[f"{kind}/grad/{name}"], np.asarray(ref), "float32", 0.0, f"{kind} {name}").check()
