"""Crafted snapshots: a real small snapshot whose manifest (and data) a test rewrites, from docs/format.md only.

Nothing here imports ppe-snapshot's manifest code: the layout is taken from the
format document (sections 2, 4 and 5), as a hostile or buggy writer would.

    path = take_small(tmp_path / "s")
    craft(path, lambda doc: entry(doc, "m/w")["shape"].append(2))
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from ppe_snapshot import Snapshot, StateDict

DATA = "data/rank0.bin"

#: The columns of an index file, in file order, with their little-endian numpy types (docs/format.md, section 11).
COLUMNS = [("tensor_dtype", "<u4"), ("tensor_ndim", "<u4"), ("tensor_chunk_end", "<i8"), ("dims", "<i8"),
           ("chunk_file", "<u4"), ("chunk_offset", "<i8"), ("chunk_nbytes", "<i8"), ("chunk_checksum", "<u8"),
           ("shard_tensor", "<u4"), ("shard_box", "<i8"), ("shard_chunk_end", "<i8")]
RANK0 = "index/rank0.idx"


def read_index(file: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The JSON header and the columns (writable copies) of an index file, read by the format document."""
    data = file.read_bytes()
    assert data[:8] == b"PPESIDX2"
    (length,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[16:16 + length])
    position = 16 + length + (-(16 + length)) % 8
    cols = {}
    for name, dtype in COLUMNS:
        count = header["columns"][name]
        cols[name] = np.frombuffer(data, dtype=dtype, count=count, offset=position).copy()
        position += cols[name].nbytes
    return header, cols


def write_index(file: Path, header: dict[str, Any], cols: dict[str, np.ndarray], fix_counts: bool = True) -> None:
    """Write an index file of ``header`` and ``cols`` with a checksum that matches (``fix_counts``: the header's
    column counts made the columns' lengths), as a hostile writer would."""
    if fix_counts:
        header["columns"] = {name: len(cols[name]) for name, _ in COLUMNS}
    head = json.dumps(header).encode()
    body = struct.pack("<8sQ", b"PPESIDX2", len(head)) + head + bytes((-(16 + len(head))) % 8)
    body += b"".join(np.asarray(cols[name], dtype=dtype).tobytes() for name, dtype in COLUMNS)
    file.write_bytes(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))


def craft_index(path: Path, mutate: Callable[[dict[str, Any], dict[str, np.ndarray]], Any], name: str = RANK0,
                fix_counts: bool = True) -> Path:
    """Rewrite index file ``name`` of the snapshot at ``path`` with ``mutate`` (which edits header and columns)."""
    header, cols = read_index(path / name)
    mutate(header, cols)
    write_index(path / name, header, cols, fix_counts)
    return path


#: The values ``take_small`` saves under app state key ``"m"``.
WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4)
BIAS = torch.arange(4, dtype=torch.float64)
ARRAY = np.arange(6, dtype=np.int32)
TOP = torch.arange(8, dtype=torch.float32).reshape(2, 4)
BOTTOM = torch.arange(8, 16, dtype=torch.float32).reshape(2, 4)


def take_small(path: Path) -> Path:
    """A committed one-rank snapshot: tensors ``m/w``, ``m/b``, ``m/top``, ``m/bottom``, an array ``m/n``
    and a value ``m/step``."""
    Snapshot.take(str(path), {"m": StateDict(w=WEIGHT.clone(), b=BIAS.clone(), n=ARRAY.copy(), top=TOP.clone(),
                                             bottom=BOTTOM.clone(), step=3)})
    return path


def read_doc(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def write_doc(path: Path, doc: Any) -> None:
    (path / "manifest.json").write_text(json.dumps(doc))


def craft(path: Path, mutate: Callable[[dict[str, Any]], Any]) -> Path:
    """Rewrite the manifest of the snapshot at ``path`` with ``mutate`` (which edits the document in place)."""
    doc = read_doc(path)
    mutate(doc)
    write_doc(path, doc)
    return path


def entry(doc: dict[str, Any], path: str, rank: int = 0) -> dict[str, Any]:
    """The entry of ``path`` as rank ``rank`` looks it up: ``ranks[r]``, else ``replicated``, else ``sharded``."""
    for section in (doc["ranks"][rank], doc["replicated"], doc.get("sharded", {})):
        if path in section:
            return section[path]
    raise KeyError(path)


def append_payload(path: Path, doc: dict[str, Any], data: bytes) -> dict[str, Any]:
    """Append ``data`` to rank 0's data file at the next multiple of 64, record the file's new size in
    ``doc["files"]`` and return the chunk that describes it (with its xxh3_64 checksum)."""
    file = path / DATA
    offset = (os.path.getsize(file) + 63) // 64 * 64
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)
        f.truncate((offset + len(data) + 63) // 64 * 64)
    doc["files"][DATA] = os.path.getsize(file)
    return {"file": DATA, "offset": offset, "nbytes": len(data), "checksum": xxhash.xxh3_64_hexdigest(data)}


def make_sharded(doc: dict[str, Any]) -> None:
    """Replace ``m/top`` and ``m/bottom`` by one sharded tensor ``m/grid`` of shape [4, 4] whose two shards
    are their bytes (rows 0-1 and 2-3); restored, it equals ``torch.cat([TOP, BOTTOM])``."""
    ranks = doc["ranks"][0]
    top, bottom = ranks.pop("m/top"), ranks.pop("m/bottom")
    doc["sharded"]["m/grid"] = {
        "type": "sharded", "dtype": "float32", "shape": [4, 4], "replicated": True,
        "shards": [{"offsets": [0, 0], "sizes": [2, 4], "chunks": top["chunks"]},
                   {"offsets": [2, 0], "sizes": [2, 4], "chunks": bottom["chunks"]}],
    }
    keys = ranks["m"]["keys"]
    keys[keys.index("top")] = "grid"
    keys.remove("bottom")


def write_deep_manifest(path: Path, where: str, depth: int, long_integer: bool) -> None:
    """Make the manifest nest ``depth`` levels deep in ``where`` ("metadata" or an object entry's value),
    written as text so no JSON library recurses; ``long_integer`` adds a 22-digit integer to the metadata,
    which sends the parse to the standard library's ``json`` instead of orjson."""
    doc = read_doc(path)
    marker = "__DEEP__"
    if where == "metadata":
        doc["metadata"] = {"deep": marker}
    else:
        entry(doc, where)["value"] = marker
    if long_integer:
        doc["metadata"]["big"] = 1234567890123456789012
    text = json.dumps(doc).replace(json.dumps(marker), "[" * depth + "0" + "]" * depth)
    (path / "manifest.json").write_text(text)
