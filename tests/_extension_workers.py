"""Training loops for the snapshot extension's tests.

Used in-process by tests/test_extension.py, by the dist_run pool in
tests/test_extension_distributed.py, and as a script that a test kills:

``python _extension_workers.py <out_dir> <iterations> <kill_at> <writer>``
    trains with ``snapshot(autoload=True)`` every 2 iterations and kills
    itself with SIGKILL in the middle of iteration ``<kill_at> + 1``.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytorch_pfn_extras as ppe
import torch
import torch.distributed as dist
import torch.nn.functional as F
from pytorch_pfn_extras.training import extensions

import ppe_snapshot

from _asserts import assert_same  # noqa: F401 - re-exported for the extension tests
from ppe_snapshot import writing
from ppe_snapshot.engine._ranks import TakeChannel

WRITERS = ("SimpleWriter", "ThreadWriter", "ProcessWriter", "ThreadQueueWriter", "ProcessQueueWriter")


class Crash(Exception):
    """Raised inside the training loop to stand for a failure."""


class Net(torch.nn.Module):
    """Small, with dropout: its training draws from the global RNG."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, width)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def batch(iteration: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one iteration: a function of the position alone, so a resumed run sees the same."""
    g = torch.Generator().manual_seed(10_000 * rank + iteration)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


class Run:
    """A model, its optimizer and scheduler, and an ExtensionsManager with LogReport, LRScheduler and a snapshot."""

    def __init__(self, out_dir: str, iterations: int, snapshot_kwargs: dict[str, Any] | None = None, *,
                 trigger: tuple[int, str] = (2, "iteration"), seed: int = 0, iters_per_epoch: int = 4,
                 target: str = "manager", sync: bool = True, state_objects: dict[str, Any] | None = None,
                 rng_in_state: bool = True) -> None:
        torch.manual_seed(seed)
        self.model = Net()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        self.rng = ppe_snapshot.RNGState()
        self.sync = sync
        self.manager = ppe.training.ExtensionsManager(
            self.model, self.optimizer, 1000, iters_per_epoch=iters_per_epoch, out_dir=out_dir,
            stop_trigger=(iterations, "iteration"),
            state_objects={**({"rng": self.rng} if rng_in_state else {}), **(state_objects or {})})
        self.log_report = extensions.LogReport(trigger=(1, "iteration"))
        self.manager.extend(self.log_report)
        self.manager.extend(extensions.LRScheduler(self.scheduler, trigger=(1, "iteration")))
        self.snapshot = None
        if snapshot_kwargs is not None:
            kwargs = dict(snapshot_kwargs)
            if target == "dict":
                kwargs["target"] = {"model": self.model, "optimizer": self.optimizer, "rng": self.rng}
            elif target == "model":
                kwargs["target"] = self.model
            self.snapshot = ppe_snapshot.snapshot(**kwargs)
            self.manager.extend(self.snapshot, trigger=trigger)

    def train(self, crash_at: int | None = None, kill_at: int | None = None, rank: int = 0) -> None:
        """Train until the stop trigger; raise :class:`Crash` (or SIGKILL) in the iteration after ``*_at``."""
        manager = self.manager
        while not manager.stop_trigger:
            with manager.run_iteration(step_optimizers=["main"]):
                done = manager.iteration
                if done == crash_at:
                    raise Crash(f"crash after {done} iterations")
                x, y = batch(done, rank)
                loss = F.mse_loss(self.model(x), y)
                if done == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward()
                if self.sync and dist.is_initialized() and dist.get_world_size() > 1:
                    for p in self.model.parameters():
                        dist.all_reduce(p.grad)
                ppe.reporting.report({"loss": loss.item()})

    def state(self) -> dict[str, Any]:
        """Everything a resumed run must reproduce exactly."""
        # Not training state: timings, and the snapshot stats (a resumed process reports its own saves only).
        log = [{k: v for k, v in entry.items() if k != "elapsed_time" and not k.startswith("snapshot/")}
               for entry in self.log_report.log]
        return {"iteration": self.manager.iteration, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "log": log, "rng": torch.get_rng_state()}


def make_writer(name: str, **kwargs: Any) -> Any:
    return getattr(writing, name)(**kwargs)




