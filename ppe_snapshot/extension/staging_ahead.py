"""The staging memory of a background writer, made ready before the first save.

A background writer's first save used to allocate its staging buffer and fault every page in while the loop
waited: on this project's VM a 1 GiB state's first save blocked 1.26 s against 0.28 s for the next ones. The
writer is asked to make the buffer ready in a background thread (``SnapshotWriter.prepare_staging``), and so is
the local tier for its own (``LocalSaves.prepare_staging``), once the extension knows the state: at
``initialize()``, and again after the first optimizer step, which is when an optimizer such as Adam creates its
state.

After autoload restored a snapshot, the buffers are made ready only when the first optimizer step begins (the
optimizers' restored state included): at a restart every rank waits for the slowest to restore, and faulting the
buffers in beside it, even at the lowest CPU priority, made the 4-rank restart from the local tier slower on this
project's VM (0.150 s against 0.133 s, medians of 6 alternated restarts). A save at the first iteration after a
restart then faults in the rest of its buffer itself (``engine.ReadyAhead``), as every first save faulted in all of
it before.

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
                          state: Callable[[], Any], restored: bool = False) -> Callable[[], None]:
    """Have each of ``prepares`` (a writer's ``prepare_staging``, the local tier's) make a save of ``state()`` (the
    state, or a stand-in of its size) ready now, unless the state was just ``restored`` (then when the first
    optimizer step begins, training having resumed), and again after the manager's first optimizer step; returns
    what removes the step hooks (torch does not let a hook remove itself while the optimizer runs its hooks: they
    do nothing after their first call until then)."""
    def prepare() -> None:
        staged = state()
        for each in prepares:
            each(staged)
    # An optimizer that is no torch.optim.Optimizer (a wrapper of ppe's protocol: state_dict() alone) has no hooks.
    optimizers = [o for o in getattr(manager, "optimizers", {}).values() if isinstance(o, torch.optim.Optimizer)]
    deferred = restored and bool(optimizers)
    if not deferred:
        prepare()
    fired: set[str] = set()

    def once(when: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if when not in fired:
                fired.add(when)
                prepare()
        return hook

    hooks = [optimizer.register_step_post_hook(once("after")) for optimizer in optimizers]
    if deferred:  # training has resumed at the first step: the buffers are made ready while it runs
        hooks += [optimizer.register_step_pre_hook(once("before")) for optimizer in optimizers]

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
            "optimizers": {name: [_local(t) for state in _states(optimizer) for t in state.values()
                                  if isinstance(t, torch.Tensor)] for name, optimizer in optimizers.items()}}


def _states(optimizer: Any) -> list[dict[Any, Any]]:
    """The per-parameter states of ``optimizer`` (none where it keeps no ``state`` dict of dicts)."""
    state = getattr(optimizer, "state", None)
    return [s for s in state.values() if isinstance(s, dict)] if isinstance(state, dict) else []


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: numel() is the whole tensor's
    return to_local() if callable(to_local) else tensor
