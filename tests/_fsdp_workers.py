"""Workers for the SHARDED-mode extension with FSDP2: train on N ranks, resume on M."""
from __future__ import annotations

from typing import Any

import pytorch_pfn_extras as ppe
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ppe_snapshot

FULL = StateDictOptions(full_state_dict=True)


def _gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as full tensors (collective; the same on every rank), copied:
    DCP hands back the live ``step`` tensors, which later steps would change."""
    state = {"model": get_model_state_dict(model, options=FULL),
             "optimizer": get_optimizer_state_dict(model, optimizer, options=FULL)}
    return torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state)


def fsdp_train(out_dir: str, stop_at: int) -> dict[str, Any]:
    """FSDP2 training under the extension in SHARDED mode (autoload on), up to ``stop_at`` iterations."""
    rank = dist.get_rank()
    torch.manual_seed(dist.get_world_size())  # another initialization per world size: state must come from the snapshot
    model = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.ReLU(), torch.nn.Linear(30, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = ppe.training.ExtensionsManager(
        model, {}, 1, iters_per_epoch=100, out_dir=out_dir, stop_trigger=(stop_at, "iteration"),
        state_objects={"optimizer": ppe_snapshot.OptimizerState(model, optimizer)})
    extension = ppe_snapshot.snapshot(snapshot_mode=ppe_snapshot.SnapshotMode.SHARDED, autoload=True)
    manager.extend(extension, trigger=(5, "iteration"))
    manager.start_extensions()
    result = {"started_at": manager.iteration, "resumed_from": extension.resumed_from,
              "at_start": _gathered(model, optimizer)}
    while not manager.stop_trigger:
        with manager.run_iteration():
            g = torch.Generator().manual_seed(100 * rank + manager.iteration)
            x = torch.randn(16, 8, generator=g)
            F.cross_entropy(model(x), (x.sum(1) > 0).long()).backward()
            optimizer.step()
            optimizer.zero_grad()
    result.update(stopped_at=manager.iteration, at_end=_gathered(model, optimizer))
    return result
