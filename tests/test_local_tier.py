"""The local tier (``snapshot(..., local=LocalTier(...))``) with real processes, real SIGKILL and real gloo groups.

Ranks simulate nodes (``PPE_SNAPSHOT_NODE``, one local directory per node: ``tests/_local_tier_child.py``) and train
a small model whose gradients are all-reduced every iteration; durable snapshots every 8 iterations, local steps
every 2. A run is killed (a rank, a node, a rank in the middle of a partner copy), restarted whole with autoload,
and must end bit-exact with an uninterrupted run; a tier that fails (a full tmpfs, a damaged part) costs the tier
only.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import _warm
from _dist import free_port

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_local_tier_child.py")
ITERATIONS, DURABLE, LOCAL = 20, 8, 2


def run_ranks(spec: dict, world: int, per_node: int = 1, wrap=lambda rank: [],
              timeout: float = 120.0) -> list[tuple[int, str]]:
    """Each rank's exit status and output (``wrap(rank)``: a command the rank's process runs under). Once a rank
    died by SIGKILL the others are killed half a second later, as a launcher tears a job down; every process is
    gone when it returns."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, PPE_SNAPSHOT_NODE=str(rank // per_node), OMP_NUM_THREADS="1",
                   GLOO_SOCKET_IFNAME="lo")
        command = [*wrap(rank), sys.executable, CHILD, str(rank), str(world), str(port), json.dumps(spec)]
        # warm: forked from a zygote that imported torch once (a command under a wrapper starts as it is)
        procs.append(_warm.popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs: dict[int, list[str]] = {rank: [] for rank in range(world)}
    readers = [threading.Thread(target=lambda p=p, r=r: outputs[r].append(p.stdout.read()), daemon=True)
               for r, p in enumerate(procs)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while None in [p.poll() for p in procs] and time.monotonic() < deadline:
        if any(p.returncode == -signal.SIGKILL for p in procs):  # as a launcher does: the job is torn down
            time.sleep(0.5)
            break
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    for reader in readers:
        reader.join()
    return [(proc.returncode, "".join(outputs[rank])) for rank, proc in enumerate(procs)]


def ends(directory, world: int) -> list[dict]:
    return [torch.load(os.path.join(directory, f"result-rank{r}.pt"), weights_only=True) for r in range(world)]


def assert_same_end(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for rank, (a, b) in enumerate(zip(got, want)):
        assert a["iteration"] == b["iteration"] == ITERATIONS
        for name, tensor in b["model"].items():
            assert torch.equal(a["model"][name], tensor), (rank, name)
        for key, state in b["optimizer"]["state"].items():
            assert torch.equal(a["optimizer"]["state"][key]["momentum_buffer"], state["momentum_buffer"]), rank


def spec_for(directory, mode: str, writer: str = "thread", **more) -> dict:
    return {"dir": str(directory), "mode": mode, "writer": writer, "iterations": ITERATIONS, "durable": DURABLE,
            "local": LOCAL, **more}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A mode's end at a world size without any failure (a run of its own, the local tier on)."""
    known: dict[tuple[str, int], list[dict]] = {}

    def end(mode: str, world: int, per_node: int = 1) -> list[dict]:
        if (mode, world) not in known:
            directory = tmp_path_factory.mktemp(f"whole-{mode}-{world}")
            statuses = run_ranks(spec_for(directory, mode), world, per_node)
            assert [s for s, _ in statuses] == [0] * world, statuses
            known[mode, world] = ends(directory, world)
        return known[mode, world]
    return end


def kill_and_resume(directory, spec: dict, world: int, per_node: int = 1, wipe=(), between=lambda: None,
                    wrap=lambda rank: []) -> list[tuple[int, str]]:
    """Run with ``spec``'s kills; the victims died by SIGKILL. Wipe the local directories of nodes ``wipe``, call
    ``between()``, run again without kills: every rank ends normally. Returns the second run's statuses."""
    first = run_ranks(spec, world, per_node, wrap)
    for rank in victims_of(spec):
        assert first[rank][0] == -9, first[rank][1][-3000:]
    for node in wipe:
        shutil.rmtree(os.path.join(directory, f"node{node}"))
    between()
    again = run_ranks({k: v for k, v in spec.items() if k not in KILLS}, world, per_node, wrap)
    assert [s for s, _ in again] == [0] * world, [out[-3000:] for _, out in again]
    return again


#: The spec keys that kill ranks (see tests/_local_tier_child.py).
KILLS = ("kill", "kill_after", "kill_in_copy")


def victims_of(spec: dict) -> set[int]:
    """The ranks ``spec`` kills."""
    return {int(r) for key in ("kill", "kill_after") for r in spec.get(key, {})} | \
        ({spec["kill_in_copy"][0]} if "kill_in_copy" in spec else set())


def resumed(directory, world: int) -> list[str | None]:
    return [end["resumed_from"] for end in ends(directory, world)]


def part(directory, step: int, rank: int, per_node: int = 1) -> str:
    return str(directory / f"node{rank // per_node}" / f"step_{step}" / f"rank{rank}")


def test_one_process_resumes_from_its_local_step(tmp_path, uninterrupted):
    """DEFAULT mode: the tier is a second directory that survives the process (here with the SimpleWriter)."""
    spec = spec_for(tmp_path, "default", "simple", kill={"0": 11}, complete=10)
    out = kill_and_resume(tmp_path, spec, 1)
    assert_same_end(ends(tmp_path, 1), uninterrupted("default", 1))
    assert resumed(tmp_path, 1) == [part(tmp_path, 10, 0)]
    assert "resumed from local step 10 (its own local part" in out[0][1]


def test_a_rank_killed_resumes_from_the_local_parts(tmp_path, uninterrupted):
    """DISTRIBUTED mode with the ProcessWriter (SHARDED mode and the ThreadWriter: the tests below)."""
    mode = "distributed"
    spec = spec_for(tmp_path, mode, "process", kill={"1": 11}, complete=10)
    kill_and_resume(tmp_path, spec, 2)
    assert_same_end(ends(tmp_path, 2), uninterrupted(mode, 2))
    # Step 10 was complete (the victim waited for it): newer than the durable snapshot of iteration 8.
    assert resumed(tmp_path, 2) == [part(tmp_path, 10, r) for r in range(2)]


def test_a_node_lost_resumes_from_the_partners_copies(tmp_path, uninterrupted):
    """Four ranks, two nodes of two; node 1 (ranks 2 and 3) is killed and its local directory wiped."""
    spec = spec_for(tmp_path, "sharded", kill={"2": 13, "3": 13}, complete=12)
    out = kill_and_resume(tmp_path, spec, 4, per_node=2, wipe=[1])
    assert_same_end(ends(tmp_path, 4), uninterrupted("sharded", 4, 2))
    # ranks 2 and 3 read their parts straight from the copies ranks 0 and 1 hold on node 0
    copies = [str(tmp_path / "node0" / "step_12" / f"copy-rank{r}") for r in (2, 3)]
    assert resumed(tmp_path, 4) == [part(tmp_path, 12, 0, 2), part(tmp_path, 12, 1, 2), *copies]
    assert "(a partner copy from rank 0" in out[2][1] and "(a partner copy from rank 1" in out[3][1]
    assert "(its own local part" in out[0][1]


@pytest.mark.parametrize("victim", [{"kill_in_serve": 0}, {"kill_in_read": 2}], ids=["holder", "reader"])
def test_a_rank_killed_while_a_copy_is_read_costs_that_restart_only(tmp_path, uninterrupted, victim):
    """Node 1 is lost and its directory wiped; in the restart, rank 0 dies as rank 2 reads its part from rank 0's
    copy, or rank 2 dies as it reads (the others are torn down); the next restart resumes from the same local step,
    bit-exact."""
    spec = spec_for(tmp_path, "sharded", kill={"2": 13, "3": 13}, complete=12)
    first = run_ranks(spec, 4, per_node=2)
    assert [s for s, _ in first][2:] == [-9, -9], [out[-3000:] for _, out in first]
    shutil.rmtree(tmp_path / "node1")
    calm = {k: v for k, v in spec.items() if k not in ("kill", "complete")}
    second = run_ranks({**calm, **victim}, 4, per_node=2)
    dead = next(iter(victim.values()))
    assert second[dead][0] == -9, second[dead][1][-3000:]
    third = run_ranks(calm, 4, per_node=2)
    assert [s for s, _ in third] == [0] * 4, [out[-3000:] for _, out in third]
    assert_same_end(ends(tmp_path, 4), uninterrupted("sharded", 4, 2))
    assert resumed(tmp_path, 4)[2:] == [str(tmp_path / "node0" / "step_12" / f"copy-rank{r}") for r in (2, 3)]


@pytest.mark.parametrize("mode, world", [("default", 1), ("sharded", 2)])
def test_a_local_directory_wiped_while_the_run_goes_on_costs_the_steps_it_held(tmp_path, uninterrupted, mode, world):
    """The last rank's node directory removed under the running job (by an operator, or a cleaner of /dev/shm) at
    iteration 5: the steps it held are gone, and the next ones are saved there again; killed at iteration 15, the
    run resumes from local step 14."""
    last = str(world - 1)
    spec = spec_for(tmp_path, mode, wipe_at={last: 5}, kill={last: 15}, complete=14)
    kill_and_resume(tmp_path, spec, world)
    assert_same_end(ends(tmp_path, world), uninterrupted(mode, world))
    assert resumed(tmp_path, world) == [part(tmp_path, 14, r) for r in range(world)]


def test_a_rank_killed_during_a_partner_copy_leaves_the_step_incomplete(tmp_path, uninterrupted):
    """Rank 1 dies while sending its part of step 12: no rank marks step 12 complete; the run resumes from 10."""
    spec = spec_for(tmp_path, "sharded", kill_in_copy=[1, 12])

    def no_marker_of_step_12():
        assert not [p for p in tmp_path.rglob("step_12/*.complete")]
    kill_and_resume(tmp_path, spec, 2, between=no_marker_of_step_12)
    assert_same_end(ends(tmp_path, 2), uninterrupted("sharded", 2))
    assert resumed(tmp_path, 2) == [part(tmp_path, 10, r) for r in range(2)]


def test_a_copy_that_arrives_other_than_sent_leaves_the_step_incomplete(tmp_path, uninterrupted):
    """Rank 1's part of step 10 reaches rank 0 with a bit flipped: the digests differ, step 10 is incomplete on
    every rank (a warning), and training goes on as without the tier."""
    statuses = run_ranks(spec_for(tmp_path, "sharded", flip_in_copy=[1, 10]), 2)
    assert [s for s, _ in statuses] == [0, 0]
    for _, out in statuses:
        assert ("local step 10 is incomplete and will not be restored: rank 0: the copy of rank 1's part: its bytes "
                "differ from what was sent") in out
        assert "local step 12 is incomplete" not in out
    assert_same_end(ends(tmp_path, 2), uninterrupted("sharded", 2))


def _flip_a_bit(part) -> None:
    data = part / "data" / "rank0.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_a_damaged_local_part_is_restored_from_its_partner_copy(tmp_path, uninterrupted):
    """Rank 1's own part of step 10 fails its checksum; rank 0 holds a copy of it, which rank 1 fetches."""
    spec = spec_for(tmp_path, "distributed", kill={"1": 11}, complete=10)
    out = kill_and_resume(tmp_path, spec, 2, between=lambda: _flip_a_bit(tmp_path / "node1" / "step_10" / "rank1"))
    assert_same_end(ends(tmp_path, 2), uninterrupted("distributed", 2))
    assert resumed(tmp_path, 2) == [part(tmp_path, 10, 0), str(tmp_path / "node0" / "step_10" / "copy-rank1")]
    assert "local step 10: this rank's own part failed (CorruptSnapshotError" in out[1][1]
    assert "resumed from local step 10 (a partner copy from rank 0" in out[1][1]
    assert "resumed from local step 10 (its own local part" in out[0][1]


def test_a_damaged_part_and_copy_fall_back_to_the_durable_snapshot(tmp_path, uninterrupted):
    spec = spec_for(tmp_path, "distributed", kill={"1": 11}, complete=10)

    def damage():
        _flip_a_bit(tmp_path / "node1" / "step_10" / "rank1")
        _flip_a_bit(tmp_path / "node0" / "step_10" / "copy-rank1")
    out = kill_and_resume(tmp_path, spec, 2, between=damage)
    assert_same_end(ends(tmp_path, 2), uninterrupted("distributed", 2))
    assert resumed(tmp_path, 2) == [str(tmp_path / "out" / "snapshot_iter_8")] * 2
    assert "the local tier was not used: local step 10: rank 1: CorruptSnapshotError" in out[1][1]


def _small_tmpfs(directory, rank: int) -> list[str]:
    """Rank 1 runs with its node's local directory on a tmpfs of 4 KiB (its own mount namespace)."""
    if rank != 1:
        return []
    os.makedirs(directory, exist_ok=True)
    return ["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o size=4k tmpfs {directory} && exec \"$@\"", "sh"]


def test_a_full_local_tmpfs_costs_the_tier_only(tmp_path, uninterrupted):
    probe = subprocess.run(_small_tmpfs(str(tmp_path / "probe"), 1) + ["true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no tmpfs can be mounted here: {probe.stderr.decode()[-300:]}")
    spec = spec_for(tmp_path, "sharded", kill={"1": 11})  # no step completes: nothing to wait for
    out = kill_and_resume(tmp_path, spec, 2, wrap=lambda rank: _small_tmpfs(str(tmp_path / "node1"), rank))
    assert_same_end(ends(tmp_path, 2), uninterrupted("sharded", 2))
    assert not [p for p in tmp_path.rglob("*.complete")]  # rank 0's parts were never agreed complete
    assert resumed(tmp_path, 2) == [str(tmp_path / "out" / "snapshot_iter_8")] * 2
    assert "No space left on device" in out[1][1] or "ENOSPC" in out[1][1]
