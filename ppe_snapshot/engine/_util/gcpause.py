"""Pausing Python's cyclic garbage collector while the engine builds or walks many small objects.

A state of thousands of tensors means tens of thousands of entries, chunks
and manifest dicts created in one go. Each 700 allocations start a
collection, and the objects surviving them end in a full collection that
walks every object of the process (a few hundred thousand once torch is
imported): 0.05-0.2 s measured here for a 5,000-tensor manifest, more than
parsing it. None of these objects form cycles, so nothing is lost by
collecting after instead.

Pauses nest and may come from several threads: the collector is enabled
again when the last one ends, and only if it was enabled before the first.
Background threads pause only short, object-heavy steps (never a write),
so the training loop is not left without a collector for long.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
