"""Where the restore of many small tensors spends its time (issue 35): the same restore in several variants,
alternated in one process, beside the bare restore (the least work any restore of them from this format does).

    python benchmarks/probe_many_restore.py [--count 10000] [--device cuda|cpu] [--rounds 5]

The state: ``--count`` flat fp32 tensors of 64 MiB in all, saved once, restored in place with a warm page cache.
Variants, each once per round in a rotating order, medians reported per tensor:

- **as is**: ``Snapshot.restore``;
- **switch 0.2 ms**: the same with the interpreter's switch interval at 0.2 ms instead of 5 ms (the walk and the
  read threads hand the GIL over sooner);
- **reads inline**: every read the restore hands to its pool run at once in the walk's thread (no threads);
- **walk only**: the reads dropped (the walk, the slabs' copies to the device, the final checks);
- **reads only**: the reads of the "as is" restore, run one after another in one thread (recorded once);
- **the bare restore**: each key's saved bytes and target looked up, the data file read whole into page-locked
  memory, a checksum per chunk compared, each target's dtype and shape compared, one copy to the device, one
  ``torch.split_with_sizes_copy`` into the targets (and scratch tensors for the gaps between them);
- **the bare restore, split + foreach**: the same, the device copy cut into views by one split and copied by one
  ``torch._foreach_copy_`` instead (the way the restore copied its slabs of flat tensors before; which of the two
  costs less on a GPU is what this row tells).

On an H200 the walk and the reads took turns rather than overlapping (issue 35's notes); this tells which of the
walk, the reads, and their sharing of the GIL a change should go after.
"""
from __future__ import annotations

import argparse
import operator
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import xxhash

import ppe_snapshot as ps
from ppe_snapshot.engine._files import ReadBatch
from ppe_snapshot.engine._restore.device_slabs import DeviceSlabs


def bare_restore(path: str, state: dict[str, torch.Tensor], host: torch.Tensor,
                 split_copy: bool = True) -> Callable[[], None]:
    """The bare restore of ``state`` (flat fp32 tensors, saved under app state key ``"m"`` by one rank) from
    snapshot ``path``, through ``host`` (page-locked for a device state, at least the data file's size). What a
    restore must do is timed: each key's saved bytes and target found, the data file read, every chunk's
    checksum and every target's dtype and shape compared, the bytes copied in; the rest of the layout (the table
    by path, the split sizes, scratch tensors for the gaps) is made here, before, from the manifest.
    ``split_copy``: the bytes copied into the targets by one ``torch.split_with_sizes_copy``, else by a split and one
    ``torch._foreach_copy_``."""
    manifest = ps.Snapshot(path).get_manifest()
    entries = [manifest[f"0/m/{key}"] for key in state]
    chunks = [entry.chunks[0] for entry in entries]
    (data,) = {chunk.file for chunk in chunks}
    data, device = os.path.join(path, data), next(iter(state.values())).device
    if os.path.getsize(data) > host.nbytes:
        raise ValueError(f"the host buffer ({host.nbytes} bytes) is smaller than {data}")
    table = {f"m/{key}": (c.offset, c.offset + c.nbytes, int(c.checksum, 16), (torch.float32, torch.Size(e.shape)))
             for key, e, c in zip(state, entries, chunks)}
    starts, ends = ([row[i] // 4 for row in table.values()] for i in (0, 1))
    pieces = [n for start, end, following in zip(starts, ends, starts[1:] + [ends[-1]])
              for n in (end - start, following - end)]  # each tensor and the gap after it, in floats
    first, last = starts[0] * 4, ends[-1] * 4
    gaps = [torch.empty(n, device=device) for n in pieces[1::2]]  # where the bytes between the tensors go
    start_of, end_of, sum_of, want_of = map(operator.itemgetter, range(4))

    def restore() -> None:
        keys = list(state)
        rows, targets = list(map(table.__getitem__, map("m/".__add__, keys))), list(map(state.get, keys))
        view = memoryview(host.numpy())
        with open(data, "rb", buffering=0) as f:
            f.readinto(view)
        chunks = map(view.__getitem__, map(slice, map(start_of, rows), map(end_of, rows)))
        if list(map(xxhash.xxh3_64_intdigest, chunks)) != list(map(sum_of, rows)):
            raise AssertionError("a checksum differs")
        if list(map(operator.attrgetter("dtype", "shape"), targets)) != list(map(want_of, rows)):
            raise AssertionError("a target differs")
        staged = host[first:last].view(torch.float32).to(device, non_blocking=True)
        if split_copy:
            torch.split_with_sizes_copy(staged, pieces, out=[t for pair in zip(targets, gaps) for t in pair])
        else:
            torch._foreach_copy_(targets, staged.split(pieces)[0::2])
    return restore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    each = (64 << 20) // 4 // args.count
    state = {f"t{i}": torch.full((each,), float(i), device=args.device) for i in range(args.count)}
    path = os.path.join(tempfile.mkdtemp(prefix="probe-many-"), "s")
    ps.Snapshot.take(path, {"m": ps.StateDict(state)})
    host = torch.empty(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs),
                       dtype=torch.uint8, pin_memory=cuda)
    submit, switch = ReadBatch.submit, sys.getswitchinterval()
    runs: list[tuple[Callable[..., Any], tuple]] = []

    def restore() -> None:
        ps.Snapshot(path).restore({"m": ps.StateDict(state)})

    def with_switch() -> None:
        sys.setswitchinterval(0.0002)
        try:
            restore()
        finally:
            sys.setswitchinterval(switch)

    def patched(replacement: Callable[..., None]) -> Callable[[], None]:
        def run() -> None:
            ReadBatch.submit = replacement
            try:
                restore()
            finally:
                ReadBatch.submit = submit
        return run

    variants = {
        "as is": restore,
        "switch 0.2 ms": with_switch,
        "reads inline": patched(lambda self, storage, fn, *a, workers=None: fn(*a)),
        "walk only": patched(lambda self, storage, fn, *a, workers=None: None),
        "the bare restore": bare_restore(path, state, host),
        "the bare restore, split + foreach": bare_restore(path, state, host, split_copy=False),
    }
    # The reads of one restore, recorded to be replayed; the host slabs they read into (for device targets) are
    # kept alive for them.
    kept_slabs, copy = [], DeviceSlabs.copy
    DeviceSlabs.copy = lambda self: (kept_slabs.append(self), copy(self))[1]
    try:
        patched(lambda self, storage, fn, *a, workers=None: runs.append((fn, a)))()
    finally:
        DeviceSlabs.copy = copy
    times: dict[str, list[float]] = {name: [] for name in [*variants, "reads only"]}

    def timed(name: str, fn: Callable[[], None]) -> None:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times[name].append(time.perf_counter() - start)

    try:
        for fn in variants.values():  # warm-up
            fn()
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                timed(name, variants[name])
            timed("reads only", lambda: [fn(*a) for fn, a in runs])
        restore()  # (the variants without reads leave the state as they found it, or worse)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    expected = torch.arange(args.count, dtype=torch.float32, device=args.device)
    assert torch.equal(torch.stack([t[0] for t in state.values()]), expected), "the restore lost a value"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"probe_many_restore: {args.count} tensors of {each * 4} bytes on {device}, {args.rounds} rounds, torch "
          f"{torch.__version__}, {os.cpu_count()} cores; per tensor, median (min-max)")
    for name, values in times.items():
        per = [v / args.count * 1e6 for v in values]
        print(f"  {name:<34} {statistics.median(per):6.2f} us  ({min(per):.2f}-{max(per):.2f})")


if __name__ == "__main__":
    main()
