"""How long a snapshot blocks the training loop, against a plain copy of the same bytes (issue 14, staging).

The state is the ~1 GiB model + Adam of ``bench_engine.large_state``. Each
round runs every method once, in a rotating order, each right after the same
``--steps`` training steps (so the state is as a loop leaves it):

* ``copy_`` of every tensor into views of one private buffer that an untimed
  warm-up faulted in, with torch's intra-op threads set to 1 and to 2;
* the call of a ThreadWriter / ProcessWriter (steady state: the first,
  untimed call allocated their staging buffers); the write runs in the
  background and is waited for, untimed, before the next method; the
  writer's ``last_stats["staging_s"]`` splits the call into planning and copy;
* ``dcp.async_save`` with its stagers (the cached ones reuse their buffers).

``Snapshot.async_take`` is a method of the rounds too (it keeps its buffer from one call to the next). It also
times the first call of each method (buffer allocation; with ``--prepare`` the writers first get
``prepare_staging``, as the extension calls it at initialize(), and ``Snapshot.prepare_staging`` is called for
``async_take``), and the writers' calls for
64 MiB in ``--many`` small tensors (the cost per tensor), and the RSS over
``--rss`` consecutive snapshots of 128 MiB per writer (reused buffers: flat).
Report: medians, and the writers' blocking time over the 2-thread copy of
the same round. With ``--device cuda`` the state (and the many tensors) live
on the GPU: the plain copy goes into a pinned buffer, as the writers' staging
does, and DCP's cached stagers pin theirs.

    python benchmarks/bench_staging.py [--rounds 5] [--scale 1.0] [--steps 1] [--many 10000 100000] [--rss 100]
                                       [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, os.path.dirname(__file__))
from bench_engine import large_state, state_bytes  # noqa: E402
from bench_writers import rss_over_many, train_step  # noqa: E402
from common import Results, emit, gib, mib, secs  # noqa: E402

import ppe_snapshot as ps  # noqa: E402
from ppe_snapshot import writing  # noqa: E402

COPY1, COPY2 = "copy_ into a faulted private buffer, 1 thread", "copy_ into a faulted private buffer, 2 threads"
THREAD, PROCESS, ASYNC_TAKE = "ThreadWriter", "ProcessWriter", "Snapshot.async_take"


def tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


class PlainCopy:
    """``copy_`` of every tensor into its place in one private buffer, faulted in once (pinned for device
    tensors, copied asynchronously and waited for)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.views: list[torch.Tensor] | None = None

    def __call__(self, path: str, state: dict) -> dict[str, float]:
        sources = tensors(state)
        if self.views is None:
            memory = torch.empty(sum(t.nbytes for t in sources), dtype=torch.uint8, pin_memory=on_cuda(sources))
            memory.fill_(0)  # fault every page in
            self.views, offset = [], 0
            for t in sources:
                self.views.append(memory[offset:offset + t.nbytes].view(t.dtype).view(t.shape))
                offset += t.nbytes
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            start = time.perf_counter()
            for view, t in zip(self.views, sources):
                view.copy_(t, non_blocking=t.is_cuda)
            if on_cuda(sources):
                torch.cuda.synchronize()
            return {"blocking": time.perf_counter() - start}
        finally:
            torch.set_num_threads(threads)

    def close(self) -> None:
        self.views = None


class Writer:
    def __init__(self, cls) -> None:
        self.writer = cls()

    def prepare(self, state: dict) -> None:
        """What the extension does at initialize() and after the first optimizer step (``--prepare``)."""
        self.writer.prepare_staging(state)

    def __call__(self, path: str, state: dict) -> dict[str, float]:
        start = time.perf_counter()
        self.writer(os.path.basename(path), os.path.dirname(path), state)
        blocking = time.perf_counter() - start
        staging = self.writer.last_stats.get("staging_s")
        self.writer.wait()
        out = {"blocking": blocking}
        if staging is not None:
            out.update(staging=staging, planning=blocking - staging)
        return out

    def close(self) -> None:
        self.writer.finalize()


