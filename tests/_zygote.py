"""The warm launcher's zygote (see ``_warm.py``): an interpreter that has imported torch and pytorch_pfn_extras
once and forks a child for each ``python script.py ...``, ``python -m module ...`` or ``python -c code ...`` the
tests ask for.

Started as ``python _zygote.py CONTROL_FD``. Requests come on the control socket (SOCK_SEQPACKET): a JSON
``{"argv", "env", "cwd", "umask", "parent", "pass_fds"}`` with four descriptors (the child's stdin, stdout,
stderr and a socket of its own to the caller), then one per number in ``pass_fds`` (at most ``MAX_PASS_FDS``),
which the child holds under that number. On that socket the zygote answers ``pid N`` once forked (``error ...``
if it could not fork), ``exited`` once the child has ended (it stays a zombie, as a Popen child does until waited
for), and ``code N`` after the caller's ``reap``.
The zygote is single-threaded (it checks that before answering ``ready``) and ends when the control socket
closes: its caller went away.

A child is what ``python script.py`` (or ``-m`` / ``-c``) would be, but for what the zygote imported already
(torch, pytorch_pfn_extras and what they import: never ppe_snapshot, which each child imports itself under its own
environment): signals as a fresh interpreter has them, its environment, directory, umask, standard streams, argv
and sys.path; torch's intra-op threads from its OMP_NUM_THREADS; numpy's and multiprocessing's random state drawn
anew (not str hashes: every child has the zygote's hash seed); ``os.getppid()`` answers the caller's pid
(``parent``) for as long as the zygote lives, as it would for the caller's own child, and what the child's parent
really is once the zygote is gone (the caller is then gone too); the script, module or code runs as ``__main__``,
and the child then ends as the interpreter would (see ``exit_as_interpreter``).
"""
import os
import signal
import sys

# What a fresh interpreter has, before anything here may change it.
_SIGNALS = {sig: signal.getsignal(sig) for sig in signal.valid_signals()
            if sig not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(sig) is not None}
_PATH = sys.path[1:]  # sys.path after the script's directory (the zygote is started without PYTHONPATH)

import atexit  # noqa: E402
import fcntl  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.machinery  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import linecache  # noqa: E402
import runpy  # noqa: E402
import selectors  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402

import pytorch_pfn_extras  # noqa: E402,F401
import torch  # noqa: E402

#: The most descriptors a request may pass beyond the standard four.
MAX_PASS_FDS = 16


class _Child:
    def __init__(self, pid: int, conn: socket.socket, pidfd: int):
        self.pid, self.conn, self.pidfd = pid, conn, pidfd
        self.exited = False


def serve(control: socket.socket):
    """Answers requests until the control socket closes (returns None); in a forked child, returns the request
    and its three descriptors."""
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    children: dict[int, _Child] = {}

    def forget(child: _Child) -> None:
        if child.conn.fileno() >= 0:
            selector.unregister(child.conn)
            child.conn.close()
        if not child.exited:
            selector.unregister(child.pidfd)
        os.close(child.pidfd)
        del children[child.pid]

    def send(child: _Child, message: bytes) -> None:
        try:
            child.conn.send(message)
        except OSError:  # the caller is gone: its end closed
            pass

    threads = len(os.listdir("/proc/self/task"))
    control.send(f"ready {threads}".encode())
    if threads != 1:
        return None
    while True:
        for key, _ in selector.select():
            if key.fileobj is control:
                message, fds, _, _ = socket.recv_fds(control, 1 << 20, 4 + MAX_PASS_FDS)
                if not message:
                    selector.close()
                    return None
                request = json.loads(message)
                conn = socket.socket(fileno=fds[3])
                try:
                    pid = os.fork()
                except OSError as e:  # no child: the caller starts a plain process
                    for fd in fds[:3] + fds[4:]:
                        os.close(fd)
                    conn.send(f"error {e}".encode())
                    conn.close()
                    continue
                if pid == 0:
                    selector.close()
                    control.close()
                    conn.close()
                    for other in children.values():
                        other.conn.close()
                        os.close(other.pidfd)
                    return request, fds[:3], fds[4:]
                for fd in fds[:3] + fds[4:]:
                    os.close(fd)
                child = children[pid] = _Child(pid, conn, os.pidfd_open(pid))
                selector.register(child.pidfd, selectors.EVENT_READ, child)
                selector.register(conn, selectors.EVENT_READ, child)
                send(child, f"pid {pid}".encode())
            elif key.fileobj is key.data.pidfd:  # the child ended: the caller hears it; it is reaped when asked
                child = key.data
                selector.unregister(child.pidfd)
                child.exited = True
                if child.conn.fileno() < 0:
                    os.waitpid(child.pid, 0)
                    forget(child)
                else:
                    send(child, b"exited")
            else:
                child = key.data
                try:
                    message = child.conn.recv(64)
                except OSError:
                    message = b""
                if message == b"reap" and child.exited:
                    _, status = os.waitpid(child.pid, 0)
                    send(child, f"code {os.waitstatus_to_exitcode(status)}".encode())
                    forget(child)
                elif not message:  # the caller let go: reap the child whenever it ends
                    selector.unregister(child.conn)
                    child.conn.close()
                    if child.exited:
                        os.waitpid(child.pid, 0)
                        forget(child)


