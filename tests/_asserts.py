"""Assertions shared by the tests."""
from __future__ import annotations

from typing import Any

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
