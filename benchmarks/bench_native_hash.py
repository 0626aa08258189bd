"""What the C helpers buy: the same work with the checksums of small chunks computed natively, without the GIL, and
in Python, holding it (``SETTINGS.native_hash``; engine/_files/chunk_hashes.py), alternated in one process; and for
the restore, the checksums computed inside each read's own native call (storage/local_reads.py) or after it.

    python benchmarks/bench_native_hash.py [--count 10000] [--device cpu|cuda] [--rounds 8]

- **restore**: ``Snapshot.restore`` in place of ``--count`` flat fp32 tensors, 64 MiB in all, warm page cache
  (on ``--device cuda`` they go through the device slabs), per tensor; 3 restores per round and setting, and as
  many with native checksums computed after each read (a read thread leaving the GIL twice per run, not once);
- **loop during a save**: a pure-Python loop's speed while ``Snapshot.async_take`` of ``2 x --count`` host
  tensors (128 MiB) is written in the background, relative to the same loop idle just before; and that take's time.

Each round runs both settings, the order alternating; medians over the rounds, and the ratio native / Python.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import ppe_snapshot as ps
from ppe_snapshot.engine._files import chunk_hashes
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage import local_reads


def _work(n: int = 2000) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


def _loop_rate(seconds: float) -> float:
    start, k = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        _work()
        k += 1
    return k / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if chunk_hashes.NATIVE is None or local_reads.READ_ALL is None:
        raise SystemExit("the C helpers are not built (pip install -e . with a C compiler, or make venv)")
    cuda = args.device == "cuda"
    each = (64 << 20) // 4 // args.count
    restored = {f"t{i}": torch.full((each,), float(i), device=args.device) for i in range(args.count)}
    saved = {f"t{i}": torch.full((each,), float(i)) for i in range(2 * args.count)}
    root = tempfile.mkdtemp(prefix="bench-native-hash-")
    path = os.path.join(root, "restored")
    ps.Snapshot.take(path, {"m": ps.StateDict(restored)})
    results: dict[str, dict[bool, list[float]]] = {k: {True: [], False: []} for k in ("restore", "loop", "take")}
    after_read: list[float] = []
    helpers = local_reads.READ_ALL, chunk_hashes.HASH_JOB

    def restore() -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        ps.Snapshot(path).restore({"m": ps.StateDict(restored)})
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    try:
        for r in range(args.rounds):
            for native in (True, False) if r % 2 else (False, True):
                SETTINGS.native_hash = native
                restore()
                results["restore"][native] += [restore() / args.count * 1e6 for _ in range(3)]
                if native:
                    local_reads.READ_ALL, chunk_hashes.HASH_JOB = None, None
                    restore()
                    after_read += [restore() / args.count * 1e6 for _ in range(3)]
                    local_reads.READ_ALL, chunk_hashes.HASH_JOB = helpers
                idle = _loop_rate(0.3)
                target = os.path.join(root, f"saved-{r}-{native}")
                start = time.perf_counter()
                pending = ps.Snapshot.async_take(target, {"m": ps.StateDict(saved)})
                loop_start, k = time.perf_counter(), 0
                while not pending.done():
                    _work()
                    k += 1
                loop_time = time.perf_counter() - loop_start
                pending.wait()
                results["take"][native].append(time.perf_counter() - start)
                results["loop"][native].append(k / loop_time / idle)
                shutil.rmtree(target)
    finally:
        SETTINGS.native_hash = True
        local_reads.READ_ALL, chunk_hashes.HASH_JOB = helpers
        shutil.rmtree(root, ignore_errors=True)
    assert all(float(t[0]) == i for i, t in enumerate(restored.values())), "the restore lost a value"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"bench_native_hash: {args.count} tensors of {each * 4} bytes on {device}, {args.rounds} rounds, "
          f"{os.cpu_count()} cores, torch {torch.__version__}; medians, native / Python")
    rows = (("restore, us per tensor", "restore", "{:.2f}"), ("loop speed during the save, of idle", "loop", "{:.2f}"),
            ("that take's time, s", "take", "{:.3f}"))
    for label, key, fmt in rows:
        native, python = (statistics.median(results[key][v]) for v in (True, False))
        print(f"  {label:<38} native {fmt.format(native):>7}  Python {fmt.format(python):>7}  ({native / python:.2f}x)")
    within, after = statistics.median(results["restore"][True]), statistics.median(after_read)
    print(f"  {'restore, native checksums after reads':<38} {after:.2f} us per tensor; hashed inside the reads "
          f"{within:.2f} ({within / after:.2f}x)")


if __name__ == "__main__":
    main()
