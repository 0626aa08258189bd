"""Engine utilities below everything else: pausing the cyclic garbage collector, host memory for staging.

The face of this subpackage: what the rest of the engine uses of it (modules here import each other directly).
"""
from ppe_snapshot.engine._util.gcpause import gc_paused
from ppe_snapshot.engine._util.hostmem import MEMORY, ReadyAhead, new_private_buffer, new_shared_buffer

__all__ = [
    "gc_paused", "MEMORY", "ReadyAhead", "new_private_buffer", "new_shared_buffer",
]
