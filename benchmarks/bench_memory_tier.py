"""The local tier (issue 34): restore from node-local memory and from partners' copies, and what a local save
blocks, beside the floors measured in the same run.

    python benchmarks/bench_memory_tier.py [--rounds 3] [--mib 256] [--s3] [--compute 2.0] [--ranks 4]

Four gloo ranks (``--ranks``) simulate two nodes of two (``PPE_SNAPSHOT_NODE``, a local directory per node under
/dev/shm), each with ``--mib`` MiB of state (16 tensors), SHARDED mode, the ThreadWriter, durable snapshots to
local disk. Per round, each case in a fresh set of processes:

- **blocking**: iterations of ``--compute`` seconds (a sleep standing for the training step); 6 iterations saving
  a local step each (local trigger 1, durable 1000) against 6 iterations saving an
  async durable snapshot each with the same writer (no tier), and iterations where both are due (local 1,
  durable 2; the 4th and 6th): the median time the loop waited per save, and, of that, the local tier's save
  (which, at such a step, copies the state from the durable save's staged image in the background; it includes
  waiting for the previous local step, one being in flight at a time).
- **own parts**: a run saves a durable snapshot at iteration 2 and local step 3, and stops (the tier intact);
  the restart's autoload (from the extension's autoload call to the training step; and the first
  ``run_iteration``'s whole start, with the extension's other start-up, the local tier's node exchange included)
  is timed on every rank, the slowest reported, against the floor measured by the same processes just before:
  the 4 ranks at once each reading its part's bytes from /dev/shm into tensors (``readinto``), the slowest rank;
  and beside it the restore's work done bare: an agreement round, the read, another round (a part unchanged since
  it completed is read without its checksums checked). The same restart again with ``LocalTier(verify="always")``:
  every chunk hashed as it is read (and, bare, the read with every 1 MiB hashed between the two rounds).
- **node lost**: the same, with node 1's directory wiped before the restart: ranks 2 and 3 fetch their parts from
  ranks 0 and 1. Floor, measured by the same processes just before: the same bytes sent alone over a gloo group
  between the same pairs, 16 MiB at a time (from and into tensors of the part's size); and beside it all the
  work such a restart must do, done bare: an agreement round, that transfer while ranks 0 and 1 read their own
  parts and every byte received is hashed, another round.
- **S3** (``--s3``): the 4 ranks save a durable snapshot to S3 through ``s3_shaped.py`` (40 MB/s per connection,
  15 ms), every node's local directory is wiped, and the restart's autoload restores from S3 (the slowest rank),
  against the own-part restore above; and one rank's part restored alone from S3 and from tmpfs, in one process.

With ``--ranks 2`` the two nodes have one rank each: on this project's 2-core VM, a core per rank, as on a real
node, instead of four ranks sharing two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from common import free_port  # noqa: E402

WORLD, PER_NODE, TENSORS = 4, 2, 16
BARE_OWN = "  the restore's work, bare (2 rounds)"
BARE_CHECKED = "  the restore's work, bare (hashed, 2 rounds)"
ALWAYS, ALWAYS_RATIO = "restore, own parts, verify='always'", "  verify='always' / read floor, this round"
BARE = "  all the restore's work, bare"


# -- a rank ------------------------------------------------------------------------------------------------------
def _state(mib: int, rank: int):
    import torch
    torch.manual_seed(rank)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(mib * (1 << 20) // 4 // TENSORS))
                                   for _ in range(TENSORS)])


def rank_main(rank: int, port: int, spec: dict) -> None:
    global WORLD, PER_NODE
    WORLD, PER_NODE = spec["world"], spec["world"] // 2
    import pytorch_pfn_extras as ppe
    import torch
    import torch.distributed as dist

    import ppe_snapshot
    from ppe_snapshot import writing
    from ppe_snapshot.extension.local_steps import LocalSteps

    local_saves: list[float] = []  # what the local tier's save takes of each iteration's wait
    save = LocalSteps.save
    autoload_start: list[float] = []

    def timed_save(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        save(self, *args, **kwargs)
        local_saves.append(time.perf_counter() - start)
    LocalSteps.save = timed_save
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    node = rank // PER_NODE
    model = _state(spec["mib"], rank if spec["case"] != "restart" else 1000 + rank)
    floor, bare = None, None
    if spec.get("floor"):  # the floors, by these processes, just before they restore
        part = os.path.join(spec["dir"], f"node{node}", f"step_{spec['step']}", f"rank{rank}")
        if spec["floor"] == "transfer":
            floor = _transfer_floor(rank, spec["mib"])
            bare = _transfer_floor(rank, spec["mib"], part)
        else:
            floor = _read_floor(part)
            bare = _read_floor(part, agreed=True, hashed=spec.get("verify") == "always")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    manager = ppe.training.ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=100,
                                             out_dir=os.path.join(spec["dir"], "out"))
    local = spec.get("local")
    tier = None if local is None else ppe_snapshot.LocalTier(directory=os.path.join(spec["dir"], f"node{node}"),
                                                              trigger=(local, "iteration"), n_retains=1,
                                                              verify=spec.get("verify", "changed"))
    durable = {"out_dir": spec["out"], "storage_options": spec["options"]} if "out" in spec else {}
    extension = ppe_snapshot.snapshot(autoload=True, snapshot_mode=ppe.training.extensions.SnapshotMode.SHARDED,
                                      writer=writing.ThreadWriter(**durable), local=tier)
    manager.extend(extension, trigger=(spec["durable"], "iteration"))
    autoload = type(extension)._autoload  # (each mode's class has its own)

    def timed_autoload(self, manager):
        autoload_start.append(time.perf_counter())
        return autoload(self, manager)
    type(extension)._autoload = timed_autoload
    waits = []
    for _ in range(spec["iterations"]):
        start = time.perf_counter()
        with manager.run_iteration():
            time.sleep(spec.get("compute_s", 0.0))  # the training step, during which background saves go on
            first = time.perf_counter()
            if spec["case"] == "restart":  # resumed: cut off before this iteration saves anything
                _report(spec, rank, {"autoload_s": first - autoload_start[0], "initialize_s": first - start,
                                     "resumed_from": extension.resumed_from, "floor_s": floor,
                                     "bare_s": bare})
        waits.append((first - start, time.perf_counter() - first))  # (initialize + autoload, the saves)
    result = {"save_waits": [w for _, w in waits], "local_saves": local_saves}
    extension.writer.wait()  # the durable snapshots in flight are committed: the next run finds them
    if extension._local is not None:
        extension._local.saves.finish()  # the steps in flight complete: the next run finds them
    _report(spec, rank, result)


def _report(spec: dict, rank: int, result: dict) -> None:
    """Write this rank's results, meet the others, and end the process as a crash would (no finalize)."""
    import torch.distributed as dist
    with open(os.path.join(spec["dir"], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, **result}, f)
    dist.barrier()
    os._exit(0)


