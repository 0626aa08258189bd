"""The ProcessWriter's worker process: writes and commits the saves staged by its parent.

It never touches CUDA: every save arrives staged in a host shared-memory
buffer that the parent sent once (and again only when it grew). Messages:

* ``("buffer", slot, tensor)``: the staging buffer of a slot;
* ``("stops", tensor)``: one byte per slot, set by the parent when the take of several ranks in that slot failed
  elsewhere (the write stops at its next block);
* ``("take", ticket, slot, job, step)``: write and commit an engine snapshot, then run
  ``step`` (see ``_replace.after_commit``: give it its name when it replaces one); a take of several ranks is
  only written and its part published: the parent, which speaks for the worker to the other ranks, concludes it;
* ``("file", ticket, slot, save, skeleton)``: write a single file;
* ``("stop",)``: finish what is queued, then exit.

The worker first sends ``READY``; each save is answered with ``(ticket, error, nbytes)``, ``error`` being None or
``(pickled exception or None, formatted traceback)``. The worker exits
when its parent goes away (the pipe closes or it is re-parented).
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from ppe_snapshot.writing._files import materialize
from ppe_snapshot.writing._replace import commit_in_place

#: Seconds between two checks that the parent is still there while idle.
PARENT_CHECK_S = 1.0
#: The first answer of a worker: it started (its parent's main module was imported without error).
READY = (None, None, None)


def serve(jobs: Connection, results: Connection, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process; it stops us
    torch.set_num_threads(1)  # leave the cores to training,
    os.nice(10)  # and let training win when both want a core: writing can wait, a step cannot
    inbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
    # A reader thread keeps the pipe drained, so the parent never blocks on a send while we write.
    results.send(READY)  # the spawn bootstrap (which imports the parent's main module again) is over
    threading.Thread(target=_receive, args=(jobs, inbox, parent_pid), daemon=True).start()
    buffers: dict[int, torch.Tensor] = {}
    stops = torch.zeros(0, dtype=torch.uint8)
    while (message := inbox.get()) is not None:
        kind, *rest = message
        if kind == "buffer":
            slot, buffer = rest
            buffers[slot] = buffer
            continue
        if kind == "stops":
            stops = rest[0]
            continue
        ticket, slot, *work = rest
        reply = (ticket, *_run(kind, work, buffers[slot], partial(_stopped, stops, slot)))
        del message, rest, work
        try:
            results.send(reply)
        except OSError:  # the parent is gone
            return


def _receive(jobs: Connection, inbox: "queue.SimpleQueue[tuple[Any, ...] | None]", parent_pid: int) -> None:
    try:
        while True:
            if not jobs.poll(PARENT_CHECK_S):
                if os.getppid() != parent_pid:
                    return
                continue
            message = jobs.recv()
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


def _run(kind: str, work: list[Any], buffer: torch.Tensor, stopped: Callable[[], str | None]
         ) -> tuple[Any, int | None]:
    try:
        if kind == "take":
            job, step = work
            job.use_staged(buffer)
            if job.world_size > 1:
                job.stopped = stopped
                job.write_part()
            else:
                commit_in_place(job, step)
            return None, None
        save, skeleton = work
        return None, save.run(materialize(skeleton, buffer))
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
