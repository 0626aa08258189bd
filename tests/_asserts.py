"""Assertions shared by the tests."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Bit-exact equality of nested state: tensors of the same dtype with equal values (on any device),
    dicts with the same keys in the same order, sequences of the same type and length, other values ==."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual.cpu(), expected.cpu()), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), \
            f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}/{i}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def manifest_doc(path: Any) -> dict[str, Any]:
    """The manifest of the committed snapshot at ``path`` as one version-1 JSON document, whatever version it
    was written as (the engine renders a version-2 snapshot's index files in the version-1 layout)."""
    import json

    from ppe_snapshot.engine import read_manifest
    from ppe_snapshot.storage import open_storage

    return json.loads(read_manifest(open_storage(str(path))).to_bytes())


@contextlib.contextmanager
def written_as(version: int) -> Iterator[None]:
    """Takes in this process write format ``version`` inside the block."""
    from ppe_snapshot.settings import SETTINGS

    before, SETTINGS.format_version = SETTINGS.format_version, version
    try:
        yield
    finally:
        SETTINGS.format_version = before


def assert_ranged_reads_scatter(storage: Any, stream: bool) -> None:
    """A :class:`RangedReader` of ``storage`` (an object store) scatters 100 kB ranges over views of any size, and
    a range past the end is EOFError; ``stream``: whether it streams responses into place."""
    import pytest

    from ppe_snapshot.storage.ranged import RangedReader
    from ppe_snapshot.storage.tuning import Tuning

    data = bytes(range(256)) * 4000  # 1,024,000 bytes
    storage.put_atomic("blob", data)
    reader = RangedReader(storage.fs, Tuning(part_size=8 << 20, upload_concurrency=4, read_part_size=100_000,
                                             read_workers=4))
    if not stream:
        reader._stream = None
    assert (reader._stream is not None) == stream
    views = [memoryview(bytearray(n)) for n in (3, 250_000, 0, 99_997, 500_000)]
    reader.read(f"{storage.root}/blob", 1000, views)
    assert b"".join(bytes(v) for v in views) == data[1000:1000 + 850_000]
    for start in (1_000_000, 2_000_000):  # the range ends past the end / starts past it
        with pytest.raises(EOFError, match="expected at least"):
            reader.read(f"{storage.root}/blob", start, [memoryview(bytearray(50_000))])