def _part_reads(part: str, hashed: bool = False):
    """A function reading the part's data files from tmpfs into tensors of their size (preallocated, touched);
    ``hashed``: each 1 MiB hashed (xxh3) as it lands, as a restore checks it."""
    import torch
    import xxhash
    files = [os.path.join(root, name) for root, _, names in os.walk(part) for name in names
             if name.endswith(".bin")]
    buffers = [torch.empty(os.path.getsize(p), dtype=torch.uint8) for p in files]
    for b in buffers:
        b.fill_(1)

    def read() -> None:
        for path, buffer in zip(files, buffers):
            with open(path, "rb", buffering=0) as f:
                if not hashed:
                    f.readinto(memoryview(buffer.numpy()))
                    continue
                view = memoryview(buffer.numpy())
                for at in range(0, len(view), 1 << 20):
                    f.readinto(view[at:at + (1 << 20)])
                    xxhash.xxh3_64_intdigest(view[at:at + (1 << 20)])
    return read


def _read_floor(part: str, agreed: bool = False, hashed: bool = False) -> float:
    """Seconds to read the part's data files into tensors (:func:`_part_reads`; ``hashed`` as there), the ranks
    starting at once; ``agreed``: all the work a restart from its own parts must do, bare: an agreement round
    (:func:`_agree`), the read, another round."""
    import torch.distributed as dist
    group = dist.new_group(backend="gloo")
    read = _part_reads(part, hashed=hashed)
    dist.barrier()  # the ranks read at once, as they restore
    start = time.perf_counter()
    if agreed:
        _agree(group, 1)
    read()
    if agreed:
        _agree(group, 2)
    return time.perf_counter() - start


