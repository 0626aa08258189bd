"""A training process for the preemption tests: ``python _preempt_child.py OUT WRITER MODE RANK WORLD INIT ITERS``.

Trains with ``snapshot(save_on_signals=(SIGTERM,), autoload=True)`` (its own trigger far away, so the only
snapshot is the one a signal asks for), printing ``iter N`` after each iteration and sleeping a little so a
test can signal it mid-run. On Preempted it prints ``preempted ITERATION CODE CHILDREN`` and exits with the
exception (its status); a run to the end prints ``done ITERATION resumed NAME``. MODE: DEFAULT, DISTRIBUTED,
SHARDED (gloo, file:// rendezvous at INIT).
"""
from __future__ import annotations

import glob
import os
import signal
import sys
import time

import pytorch_pfn_extras as ppe
import torch.distributed as dist
import torch.nn.functional as F

import ppe_snapshot

from _extension_workers import Run, batch, make_writer


def children() -> list[int]:
    """This process's child processes, from every thread's ``children`` list."""
    pids: list[int] = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids += [int(p) for p in f.read().split()]
        except FileNotFoundError:  # a thread that ended since the listing (its children passed to another thread)
            pass
    return pids


def main(out: str, writer: str, mode: str, rank: int, world: int, init: str, iterations: int) -> None:
    kwargs = {"writer": make_writer(writer, out_dir=out), "autoload": True, "save_on_signals": (signal.SIGTERM,)}
    if mode != "DEFAULT":
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        kwargs["snapshot_mode"] = getattr(ppe_snapshot.SnapshotMode, mode)
        if mode == "DISTRIBUTED":
            kwargs["saver_rank"] = 0
    run = Run(os.path.join(out, f"logs{rank}"), iterations, kwargs, trigger=(10_000, "iteration"),
              seed=rank if mode == "SHARDED" else 0, sync=mode == "DISTRIBUTED")
    manager = run.manager
    manager.start_extensions()
    print(f"start {manager.iteration}", flush=True)
    try:
        while not manager.stop_trigger:
            with manager.run_iteration(step_optimizers=["main"]):
                x, y = batch(manager.iteration, rank)
                loss = F.mse_loss(run.model(x), y)
                loss.backward()
                if mode == "DISTRIBUTED":
                    for p in run.model.parameters():
                        dist.all_reduce(p.grad)
                ppe.reporting.report({"loss": loss.item()})
            print(f"iter {manager.iteration}", flush=True)
            time.sleep(0.03)
    except ppe_snapshot.Preempted as e:
        print(f"preempted {e.iteration} {e.code} {','.join(map(str, children())) or '-'} "
              f"{signal.getsignal(signal.SIGTERM) is signal.SIG_DFL}", flush=True)
        raise
    print(f"done {manager.iteration} resumed {run.snapshot.resumed_name}", flush=True)
    if mode != "DEFAULT":
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], int(sys.argv[7]))