class CollectiveState:
    """State whose state_dict() is a collective: it hangs unless every rank calls it."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        total = torch.tensor([self.calls])
        dist.all_reduce(total)
        return {"calls_on_all_ranks": total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# -- functions run on every rank by dist_run ---------------------------------------------------------------


def dist_saver_rank_out_of_range() -> str:
    try:
        ppe_snapshot.snapshot(saver_rank=dist.get_world_size())
    except ValueError as e:
        return str(e)
    return "no error"


def _snapshot_kwargs(mode: str, **extra: Any) -> dict[str, Any]:
    kwargs = {"snapshot_mode": getattr(ppe_snapshot.SnapshotMode, mode), **extra}
    if mode == "DISTRIBUTED":
        kwargs["saver_rank"] = dist.get_world_size() - 1
    return kwargs


def snapshot_names(out_dir: str) -> list[str]:
    """``snapshot_iter_<n>`` names under ``out_dir``, by n."""
    found = [n for n in os.listdir(out_dir) if n.startswith("snapshot_iter_") and n[14:].isdigit()]
    return sorted(found, key=lambda n: int(n[14:]))


def flip_byte(path: str, offset: int = 100) -> None:
    """Damage a file without changing its size: only checksums can tell."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def dist_crash_and_resume(out_dir: str, mode: str, iterations: int, crash_at: int,
                          flip: str | None = None, own_rng: bool = False, incremental: bool = False,
                          recorded: int | None = None) -> dict[str, Any]:
    """A straight run, a run that crashes (on every rank), and a resumed run; what each rank saw.

    DISTRIBUTED: the model is replicated (gradients all-reduced), the last rank saves.
    SHARDED: every rank trains its own model and saves its part of one snapshot.
    ``flip``: a file of the newest snapshot, relative to it, whose bytes rank 0 damages before resuming.
    ``own_rng``: no RNGState in the manager; each rank draws from its own seed, and only the
    extension's own RNG capture can bring each rank's generators back. ``incremental``: incremental snapshots,
    with a frozen table (256 KiB, most of the state) that later snapshots reference. ``recorded``: the iteration
    rank 0 makes the newest snapshot's manifest record before resuming.
    """
    rank, sharded = dist.get_rank(), mode == "SHARDED"
    straight = Run(os.path.join(out_dir, f"straight{rank}"), iterations, None, seed=rank if sharded else 0,
                   sync=not sharded, rng_in_state=not own_rng)
    if own_rng:
        torch.manual_seed(1000 + rank)
    straight.train(rank=rank)
    collective = CollectiveState()
    logs = os.path.join(out_dir, f"logs{rank}")  # each rank's LogReport writes its own
    kwargs = _snapshot_kwargs(mode, writer=make_writer("ThreadWriter", out_dir=out_dir), autoload=True, n_retains=2,
                              incremental=incremental)
    frozen = {"frozen": ppe_snapshot.StateDict(table=torch.arange(1 << 16, dtype=torch.float32))} if incremental else {}
    first = Run(logs, iterations, kwargs, seed=rank if sharded else 0, sync=not sharded,
                state_objects={"collective": collective, **frozen}, rng_in_state=not own_rng)
    if own_rng:
        torch.manual_seed(1000 + rank)
    try:
        first.train(crash_at=crash_at, rank=rank)
    except Crash:
        pass
    first.snapshot.writer.finalize()
    calls = collective.calls
    dist.barrier()
    names = [n for n in snapshot_names(out_dir) if os.path.exists(os.path.join(out_dir, n, "manifest.json"))]
    newest = os.path.join(out_dir, names[-1])
    saved_ranks = sorted({int(key.split("/")[0]) for key in ppe_snapshot.Snapshot(newest).get_manifest()})
    if flip is not None and rank == 0:
        flip_byte(os.path.join(newest, flip))
    if recorded is not None and rank == 0:
        with open(os.path.join(newest, "manifest.json")) as f:
            doc = json.load(f)
        doc["metadata"]["iteration"] = recorded
        with open(os.path.join(newest, "manifest.tmp"), "w") as f:
            json.dump(doc, f)
        os.replace(os.path.join(newest, "manifest.tmp"), os.path.join(newest, "manifest.json"))  # (rank 1 reads it)
    dist.barrier()

    kwargs["writer"] = make_writer("ThreadWriter", out_dir=out_dir)
    resumed = Run(logs, iterations, kwargs, seed=100 + rank, sync=not sharded,
                  state_objects={"collective": CollectiveState(), **frozen}, rng_in_state=not own_rng)
    resumed.manager.start_extensions()
    resumed_at = resumed.manager.iteration
    resumed.train(rank=rank)
    resumed.snapshot.writer.finalize()
    dist.barrier()
    at_end = snapshot_names(out_dir)
    return {"straight": straight.state(), "resumed": resumed.state(), "resumed_at": resumed_at,
            "resumed_from": resumed.snapshot.resumed_from, "names_at_crash": names,
            "names_at_end": [n for n in at_end if os.path.exists(os.path.join(out_dir, n, "manifest.json"))],
            "saved_ranks": saved_ranks, "state_dict_calls": calls,
            "references": ppe_snapshot.Snapshot(os.path.join(out_dir, at_end[-1])).references}


