"""Rank functions for tests/test_sharded.py (run by the ``dist_run`` pool on real gloo groups).

Each returns plain CPU tensors and strings, so the test process can compare
what was saved (gathered with ``full_tensor()`` at take time) with what was
restored on another world size.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardMetadata, init_from_local_shards
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.engine import LOCAL
from ppe_snapshot.engine._files import packing
from ppe_snapshot.dcp import SnapshotStorageWriter

#: Global shapes and dtypes of the DTensor snapshot's tensors.
SHAPES = {"s0": (10, 3), "s1": (3, 7), "rep": (4, 5), "empty": (3, 2), "scalar": (), "ints": (6,),
          "chunky": (10, 7), "mesh2": (10, 4), "mesh2b": (6, 5), "st": (10, 4)}
#: Placements on a 1-D mesh of 4 ranks (keys not here live on a 2x2 mesh or are ShardedTensors).
PLACEMENTS_1D = {"s0": [Shard(0)], "s1": [Shard(1)], "rep": [Replicate()], "empty": [Shard(0)],
                 "scalar": [Replicate()], "ints": [Shard(0)], "chunky": [Shard(0)]}
PLACEMENTS_2D = {"mesh2": [Shard(0), Replicate()], "mesh2b": [Replicate(), Shard(1)]}


def reference(name: str) -> torch.Tensor:
    """The full value of a DTensor-snapshot tensor (same on every process)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if name == "ints":
        return torch.randint(-1000, 1000, SHAPES[name], generator=g)
    return torch.randn(SHAPES[name], generator=g)


