"""App state <-> entries: flattening and inflating, sharded tensors, state objects, which rank writes what.

The face of this subpackage: what the rest of the engine uses of it (modules here import each other directly).
"""
from ppe_snapshot.engine._state.flattening import (
    LoadLeaf, Payload, PlainTensors, check_target_fits, check_tensor_target, child_path, child_paths, escape, flatten,
    inflate, mark_replicated,
)
from ppe_snapshot.engine._state.planner import RankPlan, plan_rank, replicated_patterns
from ppe_snapshot.engine._state.sharded import (
    ShardPlan, dtensor_class, is_shard_key, is_sharded, merge_sharded, sharded_entries, sharded_state_patterns,
    sharded_tensor_class,
)
from ppe_snapshot.engine._state.stateful import (
    OptimizerState, RNGState, StateDict, Stateful, check_app_state, restore_order, state_of, take_states,
)

__all__ = [
    "check_app_state", "check_target_fits", "check_tensor_target", "child_path", "child_paths", "dtensor_class",
    "escape", "flatten", "inflate", "is_shard_key", "is_sharded", "LoadLeaf", "mark_replicated", "merge_sharded",
    "OptimizerState", "Payload", "PlainTensors", "plan_rank", "RankPlan", "replicated_patterns", "restore_order",
    "RNGState", "sharded_entries", "sharded_state_patterns", "sharded_tensor_class", "ShardPlan", "state_of",
    "StateDict", "Stateful", "take_states",
]
