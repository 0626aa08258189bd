"""One rank of a multi-rank save in which one rank dies (SIGKILL) or its storage fails: run as a script.

``python tests/_rank_kill.py RANK WORLD PORT SPEC_JSON`` joins a gloo group on 127.0.0.1:PORT and saves
``spec["saves"]`` times with ``spec["kind"]`` (``take``, ``async_take``, ``simple``, ``thread``, ``process``,
``distributed``: the snapshot extension in DISTRIBUTED mode with the writer ``spec["writer"]``, or ``dcp``:
torch.distributed.checkpoint's own save, for comparison), each save to ``<dir>/save<i>`` (``distributed``:
``save<i + 1>``, the iteration). It writes
``<dir>/rank<r>.json``: per save its start and end times, and the exception that ended it (type, message, time).

The victim (``spec["victim"]``) kills itself with SIGKILL, recording the time in ``<dir>/killed.json`` first:
``spec["when"]`` = ``"delay"`` kills ``spec["delay"]`` seconds into save ``spec["save"]`` (scaled by the second
save's duration when ``spec["scaled"]``; at the latest when that save returns); ``"before_save"`` just before
that save starts; ``"after_manifest"`` kills rank 0 just after it wrote the manifest of that save;
``"during_write"`` kills it from its storage (``tests/_failing_fs.py``) ``spec["delay"]`` seconds into the first
write into ``save<spec["save"]>``.
``spec["failing_rank"]`` gets a storage whose every write raises ``OSError`` (an fsspec file system);
``spec["slow_rank"]`` one that sleeps ``spec["slow_s"]`` per data write of a multi-rank take,
``spec["slow_write_rank"]`` one (an fsspec file system) that sleeps that long per data file written.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _failing_fs  # noqa: E402

KINDS = ("take", "async_take", "simple", "thread", "process")  # and "distributed", "dcp"


def _die(out: str, rank: int, how: str) -> None:
    with open(os.path.join(out, "killed.json"), "w") as f:
        json.dump({"rank": rank, "time": time.time(), "how": how}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def _slow_storage(seconds: float) -> None:
    """This process's storage sleeps ``seconds`` before every data write call (a slow disk or link)."""
    from ppe_snapshot.engine._take import take_end

    inner_write = take_end._WatchedWriter.write

    def write(self, buffers):
        time.sleep(seconds)
        inner_write(self, buffers)

    take_end._WatchedWriter.write = write


def _kill_after_manifest(out: str, rank: int, save: int, counter: list[int]) -> None:
    from ppe_snapshot.engine import _versions as versions  # the face take_end calls through

    merge = versions.merge_and_commit

    def merge_then_die(*args, **kwargs):
        parts = merge(*args, **kwargs)
        if counter[0] == save:
            _die(out, rank, "after_manifest")
        return parts

    versions.merge_and_commit = merge_then_die


def _distributed_saver(spec: dict, storage_options: dict | None):
    """Each save is one iteration of a ppe manager whose DISTRIBUTED snapshot extension (rank 0 writes, with
    ``spec["writer"]``, a ThreadWriter by default) saves ``<dir>/save<iteration>`` (iterations count from 1) at
    every iteration; the manager stops (and finalizes the extension) at the end of the last save."""
    import pytorch_pfn_extras as ppe

    import ppe_snapshot
    from ppe_snapshot import writing

    manager = None
    writer = getattr(writing, spec.get("writer", "ThreadWriter"))(storage_options=storage_options)

    def save(path, state):
        nonlocal manager
        if manager is None:
            model = torch.nn.Module()
            model.w = torch.nn.Parameter(state["m"].state_dict()["w"])
            manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 100,
                                                     iters_per_epoch=1000, out_dir=os.path.dirname(path),
                                                     stop_trigger=(spec["saves"], "iteration"))
            manager.extend(ppe_snapshot.snapshot(writer=writer, filename="save{.iteration}",
                                                 snapshot_mode=ppe_snapshot.SnapshotMode.DISTRIBUTED, saver_rank=0),
                           trigger=(1, "iteration"))
        with manager.run_iteration():
            pass
    return save, writer.wait