class DcpAsync:
    def __init__(self, kind: AsyncCheckpointerType, options: StagingOptions | None) -> None:
        self.kind = kind
        self.stager = DefaultStager(options) if options is not None else None

    def __call__(self, path: str, state: dict) -> dict[str, float]:
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=self.kind,
                                async_stager=self.stager)
        blocking = time.perf_counter() - start
        future.result()
        return {"blocking": blocking}

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class AsyncTake:
    """``Snapshot.async_take``, whose staging buffer is kept from one call to the next."""

    def __init__(self) -> None:
        ps.Snapshot.release_staging()  # the first call allocates, as a fresh process's would

    def prepare(self, state: dict) -> None:
        """``Snapshot.prepare_staging`` (``--prepare``)."""
        ps.Snapshot.prepare_staging({"state": ps.StateDict(state)})

    def __call__(self, path: str, state: dict) -> dict[str, float]:
        start = time.perf_counter()
        pending = ps.Snapshot.async_take(path, {"state": ps.StateDict(state)})
        blocking = time.perf_counter() - start
        pending.wait()
        return {"blocking": blocking}

    def close(self) -> None:
        ps.Snapshot.release_staging()


def on_cuda(sources: list[torch.Tensor]) -> bool:
    return any(t.is_cuda for t in sources)


def methods(device: str) -> dict[str, Callable]:
    def cached(shared: bool) -> StagingOptions:
        return StagingOptions(use_pinned_memory=device == "cuda", use_shared_memory=shared, use_async_staging=False,
                              use_non_blocking_copy=False)

    return {
        COPY1: PlainCopy(1),
        COPY2: PlainCopy(2),
        THREAD: Writer(writing.ThreadWriter),
        PROCESS: Writer(writing.ProcessWriter),
        ASYNC_TAKE: AsyncTake(),
        "dcp.async_save thread, default staging": DcpAsync(AsyncCheckpointerType.THREAD, None),
        "dcp.async_save thread + cached staging": DcpAsync(AsyncCheckpointerType.THREAD, cached(False)),
        "dcp.async_save process + cached shm staging": DcpAsync(AsyncCheckpointerType.PROCESS, cached(True)),
    }


