"""Pool of reusable worker processes for real multi-process (gloo) tests.

Spawning a torch process costs seconds on a small machine, so a session keeps
one pool of spawned workers and reuses it across tests.  Each call to
:meth:`DistPool.run` sends ``(fn, rank, world_size, port, args)`` to
``world_size`` workers; every worker joins a fresh gloo process group, waits
at a barrier until every rank has, runs ``fn(*args)``, and always destroys
the group afterwards, so a worker whose ``fn`` raised is clean for the next
call (one that failed to join restarts the pool).  Rank 0 starts the group's store on
a port the kernel picks and reports it before the other ranks get their task:
no two groups, of this suite or of another on the same machine, can meet on
one port.

``fn`` is pickled by reference: it must be a module-level function in a module
the workers can import (a test module, a helper under ``tests/``, or the
package itself; the workers get ``tests/`` and the repository root on
``sys.path``).  Rank and world size are available in ``fn`` through
``torch.distributed.get_rank()`` / ``get_world_size()``.

Python-level stdout/stderr printed by ``fn`` is captured in the worker and
replayed in the calling (test) process, prefixed with ``[rank N]``.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import random
import socket
import sys
import threading
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from datetime import timedelta
from multiprocessing.connection import wait as _wait_conns

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

#: The pool never grows beyond this many workers (the CI machine has 2 cores).
MAX_WORLD_SIZE = 4

#: Environment every worker gets (on top of the parent's environment).
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # Only loopback is usable in the sandbox; don't let gloo pick eth0 or
    # resolve the hostname to something unreachable.
    "GLOO_SOCKET_IFNAME": "lo",
}

_STARTUP_TIMEOUT = 120.0


#: The ports the tests' servers and the groups of the processes they start themselves listen on (the pool's
#: groups take a port from the kernel instead): below Linux's ephemeral range (32768-60999), from
#: which outgoing connections take theirs (a port picked there may be taken by one before its server binds it),
#: and a block of their own for each pytest-xdist worker (``gw<N>``), so that two workers never pick the same.
_FIRST_PORT, _PORT_BLOCK, _BLOCKS = 20000, 3000, 4


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, from this pytest worker's block (see above)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    first = _FIRST_PORT + (int(worker) % _BLOCKS if worker.isdigit() else 0) * _PORT_BLOCK
    for port in random.sample(range(first, first + _PORT_BLOCK), 100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or lingering after a test closed it
                continue
            return port
    raise OSError(f"no free port among 100 tried in {first}-{first + _PORT_BLOCK - 1}")


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


def _worker_main(conn, env: dict, paths: list) -> None:
    """Entry point of a pool worker (runs in the spawned process)."""
    os.environ.update(env)
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))

    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # parent went away
        out, err = io.StringIO(), io.StringIO()
        rank = -1
        joined = False
        try:
            task = pickle.loads(msg)
            if task is None:
                return
            fn, rank, world_size, port, args, timeout = task
            _clear_caches()
            with redirect_stdout(out), redirect_stderr(err):
                store = _join_store(conn, rank, world_size, port, timedelta(seconds=timeout))
                dist.init_process_group(
                    "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
                )
                del store  # the group holds it; rank 0's server closes with the group
                # gloo lets a rank out of init_process_group once its own pairs are up, while a peer may still
                # be finishing its handshakes: a rank whose fn returns at once and destroys the group would
                # close a pair under that peer ("connectFullMesh failed ... Connection closed by peer").
                dist.barrier()
                joined = True
                try:
                    result = fn(*args)
                finally:
                    if dist.is_initialized():
                        dist.destroy_process_group()
            reply = ("ok", result, out.getvalue(), err.getvalue())
            payload = pickle.dumps(reply)
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            tb = traceback.format_exc()
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except BaseException:  # noqa: BLE001
                tb += "\n(destroy_process_group also failed:)\n" + traceback.format_exc()
            payload = pickle.dumps(("err" if joined else _NOT_JOINED, tb, out.getvalue(), err.getvalue()))
        try:
            conn.send_bytes(payload)
        except (EOFError, OSError):
            return


#: The reply of a rank that failed before its group was up: its gloo and store state is not to be trusted again.
_NOT_JOINED = "err-joining"


def _join_store(conn, rank: int, world_size: int, port: int | None, timeout: timedelta):
    """The group's store: rank 0 serves it on a port the kernel picks and sends that port to the parent."""
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False)
        conn.send_bytes(pickle.dumps(("port", store.port)))
        return store
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)


