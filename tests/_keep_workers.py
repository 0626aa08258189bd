"""Functions run on every rank by dist_run for tests/test_extension_keep.py: KeepBest in DISTRIBUTED and SHARDED."""
from __future__ import annotations

import os
from typing import Any

import pytorch_pfn_extras as ppe
import torch.distributed as dist
from pytorch_pfn_extras.training import extension as ppe_extension

import ppe_snapshot
from ppe_snapshot.retention import METRICS_KEY, KeepBest

from _extension_workers import Run, make_writer, snapshot_names


def val_loss(iteration: int) -> float:
    return abs(iteration - 6) + 0.5  # best at iteration 6


class ValReporter(ppe_extension.Extension):
    """Stands for an Evaluator: reports val/loss every iteration, before the snapshot runs (higher priority)."""
    trigger = 1, "iteration"
    priority = ppe_extension.PRIORITY_WRITER

    def __call__(self, manager: Any) -> None:
        ppe.reporting.report({"val/loss": val_loss(manager.iteration)})


def dist_keep_best(out_dir: str, mode: str) -> dict[str, Any]:
    rank, sharded = dist.get_rank(), mode == "SHARDED"
    kwargs: dict[str, Any] = {"writer": make_writer("ThreadWriter", out_dir=out_dir), "n_retains": 1,
                              "keep": KeepBest("val/loss"), "snapshot_mode": getattr(ppe_snapshot.SnapshotMode, mode)}
    if mode == "DISTRIBUTED":
        kwargs["saver_rank"] = dist.get_world_size() - 1
    run = Run(os.path.join(out_dir, f"logs{rank}"), 10, kwargs, seed=rank if sharded else 0, sync=not sharded)
    run.manager.extend(ValReporter())
    run.train(rank=rank)
    run.snapshot.writer.finalize()
    dist.barrier()
    metadata = ppe_snapshot.Snapshot(os.path.join(out_dir, "snapshot_iter_6")).metadata
    return {"names": snapshot_names(out_dir), "metrics": metadata.get(METRICS_KEY)}
