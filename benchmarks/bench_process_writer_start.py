"""How long the first ProcessWriter save blocks the loop, against a steady-state save.

Each round is a fresh training process (the first save is once per process): it builds a model + Adam state of
about ``--mib`` MiB, creates a ProcessWriter, trains for ``--after`` seconds (0: the first save comes while the
worker process is still starting), then saves ``--saves`` times with training steps between, waiting for each
save to be durable before the next step (so that "blocked" is the save's own blocking time). Reported per
checkout: the first save's blocked time, the median of the others, and their ratio; and the floor of a first
save measured in the same process: the state's bytes copied into fresh shared memory (every page touched for the
first time, as the first save's new staging buffer is) against the same copy into it again. Medians over
rounds, the checkouts interleaved.

    python benchmarks/bench_process_writer_start.py [--a OTHER_CHECKOUT] [--b .] [--rounds 5] [--after 0 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

CHILD = r"""
import json, sys, tempfile, time
import torch
from ppe_snapshot import writing
mib, after, saves, out = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
width = int((mib * 2 ** 20 / 4 / 3) ** 0.5)  # weights + Adam's two moments
model = torch.nn.Linear(width, width, bias=False)
optim = torch.optim.Adam(model.parameters())
def step():
    optim.zero_grad()
    model(torch.ones(8, width)).sum().backward()
    optim.step()
step()
writer = writing.ProcessWriter()
start = time.perf_counter()
while time.perf_counter() - start < after:
    step()
blocked = []
for i in range(saves):
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    t = time.perf_counter()
    writer(f"snap_{i}", out, state)
    blocked.append(time.perf_counter() - t)
    writer.wait()
    step()
writer.finalize()
# The floor of a first save: the same bytes copied into fresh shared memory (the kernel's first touch of every
# page), against the same copy into that memory again (what a steady save copies into).
from ppe_snapshot.engine import new_shared_buffer
tensors = [t for t in [*model.state_dict().values(), *optim.state_dict()["state"][0].values()] if t.numel() > 1]
size = sum(t.numel() * t.element_size() for t in tensors)
def copy_into(buffer):
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        buffer[offset:offset + n].view(t.dtype).copy_(t.reshape(-1))
        offset += n
t = time.perf_counter()
buffer = new_shared_buffer(size)
copy_into(buffer)
fresh = time.perf_counter() - t
t = time.perf_counter()
copy_into(buffer)
print(json.dumps({"blocked": blocked, "fresh": fresh, "reused": time.perf_counter() - t}))
"""


def one_round(checkout: str, mib: float, after: float, saves: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as out:
        done = subprocess.run([sys.executable, "-c", CHILD, str(mib), str(after), str(saves), out],
                              capture_output=True, text=True, timeout=600, cwd=out,
                              env={**os.environ, "PYTHONPATH": os.path.abspath(checkout)})
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", help="another checkout to compare with (e.g. a git worktree of an older commit)")
    parser.add_argument("--b", default=".", help="this checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--after", type=float, nargs="+", default=[0.0, 2.0])
    parser.add_argument("--mib", type=float, default=256)
    parser.add_argument("--saves", type=int, default=6)
    args = parser.parse_args()
    checkouts = {"b": args.b, **({"a": args.a} if args.a else {})}
    print(f"state {args.mib:.0f} MiB, {args.saves} saves per process, {args.rounds} rounds, "
          f"torch {__import__('torch').__version__}, {os.cpu_count()} cores")
    print("| checkout | training before the first save | first save blocked | steady save blocked (median) "
          "| first / steady | floor: copy into fresh / reused shared memory | first save / fresh copy |")
    print("|---|---|---|---|---|---|---|")
    for after in args.after:
        results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in checkouts}
        for _ in range(args.rounds):
            for name, path in checkouts.items():
                got = one_round(path, args.mib, after, args.saves)
                blocked = got["blocked"]
                results[name].append((blocked[0], statistics.median(blocked[1:]), got["fresh"], got["reused"]))
        for name, rows in results.items():
            first, steady, fresh, reused = (statistics.median(r[i] for r in rows) for i in range(4))
            ratio = statistics.median(r[0] / r[1] for r in rows)
            to_floor = statistics.median(r[0] / r[2] for r in rows)
            print(f"| {name}: {checkouts[name]} | {after:.0f} s | {first:.3f} s | {steady:.3f} s | {ratio:.2f}x "
                  f"| {fresh:.3f} s / {reused:.3f} s | {to_floor:.2f}x |")


if __name__ == "__main__":
    main()