def _stream(fd: int, mode: str, errors: str, line_buffering: bool, unbuffered: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, mode, closefd=False)
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding=sys.__stdout__.encoding, errors=errors, newline="\n",
                            line_buffering=line_buffering, write_through=unbuffered and mode == "w")


def become(request: dict, fds: list[int], passed: list[int]) -> None:
    """Turns this forked process into ``python script.py args`` (or ``-m`` / ``-c``: ``request["argv"]``) up to
    running it."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig, handler in _SIGNALS.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    _hold_as(passed, request["pass_fds"])
    _answer_getppid(request["parent"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _stream(0, "r", "strict", False, unbuffered)
    sys.stdout = sys.__stdout__ = _stream(1, "w", "strict", os.isatty(1), unbuffered)
    sys.stderr = sys.__stderr__ = _stream(2, "w", "backslashreplace", True, unbuffered)
    argv = request["argv"]
    sys.orig_argv = list(argv)
    if argv[1] in ("-c", "-m"):  # the interpreter's argv and first path entry for each
        sys.argv, first = [argv[1], *argv[3:]], "" if argv[1] == "-c" else os.getcwd()
    else:
        sys.argv, first = list(argv[1:]), os.path.dirname(os.path.realpath(argv[1]))
    extra = os.environ.get("PYTHONPATH")
    extra = [os.path.abspath(entry) for entry in extra.split(os.pathsep)] if extra else []
    sys.path[:] = [first, *extra, *_PATH]
    importlib.invalidate_caches()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                          else len(os.sched_getaffinity(0)))
    if "numpy.random" in sys.modules:  # a fresh interpreter seeds numpy's global generator anew
        sys.modules["numpy.random"].seed()
    if "multiprocessing.process" in sys.modules:  # and draws its own multiprocessing authkey
        sys.modules["multiprocessing.process"].current_process().authkey = os.urandom(32)


def _hold_as(passed: list[int], numbers: list[int]) -> None:
    """Puts each passed descriptor under the number it had in the caller (first above them all, so that none is
    overwritten before it moved)."""
    if len(passed) != len(numbers):
        raise RuntimeError(f"{len(passed)} descriptors came for pass_fds {numbers}")
    above = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, max(numbers, default=0) + 1) for fd in passed]
    for fd in passed:
        os.close(fd)
    for fd, number in zip(above, numbers):
        os.dup2(fd, number)  # inheritable, as Popen's pass_fds leaves them
        os.close(fd)


def _answer_getppid(caller: int) -> None:
    zygote, real = os.getppid(), os.getppid
    os.getppid = lambda: caller if real() == zygote else real()


def _show_code_lines(code: object, source: str) -> None:
    """What the interpreter does with ``-c`` code before it runs (3.13 on): its lines go to ``linecache``, by name
    (3.13) and by code object (later versions), so that a traceback shows them."""
    lines = (len(source), None, [line + "\n" for line in source.splitlines()], "<string>")
    linecache.cache["<string>"] = lines
    register = getattr(linecache, "_register_code", None)
    if register is not None:
        register(code, source, "<string>")


def run_main() -> int:
    """Runs the script, module or code of ``sys.orig_argv`` as ``__main__``; returns the exit status the interpreter
    would give."""
    how = sys.orig_argv[1]
    main = type(sys)("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    try:
        if how == "-m":
            runpy._run_module_as_main(sys.orig_argv[2])  # what ``python -m`` calls
        elif how == "-c":
            main.__loader__ = importlib.machinery.BuiltinImporter
            code = compile(sys.orig_argv[2], "<string>", "exec")
            if sys.version_info >= (3, 13):  # (from 3.13 on, a traceback shows the lines of ``-c`` code)
                _show_code_lines(code, sys.orig_argv[2])
            exec(code, main.__dict__)
        else:
            script = os.path.abspath(sys.argv[0])
            main.__file__, main.__cached__ = script, None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
            with io.open_code(script) as f:
                code = compile(f.read(), script, "exec")
            exec(code, main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - reported as the interpreter reports it
        e.__traceback__ = e.__traceback__.tb_next  # this frame is no part of the script's traceback
        sys.excepthook(type(e), e, e.__traceback__)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    return 0


def exit_as_interpreter(status: int) -> None:
    """Ends the child as the interpreter ends: non-daemon threads joined, atexit handlers, the script's globals
    released (their ``__del__``), the standard streams flushed. The teardown of every module the zygote imported
    is left out: in a fork it would copy most of the zygote's memory, page by page, only to free it."""
    threading._shutdown()  # what the interpreter calls at exit
    atexit._run_exitfuncs()
    sys.modules["__main__"].__dict__.clear()
    gc.collect()
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - as the interpreter: a failed flush of stdout is exit status 120
        status = status or 120
    try:
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    if status == -signal.SIGINT:  # an uncaught KeyboardInterrupt ends the interpreter by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C ends its caller, which closes the control socket
    gc.collect()
    gc.freeze()  # the children's collections leave the zygote's objects (and their pages) alone
    forked = serve(socket.socket(fileno=int(sys.argv[1])))
    if forked is None:
        sys.exit(0)
    become(*forked)
    del forked
    exit_as_interpreter(run_main())