def _agree(group, tag: int) -> None:
    """One agreement round over ``group``, as the tier's restore makes (each rank's document to rank 0, its
    decision back)."""
    from ppe_snapshot.engine import exchange
    exchange(group, {"own": [3], "copies": {}}, tag, lambda docs: docs)


def _transfer_floor(rank: int, mib: int, own: str | None = None) -> float:
    """Seconds for the ranks of node 0 (0 and 1) to send ``mib`` MiB (from a tensor of that size) to those of node 1
    (2 and 3; into one) over a fresh gloo group, 16 MiB per message. ``own``: all the work a node-lost restart
    must do, bare: an agreement round, the transfer while the senders read their own parts from ``own`` (unchanged
    since they completed: not hashed) and every byte received is hashed (xxh3), another round."""
    import threading

    import torch
    import torch.distributed as dist
    import xxhash
    group = dist.new_group(backend="gloo")
    data = torch.ones(mib << 20, dtype=torch.uint8)
    reading = None
    if own is not None and rank < PER_NODE:
        reading = threading.Thread(target=_part_reads(own))
    dist.barrier()
    start = time.perf_counter()
    if own is not None:
        _agree(group, 1)
    if reading is not None:
        reading.start()
    for at in range(0, mib << 20, 16 << 20):
        piece = data[at:at + (16 << 20)]
        if rank < PER_NODE:
            group.send([piece], rank + PER_NODE, 7).wait()
        else:
            group.recv([piece], rank - PER_NODE, 7).wait()
            if own is not None:
                xxhash.xxh3_64_intdigest(memoryview(piece.numpy()))
    if reading is not None:
        reading.join()
    if own is not None:
        _agree(group, 2)
    return time.perf_counter() - start


