"""A process that saves snapshots until tests/test_crash.py kills it with SIGKILL.

Run as a script (not from the test pool, so it can be killed on its own):

``python _crash_child.py loop <root> <mib>``
    takes ``<root>/s0``, ``<root>/s1``, ... of a ``<mib>`` MiB state and prints
    each snapshot's path once it is committed.
``python _crash_child.py process <root> <mib>``
    as ``loop``, through a ProcessWriter (its worker process writes); prints ``worker <pid>``.
``python _crash_child.py dist <path> <mib>``
    one rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` from the
    environment) of a gloo group taking one snapshot; rank 1 holds ``<mib>`` MiB,
    rank 0 a small state. Prints ``committed`` or exits with ``ERROR_EXIT`` and
    the error on stderr.
``python _crash_child.py replace <root> <mib> <variant> <pause> <first>``
    saves ``<root>/latest`` again and again with a SimpleWriter, snapshot ``first``,
    ``first + 1``, ... (metadata ``iteration`` = the index), printing each index once
    saved. ``variant``: ``exchange`` (renameat2), ``rename`` (no exchange available) or
    ``fsspec`` (through fsspec's local file system). ``pause``: ``random`` (no pause), or
    the step of a replacement where the child prints ``PAUSE`` and sleeps, to be killed
    there: ``before_promote``, ``after_exchange``, ``after_remove``.
``python _crash_child.py incremental <root> <iterations>``
    a training loop (ppe's manager) with ``snapshot(incremental=True, keep=KeepLatest(2), autoload=True)`` and a
    ThreadWriter, a snapshot every iteration: an 8 MiB frozen tensor and a 2 MiB table of which
    ``incremental_rows`` change each iteration (``incremental_state`` gives the state of any iteration). It
    resumes where the snapshots left it; prints each iteration once its snapshot is committed.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

import torch

from ppe_snapshot import Snapshot, StateDict

#: Exit status of a dist child whose take raised.
ERROR_EXIT = 3
#: The loop child stops on its own after this many snapshots (it is meant to be killed long before).
MAX_SNAPSHOTS = 20


def big_state(mib: int) -> dict[str, torch.Tensor | int]:
    """Deterministic state of ``mib`` MiB in four dtypes, marked as snapshot 0."""
    g = torch.Generator().manual_seed(1234)
    n = (mib << 20) // 16  # elements per eighth of the bytes, at 2 bytes each
    state: dict[str, torch.Tensor | int] = {
        "weights": torch.randn(2 * n, generator=g),  # 1/2 of the bytes
        "codes": torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g),  # 1/4
        "halves": torch.randn(n, generator=g).to(torch.bfloat16),  # 1/8
        "moments": torch.randn(n // 4, generator=g, dtype=torch.float64),  # 1/8
    }
    mark(state, 0)
    return state


def mark(state: dict, index: int) -> None:
    """Make ``state`` the state of the loop's snapshot ``index``."""
    state["weights"][:4096] = float(index)
    state["step"] = index


def loop(root: str, mib: int) -> None:
    state = StateDict(big_state(mib))
    for index in range(MAX_SNAPSHOTS):
        mark(state, index)
        path = os.path.join(root, f"s{index}")
        Snapshot.take(path, {"state": state})
        print(path, flush=True)


def process_loop(root: str, mib: int) -> None:
    """``loop`` through a ProcessWriter: its worker process writes; prints ``worker <pid>`` after the first call."""
    from ppe_snapshot.writing import ProcessWriter

    writer = ProcessWriter(out_dir=root)
    state = big_state(mib)
    for index in range(MAX_SNAPSHOTS):
        mark(state, index)
        writer(f"s{index}", root, state)
        if index == 0:
            print(f"worker {writer.worker_pid}", flush=True)
    writer.finalize()


def dist_take(path: str, mib: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = big_state(mib) if rank == 1 else {"step": 0, "small": torch.arange(1000.0)}
    try:
        Snapshot.take(path, {"state": StateDict(state)})
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(ERROR_EXIT)  # the group's peer is dead; do not wait on its teardown
    print("committed", flush=True)
    os._exit(0)


def _pause() -> None:
    print("PAUSE", flush=True)
    time.sleep(60)


def replace_loop(root: str, mib: int, variant: str, pause: str, first: str) -> None:
    from ppe_snapshot.storage import LocalTree
    from ppe_snapshot.writing import SimpleWriter, _replace

    if variant == "rename":
        LocalTree.swap = lambda self, a, b: False
    promote, remove, swap = _replace.Replacement.promote, _replace.Replacement.remove, LocalTree.swap
    if pause == "before_promote":
        _replace.Replacement.promote = lambda self: (_pause(), promote(self))[1]
    elif pause == "after_exchange":
        LocalTree.swap = lambda self, a, b: swap(self, a, b) and (_pause() or True)
    elif pause == "after_remove":
        def remove_then_pause(self, path: str) -> None:
            remove(self, path)
            if path == self.final:
                _pause()
        _replace.Replacement.remove = remove_then_pause
    writer = SimpleWriter(out_dir=root, storage_options={"auto_mkdir": True} if variant == "fsspec" else None)
    state = big_state(mib)
    for index in range(int(first), int(first) + MAX_SNAPSHOTS):
        mark(state, index)
        writer("latest", "", state, metadata={"iteration": index})
        print(index, flush=True)


#: The incremental loop's table: rows of 1 KiB (256 float32), a few changed per iteration.
TABLE_ROWS = 2048


def incremental_rows(iteration: int) -> list[int]:
    """The rows of the table that iteration ``iteration`` sets to ``iteration``."""
    return [(iteration * 37 + k * 97) % TABLE_ROWS for k in range(20)]


def incremental_state(iteration: int) -> dict[str, torch.Tensor]:
    """The incremental loop's model state after iteration ``iteration``."""
    g = torch.Generator().manual_seed(5)
    table = torch.zeros(TABLE_ROWS, 256)
    for i in range(1, iteration + 1):
        table[incremental_rows(i)] = float(i)
    return {"frozen": torch.randn(2 << 20, generator=g), "table": table}


def incremental_loop(root: str, iterations: int) -> None:
    import pytorch_pfn_extras as ppe

    import ppe_snapshot
    from ppe_snapshot.retention import KeepLatest
    from ppe_snapshot.writing import ThreadWriter

    model = torch.nn.Module()
    for name, value in incremental_state(0).items():
        setattr(model, name, torch.nn.Parameter(value, requires_grad=False))
    manager = ppe.training.ExtensionsManager({"main": model}, {}, iterations, iters_per_epoch=1, out_dir=root)
    manager.extend(ppe_snapshot.snapshot(writer=ThreadWriter(), incremental=True, keep=KeepLatest(2), autoload=True),
                   trigger=(1, "iteration"))
    while not manager.stop_trigger:
        with manager.run_iteration():  # the manager counts this iteration once its body ran
            model.table.data[incremental_rows(manager.iteration + 1)] = float(manager.iteration + 1)
        print(manager.iteration, flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, target, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "incremental":
        incremental_loop(target, size)
    elif mode == "replace":
        replace_loop(target, size, *sys.argv[4:])
    else:
        {"loop": loop, "process": process_loop, "dist": dist_take}[mode](target, size)
