"""The snapshot engine: flatten app state, plan, stage, write, commit; restore in place."""
from ppe_snapshot.engine.snapshot import PendingSnapshot, Snapshot
from ppe_snapshot.engine.stateful import RNGState, Stateful, StateDict

__all__ = ["PendingSnapshot", "RNGState", "Snapshot", "StateDict", "Stateful"]
