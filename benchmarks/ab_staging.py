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

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import ab_main  # noqa: E402

CHILD = r"""
import json, os, shutil, statistics, sys, time
checkout, root, benchmarks, scale, many = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, checkout)
sys.path.insert(1, benchmarks)  # the benchmarks of this run, for large_state
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


if __name__ == "__main__":
    ab_main(__doc__, CHILD)
