"""The snapshot engine: flatten app state, plan, stage, write, commit; restore in place."""
from ppe_snapshot.engine.snapshot import PendingSnapshot, Snapshot
from ppe_snapshot.engine.stateful import OptimizerState, RNGState, Stateful, StateDict
from ppe_snapshot.engine.take import LOCAL

__all__ = ["LOCAL", "OptimizerState", "PendingSnapshot", "RNGState", "Snapshot", "StateDict", "Stateful"]
