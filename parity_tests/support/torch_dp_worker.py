"""Worker launched as ranks (gloo on the loopback interface, see ranks.py) by test_distributed_torch.py,
both by the tests' own launcher (4 ranks) and by ``torchrun`` as a user would (2 ranks).

For each data-parallel world size D in WORLDS that fits (D = 2 runs on the process group of ranks
0 and 1, D = 4 on all four), each rank holds its 8 / D rows of the batch and runs every split of
SCENARIOS[D] (DDP with K micro-batches, a plain module with an explicit group, uneven
micro-batches with an empty one) for every kind and normalisation. The batch's valid tokens
(tiny_lm_oracle.VALID_PER_ROW) are spread unevenly over the replicas: 12 / 4 for D = 2,
5 / 7 / 0 / 4 for D = 4 (replica 2 all masked). Rank 0 writes the losses and parameter gradients
to the .npz named in argv[1]. Not a test module itself (no test_ prefix)."""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist


from parity_tests.support.ranks import finish, init_gloo
from parity_tests.support.torch_problem import KINDS, NORMALIZATIONS, loss_fn_for, make_model, make_problem

from torchloss.distributed import accumulate

WORLDS = (2, 4)
# name: (wrapper, number of micro-batches)
SCENARIOS = {
    2: {
        "ddp_k1": ("ddp", 1),
        "ddp_k2": ("ddp", 2),  # replica 1's first micro-batch is all masked
        "plain_k2": ("plain", 2),
        "ddp_k5_empty": ("ddp", 5),  # 4 local rows in 5 micro-batches: one is empty
    },
    4: {
        "ddp_k1": ("ddp", 1),  # replica 2 all masked
        "plain_k1": ("plain", 1),
        "ddp_k3_empty": ("ddp", 3),  # 2 local rows in 3 micro-batches: one is empty
    },
}


def main(out_path: str, kinds: tuple[str, ...] = KINDS, normalizations: tuple[str, ...] = NORMALIZATIONS) -> None:
    rank, world_size = init_gloo()
    results: dict[str, np.ndarray] = {}
    groups = {}
    for world in WORLDS:
        if world <= world_size:  # every rank creates every group, in the same order
            groups[world] = dist.group.WORLD if world == world_size else dist.new_group(list(range(world)))
    for world, group in groups.items():
        if rank >= world:
            continue
        for kind in kinds:
            for normalization in normalizations:
                batch = make_problem(kind, float_weights=(normalization == "sum"))
                rows = batch["tokens"].shape[0] // world
                local = {key: value[rank * rows : (rank + 1) * rows] for key, value in batch.items()}
                loss_fn = loss_fn_for(kind, normalization)
                for name, (wrapper, k) in SCENARIOS[world].items():
                    model = make_model()
                    wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group) if wrapper == "ddp" else model
                    loss = accumulate(loss_fn, wrapped, local, num_microbatches=k, normalization=normalization,
                                      group=None if wrapper == "ddp" else group)
                    key = f"D{world}/{kind}/{normalization}/{name}"
                    results[key + "/loss"] = loss.numpy()
                    for pname, param in model.named_parameters():
                        results[f"{key}/grad/{pname}"] = param.grad.numpy().copy()
        # Every rank of the group must hold the same loss and gradients.
        for key in sorted(k for k in results if k.startswith(f"D{world}/")):
            gathered = [torch.zeros_like(torch.from_numpy(results[key])) for _ in range(world)]
            dist.all_gather(gathered, torch.from_numpy(results[key]), group=group)
            assert all(torch.equal(gathered[0], g) for g in gathered), f"replicas differ on {key}"
    if rank == 0:
        np.savez(out_path, **results)
    print(f"[rank {rank}] {len(results)} results checked across replicas", flush=True)
    finish(rank)


if __name__ == "__main__":
    # argv: OUT.npz [KIND,... [NORMALIZATION,...]] (default: all of them)
    chosen = [tuple(arg.split(",")) for arg in sys.argv[2:4]]
    main(sys.argv[1], *chosen)
