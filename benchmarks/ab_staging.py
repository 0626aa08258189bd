"""A/B: what the ThreadWriter and ProcessWriter calls block, with two checkouts of ppe-snapshot, interleaved.

    python benchmarks/ab_staging.py --a /path/to/base/checkout --b /path/to/changed/checkout \
        [--rounds 3] [--scale 1.0] [--many 100000]

Each round runs one fresh process per checkout, the order alternating. A process builds the ~1 GiB model +
Adam state of ``bench_engine.large_state`` and times, per writer: the first call (it allocates the staging
buffer), then three steady-state calls, each right after a 2-thread ``copy_`` of the same tensors into a
faulted private buffer (the baseline of the same moment); one ``Snapshot.async_take`` (a fresh buffer);
and the steady-state calls for 64 MiB in ``--many`` tensors. Every write is waited for, untimed, before
the next call. The report gives the median over the rounds per metric and the ratio B/A.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, shutil, statistics, sys, time
checkout, root, scale, many = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, checkout)
sys.path.insert(1, sys.argv[5])  # the benchmarks of this checkout, for large_state
import torch
import ppe_snapshot as ps
from ppe_snapshot import writing
from bench_engine import large_state
assert ps.__file__.startswith(checkout), ps.__file__


def tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [t for v in value for t in tensors(v)] if isinstance(value, (list, tuple)) else []


def main():
    out = {}
    model, optim = large_state(scale)
    state = lambda: {"model": model.state_dict(), "optim": optim.state_dict()}
    sources = tensors(state())
    memory = torch.empty(sum(t.nbytes for t in sources), dtype=torch.uint8)
    memory.fill_(0)
    views, offset = [], 0
    for t in sources:
        views.append(memory[offset:offset + t.nbytes].view(t.dtype).view(t.shape))
        offset += t.nbytes

    def copy():
        start = time.perf_counter()
        for v, t in zip(views, sources):
            v.copy_(t)
        return time.perf_counter() - start

    def call(writer, target, name):
        start = time.perf_counter()
        writer(name, root, target)
        blocked = time.perf_counter() - start
        writer.wait()
        shutil.rmtree(os.path.join(root, name))
        return blocked

    for cls in (writing.ThreadWriter, writing.ProcessWriter):
        writer = cls()
        try:
            if cls is writing.ProcessWriter:
                call(writer, {"x": torch.zeros(1)}, "start")  # the worker starts: not what is measured
            key = cls.__name__
            out[f"{key} first call"] = call(writer, state(), "first")
            steady, copies = [], []
            for i in range(3):
                copies.append(copy())
                steady.append(call(writer, state(), f"s{i}"))
            out[f"{key} steady"] = statistics.median(steady)
            out[f"{key} steady / copy"] = statistics.median(s / c for s, c in zip(steady, copies))
        finally:
            writer.finalize()
    out["copy 2 threads"] = copy()
    start = time.perf_counter()
    pending = ps.Snapshot.async_take(os.path.join(root, "async"), {"model": model, "optim": optim})
    out["Snapshot.async_take"] = time.perf_counter() - start
    pending.wait()
    del model, optim, sources, views, memory
    torch.manual_seed(0)
    small = {f"t{i}": torch.randn(16 * 2**20 // many) for i in range(many)}
    for cls in (writing.ThreadWriter, writing.ProcessWriter):
        writer = cls()
        try:
            call(writer, small, "warm")
            out[f"{cls.__name__} {many} tensors"] = statistics.median(call(writer, small, f"m{i}") for i in range(3))
        finally:
            writer.finalize()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--many", type=int, default=100_000)
    args = parser.parse_args()
    benchmarks = os.path.dirname(os.path.abspath(__file__))
    work = tempfile.mkdtemp(prefix="ab_staging_")
    child = os.path.join(work, "child.py")
    with open(child, "w") as f:
        f.write(CHILD)
    samples: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    try:
        for r in range(args.rounds):
            for label in (("A", "B") if r % 2 == 0 else ("B", "A")):
                checkout = os.path.abspath(args.a if label == "A" else args.b)
                root = os.path.join(work, label)
                os.makedirs(root, exist_ok=True)
                env = {**os.environ, "PYTHONPATH": checkout}
                done = subprocess.run([sys.executable, child, checkout, root, str(args.scale), str(args.many),
                                       benchmarks], env=env, capture_output=True, text=True, check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"round {r} {label}: " + ", ".join(f"{k}={v:.3f}" for k, v in result.items()), flush=True)
                for key, value in result.items():
                    samples[label].setdefault(key, []).append(value)
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nA: {args.a}\nB: {args.b}\nmedians of {args.rounds} rounds (one process per checkout and round)\n")
    print("| metric | A | B | B/A |\n|---|---|---|---|")
    for key in samples["A"]:
        a, b = statistics.median(samples["A"][key]), statistics.median(samples["B"][key])
        unit = "x" if "/" in key else " s"
        print(f"| {key} | {a:.3f}{unit} | {b:.3f}{unit} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
