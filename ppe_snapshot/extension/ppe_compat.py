"""The snapshot extension's arguments and writer, the way ppe 0.9's extension takes them.

ppe's extension uses ``manager.writer`` when ``writer`` is None, looked up
when the snapshot first runs. ppe's own built-in writers (the manager's
default ``SimpleWriter``, its Thread / Process / queue writers) save single
``torch.save`` files; here they are stood in for by the ``ppe_snapshot``
writer of the same kind on the same output directory, so every snapshot is
an engine snapshot unless ``savefun=`` asks for ppe's single files.
"""
from __future__ import annotations

import numbers
import posixpath
import re
import warnings
from typing import Any

import torch
from pytorch_pfn_extras import writing as ppe_writing

from ppe_snapshot import ppe_private, writing
from ppe_snapshot.run_dir import FilenameFormat, Policy, combine
from ppe_snapshot.storage import remove_local_shadow
from ppe_snapshot.writing import SnapshotWriter

#: ppe's built-in writers, and the ppe_snapshot writer that stands in for each.
_COUNTERPARTS = {
    ppe_writing.SimpleWriter: "SimpleWriter",
    ppe_writing.ThreadWriter: "ThreadWriter",
    ppe_writing.ProcessWriter: "ProcessWriter",
    ppe_writing.ThreadQueueWriter: "ThreadQueueWriter",
    ppe_writing.ProcessQueueWriter: "ProcessQueueWriter",
}


def check_writer(writer: Any) -> None:
    """Raise TypeError unless ``writer`` is None or a writer instance (ppe's protocol: callable, ``finalize()``)."""
    if writer is None or isinstance(writer, ppe_writing.Writer):
        return
    if isinstance(writer, type) or not callable(writer) or not callable(getattr(writer, "finalize", None)):
        what = f"the class {writer.__name__}" if isinstance(writer, type) else f"a {type(writer).__name__}"
        raise TypeError(f"writer must be a writer instance such as ppe_snapshot.writing.ThreadWriter() (or any "
                        f"pytorch_pfn_extras writer), or None for the manager's writer; got {what}: {writer!r}")


def check_n_retains(n_retains: Any) -> None:
    """``n_retains`` is an int: positive keeps that many snapshots, 0 or negative keeps all (as in ppe)."""
    if isinstance(n_retains, bool) or not isinstance(n_retains, numbers.Integral):
        raise TypeError(f"n_retains must be an int (the number of newest snapshots to keep; -1 keeps all), "
                        f"got {type(n_retains).__name__} {n_retains!r}")


def naming_and_retention(filename: Any, *, autoload: bool, n_retains: Any, keep: Policy | None
                         ) -> tuple[FilenameFormat | None, Policy | None]:
    """The format of the names ``filename`` gives (None for a callable), and the retention policy: ``n_retains``
    (KeepLatest) and ``keep`` together, or None. As in ppe, only a format string's names are pruned, so
    ``n_retains`` with a callable is ignored (a warning); ``autoload`` and ``keep=`` refuse a callable."""
    check_n_retains(n_retains)
    policy = combine(n_retains, keep)
    if isinstance(filename, str):
        check_inside(filename)
        return FilenameFormat(filename), policy
    if not callable(filename):
        raise TypeError(f"filename must be a format string or a callable, got {type(filename).__name__}")
    for asked, what in ((autoload, "autoload needs"), (keep is not None, "keep needs")):
        if asked:
            raise ValueError(f"{what} filename to be a format string (it is matched against the names in the output "
                             "directory); got a callable")
    if policy is not None:
        warnings.warn(f"ppe_snapshot: n_retains={n_retains} is ignored, filename is a callable (retention matches a "
                      "format string against the names in the output directory); every snapshot is kept. Give a "
                      "format string to prune.", UserWarning, stacklevel=4)
    return None, None


def check_inside(name: str, what: str = "filename") -> None:
    """Raise ValueError when snapshot name ``name`` would not stay inside the output directory."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must give a str, got {type(name).__name__} {name!r}")
    unified = name.replace("\\", "/")
    if "://" in unified or posixpath.isabs(unified) or re.match(r"[A-Za-z]:/", unified):
        raise ValueError(f"{what} {name!r} is an absolute path or URL; it must name a place inside the output "
                         "directory (give the directory as the manager's out_dir or the writer's out_dir)")
    if ".." in unified.split("/"):
        raise ValueError(f"{what} {name!r} leads out of the output directory ('..'); it must name a place "
                         "inside it")


def _plain_ppe_settings(writer: Any) -> bool:
    """Whether a ppe writer saves with ppe's defaults: ``torch.save``, no savefun keywords, the POSIX fs."""
    if not ppe_private.is_ppe_default_fs(writer.fs):
        return False
    if isinstance(writer, ppe_writing.QueueWriter):
        task = ppe_private.queue_task(writer)
        return type(task) is ppe_writing.SimpleWriter and _plain_ppe_settings(task)
    savefun, keywords = ppe_private.savefun_and_keywords(writer)
    return savefun is torch.save and not keywords


def counterpart(writer: Any) -> SnapshotWriter | None:
    """The ppe_snapshot writer standing in for ppe's built-in ``writer`` (same kind, same ``out_dir``).

    None for any other writer (ours, a subclass, one with its own savefun or
    file system): that one is called with ppe's protocol.
    """
    kind = _COUNTERPARTS.get(type(writer))
    if kind is None or not _plain_ppe_settings(writer):
        return None
    remove_local_shadow(writer.out_dir)  # made by the manager's own writer at its construction
    return getattr(writing, kind)(out_dir=writer.out_dir)


def stand_down(writer: Any, explicit: bool) -> None:
    """Release ppe's writer that was stood in for, at the extension's finalize.

    A ppe Thread / Process writer that never ran would raise "worker is not
    created" in its own ``finalize()`` (the manager calls it): it is marked
    finalized. A ppe queue writer passed to ``snapshot(writer=...)`` has a
    consumer running since its creation: it is finalized (the manager
    finalizes its own writer itself).
    """
    if ppe_private.never_ran(writer):
        ppe_private.mark_finalized(writer)
    elif explicit and isinstance(writer, ppe_writing.QueueWriter):
        writer.finalize()
