"""The cost per tensor: many small tensors, one process (issue 14).

Cases, each against torch.save+fsync / torch.load+copy_ in the same run, and the take against a bare
Python loop (``bare_loop``: the calls every tensor costs in the interpreter plus the disk, a floor):

* 64 MiB in N float32 tensors, N = 10^4 and 10^5: take (durable) and restore into the existing tensors
  (page cache);
* 10^5 0-d float32 tensors: take and restore;
* 64 MiB in an Adam state of 33,334 parameters (a dict of step, exp_avg, exp_avg_sq each: 10^5 tensors);
* 5,000 small tensors (0.19 GiB): cold restore (page cache dropped) vs the disk's cold read of the same
  bytes (the snapshot's data file read sequentially, cache dropped), in the same round; then the warm restore
  of the same snapshot (the restore's own work, for reference).

Every method runs once per round, rounds interleave them; the report gives medians.

    python benchmarks/bench_many_tensors.py [--rounds 3] [--dir /path/on/the/disk] [--cases 1e4,1e5,0d,adam,cold]
    python benchmarks/bench_many_tensors.py --profile take|restore|writer [--count 100000] [--device cuda]
        # cProfile, top 25, after the median of 5 unprofiled calls (writer: a ThreadWriter's blocking call)
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import mmap
import os
import platform
import pstats
import shutil
import sys
import tempfile
import time
from typing import Iterator

import torch
import xxhash

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, drop_cache, emit, fsync_path, secs, warm_cache  # noqa: E402

import ppe_snapshot as ps  # noqa: E402

TOTAL = 64 << 20


def many(count: int, device: str = "cpu") -> ps.StateDict:
    torch.manual_seed(0)
    per = TOTAL // 4 // count
    return ps.StateDict({f"t{i}": torch.randn(per).to(device) for i in range(count)})


def scalars(count: int) -> ps.StateDict:
    torch.manual_seed(0)
    return ps.StateDict({f"t{i}": torch.tensor(float(i)) for i in range(count)})


def optimizer_like(params: int) -> ps.StateDict:
    """An Adam state of ``params`` parameters: a dict per parameter (step, exp_avg, exp_avg_sq), 64 MiB in all
    (the other half of a model's tensors: an optimizer's, a small dict each)."""
    torch.manual_seed(0)
    per = TOTAL // 4 // (2 * params)
    return ps.StateDict({
        "state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(per), "exp_avg_sq": torch.randn(per)}
                  for i in range(params)},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(params))}]})


def tensors_of(value: object) -> Iterator[torch.Tensor]:
    """Every tensor of a nested state, in order."""
    if isinstance(value, dict):
        for v in value.values():
            if type(v) is torch.Tensor:
                yield v
            else:
                yield from tensors_of(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_of(v)
    elif isinstance(value, torch.Tensor):
        yield value


def small(count: int = 5000) -> ps.StateDict:
    torch.manual_seed(0)
    return ps.StateDict({f"t{i}": torch.randn(10240) for i in range(count)})


def take(app: dict, path: str) -> float:
    start = time.perf_counter()
    ps.Snapshot.take(path, app)
    return time.perf_counter() - start


def restore(app: dict, path: str) -> float:
    start = time.perf_counter()
    ps.Snapshot(path).restore(app)
    return time.perf_counter() - start


def torch_save(app: dict, path: str) -> float:
    start = time.perf_counter()
    torch.save({k: dict(v.state_dict()) for k, v in app.items()}, path)
    fsync_path(path)
    return time.perf_counter() - start


def bare_loop(app: dict, path: str) -> float:
    """The least a pure-Python save with a checksum per tensor does, as a floor for the take: per tensor read
    its pointer, size, dtype and shape, memmove its bytes to the next 64-byte boundary of one page-aligned
    buffer and hash them there (xxh3); then write the buffer with O_DIRECT and fsync (the disk's fastest way
    here: through the page cache the same write took 0.1 s longer). No checks, no index, no commit, nothing to
    restore from: only the calls every tensor costs in the interpreter, and the disk. The cyclic collector is
    paused, as the take pauses it (with it running, the loop took 2x as long)."""
    gc.disable()
    start = time.perf_counter()
    tensors = [t for obj in app.values() for t in tensors_of(obj.state_dict())]
    buffer = mmap.mmap(-1, (sum((t.nbytes + 63) & -64 for t in tensors) + 4095) & -4096)
    base, view, rows, offset = ctypes.addressof(ctypes.c_char.from_buffer(buffer)), memoryview(buffer), [], 0
    for t in tensors:
        n = t.nbytes
        ctypes.memmove(base + offset, t.data_ptr(), n)
        rows.append((t.dtype, t.shape, offset, n, xxhash.xxh3_64_intdigest(view[offset:offset + n])))
        offset = (offset + n + 63) & -64
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0))
    try:
        os.write(fd, view)
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    del view, base
    buffer.close()
    gc.enable()
    return elapsed


def torch_load(app: dict, path: str) -> float:
    start = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    with torch.no_grad():
        for key, obj in app.items():
            for own, tensor in zip(tensors_of(obj.state_dict()), tensors_of(loaded[key])):
                own.copy_(tensor)
    return time.perf_counter() - start


def cold_read(path: str) -> float:
    """The disk's cold sequential read of the snapshot's data files (the same bytes the restore reads)."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(path, "data")) for f in fs]
    drop_cache(path)
    block = bytearray(16 << 20)
    start = time.perf_counter()
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while f.readinto(block):
                pass
    return time.perf_counter() - start


