"""Encoding of values into the manifest's JSON, without pickle.

Tensors and numpy arrays are stored as raw bytes elsewhere; this module maps
dtypes to names and turns the other common values (numbers, strings, bools,
None, bytes, tuples, lists, dicts, small numpy arrays, torch dtypes and
devices, sets, Enum members, namedtuples and dataclasses of such values) into
tagged JSON that any reader can decode without running code named by the
snapshot: classes are only looked up among already imported modules.
"""
from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import enum
import inspect
import math
import sys
from typing import Any, Callable

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
#: The tensor types whose memory is the tensor (no subclass with storage semantics of its own).
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
#: The dtypes stored as raw bytes, with their names in a manifest.
RAW_DTYPE_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
#: Every dtype torch defines (quantized ones included), as a ``$dtype`` value may name them.
_ALL_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of a torch dtype (``"float32"``)."""
    try:
        return RAW_DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedValueError(f"tensors of dtype {dtype} cannot be stored as raw bytes") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise CorruptSnapshotError(f"unknown tensor dtype {name!r} in manifest") from None


def can_store_raw(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements are plain bytes in memory (not nested, meta, sparse or quantized)."""
    return tensor.dtype in RAW_DTYPE_NAMES and tensor.layout == torch.strided and not tensor.is_quantized \
        and not tensor.is_nested and not tensor.is_meta


def memory_problem(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s elements are not plain strided memory (meta, nested, another layout, quantized), in words;
    None where they are."""
    if tensor.is_meta:
        return "is a meta tensor, which holds no data"
    if tensor.is_nested:
        return "is a nested tensor"
    if tensor.layout != torch.strided:
        return f"has layout {tensor.layout}"
    if tensor.is_quantized:
        return "is quantized"
    return None


def raw_storage_problem(tensor: torch.Tensor) -> str:
    """Why :func:`can_store_raw` refuses ``tensor``, in words."""
    return memory_problem(tensor) or f"has dtype {tensor.dtype}"


def is_raw_array(value: Any) -> bool:
    """numpy arrays whose bytes mean the same thing in any process (no object dtype)."""
    return isinstance(value, np.ndarray) and not value.dtype.hasobject


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


#: Values nested deeper than this are not written, and refused as damage when read (before Python's stack runs out).
MAX_DEPTH = 200


# -- classes named in the manifest (Enum, namedtuple, dataclass) ----------------------

#: The kinds of classes a manifest may name, with the check a class must pass to be one.
_CLASS_KINDS: dict[str, Callable[[type], bool]] = {
    "$enum": lambda cls: issubclass(cls, enum.Enum),
    "$namedtuple": lambda cls: issubclass(cls, tuple) and isinstance(inspect.getattr_static(cls, "_fields", None),
                                                                     tuple),
    "$dataclass": lambda cls: dataclasses.is_dataclass(cls),
}


def _imported_class(module: Any, qualname: Any) -> type | None:
    """The class ``module.qualname`` if this process has already imported it; never imports anything."""
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        if obj is None or not part.isidentifier() or part.startswith("__"):
            return None
        obj = inspect.getattr_static(obj, part, None)  # no properties or __getattr__ run
    return obj if isinstance(obj, type) else None


def _class_ref(value: Any) -> list[str] | None:
    """``[module, qualname]`` of ``value``'s class when a reader can find the class by them."""
    cls = type(value)
    module, qualname = cls.__module__, cls.__qualname__
    return [module, qualname] if _imported_class(module, qualname) is cls else None


def _class_of(tag: str, module: Any, qualname: Any) -> type:
    """The class a manifest names, if already imported and of the tag's kind; else CorruptSnapshotError."""
    kind = tag[1:]
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise CorruptSnapshotError(f"malformed {kind} class name in manifest: {module!r:.100}, {qualname!r:.100}")
    if module not in sys.modules:
        raise CorruptSnapshotError(
            f"the manifest holds a value of class {module}.{qualname:.100} ({kind}), but module {module!r:.100} is "
            "not imported in this process; import it before restoring (reading a snapshot never imports modules)")
    cls = _imported_class(module, qualname)
    if cls is None or not _CLASS_KINDS[tag](cls):
        raise CorruptSnapshotError(
            f"the manifest names {module}.{qualname:.100} as the class of a {kind} value, which it is not; refused")
    return cls


def _encode_instance(value: Any, depth: int) -> Any:
    """Tagged JSON for an Enum member, a namedtuple or a dataclass instance; None for anything else."""
    if isinstance(value, enum.Enum):
        ref = _class_ref(value)
        if ref is None or type(value).__members__.get(value.name) is not value:  # e.g. a combination of flags
            return None
        return {"$enum": [*ref, value.name]}
    if isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple):
        ref = _class_ref(value)
        return None if ref is None else {"$namedtuple": [*ref, [encode_value(v, depth) for v in value]]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        ref = _class_ref(value)
        fields = dataclasses.fields(value)
        attributes = getattr(value, "__dict__", None)  # None with slots=True
        if ref is None or not all(f.init for f in fields) or \
                (attributes is not None and attributes.keys() != {f.name for f in fields}):
            return None  # state __init__ cannot rebuild: only pickle keeps it
        return {"$dataclass": [*ref, [[f.name, encode_value(getattr(value, f.name), depth)] for f in fields]]}
    return None


def _decode_instance(tag: str, body: Any, depth: int) -> Any:
    if not isinstance(body, list) or len(body) != 3:
        raise CorruptSnapshotError(f"malformed {tag} value in manifest")
    module, qualname, content = body
    cls = _class_of(tag, module, qualname)
    if tag == "$enum":
        member = cls.__members__.get(content) if isinstance(content, str) else None
        if member is None:
            raise CorruptSnapshotError(f"{module}.{qualname} has no member {content!r}")
        return member
    if not isinstance(content, list):
        raise CorruptSnapshotError(f"malformed {tag} value in manifest")
    if tag == "$namedtuple":
        if len(content) != len(cls._fields):
            raise CorruptSnapshotError(f"{module}.{qualname} has {len(cls._fields)} fields, the manifest "
                                       f"gives {len(content)}")
        return tuple.__new__(cls, [_decode(v, depth) for v in content])
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if not all(isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) for item in content) \
            or len(content) != len(names) or {item[0] for item in content} != names:
        raise CorruptSnapshotError(f"the manifest's fields of {module}.{qualname} do not match its init fields")
    return cls(**{name: _decode(v, depth) for name, v in content})


