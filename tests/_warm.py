"""The warm launcher: ``popen([sys.executable, script, ...])`` starts the script in a real process forked from a
zygote (``_zygote.py``) that has imported torch and pytorch_pfn_extras already, which saves each process the
seconds of CPU those imports cost; ``-m module`` and ``-c code`` start the same way. ``run`` is the same for
``subprocess.run``.

The child is a real process: ``pid`` is the process running the script, a ``kill -9`` of it kills that one, and
its exit status is Popen's ``returncode`` (a negative signal number when a signal killed it). It stays a zombie
until ``poll`` / ``wait`` sees it end, as a Popen child does, and its ``os.getppid()`` answers the caller. What the
call sites use of Popen is here: ``pid``, ``args``, ``poll``, ``wait(timeout)``, ``communicate(input=None,
timeout)``, ``kill``, ``terminate``, ``send_signal``, ``returncode``, the ``stdin`` / ``stdout`` / ``stderr`` pipes
(text or bytes), ``pass_fds``, ``with``.

Everything else gets a plain ``subprocess.Popen``: another command (other options, a wrapper command), a keyword
not handled here, or an environment that differs from the zygote's in what an interpreter reads once at start
(``PYTHON*`` but PYTHONPATH, locale, ``TORCH*`` but the inductor's cache directory, which torch sets itself
once it is asked for, OpenMP's / OpenBLAS's but OMP_NUM_THREADS). A zygote that does not start or dies is
reported once (a warning) and every later launch is a plain Popen; the zygote stops when the process that
started it exits (its control socket closes). ``PPE_SNAPSHOT_TESTS_WARM=0`` turns the launcher off
(every launch a plain Popen), to compare or to rule it out.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Any, Optional

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote.py")
_READY_TIMEOUT = 120.0
_REPLY_TIMEOUT = 60.0
_HANDLED = {"stdin", "stdout", "stderr", "text", "universal_newlines", "encoding", "errors", "env", "cwd",
            "pass_fds"}
_MAX_PASS_FDS = 16  # the zygote's MAX_PASS_FDS
_STARTUP_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "LC_", "LD_", "MALLOC_")
_PER_CHILD = {"PYTHONPATH", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR"}


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if (k.startswith(_STARTUP_PREFIXES) or k == "LANG") and k not in _PER_CHILD}


class _Zygote:
    """The zygote process and its control socket (of the process that started it)."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.lock = threading.Lock()
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "1"  # no OpenMP / OpenBLAS thread may exist when it forks
        self.startup = _startup_env(env)
        try:
            self.process = subprocess.Popen([sys.executable, ZYGOTE, str(theirs.fileno())], env=env, cwd="/",
                                            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
        try:
            ready = _receive(self.control, _READY_TIMEOUT)
            if ready != b"ready 1":
                raise RuntimeError(f"it said {ready!r}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.control.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _receive(sock: socket.socket, timeout: float) -> bytes:
    """One message (b"" once the other end closed); raises TimeoutError after ``timeout`` seconds."""
    if not select.select([sock], [], [], timeout)[0]:
        raise TimeoutError(f"no answer from the zygote in {timeout:.0f} s")
    try:
        return sock.recv(1 << 16)
    except ConnectionResetError:
        return b""


_zygote: Optional[_Zygote] = None
_broken = False
_start_lock = threading.Lock()


def _get_zygote() -> Optional[_Zygote]:
    """This process's zygote (started on first use); None where it could not start."""
    global _zygote, _broken
    with _start_lock:
        if _zygote is not None and _zygote.owner != os.getpid():  # a fork of the process that started it
            _zygote, _broken = None, False
        if _zygote is None and not _broken:
            try:
                _zygote = _Zygote()
                atexit.register(_zygote.close)
            except Exception as e:  # noqa: BLE001 - the launcher then starts plain processes
                _give_up(f"the warm launcher's zygote did not start ({e}): tests start plain processes")
        return _zygote


def _give_up(why: str) -> None:
    global _zygote, _broken
    _zygote, _broken = None, True
    warnings.warn(why, RuntimeWarning, stacklevel=3)


def _text(arg: Any) -> str:
    return os.fsdecode(arg) if isinstance(arg, bytes) else str(arg)


def _starts_python(args: Any) -> bool:
    """``[sys.executable, script.py, ...]``, ``[sys.executable, "-m", module, ...]`` or ``-c code``."""
    if not (isinstance(args, (list, tuple)) and len(args) >= 2 and _text(args[0]) == sys.executable):
        return False
    first = str(args[1])
    return first.endswith(".py") and os.path.isfile(first) or first in ("-c", "-m") and len(args) >= 3


def _eligible(args: Any, kwargs: dict[str, Any]) -> bool:
    return (_starts_python(args) and set(kwargs) <= _HANDLED and len(kwargs.get("pass_fds", ())) <= _MAX_PASS_FDS
            and kwargs.get("stdin") in (None, subprocess.DEVNULL, subprocess.PIPE)
            and kwargs.get("stdout") in (None, subprocess.DEVNULL, subprocess.PIPE)
            and kwargs.get("stderr") in (None, subprocess.DEVNULL, subprocess.PIPE, subprocess.STDOUT))


def popen(args: list, **kwargs: Any):
    """``subprocess.Popen(args, **kwargs)``, started warm where it can be (see the module's docstring)."""
    if os.environ.get("PPE_SNAPSHOT_TESTS_WARM") != "0" and _eligible(args, kwargs):
        env = {str(k): str(v) for k, v in (kwargs["env"] if kwargs.get("env") is not None else os.environ).items()}
        zygote = _get_zygote()
        if zygote is not None and _startup_env(env) == zygote.startup:
            try:
                return WarmPopen(zygote, [_text(a) for a in args], env,
                                 **{k: v for k, v in kwargs.items() if k != "env"})
            except _ZygoteGone as e:
                _give_up(f"the warm launcher's zygote is gone ({e}): tests start plain processes")
    return subprocess.Popen(args, **kwargs)


def run(args: list, *, timeout: Optional[float] = None, capture_output: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(args, ...)`` (without ``check`` / ``input``), started warm where it can be."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with popen(args, **kwargs) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
    return subprocess.CompletedProcess(args, process.returncode, out, err)


class _ZygoteGone(Exception):
    """The zygote did not start the child."""


class WarmPopen:
    """A child forked by the zygote, driven as a ``subprocess.Popen``."""

    def __init__(self, zygote: _Zygote, args: list[str], env: dict[str, str], *, stdin=None, stdout=None,
                 stderr=None, text: bool = False, universal_newlines: Optional[bool] = None,
                 encoding: Optional[str] = None, errors: Optional[str] = None, cwd=None, pass_fds=()):
        self.args, self.returncode = args, None
        self.stdin = self.stdout = self.stderr = None
        self._lock = threading.Lock()
        self._readers: dict[str, Any] = {}
        text = bool(text or universal_newlines or encoding or errors)
        theirs, close_after = [0, 1, 2], []
        pipes: dict[str, int] = {}
        for index, (name, how) in enumerate((("stdin", stdin), ("stdout", stdout), ("stderr", stderr))):
            if how == subprocess.PIPE:
                read, write = os.pipe()
                ours, theirs[index] = (write, read) if index == 0 else (read, write)
                pipes[name] = ours
                close_after.append(theirs[index])
            elif how == subprocess.DEVNULL:
                theirs[index] = os.open(os.devnull, os.O_RDWR)
                close_after.append(theirs[index])
            elif how == subprocess.STDOUT:
                theirs[index] = theirs[1]
        self._conn, conn_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pass_fds = [int(fd) for fd in pass_fds]
        request = json.dumps({"argv": args, "env": env, "cwd": os.getcwd() if cwd is None else os.fspath(cwd),
                              "umask": _umask(), "parent": os.getpid(), "pass_fds": pass_fds}).encode()
        try:
            try:
                with zygote.lock:
                    socket.send_fds(zygote.control, [request], [*theirs, conn_theirs.fileno(), *pass_fds])
            except OSError as e:
                self._conn.close()
                for fd in pipes.values():
                    os.close(fd)
                raise _ZygoteGone(e) from None
        finally:
            conn_theirs.close()
            for fd in close_after:
                os.close(fd)
        reply = _receive(self._conn, _REPLY_TIMEOUT)
        if not reply.startswith(b"pid "):  # gone before it forked (b""), or its fork failed
            for fd in pipes.values():
                os.close(fd)
            self._conn.close()
            raise _ZygoteGone(reply.decode() or "it closed the connection")
        self.pid = int(reply.split()[1])
        for name, fd in pipes.items():
            stream = io.open(fd, "wb" if name == "stdin" else "rb")
            if text:
                stream = io.TextIOWrapper(stream, encoding=encoding, errors=errors, write_through=name == "stdin")
            setattr(self, name, stream)

    def _status(self, timeout: Optional[float]) -> Optional[int]:
        """The exit status, once the child ended (reaped then); None if it runs after ``timeout`` seconds."""
        if self.returncode is not None:
            return self.returncode
        if not select.select([self._conn], [], [], timeout)[0]:
            return None
        said = _receive(self._conn, 0)
        if said == b"exited":
            self._conn.send(b"reap")
            said = _receive(self._conn, _REPLY_TIMEOUT)
        if not said.startswith(b"code "):
            raise RuntimeError(f"lost the zygote while {self.args!r} (pid {self.pid}) ran (it said {said!r})")
        self.returncode = int(said.split()[1])
        self._conn.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        if not self._lock.acquire(blocking=False):  # another thread waits for it
            return None
        try:
            return self._status(0)
        finally:
            self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if self._lock.acquire(timeout=-1 if left is None else left):
                try:
                    if self._status(left) is not None:
                        return self.returncode
                finally:
                    self._lock.release()
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)  # still a zombie at worst: not reaped before poll / wait saw it end

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def communicate(self, input: Any = None, timeout: Optional[float] = None):  # noqa: A002 - Popen's name
        """Reads stdout and stderr to their end and waits for the child, as ``Popen.communicate``."""
        if input is not None:
            raise NotImplementedError("communicate(input=...) is not supported by the warm launcher")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None and not self.stdin.closed:
            self.stdin.close()
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and not stream.closed and name not in self._readers:
                box: list = []
                reader = threading.Thread(target=lambda s=stream, b=box: b.append(s.read()), daemon=True)
                reader.start()
                self._readers[name] = (reader, box)
        for reader, _ in self._readers.values():
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
        results = []
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            results.append(self._readers[name][1][0] if name in self._readers else None)
            if stream is not None:
                stream.close()
        return tuple(results)

    def __enter__(self) -> "WarmPopen":
        return self

    def __exit__(self, *exc: Any) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()

    def __del__(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