def _saver(kind: str, spec: dict, storage_options: dict | None):
    """A function ``save(path, state)`` that returns when the save is handed off, and ``finish()``."""
    from ppe_snapshot import Snapshot, writing

    if kind == "take":
        return lambda path, state: Snapshot.take(path, state, storage_options=storage_options), lambda: None
    if kind == "async_take":
        pending: list = []

        def save(path, state):
            pending[:] = [Snapshot.async_take(path, state, storage_options=storage_options)]
            pending[0].wait()  # an async take's error is raised by wait()
        return save, lambda: None
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp
        return (lambda path, state: dcp.save({f"w{dist.get_rank()}": state["m"].state_dict()["w"]}, checkpoint_id=path),
                lambda: None)
    if kind == "distributed":
        return _distributed_saver(spec, storage_options)
    cls = {"simple": writing.SimpleWriter, "thread": writing.ThreadWriter, "process": writing.ProcessWriter}[kind]
    writer = cls(storage_options=storage_options)

    def save(path, state):
        writer(os.path.basename(path), os.path.dirname(path), state["m"].state_dict(), pg=None)
    return save, writer.wait


def main(rank: int, world_size: int, port: int, spec: dict) -> None:
    out = spec["dir"]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=spec.get("pg_timeout", 120)))
    from ppe_snapshot import StateDict

    storage_options = None
    if spec.get("failing_rank") == rank:
        _failing_fs.register(_failing_fs.FailingFileSystem)
    if spec.get("failing_rank") is not None or spec.get("when") == "during_write":
        storage_options = {"auto_mkdir": True}  # every rank through fsspec's local file system
    if spec.get("slow_write_rank") == rank:
        _failing_fs.register(_failing_fs.SlowFileSystem)
        storage_options = {"auto_mkdir": True, "slow_s": spec["slow_s"]}
    if spec.get("victim") == rank and spec.get("when") == "during_write":
        _failing_fs.register(_failing_fs.KillingFileSystem)
        storage_options.update(kill_pid=os.getpid(), record=os.path.join(out, "killed.json"), rank=rank,
                               marker=f"/save{spec['save']}/", delay_s=spec.get("delay", 0.0))
    if spec.get("slow_rank") == rank:
        _slow_storage(spec["slow_s"])
    counter = [-1]
    victim = spec.get("victim")
    if victim == rank and spec.get("when") == "after_manifest":
        _kill_after_manifest(out, rank, spec["save"], counter)
    generator = torch.Generator().manual_seed(rank)
    state = {"m": StateDict(w=torch.randn(spec["mib"] << 18, generator=generator))}
    save, finish = _saver(spec["kind"], spec, storage_options)
    record: dict = {"rank": rank, "pid": os.getpid(), "saves": []}
    steady = None
    try:
        for i in range(spec["saves"]):
            counter[0] = i
            entry = {"start": time.time()}
            record["saves"].append(entry)
            timer = None
            if victim == rank and spec.get("when") == "before_save" and i == spec["save"]:
                _die(out, rank, "before_save")
            if victim == rank and spec.get("when") == "delay" and i == spec["save"]:
                delay = spec["delay"] * (steady if spec.get("scaled") and steady else 1.0)
                timer = threading.Timer(delay, _die, args=(out, rank, "delay"))
                timer.start()
            save(f"{out}/save{i}", state)
            if i == 1:  # the first save starts a writer's worker: the second one is the steady duration
                finish()
                steady = time.time() - entry["start"]
            entry["end"] = time.time()
            if timer is not None:  # the save returned first: die now, at its end
                timer.cancel()
                _die(out, rank, "end of save")
        finish()
    except BaseException as e:  # noqa: BLE001 - recorded for the test
        record["error"] = {"type": type(e).__name__, "message": str(e)[:4000], "time": time.time(),
                           "classes": [c.__name__ for c in type(e).__mro__]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    os._exit(0)  # no teardown: a peer may be dead, and the group's destructor would wait for it


def run_trial(spec: dict, world_size: int = 3, timeout: float = 120.0) -> dict:
    """Run one trial (``world_size`` fresh processes) and return what each rank and the victim recorded:
    ``{"ranks": {rank: record or None}, "killed": {...} or None, "returncodes": [...]}``."""
    import subprocess

    import _warm
    from _dist import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [_warm.popen([sys.executable, os.path.abspath(__file__), str(r), str(world_size), str(port),
                          json.dumps(spec)], env=env) for r in range(world_size)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    result: dict = {"ranks": {}, "killed": None, "returncodes": [p.returncode for p in procs]}
    for r in range(world_size):
        path = os.path.join(spec["dir"], f"rank{r}.json")
        result["ranks"][r] = json.load(open(path)) if os.path.exists(path) else None
    killed = os.path.join(spec["dir"], "killed.json")
    result["killed"] = json.load(open(killed)) if os.path.exists(killed) else None
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