def encode_value(value: Any, depth: int = 0) -> Any:
    """Tagged JSON for ``value``; raises :class:`UnsupportedValueError` when only pickle could store it."""
    if value is None or type(value) in (bool, str):
        return value
    depth += 1
    if depth > MAX_DEPTH:  # a reader would refuse it
        raise UnsupportedValueError(f"the value nests containers deeper than {MAX_DEPTH} levels; "
                                    "store it with allow_pickle=True or flatten it")
    if isinstance(value, int) and type(value) is int:
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, list) and type(value) is list:
        return [encode_value(v, depth) for v in value]
    if type(value) is tuple:
        return {"$tuple": [encode_value(v, depth) for v in value]}
    if isinstance(value, torch.Size):
        return {"$size": list(value)}
    if type(value) in (dict, collections.OrderedDict):
        tag = "$dict" if type(value) is dict else "$odict"
        return {tag: [[encode_value(k, depth), encode_value(v, depth)] for k, v in value.items()]}
    if isinstance(value, enum.Enum):  # before str and int: StrEnum, IntEnum members stay members
        return _encode_instance(value, depth) or _needs_pickle(value)
    if isinstance(value, str):  # a subclass, read back as str
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": _b64(bytes(value))}
    if type(value) is complex:
        return {"$complex": [encode_value(value.real, depth), encode_value(value.imag, depth)]}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, (set, frozenset)):
        return {"$set" if isinstance(value, set) else "$frozenset": [encode_value(v, depth) for v in value]}
    if isinstance(value, np.generic) and not isinstance(value, np.object_):
        return {"$npscalar": [value.dtype.str, _b64(value.tobytes())]}
    if is_raw_array(value):
        return {"$ndarray": [value.dtype.str, list(value.shape), _b64(np.ascontiguousarray(value).tobytes())]}
    return _encode_instance(value, depth) or _needs_pickle(value)


def _needs_pickle(value: Any) -> Any:
    raise UnsupportedValueError(
        f"a value of type {type(value).__module__}.{type(value).__qualname__} can only be saved with pickle; "
        "pass allow_pickle=True to save it that way, or convert it to tensors and plain Python values")


def _malformed(tag: str, body: Any) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"malformed {tag} value in manifest: {body!r:.200}")


def _unb64(tag: str, body: Any) -> bytes:
    if not isinstance(body, str):
        raise _malformed(tag, body)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise _malformed(tag, body) from None


def _np_dtype(tag: str, name: Any) -> np.dtype:
    """A numpy dtype named in the manifest; never an object dtype (its bytes would be pointers)."""
    if not isinstance(name, str):
        raise _malformed(tag, name)
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError):
        raise CorruptSnapshotError(f"unknown numpy dtype {name!r} in manifest") from None
    if dtype.hasobject:
        raise CorruptSnapshotError(f"numpy dtype {name!r} in manifest holds Python objects; refused")
    return dtype


