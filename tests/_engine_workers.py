"""Functions run by the ``dist_run`` pool workers in tests/test_distributed.py.

They run on every rank of a live gloo process group and return plain values
(tensors included) for the test process to check. Expected values come from
the deterministic builders below, which the test process calls too.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from _asserts import written_as
from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.engine import LOCAL

#: Tensors of the replicated model; 4096 float32 = 16 KiB each, a multiple of the 64-byte alignment.
MODEL_TENSORS = 7
MODEL_NUMEL = 4096


# -- deterministic state --------------------------------------------------------

def per_rank_values(rank: int) -> dict[str, Any]:
    """State that differs per rank (a tensor whose shape also depends on the rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return {
        "weights": torch.randn(5 + rank, 33, generator=g),
        "ids": torch.arange(rank, rank + 50, dtype=torch.int64) * (rank + 3),
        "step": 100 * rank + 7,
        "name": f"rank-{rank}",
    }


def per_rank_target(rank: int) -> StateDict:
    """A restore target shaped like ``per_rank_values(rank)`` holding other values."""
    return StateDict(weights=torch.zeros(5 + rank, 33), ids=torch.zeros(50, dtype=torch.int64), step=-1, name="")


def model_values() -> dict[str, torch.Tensor]:
    """State identical on every rank: ``MODEL_TENSORS`` equal-sized tensors."""
    g = torch.Generator().manual_seed(7)
    return {f"layer{i}": torch.randn(MODEL_NUMEL, generator=g) for i in range(MODEL_TENSORS)}


def model_target() -> StateDict:
    return StateDict({f"layer{i}": torch.full((MODEL_NUMEL,), -1.0) for i in range(MODEL_TENSORS)})


def net() -> nn.Module:
    """The module wrapped in DistributedDataParallel (same initial weights on every rank)."""
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


class Wrapped(nn.Module):
    """A plain module whose state dict keys match a DDP model's (``module.<name>``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def error_of(fn, *args: Any, **kwargs: Any) -> tuple[str, str] | None:
    """``(type name, message)`` of what ``fn`` raised, or None."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # the test checks the exact type by name
        return type(e).__name__, str(e)
    return None


def _restored(snapshot: Snapshot, key: str, target: StateDict) -> dict[str, Any]:
    """Restore ``target`` under ``key``; check tensors were loaded in place."""
    before = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    snapshot.restore({key: target})
    assert all(target[k].data_ptr() == ptr for k, ptr in before.items()), "restore replaced a tensor"
    return dict(target)


# -- per-rank state ---------------------------------------------------------------

def take_and_restore_per_rank(path: str) -> dict[str, Any]:
    rank = dist.get_rank()
    Snapshot.take(path, {"state": StateDict(per_rank_values(rank))})
    snapshot = Snapshot(path)
    return {"restored": _restored(snapshot, "state", per_rank_target(rank)), "keys": sorted(snapshot.get_manifest())}


def restore_per_rank(path: str) -> dict[str, Any]:
    """Restore "state"; a rank the snapshot has no state for reports the error instead."""
    rank = dist.get_rank()
    target = per_rank_target(rank)
    error = error_of(Snapshot(path).restore, {"state": target})
    return {"error": error, "restored": None if error else dict(target)}


# -- replicated state ---------------------------------------------------------------

def take_replicated(path: str, pattern: str) -> None:
    Snapshot.take(path, {"model": StateDict(model_values())}, replicated=[pattern])


def take_and_restore_ddp(path: str) -> dict[str, torch.Tensor]:
    model = DistributedDataParallel(net())
    Snapshot.take(path, {"model": model})
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-3.0)
    Snapshot(path).restore({"model": model})
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def take_mixed(path: str, version: int) -> None:
    """Replicated model (glob ``model/*``), per-rank "state", and "only2" on rank 2 alone, as format ``version``."""
    rank = dist.get_rank()
    app_state = {"model": StateDict(model_values()), "state": StateDict(per_rank_values(rank))}
    if rank == 2:
        app_state["only2"] = StateDict(x=torch.arange(12.0).reshape(3, 4))
    with written_as(version):
        Snapshot.take(path, app_state, replicated=["model/*"])


def restore_mixed(path: str) -> dict[str, Any]:
    rank = dist.get_rank()
    snapshot = Snapshot(path)
    return {
        "model": _restored(snapshot, "model", model_target()),
        "state": _restored(snapshot, "state", per_rank_target(rank)),
        "only2_error": error_of(snapshot.restore, {"only2": StateDict(x=torch.zeros(3, 4))}),
    }


# -- async take and LOCAL --------------------------------------------------------

def async_take_then_mutate(path: str) -> dict[str, Any]:
    rank = dist.get_rank()
    model, state = StateDict(model_values()), StateDict(per_rank_values(rank))
    pending = Snapshot.async_take(path, {"model": model, "state": state}, replicated=["model/**"])
    for t in model.values():
        t.add_(1.0)
    state["weights"].zero_()
    state["ids"].fill_(-9)
    state["step"] = -5
    snapshot = pending.wait()
    assert pending.done()
    return {"model": _restored(snapshot, "model", model_target()),
            "state": _restored(snapshot, "state", per_rank_target(rank))}


def local_take_on_rank1(path: str) -> dict[str, Any]:
    """Rank 1 alone takes with ``pg=LOCAL``; then every rank restores it with ``pg=LOCAL``."""
    rank = dist.get_rank()
    if rank == 1:
        snapshot = Snapshot.take(path, {"state": StateDict(per_rank_values(1))}, pg=LOCAL)
        assert snapshot.pg is LOCAL
    dist.barrier()
    restored = _restored(Snapshot(path, pg=LOCAL), "state", per_rank_target(1))
    dist.barrier()  # nobody leaves (and tears the group down) while another rank still reads
    return restored