def _sharded_tensor(full: torch.Tensor, rank: int, world: int) -> ShardedTensor:
    """Rows of ``full`` split as torch.chunk does, one shard per rank (every rank must get rows)."""
    rows = -(-full.shape[0] // world)
    local = full[rank * rows:(rank + 1) * rows].clone()
    metadata = ShardMetadata([rank * rows, 0], list(local.shape), f"rank:{rank}/cpu")
    return init_from_local_shards([LocalShard(local, metadata)], *full.shape)


def _gathered(state: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of a (nested) state dict as a full CPU tensor."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _gathered(value)
        elif isinstance(value, DTensor):
            out[key] = value.full_tensor()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


# -- FSDP2 ---------------------------------------------------------------------

def _fsdp(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """7 and 3 output rows: uneven over 2, 3 and 4 ranks, an empty shard on rank 3 of 4."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    for _ in range(steps):
        model(torch.randn(4, 5, generator=g)).square().sum().backward()
        optim.step()
        optim.zero_grad()


class ModelAndOptim:
    """The DCP-style app state: FQN-keyed state through get_state_dict / set_state_dict."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state (index-keyed) as full tensors: what one process would hold."""
    return {"model": _gathered(model.state_dict()), "optim": _gathered(optim.state_dict())}


def _take_fsdp(root: str, tag: str, world: int) -> dict[str, Any]:
    """Train 2 steps, take the direct and the get_state_dict snapshots; return the gathered state."""
    model, optim = _fsdp(world)
    _train(model, optim, 2, seed=world)
    Snapshot.take(f"{root}/fsdp{tag}", {"model": model, "optim": optim})
    Snapshot.take(f"{root}/fsdp{tag}w", {"app": ModelAndOptim(model, optim)})
    return full_state(model, optim)


def _restore_fsdp(root: str, tag: str, world: int) -> dict[str, Any]:
    """Restore both FSDP snapshots into fresh FSDP2 models on this world; return what they hold."""
    model, optim = _fsdp(world)
    _train(model, optim, 1, seed=99)  # the optimizer needs state to load DTensors into
    Snapshot(f"{root}/fsdp{tag}").restore({"model": model, "optim": optim})
    direct = full_state(model, optim)
    model, optim = _fsdp(world)  # get_state_dict initializes the optimizer's state itself
    Snapshot(f"{root}/fsdp{tag}w").restore({"app": ModelAndOptim(model, optim)})
    return {"direct": direct, "wrapped": full_state(model, optim)}


def save_on_two(root: str) -> dict[str, Any]:
    """Two ranks: FSDP snapshots, a per-rank snapshot for the missing-rank error, and a DTensor
    saved through ``dcp.save`` (its shards become a sharded entry the engine reads)."""
    rank = dist.get_rank()
    Snapshot.take(f"{root}/perrank2", {"local": StateDict(t=torch.full((2,), rank))})
    mesh = init_device_mesh("cpu", (2,))
    saved_chunk_bytes = packing.CHUNK_BYTES
    packing.CHUNK_BYTES = 64  # 3 chunks per shard: row reads on 4 ranks skip the chunks they do not need
    try:
        dcp.save({"w": distribute_tensor(reference("chunky"), mesh, [Shard(1)])},
                 storage_writer=SnapshotStorageWriter(f"{root}/dcp2"))
    finally:
        packing.CHUNK_BYTES = saved_chunk_bytes
    return _take_fsdp(root, "2", 2)


# -- DTensor / ShardedTensor -----------------------------------------------------

def _dtensor_state(world: int) -> StateDict:
    mesh = init_device_mesh("cpu", (world,))
    state = StateDict({k: distribute_tensor(reference(k), mesh, p) for k, p in PLACEMENTS_1D.items()})
    mesh2 = init_device_mesh("cpu", (2, 2))
    state.update({k: distribute_tensor(reference(k), mesh2, p) for k, p in PLACEMENTS_2D.items()})
    state["st"] = _sharded_tensor(reference("st"), dist.get_rank(), world)
    return state


def _restore_dtensors(path: str, world: int, placement: Any) -> dict[str, torch.Tensor]:
    """Restore the DTensor snapshot into zeroed DTensors of ``placement`` on a 1-D mesh of ``world``
    (Shard(0) where the tensor lacks the dimension, Replicate for the scalar and for "empty")."""
    mesh = init_device_mesh("cpu", (world,))
    targets = StateDict()
    for key in SHAPES:
        zeros = torch.zeros_like(reference(key))
        if key == "empty" or zeros.dim() == 0:
            placements = [Replicate()]
        else:
            placements = [placement if placement.dim < zeros.dim() else Shard(0)]
        targets[key] = distribute_tensor(zeros, mesh, placements)
    Snapshot(path).restore({"dt": targets})
    return {k: v.full_tensor() for k, v in targets.items()}


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # the test asserts the type name and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def four_ranks(root: str) -> dict[str, Any]:
    """Everything that needs 4 ranks, in one call (4-rank calls are the expensive part)."""
    rank, out = dist.get_rank(), {}
    saved_chunk_bytes = packing.CHUNK_BYTES
    packing.CHUNK_BYTES = 64  # several checksummed chunks per shard, so restores read parts of shards
    try:
        state = _dtensor_state(4)
        Snapshot.async_take(f"{root}/dt4", {"dt": state}).wait()
    finally:
        packing.CHUNK_BYTES = saved_chunk_bytes
    out["dt4_saved"] = {k: v.full_tensor() if isinstance(v, DTensor) else reference(k) for k, v in state.items()}

    # same world size, other placements: Shard(1) everywhere (Replicate for the scalar)
    out["dt4_on4"] = _restore_dtensors(f"{root}/dt4", 4, Shard(1))
    # a tensor saved from a 2x2 mesh read into a ShardedTensor of rows over 4 ranks
    target = _sharded_tensor(torch.zeros(SHAPES["mesh2"]), rank, 4)
    Snapshot(f"{root}/dt4").read_object("dt/mesh2", obj_out=target)
    out["st_from_mesh2"] = [(s.metadata.shard_offsets, s.tensor.clone()) for s in target.local_shards()]

    target = distribute_tensor(torch.zeros(SHAPES["chunky"]), init_device_mesh("cpu", (4,)), [Shard(0)])
    out["dcp2_on4"] = Snapshot(f"{root}/dcp2").read_object("w", obj_out=target).full_tensor()

    out["fsdp4_saved"] = _take_fsdp(root, "4", 4)
    out["fsdp2_on4"] = _restore_fsdp(root, "2", 4)

    mesh = init_device_mesh("cpu", (4,))
    out["errors"] = {
        "per_rank": _error(lambda: Snapshot(f"{root}/perrank2").restore(
            {"local": StateDict(t=torch.zeros(2, dtype=torch.int64))})),
        "shape": _error(lambda: Snapshot(f"{root}/dt4").read_object(
            "dt/s0", obj_out=distribute_tensor(torch.zeros(10, 4), mesh, [Shard(0)]))),
        "dtype": _error(lambda: Snapshot(f"{root}/dt4").read_object(
            "dt/s0", obj_out=distribute_tensor(torch.zeros(10, 3, dtype=torch.float64), mesh, [Shard(0)]))),
        "partial": _error(lambda: Snapshot.take(
            f"{root}/partial", {"p": StateDict(w=DTensor.from_local(torch.ones(2), mesh, [Partial()]))})),
        "local": _error(lambda: Snapshot.take(
            f"{root}/local{rank}", {"p": StateDict(w=distribute_tensor(torch.ones(8), mesh, [Shard(0)]))}, pg=LOCAL)),
    }
    return out


def restore_elsewhere(root: str) -> dict[str, Any]:
    """On 2 or 3 ranks: the 4-rank snapshots restored into this world's DTensors and FSDP2 models,
    and the snapshot of a plain one-process model (read as rank 0's, ``pg=LOCAL``) into FSDP2."""
    world = dist.get_world_size()
    model, optim = _fsdp(world)
    _train(model, optim, 1, seed=98)
    Snapshot(f"{root}/plain1", pg=LOCAL).restore({"model": model, "optim": optim})
    return {"dt": _restore_dtensors(f"{root}/dt4", world, Shard(0)), "fsdp": _restore_fsdp(root, "4", world),
            "plain1": full_state(model, optim)}


def take_rows_on_two(path: str, storage_options: dict[str, Any]) -> None:
    """Two ranks: ``reference("chunky")`` as a DTensor of rows split over the ranks, taken to ``path``."""
    mesh = init_device_mesh("cpu", (2,))
    state = StateDict(w=distribute_tensor(reference("chunky"), mesh, [Shard(0)]))
    Snapshot.take(path, {"dt": state}, storage_options=storage_options)
