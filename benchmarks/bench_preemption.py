"""The cost of save_on_signals when no signal arrives (issue 13): target <= 1 % of a 50 ms training step.

One process: a ppe ExtensionsManager running empty iterations, with a snapshot extension (trigger far away)
with and without ``save_on_signals``; the difference per iteration is the check (a wrapped trigger reading a
flag). Several ranks: the agreement (an exchange of the signal number through rank 0, point to point on a gloo
group of its own, so that a rank that died is named), timed per call on ``--ranks`` ranks of this machine. Methods interleaved round by round; medians.

    python benchmarks/bench_preemption.py --rounds 5 --iterations 20000 --ranks 2
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

import pytorch_pfn_extras as ppe
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppe_snapshot  # noqa: E402
from ppe_snapshot import writing  # noqa: E402
from ppe_snapshot.extension.preemption import CHECK_EVERY, Preemption  # noqa: E402

STEP_S = 0.050


def _loop_s(out: str, iterations: int, signals: tuple) -> float:
    model = torch.nn.Linear(2, 2)
    manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 10**9,
                                             iters_per_epoch=10**6, out_dir=out)
    ext = ppe_snapshot.snapshot(writer=writing.SimpleWriter(out_dir=out), save_on_signals=signals)
    manager.extend(ext, trigger=(10**8, "iteration"))
    manager.start_extensions()
    start = time.perf_counter()
    for _ in range(iterations):
        with manager.run_iteration():
            pass
    elapsed = time.perf_counter() - start
    ext.finalize(manager)
    return elapsed / iterations


def _ranks(rank: int, world: int, init: str, calls: int, rounds: int, results) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    preemption = Preemption.for_ranks((signal.SIGTERM,), None)

    class _Manager:
        iteration = 0
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            preemption.decided = None
            preemption.due(_Manager)
        times.append((time.perf_counter() - start) / calls)
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    base, watched = [], []
    with tempfile.TemporaryDirectory() as out:
        _loop_s(out, 1000, ())  # warm-up
        for _ in range(args.rounds):
            base.append(_loop_s(out, args.iterations, ()))
            watched.append(_loop_s(out, args.iterations, (signal.SIGTERM,)))
    b, w = statistics.median(base), statistics.median(watched)
    print(f"one process: iteration without save_on_signals {b * 1e6:.1f} us, with {w * 1e6:.1f} us, "
          f"cost {(w - b) * 1e6:.2f} us = {(w - b) / STEP_S * 100:.4f} % of a 50 ms step")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_ranks, args=(r, args.ranks, init, 2000, args.rounds, results))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        times = results.get(timeout=600)
        for p in procs:
            p.join()
    m = statistics.median(times)
    print(f"{args.ranks} ranks: agreement (an exchange through rank 0 on a gloo side group) {m * 1e6:.1f} us per "
          f"check = {m / STEP_S * 100:.3f} % of a 50 ms step if checked every iteration, "
          f"{m / CHECK_EVERY / STEP_S * 100:.3f} % checked every {CHECK_EVERY} (the default); rounds "
          f"{', '.join(f'{t * 1e6:.0f}' for t in times)} us")


if __name__ == "__main__":
    main()