def run_round(case: str, app: dict, root: str, r: int, results: Results) -> None:
    snap, pt = os.path.join(root, f"{r}-snap"), os.path.join(root, f"{r}.pt")
    metrics = {"take": take(app, snap)}
    warm_cache(snap)
    metrics["restore"] = restore(app, snap)
    results.add(case, "ppe-snapshot", metrics)
    base = {"take": torch_save(app, pt)}
    warm_cache(pt)
    base["restore"] = torch_load(app, pt)
    results.add(case, "torch.save+fsync / torch.load+copy_", base)
    floor = bare_loop(app, pt + ".bare")
    results.add(case, "bare Python loop", {"take": floor})
    print(f"   {case} round {r}: snapshot take {metrics['take']:.3f} s restore {metrics['restore']:.3f} s; "
          f"torch {base['take']:.3f} s / {base['restore']:.3f} s; bare loop {floor:.3f} s", flush=True)
    shutil.rmtree(snap)
    os.remove(pt)
    os.remove(pt + ".bare")


def run_cold(app: dict, root: str, r: int, results: Results) -> None:
    case = "5,000 small tensors, cold"
    snap = os.path.join(root, f"{r}-cold")
    ps.Snapshot.take(snap, app)
    fsync_path(snap)
    disk = cold_read(snap)
    drop_cache(snap)
    cold = restore(app, snap)
    warm = restore(app, snap)  # the same bytes from the page cache: the restore's own work
    results.add(case, "ppe-snapshot", {"restore": cold, "disk": disk, "ratio": disk / cold, "warm": warm})
    print(f"   {case} round {r}: restore {cold:.3f} s, disk cold read {disk:.3f} s ({disk / cold:.0%}), "
          f"warm restore {warm:.3f} s", flush=True)
    shutil.rmtree(snap)


def report(results: Results, args) -> str:
    lines = ["### Many tensors (bench_many_tensors.py)", "",
             f"`python benchmarks/bench_many_tensors.py --rounds {args.rounds}`; {platform.node()}, "
             f"{os.cpu_count()} cores, torch {torch.__version__}; medians of {args.rounds} rounds.", "",
             "| case | snapshot take | torch.save+fsync | ratio | bare Python loop (floor) | take / floor "
             "| snapshot restore | torch.load+copy_ | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in dict.fromkeys(c for c, _, _ in results.samples):
        if "cold" in case:
            continue
        t, tt = results.median(case, "ppe-snapshot", "take"), results.median(case, "torch.save+fsync / "
                                                                             "torch.load+copy_", "take")
        r, tr = results.median(case, "ppe-snapshot", "restore"), results.median(case, "torch.save+fsync / "
                                                                                "torch.load+copy_", "restore")
        floor = results.median(case, "bare Python loop", "take")
        lines.append(f"| {case} | {secs(t)} | {secs(tt)} | {tt / t:.1f}x | {secs(floor)} | {t / floor:.2f}x "
                     f"| {secs(r)} | {secs(tr)} | {tr / r:.1f}x |")
    cold = "5,000 small tensors, cold"
    if results.median(cold, "ppe-snapshot", "restore") is not None:
        lines += ["", "| case | cold restore | disk cold read of the data file | restore vs disk | warm restore |",
                  "|---|---|---|---|---|",
                  f"| {cold} | {secs(results.median(cold, 'ppe-snapshot', 'restore'))} | "
                  f"{secs(results.median(cold, 'ppe-snapshot', 'disk'))} | "
                  f"{results.median(cold, 'ppe-snapshot', 'ratio'):.0%} | "
                  f"{secs(results.median(cold, 'ppe-snapshot', 'warm'))} |"]
    return "\n".join(lines)


def profile(what: str, count: int, root: str, device: str) -> None:
    app = {"state": many(count, device)}
    path = os.path.join(root, "profiled")
    writer = ps.writing.ThreadWriter()

    def call() -> None:
        if what == "take":
            shutil.rmtree(path, ignore_errors=True)
            ps.Snapshot.take(path, app)
        elif what == "restore":
            ps.Snapshot(path).restore(app)
        else:
            writer("profiled", root, app["state"].state_dict())  # (the extension's call: its blocking part)
            return
        if device != "cpu":
            torch.cuda.synchronize()

    ps.Snapshot.take(path, app)  # warm-up (imports)
    warm_cache(path)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        writer.wait()
    median = sorted(times)[2]
    print(f"{what} of {count} tensors on {device}: median of 5 {median * 1e3:.1f} ms, "
          f"{median / count * 1e6:.2f} us per tensor")
    profiler = cProfile.Profile()
    profiler.runcall(call)
    writer.wait()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    writer.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--cases", default="1e4,1e5,0d,adam,cold")
    parser.add_argument("--profile", choices=("take", "restore", "writer"))
    parser.add_argument("--device", default="cpu", help="where the profiled state lies (cpu, cuda)")
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--report", default=None, help="also write the markdown report to this file")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ppe-many-", dir=args.dir)
    try:
        if args.profile:
            profile(args.profile, args.count, root, args.device)
            return
        cases = args.cases.split(",")
        states = {"64 MiB in 10^4 float32": (lambda: many(10_000)) if "1e4" in cases else None,
                  "64 MiB in 10^5 float32": (lambda: many(100_000)) if "1e5" in cases else None,
                  "10^5 0-d float32": (lambda: scalars(100_000)) if "0d" in cases else None,
                  "64 MiB in an Adam state of 33,334 parameters (10^5 tensors)":
                      (lambda: optimizer_like(33_334)) if "adam" in cases else None}
        results = Results()
        for case, build in states.items():
            if build is None:
                continue
            app = {"state": build()}
            for r in range(args.rounds):
                run_round(case, app, root, r, results)
        if "cold" in cases:
            app = {"state": small()}
            for r in range(args.rounds):
                run_cold(app, root, r, results)
        emit(report(results, args), args.report)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
