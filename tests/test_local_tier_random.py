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

import pytest

from test_local_tier import (  # noqa: F401
    ITERATIONS, assert_same_end, ends, kill_and_resume, run_ranks, spec_for, uninterrupted, victims_of,
)

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

    def restart_killed() -> None:  # the restart killed too, while it restores
        restart = {**spec, "kill_after": plan["restart_kill"]}
        statuses = run_ranks(restart, WORLD, PER_NODE)
        for rank in victims_of(restart):
            assert statuses[rank][0] == -9, (plan, statuses[rank][1][-3000:])

    kill_and_resume(tmp_path, {**spec, "kill_after": plan["kill_after"]}, WORLD, PER_NODE, wipe=plan["wipe"],
                    between=restart_killed if plan["restart_kill"] is not None else lambda: None)
    assert_same_end(ends(tmp_path, WORLD), uninterrupted(plan["mode"], WORLD, PER_NODE))
