"""Restore: loading stored values into app state (one loader per stored kind), the bulk path for many small
tensors.

The face of this subpackage: what the rest of the engine uses of it (modules here import each other directly).
"""
from ppe_snapshot.engine._restore.loading import leaf_loader, load_state, read_value

__all__ = [
    "leaf_loader", "load_state", "read_value",
]