# -- the driver --------------------------------------------------------------------------------------------------
def run_ranks(spec: dict) -> list[dict]:
    spec = {**spec, "world": WORLD}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--spec",
                               json.dumps(spec)], env=dict(os.environ, PPE_SNAPSHOT_NODE=str(r // PER_NODE),
                                                            OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"))
             for r in range(WORLD)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise RuntimeError(f"a rank exited with {p.returncode}")
    results = []
    for r in range(WORLD):
        with open(os.path.join(spec["dir"], f"rank{r}.json")) as f:
            results.append(json.load(f))
        os.remove(os.path.join(spec["dir"], f"rank{r}.json"))
    return results


def s3_restart(shared: dict, url: str, options: dict) -> float:
    """The 4 ranks save a durable snapshot to shaped S3 (and local steps), every node's local directory is wiped,
    and the restart restores from S3: the slowest rank's autoload."""
    on_s3 = {**shared, "out": url, "options": options, "local": 1, "durable": 2}

    def wipe_nodes() -> None:
        for node in range(WORLD // PER_NODE):
            shutil.rmtree(os.path.join(shared["dir"], f"node{node}"), ignore_errors=True)
    wipe_nodes()  # the save starts afresh
    run_ranks({**on_s3, "case": "save", "iterations": 3})
    wipe_nodes()  # every node lost
    restart = run_ranks({**on_s3, "case": "restart", "iterations": 1})
    assert all(r["resumed_from"] == f"{url}/snapshot_iter_2" for r in restart), restart
    return max(r["autoload_s"] for r in restart)


def one_round(base: str, mib: int, compute: float, s3: tuple[str, dict] | None = None) -> dict[str, float]:
    directory = tempfile.mkdtemp(dir=base)
    try:
        return _cases(directory, mib, compute, s3)
    finally:  # a failed case leaves nothing in /dev/shm
        shutil.rmtree(directory, ignore_errors=True)


def _cases(directory: str, mib: int, compute: float, s3: tuple[str, dict] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    shared = {"dir": directory, "mib": mib}
    step = {"case": "blocking", "iterations": 7, "compute_s": compute}
    local = run_ranks({**shared, **step, "local": 1, "durable": 1000})
    out["local save blocking"] = statistics.median(w for r in local for w in r["save_waits"][1:])
    shutil.rmtree(directory)
    os.makedirs(directory)
    durable = run_ranks({**shared, **step, "durable": 1})
    out["async durable save blocking"] = statistics.median(w for r in durable for w in r["save_waits"][1:])
    shutil.rmtree(directory)
    os.makedirs(directory)
    both = run_ranks({**shared, **step, "local": 1, "durable": 2})
    out["local + durable, same step"] = statistics.median(r["save_waits"][i] for r in both for i in (3, 5))
    out["  of which the local save"] = statistics.median(r["local_saves"][i] for r in both for i in (3, 5))
    shutil.rmtree(directory)
    os.makedirs(directory)
    run_ranks({**shared, "case": "save", "local": 1, "durable": 2, "iterations": 3})
    restart = {**shared, "case": "restart", "local": 1, "durable": 2, "iterations": 1, "step": 3}
    out.update(_restart(restart, "read", ("read floor (tmpfs -> tensors)", BARE_OWN, "restore, own parts",
                                          "  the first iteration's start, whole",
                                          "  own parts / read floor, this round")))
    out.update(_restart({**restart, "verify": "always"}, "read", (
        "read floor, again", BARE_CHECKED, ALWAYS, "  the first iteration's start, whole (always)", ALWAYS_RATIO)))
    shutil.rmtree(os.path.join(directory, "node1"))
    out.update(_restart(restart, "transfer", ("transfer floor (gloo, alone)", BARE, "restore, node lost",
                                              "  the first iteration's start, whole ",
                                              "  node lost / transfer floor, this round")))
    if s3 is not None:
        out["restore from shaped S3, 4 ranks"] = s3_restart(shared, f"{s3[0]}/{os.path.basename(directory)}", s3[1])
    return out


def _restart(restart: dict, floor: str, names: tuple[str, ...]) -> dict[str, float]:
    """A restart from local step 3 with its ``floor`` measured first: the slowest rank's floor, work done bare,
    restore and first iteration's whole start, and the restore over the floor, under ``names``."""
    ranks = run_ranks({**restart, "floor": floor})
    assert all(r["resumed_from"] and "step_3" in r["resumed_from"] for r in ranks), ranks
    floor_s, bare, restore, start = (max(r[k] for r in ranks) for k in ("floor_s", "bare_s", "autoload_s",
                                                                        "initialize_s"))
    return dict(zip(names, (floor_s, bare, restore, start, restore / floor_s)))


def s3_round(mib: int, options: dict) -> dict[str, float]:
    """One rank's part: restored from a durable snapshot on shaped S3, and from a local tier on tmpfs."""
    import torch

    import ppe_snapshot as ps
    state = {f"t{i}": t.data for i, t in enumerate(_state(mib, 0))}
    url = f"s3://bench/part-{os.getpid()}-{time.monotonic_ns()}"
    ps.Snapshot.take(url, {"s": ps.StateDict(state)}, storage_options=options)
    local = tempfile.mkdtemp(dir="/dev/shm")
    ps.Snapshot.take(f"{local}/part", {"s": ps.StateDict(state)})
    targets = {k: torch.empty_like(v) for k, v in state.items()}
    start = time.perf_counter()
    ps.Snapshot(url, storage_options=options).restore({"s": ps.StateDict(targets)})
    s3 = time.perf_counter() - start
    start = time.perf_counter()
    ps.Snapshot(f"{local}/part").restore({"s": ps.StateDict(targets)})
    tmpfs = time.perf_counter() - start
    shutil.rmtree(local)
    return {"restore from shaped S3, 1 rank alone": s3, "restore from tmpfs, 1 rank alone": tmpfs}


def shaped_s3(rate_mb: float, latency_ms: float) -> tuple[subprocess.Popen, dict]:
    """``s3_shaped.py`` started (stop it by closing its stdin) and the storage options through its proxy."""
    server = subprocess.Popen([sys.executable, os.path.join(HERE, "s3_shaped.py"), "--rate-mb", str(rate_mb),
                               "--latency-ms", str(latency_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    urls = json.loads(server.stdout.readline())
    options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": urls["proxy"]}}
    import s3fs
    s3fs.S3FileSystem(**options).mkdir("bench")
    return server, options


def main() -> None:
    global WORLD, PER_NODE
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--s3", action="store_true")
    parser.add_argument("--compute", type=float, default=2.0, help="seconds per training step in the blocking cases")
    parser.add_argument("--rate-mb", type=float, default=40.0)
    parser.add_argument("--latency-ms", type=float, default=15.0)
    parser.add_argument("--ranks", type=int, default=WORLD, choices=(2, 4),
                        help="ranks, as two nodes (2: one rank per core of this project's VM)")
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--spec")
    args = parser.parse_args()
    WORLD, PER_NODE = args.ranks, args.ranks // 2
    if args.rank is not None:
        rank_main(args.rank, args.port, json.loads(args.spec))
        return
    server, options = shaped_s3(args.rate_mb, args.latency_ms) if args.s3 else (None, {})
    try:
        rounds = [one_round(args.dir, args.mib, args.compute, ("s3://bench", options) if args.s3 else None)
                  for _ in range(args.rounds)]
        for r in rounds if args.s3 else ():
            r.update(s3_round(args.mib, options))
    finally:
        if server is not None:
            server.stdin.close()
            server.wait()
    print(f"{WORLD} ranks as 2 nodes of {PER_NODE}, {args.mib} MiB per rank, {args.compute:g} s per training step, "
          f"{args.rounds} rounds (median, min-max), seconds")
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        print(f"  {key:40s} {statistics.median(values):8.3f}  ({min(values):.3f}-{max(values):.3f})")
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"  own parts / read floor: {med['restore, own parts'] / med['read floor (tmpfs -> tensors)']:.2f}x "
          f"the medians, {med['  own parts / read floor, this round']:.2f}x the median round (target <= 1.3x); "
          f"{med['restore, own parts'] / med[BARE_OWN]:.2f}x the restore's work done bare (the read, the two "
          "agreement rounds)")
    print(f"  own parts, verify='always' / read floor: {med[ALWAYS_RATIO]:.2f}x the median round; "
          f"{med[ALWAYS] / med[BARE_CHECKED]:.2f}x its work done bare (the read, every byte hashed, the two "
          "agreement rounds)")
    print(f"  node lost / transfer floor: {med['restore, node lost'] / med['transfer floor (gloo, alone)']:.2f}x "
          f"the medians, {med['  node lost / transfer floor, this round']:.2f}x the median round (target <= 2x); "
          f"{med['restore, node lost'] / med[BARE]:.2f}x all the restore's "
          "work done bare (the transfer, the holders' own reads, every byte received hashed, the two agreement rounds)")
    print(f"  local save / async save blocking: "
          f"{med['local save blocking'] / med['async durable save blocking']:.2f}x (target <= 1.1x)")
    print(f"  local + durable at one step / async save blocking: "
          f"{med['local + durable, same step'] / med['async durable save blocking']:.2f}x (the state copied once)")
    if args.s3:
        print(f"  shaped S3 / own parts, 4 ranks: "
              f"{med['restore from shaped S3, 4 ranks'] / med['restore, own parts']:.1f}x (target >= 5x)")


if __name__ == "__main__":
    main()
