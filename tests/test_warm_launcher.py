"""The warm launcher (``tests/_warm.py``): children forked from a zygote that imported torch and
pytorch_pfn_extras are real processes that behave as ``python script.py`` would."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import _warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(tmp_path, text: str) -> str:
    path = tmp_path / "child.py"
    path.write_text(text)
    return str(path)


def _warm_popen(args, **kwargs) -> _warm.WarmPopen:
    process = _warm.popen(args, **kwargs)
    assert isinstance(process, _warm.WarmPopen), "the zygote did not start"
    return process


def test_exit_status_argv_cwd_env_and_stdout(tmp_path):
    script = _script(tmp_path, "import os, sys\nprint(sys.argv, os.getcwd(), os.environ['WARM_TEST'], __name__,"
                               " __file__, sys.path[0])\nsys.exit(3)\n")
    work = tmp_path / "work"
    work.mkdir()
    process = _warm_popen([sys.executable, script, "a", "b c"], cwd=work, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "WARM_TEST": "seen"})
    out, err = process.communicate(timeout=60)
    assert (process.returncode, err) == (3, None)
    assert out == f"{[script, 'a', 'b c']} {work} seen __main__ {script} {tmp_path}\n"


def test_the_callers_directory_and_umask_by_default(tmp_path, monkeypatch):
    script = _script(tmp_path, "import os\nprint(os.getcwd(), oct(os.umask(0)))\n")
    assert _warm_popen([sys.executable, script], stdout=subprocess.DEVNULL).wait(timeout=60) == 0  # zygote up
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    mask = os.umask(0o027)
    try:
        done = _warm.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    finally:
        os.umask(mask)
    assert (done.returncode, done.stdout) == (0, f"{tmp_path / 'here'} 0o27\n"), done.stderr


def test_an_uncaught_exception_is_exit_status_1_with_its_traceback_on_stderr(tmp_path):
    script = _script(tmp_path, "import sys\nprint('out')\ndef f():\n    raise ValueError('boom')\nf()\n")
    done = _warm.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "out\n"
    lines = done.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == "ValueError: boom"
    assert f'File "{script}", line 5, in <module>' in done.stderr and "_zygote" not in done.stderr


def test_stderr_into_stdout_in_bytes_and_exit_handlers(tmp_path):
    script = _script(tmp_path, "import atexit, sys, threading, time\n"
                               "atexit.register(print, 'atexit', flush=True)\n"
                               "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
                               "print('err', file=sys.stderr, flush=True)\nsys.exit('bye')\n")
    process = _warm_popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 1
    assert out.splitlines() == [b"err", b"bye", b"thread", b"atexit"]


def test_sigkill_reports_minus_9_and_the_process_is_gone(tmp_path):
    script = _script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    process = _warm_popen([sys.executable, script], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "up\n"
    with open(f"/proc/{process.pid}/cmdline", "rb") as f:  # the very process the test holds
        assert f.read().split(b"\0")[1].endswith(b"_zygote.py")
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(process.pid, 0)
    process.kill()  # a no-op once it ended, as Popen's
    process.stdout.close()


def test_signals_as_a_fresh_interpreter_has_them(tmp_path):
    """A fresh interpreter's SIGINT handler is Python's, unless SIGINT was ignored where it started (as in a
    background job of a shell script): the child's must be what a plain start prints here."""
    report = ("import signal\nprint(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,"
              " signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)\n")
    fresh = subprocess.run([sys.executable, "-c", report], capture_output=True, text=True, timeout=60).stdout
    assert fresh.startswith("True ")
    script = _script(tmp_path, report + "import time\ntime.sleep(600)\n")
    process = _warm_popen([sys.executable, script], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == fresh
    process.terminate()
    assert process.wait(timeout=30) == -signal.SIGTERM
    process.stdout.close()


def test_a_child_imports_ppe_snapshot_itself_under_its_environment(tmp_path):
    script = _script(tmp_path, "import sys\nassert 'ppe_snapshot' not in sys.modules\n"
                               "import ppe_snapshot.settings, torch\n"
                               "print(ppe_snapshot.__file__, ppe_snapshot.settings.SETTINGS.block_bytes,"
                               " torch.get_num_threads())\n")
    done = _warm.run([sys.executable, script], capture_output=True, text=True, timeout=60,
                     env={**os.environ, "PYTHONPATH": ROOT, "PPE_SNAPSHOT_BLOCK_KB": "12", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{os.path.join(ROOT, 'ppe_snapshot', '__init__.py')} 12288 1\n"
    assert type(_warm.popen([sys.executable, script], stdout=subprocess.DEVNULL)) is _warm.WarmPopen


def test_what_it_cannot_start_warm_is_a_plain_popen(tmp_path):
    script = _script(tmp_path, "print('hi')\n")
    plain = [_warm.popen([sys.executable, "-u", script], stdout=subprocess.PIPE),
             _warm.popen([sys.executable, script], stdout=subprocess.PIPE, env={**os.environ, "PYTHONHASHSEED": "7"}),
             _warm.popen(["sh", "-c", f"exec {sys.executable} {script}"], stdout=subprocess.PIPE),
             _warm.popen([sys.executable, script], stdout=subprocess.PIPE, start_new_session=True)]
    for process in plain:
        assert type(process) is subprocess.Popen
        assert process.communicate(timeout=60) == (b"hi\n", None) and process.returncode == 0


_REPORT = ("import os, sys\nprint(sys.argv, repr(sys.path[0]), __name__, globals().get('__file__'),"
           " os.getppid() == int(os.environ['CALLER']))\n")


def test_code_and_modules_run_as_the_interpreter_runs_them(tmp_path, monkeypatch):
    """``-c`` and ``-m`` children see the argv, first path entry, ``__main__`` and parent a plain start sees; a
    failure's traceback and status are the interpreter's."""
    (tmp_path / "reporter.py").write_text(_REPORT)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "CALLER": str(os.getpid())}
    for args in ([sys.executable, "-c", _REPORT, "a", "b c"], [sys.executable, "-m", "reporter", "x"],
                 [sys.executable, "-c", "raise KeyError('k')"], [sys.executable, "-m", "no_such_module"]):
        plain = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
        process = _warm_popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert process.communicate(timeout=60) == (plain.stdout, plain.stderr)
        assert process.returncode == plain.returncode
    assert plain.returncode == 1 and "No module named no_such_module" in plain.stderr
    assert subprocess.run([sys.executable, "-c", _REPORT], capture_output=True, text=True, timeout=60,
                          env=env).stdout == "['-c'] '' __main__ None True\n"


def test_passed_descriptors_keep_their_numbers(tmp_path):
    read, write = os.pipe()
    try:
        code = ("import os, sys\nfd = int(sys.argv[1])\nos.write(fd, b'through %d' % fd)\n"
                "print(os.get_inheritable(fd), os.fstat(fd).st_ino == int(sys.argv[2]))\n")
        process = _warm_popen([sys.executable, "-c", code, str(write), str(os.fstat(write).st_ino)],
                              pass_fds=[write], stdout=subprocess.PIPE, text=True)
        os.close(write)
        out, _ = process.communicate(timeout=60)
        assert (process.returncode, out) == (0, "True True\n")
        assert os.read(read, 100) == f"through {write}".encode() and os.read(read, 100) == b""
    finally:
        os.close(read)


def test_a_process_writers_worker_starts_warm_and_stays_with_its_parent(tmp_path):
    """The suite's Process writers start their workers warm (conftest): a worker that finds its parent changed
    leaves, so it must see this process as its parent past its checks (``PARENT_CHECK_S``)."""
    import torch

    from ppe_snapshot import Snapshot
    from ppe_snapshot.writing import ProcessWriter
    from ppe_snapshot.writing._worker import PARENT_CHECK_S

    writer = ProcessWriter(out_dir=str(tmp_path))
    try:
        writer("a", str(tmp_path), {"x": torch.arange(3)})
        writer.wait()
        pid = writer.worker_pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[1].endswith(b"_zygote.py")
        time.sleep(2.5 * PARENT_CHECK_S)
        writer("b", str(tmp_path), {"x": torch.arange(4)})
        writer.wait()
        assert writer.worker_pid == pid
    finally:
        writer.finalize()
    Snapshot(str(tmp_path / "b")).verify()
    assert _gone(pid)


def test_children_run_side_by_side_and_start_fast(tmp_path):
    script = _script(tmp_path, "import sys, time\ntime.sleep(float(sys.argv[1]))\nsys.exit(int(sys.argv[2]))\n")
    _warm_popen([sys.executable, script, "0", "0"]).wait(timeout=60)  # the zygote is up
    started = time.monotonic()
    processes = [_warm_popen([sys.executable, script, str(0.5 - i / 10), str(i)]) for i in range(4)]
    assert [p.wait(timeout=60) for p in processes] == [0, 1, 2, 3]
    assert time.monotonic() - started < 10


def _gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in "ZXx":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_zygote_that_dies_is_reported_and_plain_processes_follow(tmp_path, monkeypatch):
    script = _script(tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    zygote = _warm._Zygote()
    monkeypatch.setattr(_warm, "_zygote", zygote)  # this test's own, which it kills (restored afterwards)
    monkeypatch.setattr(_warm, "_broken", False)
    running = _warm_popen([sys.executable, script], stdout=subprocess.PIPE, text=True)
    try:
        assert running.stdout.readline() == "up\n"
        zygote.process.kill()
        zygote.process.wait(timeout=30)
        with pytest.raises(RuntimeError, match="lost the zygote"):
            running.wait(timeout=30)
        with pytest.warns(RuntimeWarning, match="zygote is gone"):
            plain = _warm.popen([sys.executable, script], stdout=subprocess.PIPE, text=True)
        assert type(plain) is subprocess.Popen and plain.stdout.readline() == "up\n"
        plain.kill()
        assert plain.wait(timeout=30) == -signal.SIGKILL
        plain.stdout.close()
        later = _warm.popen([sys.executable, script], stdout=subprocess.DEVNULL)
        later.kill()
        assert type(later) is subprocess.Popen and later.wait(timeout=30) == -signal.SIGKILL
    finally:
        os.kill(running.pid, signal.SIGKILL)  # orphaned when its zygote died
        running.stdout.close()
        zygote.close()
    assert _gone(running.pid)


def test_the_zygote_ends_with_the_process_that_started_it(tmp_path):
    script = _script(tmp_path, "print('child')\n")
    starter = (f"import os, subprocess, sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\nimport _warm\n"
               f"child = _warm.popen([sys.executable, {script!r}])\nassert child.wait(timeout=60) == 0\n"
               "print(_warm._zygote.process.pid, flush=True)\nos._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    out = done.stdout.split()
    assert out[0] == "child" and _gone(int(out[1]))


def test_a_zygote_that_does_not_start_leaves_plain_processes(tmp_path, monkeypatch):
    broken = tmp_path / "zygote.py"
    broken.write_text("import sys\nsys.exit('no torch here')\n")
    script = _script(tmp_path, "print('hi')\n")
    monkeypatch.setattr(_warm, "ZYGOTE", str(broken))
    monkeypatch.setattr(_warm, "_zygote", None)  # this process's zygote is restored afterwards
    monkeypatch.setattr(_warm, "_broken", False)
    with pytest.warns(RuntimeWarning, match="zygote did not start"):
        process = _warm.popen([sys.executable, script], stdout=subprocess.PIPE)
    assert type(process) is subprocess.Popen
    assert process.communicate(timeout=60) == (b"hi\n", None) and process.returncode == 0
