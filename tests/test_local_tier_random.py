"""The local tier against kills at random moments: seeded trials of four ranks as two nodes of two (SHARDED or
DISTRIBUTED mode, any writer) where a rank, a node whose local directory is then wiped, or every node (every local
directory wiped: the durable snapshot is all there is) is SIGKILLed at a random moment of the run (computing,
saving a local step, sending or receiving a partner copy, writing a durable snapshot), and, in some trials, again
at a random moment of the restart (while it restores); the run restarted whole with autoload must end bit-exact
with an uninterrupted one. Half the trials save densely (a local step every iteration, a durable snapshot every 4)
so that kills land in saves and copies more often. DEFAULT mode the same with one process (its local directory a
second directory that survives it; wiped in some trials, as if the machine were lost). The suite runs
``LOCAL_TIER_TRIALS`` trials of each (default 2 of four ranks, 1 of one process) from seed
``LOCAL_TIER_FIRST_SEED`` (default 0); ``benchmarks/local_tier_trials.py`` runs more.
"""
from __future__ import annotations

import os
import random

import pytest

from test_local_tier import (  # noqa: F401
    DURABLE, ITERATIONS, LOCAL, assert_same_end, ends, kill_and_resume, run_ranks, spec_for, uninterrupted, victims_of,
)

TRIALS = int(os.environ.get("LOCAL_TIER_TRIALS", "2"))
ONE_PROCESS_TRIALS = int(os.environ.get("LOCAL_TIER_TRIALS", "1"))
FIRST_SEED = int(os.environ.get("LOCAL_TIER_FIRST_SEED", "0"))
WORLD, PER_NODE = 4, 2


def _plan(seed: int, world: int = WORLD, per_node: int = PER_NODE) -> dict:
    """What trial ``seed`` kills, and when: ``world`` ranks as nodes of ``per_node`` (one process: DEFAULT mode)."""
    rng = random.Random(seed)
    lost = rng.choices(["rank", "node", "every node"], weights=[2, 2, 1])[0]
    first = rng.randrange(world)
    victims = {"rank": [first], "node": [first // per_node * per_node + i for i in range(per_node)],
               "every node": list(range(world))}[lost]
    # (ranks from iteration 2: the first forms the snapshots' side group, and a process killed while gloo connects
    # a group leaves its peers connecting to a port another test's group may take next)
    iteration = rng.randrange(2 if world > 1 else 1, ITERATIONS - 3)
    delay = rng.uniform(0.0, rng.choice([0.005, 0.05, 0.2]))
    again = rng.random() < 0.4  # killed again while the restart restores
    modes = ["sharded", "distributed"] if world > 1 else ["default"]
    plan = {"mode": rng.choice(modes), "writer": rng.choice(["simple", "thread", "process"]),
            "wipe": {"rank": [], "node": [first // per_node], "every node": list(range(world // per_node))}[lost],
            "kill_after": {str(v): [iteration, delay] for v in victims},
            "restart_kill": {str(victims[0]): [0, rng.uniform(0.0, 0.3)]} if again else None}
    # local steps every 2 iterations and durable snapshots every 8, or, denser, every iteration and every 4 (a kill
    # then lands in a save or a copy more often); drawn last, so the draws above stay those of earlier trials
    plan["local"], plan["durable"] = rng.choice([(LOCAL, DURABLE), (1, 4)])
    return plan


def _trial(directory, uninterrupted, plan: dict, world: int, per_node: int) -> None:  # noqa: F811
    """Run ``plan`` (of :func:`_plan`) and its restarts: the end is bit-exact with an uninterrupted run."""
    spec = spec_for(directory, plan["mode"], plan["writer"], local=plan["local"], durable=plan["durable"])

    def restart_killed() -> None:  # the restart killed too, while it restores
        restart = {**spec, "kill_after": plan["restart_kill"]}
        statuses = run_ranks(restart, world, per_node)
        for rank in victims_of(restart):
            assert statuses[rank][0] == -9, (plan, statuses[rank][1][-3000:])

    kill_and_resume(directory, {**spec, "kill_after": plan["kill_after"]}, world, per_node, wipe=plan["wipe"],
                    between=restart_killed if plan["restart_kill"] is not None else lambda: None)
    assert_same_end(ends(directory, world), uninterrupted(plan["mode"], world, per_node))


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + TRIALS))
def test_a_kill_at_a_random_moment_resumes_bit_exact(tmp_path, uninterrupted, seed):  # noqa: F811
    _trial(tmp_path, uninterrupted, _plan(seed), WORLD, PER_NODE)


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + ONE_PROCESS_TRIALS))
def test_one_process_killed_at_a_random_moment_resumes_bit_exact(tmp_path, uninterrupted, seed):  # noqa: F811
    _trial(tmp_path, uninterrupted, _plan(seed, world=1, per_node=1), 1, 1)
