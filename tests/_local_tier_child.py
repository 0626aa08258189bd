"""One rank of a training run with a local tier, simulated nodes on one machine: run as a script.

``python tests/_local_tier_child.py RANK WORLD PORT SPEC_JSON``: joins a gloo group on 127.0.0.1:PORT and trains
a small model (gradients all-reduced every iteration, so a dead rank stops the others) for ``spec["iterations"]``
iterations with the snapshot extension in ``spec["mode"]`` (``default``, ``distributed``, ``sharded``), its
``spec["writer"]``, durable snapshots every ``spec["durable"]`` iterations under ``<dir>/out`` and a local tier
every ``spec["local"]`` iterations in ``<dir>/node<n>`` (``n``: this rank's node, ``PPE_SNAPSHOT_NODE``).
``spec["kill"]`` maps a rank to the iteration at whose end it SIGKILLs itself, once its part of local step
``spec["complete"]`` (if given) is marked complete; ``spec["kill_after"]`` maps a rank to ``[iteration, seconds]``:
that many seconds after iteration ``iteration`` begins (0: after the process groups formed) it SIGKILLs itself, at
whatever it is doing then, and it waits to be killed after iteration ``iteration + 2`` (0: after its second);
``spec["kill_in_copy"]`` (``[rank, step]``) has that rank SIGKILL itself while it sends its part of that local
step to its partner (after the header, before the first chunk); ``spec["flip_in_copy"]`` (``[rank, step]``) has it
flip a bit of what it sends of that step; ``spec["kill_in_serve"]`` (a rank) has that rank SIGKILL itself when it
first sends bytes of a copy it holds to a rank restoring from it; ``spec["kill_in_read"]`` (a rank), when it first
waits for bytes of the copy it restores from (with the copy's header, or asked for); ``spec["wipe_at"]`` maps a
rank to the iteration at whose end it removes its node's local directory while the run goes on.
At the end it writes ``<dir>/result-rank<r>.pt``: the iteration, where autoload resumed from, the model's and the
optimizer's state.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import pytorch_pfn_extras as ppe  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ppe_snapshot  # noqa: E402
from ppe_snapshot import writing  # noqa: E402

MODES = {"default": ppe.training.extensions.SnapshotMode.DEFAULT,
         "distributed": ppe.training.extensions.SnapshotMode.DISTRIBUTED,
         "sharded": ppe.training.extensions.SnapshotMode.SHARDED}
WRITERS = {"simple": writing.SimpleWriter, "thread": writing.ThreadWriter, "process": writing.ProcessWriter}


def main(rank: int, world: int, port: int, spec: dict) -> None:
    faulthandler.dump_traceback_later(spec.get("dump_after", 300), exit=True)  # never hang a test
    kill_after = spec.get("kill_after", {}).get(str(rank))
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s %(levelname)s %(message)s")
    logging.getLogger("ppe_snapshot.extension.resuming").setLevel(logging.INFO)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    if kill_after is not None and kill_after[0] == 0:
        # (once the groups are formed, the default one and the snapshots' side group: a process killed while gloo
        # connects its peers leaves them connecting to a port that another test's group may take next)
        if world > 1:
            ppe_snapshot.engine.side_group(None)
        _die_after(kill_after[1])
    node = os.environ.get("PPE_SNAPSHOT_NODE", "0")
    torch.manual_seed(0 if spec["mode"] != "sharded" else rank)
    width = spec.get("width", 16)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    manager = ppe.training.ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=spec["iterations"],
                                             out_dir=os.path.join(spec["dir"], "out"))
    tier = ppe_snapshot.LocalTier(directory=os.path.join(spec["dir"], f"node{node}"),
                                  trigger=(spec["local"], "iteration"), n_retains=2)
    extension = ppe_snapshot.snapshot(autoload=True, snapshot_mode=MODES[spec["mode"]],
                                      saver_rank=0 if spec["mode"] == "distributed" else None,
                                      writer=WRITERS[spec["writer"]](), local=tier)
    manager.extend(extension, trigger=(spec["durable"], "iteration"))
    kill_at, wipe_at = (spec.get(key, {}).get(str(rank)) for key in ("kill", "wipe_at"))  # (as kill_after)
    if spec.get("kill_in_copy", [None])[0] == rank:
        _die_in_copy(f"step_{spec['kill_in_copy'][1]}/")
    if spec.get("kill_in_serve") == rank:
        _die_in_serve()
    if spec.get("kill_in_read") == rank:
        _die_in_read()
    if spec.get("flip_in_copy", [None])[0] == rank:
        _flip_in_copy(f"step_{spec['flip_in_copy'][1]}/")
    ran = 0  # iterations this process ran
    while not manager.stop_trigger:
        if kill_after is not None and kill_after[0] and manager.iteration + 1 == kill_after[0]:
            _die_after(kill_after[1])
        if kill_after is not None and (manager.iteration == kill_after[0] + 2 if kill_after[0] else ran == 2):
            time.sleep(3600)  # (killed by the timer meanwhile)
        ran += 1
        with manager.run_iteration():
            x = torch.randn(8, width)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            if world > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            optimizer.step()
        if manager.iteration == wipe_at:  # as an operator, or a cleaner of /dev/shm, might
            shutil.rmtree(os.path.join(spec["dir"], f"node{node}"), ignore_errors=True)
        if manager.iteration == kill_at:
            if "complete" in spec:
                _wait_for(os.path.join(spec["dir"], f"node{node}", f"step_{spec['complete']}", f"rank{rank}.complete"))
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save({"iteration": manager.iteration, "resumed_from": extension.resumed_from,
                "model": model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(spec["dir"], f"result-rank{rank}.pt"))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _wait_for(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def _die_in_copy(step: str) -> None:
    """SIGKILL this process when it first reads its part of local ``step`` to send it to its partner."""
    from ppe_snapshot.local_tier import transfer

    read = transfer._Stream.read

    def read_or_die(self, index, out):
        if step in self.storage.url:
            os.kill(os.getpid(), signal.SIGKILL)
        read(self, index, out)

    transfer._Stream.read = read_or_die


def _die(*args: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_after(seconds: float) -> None:
    """SIGKILL this process ``seconds`` from now, from another thread: whatever the process does then."""
    timer = threading.Timer(seconds, _die)
    timer.daemon = True
    timer.start()


def _die_in_serve() -> None:
    """SIGKILL this process when it first sends bytes of a copy it holds to the rank restoring from it: the small
    files that go with the header (read first), or the pieces asked for."""
    from ppe_snapshot.local_tier import peer_reads

    peer_reads._small_files = _die
    peer_reads._Sending.piece = _die


def _die_in_read() -> None:
    """SIGKILL this process when it first waits for bytes of the copy it restores from: the small files that come
    with the header, or the pieces it asked for."""
    from ppe_snapshot.local_tier import peer_reads

    peer_reads._receive_inline = _die
    peer_reads.PeerFiles._receive = _die


def _flip_in_copy(step: str) -> None:
    """Flip a bit of every chunk this process sends of its part of local ``step``, after hashing it (a copy that
    arrives other than it was sent)."""
    from ppe_snapshot.local_tier import transfer

    read = transfer._Stream.read

    def read_and_flip(self, index, out):
        read(self, index, out)
        if step in self.storage.url:
            out[0] ^= 1

    transfer._Stream.read = read_and_flip


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