def many_tensors(counts: list[int], rounds: int, root: str, device: str) -> Results:
    """The writers' calls for 64 MiB in ``count`` float32 tensors; the first, untimed call allocates."""
    results = Results()
    for count in counts:
        torch.manual_seed(0)
        state = {f"t{i}": torch.randn(16 * 2**20 // count, device=device) for i in range(count)}
        writers = {THREAD: Writer(writing.ThreadWriter), PROCESS: Writer(writing.ProcessWriter)}
        try:
            for name, writer in writers.items():
                writer(os.path.join(root, "warmup"), state)
                remove(os.path.join(root, "warmup"))
            for r in range(rounds):
                for name, writer in writers.items():
                    metrics = writer(os.path.join(root, f"m{r}"), state)
                    remove(os.path.join(root, f"m{r}"))
                    results.add(f"{count}", name, metrics)
                    print(f"{count} tensors, round {r}: {name}: "
                          + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()), flush=True)
        finally:
            for writer in writers.values():
                writer.close()
    return results


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=1, help="training steps before each method's snapshot")
    parser.add_argument("--many", type=int, nargs="*", default=[10_000, 100_000],
                        help="tensor counts of the 64 MiB many-tensor case")
    parser.add_argument("--rss", type=int, default=100, help="consecutive snapshots for the RSS check (0: none)")
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives")
    parser.add_argument("--prepare", action="store_true",
                        help="have the writers prepare their staging before the first call, as the extension does")
    parser.add_argument("--report")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    root = os.path.join(args.dir, "bench_staging")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    model, optim = large_state(args.scale, args.device)
    nbytes = state_bytes({"model": model, "optim": optim})
    batch = torch.randn(8, 2048, device=args.device)
    results, case, first = Results(), "staging", Results()
    table = methods(args.device)

    def snapshot(name: str, method: Callable, path: str) -> dict[str, float]:
        for _ in range(args.steps):
            train_step(model, optim, batch)
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        metrics = method(path, state)
        remove(path)
        os.sync()  # the write's page-cache writeback does not run into the next method
        return metrics

    failed: dict[str, str] = {}  # a method that raised, and why: left out of the rounds that follow

    def attempt(name: str, path: str) -> dict[str, float] | None:
        if name in failed:
            return None
        try:
            return snapshot(name, table[name], path)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"{name} failed: {failed[name]}", flush=True)
            remove(path)
            return None

    if args.prepare:
        for method in table.values():
            if hasattr(method, "prepare"):
                method.prepare({"model": model.state_dict(), "optim": optim.state_dict()})
    try:
        for name in table:  # untimed for the medians: first buffer allocations, worker start
            metrics = attempt(name, os.path.join(root, "warmup"))
            if metrics is not None:
                first.add(case, name, metrics)
                print(f"first call: {name}: {metrics['blocking']:.3f} s", flush=True)
        names = list(table)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                metrics = attempt(name, os.path.join(root, f"r{r}"))
                if metrics is None:
                    continue
                results.add(case, name, metrics)
                print(f"round {r}: {name}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()), flush=True)
        many = many_tensors(args.many, args.rounds, root, args.device)
        rss = {name: rss_over_many(cls, os.path.join(root, "rss"), args.rss) for name, cls in
               [(THREAD, writing.ThreadWriter), (PROCESS, writing.ProcessWriter)]} if args.rss else {}
    finally:
        for method in table.values():
            method.close()
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    copy2 = results.samples[(case, COPY2, "blocking")]
    lines = [f"Command: `python benchmarks/bench_staging.py --rounds {args.rounds} --scale {args.scale} "
             f"--steps {args.steps} --many {' '.join(map(str, args.many))} --rss {args.rss} "
             f"--device {args.device}{' --prepare' if args.prepare else ''}`  ",
             f"Machine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}"
             f"{f', {torch.cuda.get_device_name()}' if args.device == 'cuda' else ''}; state {gib(nbytes)} "
             f"in {len(tensors({'m': model.state_dict(), 'o': optim.state_dict()}))} tensors; "
             f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; medians of {args.rounds} rounds, "
             f"methods interleaved, {args.steps} training step(s) before each.", "",
             results.table(case, [("blocking", "blocked per snapshot", secs), ("planning", "of which planning", secs),
                                  ("staging", "of which staging copy", secs)]), "",
             "| first call (allocates its buffers; the ProcessWriter's also waits for its worker to start) | blocked |",
             "|---|---|"]
    lines += [f"| {name} | {secs(first.median(case, name, 'blocking'))} |" for name in first.methods(case)]
    lines.append("")
    steady = {name: results.median(case, name, "blocking") for name in results.methods(case)}
    for name in (THREAD, PROCESS, ASYNC_TAKE):
        if name in first.methods(case) and name in steady:
            lines.append(f"- {name}: first call {first.median(case, name, 'blocking') / steady[name]:.2f}x its "
                         "steady blocking")
    if ASYNC_TAKE in steady and THREAD in steady:
        lines.append(f"- {ASYNC_TAKE}: steady blocking {steady[ASYNC_TAKE] / steady[THREAD]:.2f}x the ThreadWriter's")
    for name in (THREAD, PROCESS):
        per_round = [b / c for b, c in zip(results.samples[(case, name, "blocking")], copy2)]
        lines.append(f"- {name}: blocked {statistics.median(per_round):.2f}x the 2-thread copy of the same round "
                     f"(median of the per-round ratios; rounds {min(per_round):.2f}-{max(per_round):.2f}x), "
                     f"{results.median(case, name, 'blocking') / results.median(case, COPY1, 'blocking'):.2f}x "
                     "the 1-thread copy")
    dcp_names = [m for m in results.methods(case) if m.startswith("dcp")]
    if dcp_names:
        best = min(dcp_names, key=lambda m: results.median(case, m, "blocking"))
        lines.append(f"- best dcp.async_save staging: {results.median(case, best, 'blocking'):.3f} s ({best})")
    lines += [f"- {name}: failed, left out: {why}" for name, why in failed.items()]
    if args.many:
        lines += ["", "64 MiB in many float32 tensors (steady state; planning includes the hand-off, which for the "
                  "ProcessWriter pickles the job):", "",
                  "| tensors | writer | blocked per snapshot | of which planning | of which staging copy |",
                  "|---|---|---|---|---|"]
        for count in args.many:
            for name in many.methods(f"{count}"):
                cells = [many.median(f"{count}", name, m) for m in ("blocking", "planning", "staging")]
                cells = " | ".join("-" if c is None else secs(c) for c in cells)
                lines.append(f"| {count:,} | {name} | {cells} |")
    for name, samples in rss.items():
        lines.append(f"- {name}: RSS over {args.rss} snapshots of 128 MiB: first {mib(samples[0])}, "
                     f"last {mib(samples[-1])}, max {mib(max(samples))}")
    emit("\n".join(lines), args.report)


if __name__ == "__main__":
    main()