def _items(tag: str, body: Any, length: int | None = None) -> list:
    if not isinstance(body, list) or (length is not None and len(body) != length):
        raise _malformed(tag, body)
    return body


def _decode_tagged(tag: str, body: Any, depth: int) -> Any:
    if tag == "$float":
        if body not in ("nan", "inf", "-inf"):
            raise _malformed(tag, body)
        return float(body)
    if tag == "$tuple":
        return tuple(_decode(v, depth) for v in _items(tag, body))
    if tag == "$size":
        if not all(type(v) is int and v >= 0 for v in _items(tag, body)):
            raise _malformed(tag, body)
        return torch.Size(body)
    if tag in ("$dict", "$odict"):
        pairs = _items(tag, body)
        if not all(type(kv) is list and len(kv) == 2 for kv in pairs):
            raise _malformed(tag, body)
        items = [(_decode(k, depth), _decode(v, depth)) for k, v in pairs]
        try:
            return dict(items) if tag == "$dict" else collections.OrderedDict(items)
        except TypeError:  # an unhashable key
            raise _malformed(tag, body) from None
    if tag == "$bytes":
        return _unb64(tag, body)
    if tag == "$complex":
        real, imag = (_decode(v, depth) for v in _items(tag, body, 2))
        if not all(type(v) is float for v in (real, imag)):
            raise _malformed(tag, body)
        return complex(real, imag)
    if tag == "$dtype":
        if body not in _ALL_TORCH_DTYPES:
            raise CorruptSnapshotError(f"unknown torch dtype {body!r} in manifest")
        return _ALL_TORCH_DTYPES[body]
    if tag == "$device":
        if not isinstance(body, str):
            raise _malformed(tag, body)
        try:
            return torch.device(body)
        except (RuntimeError, TypeError, ValueError):
            raise _malformed(tag, body) from None
    if tag in ("$set", "$frozenset"):
        try:
            items = [_decode(v, depth) for v in _items(tag, body)]
            return set(items) if tag == "$set" else frozenset(items)
        except TypeError:  # an unhashable member
            raise _malformed(tag, body) from None
    if tag == "$npscalar":
        name, data = _items(tag, body, 2)
        dtype, raw = _np_dtype(tag, name), _unb64(tag, data)
        if len(raw) != dtype.itemsize:
            raise _malformed(tag, body)
        return np.frombuffer(raw, dtype=dtype)[0]
    if tag == "$ndarray":
        name, shape, data = _items(tag, body, 3)
        dtype, raw = _np_dtype(tag, name), _unb64(tag, data)
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape) \
                or math.prod(shape) * dtype.itemsize != len(raw):
            raise CorruptSnapshotError(f"$ndarray in manifest: shape {shape!r:.100} of {name} does not match "
                                       f"its {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if tag in _CLASS_KINDS:
        return _decode_instance(tag, body, depth)
    raise CorruptSnapshotError(f"unknown value tag {tag!r:.100} in manifest")


def _decode(encoded: Any, depth: int) -> Any:
    if isinstance(encoded, list):
        if depth >= MAX_DEPTH:
            raise CorruptSnapshotError(f"a value nested too deeply (deeper than {MAX_DEPTH} levels)")
        return [_decode(v, depth + 1) for v in encoded]
    if isinstance(encoded, dict):
        if depth >= MAX_DEPTH:
            raise CorruptSnapshotError(f"a value nested too deeply (deeper than {MAX_DEPTH} levels)")
        if len(encoded) != 1:
            raise CorruptSnapshotError(f"malformed value in manifest: {encoded!r:.200}")
        ((tag, body),) = encoded.items()
        return _decode_tagged(tag, body, depth + 1)
    if encoded is None or type(encoded) in (str, int, float, bool):
        return encoded
    raise CorruptSnapshotError(f"a value of type {type(encoded).__name__} cannot appear in a manifest")


def decode_value(encoded: Any) -> Any:
    """The inverse of :func:`encode_value`; raises only :class:`CorruptSnapshotError` for malformed input.

    Classes (Enum, namedtuple, dataclass) are looked up among the modules this
    process has already imported, and must be of the kind their tag says;
    nothing is imported and no other code named by the snapshot runs.
    """
    if encoded is None or type(encoded) in (str, int, bool, float):  # most values: no tag to check
        return encoded
    try:
        return _decode(encoded, 0)
    except CorruptSnapshotError:
        raise
    except Exception as e:  # a class's own __init__ / __post_init__ refusing the values
        raise CorruptSnapshotError(f"cannot decode a value of the manifest ({e!r:.200})") from e
