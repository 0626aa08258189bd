"""A/B: what each writer's call blocks and how long until durable, with two checkouts of ppe-snapshot, interleaved.

    python benchmarks/ab_writers.py --a /path/to/base/checkout --b /path/to/changed/checkout [--rounds 3] [--scale 1.0]

Each round runs one fresh process per checkout, the order alternating. A process builds the ~1 GiB model + Adam
state of ``bench_engine.large_state`` and, per writer (Simple, Thread, Process), makes one untimed save (worker
start, first buffer), then three timed ones: the time the call blocked and the time until ``wait()`` returned;
each metric is the median of its three. The report gives the median over the rounds and B/A.
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
sys.path.insert(1, benchmarks)
import ppe_snapshot as ps
from ppe_snapshot import writing
from bench_engine import large_state
assert ps.__file__.startswith(checkout), ps.__file__

model, optim = large_state(scale)
state = {"model": model.state_dict(), "optim": optim.state_dict()}
out = {}
for cls in (writing.SimpleWriter, writing.ThreadWriter, writing.ProcessWriter):
    writer = cls(out_dir=root)
    blocked, durable = [], []
    for i in range(4):
        start = time.perf_counter()
        writer(f"s{i}", root, state)
        middle = time.perf_counter()
        writer.wait()
        end = time.perf_counter()
        if i:
            blocked.append(middle - start)
            durable.append(end - start)
    writer.finalize()
    out[f"{cls.__name__} blocked"] = statistics.median(blocked)
    out[f"{cls.__name__} until durable"] = statistics.median(durable)
    shutil.rmtree(root)
    os.makedirs(root)
print(json.dumps(out))
"""

if __name__ == "__main__":
    ab_main(__doc__, CHILD)
