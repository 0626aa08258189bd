"""What a reader refuses in an index file of format version 2 (``docs/format.md``, section 11), seen in the file
alone: the header's fields, the columns' lengths and ranges, chunks inside their files, sizes that match
shapes (without overflow), shards inside their tensors. Vectorised over the columns: an index of 10^5 tensors
is checked in a few numpy comparisons.
"""
from __future__ import annotations

from typing import Any, Collection

import numpy as np

from ppe_snapshot.engine._format.names import Raw
from ppe_snapshot.engine._format.validation import MAX_VALUE, dtype_itemsize
from ppe_snapshot.errors import CorruptSnapshotError
from ppe_snapshot.storage import is_safe_relative, split_reference

#: The columns of an index file, in file order, with their little-endian numpy types.
COLUMNS: dict[str, str] = {
    "tensor_dtype": "<u4", "tensor_ndim": "<u4", "tensor_chunk_end": "<i8", "dims": "<i8",
    "chunk_file": "<u4", "chunk_offset": "<i8", "chunk_nbytes": "<i8", "chunk_checksum": "<u8",
    "shard_tensor": "<u4", "shard_box": "<i8", "shard_chunk_end": "<i8",
}


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < MAX_VALUE


def header_problem(header: Any, take_id: str, section: str, rank: int | None,
                   references: Collection[str] = ()) -> str | None:
    """What is wrong with an index file's header; ``references``: the sibling snapshots (the manifest's
    ``references``) whose data files it may name as ``../<snapshot>/<file>``."""
    if type(header) is not dict:
        return "its header is not an object"
    if header.get("take_id") != take_id or header.get("section") != section or header.get("rank") != rank:
        return (f"it belongs to take {header.get('take_id')!r:.40}, section {header.get('section')!r:.40}, rank "
                f"{header.get('rank')!r:.20}, not to take {take_id!r}, section {section!r}, rank {rank!r} of the "
                "manifest (a leftover of another take?)")
    files, dtypes, tensors = header.get("files"), header.get("dtypes"), header.get("tensors")
    entries, sharded, columns = header.get("entries"), header.get("sharded"), header.get("columns")
    if type(files) is not list or not all(type(f) is list and len(f) == 2 and _is_count(f[1]) for f in files):
        return "files is not a list of [name, size] pairs"
    names = [f[0] for f in files]
    for name in names:
        reference = split_reference(name)
        if reference is not None and reference[0] in references:
            continue
        if not is_safe_relative(name):
            return (f"data file name {name!r:.200} is not a normalised relative path inside the snapshot "
                    "(no '..', '.', empty or absolute parts, no backslashes)"
                    + (", nor a file of a snapshot its manifest lists in references" if reference else ""))
    if len(set(names)) != len(names):
        return "a data file is listed twice"
    if type(dtypes) is not list or not all(type(d) is list and len(d) == 2 and all(type(x) is str for x in d)
                                           for d in dtypes):
        return "dtypes is not a list of [kind, name] pairs"
    if type(tensors) is not list or not set(map(type, tensors)) <= {str} or len(set(tensors)) != len(tensors):
        return "tensors is not a list of distinct paths"
    if type(entries) is not dict or not entries.keys().isdisjoint(tensors):
        return "entries is not an object of paths other than the tensors'"
    if type(sharded) is not list or not all(
            type(s) is list and len(s) == 3 and type(s[0]) is str and type(s[1]) is str and type(s[2]) is list
            and all(_is_count(n) for n in s[2]) for s in sharded):
        return "sharded is not a list of [path, dtype, shape] triples"
    if type(columns) is not dict or set(columns) != set(COLUMNS) or not all(_is_count(n) for n in columns.values()):
        return f"columns is not an object of the counts of {sorted(COLUMNS)}"
    return None


