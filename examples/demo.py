"""Kill a training run with SIGKILL, restart it, and get exactly the weights of an uninterrupted run.

Run it with ``make demo`` (or ``python examples/demo.py``). It trains a small
MLP (with dropout, so the RNG matters) under pytorch-pfn-extras'
``ExtensionsManager`` with::

    ppe_snapshot.snapshot(writer=ppe_snapshot.writing.ProcessWriter(), n_retains=3, autoload=True)

every few iterations, three times, each in a child process:

1. straight through, as the reference (beside run 2);
2. killed with SIGKILL right after a snapshot was handed to the writer (its
   write may still be in flight);
3. restarted on the same directory: ``autoload`` finds the newest complete
   snapshot, and training goes on from there to the end.

After the kill it prints which snapshots were complete at that moment and, once the writer process (which
outlives the trainer by the save in hand) has exited, whether it finished the one it was writing. It prints
where run 3 resumed from, then PASS when its final model and
optimizer are bit-identical to run 1 (FAIL and exit status 1 otherwise).
With ``--keep DIR`` the runs are made under DIR and left there, to explore
with the command line (``ppe-snapshot ls DIR/crashed``).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import torch

ITERATIONS = 60
SNAPSHOT_EVERY = 5
KILL_AFTER = 35  # iterations; a snapshot was just taken


def train(out_dir: str, iterations: int) -> None:
    """The child: train, snapshot, print progress; resume from ``out_dir`` if it holds snapshots."""
    import pytorch_pfn_extras as ppe
    import torch.nn.functional as F

    import ppe_snapshot

    logging.basicConfig(level=logging.WARNING, format="    %(message)s", stream=sys.stdout)
    warnings.filterwarnings("ignore", message="ppe_snapshot autoload")  # the log line says it already
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(  # about 1.6 M parameters: with Adam, about 19 MiB of state
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(1024, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    manager = ppe.training.ExtensionsManager(
        model, optimizer, 1, iters_per_epoch=ITERATIONS, out_dir=out_dir, stop_trigger=(iterations, "iteration"))
    # Dropout draws from the global RNG; snapshots hold its state, so the resumed run draws the same numbers.
    snapshot = ppe_snapshot.snapshot(writer=ppe_snapshot.writing.ProcessWriter(), n_retains=3, autoload=True)
    manager.extend(snapshot, trigger=(SNAPSHOT_EVERY, "iteration"))

    write_times: list[float | None] = []  # of each save, once the writer reported it
    manager.start_extensions()  # autoload happens here
    if snapshot.resumed_from is not None:
        print(f"RESUMED {snapshot.resumed_from} iteration {manager.iteration}", flush=True)
    print(f"WRITER {snapshot.writer.worker_pid}", flush=True)  # the parent waits for it to go after the kill
    while not manager.stop_trigger:
        with manager.run_iteration(step_optimizers=["main"]):
            g = torch.Generator().manual_seed(manager.iteration)  # the data of this iteration
            x = torch.randn(64, 512, generator=g)
            y = torch.randint(0, 10, (64,), generator=g)
            F.cross_entropy(model(x), y).backward()
        if manager.iteration % SNAPSHOT_EVERY == 0:  # the stats of the save just handed to the writer
            stats, previous = snapshot.writer.last_stats, write_times[-1] if write_times else None
            print(f"SNAPSHOT {manager.iteration}: the loop waited {stats['blocking_s'] * 1e3:.0f} ms for "
                  f"{stats['bytes'] / 2**20:.1f} MiB" +
                  (f"; the write before took {previous * 1e3:.0f} ms in the writer process" if previous else ""),
                  flush=True)
            write_times.append(None)
        if write_times and write_times[-1] is None and "snapshot/write_s" in manager.observation:
            write_times[-1] = manager.observation["snapshot/write_s"]
        print(f"ITERATION {manager.iteration}", flush=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, os.path.join(out_dir, "final.pt"))


def _child(out_dir: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", out_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _show(line: str) -> None:
    if line.startswith("SNAPSHOT"):
        print(f"    snapshot at iteration {line[len('SNAPSHOT '):]}", end="")
    elif line.startswith("RESUMED"):
        _, path, _, iteration = line.split()
        print(f"  autoload resumed from {path} at iteration {iteration}")
    elif not line.startswith(("ITERATION", "WRITER")):
        print(line, end="")


def _run_to_end(out_dir: str, show: bool = True) -> list[str]:
    child = _child(out_dir)
    lines = []
    for line in child.stdout:
        lines.append(line.rstrip("\n"))
        if show:
            _show(line)
    if child.wait() != 0:
        raise SystemExit(f"FAIL: the training process exited with status {child.returncode}")
    return lines


def _run_and_kill(out_dir: str) -> int | None:
    """Runs the child until KILL_AFTER and SIGKILLs it; returns its writer process's pid."""
    child, writer_pid = _child(out_dir), None
    for line in child.stdout:
        if line.startswith("WRITER"):
            writer_pid = int(line.split()[1])
        elif line.startswith(("SNAPSHOT", "ITERATION")) and int(line.split()[1].rstrip(":")) >= KILL_AFTER:
            child.send_signal(signal.SIGKILL)  # right after the snapshot was handed to the writer
            _show(line)
            break
        _show(line)
    child.wait()
    child.stdout.close()
    print(f"  killed the training process after iteration {KILL_AFTER} (status {child.returncode})")
    return writer_pid


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _snapshots(out_dir: str) -> tuple[list[str], set[str]]:
    """The snapshot directories in ``out_dir``, oldest first, and those that are complete (have a manifest)."""
    names = sorted((n for n in os.listdir(out_dir) if n.startswith("snapshot_iter_")), key=lambda n: int(n[14:]))
    return names, {n for n in names if os.path.exists(os.path.join(out_dir, n, "manifest.json"))}


