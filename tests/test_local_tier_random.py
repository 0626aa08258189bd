"""The local tier against kills at random moments: seeded trials of four ranks as two nodes of two (SHARDED or
DISTRIBUTED mode, any writer) where a rank, a node whose local directory is then wiped, or every node (every local
directory wiped: the durable snapshot is all there is) is SIGKILLed at a random moment of the run (computing,
saving a local step, sending or receiving a partner copy, writing a durable snapshot), and, in some trials, again
at a random moment of the restart (while it restores); the run restarted whole with autoload must end bit-exact
with an uninterrupted one. The suite runs ``LOCAL_TIER_TRIALS`` trials (default 2) from seed
``LOCAL_TIER_FIRST_SEED`` (default 0); ``benchmarks/local_tier_trials.py`` runs more.
"""
from __future__ import annotations

import os
import random
import shutil

import pytest

from test_local_tier import ITERATIONS, assert_same_end, ends, run_ranks, spec_for, uninterrupted  # noqa: F401

TRIALS = int(os.environ.get("LOCAL_TIER_TRIALS", "2"))
FIRST_SEED = int(os.environ.get("LOCAL_TIER_FIRST_SEED", "0"))
WORLD, PER_NODE = 4, 2


def _plan(seed: int) -> dict:
    """What trial ``seed`` kills, and when."""
    rng = random.Random(seed)
    lost = rng.choices(["rank", "node", "every node"], weights=[2, 2, 1])[0]
    first = rng.randrange(WORLD)
    victims = {"rank": [first], "node": [first // PER_NODE * PER_NODE + i for i in range(PER_NODE)],
               "every node": list(range(WORLD))}[lost]
    # (from iteration 2: the first forms the snapshots' side group, and a process killed while gloo connects a group
    # leaves its peers connecting to a port another test's group may take next)
    iteration, delay = rng.randrange(2, ITERATIONS - 3), rng.uniform(0.0, rng.choice([0.005, 0.05, 0.2]))
    again = rng.random() < 0.4  # killed again while the restart restores
    return {"mode": rng.choice(["sharded", "distributed"]), "writer": rng.choice(["simple", "thread", "process"]),
            "wipe": {"rank": [], "node": [first // PER_NODE], "every node": list(range(WORLD // PER_NODE))}[lost],
            "kill_after": {str(v): [iteration, delay] for v in victims},
            "restart_kill": {str(victims[0]): [0, rng.uniform(0.0, 0.3)]} if again else None}


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + TRIALS))
def test_a_kill_at_a_random_moment_resumes_bit_exact(tmp_path, uninterrupted, seed):  # noqa: F811
    plan = _plan(seed)
    spec = spec_for(tmp_path, plan["mode"], plan["writer"])
    runs = [{**spec, "kill_after": plan["kill_after"]}]
    if plan["restart_kill"] is not None:
        runs.append({**spec, "kill_after": plan["restart_kill"]})
    for number, killed in enumerate(runs):
        statuses = run_ranks(killed, WORLD, PER_NODE)
        for rank in killed["kill_after"]:
            assert statuses[int(rank)][0] == -9, (plan, number, statuses[int(rank)][1][-3000:])
        if number == 0:
            for node in plan["wipe"]:
                shutil.rmtree(tmp_path / f"node{node}", ignore_errors=True)
    statuses = run_ranks(spec, WORLD, PER_NODE)
    assert [s for s, _ in statuses] == [0] * WORLD, (plan, [out[-3000:] for _, out in statuses])
    assert_same_end(ends(tmp_path, WORLD), uninterrupted(plan["mode"], WORLD, PER_NODE))
