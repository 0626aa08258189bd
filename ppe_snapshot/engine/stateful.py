"""Stateful objects: anything with ``state_dict()`` / ``load_state_dict()``."""
from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Stateful(Protocol):
    """What app state values must provide (modules, optimizers, schedulers, ...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class StateDict(dict):
    """A dict that is its own state: puts tensors and plain values into an app state.

    Restoring loads tensors in place and replaces the other values.
    """

    def state_dict(self) -> dict[str, Any]:
        return self

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.update(state_dict)


class RNGState:
    """The global random number generators: torch (CPU and every CUDA device), numpy, Python.

    After a restore they produce what they would have produced right after the take.
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        np.random.set_state(tuple(state_dict["numpy"]))
        version, internal, gauss = state_dict["python"]
        random.setstate((version, tuple(internal), gauss))
        cuda = state_dict.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(cuda)[: torch.cuda.device_count()])


def state_of(key: str, obj: Any) -> dict[str, Any]:
    """``obj.state_dict()``, or a clear error when ``obj`` is not stateful."""
    if not isinstance(obj, Stateful):
        raise TypeError(
            f"app_state[{key!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
            "wrap tensors and plain values in ppe_snapshot.StateDict")
    return obj.state_dict()


class OptimizerState:
    """An optimizer's state keyed by parameter name and sharded like the parameters.

    Goes through ``torch.distributed.checkpoint.state_dict``, which creates the
    optimizer's state before the first step, so a snapshot restores in place into
    a freshly built FSDP2 / DTensor optimizer, on any world size. Use it instead of
    the optimizer itself in an app state or a manager's ``state_objects``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
