"""The staging memory of a background writer, made ready before the first save.

A background writer's first save used to allocate its staging buffer and fault every page in while the loop
waited: on this project's VM a 1 GiB state's first save blocked 1.26 s against 0.28 s for the next ones. The
writer is asked to make the buffer ready in a background thread (``SnapshotWriter.prepare_staging``), and so is
the local tier for its own (``LocalSaves.prepare_staging``), once the extension knows the state: at ``initialize()`` (the models, and the optimizers' state where autoload restored
it), and again after the first optimizer step, which is when an optimizer such as Adam creates its state.

In DEFAULT mode the state is the one a save takes (``state_dict()``). In the other modes ``state_dict()`` may be a
collective (sharded models), which must not run outside a save: the size comes from the tensors a rank's save of
the manager holds, found without it (:func:`local_tensors`), on each rank that writes.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from pytorch_pfn_extras.training import ExtensionsManagerProtocol



def prepare_staging_ahead(prepares: list[Callable[[Any], None]], manager: ExtensionsManagerProtocol,
                          state: Callable[[], Any]) -> Callable[[], None]:
    """Have each of ``prepares`` (a writer's ``prepare_staging``, the local tier's) make a save of ``state()`` (the
    state, or a stand-in of its size) ready now, and again after the manager's first optimizer step; returns what
    removes the step hooks (torch does not let a hook remove itself while the optimizer runs its hooks: it does
    nothing after the first step until then)."""
    def prepare() -> None:
        staged = state()
        for each in prepares:
            each(staged)
    prepare()
    fired = False

    def after_first_step(*_: Any) -> None:
        nonlocal fired
        if not fired:
            fired = True
            prepare()

    hooks = [optimizer.register_step_post_hook(after_first_step)
             for optimizer in getattr(manager, "optimizers", {}).values()]

    def remove() -> None:
        while hooks:
            hooks.pop().remove()

    return remove


def local_tensors(manager: ExtensionsManagerProtocol) -> dict[str, Any]:
    """A stand-in of the size of this rank's save of ``manager``, found without ``state_dict()``: each model's
    parameters and buffers (of a DTensor, this rank's shard) and each optimizer's state tensors."""
    models = getattr(manager, "models", {})
    optimizers = getattr(manager, "optimizers", {})
    return {"models": {name: [_local(t) for t in itertools.chain(model.parameters(), model.buffers())]
                       for name, model in models.items()},
            "optimizers": {name: [_local(t) for state in optimizer.state.values() for t in state.values()
                                  if isinstance(t, torch.Tensor)] for name, optimizer in optimizers.items()}}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: numel() is the whole tensor's
    return to_local() if callable(to_local) else tensor
