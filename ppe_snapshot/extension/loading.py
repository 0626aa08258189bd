"""``load_snapshot``: a snapshot of the extension, read outside the trainer (an inference script, a notebook).

It reads what the command line reads, the same way and with the same errors (``ppe_snapshot.cli.common``): an
engine snapshot (a directory) through the engine, ppe's single file with ``torch.load(..., weights_only=True)``,
a DCP directory (torch's own, or the DCP adapter's), a safetensors file. A model or optimizer given is checked
against what was saved first, so that a changed model is reported as such (missing and unexpected keys, shapes),
never as a damaged snapshot.
"""
from __future__ import annotations

from typing import Any

import torch

from ppe_snapshot.errors import StateMismatchError


def load_snapshot(path: str, model: Any = None, optimizer: Any = None, *,
                  storage_options: dict[str, Any] | None = None, allow_pickle: bool = False) -> Any:
    """The state a snapshot of the extension saved (a manager's state dict, or ``snapshot_object``'s target's),
    tensors on the CPU; with ``model`` / ``optimizer`` also loaded into them.

    ``path`` is the snapshot (``out/snapshot_iter_100``, a directory, or ppe's single file; a local path or an
    fsspec URL), or what ``ppe-snapshot convert`` wrote of one: a DCP directory, a safetensors file (of
    a model's state dict: ``convert --to safetensors --model NAME``). Raises :class:`~ppe_snapshot.SnapshotNotFoundError` when
    nothing readable is there (nothing at all, a directory without a snapshot, a save in progress),
    :class:`~ppe_snapshot.UnsupportedFormatError` for a file of another kind, and
    :class:`~ppe_snapshot.UnsupportedValueError` when reading it needs pickle and ``allow_pickle`` is not set.

    ``model`` and ``optimizer`` take the manager's only model / optimizer, or the one named ``main`` (a dict
    ``{name: module}`` takes each by name); a snapshot of ``snapshot_object(model, ...)`` holds the model's
    state itself. Raises :class:`~ppe_snapshot.StateMismatchError` naming the missing and unexpected keys
    and the shapes and dtypes that differ when the model does not fit, before anything is loaded into it (the
    rule of ``restore`` and autoload: a tensor is never cast to another dtype on the way in).
    """
    state = _read(str(path), storage_options, allow_pickle)
    if model is not None:
        _load(model, _part(state, "models"), "model")
    if optimizer is not None:
        _load(optimizer, _part(state, "optimizers"), "optimizer")
    return state


def _read(path: str, storage_options: dict[str, Any] | None, allow_pickle: bool) -> Any:
    from ppe_snapshot.cli.common import open_source, read_state  # the command line's readers, loaded when used

    return read_state(open_source(path, storage_options), allow_pickle)[0]


def _part(state: Any, section: str) -> Any:
    """The saved states of the manager's ``section`` (``models``, ``optimizers``); the whole state when the
    snapshot holds one object's state (``snapshot_object``)."""
    if not isinstance(state, dict) or section not in state:
        return state
    return state[section]


def _load(target: Any, saved: Any, what: str) -> None:
    if isinstance(target, dict):
        for name, one in target.items():
            if not isinstance(saved, dict) or name not in saved:
                raise StateMismatchError(f"the snapshot holds no {what} named {name!r}; it holds "
                                         f"{sorted(saved) if isinstance(saved, dict) else 'one state'}")
            _load_one(one, saved[name], f"{what} {name!r}")
        return
    if isinstance(saved, dict) and _named(saved):
        if len(saved) != 1 and "main" not in saved:
            raise StateMismatchError(f"the snapshot holds several {what}s ({sorted(saved)}): pass a dict "
                                     f"{{name: {what}}} to choose")
        saved = saved["main"] if "main" in saved else next(iter(saved.values()))
    _load_one(target, saved, what)


def _named(saved: dict[str, Any]) -> bool:
    """Whether ``saved`` maps names to states (the manager's ``models`` / ``optimizers``), not one state dict."""
    return bool(saved) and all(isinstance(v, dict) for v in saved.values())


def _load_one(target: Any, saved: Any, what: str) -> None:
    if isinstance(target, torch.nn.Module):
        _check_module(target, saved, what)
    try:
        target.load_state_dict(saved)
    except (RuntimeError, ValueError, KeyError) as e:  # an optimizer of other parameter groups, ...
        raise StateMismatchError(f"the {what} does not fit the snapshot: {e}") from e


def _check_module(module: torch.nn.Module, saved: Any, what: str) -> None:
    own = module.state_dict()
    if not isinstance(saved, dict):
        raise StateMismatchError(f"the snapshot holds a {type(saved).__name__} where the {what}'s state dict was "
                                 "expected")
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    both = [k for k in sorted(set(own) & set(saved)) if isinstance(saved[k], torch.Tensor)]
    shapes = [f"{k}: saved {list(saved[k].shape)}, {what} {list(own[k].shape)}" for k in both
              if saved[k].shape != own[k].shape]
    dtypes = [f"{k}: saved {_name(saved[k].dtype)}, {what} {_name(own[k].dtype)}" for k in both
              if saved[k].dtype != own[k].dtype]
    parts = ([f"missing keys {missing}"] if missing else []) + (
        [f"unexpected keys {unexpected}"] if unexpected else []) + (
        [f"other shapes ({'; '.join(shapes)})"] if shapes else []) + (
        [f"other dtypes ({'; '.join(dtypes)}; load into the saved dtype, then convert the {what})"] if dtypes else [])
    if parts:
        raise StateMismatchError(f"the {what} does not fit the snapshot (was it changed since the snapshot was "
                                 f"saved?): {', '.join(parts)}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
