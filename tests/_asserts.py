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
