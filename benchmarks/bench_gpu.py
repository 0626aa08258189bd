"""GPU state at the hardware's limits (issue 35): saves, async saves, first calls and restores of a CUDA state,
beside torch.save / torch.load / dcp.save / dcp.async_save / dcp.load and the floors measured in the same run.

    python benchmarks/bench_gpu.py [--gib 4] [--rounds 3] [--many 10000] [--no-peers] [--device cuda|cpu]
                                   [--dir DIR] [--read-workers 2,4] [--sweep]

The state: ``15 * gib`` fp32 matrices of 64 MiB, ``250 * gib`` tensors of 256 KiB and one scalar (4 GiB for
``--gib 4``); ``--many`` tensors of 64 MiB in all (their own case). Each round runs every method once, in a
rotating order, and the floors:

- **D2H / H2D**: the state's bytes copied into / out of one page-locked buffer (faulted in before), synchronized;
- **dd write / dd read**: the state's size written with O_DIRECT (``dd oflag=direct conv=fsync``), read back with
  O_DIRECT (the disk);
- **page-cache read**: the snapshot's data files read into a host buffer, cached (the page cache);
- **the bare restore** of the ``--many`` tensors: the least work any restore of them from this format does
  (``probe_many_restore.bare_restore``).

Methods: ``Snapshot.take`` (durable), ``Snapshot.async_take`` and a ThreadWriter (blocking; their first call is
reported on its own: made in a fresh process before the rounds, after ``Snapshot.prepare_staging`` and the
writer's ``prepare_staging``, as the extension calls it), ``Snapshot.restore`` in place with a warm page cache
and a cold one (the cold one only where ``/proc/sys/vm/drop_caches`` is writable); the peers the same way.
``--read-workers 2,4``: the warm and cold restores once with each count of reads in flight into the GPU
(``DEVICE_READ_WORKERS``) in every round, the counts alternated. ``--sweep``: before the rounds, the gather's
threshold (``SMALL_DEVICE_BYTES``) against tensors of 64 KiB to 8 MiB, 256 MiB of each size, saved by the
ThreadWriter with the tensors gathered and copied one by one (blocking, median of 3).
Report: medians, and each figure over its floor.
On a machine without a GPU, ``--device cpu`` runs the same methods on a CPU state (a check of the script).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from common import fsync_path, warm_cache  # noqa: E402
from probe_many_restore import bare_restore  # noqa: E402

import ppe_snapshot as ps  # noqa: E402
from ppe_snapshot import writing  # noqa: E402
from ppe_snapshot.engine._files import device_reads  # noqa: E402
from ppe_snapshot.engine._take import device_gather  # noqa: E402

MiB = 1 << 20


def make_state(gib: float, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    state = {f"w{i}": torch.randn(16 * MiB, device=device, generator=g) for i in range(max(1, round(15 * gib)))}
    state.update({f"n{i}": torch.randn(64 * 1024, device=device, generator=g) for i in range(round(250 * gib))})
    state["step"] = torch.tensor(7.0, device=device)
    return state


def many_state(count: int, device: str) -> dict[str, torch.Tensor]:
    each = max(1, (64 * MiB // 4) // count)
    return {f"t{i}": torch.full((each,), float(i), device=device) for i in range(count)}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in state.values())


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.device = args, args.device
        self.dir = tempfile.mkdtemp(prefix="bench-gpu-", dir=args.dir)
        self.state = make_state(args.gib, self.device)
        self.size = nbytes(self.state)
        self.pinned = torch.empty(self.size, dtype=torch.uint8, pin_memory=self.device == "cuda")
        self.pinned.fill_(0)
        self.writer = writing.ThreadWriter()
        self.times: dict[str, list[float]] = {}
        self.rounds_done = 0
        self.read_workers, self.small_device_bytes = device_reads.DEVICE_READ_WORKERS, device_gather.SMALL_DEVICE_BYTES

    def path(self, name: str) -> str:
        path = os.path.join(self.dir, name)
        shutil.rmtree(path, ignore_errors=True)
        if os.path.isfile(path):
            os.remove(path)
        return path

    def record(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)
        print(f"{name}: {seconds:.3f} s", flush=True)  # (a run cut short by a time limit still says this much)

    def timed(self, name: str, fn: Callable[[], object]) -> float:
        sync(self.device)
        start = time.perf_counter()
        fn()
        sync(self.device)
        seconds = time.perf_counter() - start
        self.record(name, seconds)
        return seconds

    # -- floors -------------------------------------------------------------------------------------------------
    def d2h(self) -> None:
        def copy() -> None:
            at = 0
            for t in self.state.values():
                self.pinned[at:at + t.nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                at += t.nbytes
        self.timed("floor: D2H into page-locked memory", copy)

    def h2d(self) -> None:
        def copy() -> None:
            at = 0
            for t in self.state.values():
                t.copy_(self.pinned[at:at + t.nbytes].view(t.dtype).view(t.shape), non_blocking=True)
                at += t.nbytes
        self.timed("floor: H2D from page-locked memory", copy)

    def dd(self) -> None:
        path, count = self.path("dd.bin"), max(1, self.size // (64 * MiB))
        write = ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync"]
        if subprocess.run(write, capture_output=True).returncode == 0:
            self.timed("floor: dd write, O_DIRECT", lambda: subprocess.run(write, check=True, capture_output=True))
            read = ["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"]
            self.timed("floor: dd read, O_DIRECT", lambda: subprocess.run(read, check=True, capture_output=True))
        os.remove(path)

    def page_cache_read(self, snapshot: str) -> None:
        files = [os.path.join(d, f) for d, _, fs in os.walk(snapshot) for f in fs if f.endswith(".bin")]
        warm_cache(snapshot)

        def read() -> None:
            at, view = 0, memoryview(self.pinned.numpy())
            for name in files:
                with open(name, "rb", buffering=0) as f:
                    at += f.readinto(view[at:])
        self.timed("floor: page-cache read into host memory", read)

    # -- ppe-snapshot -------------------------------------------------------------------------------------------
    def take(self) -> None:
        path = self.path("take")
        self.timed("Snapshot.take (durable)", lambda: ps.Snapshot.take(path, {"m": ps.StateDict(self.state)}))
        self.restores(path)

    def restores(self, path: str) -> None:
        target = {"m": ps.StateDict(self.state)}
        warm_cache(path)
        self.timed("Snapshot.restore, warm", lambda: ps.Snapshot(path).restore(target))
        self.page_cache_read(path)
        if can_drop_caches():
            drop_caches()
            self.timed("Snapshot.restore, cold", lambda: ps.Snapshot(path).restore(target))
        self.rounds_done += 1
        counts = self.args.read_workers[self.rounds_done % 2:] + self.args.read_workers[:self.rounds_done % 2]
        for count in counts:  # (alternated from round to round)
            device_reads.DEVICE_READ_WORKERS = count
            warm_cache(path)
            self.timed(f"Snapshot.restore, warm, {count} read threads", lambda: ps.Snapshot(path).restore(target))
            if can_drop_caches():
                drop_caches()
                self.timed(f"Snapshot.restore, cold, {count} read threads",
                           lambda: ps.Snapshot(path).restore(target))
        device_reads.DEVICE_READ_WORKERS = self.read_workers

    def sweep(self) -> None:
        """The gather's threshold: 256 MiB of tensors of one size saved with them gathered, then copied one by
        one (``SMALL_DEVICE_BYTES`` just above, then at, their size)."""
        for size in (64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20):
            state = {f"t{i}": torch.ones(size // 4, device=self.device) for i in range((256 << 20) // size)}
            for gathered in (True, False):
                device_gather.SMALL_DEVICE_BYTES = size + 1 if gathered else size
                times = []
                for _ in range(4):  # (the first call sizes the buffer)
                    self.path("sweep")
                    start = time.perf_counter()
                    self.writer("sweep", self.dir, state)
                    times.append(time.perf_counter() - start)
                    self.writer.wait()
                print(f"sweep: {len(state)} tensors of {size >> 10} KiB, "
                      f"{'gathered' if gathered else 'one by one'}: {statistics.median(times[1:]):.4f} s", flush=True)
            del state
        device_gather.SMALL_DEVICE_BYTES = self.small_device_bytes
        self.path("sweep")

    def async_take(self) -> None:
        path = self.path("async")
        pending = []
        self.timed("Snapshot.async_take blocking, steady",
                   lambda: pending.append(ps.Snapshot.async_take(path, {"m": ps.StateDict(self.state)})))
        pending[0].wait()

    def thread_writer(self) -> None:
        self.path("writer")
        self.timed("ThreadWriter blocking, steady", lambda: self.writer("writer", self.dir, self.state))
        self.writer.wait()

    def many(self) -> None:
        state, path = many_state(self.args.many, self.device), self.path("many")
        self.path("many_w")
        self.writer("many_w", self.dir, state)  # (the buffer of this size)
        self.writer.wait()
        self.path("many_w")
        self.timed(f"{len(state)} tensors: ThreadWriter blocking", lambda: self.writer("many_w", self.dir, state))
        self.writer.wait()
        ps.Snapshot.take(path, {"m": ps.StateDict(state)})
        warm_cache(path)
        self.timed(f"{len(state)} tensors: Snapshot.restore, warm",
                   lambda: ps.Snapshot(path).restore({"m": ps.StateDict(state)}))
        self.timed(f"{len(state)} tensors: floor, the bare restore", bare_restore(path, state, self.pinned))

    # -- peers ----------------------------------------------------------------------------------------------------
    def torch_save(self) -> None:
        path = self.path("torch.pt")

        def save() -> None:
            torch.save(self.state, path)
            fsync_path(path)
        self.timed("torch.save + fsync", save)
        warm_cache(path)
        self.timed("torch.load, warm", lambda: torch.load(path, map_location=self.device, weights_only=True))
        os.remove(path)

    def dcp_save(self) -> None:
        path = self.path("dcp")

        def save() -> None:
            dcp.save(self.state, checkpoint_id=path, no_dist=True)
            fsync_path(path)
        self.timed("dcp.save + fsync", save)
        warm_cache(path)
        self.timed("dcp.load in place, warm", lambda: dcp.load(self.state, checkpoint_id=path, no_dist=True))

    def dcp_async(self) -> None:
        path = self.path("dcp_async")
        future = []
        self.timed("dcp.async_save blocking", lambda: future.append(dcp.async_save(self.state, checkpoint_id=path,
                                                                                   no_dist=True)))
        future[0].result()

    def methods(self) -> list[Callable[[], None]]:
        ours = [self.take, self.async_take, self.thread_writer, self.many]
        peers = [] if self.args.no_peers else [self.torch_save, self.dcp_save, self.dcp_async]
        return [self.d2h, self.h2d, self.dd, *ours, *peers]

    def first_calls(self) -> None:
        """The first call of async_take and of a writer in this process (the writer prepared as the extension
        does), before any round."""
        self.writer.prepare_staging(self.state)
        ps.Snapshot.prepare_staging({"m": ps.StateDict(self.state)})
        time.sleep(self.size / (1 << 30) + 0.5)  # the background preparations' time (a training step or so)
        self.path("writer")
        self.timed("ThreadWriter blocking, first call (prepared)", lambda: self.writer("writer", self.dir, self.state))
        self.writer.wait()
        path, pending = self.path("async"), []
        self.timed("Snapshot.async_take blocking, first call (prepared)",
                   lambda: pending.append(ps.Snapshot.async_take(path, {"m": ps.StateDict(self.state)})))
        pending[0].wait()

    def run(self) -> None:
        try:
            self.first_calls()
            if self.args.sweep:
                self.sweep()
            methods = self.methods()
            for r in range(self.args.rounds):
                for method in methods[r % len(methods):] + methods[:r % len(methods)]:
                    method()
        finally:
            self.writer.finalize()
            shutil.rmtree(self.dir, ignore_errors=True)

    def report(self) -> None:
        med = {name: statistics.median(v) for name, v in self.times.items()}
        device = torch.cuda.get_device_name() if self.device == "cuda" else "cpu"
        print(f"\nbench_gpu: {self.size / (1 << 30):.2f} GiB on {device}, {self.args.rounds} rounds, torch "
              f"{torch.__version__}; seconds, median (min-max)")
        for name, values in self.times.items():
            print(f"  {name:<58} {med[name]:8.3f}  ({min(values):.3f}-{max(values):.3f})")
        ratios = [
            ("durable save / dd write", "Snapshot.take (durable)", "floor: dd write, O_DIRECT"),
            ("async_take steady / D2H", "Snapshot.async_take blocking, steady", "floor: D2H into page-locked memory"),
            ("ThreadWriter steady / D2H", "ThreadWriter blocking, steady", "floor: D2H into page-locked memory"),
            ("async_take first (prepared) / steady", "Snapshot.async_take blocking, first call (prepared)",
             "Snapshot.async_take blocking, steady"),
            ("ThreadWriter first / steady", "ThreadWriter blocking, first call (prepared)",
             "ThreadWriter blocking, steady"),
            ("restore warm / page-cache read", "Snapshot.restore, warm", "floor: page-cache read into host memory"),
            ("restore cold / dd read", "Snapshot.restore, cold", "floor: dd read, O_DIRECT"),
        ]
        print("  ratios:")
        for label, a, b in ratios:
            if a in med and b in med:
                print(f"    {label:<40} {med[a] / med[b]:6.2f}x")
        for name in med:
            if name.startswith(f"{self.args.many} tensors"):
                print(f"    {name + ', per tensor':<58} {med[name] / self.args.many * 1e6:6.1f} us")
        restore, bare = (f"{self.args.many} tensors: {what}" for what in ("Snapshot.restore, warm",
                                                                          "floor, the bare restore"))
        if restore in med and bare in med:
            print(f"    {f'{self.args.many} tensors: restore / the bare restore':<40} {med[restore] / med[bare]:6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--many", type=int, default=10000)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dir", default=None, help="where the snapshots go (default: the temporary directory)")
    parser.add_argument("--read-workers", type=lambda text: [int(n) for n in text.split(",")], default=[],
                        help="counts of reads in flight into the GPU to compare, e.g. 2,4")
    parser.add_argument("--sweep", action="store_true", help="measure the gather's threshold first")
    bench = Bench(parser.parse_args())
    bench.run()
    bench.report()


if __name__ == "__main__":
    main()
