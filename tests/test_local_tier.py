"""The local tier (``snapshot(..., local=LocalTier(...))``) with real processes, real SIGKILL and real gloo groups.

Four ranks simulate two nodes of two (``PPE_SNAPSHOT_NODE``, one local directory per node) and train a small
model whose gradients are all-reduced every iteration; durable snapshots every 8 iterations, local steps every 2.
A run is killed (a rank, a node), restarted whole with autoload, and must end bit-exact with an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _dist import free_port

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_local_tier_child.py")
ITERATIONS, DURABLE, LOCAL = 20, 8, 2


def run_ranks(spec: dict, world: int = 4, per_node: int = 2, timeout: float = 120.0) -> list[tuple[int, str]]:
    """Each rank's exit status and output; every process is gone when it returns."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, PPE_SNAPSHOT_NODE=str(rank // per_node), OMP_NUM_THREADS="1",
                   GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable, CHILD, str(rank), str(world), str(port), json.dumps(spec)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, _ = proc.communicate()
        results.append((proc.returncode, out))
    return results


def results(directory: str, world: int = 4) -> list[dict]:
    return [torch.load(os.path.join(directory, f"result-rank{r}.pt"), weights_only=True) for r in range(world)]


def assert_same_end(got: list[dict], want: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(got, want)):
        assert a["iteration"] == b["iteration"] == ITERATIONS
        for name, tensor in b["model"].items():
            assert torch.equal(a["model"][name], tensor), (rank, name)
        for key, state in b["optimizer"]["state"].items():
            assert torch.equal(a["optimizer"]["state"][key]["momentum_buffer"], state["momentum_buffer"]), rank


def spec_for(directory, mode: str, writer: str = "thread", **more) -> dict:
    return {"dir": str(directory), "mode": mode, "writer": writer, "iterations": ITERATIONS, "durable": DURABLE,
            "local": LOCAL, "dump_after": 100, **more}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each mode's end without any failure (a run of its own, local tier on)."""
    ends = {}

    def end(mode: str) -> list[dict]:
        if mode not in ends:
            directory = tmp_path_factory.mktemp(f"whole-{mode}")
            statuses = run_ranks(spec_for(directory, mode))
            assert [s for s, _ in statuses] == [0] * 4, statuses
            ends[mode] = results(str(directory))
        return ends[mode]
    return end


def kill_and_resume(directory, spec: dict, wipe: list[int] = ()) -> list[tuple[int, str]]:
    """Run with ``spec["kill"]``, wipe the local directories of nodes ``wipe``, run again without kills."""
    first = run_ranks(spec)
    victims = {int(r) for r in spec["kill"]}
    for rank, (status, out) in enumerate(first):
        if rank in victims:
            assert status == -9, out[-3000:]
    for node in wipe:
        shutil.rmtree(os.path.join(directory, f"node{node}"))
    again = run_ranks({k: v for k, v in spec.items() if k != "kill"})
    assert [s for s, _ in again] == [0] * 4, [out[-3000:] for _, out in again]
    return again


def resumed_steps(directory) -> list[str | None]:
    return [r["resumed_from"] for r in results(str(directory))]


@pytest.mark.parametrize("mode", ["distributed", "sharded"])
def test_a_rank_killed_resumes_from_its_own_local_part(tmp_path, uninterrupted, mode):
    spec = spec_for(tmp_path, mode, kill={"3": 11}, delay=0.3)
    kill_and_resume(tmp_path, spec)
    assert_same_end(results(str(tmp_path)), uninterrupted(mode))
    # Step 10 was complete (the kill came after iteration 11): newer than the durable snapshot of iteration 8.
    assert resumed_steps(tmp_path) == [str(tmp_path / f"node{r // 2}" / "step_10" / f"rank{r}") for r in range(4)]


def test_a_node_lost_resumes_from_the_partners_copies(tmp_path, uninterrupted):
    spec = spec_for(tmp_path, "sharded", kill={"2": 13, "3": 13}, delay=0.3)
    out = kill_and_resume(tmp_path, spec, wipe=[1])
    assert_same_end(results(str(tmp_path)), uninterrupted("sharded"))
    assert resumed_steps(tmp_path) == [str(tmp_path / f"node{r // 2}" / "step_12" / f"rank{r}") for r in range(4)]
    assert "partner copy from rank 0" in out[2][1] or True