def _clear_caches() -> None:
    """Drop per-process caches that would leak state between tests."""
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        try:
            s3fs.S3FileSystem.clear_instance_cache()
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


class DistRunError(AssertionError):
    """Raised when a rank failed, a worker died, or a call timed out."""


class _Worker:
    def __init__(self, ctx):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        env = {k: v for k, v in WORKER_ENV.items()}
        # Respect an explicit override from the developer's environment.
        for k in env:
            if k in os.environ:
                env[k] = os.environ[k]
        # Not daemonic: library code under test may start its own processes
        # (e.g. a process-based snapshot writer).
        self.proc = ctx.Process(
            target=_worker_main,
            args=(child_conn, env, [TESTS_DIR, REPO_ROOT]),
            name="dist-pool-worker",
            daemon=False,
        )
        self.proc.start()
        child_conn.close()
        self.conn = parent_conn
        self.ready = False

    def kill(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)


class DistPool:
    """Lazily started, growable pool of spawned worker processes."""

    def __init__(self, max_world_size: int = MAX_WORLD_SIZE):
        self.max_world_size = max_world_size
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._ctx = None

    # -- lifecycle ---------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self._workers)

    def _context(self):
        if self._ctx is None:
            import torch.multiprocessing as tmp

            self._ctx = tmp.get_context("spawn")
        return self._ctx

    def _ensure(self, n: int) -> None:
        new = [_Worker(self._context()) for _ in range(n - len(self._workers))]
        self._workers.extend(new)
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        pending = {w.conn: w for w in new}
        while pending:
            left = deadline - time.monotonic()
            ready = _wait_conns(list(pending), timeout=max(left, 0))
            if not ready:
                self.shutdown(kill=True)
                raise DistRunError(f"dist pool: {len(pending)} worker(s) did not start within {_STARTUP_TIMEOUT:.0f}s")
            for c in ready:
                w = pending.pop(c)
                try:
                    tag, _pid = pickle.loads(c.recv_bytes())
                    assert tag == "ready"
                except Exception as e:  # noqa: BLE001
                    self.shutdown(kill=True)
                    raise DistRunError(f"dist pool: worker failed to start (exit code {w.proc.exitcode}): {e!r}") from e
                w.ready = True

    def shutdown(self, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop all workers (politely unless ``kill``); the pool restarts lazily."""
        workers, self._workers = self._workers, []
        if not kill:
            for w in workers:
                try:
                    w.conn.send_bytes(pickle.dumps(None))
                except (OSError, EOFError):
                    pass
            deadline = time.monotonic() + timeout
            for w in workers:
                w.proc.join(timeout=max(deadline - time.monotonic(), 0.1))
        for w in workers:
            w.kill()

    # -- running -----------------------------------------------------------

    def run(self, fn, world_size: int, *args, timeout: float = 120) -> list:
        """Run ``fn(*args)`` on ``world_size`` gloo ranks; return results by rank."""
        if not 1 <= world_size <= self.max_world_size:
            raise ValueError(f"world_size must be in 1..{self.max_world_size}, got {world_size}")
        with self._lock:
            try:
                return self._run(fn, world_size, args, timeout)
            except DistRunError:
                raise  # already handled (pool killed where needed)
            except BaseException:
                # Interrupted mid-call (Ctrl-C, pytest-timeout, ...): workers may
                # still be busy or hold unread replies, so start afresh next time.
                self.shutdown(kill=True)
                raise

    def _run(self, fn, world_size, args, timeout):
        try:
            first = pickle.dumps((fn, 0, world_size, None, args, timeout))
        except Exception as e:
            raise DistRunError(
                f"dist_run: cannot pickle the task ({e!r}); fn must be a module-level function "
                "(importable by the workers) and args must be picklable"
            ) from e
        self._ensure(world_size)
        workers = self._workers[:world_size]
        fname = getattr(fn, "__qualname__", repr(fn))
        deadline = time.monotonic() + timeout
        workers[0].conn.send_bytes(first)
        port = self._store_port(workers[0], fname, world_size, timeout, deadline)
        for rank, w in enumerate(workers[1:], 1):
            w.conn.send_bytes(pickle.dumps((fn, rank, world_size, port, args, timeout)))

        rank_of = {w.conn: r for r, w in enumerate(workers)}
        replies: dict[int, tuple] = {}
        died: list[int] = []
        while len(replies) + len(died) < world_size:
            pending = [c for c, r in rank_of.items() if r not in replies and r not in died]
            ready = _wait_conns(pending, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                missing = sorted(set(range(world_size)) - set(replies) - set(died))
                self.shutdown(kill=True)
                self._replay_output(replies)
                raise DistRunError(
                    f"dist_run({fname}, world_size={world_size}) timed out after {timeout}s; "
                    f"ranks {missing} did not finish (pool killed and will restart)"
                    + self._format_failures(replies)
                )
            for c in ready:
                r = rank_of[c]
                try:
                    replies[r] = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    died.append(r)
                except Exception:  # noqa: BLE001 - e.g. result not unpicklable here
                    replies[r] = ("err", "could not unpickle the result:\n" + traceback.format_exc(), "", "")

        self._replay_output(replies)
        if died:
            codes = {r: workers[r].proc.exitcode for r in died}
            self.shutdown(kill=True)
            raise DistRunError(
                f"dist_run({fname}, world_size={world_size}): worker process(es) died: "
                + ", ".join(f"rank {r} (exit code {codes[r]})" for r in sorted(died))
                + " (pool killed and will restart)"
                + self._format_failures(replies)
            )
        failures = self._format_failures(replies)
        if failures:
            nfail = sum(1 for rep in replies.values() if rep[0] != "ok")
            restart = ""
            if any(rep[0] == _NOT_JOINED for rep in replies.values()):
                self.shutdown(kill=True)  # a worker left half-joined hung the next group on this pool
                restart = " before the group was up (pool killed and will restart)"
            raise DistRunError(
                f"dist_run({fname}, world_size={world_size}): {nfail} rank(s) failed{restart}" + failures
            )
        return [replies[r][1] for r in range(world_size)]

    def _store_port(self, worker: _Worker, fname: str, world_size: int, timeout: float, deadline: float) -> int:
        """The port rank 0's store listens on, as its worker reports it before anything else."""
        what = f"dist_run({fname}, world_size={world_size})"
        if not _wait_conns([worker.conn], timeout=max(deadline - time.monotonic(), 0)):
            self.shutdown(kill=True)
            raise DistRunError(
                f"{what} timed out after {timeout}s: rank 0 started no store (pool killed and will restart)"
            )
        try:
            message = pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):
            code = worker.proc.exitcode
            self.shutdown(kill=True)
            raise DistRunError(f"{what}: rank 0 died (exit code {code}) (pool killed and will restart)") from None
        if message[0] != "port":  # rank 0 failed before its store listened; the other workers got nothing
            self.shutdown(kill=True)  # (like any worker that failed before its group was up)
            self._replay_output({0: message})
            raise DistRunError(f"{what}: rank 0 failed before its store listened (pool killed and will restart)"
                               + self._format_failures({0: message}))
        return message[1]

    @staticmethod
    def _format_failures(replies: dict) -> str:
        parts = []
        for r in sorted(replies):
            if replies[r][0] != "ok":
                tb = replies[r][1].rstrip()
                parts.append(f"\n\n----- rank {r} failed -----\n{tb}")
        return "".join(parts)

    @staticmethod
    def _replay_output(replies: dict) -> None:
        for r in sorted(replies):
            _, _, out, err = replies[r]
            for text, stream in ((out, sys.stdout), (err, sys.stderr)):
                if text:
                    stream.write("".join(f"[rank {r}] {line}\n" for line in text.splitlines()))


_POOL: DistPool | None = None


def get_pool() -> DistPool:
    """The process-wide pool (created on first use, started lazily)."""
    global _POOL
    if _POOL is None:
        _POOL = DistPool()
    return _POOL


def shutdown_pool() -> None:
    """Tear the pool down (fixture finalizer / atexit)."""
    global _POOL
    if _POOL is not None:
        _POOL.shutdown()
        _POOL = None


atexit.register(shutdown_pool)


def dist_run(fn, world_size: int, *args, timeout: float = 120) -> list:
    """Module-level convenience: ``get_pool().run(...)``."""
    return get_pool().run(fn, world_size, *args, timeout=timeout)
