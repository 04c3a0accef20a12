"""Worker for test_distributed_jax_multiprocess.py: one of 2 JAX processes (CPU, gloo
collectives, coordinator on 127.0.0.1). Each process owns one CPU device and its half of the
batch; the step runs under shard_map over the global 'data' axis, and process 0 writes the
loss and gradients to argv[3]. Not a test module itself."""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from parity_tests.support.jax_problem import make_loss_fn, make_problem, shard_map  # noqa: E402

from jaxloss.distributed import accumulate  # noqa: E402


def main(process_id: int, port: int, out_path: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.process_count() == 2 and len(jax.devices()) == 2
    mesh = Mesh(np.array(jax.devices()), ("data",))
    results = {}
    for kind in ("cross_entropy", "reverse_kl"):
        params, batch = make_problem(kind)
        loss_fn = make_loss_fn(kind, "valid_tokens")
        # Every process holds the whole NumPy batch here; each device gets its own rows.
        global_batch = {key: jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("data")),
                                                          lambda index, value=value: np.asarray(value)[index])
                        for key, value in batch.items()}

        def step(params, batch):
            return accumulate(loss_fn, params, batch, num_microbatches=2, data_axes="data")

        sharded = jax.jit(shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))
        loss, grads = sharded(params, global_batch)
        results[f"{kind}/loss"] = np.asarray(jax.device_get(loss.addressable_data(0)))
        for name, grad in grads.items():
            results[f"{kind}/grad/{name}"] = np.asarray(grad.addressable_data(0))
    if process_id == 0:
        np.savez(out_path, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
