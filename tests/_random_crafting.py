"""Randomly crafted snapshots, for test_untrusted_random.py (run as a child process under a memory limit).

    python _random_crafting.py KIND SEED COUNT [READERS]

takes one small snapshot of KIND (``v2``: the default format, ``v1``: one JSON manifest, ``sharded``: a sharded
tensor in version 2's index files, ``incremental``: version 3, most bytes read from a base, ``dcp``: a model's and
its optimizer's state written by ``dcp.save`` through ``SnapshotStorageWriter``, read by ``dcp.load``), then COUNT times
copies it, damages the copy at random the way a buggy or hostile writer would (``_random_damage.py``) and reads
it back every way a user does. It
prints one JSON object: ``findings``, every read that raised something other than a ``SnapshotError`` (with the
damage and the traceback's last lines), and ``outcomes``, how many reads ended each way. READERS ``cli`` reads
it with the ``ppe-snapshot`` commands instead (their one-line failure raised here, to be seen by its type), and
finds too a failed ``convert`` that leaves its destination behind.
"""
from __future__ import annotations

import collections
import json
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

KIND, SEED, COUNT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
READERS = sys.argv[4] if len(sys.argv) > 4 else "api"
if KIND in ("v1", "sharded"):  # (read when ppe_snapshot is imported; the sharded one is upgraded to version 2)
    os.environ["PPE_SNAPSHOT_FORMAT_VERSION"] = "1"
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # an allocation sized by a crafted field fails here

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from _cli_raising import run_command  # noqa: E402
from _crafted import craft, make_sharded, take_small  # noqa: E402
from _random_damage import damage_snapshot  # noqa: E402
from ppe_snapshot import RNGState, Snapshot, SnapshotError, StateDict  # noqa: E402
from ppe_snapshot.dcp import SnapshotStorageReader, SnapshotStorageWriter  # noqa: E402
from ppe_snapshot.engine import upgrade_snapshot  # noqa: E402
from ppe_snapshot.storage import open_storage  # noqa: E402

rng = random.Random(SEED)

def full_state() -> dict[str, Any]:
    """A bit of every kind of value; the restore target of ``v2`` and ``incremental``."""
    return {"m": StateDict(w=torch.arange(12, dtype=torch.float32).reshape(3, 4), b=torch.arange(4.0).double(),
                           big=torch.arange(70_000, dtype=torch.int32), h=torch.ones(5, dtype=torch.bfloat16),
                           empty=torch.zeros(0), scalar=torch.tensor(3.5), c=torch.ones(3, dtype=torch.complex64),
                           flag=torch.tensor([True, False]), n=np.arange(6, dtype=np.int32),
                           nested={"a": [torch.ones(2), 3, "x"], "b": (1.5, None), 7: torch.zeros(2, 2)},
                           step=3, name="run", lst=[1, 2, [3, 4]]),
            "rng": RNGState()}


def small_target() -> dict[str, Any]:
    """The restore target of ``v1`` and ``sharded`` (``_crafted.take_small``, ``m/grid`` sharded)."""
    target = StateDict(w=torch.zeros(3, 4), b=torch.zeros(4, dtype=torch.float64), n=None, step=0)
    if KIND == "sharded":
        target["grid"] = torch.zeros(4, 4)
    else:
        target.update(top=torch.zeros(2, 4), bottom=torch.zeros(2, 4))
    return {"m": target}


