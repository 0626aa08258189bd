"""The take: preparing, staging, writing (incremental too) and ending a take on every rank; who writes it.

The face of this subpackage: what the rest of the engine uses of it (modules here import each other directly).
"""
from ppe_snapshot.engine._take.incremental import block_size, check_base, write_pieces
from ppe_snapshot.engine._take.staging import StagedImage, new_staging_buffer
from ppe_snapshot.engine._take.staging_pool import (
    give_back, prepare_staging_buffer, release_staging_buffers, staging_estimate, take_staging_buffer,
)
from ppe_snapshot.engine._take.take import TakeJob, TensorPrepare, prepare_take
from ppe_snapshot.engine._take.writers import judge_writers

__all__ = [
    "block_size", "check_base", "give_back", "judge_writers", "new_staging_buffer", "prepare_staging_buffer",
    "prepare_take", "release_staging_buffers", "StagedImage", "staging_estimate", "take_staging_buffer", "TakeJob",
    "TensorPrepare", "write_pieces",
]
