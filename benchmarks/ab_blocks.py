"""A/B: what a plain take's chunks cost, with two checkouts of ppe-snapshot, interleaved (issue 32: every take
writes its payloads in chunks of its block size, 1 MiB by default, where it wrote one chunk of up to 64 MiB).

    python benchmarks/ab_blocks.py --a /path/to/base/checkout --b /path/to/changed/checkout \
        [--rounds 3] [--scale 1.0]

Each round runs one fresh process per checkout, the order alternating. A process builds the ~1 GiB model +
Adam state of ``bench_engine.large_state`` and times three of each, on snapshots it took itself:
``Snapshot.take``, ``Snapshot.async_take`` until committed, ``restore`` into the existing tensors (page cache
warm) and ``verify()`` (every checksum); each metric is the median of its three. The report gives the median
over the rounds and B/A.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import ab_main  # noqa: E402

CHILD = r"""
import json, os, shutil, statistics, sys, time
checkout, root, benchmarks, scale = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
sys.path.insert(0, checkout)
sys.path.insert(1, benchmarks)  # the benchmarks of this run, for the state
import ppe_snapshot as ps
from bench_engine import large_state
assert ps.__file__.startswith(checkout), ps.__file__

model, optim = large_state(scale)
app = {"model": model, "optim": optim}
times = {"take": [], "async_take until committed": [], "restore (warm)": [], "verify (every checksum)": []}
for i in range(3):
    path = os.path.join(root, f"s{i}")
    start = time.perf_counter()
    ps.Snapshot.take(path, app)
    times["take"].append(time.perf_counter() - start)
    start = time.perf_counter()
    ps.Snapshot.async_take(path + "a", app).wait()
    times["async_take until committed"].append(time.perf_counter() - start)
    ps.Snapshot(path).restore(app)  # warm the page cache
    start = time.perf_counter()
    ps.Snapshot(path).restore(app)
    times["restore (warm)"].append(time.perf_counter() - start)
    start = time.perf_counter()
    ps.Snapshot(path).verify()
    times["verify (every checksum)"].append(time.perf_counter() - start)
    shutil.rmtree(path)
    shutil.rmtree(path + "a")
print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
"""


if __name__ == "__main__":
    ab_main(__doc__, CHILD)
