"""Helpers shared by the benchmark scripts: timing, peak RSS, page-cache control, reporting."""
from __future__ import annotations

import gc
import os
import re
import statistics
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
