"""The snapshot engine: flatten app state, plan, stage, write, commit; restore in place."""
from ppe_snapshot.engine.snapshot import PendingSnapshot, Snapshot
from ppe_snapshot.engine.stateful import RNGState, Stateful, StateDict
from ppe_snapshot.engine.take import LOCAL

__all__ = ["LOCAL", "PendingSnapshot", "RNGState", "Snapshot", "StateDict", "Stateful"]
