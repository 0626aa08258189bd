"""Stateful objects: anything with ``state_dict()`` / ``load_state_dict()``."""
from __future__ import annotations

import base64
import operator
import random
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from ppe_snapshot.errors import CorruptSnapshotError

T = TypeVar("T")


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
        return dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.update(state_dict)


#: The generators every RNG state holds (``cuda`` too where CUDA was initialized).
_GENERATORS = {"torch", "numpy", "python"}


class RNGState:
    """The global random number generators: torch (CPU and every CUDA device), numpy, Python.

    After a restore they produce what they would have produced right after the take,
    even when other objects of the same app state draw random numbers in their
    ``state_dict()`` / ``load_state_dict()``: a take captures this state before
    any other object's and sets the generators back to it afterwards, and a
    restore loads it after every other object (see :func:`take_states` and
    :func:`restore_order`).
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
        """Set every generator to ``state_dict`` (as :meth:`state_dict` gives it, maybe read from a snapshot), or
        none: a state a generator refuses (damaged or crafted) raises :class:`CorruptSnapshotError` naming it,
        before any generator is set. CUDA states beyond this machine's devices are left out; without CUDA, all."""
        # Each part is tried on a generator of its own first: the global ones are set once all are known good.
        cpu = _checked("torch", lambda: _tried(torch.Generator().set_state, _byte_tensor(state_dict["torch"])))
        numpy = _checked("numpy", lambda: _tried(np.random.RandomState().set_state, _numpy_state(state_dict["numpy"])))
        python = _checked("python", lambda: _tried(random.Random().setstate, _python_state(state_dict["python"])))
        cuda = state_dict.get("cuda") if torch.cuda.is_available() else None
        cuda = [] if cuda is None else _checked("cuda", lambda: [
            _cuda_state(device, state) for device, state in enumerate(list(cuda)[: torch.cuda.device_count()])])
        torch.set_rng_state(cpu)
        np.random.set_state(numpy)
        random.setstate(python)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)

    @staticmethod
    def is_state(value: Any) -> bool:
        """Whether ``value`` is what :meth:`state_dict` gives (torch, numpy and Python generators, maybe CUDA's),
        read back from a snapshot: recognised by its contents, whatever key it was saved under."""
        return (isinstance(value, dict) and _GENERATORS <= set(value) <= _GENERATORS | {"cuda"}
                and isinstance(value["torch"], torch.Tensor) and value["torch"].dtype == torch.uint8
                and isinstance(value["numpy"], (tuple, list)) and len(value["numpy"]) == 5
                and value["numpy"][0] == "MT19937")

    @staticmethod
    def to_json(state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (as :meth:`state_dict` gives it) as JSON values, to send to another rank without pickle."""
        name, keys, pos, has_gauss, gauss = state["numpy"]
        version, internal, python_gauss = state["python"]
        doc = {"torch": _b64(state["torch"].numpy()), "numpy": [name, _b64(np.asarray(keys, dtype="<u4")), pos,
                                                                has_gauss, gauss],
               "python": [version, list(internal), python_gauss]}
        if "cuda" in state:
            doc["cuda"] = [_b64(t.numpy()) for t in state["cuda"]]
        return doc

    @staticmethod
    def from_json(doc: dict[str, Any]) -> dict[str, Any]:
        """The state that :meth:`to_json` turned into ``doc``, with the types :meth:`state_dict` gives."""
        name, keys, pos, has_gauss, gauss = doc["numpy"]
        version, internal, python_gauss = doc["python"]
        state = {"torch": torch.frombuffer(bytearray(base64.b64decode(doc["torch"])), dtype=torch.uint8),
                 "numpy": (name, np.frombuffer(base64.b64decode(keys), dtype="<u4").astype(np.uint32), pos,
                           has_gauss, gauss),
                 "python": (version, tuple(internal), python_gauss)}
        if "cuda" in doc:
            state["cuda"] = [torch.frombuffer(bytearray(base64.b64decode(t)), dtype=torch.uint8) for t in doc["cuda"]]
        return state


def _checked(name: str, part: Callable[[], T]) -> T:
    """What ``part`` gives (generator ``name``'s saved state, tried on a generator of its own), or what the
    generator refuses as a :class:`CorruptSnapshotError` naming it."""
    try:
        return part()
    except KeyError:
        raise CorruptSnapshotError(f"RNG state: the {name} generator's state is missing") from None
    except (LookupError, TypeError, ValueError, RuntimeError, OverflowError) as e:  # (numpy: IndexError too)
        raise CorruptSnapshotError(f"RNG state: the {name} generator refuses the saved state ({e})") from None


def _tried(setter: Callable[[T], Any], state: T) -> T:
    setter(state)
    return state


def _byte_tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a {type(value).__name__}, not a tensor")
    if value.dtype != torch.uint8 or value.device.type != "cpu":
        raise TypeError(f"a tensor of {value.dtype} on {value.device}, not of uint8 on the CPU")
    return value


#: The words of numpy's MT19937 state; its position runs from 0 to this (there, the next draw refills them).
_MT19937_WORDS = 624


def _numpy_state(value: Any) -> tuple[Any, ...]:
    """numpy's legacy state, its position checked: ``RandomState.set_state`` takes any position that fits a C
    int, and the next draw reads the generator's words there (2^31 - 1: a segmentation fault)."""
    name, keys, pos, has_gauss, gauss = value
    if not 0 <= operator.index(pos) <= _MT19937_WORDS:
        raise ValueError(f"its position {pos} is outside 0..{_MT19937_WORDS}")
    return name, keys, pos, has_gauss, gauss


def _python_state(value: Any) -> tuple[Any, ...]:
    version, internal, gauss = value
    return version, tuple(internal), gauss


def _cuda_state(device: int, state: Any) -> torch.Tensor:
    expected = torch.cuda.get_rng_state(device).numel()
    if _byte_tensor(state).numel() != expected:
        raise ValueError(f"cuda:{device}'s is {state.numel()} bytes where it holds {expected}")
    return state


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()


def state_of(key: str, obj: Any) -> dict[str, Any]:
    """``obj.state_dict()``, or a clear error when ``obj`` is not stateful."""
    if not isinstance(obj, Stateful):
        raise TypeError(
            f"app_state[{key!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
            "wrap tensors and plain values in ppe_snapshot.StateDict")
    return obj.state_dict()


def take_states(app_state: dict[str, Any]) -> dict[str, Any]:
    """Every object's state, keyed as ``app_state``; RNG states are captured first.

    The generators are set back to the captured state once every other
    ``state_dict()`` has run, so draws made there neither leak into the
    snapshot nor make the process diverge from it.
    """
    rng_keys = [key for key, obj in app_state.items() if isinstance(obj, RNGState)]
    states = {key: state_of(key, app_state[key]) for key in rng_keys}
    try:
        for key, obj in app_state.items():
            if key not in states:
                states[key] = state_of(key, obj)
    finally:
        for key in rng_keys:
            app_state[key].load_state_dict(states[key])
    return {key: states[key] for key in app_state}


def check_app_state(app_state: Any) -> None:
    """Raise ``TypeError`` unless ``app_state`` is a dict of stateful objects (before any storage is touched)."""
    if not isinstance(app_state, dict):
        raise TypeError(f"app_state must be a dict of stateful objects, got {type(app_state).__name__}")
    for key, obj in app_state.items():
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"app_state[{key!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
                "wrap tensors and plain values in ppe_snapshot.StateDict")


def restore_order(app_state: dict[str, Any]) -> dict[str, Any]:
    """``app_state`` with its RNG states last, so no other object's ``load_state_dict()`` moves the generators."""
    rng = {key: obj for key, obj in app_state.items() if isinstance(obj, RNGState)}
    return {**{key: obj for key, obj in app_state.items() if key not in rng}, **rng}


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
