"""FSDP2 training on CPU (gloo) with snapshots in SHARDED mode: every rank writes its shards into one snapshot.

Run it twice on the same directory: the first run stops at iteration 25 as
if the job had been preempted, the second resumes from the newest snapshot
(one manifest for all ranks) and finishes::

    torchrun --nproc_per_node=2 examples/train_sharded.py --out /tmp/sharded-run --stop-at 25
    torchrun --nproc_per_node=2 examples/train_sharded.py --out /tmp/sharded-run

(Set ``GLOO_SOCKET_IFNAME=lo`` where the host name does not resolve to a
usable interface.) With ``--device cuda`` each rank trains on its own GPU
(``LOCAL_RANK``) over NCCL, and the snapshot is staged through pinned host
memory; it restores on CPU ranks as well. The parameters are DTensors sharded over the ranks by
``fully_shard``; each rank saves only its own shards, and the snapshot can be
restored on another number of ranks. The optimizer's state goes through
``ppe_snapshot.OptimizerState`` (torch.distributed.checkpoint's state_dict API),
which gives it the parameters' sharding even before the first step, so it
restores in place too.
"""
from __future__ import annotations

import argparse
import os

import pytorch_pfn_extras as ppe
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ppe_snapshot


def main() -> None:
    parser = argparse.ArgumentParser(description="FSDP2 training with ppe_snapshot in SHARDED mode")
    parser.add_argument("--out", required=True, help="output directory shared by the ranks (a path or URL)")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--stop-at", type=int, default=None, help="stop after this many iterations")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU per rank, NCCL (default: cpu, gloo)")
    args = parser.parse_args()

    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    # The manager steps no optimizer itself; the optimizer's state is one of its state objects.
    manager = ppe.training.ExtensionsManager(
        model, {}, 1, iters_per_epoch=args.iterations, out_dir=args.out,
        stop_trigger=(args.stop_at or args.iterations, "iteration"),
        state_objects={"optimizer": ppe_snapshot.OptimizerState(model, optimizer)})
    snapshot = ppe_snapshot.snapshot(snapshot_mode=ppe_snapshot.SnapshotMode.SHARDED,
                                     writer=ppe_snapshot.writing.ThreadWriter(out_dir=args.out),
                                     n_retains=2, autoload=True)
    manager.extend(snapshot, trigger=(5, "iteration"))

    manager.start_extensions()
    if rank == 0:
        print(f"starting at iteration {manager.iteration}" +
              (f", resumed from {snapshot.resumed_from}" if snapshot.resumed_from else ""), flush=True)
    while not manager.stop_trigger:
        with manager.run_iteration():
            g = torch.Generator().manual_seed(1000 * rank + manager.iteration)  # each rank's own data
            x = torch.randn(32, 32, generator=g).to(device)
            F.cross_entropy(model(x), (x.sum(1) > 0).long() + 2 * (x[:, 0] > 0).long()).backward()
            optimizer.step()
            optimizer.zero_grad()
    checksum = sum(p.full_tensor().double().sum().item() for p in model.parameters())  # a collective
    if rank == 0:
        last = ppe_snapshot.Snapshot(f"{args.out}/snapshot_iter_{manager.iteration}")  # the stop is a multiple of 5
        ranks = sorted({int(key.split("/")[0]) for key in last.get_manifest()})
        print(f"stopped at iteration {manager.iteration}; sum of the weights {checksum:.6f}; "
              f"{last.path} holds the parts of ranks {ranks}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
