"""Random damage to a snapshot, the way a buggy or hostile writer would make it, for the seeded sweeps
(``_random_crafting.py``: one snapshot read every way; ``_random_run_dirs.py``: a run directory autoloaded).

A damage is one of: a manifest or index header field replaced, removed or copied from elsewhere; an index
column's value changed, or a column cut or grown, the index checksum recomputed (as a hostile writer's would
be); a data file's byte flipped or the file cut.
"""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from _crafted import COLUMNS, read_index, write_index

#: What a crafted field becomes: integers at the edges of every column type, and values of every JSON kind.
NASTY_INTS = [0, -1, 1, 2, 3, 7, 64, 100_000, 1 << 31, 1 << 32, 1 << 40, (1 << 63) - 1, -(1 << 63)]
NASTY = NASTY_INTS + [None, True, False, "", "../x", "/etc/passwd", "data/rank0.bin", 1.5, float("nan"), [], {},
                      [0], [[0]], [1, 2], {"a": 1}, "float32", "<f4", "|O", "tensor", "ndarray", "object",
                      "container", "sharded", "dict", "0" * 16]


def nodes(doc: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    yield path, doc
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in list(children):
        yield from nodes(value, path + (key,))


def damage_json(rng: random.Random, doc: Any) -> None:
    """One to three fields of ``doc`` replaced by a nasty value or a neighbour, or removed."""
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        # (the 625 words of Python's generator state would take most picks)
        where = [(p, v) for p, v in nodes(doc) if p and ("python" not in map(str, p) or rng.random() < 0.01)]
        path, value = rng.choice(where)
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        pick = rng.random()
        if pick < 0.6:
            numeric = isinstance(value, int) and not isinstance(value, bool)
            parent[path[-1]] = value + rng.choice([-1, 1, 8, -8, 64, 1 << 20]) if numeric and rng.random() < 0.5 \
                else copy.deepcopy(rng.choice(NASTY))
        elif pick < 0.9:
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(where)[1])


def damage_snapshot(rng: random.Random, path: Path, manifest_only: bool = False) -> str:
    """Damage the engine snapshot at ``path`` once (``manifest_only``: its manifest, version 1's one document);
    what was damaged."""
    pick = rng.random()
    if manifest_only or pick < 0.2:
        doc = json.loads((path / "manifest.json").read_text())
        damage_json(rng, doc)
        (path / "manifest.json").write_text(json.dumps(doc))
        return "manifest"
    if pick > 0.95:
        data = rng.choice(sorted((path / "data").iterdir()))
        size = data.stat().st_size
        with open(data, "r+b") as f:
            if rng.random() < 0.5:
                f.truncate(rng.randrange(size))
            else:
                f.seek(at := rng.randrange(size))
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0x5A]))
        return f"data file {data.name}"
    index = rng.choice(sorted((path / "index").iterdir()))
    header, cols = read_index(index)
    filled = [n for n, _ in COLUMNS if len(cols[n])]  # (the shared index of a state saved per rank has none)
    if pick < 0.55 or not filled:
        damage_json(rng, header)
        what = f"{index.name} header"
    else:
        name = rng.choice(filled)
        column, change = cols[name], rng.random()
        if change < 0.7:
            at = rng.randrange(len(column))
            limits = np.iinfo(column.dtype)
            value = rng.choice(NASTY_INTS + [int(column[at]) + d for d in (-1, 1, 4, -4, 64)])
            column[at] = max(limits.min, min(limits.max, value))
        else:
            cols[name] = column[:-1] if change < 0.85 else np.append(column, column[-1:]).astype(column.dtype)
        what = f"{index.name} column {name}"
    write_index(index, header, cols, fix_counts=rng.random() < 0.85)
    return what
