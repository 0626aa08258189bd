"""What a user asks of the local tier: ``snapshot(..., local=LocalTier(...))``, and the checks made of it.

The local tier keeps frequent snapshots of each rank's state in node-local memory (``/dev/shm`` by default) and,
where the ranks span several nodes, a copy of each rank's part on a partner rank of another node. Its trigger
is more frequent than the extension's own (the durable snapshots) and divides it.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from ppe_snapshot.storage import absolute, memory_backed_dir

@dataclass(frozen=True)
class LocalTier:
    """The local tier of a snapshot extension.

    Args:
        directory: The node-local directory (None: a folder under ``/dev/shm`` named after the output directory,
            the same in every process of a run, so a restarted process finds it). Each node needs its own: on one
            machine, ranks simulating several nodes are given one directory per node.
        trigger: When a local step is saved: ``(period, "iteration" | "epoch")``, more frequent than the
            extension's trigger and dividing it.
        n_retains: How many complete local steps each rank keeps (the newest ones; one more may be in flight).
        partners: How many partner copies of each rank's part are kept on other nodes: 0 or 1 (None: 1 where the
            ranks span several nodes, else 0).
        verify: Which of a rank's own parts a restore checks against their checksums: ``"changed"``, those whose
            files changed since the part was completed (its marker records them; any write sets a file's change
            time: ``storage/unchanged.py``), or ``"always"``, every one (a restore from memory then takes about a
            third longer). A partner's copy fetched over the network is always checked.
    """
    directory: str | None = None
    trigger: tuple[float, str] = (1, "iteration")
    n_retains: int = 2
    partners: int | None = None
    verify: str = "changed"

    def __post_init__(self) -> None:
        period, unit = _interval(self.trigger, "LocalTier(trigger=...)")
        object.__setattr__(self, "trigger", (period, unit))
        if type(self.n_retains) is not int or self.n_retains < 1:
            raise ValueError(f"LocalTier(n_retains={self.n_retains!r}): keep at least one local step (an int >= 1)")
        if self.partners not in (None, 0, 1):
            raise ValueError(f"LocalTier(partners={self.partners!r}): 0 or 1 partner copy of each rank's part "
                             "(None: 1 where the ranks span several nodes)")
        if self.verify not in ("changed", "always"):
            raise ValueError(f"LocalTier(verify={self.verify!r}): 'changed' (check the own parts whose files changed "
                             "since they were completed) or 'always' (check every one)")
        if self.directory is not None and not isinstance(self.directory, (str, os.PathLike)):
            raise TypeError(f"LocalTier(directory=...) takes a path, got {type(self.directory).__name__}")

    def resolved_directory(self, out_dir: str) -> str:
        """The tier's directory for a run whose durable snapshots go to ``out_dir``."""
        if self.directory is not None:
            return os.fspath(self.directory)
        key = hashlib.sha256(absolute(out_dir).encode()).hexdigest()[:16]
        return f"{memory_backed_dir()}/ppe-snapshot-{os.getuid()}/{key}"


def local_tier(value: Any) -> LocalTier | None:
    """The extension's ``local=`` argument as a :class:`LocalTier`: one, a dict of its arguments, or None."""
    if value is None or isinstance(value, LocalTier):
        return value
    if isinstance(value, dict):
        return LocalTier(**value)
    raise TypeError(f"local= takes a ppe_snapshot.LocalTier or a dict of its arguments, got {type(value).__name__}")


def _interval(trigger: Any, what: str) -> tuple[float, str]:
    if (not isinstance(trigger, tuple) or len(trigger) != 2 or trigger[1] not in ("iteration", "epoch")
            or not isinstance(trigger[0], (int, float)) or trigger[0] <= 0):
        raise ValueError(f"{what}: an interval (period, 'iteration' | 'epoch') with period > 0, got {trigger!r}")
    if trigger[1] == "iteration" and int(trigger[0]) != trigger[0]:
        raise ValueError(f"{what}: a period in iterations is a whole number, got {trigger[0]!r}")
    return trigger[0], trigger[1]


def iterations(trigger: tuple[float, str], iters_per_epoch: int | None) -> float:
    """The period of an interval trigger in iterations (an epoch's iterations: ``iters_per_epoch``)."""
    period, unit = trigger
    if unit == "iteration":
        return period
    if not iters_per_epoch:
        raise ValueError(f"the local tier's trigger {trigger!r} is in epochs and the manager has no epoch length")
    return period * iters_per_epoch


def check_triggers(local: tuple[float, str], durable: Any, iters_per_epoch: int | None) -> None:
    """``ValueError`` unless the local trigger is more frequent than the extension's ``durable`` one (an interval
    trigger: its ``period`` and ``unit``) and divides it, both counted in iterations."""
    period, unit = getattr(durable, "period", None), getattr(durable, "unit", None)
    if period is None or unit not in ("iteration", "epoch"):
        raise ValueError(f"local=: the extension's trigger {durable!r} is not an interval; the local tier needs the "
                         "snapshot's trigger as (period, 'iteration' | 'epoch') to fit its own between its saves")
    local_n = iterations(local, iters_per_epoch)
    durable_n = iterations((period, unit), iters_per_epoch)
    if not (local_n < durable_n and int(local_n) == local_n and durable_n % local_n == 0):
        raise ValueError(f"local=: the local trigger {local!r} ({local_n:g} iterations) must be more frequent than "
                         f"the snapshot's trigger ({period!r}, {unit!r}) ({durable_n:g} iterations) and divide it, "
                         "so that every durable snapshot is also a local step")
