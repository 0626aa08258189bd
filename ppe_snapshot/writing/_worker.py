"""The ProcessWriter's worker process: writes and commits the saves staged by its parent.

A fresh interpreter (see ``_process._BOOT``), not a fork and not multiprocessing's ``spawn``: the parent's main
script is imported only when a save refers to something defined there (a savefun, a class), so a script without
a ``__main__`` guard works. It never touches CUDA: every save arrives staged in a host shared-memory buffer that
the parent sent once (and again only when it grew).

The first message is the setup (plain pickle): the parent's ``sys_path``, ``parent_pid``, ``main`` and
``authkey`` (with which the worker fetches the file descriptors of the shared buffers from its parent). Every
other message is a :func:`frame` ``(kind, ticket, body)``, the body unpickled only where its errors can be
answered:

* ``buffer`` ``(slot, tensor)``: the staging buffer of a slot;
* ``stops`` ``(tensor,)``: one byte per slot, set by the parent when the take of several ranks in that slot failed
  elsewhere (the write stops at its next block);
* ``take`` ``(slot, job, step)``: write and commit an engine snapshot, then run ``step`` (see
  ``_replace.after_commit``: give it its name when it replaces one); a take of several ranks is only written and
  its part published: the parent, which speaks for the worker to the other ranks, concludes it;
* ``file`` ``(slot, save, skeleton)``: write a single file;
* ``stop``: finish what is queued, then exit.

The worker first sends ``READY``; each save is answered with ``(ticket, error, nbytes)``, ``error`` being None or
``(pickled exception or None, formatted traceback)``. The worker exits when its parent goes away (the pipe
closes or it is re-parented).
"""
from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import queue
import runpy
import signal
import sys
import threading
import traceback
import types
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch

from ppe_snapshot.writing._files import materialize
from ppe_snapshot.writing._replace import commit_in_place

#: Seconds between two checks that the parent is still there while idle.
PARENT_CHECK_S = 1.0
#: The first answer of a worker: it started (its parent's main module was imported without error).
READY = (None, None, None)


def frame(kind: str, ticket: int | None, *body: Any) -> bytes:
    """A message to the worker (see the module's docstring); the body goes with the tensors' shared memory."""
    return pickle.dumps((kind, ticket, bytes(ForkingPickler.dumps(body))))


def serve(jobs: Connection, results: Connection, setup: dict[str, Any]) -> None:
    multiprocessing.current_process().authkey = setup["authkey"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process; it stops us
    torch.set_num_threads(1)  # leave the cores to training,
    os.nice(10)  # and let training win when both want a core: writing can wait, a step cannot
    inbox: queue.SimpleQueue[tuple[str, int | None, bytes] | None] = queue.SimpleQueue()
    # A reader thread keeps the pipe drained, so the parent never blocks on a send while we write.
    results.send(READY)
    threading.Thread(target=_receive, args=(jobs, inbox, setup["parent_pid"]), daemon=True).start()
    unpickle = partial(_unpickle, setup["main"])
    buffers: dict[int, torch.Tensor] = {}
    stops = torch.zeros(0, dtype=torch.uint8)
    while (message := inbox.get()) is not None:
        kind, ticket, body = message
        if kind == "buffer":
            slot, buffer = unpickle(body)
            buffers[slot] = buffer
            continue
        if kind == "stops":
            stops, = unpickle(body)
            continue
        reply = (ticket, *_run(kind, partial(unpickle, body), buffers, stops))
        del message, body
        try:
            results.send(reply)
        except OSError:  # the parent is gone
            return


class _Unpickler(pickle.Unpickler):
    """Unpickles a message's body; imports the parent's main module on the first reference to it."""

    def __init__(self, data: bytes, main: tuple[str, str] | None) -> None:
        super().__init__(io.BytesIO(data))
        self._main = main

    def find_class(self, module: str, name: str) -> Any:
        if module == "__main__" and self._main is not None and "__mp_main__" not in _MAIN:
            _import_main(self._main)
        return super().find_class(module, name)


#: The parent's main module once imported here (as ``__mp_main__``, the name multiprocessing's spawn gives it).
_MAIN: dict[str, types.ModuleType] = {}


def _import_main(main: tuple[str, str]) -> None:
    """Run the parent's main script or module as ``__mp_main__`` and make it this process's ``__main__``."""
    kind, where = main
    process = multiprocessing.current_process()
    process._inheriting = True  # type: ignore[attr-defined]  # a writer created by the import refuses
    try:
        if kind == "path":
            found = runpy.run_path(where, run_name="__mp_main__")
        else:
            found = runpy.run_module(where, run_name="__mp_main__", alter_sys=True)
    finally:
        del process._inheriting  # type: ignore[attr-defined]
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(found)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = _MAIN["__mp_main__"] = module


def _unpickle(main: tuple[str, str] | None, body: bytes) -> Any:
    return _Unpickler(body, main).load()


def _receive(jobs: Connection, inbox: "queue.SimpleQueue[tuple[str, int | None, bytes] | None]",
             parent_pid: int) -> None:
    try:
        while True:
            if not jobs.poll(PARENT_CHECK_S):
                if os.getppid() != parent_pid:
                    return
                continue
            message = pickle.loads(jobs.recv_bytes())
            if message[0] == "stop":
                return
            inbox.put(message)
    except (EOFError, OSError):  # the parent closed the pipe or died
        return
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        raise
    finally:
        inbox.put(None)


def _stopped(stops: torch.Tensor, slot: int) -> str | None:
    return "the take failed on another rank" if slot < len(stops) and stops[slot] else None


def _run(kind: str, body: Callable[[], Any], buffers: dict[int, torch.Tensor], stops: torch.Tensor
         ) -> tuple[Any, int | None]:
    try:
        slot, *work = body()
        if kind == "take":
            job, step = work
            job.use_staged(buffers[slot])
            if job.world_size > 1:
                job.stopped = partial(_stopped, stops, slot)
                job.write_part()
            else:
                return None, commit_in_place(job, step)
            return None, None
        save, skeleton = work
        return None, save.run(materialize(skeleton, buffers[slot]))
    except BaseException as e:
        return _describe(e), None


def _describe(error: BaseException) -> tuple[bytes | None, str]:
    text = "".join(traceback.format_exception(error))
    try:
        data: bytes | None = pickle.dumps(error)
        pickle.loads(data)
    except Exception:  # sent as text only
        data = None
    return data, text