def dist_error_on_one_rank(out_dir: str, mode: str, failing_rank: int) -> dict[str, Any]:
    """``failing_rank`` raises after 5 iterations; the others stop there normally and must not hang."""
    rank = dist.get_rank()
    logs = os.path.join(out_dir, f"logs{rank}")  # each rank's LogReport writes its own
    kwargs = _snapshot_kwargs(mode, writer=make_writer("ThreadWriter", out_dir=out_dir), snapshot_on_error=True)
    run = Run(logs, 10 if rank == failing_rank else 5, kwargs, trigger=(4, "iteration"),
              seed=rank if mode == "SHARDED" else 0, sync=False)
    raised = None
    try:
        run.train(crash_at=5 if rank == failing_rank else None, rank=rank)
    except Crash as e:
        raised = str(e)
    run.snapshot.writer.finalize()
    model = {k: v.clone() for k, v in run.model.state_dict().items()}
    dist.barrier()
    listing = sorted(os.listdir(out_dir))
    kwargs = _snapshot_kwargs(mode, writer=make_writer("SimpleWriter", out_dir=out_dir), autoload=True)
    resumed = Run(logs, 10, kwargs, trigger=(4, "iteration"), seed=50, sync=False)
    resumed.manager.start_extensions()
    return {"raised": raised, "model": model, "listing": listing, "resumed_at": resumed.manager.iteration}


def _main(out_dir: str, iterations: str, kill_at: str, writer: str) -> None:
    run = Run(out_dir, int(iterations), {"writer": make_writer(writer), "autoload": True})
    run.train(kill_at=int(kill_at))


if __name__ == "__main__":
    _main(*sys.argv[1:])


def dist_resume_from_error_snapshot(out_dir: str, iterations: int, crash_at: int) -> dict[str, Any]:
    """DISTRIBUTED, ranks seeded alike, no RNGState in the target: the only snapshot is the one taken on
    error, which holds the saver's RNG state alone; every rank must continue exactly from it."""
    rank = dist.get_rank()
    straight = Run(os.path.join(out_dir, f"straight{rank}"), iterations, None, rng_in_state=False)
    torch.manual_seed(7)
    straight.train(rank=rank)

    def run(seed: int) -> Run:
        kwargs = _snapshot_kwargs("DISTRIBUTED", writer=make_writer("SimpleWriter", out_dir=out_dir),
                                  autoload=True, snapshot_on_error=True)
        return Run(os.path.join(out_dir, f"logs{rank}"), iterations, kwargs, trigger=(1000, "iteration"),
                   seed=seed, rng_in_state=False)

    first = run(0)
    torch.manual_seed(7)
    try:
        first.train(crash_at=crash_at, rank=rank)
    except Crash:
        pass
    dist.barrier()
    names = snapshot_names(out_dir)
    resumed = run(100 + rank)
    torch.manual_seed(1234 + rank)  # whatever the generators hold now, the snapshot must override it
    resumed.train(rank=rank)
    return {"straight": straight.state(), "resumed": resumed.state(), "names": names,
            "resumed_from": resumed.snapshot.resumed_from}


@contextlib.contextmanager
def _verdicts_late(seconds: float) -> Iterator[None]:
    """This process learns of each take's verdict ``seconds`` after it arrived (a busy rank, a slow link)."""
    original = TakeChannel.verdict

    def late(channel: TakeChannel, *args: Any, **kwargs: Any) -> Any:
        verdict = original(channel, *args, **kwargs)
        time.sleep(seconds)
        return verdict

    TakeChannel.verdict = late  # type: ignore[method-assign]
    try:
        yield
    finally:
        TakeChannel.verdict = original  # type: ignore[method-assign]


