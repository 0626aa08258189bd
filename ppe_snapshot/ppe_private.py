"""Every use of pytorch_pfn_extras's private API, in one module.

ppe 0.9 documents none of what follows; the drop-in needs each of them, and
``tests/test_ppe_private.py`` pins them to the ppe versions in
:data:`TESTED_PPE`, so that a ppe release that renames one fails there, loudly,
rather than somewhere in a training loop.

=============================  ===============================================================================
``Writer._add_cleanup_hook``   how ppe's snapshot extension (and ours) registers retention with a writer
``Writer._post_save``          runs those hooks after each save (our writers call it once a save committed)
``StandardWriter._worker``     None until ppe's Thread / Process writer first saved
``StandardWriter._finalized``  set to skip the ``finalize()`` of a ppe writer that never ran ("worker is not
                               created")
``StandardWriter._savefun``,   the savefun and its keywords a ppe writer was made with
``._kwds``, ``QueueWriter._task``
``_PosixFileSystem``           the class of ppe's default file system (what a writer made without ``fs`` holds)
``manager._model_available``   ppe's guard that marks the models unavailable when no extension needing them is due
``manager.extensions``         the manager's running order of extensions, once it started them
``manager._extensions``        the extensions registered with the manager, by name, before it started them
``state_dict()["extensions"]`` the extensions' states in a manager's state, by the names they were registered under
=============================  ===============================================================================
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

from pytorch_pfn_extras import writing as ppe_writing

#: The pytorch_pfn_extras versions (major.minor) whose private names this module was checked against.
TESTED_PPE = ("0.8", "0.9")

#: The class of ppe's default file system (POSIX paths), private in ppe (``writing._writer_base._PosixFileSystem``).
PPE_DEFAULT_FS = type(ppe_writing.Writer().fs)


def is_ppe_default_fs(fs: Any) -> bool:
    """Whether ``fs`` is ppe's default (POSIX) file system, as a writer made without ``fs`` holds."""
    return type(fs) is PPE_DEFAULT_FS


def takes_cleanup_hooks(writer: Any) -> bool:
    """Whether ``writer`` runs hooks after its saves (ppe's snapshot extension asks the same)."""
    return hasattr(writer, "_add_cleanup_hook")


def add_cleanup_hook(writer: Any, hook: Callable[[], None]) -> None:
    """Have ``writer`` call ``hook()`` after each save."""
    writer._add_cleanup_hook(hook)


def run_cleanup_hooks(writer: ppe_writing.Writer) -> None:
    """Run the hooks registered with ``writer`` (ppe's writers do after each save)."""
    writer._post_save()


def queue_task(writer: ppe_writing.QueueWriter) -> Any:
    """The writer that ppe's queue ``writer`` saves with (its consumer calls it), or None."""
    return getattr(writer, "_task", None)


def savefun_and_keywords(writer: Any) -> tuple[Any, dict[str, Any]]:
    """(savefun, its keywords) that ppe's ``writer`` was made with ((None, {}) where it has none)."""
    return getattr(writer, "_savefun", None), dict(getattr(writer, "_kwds", None) or {})


def never_ran(writer: Any) -> bool:
    """Whether ppe's Thread / Process ``writer`` never saved (its ``finalize()`` would raise)."""
    return isinstance(writer, ppe_writing.StandardWriter) and getattr(writer, "_worker", None) is None


def mark_finalized(writer: Any) -> None:
    """Make ppe's ``writer`` skip its ``finalize()``."""
    writer._finalized = True


@contextlib.contextmanager
def models_available(manager: Any) -> Iterator[None]:
    """Within the block, the manager's models count as available, as ppe makes them for an extension that
    needs them (``needs_model_state``); ppe's guard is put back after."""
    available = getattr(manager, "_model_available", None)
    if available is False:
        manager._model_available = True
    try:
        yield
    finally:
        if available is False:
            manager._model_available = False


def running_extensions(manager: Any) -> list | None:
    """The manager's running order of ``(name, ExtensionEntry)``, or None before it started its extensions."""
    running = getattr(manager, "extensions", None)
    return running if isinstance(running, list) else None


def extension_entries(manager: Any) -> list:
    """The manager's ``(name, ExtensionEntry)`` pairs: its running order once started, else as registered."""
    return running_extensions(manager) or list(getattr(manager, "_extensions", {}).items())


def extension_states(state: Any) -> dict | None:
    """The extensions' states in a manager's ``state_dict()``, by name (what its ``load_state_dict`` looks each
    registered extension up in), or None where ``state`` holds none."""
    found = state.get("extensions") if isinstance(state, dict) else None
    return found if isinstance(found, dict) else None


def set_running_extensions(manager: Any, running: list) -> None:
    """Replace the manager's running order (a new list: the manager may be iterating the current one)."""
    manager.extensions = running


def iters_per_epoch(manager: Any) -> int | None:
    """The manager's iterations per epoch (what its interval triggers count epochs in), or None when unknown."""
    try:
        return int(manager._iters_per_epoch)
    except (AttributeError, AssertionError, TypeError):
        return None