def _report_kill(out_dir: str, writer_pid: int | None) -> None:
    """Says what the kill left: what was complete at that moment, and what the writer process did after it.

    The ProcessWriter's worker is a process of its own: it finishes the save in hand (or not) and exits once it
    sees its parent gone. The listing is made again once it has, so that what is printed is what autoload finds.
    """
    names, complete = _snapshots(out_dir)
    writing = [n for n in names if n not in complete]
    print(f"  complete at the kill: {', '.join(n for n in names if n in complete) or 'none'}" +
          (f"; being written by the writer process: {', '.join(writing)}" if writing else ""))
    deadline = time.monotonic() + 30
    while writer_pid is not None and _alive(writer_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if writer_pid is not None and _alive(writer_pid):
        print(f"  the writer process (pid {writer_pid}) is still running after 30 s")
        return
    _, complete_after = _snapshots(out_dir)
    for name in writing:
        if name in complete_after:
            print(f"  the writer process finished {name} after the trainer died, then exited: it is complete")
        else:
            print(f"  the writer process exited without finishing {name}: an incomplete leftover (no manifest.json),"
                  " which autoload skips and n_retains removes")


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def main(keep: str | None) -> int:
    if keep is not None and os.path.exists(keep) and os.listdir(keep):
        print(f"{keep} is not empty; give --keep a new or empty directory", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with (contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="ppe-snapshot-demo-")) as root:
        os.makedirs(root, exist_ok=True)
        straight, crashed = os.path.join(root, "straight"), os.path.join(root, "crashed")
        print(f"1. training {ITERATIONS} iterations without interruption (the reference, beside run 2)")
        with concurrent.futures.ThreadPoolExecutor(1) as background:
            reference = background.submit(_run_to_end, straight, False)
            print(f"2. training again, snapshots every {SNAPSHOT_EVERY} iterations, and killing it with SIGKILL\n"
                  "   (the first write also waits for the writer's new worker process to import torch)")
            _report_kill(crashed, _run_and_kill(crashed))
            reference.result()  # raises its SystemExit if it failed
        print("3. restarting it with autoload=True")
        lines = _run_to_end(crashed)
        if not any(line.startswith("RESUMED") for line in lines):
            print("FAIL: the restarted run did not resume from a snapshot")
            return 1
        expected = torch.load(os.path.join(straight, "final.pt"))
        got = torch.load(os.path.join(crashed, "final.pt"))
        ok = _same(expected, got)
    print(f"{'PASS' if ok else 'FAIL'}: the final model and optimizer state are "
          f"{'bit-identical to' if ok else 'different from'} the uninterrupted run's "
          f"({time.perf_counter() - start:.1f} s)")
    if keep:
        tool = os.path.join(os.path.dirname(sys.executable), "ppe-snapshot")  # the venv's, which PATH may lack
        print(f"the run directories are in {keep}; try: {tool if os.path.exists(tool) else 'ppe-snapshot'} ls "
              f"{os.path.join(keep, 'crashed')}")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", metavar="OUT_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--keep", metavar="DIR", help="make the runs under DIR (new or empty) and leave them there")
    args = parser.parse_args()
    if args.child:
        train(args.child, ITERATIONS)
    else:
        sys.exit(main(args.keep))