def dist_fixed_name_and_initialize(out_dir: str, mode: str, writer: str, late_rank: int | None = None
                                   ) -> dict[str, Any]:
    """Save ``latest`` at every iteration (replaced each time) on every rank, then resume; what each rank saw.
    ``late_rank`` learns of each take's verdict 0.3 s late (rank 0 has moved the take to its name by then)."""
    rank, sharded = dist.get_rank(), mode == "SHARDED"
    logs = os.path.join(out_dir, f"logs{rank}")
    kwargs = _snapshot_kwargs(mode, writer=make_writer(writer, out_dir=out_dir), filename="latest")
    first = Run(logs, 5, kwargs, trigger=(1, "iteration"), seed=rank if sharded else 0, sync=not sharded)
    with _verdicts_late(0.3 if rank == late_rank else 0.0):
        first.train(rank=rank)  # the manager finalizes the extension at the end
    model = {k: v.clone() for k, v in first.model.state_dict().items()}
    dist.barrier()
    listing = sorted(n for n in os.listdir(out_dir) if not n.startswith("logs"))
    kept = sorted(os.listdir(os.path.join(out_dir, "latest")))
    kwargs = _snapshot_kwargs(mode, writer=make_writer("SimpleWriter", out_dir=out_dir), filename="latest",
                              autoload=True)
    resumed = Run(logs, 5, kwargs, seed=100 + rank, sync=not sharded)
    loaded = resumed.snapshot.initialize(resumed.manager)
    return {"listing": listing, "kept": kept, "loaded": loaded, "resumed_from": resumed.snapshot.resumed_from,
            "iteration": resumed.manager.iteration, "model": model, "resumed_model": resumed.model.state_dict()}


def dist_replace_latest(url: str, storage_options: dict[str, Any], writer: str, late_rank: int) -> None:
    """Three SHARDED saves of each rank's own tensor (``10 * step + rank``) to ``url/latest``, each replacing the
    one before; ``late_rank`` learns of each take's verdict 0.3 s late."""
    rank = dist.get_rank()
    saver = make_writer(writer, out_dir=url, storage_options=storage_options)
    with _verdicts_late(0.3 if rank == late_rank else 0.0):
        for step in range(3):
            saver("latest", url, {"t": torch.full((4,), 10.0 * step + rank)}, metadata={"iteration": step}, pg=None)
            saver.wait()
    saver.finalize()


