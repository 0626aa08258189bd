"""Preemption: save at the end of the iteration a signal (SIGTERM, ...) arrived in, wait until durable, exit.

The signal handler only records the signal (saving inside a handler is not
safe). The snapshot extension's trigger is wrapped (:class:`PreemptionTrigger`)
so that at the end of every iteration :meth:`Preemption.due` is asked
whether a signal came; then the extension saves at once with its writer,
waits until the save is durable, finalizes the manager and raises
:class:`ppe_snapshot.Preempted`.

Several ranks (DISTRIBUTED / SHARDED): schedulers signal ranks at slightly
different times, or only some. Every ``check_every`` iterations the ranks
agree on the largest signal number, point to point through rank 0 on a gloo
group of their own (created at construction, never the training group), so
that a rank whose process died is named on every other rank (a
:class:`SnapshotError`) instead of leaving them in a collective; all ranks see
the same result at the same iteration, so all save that iteration together
and none waits for another. Its cost is in benchmarks/RESULTS.md. Then every
rank waits for its writer and meets the others (the same exchange) before any
exits (a launcher such as torchrun stops the others when one exits). A save
that failed (a rank died during it) still finalizes the manager, then raises.

A second signal while the save runs is recorded and otherwise ignored: the
save completes and ``Preempted`` is raised. Only SIGKILL (a scheduler's end
of grace period) stops it; the snapshot being written is then incomplete,
and autoload resumes from the previous one.
"""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from typing import Any, Callable

import torch.distributed as dist

from ppe_snapshot import ppe_private
from ppe_snapshot.engine import agree_max
from ppe_snapshot.errors import Preempted, SnapshotError

logger = logging.getLogger(__name__)

#: Iterations between two agreements of the ranks on whether a signal came. One agreement took 0.22 ms on 2
#: ranks of a 2-core VM, 0.5 ms on 3 (benchmarks/RESULTS.md): every 10 iterations, at most 0.1 % of a 50 ms
#: step; the save then comes at most 9 iterations after the signal.
CHECK_EVERY = 10


def check_signals(signals: Iterable[Any]) -> tuple[signal.Signals, ...]:
    """``save_on_signals`` as signal numbers; a clear error for what cannot be caught."""
    if isinstance(signals, (int, signal.Signals)):
        raise TypeError("save_on_signals takes a tuple of signals, e.g. (signal.SIGTERM,), got one signal")
    checked = []
    for s in signals:
        try:
            sig = signal.Signals(s)
        except (ValueError, TypeError):
            raise ValueError(f"save_on_signals: {s!r} is not a signal (use signal.SIGTERM, signal.SIGUSR1, ...)"
                             ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"save_on_signals: {sig.name} cannot be caught; use SIGTERM, SIGUSR1, SIGINT, ...")
        checked.append(sig)
    return tuple(dict.fromkeys(checked))


class Preemption:
    """The signals watched, what arrived, and the agreement of the ranks on the iteration to save."""

    def __init__(self, signals: Iterable[Any], exit_code: int | None = None, group: Any = None,
                 check_every: int = CHECK_EVERY) -> None:
        self.signals = check_signals(signals)
        if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
            raise TypeError(f"preempted_exit_code must be an int or None, got {exit_code!r}")
        self.exit_code = exit_code
        self.check_every = check_every
        #: The first signal received (set by the handler), and how many arrived.
        self.received: int | None = None
        self.count = 0
        #: The signal whose snapshot is due (agreed by every rank), or None.
        self.decided: int | None = None
        self._group = group
        self._exchanges = 0  # the tag of each agreement (every rank counts the same)
        self._previous: dict[signal.Signals, Any] = {}

    @classmethod
    def for_ranks(cls, signals: Iterable[Any], exit_code: int | None) -> "Preemption":
        """Every rank must construct it at the same point: it creates a gloo group of its own (collective)."""
        checked = check_signals(signals)
        return cls(checked, exit_code, group=dist.new_group(backend="gloo"))

    # -- the handler -----------------------------------------------------------------------------------------
    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum

    def install(self) -> None:
        if self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("save_on_signals: the snapshot must be initialized in the main thread (Python runs "
                               "signal handlers there only)")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    # -- deciding ------------------------------------------------------------------------------------------
    def due(self, manager: Any) -> bool:
        """Whether the snapshot of a signal is due at this iteration (the same answer on every rank)."""
        if self.decided is None:
            if self._group is None:
                self.decided = self.received
            elif manager.iteration % self.check_every == 0:
                self.decided = self._agree(self.received or 0) or None
        return self.decided is not None

    def barrier(self) -> None:
        """Every rank waits here until all have made their part durable (a rank exiting early may make a
        launcher such as torchrun kill the others)."""
        if self._group is not None:
            self._agree(0)

    def _agree(self, value: int) -> int:
        """The largest ``value`` of the ranks; a :class:`SnapshotError` naming a rank that died."""
        self._exchanges += 1
        try:
            return agree_max(self._group, value, self._exchanges)
        except SnapshotError as e:
            raise SnapshotError(f"preemption: the ranks could not agree, {e}") from e

    def exit_status(self) -> int:
        assert self.decided is not None
        return self.exit_code if self.exit_code is not None else 128 + int(self.decided)

    def wrap_trigger(self, manager: Any, extension: Any) -> bool:
        """Make the manager ask :meth:`due` at the end of every iteration, through the trigger of ``extension``'s
        entry. False when the manager has no entry for it (not a ppe manager)."""
        for _, entry in ppe_private.extension_entries(manager):
            if getattr(entry, "extension", None) is extension:
                if not isinstance(entry.trigger, PreemptionTrigger):
                    entry.trigger = PreemptionTrigger(entry.trigger, self.due)
                return True
        return False


def preempt(snapshot: Any, manager: Any, preemption: Preemption) -> None:
    """Save ``manager``'s state now with the snapshot extension's writer, wait until durable (every rank),
    finalize the manager, raise :class:`ppe_snapshot.Preempted`."""
    assert preemption.decided is not None
    name, failure = None, None
    with ppe_private.models_available(manager):  # ppe's guard when no needs_model_state extension was due
        try:
            name = snapshot._format_name(manager)
            snapshot._make_snapshot(manager)
            if hasattr(snapshot.writer, "wait"):
                snapshot.writer.wait()
        except Exception as e:  # noqa: BLE001 - raised below, once no rank waits for this one
            failure = e
    try:
        preemption.barrier()
    except SnapshotError as e:  # a rank died: finalize all the same, then raise
        failure = failure if failure is not None else e
    finalize = getattr(manager, "finalize", None)
    if callable(finalize):
        finalize()  # every extension's finalize (this one puts the signal handlers back) and the writers'
    else:
        snapshot.finalize(manager)
    if failure is not None:
        raise failure
    logger.warning("preempted by signal %s at iteration %s; snapshot %s is durable; exiting with "
                   "status %d", preemption.decided, manager.iteration, name, preemption.exit_status())
    raise Preempted(preemption.exit_status(), preemption.decided, manager.iteration, name)


class PreemptionTrigger:
    """A trigger that fires when its inner trigger does, or when a preemption snapshot is due. The inner
    trigger is always called first (triggers are stateful); its state is the saved state."""

    def __init__(self, inner: Any, due: Callable[[Any], bool]) -> None:
        self.inner = inner
        self._due = due

    def __call__(self, manager: Any) -> bool:
        fired = bool(self.inner(manager))
        return self._due(manager) or fired

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        return self.inner.may_fire(iteration, epoch_len)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
