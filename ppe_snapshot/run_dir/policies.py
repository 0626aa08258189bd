"""Retention policies: which complete snapshots of a run to keep.

A policy is a small object with one method, ``keep(snapshots)``: given the
complete snapshots of a run (:class:`~ppe_snapshot.run_dir.Candidate`, oldest
training position first, each with ``name``, ``iteration``, ``epoch_detail``
and ``metrics``, the values recorded when it was taken), it returns the names
it keeps. ``a | b`` keeps what either keeps. Write one by subclassing
:class:`Policy`::

    class KeepFirst(Policy):
        def keep(self, snapshots):
            return {snapshots[0].name} if snapshots else set()

A policy that needs values recorded at save time names them in
``recorded_keys`` (the snapshot extension reads them from the manager's
observation and stores them in the snapshot's metadata).

Whatever the policies say, pruning never removes the newest complete
snapshot, one being written, or the one autoload resumed from until a newer
complete one exists (:func:`ppe_snapshot.run_dir.select_prunable`).
"""
from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

from ppe_snapshot.run_dir.listing import Candidate


class Policy:
    """A retention policy: ``keep(snapshots) -> names kept``; ``a | b`` is their union."""

    #: Observation keys the snapshot extension records in each snapshot's metadata for this policy.
    recorded_keys: tuple[str, ...] = ()

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        raise NotImplementedError

    def __or__(self, other: Any) -> "Policy":
        if not isinstance(other, Policy):
            return NotImplemented
        return Union(self, other)

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) and _public(self) == _public(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(self)))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in _public(self).items())
        return f"{type(self).__name__}({args})"


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


class KeepLatest(Policy):
    """The ``n`` newest complete snapshots."""

    def __init__(self, n: int) -> None:
        self.n = _positive_int(n, "KeepLatest(n): n")

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        return {c.name for c in snapshots[-self.n:]}


class KeepEvery(Policy):
    """Milestones: the snapshot at each multiple of ``n`` iterations (or epochs), or when none was taken exactly
    there, the first one after it (before the next multiple). A snapshot whose name and metadata hold no position
    in ``unit`` is not a milestone."""

    def __init__(self, n: int, unit: str = "iteration") -> None:
        self.n = _positive_int(n, "KeepEvery(n): n")
        if unit not in ("iteration", "epoch"):
            raise ValueError(f"KeepEvery(unit=...) must be 'iteration' or 'epoch', got {unit!r}")
        self.unit = unit

    def _window(self, c: Candidate) -> int | None:
        if self.unit == "iteration":
            return None if c.iteration is None else c.iteration // self.n
        if c.epoch_detail is None or not math.isfinite(c.epoch_detail):
            return None
        return math.floor(c.epoch_detail / self.n + 1e-9)

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        first: dict[int, Candidate] = {}
        for c in snapshots:  # oldest first: the first of each window is its milestone
            window = self._window(c)
            if window is not None and window not in first:
                first[window] = c
        return {c.name for c in first.values()}


class KeepBest(Policy):
    """The ``n`` snapshots with the lowest (``mode="min"``) or highest (``"max"``) recorded value of ``key``
    (e.g. ``"val/loss"``); ties go to the newer one. Snapshots without the value are not candidates (warned once)."""

    def __init__(self, key: str, n: int = 1, mode: str = "min") -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"KeepBest(key): key must be a non-empty str (an observation key), got {key!r}")
        self.key = key
        self.n = _positive_int(n, "KeepBest(n): n")
        if mode not in ("min", "max"):
            raise ValueError(f"KeepBest(mode=...) must be 'min' or 'max', got {mode!r}")
        self.mode = mode
        self._warned = False

    @property
    def recorded_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.key,)

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        scored = [(c.metrics[self.key], position, c) for position, c in enumerate(snapshots)
                  if _is_number(c.metrics.get(self.key))]
        missing = [c.name for c in snapshots if not _is_number(c.metrics.get(self.key))]
        if missing and not self._warned:
            self._warned = True
            warnings.warn(f"KeepBest({self.key!r}): {len(missing)} snapshot(s) have no recorded value of "
                          f"{self.key!r} (e.g. {missing[0]}) and are not candidates for it", stacklevel=2)
        sign = 1 if self.mode == "min" else -1
        scored.sort(key=lambda t: (sign * t[0], -t[1]))
        return {c.name for _, _, c in scored[:self.n]}


class Union(Policy):
    """What any of ``policies`` keeps (``a | b``)."""

    def __init__(self, *policies: Policy) -> None:
        flat: list[Policy] = []
        for p in policies:
            if not isinstance(p, Policy):
                raise TypeError(f"a retention policy must be a ppe_snapshot.retention.Policy, got {p!r}")
            flat.extend(p.policies if isinstance(p, Union) else (p,))
        self.policies = tuple(flat)

    @property
    def recorded_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(dict.fromkeys(k for p in self.policies for k in p.recorded_keys))

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        kept: set[str] = set()
        for p in self.policies:
            kept |= set(p.keep(snapshots))
        return kept

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies)


class KeepAll(Policy):
    """Every snapshot (what ``n_retains`` of 0 or less means, as in ppe)."""

    def keep(self, snapshots: Sequence[Candidate]) -> set[str]:
        return {c.name for c in snapshots}


def as_policy(keep: Any) -> Policy:
    """A policy from what ``prune`` / the extension take: an int (``n_retains``: positive is
    :class:`KeepLatest`, 0 or less keeps all) or a :class:`Policy`."""
    if isinstance(keep, Policy):
        return keep
    if isinstance(keep, numbers.Integral) and not isinstance(keep, bool):
        return KeepLatest(int(keep)) if keep > 0 else KeepAll()
    raise TypeError(f"retention takes an int (the number of newest snapshots to keep) or a policy of "
                    f"ppe_snapshot.retention (KeepLatest, KeepEvery, KeepBest, a | b), got {keep!r}")


def combine(n_retains: int, keep: Policy | None) -> Policy | None:
    """The extension's policy: ``n_retains`` (positive: KeepLatest) and ``keep`` together (their union),
    or None when neither asks for pruning."""
    latest = KeepLatest(n_retains) if n_retains > 0 else None
    if keep is None:
        return latest
    if not isinstance(keep, Policy):
        raise TypeError(f"keep must be a retention policy of ppe_snapshot.retention (KeepLatest, KeepEvery, "
                        f"KeepBest, a | b), got {keep!r}")
    return keep if latest is None else latest | keep


def _public(policy: Policy) -> dict[str, Any]:
    return {k: v for k, v in vars(policy).items() if not k.startswith("_")}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
