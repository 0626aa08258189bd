"""Sharded FSDP2 state: a 4-rank take and a 4 -> 2 reshard restore, ppe-snapshot vs DCP.

The model (21 Linear(2048, 2048) layers, each `fully_shard`-ed) and its Adam
state, after one step, total about 1 GiB over the ranks. Phase 1 runs 4 ranks
(gloo, CPU) and saves with both methods, interleaved, ``--rounds`` times;
phase 2 runs 2 ranks and restores each saved snapshot into a fresh FSDP2
model + Adam. A time is the slowest rank's, between barriers.

    python benchmarks/bench_sharded.py [--rounds 3] [--scale 1.0]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from common import drop_cache, emit, free_port, fsync_path, gib, secs, warm_cache  # noqa: E402

import ppe_snapshot as ps  # noqa: E402


def build(scale: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(max(1, round(21 * scale)))])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 2048)).sum().backward()
    optim.step()
    return model, optim


def local_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    tensors = [p.to_local() for p in model.parameters()]
    tensors += [v.to_local() if hasattr(v, "to_local") else v
                for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def save_phase(rank: int, world: int, port: int, root: str, rounds: int, scale: float, out) -> None:
    _init(rank, world, port)
    model, optim = build(scale)
    total = torch.tensor([local_bytes(model, optim)])
    dist.all_reduce(total)
    times: dict[str, list[float]] = {"ppe-snapshot": [], "dcp": []}
    for r in range(rounds):
        times["ppe-snapshot"].append(timed(lambda: ps.Snapshot.take(f"{root}/ppe{r}", {"model": model, "optim": optim})))
        times["dcp"].append(timed(lambda: dcp.save({"model": model.state_dict(), "optim": optim.state_dict()},
                                                   checkpoint_id=f"{root}/dcp{r}")))
    if rank == 0:
        out.put(("save", times, total.item()))
    dist.destroy_process_group()


def restore_phase(rank: int, world: int, port: int, root: str, rounds: int, scale: float, out) -> None:
    _init(rank, world, port)
    model, optim = build(scale)

    def dcp_load(r: int) -> None:
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        dcp.load(state, checkpoint_id=f"{root}/dcp{r}")
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])

    def prepare_cache(path: str, cold: bool) -> None:
        if rank == 0:  # same page-cache state for both methods
            fsync_path(path)
            drop_cache(path) if cold else warm_cache(path)

    times: dict[str, list[float]] = {f"{m} {c}": [] for c in ("cold", "warm") for m in ("ppe-snapshot", "dcp")}
    for r in range(rounds):
        for cache in ("cold", "warm"):
            prepare_cache(f"{root}/ppe{r}", cache == "cold")
            times[f"ppe-snapshot {cache}"].append(
                timed(lambda: ps.Snapshot(f"{root}/ppe{r}").restore({"model": model, "optim": optim})))
            prepare_cache(f"{root}/dcp{r}", cache == "cold")
            times[f"dcp {cache}"].append(timed(lambda: dcp_load(r)))
    if rank == 0:
        out.put(("restore", times, None))
    dist.destroy_process_group()


def _init(rank: int, world: int, port: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def run(phase, world: int, args, root: str) -> tuple:
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=phase, args=(r, world, port, root, args.rounds, args.scale, out))
             for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank of {phase.__name__} exited with {p.exitcode}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    parser.add_argument("--report")
    args = parser.parse_args()
    root = os.path.join(args.dir, "bench_sharded")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    try:
        _, saves, nbytes = run(save_phase, 4, args, root)
        _, restores, _ = run(restore_phase, 2, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    take = {k: statistics.median(v) for k, v in saves.items()}
    restore = {k: statistics.median(v) for k, v in restores.items()}
    lines = [f"Command: `python benchmarks/bench_sharded.py --rounds {args.rounds} --scale {args.scale}`  ",
             f"Machine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo on CPU; "
             f"FSDP2 model + Adam, {gib(nbytes)} over 4 ranks; date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"medians of {args.rounds} interleaved rounds (slowest rank).", "",
             "| method | 4-rank take | 4 -> 2 restore, files not cached | 4 -> 2 restore, files in page cache |",
             "|---|---|---|---|"]
    lines += [f"| {k} | {secs(take[k])} | {secs(restore[k + ' cold'])} | {secs(restore[k + ' warm'])} |" for k in take]
    lines += ["", f"- take: {take['dcp'] / take['ppe-snapshot']:.2f}x DCP; reshard restore: "
                  f"{restore['dcp cold'] / restore['ppe-snapshot cold']:.2f}x DCP (not cached), "
                  f"{restore['dcp warm'] / restore['ppe-snapshot warm']:.2f}x DCP (cached)"]
    text = "\n".join(lines)
    emit(text, args.report)


if __name__ == "__main__":
    main()