def dcp_state() -> dict[str, Any]:
    """The state of ``dcp``, and its load target: a model's, an optimizer's after one step, and plain values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(),
            "extra": {"step": 5, "name": "run", "t": torch.arange(6.0)}}


def build(root: Path) -> tuple[Path, Callable[[], dict[str, Any]]]:
    """The snapshot every case copies, and a fresh restore target for it."""
    base = root / "base"
    if KIND == "v1":
        return take_small(base), small_target
    if KIND == "sharded":
        craft(take_small(root / "v1"), make_sharded)
        upgrade_snapshot(open_storage(str(root / "v1")), open_storage(str(base)))
        return base, small_target
    if KIND == "incremental":
        state = full_state()
        Snapshot.take(str(root / "first"), state)
        state["m"]["w"] += 1  # one block changed: the rest is read from "first"
        Snapshot.take(str(base), state, base=str(root / "first"))
        return base, full_state
    if KIND == "dcp":
        dcp.save(dcp_state(), storage_writer=SnapshotStorageWriter(str(base)))
        return base, dcp_state
    Snapshot.take(str(base), full_state())
    return base, full_state


def damage(path: Path) -> str:
    """Damage the snapshot at ``path`` once; what was damaged."""
    return damage_snapshot(rng, path, manifest_only=KIND == "v1")


def reads(path: Path, target: Callable[[], dict[str, Any]]) -> dict[str, Callable[[], Any]]:
    """Every way a user reads a snapshot."""
    def every_entry() -> None:
        snapshot = Snapshot(str(path))
        for key in snapshot.get_manifest():
            try:
                snapshot.read_object(key)
            except SnapshotError:
                pass
    if KIND == "dcp":
        return {"read_metadata": lambda: SnapshotStorageReader(str(path)).read_metadata(),
                "dcp.load": lambda: dcp_load(path, target()), "verify": lambda: Snapshot(str(path)).verify(),
                "every entry": every_entry}
    return {"get_manifest": lambda: Snapshot(str(path)).get_manifest(),
            "read_object": lambda: Snapshot(str(path)).read_object("0/m"),
            "restore": lambda: Snapshot(str(path)).restore(target()),
            "verify": lambda: Snapshot(str(path)).verify(),
            "every entry": every_entry}


class RefusedByDcp(Exception):
    """``dcp.load`` failed in DCP's own code, for a reason a damaged snapshot gives (``outcome``: which)."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def dcp_load(path: Path, target: dict[str, Any]) -> None:
    """``dcp.load``: what failed in the reader raised as it is; DCP's own refusals as :class:`RefusedByDcp`."""
    try:
        dcp.load(target, storage_reader=SnapshotStorageReader(str(path)))
    except CheckpointException as e:  # (a BaseException)
        ((error, _trace),) = e.failures.values()
        # (its message carries ours; before torch 2.12 DCP drops it and asserts it has metadata)
        dropped = torch.__version__ < "2.12"
        if type(error) is AssertionError and ("global metadata read failed: " in str(error) or dropped):
            raise RefusedByDcp("DCP: the reader's metadata error") from None
        if type(error) is RuntimeError and str(error).startswith("Missing key in checkpoint state_dict"):
            raise RefusedByDcp("DCP: a key missing") from None  # (a crafted index without one of the entries)
        raise error from None


def cli_reads(path: Path) -> dict[str, Callable[[], Any]]:
    """Every command that reads a snapshot."""
    def convert(to: str) -> None:
        out = path.parent / f"out-{to}"
        try:
            run_command("convert", str(path), str(out), "--to", to)
        except BaseException:
            if out.exists():
                raise RuntimeError(f"the failed convert --to {to} left {out.name} behind") from None
            raise
        finally:
            shutil.rmtree(out) if out.is_dir() else out.unlink(missing_ok=True)
    return {"inspect": lambda: run_command("inspect", str(path)), "verify": lambda: run_command("verify", str(path)),
            "diff": lambda: run_command("diff", str(path.parent / "base"), str(path)),
            "ls": lambda: run_command("ls", str(path.parent)),
            **{f"convert {to}": lambda to=to: convert(to) for to in ("torch", "dcp", "safetensors")}}


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError("a read took more than 30 s")


def outcome(name: str, read: Callable[[], Any]) -> str:
    """How ``read`` ended: "read", or the name of the SnapshotError it raised; anything else propagates."""
    signal.alarm(30)
    try:
        read()
        return "read"
    except SnapshotError as e:
        return type(e).__name__
    except RefusedByDcp as e:
        return e.outcome
    except KeyError as e:  # read_object's answer for a key the manifest does not list (its root entry damaged)
        if name != "read_object" or "is not in snapshot" not in str(e):
            raise
        return "KeyError"
    finally:
        signal.alarm(0)


def main() -> None:
    signal.signal(signal.SIGALRM, _alarm)
    root = Path(tempfile.mkdtemp())
    base, target = build(root)
    findings, outcomes = [], collections.Counter()
    for case in range(COUNT):
        path = root / f"case{case}"  # (beside the base an incremental snapshot reads)
        shutil.copytree(base, path)
        what = damage(path)
        for name, read in (cli_reads(path) if READERS == "cli" else reads(path, target)).items():
            try:
                outcomes[outcome(name, read)] += 1
            except BaseException as e:  # noqa: BLE001 - what the test is for
                findings.append({"case": case, "damage": what, "read": name, "error": f"{type(e).__name__}: {e}"[:300],
                                 "where": traceback.format_exception(e)[-3:]})
        shutil.rmtree(path)
    shutil.rmtree(root)
    print(json.dumps({"findings": findings, "outcomes": outcomes}))


if __name__ == "__main__":
    main()
