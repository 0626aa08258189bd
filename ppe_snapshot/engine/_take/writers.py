"""Who is writing a take: the process that writes a rank's share records itself under ``.parts/`` before its first
byte, so that a directory without manifest can be told apart: a save in progress, or the leftover of one whose
writers are gone.

A record (:func:`writer_name`, one per rank) holds the host name, the boot id, the PID namespace and the processes
of that rank's share: the one writing it and, where another process prepared it and concludes it (a
ProcessWriter's worker writes for the training process), that one too; each by id and start time
(``/proc/<pid>/stat``, so that a reused id is not taken for it). Only a reader on the same host, boot and PID
namespace can check it; anywhere else (another host, a container of its own) the answer is *unknown*, and the
caller keeps the leftover as if a save were writing it. A take's writers are gone only when every rank's record is
there and none of the processes they name lives.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

from ppe_snapshot.engine._format import dump_json, load_json, PARTS_DIR, parse_parts_name, takes_in_progress
from ppe_snapshot.storage import Storage

#: What :func:`judge_writers` says of a directory's takes.
ALIVE, GONE, UNKNOWN = "alive", "gone", "unknown"


def writer_name(take_id: str, rank: int) -> str:
    """The record of the processes of rank ``rank``'s share of a take."""
    return f"{PARTS_DIR}/{take_id}.writer-rank{rank}.json"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot, ``/proc/<pid>/stat`` field 22); None when no
    such process runs (or no ``/proc``): a zombie (state Z, X: dead, not yet reaped) runs no more."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name, in parentheses, may hold spaces
    return fields[19] if len(fields) > 19 and fields[0] not in ("Z", "X", "x") else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_machine() -> dict[str, Any]:
    """Where this process runs: host name, boot id, PID namespace (what a reader must share to check a record)."""
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": _pid_namespace()}


def record_writer(storage: Storage, take_id: str, rank: int, world_size: int, preparer: int) -> None:
    """Record this process, and ``preparer`` (the process that prepared the share) where that is another one, as
    the processes of rank ``rank``'s share of take ``take_id``."""
    pids = dict.fromkeys([os.getpid(), preparer])
    processes = [{"pid": pid, "start": _start_time(pid)} for pid in pids]
    storage.put_atomic(writer_name(take_id, rank),
                       dump_json({**this_machine(), "world_size": world_size, "processes": processes}))


def forget_writers(storage: Storage, take_id: str, rank: int) -> None:
    """Remove the writer record of rank ``rank`` of a take that ended (and ``.parts/`` on a local file system,
    once empty: a committed snapshot keeps nothing of its take)."""
    storage.remove(writer_name(take_id, rank))
    storage.remove_empty_dir(PARTS_DIR)


def forget_quietly(storage: Storage, take_id: str, rank: int) -> None:
    """:func:`forget_writers` where storage may be failing (the take's own outcome is what counts; the records then
    stay, and the directory is judged by them)."""
    try:
        forget_writers(storage, take_id, rank)
    except Exception:  # noqa: BLE001 - the take's own error or outcome is the one to report
        pass


@dataclass(frozen=True)
class Writers:
    """What the writer records of one directory say: ``state`` ALIVE (a writer lives), GONE (every writer of
    every take recorded there is provably dead), UNKNOWN (no record, or records that cannot be checked here);
    ``detail`` says it in words."""
    state: str
    detail: str
    #: Whether a take there published parts and was not aborted (its ranks were committing it).
    in_progress: bool = False

    @property
    def alive(self) -> bool:
        return self.state == ALIVE

    @property
    def gone(self) -> bool:
        return self.state == GONE


def _alive(doc: dict[str, Any], here: dict[str, Any]) -> bool | None:
    """Whether the recorded process lives; None when that cannot be known here."""
    if not isinstance(doc.get("pid"), int) or not doc.get("start"):
        return None
    if any(doc.get(key) != here[key] or here[key] is None for key in ("host", "boot", "pid_ns")):
        return None
    return _start_time(doc["pid"]) == doc["start"]


def judge_writers(names: list[str], read: Callable[[str], bytes]) -> Writers:
    """Judge the takes recorded under a directory's ``.parts/`` (``names``: the base names there; ``read(name)``:
    one file's bytes)."""
    judged = _judge(names, read)
    return dataclasses.replace(judged, in_progress=bool(takes_in_progress(names)))


def _processes(doc: Any, take_id: str, rank: str) -> list[dict[str, Any]] | None:
    """One rank's record as one document per process it names; None when it is not a record."""
    if not isinstance(doc, dict) or not isinstance(doc.get("processes"), list):
        return None
    machine = {key: doc.get(key) for key in ("host", "boot", "pid_ns", "world_size")}
    return [{**machine, "pid": p.get("pid"), "start": p.get("start"), "take_id": take_id, "rank": rank}
            for p in doc["processes"] if isinstance(p, dict)]


def _judge(names: list[str], read: Callable[[str], bytes]) -> Writers:
    here = this_machine()
    records: list[dict[str, Any]] = []
    aborted = {p.take_id for p in map(parse_parts_name, names) if p is not None and p.aborted}
    for name in names:
        take_id, _, rest = name.partition(".")
        if rest.startswith("writer-rank") and rest.endswith(".json"):
            try:
                processes = _processes(load_json(read(name)), take_id, rest.removesuffix(".json").split("-")[1])
            except (OSError, ValueError):  # removed meanwhile, or unreadable: cannot be checked
                processes = None
            if not processes:
                return Writers(UNKNOWN, f"unknown: its writer record {name} cannot be read")
            records.extend(processes)
    if not records:
        return Writers(UNKNOWN, "unknown: no writer recorded; written by an older version, or killed as it started")
    verdicts = [(doc, _alive(doc, here)) for doc in records]
    live = [doc for doc, alive in verdicts if alive and doc["take_id"] not in aborted]
    if live:
        return Writers(ALIVE, f"being written by pid {live[0]['pid']} on {live[0]['host']}")
    unchecked = [doc for doc, alive in verdicts if alive is None]
    if unchecked:
        return Writers(UNKNOWN, f"unknown: written from host {unchecked[0].get('host')!s} (pid "
                                f"{unchecked[0].get('pid')!s}), which cannot be checked from here")
    for take_id in {doc["take_id"] for doc in records}:
        ranks = {doc["rank"] for doc in records if doc["take_id"] == take_id}
        world = next(doc.get("world_size") for doc in records if doc["take_id"] == take_id)
        if not isinstance(world, int) or not {f"rank{r}" for r in range(world)} <= ranks:
            return Writers(UNKNOWN, "unknown: not every rank of its take recorded a writer")
    dead = sorted({(str(doc.get("host")), doc["pid"]) for doc in records}, key=str)
    if any(alive for _, alive in verdicts):  # live writers of an aborted take: it ends, but is not gone yet
        return Writers(UNKNOWN, "unknown: its take was aborted and a writer still runs")
    return Writers(GONE, f"its writer{'s are' if len(dead) > 1 else ' is'} gone: "
                         + ", ".join(f"pid {pid} on {host}" for host, pid in dead))


__all__ = ["ALIVE", "GONE", "UNKNOWN", "Writers", "forget_quietly", "forget_writers", "judge_writers", "record_writer",
           "this_machine", "writer_name"]