class _PreparingWriter(writing.ThreadWriter):
    """A ThreadWriter that records the tensor bytes of each state it is asked to prepare staging for."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prepared: list[int] = []

    def prepare_staging(self, target: Any) -> None:
        leaves = torch.utils._pytree.tree_leaves(target)
        self.prepared.append(sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)))
        super().prepare_staging(target)


def dist_staging_ahead(out_dir: str, mode: str) -> dict[str, Any]:
    """Three iterations of a Linear(512, 256) with Adam, saved at the 2nd with a ThreadWriter: what the writer was
    asked to prepare staging for, the size of its staging buffer and the bytes its save staged."""
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Linear(512, 256)
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=3, out_dir=out_dir)
    writer = _PreparingWriter(out_dir=out_dir)
    manager.extend(ppe_snapshot.snapshot(writer=writer, **_snapshot_kwargs(mode)), trigger=(2, "iteration"))
    x = torch.randn(4, 512)
    for _ in range(3):
        with manager.run_iteration():
            model(x).sum().backward()
            optimizer.step()
    writer.wait()
    buffer = writer.staging_buffers[0] if writer.staging_buffers else None
    staged = writer.last_stats["bytes"] if writer.last_stats else None
    writer.finalize()
    return {"prepared": writer.prepared, "buffer": None if buffer is None else buffer.numel(), "staged": staged}


def _rank_files_run(out_dir: str, iterations: int, crash_at: int | None, by: str, manager_writer: str | None,
                    savefun: Any = torch.save, mode: str = "SHARDED") -> dict[str, Any]:
    """SHARDED (or ``mode``) with a ``savefun`` (ppe's per-rank files), by our extension or ppe's (``by``): each rank
    its own model (momentum: optimizer state), snapshots every 2 iterations, autoload; Crash after ``crash_at``."""
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    writer = make_writer(manager_writer, out_dir=out_dir) if manager_writer else ppe.writing.SimpleWriter(out_dir=out_dir)
    manager = ppe.training.ExtensionsManager(model, optimizer, 100, iters_per_epoch=3, out_dir=out_dir,
                                             stop_trigger=(iterations, "iteration"), writer=writer)
    make = ppe_snapshot.snapshot if by == "ours" else extensions.snapshot
    manager.extend(make(savefun=savefun, snapshot_mode=getattr(ppe_snapshot.SnapshotMode, mode), saver_rank=0,
                        autoload=True, n_retains=2), trigger=(2, "iteration"))
    with contextlib.redirect_stdout(sys.stderr):  # ppe's SHARDED autoload prints the path it checks
        manager.start_extensions()
    resumed_at = manager.iteration
    # ppe's autoload has every rank list alone: no rank saves before all have resumed, or a slow one resumes from it
    dist.barrier()
    while not manager.stop_trigger:
        with manager.run_iteration():
            if manager.iteration == crash_at:
                raise Crash(f"crash after {crash_at} iterations")
            model(torch.full((2, 4), float(manager.iteration + rank))).pow(2).sum().backward()
    writer.finalize()
    return {"resumed_at": resumed_at, "model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _tree(out_dir: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, f), out_dir) for root, _, files in os.walk(out_dir) for f in files)


def dist_rank_files(out_dir: str, first: str, second: str, manager_writer: str | None,
                    damage: str | None = None, mode: str = "SHARDED") -> dict[str, Any]:
    """A straight run of 8 iterations, a run by ``first`` that crashes after 5, and one by ``second`` resuming;
    ``damage`` (rank 0, before resuming): "unmarked" takes the newest snapshot's mark off, "ranks" adds a third
    rank's file to it."""
    rank = dist.get_rank()
    straight = _rank_files_run(os.path.join(out_dir, f"straight{rank}"), 8, None, "ours", manager_writer, mode=mode)
    shared = os.path.join(out_dir, "run")
    try:
        _rank_files_run(shared, 8, 5, first, manager_writer, mode=mode)
    except Crash:
        pass
    dist.barrier()
    at_crash = _tree(shared)
    if rank == 0 and damage == "unmarked":
        os.remove(os.path.join(shared, "snapshot_iter_4", "complete"))
    if rank == 0 and damage == "ranks":
        with open(os.path.join(shared, "snapshot_iter_4", "2"), "wb") as f:
            torch.save({}, f)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ppe_snapshot.AutoloadSkipWarning)
        resumed = _rank_files_run(shared, 8, None, second, manager_writer, mode=mode)
    dist.barrier()
    return {"straight": straight, "resumed": resumed, "at_crash": at_crash, "at_end": _tree(shared),
            "skipped": [str(w.message) for w in caught if issubclass(w.category, ppe_snapshot.AutoloadSkipWarning)]}


def save_failing_on_rank_1(obj: Any, f: Any) -> None:
    """A savefun that fails on rank 1 only (module level: importable where the save runs)."""
    if dist.get_rank() == 1:
        raise KeyError("rank 1's disk is gone")
    torch.save(obj, f)


def dist_rank_file_failing(out_dir: str) -> dict[str, Any]:
    """SHARDED with a savefun that fails on rank 1 at the first snapshot: what each rank raised, what is left."""
    raised = None
    try:
        _rank_files_run(out_dir, 4, None, "ours", None, savefun=save_failing_on_rank_1)
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        raised = f"{type(e).__name__}: {e}"
    dist.barrier()
    return {"raised": raised, "left": _tree(out_dir)}


def dist_default_names() -> list[tuple[str, str]]:
    """(ours, ppe's) ``default_name`` of the DISTRIBUTED and SHARDED extensions, and of a subclass of ours."""
    names = []
    for mode in ("DISTRIBUTED", "SHARDED"):
        kwargs = {"snapshot_mode": getattr(ppe_snapshot.SnapshotMode, mode), "saver_rank": 0}
        names.append((ppe_snapshot.snapshot(**kwargs).default_name, extensions.snapshot(**kwargs).default_name))

    class Mine(ppe_snapshot.extension.ShardedSnapshot):
        pass
    names.append((Mine(saver_rank=0).default_name, "Mine"))
    return names
