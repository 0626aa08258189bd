"""What a snapshot costs the training loop: ppe-snapshot's writers vs ppe 0.9's writers and DCP async_save.

The state is a model + Adam of about 1 GiB (the engine benchmark's case a).
For each method, per snapshot: (1) the time the loop is blocked, (2) the step
time while the write runs (a real forward/backward/Adam step of the same
model) relative to idle steps, (3) the time until the snapshot is durable,
(4) peak extra RSS. Baseline: one copy of the state into already-allocated
buffers with torch's intra-op threads (both cores), timed like a writer's
call (right after the same idle training steps). Floor: the same bytes
written by another process with O_DIRECT (no staging, no checksums), which
shows what the disk write alone costs the training steps. Then RSS over many
consecutive snapshots of a smaller state, for the async writers.

    python benchmarks/bench_writers.py [--rounds 3] [--many 100] [--scale 1.0]
"""
from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pytorch_pfn_extras import writing as ppe_writing
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, os.path.dirname(__file__))
from bench_engine import large_state, state_bytes  # noqa: E402
from common import PeakRSS, Results, emit, gib, mib, rss, secs  # noqa: E402

from ppe_snapshot import writing  # noqa: E402


FLOOR = "floor: bare O_DIRECT write of the bytes by another process"
COPY = "copy into allocated buffers (2 threads)"


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optim.zero_grad(set_to_none=False)
    model(batch).square().mean().backward()
    optim.step()


class Method:
    """Starts one snapshot; ``busy()`` tells whether its write is still running; ``close()`` at the end."""

    def start(self, path: str, state: dict) -> None: ...

    def busy(self) -> bool: ...

    def close(self) -> None: ...


class OurWriter(Method):
    def __init__(self, cls) -> None:
        self.writer = cls()
        self._done = threading.Event()

    def start(self, path, state):
        self.writer(os.path.basename(path), os.path.dirname(path), state)
        self._done.clear()
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self):
        self.writer.wait()
        self._done.set()

    def busy(self):
        return not self._done.is_set()

    def close(self):
        self.writer.finalize()


class PpeWriter(Method):
    """ppe 0.9's writers: torch.save of the state dict, in the caller / a new thread / a forked process."""

    def __init__(self, cls) -> None:
        self.cls = cls
        self.writer = None

    def start(self, path, state):
        if self.writer is None:
            self.writer = self.cls(out_dir=os.path.dirname(path))
        self.writer(os.path.basename(path), os.path.dirname(path), state)

    def busy(self):
        worker = getattr(self.writer, "_worker", None)
        return worker is not None and worker.is_alive()

    def close(self):
        if self.writer is not None:
            self.writer.finalize()


class DcpAsync(Method):
    def __init__(self, kind: AsyncCheckpointerType, stager_options: StagingOptions | None) -> None:
        self.kind = kind
        self.stager = DefaultStager(stager_options) if stager_options else None
        self.future = None

    def start(self, path, state):
        if self.future is not None:
            self.future.result()
        self.future = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=self.kind,
                                     async_stager=self.stager)

    def busy(self):
        return not self.future.done()

    def close(self):
        if self.future is not None:
            self.future.result()
        if self.stager is not None:
            self.stager.close()


def _bare_writer(conn, nbytes: int) -> None:
    """Writes ``nbytes`` from one pre-touched, page-aligned buffer with O_DIRECT + fsync per request."""
    os.nice(10)  # as the ProcessWriter's worker
    buffer = mmap.mmap(-1, nbytes)
    buffer.write(b"\1" * nbytes)
    while (path := conn.recv()) is not None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        view, done = memoryview(buffer), 0
        while done < nbytes:
            done += os.pwrite(fd, view[done:done + (64 << 20)], done)
        os.fsync(fd)
        os.close(fd)
        conn.send(path)


