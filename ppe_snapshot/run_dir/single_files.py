"""ppe's single-file snapshots (written with ``savefun=torch.save``): checking, peeking, loading.

Nothing here runs code from the file: the quick check reads its first bytes,
the training position is read from its pickle record with every class
stubbed, and loading uses ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

import numpy as np
import torch

from ppe_snapshot.storage import Tree, open_url
from ppe_snapshot.stored_snapshot import recorded_count

#: How a ``torch.save`` file begins: a zip archive (the default), or a pickle (the legacy format).
_FILE_MAGIC = (b"PK\x03\x04", b"\x80")


def file_problem(tree: Tree, path: str) -> str | None:
    """Why the file at ``path`` is not a ``torch.save`` file (the quick check: its first bytes), or None."""
    try:
        with tree.open(path, "rb") as f:
            head = f.read(4)
    except Exception as e:  # noqa: BLE001 - unreadable: not a usable snapshot
        return f"cannot be read: {type(e).__name__}: {e}"
    if not head:
        return "it is an empty file"
    if not head.startswith(_FILE_MAGIC):
        return "it is neither a directory with a manifest nor a torch.save file"
    return None


class _Stub:
    """Stands for any object a pickle refers to, so a pickle can be read without running its code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _PeekUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        return None


#: The largest pickle record read for a training position (a manager's state pickles to kilobytes: its tensors
#: are records of their own).
MAX_PEEKED_RECORD = 64 << 20


def recorded_iteration(tree: Tree, path: str) -> int | None:
    """``_start_iteration`` of a ``torch.save``'d manager state, reading only its small pickle record.

    No code from the file runs and no tensor data is read. None for other
    targets, the legacy (non-zip) format, an unreadable file, or a record compressed (torch.save never does)
    or larger than ``MAX_PEEKED_RECORD`` (an allocation the file's bytes on disk would not bound).
    """
    try:
        with tree.open(path, "rb") as f, zipfile.ZipFile(f) as archive:
            records = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not records:
                return None
            record = archive.getinfo(min(records, key=len))
            # torch.save stores its records uncompressed: a compressed one could unpack to any size
            if record.compress_type != zipfile.ZIP_STORED or record.file_size > MAX_PEEKED_RECORD:
                return None
            state = _PeekUnpickler(io.BytesIO(archive.read(record))).load()
    except Exception:  # noqa: BLE001 - the position then comes from the file name
        return None
    value = state.get("_start_iteration") if isinstance(state, dict) else None
    return recorded_count(value)


def load_file(url: str, storage_options: dict[str, Any] | None) -> Any:
    """A single-file (``torch.save``) snapshot, loaded with ``weights_only``.

    numpy arrays are allowed too: the numpy RNG state (``RNGState``) holds one.
    """
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    numpy_globals = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with open_url(url, "rb", storage_options) as f, torch.serialization.safe_globals(numpy_globals):
        return torch.load(f, map_location=torch.device("cpu"), weights_only=True)
