"""An incremental take references a base data file only where that keeps enough of the file alive.

A snapshot that references a file keeps all of it on disk (retention removes data files whole). A full fine-tune
changes every weight, but a few small entries (the numpy RNG state, 2.5 KB) stay the same for the whole run: each
snapshot would reference them in the first snapshot's file and keep that whole file, a full copy of the state,
forever. So once an incremental take knows what it keeps of each base file, the blocks it keeps of a file it would
reference for less than :data:`MIN_REFERENCED_SHARE` of the file's bytes are copied from that file into its own
(checksum-verified), and the file is not referenced. A copy costs at most that share of the file; later takes
reference the copied blocks in the new file (until that file too falls below the share).
"""
from __future__ import annotations

import numpy as np

from ppe_snapshot.engine._files import PayloadAppender, checksum, coalesced, mismatch_error, read_file_into
from ppe_snapshot.engine._format import Chunk
from ppe_snapshot.storage import Storage

#: A base file an incremental take would reference for less than this share of its bytes is not referenced.
MIN_REFERENCED_SHARE = 0.5
#: The chunks an incremental take references in one base file: their offsets and sizes (a chunk may repeat).
Kept = tuple[list[int], list[int]]


def referenced_share(kept: Kept, size: int) -> float:
    """The share of a data file of ``size`` bytes that the chunks ``kept`` cover (each distinct chunk once)."""
    if not size:
        return 1.0
    _, first = np.unique(np.asarray(kept[0], dtype=np.int64), return_index=True)
    return float(np.asarray(kept[1], dtype=np.int64)[first].sum()) / size


def copy_sparse_references(storage: Storage, appender: PayloadAppender, rows: list[list[Chunk]],
                           kept: dict[str, Kept], sizes: dict[str, int]) -> set[str]:
    """Copy into this take's file (being appended to by ``appender``) the chunks that ``rows`` reference in each
    file of ``kept`` whose ``sizes`` they cover less than :data:`MIN_REFERENCED_SHARE` of, and name the copies
    in ``rows`` instead; the files no longer referenced."""
    sparse = {name for name, chunks in kept.items() if referenced_share(chunks, sizes[name]) < MIN_REFERENCED_SHARE}
    if not sparse:
        return sparse
    blocks_of: dict[str, dict[int, Chunk]] = {name: {} for name in sparse}
    for chunks in rows:
        for chunk in chunks:
            if chunk.file in blocks_of:
                blocks_of[chunk.file][chunk.offset] = chunk
    copies: dict[tuple[str, int], Chunk] = {}
    for name in sorted(sparse):
        blocks = sorted(blocks_of[name].values(), key=lambda c: c.offset)
        for first, stop in coalesced([(c.offset, c.nbytes) for c in blocks]):
            run, start = blocks[first:stop], blocks[first].offset
            data = memoryview(bytearray(run[-1].offset + run[-1].nbytes - start))
            read_file_into(storage, name, start, data)
            for chunk in run:
                view = data[chunk.offset - start:chunk.offset - start + chunk.nbytes]
                if checksum(view) != chunk.checksum:
                    raise mismatch_error(storage, name, chunk.offset, chunk.nbytes, "a block this take keeps")
                copies[(name, chunk.offset)] = appender.append_hashed(view, chunk.checksum)
    for chunks in rows:
        for i, chunk in enumerate(chunks):
            if chunk.file in sparse:
                chunks[i] = copies[(chunk.file, chunk.offset)]
    return sparse

