"""Helpers shared by the benchmark scripts: timing, peak RSS, page-cache control, reporting."""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """Resident set size of this process in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Peak RSS of this process inside the ``with`` block; ``extra`` is the peak above the RSS at entry.

    Linux keeps the peak itself (``VmHWM``) and resets it on request
    (``/proc/self/clear_refs``), so nothing runs beside the code being
    timed. A thread sampling RSS every millisecond instead would
    take CPU from that code: on 2 cores it slowed a 1 GiB staging copy from
    about 0.06 s to 0.1-0.15 s.
    """

    def __init__(self) -> None:
        self.start = self.peak = 0

    def __enter__(self) -> "PeakRSS":
        gc.collect()
        self.start = rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        return self

    def __exit__(self, *exc) -> None:
        with open("/proc/self/status") as f:
            self.peak = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024

    @property
    def extra(self) -> int:
        return self.peak - self.start


def fsync_path(path: str) -> None:
    """fsync every file under ``path`` (a file or a directory) and the directories themselves."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths + ([path] if os.path.isdir(path) else []):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(path: str) -> None:
    """Evict a file's (or a directory tree's) pages from the page cache (data must be fsynced)."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@contextmanager
def timer(out: dict, key: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    out[key] = time.perf_counter() - start


@dataclass
class Results:
    """Samples per (case, method, metric); medians and ratios for the report."""
    samples: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)

    def add(self, case: str, method: str, metrics: dict[str, float]) -> None:
        for metric, value in metrics.items():
            self.samples.setdefault((case, method, metric), []).append(value)

    def median(self, case: str, method: str, metric: str) -> float | None:
        values = self.samples.get((case, method, metric))
        return statistics.median(values) if values else None

    def methods(self, case: str) -> list[str]:
        return list(dict.fromkeys(m for c, m, _ in self.samples if c == case))

    def table(self, case: str, metrics: list[tuple[str, str, Callable[[float], str]]]) -> str:
        lines = ["| method | " + " | ".join(title for _, title, _ in metrics) + " |",
                 "|---" * (len(metrics) + 1) + "|"]
        for method in self.methods(case):
            cells = []
            for metric, _, fmt in metrics:
                value = self.median(case, method, metric)
                cells.append("-" if value is None else fmt(value))
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def secs(n: float) -> str:
    return f"{n:.3f} s"


def gbps(n: float) -> str:
    return f"{n / 1e9:.2f} GB/s"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm_cache(path: str) -> None:
    """Read a file or directory tree once so its pages are in the page cache."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def emit(text: str, report: str | None) -> None:
    """Print a benchmark's markdown report, and write it to ``report`` when given."""
    print(text)
    if report:
        with open(report, "w") as f:
            f.write(text + "\n")


def ab_main(doc: str | None, child_source: str) -> None:
    """An A/B script's command line: two checkouts, the rounds, and the scale of the large state and the
    number of small tensors that the child gets after ``checkout root benchmarks`` (see :func:`run_ab`)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="checkout A (e.g. a worktree of the base commit)")
    parser.add_argument("--b", required=True, help="checkout B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="of bench_engine.large_state (~1 GiB at 1)")
    parser.add_argument("--many", type=int, default=100_000, help="small tensors in the per-tensor cases")
    args = parser.parse_args()
    run_ab(child_source, args, [str(args.scale), str(args.many)])


def run_ab(child_source: str, args: argparse.Namespace, extra: list[str], unit: str = " s") -> None:
    """Run ``child_source`` once per checkout and round, in a fresh process, alternating which goes first; print
    each round and a table of the medians with B/A. The child gets ``checkout root benchmarks *extra`` and
    prints a JSON object of metric -> value in ``unit`` (or ratio, for a metric whose name holds a ``/``) last."""
    benchmarks = os.path.dirname(os.path.abspath(__file__))
    work = tempfile.mkdtemp(prefix="ab_")
    child = os.path.join(work, "child.py")
    with open(child, "w") as f:
        f.write(child_source)
    samples: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    try:
        for r in range(args.rounds):
            for label in (("A", "B") if r % 2 == 0 else ("B", "A")):
                checkout = os.path.abspath(args.a if label == "A" else args.b)
                root = os.path.join(work, label)
                os.makedirs(root, exist_ok=True)
                env = {**os.environ, "PYTHONPATH": checkout}
                done = subprocess.run([sys.executable, child, checkout, root, benchmarks, *extra], env=env,
                                      capture_output=True, text=True, check=True)
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
        shown = "x" if "/" in key else unit
        print(f"| {key} | {a:.3f}{shown} | {b:.3f}{shown} | {b / a:.2f} |")