class BareDirectWrite(Method):
    """The floor for any writer: the state's bytes, already in a buffer, written by another process
    with O_DIRECT and fsync'd. No staging, no checksums, no manifest: the step slowdown it causes is
    what the disk write alone costs the training loop on this machine."""

    def __init__(self, nbytes: int) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_bare_writer, args=(child, -(-nbytes // 4096) * 4096), daemon=True)
        self.process.start()
        self.pending = False

    def start(self, path, state):
        self.conn.send(path)
        self.pending = True

    def busy(self):
        if self.pending and self.conn.poll():
            self.conn.recv()
            self.pending = False
        return self.pending

    def close(self):
        self.conn.send(None)
        self.process.join()


def methods(nbytes: int) -> dict[str, Method]:
    cached_shm = StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
                                use_non_blocking_copy=False)
    return {
        COPY: CopyBaseline(),
        "ppe-snapshot SimpleWriter": OurWriter(writing.SimpleWriter),
        "ppe-snapshot ThreadWriter": OurWriter(writing.ThreadWriter),
        "ppe-snapshot ProcessWriter": OurWriter(writing.ProcessWriter),
        "ppe 0.9 SimpleWriter": PpeWriter(ppe_writing.SimpleWriter),
        "ppe 0.9 ThreadWriter": PpeWriter(ppe_writing.ThreadWriter),
        "ppe 0.9 ProcessWriter": PpeWriter(ppe_writing.ProcessWriter),
        "dcp.async_save thread": DcpAsync(AsyncCheckpointerType.THREAD, None),
        "dcp.async_save process + cached shm staging": DcpAsync(AsyncCheckpointerType.PROCESS, cached_shm),
        FLOOR: BareDirectWrite(nbytes),
    }


class CopyBaseline(Method):
    """One copy of every tensor into buffers allocated (and touched) by the untimed warm-up; it goes
    through the same steps as the writers (idle training steps just before), so the two compare.

    The buffers are a shared mapping: ppe 0.9's ProcessWriter forks this process, and private pages
    would then fault on their next write (copy-on-write), which measured 0.33 s instead of 0.07 s.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] | None = None

    def start(self, path, state):
        tensors = [t for sd in state.values() for t in _tensors(sd)]
        if self.buffers is None:
            memory = torch.frombuffer(mmap.mmap(-1, sum(t.nbytes for t in tensors)), dtype=torch.uint8)
            self.buffers, offset = [], 0
            for t in tensors:
                self.buffers.append(memory[offset:offset + t.nbytes].view(t.dtype).view(t.shape))
                offset += t.nbytes
        for b, t in zip(self.buffers, tensors):
            b.copy_(t)

    def busy(self):
        return False

    def close(self):
        self.buffers = None


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def snapshot_once(method: Method, path: str, app, batch) -> dict[str, float]:
    model, optim = app
    idle = []
    for _ in range(3):
        start = time.perf_counter()
        train_step(model, optim, batch)
        idle.append(time.perf_counter() - start)
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    busy_steps = []
    with PeakRSS() as mem:
        start = time.perf_counter()
        method.start(path, state)
        blocking = time.perf_counter() - start
        while method.busy():
            t = time.perf_counter()
            train_step(model, optim, batch)
            busy_steps.append(time.perf_counter() - t)
        # ppe 0.9's writers do not fsync: their data is durable only after this. It also keeps one
        # method's page-cache writeback from taking CPU from the next method's staging copy.
        os.sync()
        durable = time.perf_counter() - start
    out = {"blocking": blocking, "durable": durable, "rss_extra": mem.extra,
           "idle_step": statistics.median(idle)}
    if busy_steps:
        out["busy_step"] = statistics.median(busy_steps)
        out["slowdown"] = out["busy_step"] / out["idle_step"] - 1
    return out


def rss_over_many(cls, root: str, count: int) -> list[int]:
    torch.manual_seed(0)
    state = {"s": {f"t{i}": torch.randn(2 << 20) for i in range(16)}}  # 128 MiB
    writer = cls(out_dir=root)
    samples = []
    try:
        for i in range(count):
            writer(f"snap{i}", root, state)
            writer.wait()
            shutil.rmtree(os.path.join(root, f"snap{i}"), ignore_errors=True)
            samples.append(rss())
    finally:
        writer.finalize()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--many", type=int, default=100, help="consecutive snapshots for the RSS check")
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    parser.add_argument("--report")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    root = os.path.join(args.dir, "bench_writers")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    model, optim = large_state(args.scale)
    app, nbytes = (model, optim), state_bytes({"model": model, "optim": optim})
    batch = torch.randn(8, 2048)
    results, case = Results(), "writers"
    table = methods(nbytes)
    try:
        for name, method in table.items():  # untimed: worker start-up and first buffer allocations
            path = os.path.join(root, f"warmup-{name.replace(' ', '_').replace('+', '')}")
            snapshot_once(method, path, app, batch)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else (
                os.path.exists(path) and os.remove(path))
        for r in range(args.rounds):
            for name, method in table.items():
                path = os.path.join(root, f"r{r}-{name.replace(' ', '_').replace('+', '')}")
                metrics = snapshot_once(method, path, app, batch)
                if name == COPY:  # nothing is written: only the time of the copy means something
                    metrics = {"blocking": metrics["blocking"]}
                results.add(case, name, metrics)
                print(f"round {r}: {name}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()), flush=True)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else (
                    os.path.exists(path) and os.remove(path))
        for method in table.values():
            method.close()
        many = {name: rss_over_many(cls, os.path.join(root, "many"), args.many)
                for name, cls in [("ThreadWriter", writing.ThreadWriter), ("ProcessWriter", writing.ProcessWriter)]}
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    copy = results.median(case, COPY, "blocking")
    sync = results.median(case, "ppe-snapshot SimpleWriter", "durable")
    lines = [f"Command: `python benchmarks/bench_writers.py --rounds {args.rounds} --scale {args.scale} --many {args.many}`  ",
             f"Machine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}; state {gib(nbytes)}; "
             f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; medians of {args.rounds} rounds "
             "after one untimed warm-up snapshot per method (worker start, first buffer allocation).", "",
             results.table(case, [("blocking", "blocked per snapshot", secs), ("durable", "until durable", secs),
                                  ("idle_step", "step idle", secs), ("busy_step", "step while writing", secs),
                                  ("slowdown", "step slowdown", lambda v: f"{v:+.0%}"),
                                  ("rss_extra", "peak extra RSS", mib)]), ""]
    for name in ("ThreadWriter", "ProcessWriter"):
        block = results.median(case, f"ppe-snapshot {name}", "blocking")
        durable = results.median(case, f"ppe-snapshot {name}", "durable")
        lines.append(f"- {name}: blocked {block / copy:.2f}x the plain copy; durable {durable / sync:.2f}x the sync take; "
                     f"RSS over {args.many} snapshots of 128 MiB: first {mib(many[name][0])}, "
                     f"last {mib(many[name][-1])}, max {mib(max(many[name]))}")
    best_dcp = min(results.median(case, m, "blocking") for m in results.methods(case) if m.startswith("dcp"))
    lines.append(f"- best dcp.async_save blocking: {best_dcp:.3f} s")
    lines.append(f"- step slowdown while the disk alone writes the bytes (the floor row): "
                 f"{results.median(case, FLOOR, 'slowdown'):+.0%}; ProcessWriter: "
                 f"{results.median(case, 'ppe-snapshot ProcessWriter', 'slowdown'):+.0%}")
    text = "\n".join(lines)
    emit(text, args.report)


if __name__ == "__main__":
    main()
