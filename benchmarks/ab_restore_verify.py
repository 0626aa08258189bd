"""A/B: restore and verify(deep=False) of the 5,000-small-tensor snapshot (bench_engine.py's case b) with two
checkouts of ppe-snapshot, interleaved, to see what a change costs on a shared, noisy machine.

    python benchmarks/ab_restore_verify.py --a /path/to/base/checkout --b /path/to/changed/checkout \
        [--rounds 11] [--inner 9]

One snapshot is taken (with ``--a``). Each round runs one fresh process per checkout, the order
alternating, each timing ``--inner`` restores into existing tensors and quick verifies after two warm-up
runs (page cache warm) and printing their median and minimum; the report gives, per metric, the median
over the rounds and the ratio B/A.
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
import json, statistics, sys, time
sys.path.insert(0, sys.argv[3])
import torch
import ppe_snapshot as ps
assert ps.__file__.startswith(sys.argv[3]), ps.__file__
path, inner = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
app = {"s": ps.StateDict({f"t{i}": torch.empty(10240) for i in range(5000)})}
def t(f):
    s = time.perf_counter(); f(); return time.perf_counter() - s
for _ in range(2):
    ps.Snapshot(path).restore(app); ps.Snapshot(path).verify(deep=False)
r = [t(lambda: ps.Snapshot(path).restore(app)) for _ in range(inner)]
v = [t(lambda: ps.Snapshot(path).verify(deep=False)) for _ in range(inner)]
print(json.dumps({"restore": statistics.median(r), "verify_quick": statistics.median(v),
                  "restore_min": min(r), "verify_quick_min": min(v)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True, help="the base checkout (its root directory)")
    parser.add_argument("--b", required=True, help="the changed checkout")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--inner", type=int, default=9)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    args.a, args.b = os.path.abspath(args.a), os.path.abspath(args.b)
    root = tempfile.mkdtemp(prefix="ab-restore-verify-")
    path = os.path.join(root, "snap")
    setup = ("import sys; sys.path.insert(0, sys.argv[2]); import torch, ppe_snapshot as ps; torch.manual_seed(0); "
             "ps.Snapshot.take(sys.argv[1], {'s': ps.StateDict({f't{i}': torch.randn(10240) for i in range(5000)})})")
    subprocess.run([args.python, "-c", setup, path, args.a], check=True, env={**os.environ, "PYTHONPATH": args.a})
    results: dict[str, list[dict]] = {"a": [], "b": []}
    for r in range(args.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        for which in order:
            tree = getattr(args, which)
            out = subprocess.run([args.python, "-c", CHILD, path, str(args.inner), tree], check=True,
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
            results[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"round {r}: " + "  ".join(f"{w}: restore {results[w][-1]['restore']*1e3:.1f} ms, "
                                          f"verify_quick {results[w][-1]['verify_quick']*1e3:.1f} ms" for w in "ab"),
              flush=True)
    for metric in ("restore", "verify_quick", "restore_min", "verify_quick_min"):
        a = statistics.median(x[metric] for x in results["a"])
        b = statistics.median(x[metric] for x in results["b"])
        print(f"{metric}: A ({args.a}) {a*1e3:.2f} ms, B ({args.b}) {b*1e3:.2f} ms, B/A {b/a:.3f}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
