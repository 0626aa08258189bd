"""save_on_signals: real SIGTERMs sent to real training processes (one process, and 2 gloo ranks in
DISTRIBUTED and SHARDED modes), every writer kind: the iteration saved, durable at exit, the exit status,
resume with autoload, no hang, no worker left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import ppe_snapshot
from ppe_snapshot import Preempted, Snapshot

import _warm
from _extension_workers import Run, make_writer, snapshot_names

HERE = os.path.dirname(os.path.abspath(__file__))
ITERS = 400  # far more than a test waits for: the run ends by preemption
TIMEOUT = 240


def _start(out: str, writer: str, mode: str, world: int, iterations: int = ITERS) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    # A fresh rendezvous file per run: a preempted run exits without destroying its group, and torch's
    # FileStore must never be reused once its file may be left behind (a second run on it can hang).
    init = f"file://{out}/rendezvous-{time.monotonic_ns()}"
    return [_warm.popen([sys.executable, os.path.join(HERE, "_preempt_child.py"), out, writer, mode, str(rank),
                         str(world), init, str(iterations)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True, env=env) for rank in range(world)]


def _wait_for_iteration(proc: subprocess.Popen, at_least: int) -> int:
    for line in proc.stdout:
        if line.startswith("iter ") and int(line.split()[1]) >= at_least:
            return int(line.split()[1])
    raise AssertionError(f"the training process ended before iteration {at_least}: {proc.stderr.read()[-3000:]}")


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a training process hung after the signal") from None
        results.append((p.returncode, out, err))
    return results


def _preempted_line(out: str) -> list[str]:
    lines = [line.split() for line in out.splitlines() if line.startswith("preempted ")]
    assert len(lines) == 1, out
    return lines[0][1:]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int) -> bool:
    """Whether ``pid`` ends (a worker exits once it sees its parent gone); waits up to 60 s for it."""
    for _ in range(600):
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


_MODES = {"DEFAULT": (1, (0,)), "DISTRIBUTED": (2, (1,)), "SHARDED": (2, (0,))}


# The multi-rank modes with the ProcessWriter (the save crosses a process boundary there, and the ranks agree
# across it), each other writer in one mode; the ThreadWriter in the multi-rank modes is also run by the three-rank
# test below, DEFAULT mode with the ProcessWriter by the second-signal test. A writer x mode matrix cost 50 s
# more of the suite, which must stay under 10 minutes on 2 cores.
@pytest.mark.parametrize("writer, mode", [("ProcessWriter", "DISTRIBUTED"), ("ProcessWriter", "SHARDED"),
                                          ("SimpleWriter", "SHARDED"), ("ThreadWriter", "DEFAULT")])
def test_sigterm_saves_the_iteration_waits_until_durable_and_resumes(tmp_path, writer, mode):
    world, signalled = _MODES[mode]
    _preempt_and_resume(str(tmp_path), writer, mode, world, signalled)


@pytest.mark.parametrize("mode", ["DISTRIBUTED", "SHARDED"])
def test_three_ranks_signalled_one_after_another_save_the_same_iteration(tmp_path, mode):
    _preempt_and_resume(str(tmp_path), "ThreadWriter", mode, 3, (2, 0))


def _preempt_and_resume(out: str, writer: str, mode: str, world: int, signalled: tuple[int, ...]) -> None:
    procs = _start(out, writer, mode, world)
    # Every rank signalled has its handler (it trains): in SHARDED mode a rank may start iterations after another
    # (nothing syncs their steps), and a signal before its extension is initialized ends it the default way.
    seen = max(_wait_for_iteration(procs[rank], 3) for rank in signalled)
    for rank in signalled:  # only some ranks get the signal: every rank must still save the same iteration
        procs[rank].send_signal(signal.SIGTERM)
    results = _finish(procs)
    saved = set()
    for code, stdout, stderr in results:
        assert code == 128 + signal.SIGTERM, stderr[-3000:]
        iteration, status, workers, default_restored = _preempted_line(stdout)
        assert int(status) == 143 and default_restored == "True"
        saved.add(int(iteration))
        for pid in ([] if workers == "-" else [int(p) for p in workers.split(",")]):
            assert _gone(pid), f"writer worker {pid} outlived its training process"
    assert len(saved) == 1, saved  # every rank saved the same iteration
    iteration = saved.pop()
    assert seen <= iteration < ITERS
    assert snapshot_names(out) == [f"snapshot_iter_{iteration}"]
    snap = Snapshot(os.path.join(out, f"snapshot_iter_{iteration}"))
    snap.verify(deep=True)  # durable and whole when the process exited
    assert snap.metadata["iteration"] == iteration
    # resume: every rank starts at the saved iteration and trains to the end
    resumed = _finish(_start(out, writer, mode, world, iterations=iteration + 3))
    for code, stdout, stderr in resumed:
        assert code == 0, stderr[-3000:]
        assert f"start {iteration}\n" in stdout
        assert f"done {iteration + 3} resumed snapshot_iter_{iteration}" in stdout


def test_a_second_signal_during_the_save_is_ignored(tmp_path):
    out = str(tmp_path)
    (proc,) = _start(out, "ProcessWriter", "DEFAULT", 1)
    _wait_for_iteration(proc, 3)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # before or during the save: recorded, the save completes
    ((code, stdout, stderr),) = _finish([proc])
    assert code == 143, stderr[-3000:]
    iteration = int(_preempted_line(stdout)[0])
    assert snapshot_names(out) == [f"snapshot_iter_{iteration}"]
    Snapshot(os.path.join(out, f"snapshot_iter_{iteration}")).verify(deep=True)


def test_in_process_signal_saves_at_the_end_of_its_iteration_and_restores_the_previous_handler(tmp_path):
    out = str(tmp_path)
    previous = signal.signal(signal.SIGUSR1, lambda *a: None)
    try:
        mine = signal.getsignal(signal.SIGUSR1)
        kwargs = {"writer": make_writer("ThreadWriter", out_dir=out), "save_on_signals": (signal.SIGUSR1,),
                  "preempted_exit_code": 7}
        run = Run(out, 50, kwargs, trigger=(1000, "iteration"))
        manager = run.manager
        with pytest.raises(Preempted) as caught:
            while not manager.stop_trigger:
                with manager.run_iteration(step_optimizers=["main"]):
                    if manager.iteration == 4:  # the 5th iteration: it ends with iteration 5 saved
                        os.kill(os.getpid(), signal.SIGUSR1)
                        assert signal.getsignal(signal.SIGUSR1) is not mine  # ours while training
        e = caught.value
        assert (e.code, e.iteration, e.signum, e.snapshot) == (7, 5, signal.SIGUSR1, "snapshot_iter_5")
        assert signal.getsignal(signal.SIGUSR1) is mine and manager._finalized
        assert snapshot_names(out) == ["snapshot_iter_5"]
        Snapshot(os.path.join(out, "snapshot_iter_5")).verify(deep=True)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_preempted_is_a_system_exit_with_a_documented_status():
    e = Preempted(143, signal.SIGTERM, 12, "snapshot_iter_12")
    assert isinstance(e, SystemExit) and e.code == 143 and e.iteration == 12
    assert "signal 15 at iteration 12" in str(e)


@pytest.mark.parametrize("signals, error, fragment", [
    ((signal.SIGKILL,), ValueError, "SIGKILL cannot be caught"),
    (("TERM",), ValueError, "is not a signal"),
    (signal.SIGTERM, TypeError, "takes a tuple of signals"),
])
def test_bad_signals(signals, error, fragment):
    with pytest.raises(error, match=fragment):
        ppe_snapshot.snapshot(save_on_signals=signals)
    with pytest.raises(TypeError, match="preempted_exit_code must be an int"):
        ppe_snapshot.snapshot(save_on_signals=(signal.SIGTERM,), preempted_exit_code="1")


def test_a_rank_that_died_is_named_by_the_signal_agreement_of_the_others(tmp_path):
    """SHARDED (no collective in the training step): rank 2 is SIGKILLed; at their next agreement ranks 0 and 1
    raise a SnapshotError naming it, instead of waiting in a collective."""
    procs = _start(str(tmp_path), "ThreadWriter", "SHARDED", 3)
    for proc in procs:
        _wait_for_iteration(proc, 3)
    procs[2].kill()
    procs[0].send_signal(signal.SIGTERM)
    started = time.monotonic()
    results = _finish(procs)
    assert time.monotonic() - started < 30
    assert results[2][0] == -signal.SIGKILL
    for code, stdout, stderr in results[:2]:
        assert code == 1, stderr[-3000:]
        assert "SnapshotError: preemption: the ranks could not agree, rank 2 died or lost its connection" in stderr, \
            stderr[-3000:]
