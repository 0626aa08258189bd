"""Snapshot stats into ppe's reporter where ``LogReport`` / ``PrintReport`` see them at their default priorities.

Extensions run in priority order, and the snapshot (``PRIORITY_SNAPSHOT``) runs after ``LogReport``
(``PRIORITY_WRITER``) has read the iteration's observation. So the stats of a save are reported into the
*next* iteration's observation by :class:`StatsReporter`, an extension that the snapshot places first in the
manager's running order when the manager starts its extensions (it is not registered: it holds no state and
is not in the manager's ``state_dict``). ``write_s`` of an asynchronous save is reported once the write ended.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytorch_pfn_extras import reporting
from pytorch_pfn_extras.training import extension

from ppe_snapshot import ppe_private

#: The name of the reporter in the manager's running order.
NAME = "ppe_snapshot/stats"


class StatsReporter(extension.Extension):
    """Reports the stats of the last save at the start of the next iteration's extensions."""

    trigger = 1, "iteration"
    priority = extension.PRIORITY_WRITER + 1
    needs_model_state = False

    def __init__(self) -> None:
        self._stats: Mapping[str, Any] | None = None
        self._first = False  # blocking_s and bytes not reported yet
        self._write_pending = False  # write_s not reported yet
        self._once: dict[str, Any] = {}  # reported at the next call, then dropped

    def add_once(self, values: Mapping[str, Any]) -> None:
        """Values to report once, at the next iteration (a restore's time)."""
        self._once.update(values)

    def add(self, stats: Mapping[str, Any]) -> None:
        """The stats of a save just made (a writer's ``last_stats``: ``write_s`` may be filled in later)."""
        self._stats, self._write_pending = stats, True
        self._first = True

    def __call__(self, manager: Any) -> None:
        if self._once:
            reporting.report(self._once)
            self._once = {}
        stats = self._stats
        if stats is None:
            return
        values: dict[str, Any] = {}
        if self._first:
            values = {"snapshot/blocking_s": stats.get("blocking_s"), "snapshot/bytes": stats.get("bytes")}
            self._first = False
        if self._write_pending and stats.get("write_s") is not None:
            values["snapshot/write_s"] = stats["write_s"]
            self._write_pending = False
        values = {k: v for k, v in values.items() if v is not None}
        if values:
            reporting.report(values)
        if not self._write_pending:
            self._stats = None


def attach(manager: Any) -> StatsReporter | None:
    """Put a :class:`StatsReporter` first in the running order of a manager that started its extensions."""
    running = ppe_private.running_extensions(manager)
    if running is None:
        return None
    for name, entry in running:
        if name == NAME:
            return entry.extension
    reporter = StatsReporter()
    # A new list: start_extensions may be iterating the current one (this runs from an initialize()).
    ppe_private.set_running_extensions(
        manager, [(NAME, extension.ExtensionEntry(reporter, trigger=StatsReporter.trigger))] + running)
    return reporter