def columns_problem(header: dict[str, Any], cols: dict[str, np.ndarray], files: dict[str, int],
                     itemsizes: np.ndarray) -> str | None:
    n_tensors, n_chunks, n_shards = len(header["tensors"]), len(cols["chunk_file"]), len(cols["shard_tensor"])
    if not (len(cols["tensor_dtype"]) == len(cols["tensor_ndim"]) == len(cols["tensor_chunk_end"]) == n_tensors):
        return "its tensor columns do not have one row per tensor"
    if not (len(cols["chunk_offset"]) == len(cols["chunk_nbytes"]) == len(cols["chunk_checksum"]) == n_chunks):
        return "its chunk columns differ in length"
    if len(cols["shard_chunk_end"]) != n_shards:
        return "its shard columns differ in length"
    if n_tensors and (cols["tensor_dtype"] >= len(itemsizes)).any():
        return "a tensor names a dtype beyond the dtype table"
    if int(cols["tensor_ndim"].sum(dtype=np.int64)) != len(cols["dims"]):
        return "the tensors' numbers of dimensions do not add up to the dimensions listed"
    ends = np.concatenate((cols["tensor_chunk_end"], cols["shard_chunk_end"]))
    if len(ends) and ((np.diff(ends) < 0).any() or ends[0] < 0 or ends[-1] != n_chunks):
        return "the chunk ranges of its tensors and shards are not consecutive"
    if not len(ends) and n_chunks:
        return "it lists chunks of no entry"
    offset, nbytes = cols["chunk_offset"], cols["chunk_nbytes"]
    if n_chunks:
        if (cols["chunk_file"] >= len(files)).any():
            return "a chunk names a data file beyond the file table"
        if (offset < 0).any() or (nbytes < 0).any() or (offset >= MAX_VALUE).any() or (nbytes >= MAX_VALUE).any():
            return "a chunk's offset or size is negative or out of range"
        sizes = np.array(list(files.values()), dtype=np.int64)
        beyond = np.flatnonzero(offset + nbytes > sizes[cols["chunk_file"]])
        if len(beyond):
            i = int(beyond[0])
            return (f"a chunk claims bytes {int(offset[i])}..{int(offset[i] + nbytes[i])} of "
                    f"{list(files)[int(cols['chunk_file'][i])]}, beyond its recorded size")
    dims = cols["dims"]
    if len(dims) and ((dims < 0).any() or (dims >= MAX_VALUE).any()):
        return "a tensor's shape holds a negative or out-of-range size"
    stored = np.concatenate(([0], np.cumsum(nbytes, dtype=np.int64)))
    if n_tensors:
        tensor_ends = cols["tensor_chunk_end"]
        held = stored[tensor_ends] - stored[np.concatenate(([0], tensor_ends[:-1]))]
        need = _segment_products(dims, cols["tensor_ndim"]) * itemsizes[cols["tensor_dtype"]]
        wrong = np.flatnonzero(held != need)
        if len(wrong):
            i = int(wrong[0])
            return (f"tensor {header['tensors'][i]!r:.200}: its chunks hold {int(held[i])} bytes, but its shape "
                    f"and dtype need {need[i]}")
    return _shards_problem(header, cols, stored) if n_shards or header["sharded"] else None


def _segment_products(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The product of each run of ``lengths[i]`` consecutive ``values`` (1 for an empty run); Python ints (an
    object array) where one could overflow 64 bits: a crafted shape must not wrap around to a small size."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64) if len(lengths) else \
        np.zeros(0, dtype=np.int64)
    bits = np.concatenate(([0.0], np.cumsum(np.log2(np.maximum(values, 1).astype(np.float64)))))
    if ((bits[starts + lengths] - bits[starts]) < 60).all():
        out = np.ones(len(lengths), dtype=np.int64)
        nonempty = lengths > 0
        if nonempty.any():
            s, n = starts[nonempty], lengths[nonempty].astype(np.int64)
            bounds = np.empty(2 * len(s), dtype=np.int64)
            bounds[0::2], bounds[1::2] = s, s + n  # reduceat multiplies from each bound up to the next
            out[nonempty] = np.multiply.reduceat(np.append(values, 1), bounds)[0::2]
        return out
    out = np.ones(len(lengths), dtype=object)
    for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        for v in values[s:s + n].tolist():
            out[i] *= v
    return out


def _shards_problem(header: dict[str, Any], cols: dict[str, np.ndarray], stored: np.ndarray) -> str | None:
    sharded = header["sharded"]
    if len(set(s[0] for s in sharded)) != len(sharded):
        return "a sharded tensor is listed twice"
    tensor = cols["shard_tensor"]
    if len(tensor) and (tensor >= len(sharded)).any():
        return "a shard names a sharded tensor beyond the table"
    try:
        itemsizes = [dtype_itemsize(Raw.TENSOR, s[1]) for s in sharded]
    except CorruptSnapshotError as e:
        return str(e)
    box, position = cols["shard_box"], 0
    first = len(cols["tensor_chunk_end"]) and int(cols["tensor_chunk_end"][-1])
    starts = np.concatenate(([first], cols["shard_chunk_end"][:-1])) if len(tensor) else []
    for i, (t, start, end) in enumerate(zip(tensor.tolist(), list(starts), cols["shard_chunk_end"].tolist())):
        path, dtype, shape = sharded[t]
        ndim = len(shape)
        if position + 2 * ndim > len(box):
            return "the shards' boxes run past the box column"
        offsets, sizes = box[position:position + ndim].tolist(), box[position + ndim:position + 2 * ndim].tolist()
        position += 2 * ndim
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            return f"{path!r:.200}: shard {i} (offsets {offsets}, sizes {sizes}) does not lie within {shape}"
        count = 1
        for s in sizes:
            count *= s
        if int(stored[end] - stored[int(start)]) != count * itemsizes[t]:
            return f"{path!r:.200}: shard {i}'s chunks do not hold its {sizes} elements of {dtype}"
    if position != len(box):
        return "the box column holds more than the shards' boxes"
    return None
