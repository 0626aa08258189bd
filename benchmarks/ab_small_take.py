"""A/B: ``Snapshot.take`` and ``restore`` of bench_engine's ~5,000 small tensors (case (b)), two checkouts,
interleaved.

    python benchmarks/ab_small_take.py --a /path/to/base/checkout --b /path/to/changed/checkout [--rounds 3]

Each round runs one fresh process per checkout, the order alternating. A process builds
``bench_engine.small_state`` and times five takes (each to a new path, fsynced as every take is) and five warm
restores of the first; each metric is the median of its five. The report gives the median over the rounds and B/A.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import ab_main  # noqa: E402

CHILD = r"""
import json, os, statistics, sys, time
checkout, root, benchmarks, scale = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
sys.path.insert(0, checkout)
sys.path.insert(1, benchmarks)
import ppe_snapshot as ps
from bench_engine import small_state
assert ps.__file__.startswith(checkout), ps.__file__

app = {"s": small_state(scale)}
takes, restores = [], []
for i in range(6):
    start = time.perf_counter()
    ps.Snapshot.take(os.path.join(root, f"s{i}"), app)
    if i:
        takes.append(time.perf_counter() - start)
snap = ps.Snapshot(os.path.join(root, "s0"))
for i in range(6):
    start = time.perf_counter()
    snap.restore(app)
    if i:
        restores.append(time.perf_counter() - start)
print(json.dumps({"take (5,000 small tensors)": statistics.median(takes),
                  "restore warm (5,000 small tensors)": statistics.median(restores)}))
"""

if __name__ == "__main__":
    ab_main(__doc__, CHILD)