# -- failures ----------------------------------------------------------------------

def take_reporting_error(path: str, bad_rank: int | None) -> tuple[str, str] | None:
    """Take per-rank state; on ``bad_rank`` it holds a value that only pickle could store.

    Every rank goes on using the group afterwards, as a training loop that
    logs the error would: a failing rank does not end the others' wait by dying.
    """
    rank = dist.get_rank()
    state = StateDict(per_rank_values(rank))
    if rank == bad_rank:
        state["handle"] = object()
    error = error_of(Snapshot.take, path, {"state": state})
    dist.barrier()
    return error



# -- replicated globs that differ between ranks ----------------------------------------

def take_with_rank_globs(path: str, globs_by_rank: list[list[str]]) -> dict[str, Any]:
    """Replicated "model" and per-rank "extra"; each rank passes its own globs. Restores both."""
    rank = dist.get_rank()
    app_state = {"model": StateDict(model_values()), "extra": StateDict(per_rank_values(rank))}
    Snapshot.take(path, app_state, replicated=globs_by_rank[rank])
    snapshot = Snapshot(path)
    return {"model": _restored(snapshot, "model", model_target()),
            "extra": _restored(snapshot, "extra", per_rank_target(rank))}


def take_uneven_replicated(path: str) -> tuple[str, str] | None:
    """A replicated glob matching different entries on different ranks: rank 0 has x/a and x/b, the others x/a."""
    rank = dist.get_rank()
    state = {"a": torch.arange(1000.0)}
    if rank == 0:
        state["b"] = torch.arange(10.0)
    error = error_of(Snapshot.take, path, {"x": StateDict(state)}, replicated=["x/*"])
    dist.barrier()
    return error


# -- async takes failing on one rank ------------------------------------------------------

class _FailingFile:
    """A file whose writes fail with ENOSPC once ``limit`` bytes were written (after ``delay`` seconds)."""

    def __init__(self, file: Any, limit: int, delay: float) -> None:
        self._file, self._limit, self._delay, self._written = file, limit, delay, 0

    def write(self, data: Any) -> int:
        self._written += memoryview(data).nbytes
        if self._written > self._limit:
            time.sleep(self._delay)  # late: the other ranks have published their parts by then
            raise OSError(28, "No space left on device (injected)")
        return self._file.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _failing_fs_class():
    from fsspec.implementations.local import LocalFileSystem

    class FailingWriteFileSystem(LocalFileSystem):
        """The local file system, except that writes to files named ``fail_name`` fail after ``limit`` bytes."""
        protocol = "failingwrite"

        def __init__(self, fail_name: str = "", limit: int = 0, delay: float = 0.0, **kwargs: Any) -> None:
            super().__init__(auto_mkdir=True, **kwargs)
            self.fail_name, self.limit, self.delay = fail_name, limit, delay

        @classmethod
        def _strip_protocol(cls, path):
            if isinstance(path, str) and path.startswith("failingwrite://"):
                path = path[len("failingwrite://"):]
            return super()._strip_protocol(path)

        def _open(self, path, mode="rb", **kwargs):
            file = super()._open(path, mode, **kwargs)
            if "w" in mode and self.fail_name and path.endswith(self.fail_name):
                return _FailingFile(file, self.limit, self.delay)
            return file

    return FailingWriteFileSystem


def _fail_staging(size: int) -> torch.Tensor:
    raise MemoryError(f"cannot stage {size} bytes (injected)")


#: When the failing rank of a round fails: at its data file's open (a directory is in the way), at staging,
#: at its write (ENOSPC, the file open), or late in its write (after the others published their parts).
FAILURE_MOMENTS = ("open", "stage", "write", "late")


def failure_of_round(i: int, world: int) -> tuple[int, str]:
    """(failing rank, moment) of round ``i``: every rank fails at every moment over ``4 * world`` rounds."""
    return i % world, FAILURE_MOMENTS[i // world % len(FAILURE_MOMENTS)]


def async_take_failing_rounds(base: str, rounds: int) -> list[tuple[str, str] | None]:
    """``rounds`` async takes of replicated and per-rank state; in each, one rank fails (``failure_of_round``).

    Every rank reports the error its ``async_take`` / ``wait()`` raised; a wait that would hang raises
    TimeoutError.
    """
    import fsspec

    fsspec.register_implementation("failingwrite", _failing_fs_class(), clobber=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = []
    for i in range(rounds):
        bad, moment = failure_of_round(i, world)
        path, options, staging = f"{base}/round{i}", None, None
        if rank == bad and moment == "open":
            os.makedirs(f"{path}/data/rank{rank}.bin")
        if rank == bad and moment == "stage":
            staging = _fail_staging
        if moment in ("write", "late"):
            options = {"fail_name": f"data/rank{bad}.bin", "limit": 0, "delay": 0.5 if moment == "late" else 0}
            path = f"failingwrite://{path}"
        app_state = {"model": StateDict(model_values()), "state": StateDict(per_rank_values(rank))}
        try:
            pending = Snapshot.async_take(path, app_state, replicated=["model/**"], storage_options=options,
                                          staging=staging)
        except Exception as e:  # the staging failure is raised by async_take itself
            errors.append((type(e).__name__, str(e)))
        else:
            errors.append(error_of(pending.wait, timeout=60))
        dist.barrier()
    return errors
