"""The snapshot extension's local tier (``snapshot(..., local=...)``): when local steps are saved, and resuming
from them.

The extension's own trigger keeps writing durable snapshots; at ``initialize`` its manager entry's trigger is
wrapped (:class:`TierTrigger`) to fire at the local trigger too, and remember which of the two fired. A local
step is saved at every firing of the local trigger (a durable step included); what the tier does with it is
:mod:`ppe_snapshot.local_tier`'s. At autoload the tier is asked first, for a step newer than the newest complete
durable snapshot.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable

from pytorch_pfn_extras.training import ExtensionsManagerProtocol
from pytorch_pfn_extras.training.triggers import IntervalTrigger

from ppe_snapshot import ppe_private
from ppe_snapshot.engine import RNGState, StateDict, exchange, side_group
from ppe_snapshot.local_tier import (
    START_TAG, Fallback, LocalSaves, LocalTier, Planning, Ranks, Recovered, check_triggers, partners, recover,
    this_node, wards,
)
from ppe_snapshot.extension.saved_state import RNG_KEY, STATE_KEY
from ppe_snapshot.settings import SETTINGS
from ppe_snapshot.storage import Storage, open_tree
from ppe_snapshot.writing import ImageLoan

logger = logging.getLogger(__name__)


class TierTrigger:
    """The extension's trigger, firing also at the local tier's; :attr:`durable_due` and :attr:`local_due` say
    which of the two fired at the last call. Its state is the inner trigger's."""

    def __init__(self, inner: Any, local: IntervalTrigger) -> None:
        self.inner, self.local = inner, local
        self.durable_due = self.local_due = False

    def __call__(self, manager: Any) -> bool:
        self.durable_due = bool(self.inner(manager))
        self.local_due = bool(self.local(manager))
        return self.local_due or self.durable_due

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        return self.inner.may_fire(iteration, epoch_len) or self.local.may_fire(iteration, epoch_len)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class LocalSteps:
    """One extension's local tier: its trigger, its saves, its part of autoload."""

    def __init__(self, tier: LocalTier, saves: LocalSaves, trigger: TierTrigger) -> None:
        self.tier, self.saves, self.trigger = tier, saves, trigger

    @classmethod
    def start(cls, tier: LocalTier, extension: Any, manager: ExtensionsManagerProtocol, out_dir: str,
              rank: int, world_size: int) -> "LocalSteps | None":
        """The tier of ``extension`` (every rank calls it at ``initialize``): triggers checked (``ValueError``),
        the manager entry's trigger wrapped, each rank's node told to every rank over the ranks' side group and
        the partners chosen. None, with a warning, where a rank cannot use its directory."""
        entry = next((e for _, e in ppe_private.extension_entries(manager) if e.extension is extension), None)
        if entry is None:
            raise ValueError("local=: the snapshot must be registered with manager.extend(...) for its local tier "
                             "to know the snapshot's trigger")
        check_triggers(tier.trigger, entry.trigger, ppe_private.iters_per_epoch(manager))
        directory = tier.resolved_directory(out_dir)
        problem = _usable(directory)
        ranks = Ranks()
        if world_size > 1:  # the side group the ranks' takes speak over, made at initialize
            group = side_group(None).group
            docs = exchange(group, {"node": this_node(rank), "problem": problem}, START_TAG, lambda docs: docs)
            nodes = [doc["node"] for doc in docs]
            partner_of = partners(nodes) if tier.partners != 0 else {}
            if tier.partners == 1 and not partner_of and rank == 0:
                logger.warning("local=: every rank runs on node %r, so no partner copies are kept (a lost node "
                               "resumes from durable snapshots)", nodes[0])
            ranks = Ranks(rank, world_size, group, partner_of.get(rank), tuple(wards(partner_of, rank)))
            problem = "; ".join(f"rank {r}: {doc['problem']}" for r, doc in enumerate(docs) if doc["problem"]) or None
        if problem is not None:
            logger.warning("the local tier is off: %s; durable snapshots go on", problem)
            return None
        trigger = TierTrigger(entry.trigger, IntervalTrigger(*tier.trigger))
        entry.trigger = trigger
        return cls(tier, LocalSaves(directory, ranks, tier.n_retains, recheck=tier.verify == "always"), trigger)

    @property
    def durable_due(self) -> bool:
        """Whether the extension's own trigger fired at this call (a durable snapshot is due)."""
        return self.trigger.durable_due

    @property
    def local_due(self) -> bool:
        return self.trigger.local_due

    def save(self, manager: ExtensionsManagerProtocol, state: Any, rng_rank: int, metadata: dict[str, Any],
             loan: ImageLoan | None = None) -> None:
        """Save this rank's ``state`` (the target's state dict) and RNG state as its part of the local step at
        the manager's iteration; ``loan``: the staged image of the durable save of this step, which the tier
        copies the state from (and gives back)."""
        app_state = {STATE_KEY: StateDict(state), RNG_KEY: StateDict({rng_rank: RNGState().state_dict()})}
        if loan is not None and loan.image is None:  # the durable save staged nothing here
            loan.release()
            loan = None
        if loan is None:
            self.saves.save(manager.iteration, app_state, metadata)
        else:
            self.saves.save(manager.iteration, app_state, metadata, loan.image, loan.release)

    def resume(self, names: Callable[[], Any] | None, durable: Callable[[], int | None],
               restore: Callable[[str | Storage], None]) -> Recovered | Fallback | None:
        """Restore from the newest local step newer than the newest complete durable snapshot, as :func:`recover`
        does (every rank at once); ``names()``: this rank's view of the durable snapshots' names (see
        :func:`ppe_snapshot.local_tier.recovery.agreed_plan`); ``durable()`` lists the durable snapshots (every
        rank at once) and returns that snapshot's iteration, called only where their names do not show the local
        step newer than all of them. A failure of the tier itself is a warning and a :class:`Fallback`; what
        ``durable()`` raises propagates."""
        try:
            planning = Planning(self.saves, names)
            settled = planning.durable_by_names()
        except Exception as e:  # noqa: BLE001 - the tier may fail; durable snapshots remain
            return _unreadable(e)
        newest = settled.newest if settled is not None else durable()
        try:
            return recover(self.saves, newest, restore, planning)
        except Exception as e:  # noqa: BLE001 - the tier may fail; durable snapshots remain
            return _unreadable(e)

    def finish(self) -> None:
        self.saves.finish(timeout=SETTINGS.commit_timeout)


def _unreadable(error: Exception) -> Fallback:
    logger.warning("the local tier could not be read: %s: %s; resuming from durable snapshots",
                   type(error).__name__, error)
    return Fallback(f"{type(error).__name__}: {error}", touched=False)


def _usable(directory: str) -> str | None:
    """None when this process can write into ``directory`` (made if missing), else why not."""
    tree = open_tree(directory)
    probe = f"{tree.root}/.probe-{os.getpid()}"
    try:
        tree.make_directory(tree.root)
        tree.save_file(probe, lambda f: f.write(b"ok"))
        tree.remove(probe)
    except OSError as e:
        return f"{directory} is not usable: {type(e).__name__}: {e}"
    return None

