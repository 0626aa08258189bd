"""Encoding of values into the manifest's JSON, without pickle.

Tensors and numpy arrays are stored as raw bytes elsewhere; this module maps
dtypes to names and turns the other common values (numbers, strings, bools,
None, bytes, tuples, lists, dicts, small numpy arrays, torch dtypes and
devices) into tagged JSON that any reader can decode.
"""
from __future__ import annotations

import base64
import collections
import math
from typing import Any

import numpy as np
import torch

from ppe_snapshot.errors import CorruptSnapshotError, UnsupportedValueError

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
_TORCH_DTYPE_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of a torch dtype (``"float32"``)."""
    try:
        return _TORCH_DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedValueError(f"tensors of dtype {dtype} cannot be stored as raw bytes") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise CorruptSnapshotError(f"unknown tensor dtype {name!r} in manifest") from None


def can_store_raw(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _TORCH_DTYPE_NAMES and tensor.layout == torch.strided and not tensor.is_quantized


def is_raw_array(value: Any) -> bool:
    """numpy arrays whose bytes mean the same thing in any process (no object dtype)."""
    return isinstance(value, np.ndarray) and not value.dtype.hasobject


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encode_value(value: Any) -> Any:
    """Tagged JSON for ``value``; raises :class:`UnsupportedValueError` when only pickle could store it."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and type(value) is int:
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, list) and type(value) is list:
        return [encode_value(v) for v in value]
    if type(value) is tuple:
        return {"$tuple": [encode_value(v) for v in value]}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if type(value) in (dict, collections.OrderedDict):
        tag = "$dict" if type(value) is dict else "$odict"
        return {tag: [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": _b64(bytes(value))}
    if type(value) is complex:
        return {"$complex": [encode_value(value.real), encode_value(value.imag)]}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, (set, frozenset)):
        return {"$set" if isinstance(value, set) else "$frozenset": [encode_value(v) for v in value]}
    if isinstance(value, np.generic) and not isinstance(value, np.object_):
        return {"$npscalar": [value.dtype.str, _b64(value.tobytes())]}
    if is_raw_array(value):
        return {"$ndarray": [value.dtype.str, list(value.shape), _b64(np.ascontiguousarray(value).tobytes())]}
    raise UnsupportedValueError(
        f"a value of type {type(value).__module__}.{type(value).__qualname__} can only be saved with pickle; "
        "pass allow_pickle=True to save it that way, or convert it to tensors and plain Python values")


def _decode_tagged(tag: str, body: Any) -> Any:
    if tag == "$float":
        return float(body)
    if tag == "$tuple":
        return tuple(decode_value(v) for v in body)
    if tag == "$size":
        return torch.Size(body)
    if tag in ("$dict", "$odict"):
        items = ((decode_value(k), decode_value(v)) for k, v in body)
        return dict(items) if tag == "$dict" else collections.OrderedDict(items)
    if tag == "$bytes":
        return base64.b64decode(body)
    if tag == "$complex":
        return complex(decode_value(body[0]), decode_value(body[1]))
    if tag == "$dtype":
        return getattr(torch, body)
    if tag == "$device":
        return torch.device(body)
    if tag in ("$set", "$frozenset"):
        items = [decode_value(v) for v in body]
        return set(items) if tag == "$set" else frozenset(items)
    if tag == "$npscalar":
        return np.frombuffer(base64.b64decode(body[1]), dtype=np.dtype(body[0]))[0]
    if tag == "$ndarray":
        dtype, shape, data = body
        return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()
    raise CorruptSnapshotError(f"unknown value tag {tag!r} in manifest")


def decode_value(encoded: Any) -> Any:
    """The inverse of :func:`encode_value`."""
    if isinstance(encoded, list):
        return [decode_value(v) for v in encoded]
    if isinstance(encoded, dict):
        if len(encoded) != 1:
            raise CorruptSnapshotError(f"malformed value in manifest: {encoded!r:.200}")
        ((tag, body),) = encoded.items()
        return _decode_tagged(tag, body)
    return encoded
