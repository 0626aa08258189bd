"""The same training loop with each writer: how long snapshots block the loop.

Run: ``python examples/train_writers.py`` (about 20 s on a 2-core machine).

``SimpleWriter`` saves in the training loop; ``ThreadWriter`` and
``ProcessWriter`` block it only while the state is copied to a staging
buffer, then write in the background (a thread, or one long-lived worker
process). The loop also shows ``n_retains`` (only the newest snapshots stay)
and an fsspec URL as the output directory (``memory://``; ``s3://bucket/run``
works the same with ``storage_options``).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

import pytorch_pfn_extras as ppe
import torch
import torch.nn.functional as F

import ppe_snapshot
from ppe_snapshot import writing
from ppe_snapshot.retention import list_snapshots


def train(writer: writing.SimpleWriter, log_dir: str, iterations: int = 40) -> dict[str, list[float]]:
    """Train a small MLP with a snapshot every 5 iterations; returns the reported snapshot stats."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=iterations, out_dir=log_dir)
    manager.extend(ppe_snapshot.snapshot(writer=writer, n_retains=2), trigger=(5, "iteration"))
    stats: dict[str, list[float]] = {"snapshot/blocking_s": [], "snapshot/write_s": []}
    while not manager.stop_trigger:
        with manager.run_iteration(step_optimizers=["main"]):
            x = torch.randn(64, 512)
            F.cross_entropy(model(x), torch.randint(0, 10, (64,))).backward()
        for key, values in stats.items():
            if key in manager.observation:
                values.append(manager.observation[key])
    return stats


def main(iterations: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        runs = {
            "SimpleWriter": writing.SimpleWriter(out_dir=f"{root}/simple"),
            "ThreadWriter": writing.ThreadWriter(out_dir=f"{root}/thread"),
            "ProcessWriter": writing.ProcessWriter(out_dir=f"{root}/process"),
            "ThreadWriter, memory://": writing.ThreadWriter(out_dir="memory://train-writers/run"),
        }
        print(f"{'writer':26} {'loop blocked (median)':>22} {'write (median)':>15}  snapshots kept")
        for name, writer in runs.items():
            stats = train(writer, root, iterations)
            kept = [c.name for c in list_snapshots(writer.out_dir, "snapshot_iter_{.iteration}")]
            blocked = statistics.median(stats["snapshot/blocking_s"]) * 1e3
            written = statistics.median(stats["snapshot/write_s"]) * 1e3
            print(f"{name:26} {blocked:19.1f} ms {written:12.1f} ms  {', '.join(kept)}")


if __name__ == "__main__":  # the ProcessWriter's worker imports this script: keep the guard
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40, help="per writer (default: %(default)s)")
    main(parser.parse_args().iterations)
