"""DDP training on CPU (gloo) with snapshots in DISTRIBUTED mode: one rank writes, every rank resumes.

Run it twice on the same directory: the first run fails on purpose at
iteration 25 (``snapshot_on_error`` saves a snapshot there, on the saver
rank), the second resumes from the newest snapshot and finishes::

    torchrun --nproc_per_node=2 examples/train_ddp.py --out /tmp/ddp-run --fail-at 25
    torchrun --nproc_per_node=2 examples/train_ddp.py --out /tmp/ddp-run

(On a machine whose host name does not resolve to a usable interface, set
``GLOO_SOCKET_IFNAME=lo``.) In DISTRIBUTED mode every rank computes its state
dict at each snapshot (so collective state dicts work), ``saver_rank`` alone
writes it, and at start every rank restores the same snapshot.
"""
from __future__ import annotations

import argparse

import pytorch_pfn_extras as ppe
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ppe_snapshot


def main() -> None:
    parser = argparse.ArgumentParser(description="DDP training with ppe_snapshot in DISTRIBUTED mode")
    parser.add_argument("--out", required=True, help="output directory shared by the ranks (a path or URL)")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--fail-at", type=int, default=None, help="raise an error after this many iterations")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(256, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    manager = ppe.training.ExtensionsManager(
        model, optimizer, 1, iters_per_epoch=args.iterations, out_dir=args.out,
        stop_trigger=(args.iterations, "iteration"))
    snapshot = ppe_snapshot.snapshot(
        snapshot_mode=ppe_snapshot.SnapshotMode.DISTRIBUTED, saver_rank=0,
        writer=ppe_snapshot.writing.ThreadWriter(out_dir=args.out), n_retains=2, autoload=True,
        snapshot_on_error=True)
    manager.extend(snapshot, trigger=(10, "iteration"))

    manager.start_extensions()
    if rank == 0:
        print(f"starting at iteration {manager.iteration}" +
              (f", resumed from {snapshot.resumed_from}" if snapshot.resumed_from else ""), flush=True)
    try:
        while not manager.stop_trigger:
            with manager.run_iteration(step_optimizers=["main"]):
                if manager.iteration == args.fail_at:
                    raise RuntimeError(f"a failure on purpose after {args.fail_at} iterations")
                g = torch.Generator().manual_seed(1000 * rank + manager.iteration)  # each rank's own data
                x = torch.randn(32, 32, generator=g)
                F.cross_entropy(model(x), (x.sum(1) > 0).long() + 2 * (x[:, 0] > 0).long()).backward()
    except RuntimeError as e:
        if rank == 0:
            print(f"stopped: {e}", flush=True)
    else:
        checksum = sum(p.double().sum().item() for p in model.parameters())
        if rank == 0:
            print(f"finished at iteration {manager.iteration}; sum of the weights {checksum:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
