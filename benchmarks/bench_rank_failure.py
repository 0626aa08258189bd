"""How long the surviving ranks of a save wait after one rank is killed: ppe-snapshot against DCP (issue 21).

3 gloo ranks on this machine, a 256 MiB tensor per rank, saves to a local directory one after the other. In save 2
rank 1 kills itself with SIGKILL ``--at`` of the way into the save (as a fraction of save 1's duration); the
time from the kill to the last survivor's exception is measured, for ``Snapshot.take``, a ThreadWriter save (the
error raised by ``wait()``) and ``torch.distributed.checkpoint.save``, interleaved round by round; medians.
Target: at most 1.5x DCP's, and never above 10 s.

    python benchmarks/bench_rank_failure.py --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import _rank_kill  # noqa: E402

METHODS = {"take": "Snapshot.take", "thread": "ThreadWriter", "dcp": "dcp.save"}


def detection_s(kind: str, mib: int, at: float) -> tuple[float, str]:
    """Seconds from the kill to the last survivor's exception, and that exception's first line."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as out:
        spec = {"dir": out, "kind": kind, "saves": 4, "mib": mib, "victim": 1, "when": "delay", "save": 2,
                "delay": at, "scaled": True, "pg_timeout": 120}
        result = _rank_kill.run_trial(spec, timeout=180)
    killed = result["killed"]
    errors = [result["ranks"][r] and result["ranks"][r].get("error") for r in (0, 2)]
    if killed is None or not all(errors):
        return float("inf"), f"a survivor raised nothing within the trial's time limit: {errors}"
    last = max(errors, key=lambda e: e["time"])
    return last["time"] - killed["time"], f"{last['type']}: {last['message'].splitlines()[0][:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256, help="MiB per rank")
    parser.add_argument("--at", type=float, default=0.5, help="when rank 1 dies, as a fraction of a save")
    args = parser.parse_args()
    times: dict[str, list[float]] = {kind: [] for kind in METHODS}
    for round_ in range(args.rounds):
        for kind in METHODS:
            seconds, error = detection_s(kind, args.mib, args.at)
            times[kind].append(seconds)
            print(f"round {round_ + 1} {METHODS[kind]:>14}: {seconds:.3f} s  ({error})", flush=True)
    dcp = statistics.median(times["dcp"])
    for kind, label in METHODS.items():
        median = statistics.median(times[kind])
        print(f"{label:>14}: kill -> last survivor's exception median {median:.3f} s ({median / dcp:.2f}x DCP); "
              f"rounds {', '.join(f'{t:.3f}' for t in times[kind])}")


if __name__ == "__main__":
    main()
