"""``convert``: between engine snapshots, ppe torch.save files, torch DCP directories and safetensors files.

What a target cannot hold (RNG states beyond a torch.save file's manager state, non-tensor values in a
safetensors file) is named on stderr, never dropped silently; keys that the flat targets (safetensors, DCP)
would join into one (``{"a.b": x}`` beside ``{"a": {"b": y}}``) are refused before anything is written. An
existing DST is refused unless ``--force``.
"""
from __future__ import annotations

import argparse
import io
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ppe_snapshot.cli.common import (
    STATE_KEY, Kind, Source, UsageError, join_keys, key_of, keyed, open_source, progress, read_app_state, read_dcp,
    unwrap,
)
from ppe_snapshot.cli.dcp_dirs import failure, save_dcp
from ppe_snapshot.engine import Snapshot, StateDict, read_manifest, upgrade_snapshot
from ppe_snapshot.errors import UnsupportedValueError
from ppe_snapshot.storage import open_storage, open_tree, open_url

TARGETS = ("snapshot", "torch", "dcp", "safetensors")


#: What DST's name says when ``--to`` is not given: the only inference made (the name states the format).
SUFFIX_TARGETS = {".pt": "torch", ".pth": "torch", ".pkl": "torch", ".safetensors": "safetensors"}


def _target(to: str | None, dst: str) -> str:
    """``--to``, else the format DST's suffix names; else an error asking for ``--to`` (no format is chosen for the
    user: a wrong guess loses state, e.g. a torch file drops a snapshot's RNG states)."""
    if to is not None:
        return to
    lowered = dst.lower().rstrip("/")
    for suffix, target in SUFFIX_TARGETS.items():
        if lowered.endswith(suffix):
            return target
    raise UsageError(f"{dst}: say which format to write with --to {{{','.join(TARGETS)}}} (snapshot keeps "
                     "everything, RNG states included; torch: a torch.save file as ppe writes; dcp: torch's DCP "
                     "format; safetensors: tensors only); without --to only a .pt/.pth/.pkl or .safetensors name "
                     "chooses the format")


def _note(message: str) -> None:
    print(f"ppe-snapshot: note: {message}", file=sys.stderr)


def _check_destination(dst: str, storage_options: dict | None, force: bool) -> bool:
    """Whether ``dst`` exists (then only with ``force``)."""
    tree = open_tree(dst, storage_options)
    if tree.exists(tree.root) and not force:
        raise UsageError(f"{dst}: already exists; pass --force to replace it")
    return tree.exists(tree.root)


def _move_aside(dst: str, storage_options: dict | None) -> str:
    """Move an existing ``dst`` beside it until the conversion succeeded; returns where it went."""
    tree = open_tree(dst, storage_options)
    aside = tree.root + ".ppe-snapshot-replaced"
    if tree.exists(aside):  # left by a conversion that was killed: the new DST was never complete
        tree.remove(aside)
    tree.move(tree.root, aside)
    return aside


def _tensors_only(state: dict[str, Any], within: tuple[str, ...], target: str) -> dict[str, torch.Tensor]:
    tensors = {k: v for k, v in join_keys(state, within).items() if isinstance(v, torch.Tensor)}
    dropped = [k for k, v in keyed(state, within).items() if not isinstance(v, torch.Tensor)]
    if dropped:
        shown = ", ".join(dropped[:8]) + (f" and {len(dropped) - 8} more" if len(dropped) > 8 else "")
        _note(f"{target} holds tensors only; not written ({len(dropped)} non-tensor values): {shown}")
    return tensors


def _write_safetensors(state: dict[str, Any], within: tuple[str, ...], dst: str, storage_options: dict | None
                       ) -> None:
    from safetensors.torch import save as save_safetensors

    tensors = {k: v.detach().cpu().contiguous().clone()
               for k, v in _tensors_only(state, within, "safetensors").items()}
    _check_safetensors_dtypes(tensors, save_safetensors)
    data = save_safetensors(tensors)
    with open_url(dst, "wb", storage_options) as f:
        f.write(data)


def _check_safetensors_dtypes(tensors: dict[str, torch.Tensor], save: Any) -> None:
    """Raise :class:`UnsupportedValueError` naming the tensors of a dtype the installed safetensors cannot store
    (complex128 with safetensors 0.8; complex64, float8 and unsigned types too with 0.4), each dtype tried on an
    empty tensor."""
    refused = []
    for dtype in sorted({t.dtype for t in tensors.values()}, key=str):
        try:
            save({"probe": torch.empty(0, dtype=dtype)})
        except Exception:  # noqa: BLE001 - each release refuses in its own way (KeyError, ValueError, ...)
            refused.append(dtype)
    if refused:
        import safetensors

        keys = [k for k, t in tensors.items() if t.dtype in refused]
        shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        raise UnsupportedValueError(
            f"safetensors {safetensors.__version__} cannot store {', '.join(map(str, refused))}, the dtype of "
            f"{shown}; convert --to torch, dcp or snapshot keeps them")


def _write_torch(state: dict[str, Any], dst: str, storage_options: dict | None) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with open_url(dst, "wb", storage_options) as f:
        f.write(buffer.getvalue())


def _write_dcp(state: dict[str, Any], dst: str, storage_options: dict | None,
               metadata: dict[str, Any] | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    local = open_tree(dst, storage_options).local_dir
    if local is None:
        raise UsageError(f"{dst}: torch DCP directories are written to local paths only")
    try:
        save_dcp(state, dcp.FileSystemWriter(local), metadata)
    except CheckpointException as e:  # a BaseException holding each rank's error and its traceback as text
        cause = failure(e)
        raise UsageError(f"{dst}: torch DCP could not write it: {type(cause).__name__}: {cause}") from e


@dataclass
class _Read:
    """What is converted: the source's state (as :func:`unwrap` gives it), where it is in the source's app state
    (for the keys of notes and errors), its RNG states, and the metadata recorded with it (training position...)."""
    state: dict[str, Any]
    within: tuple[str, ...] = ()
    rng: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] | None = None


def _read(source: Source, allow_pickle: bool) -> _Read:
    """An engine snapshot's metadata, or what ``convert`` recorded in a DCP checkpoint, comes along."""
    if source.kind in (Kind.DCP_ADAPTER, Kind.TORCH_DCP):
        state, metadata = read_dcp(source, allow_pickle)
        return _Read(state, (STATE_KEY,), metadata=metadata)
    values, rng = read_app_state(source, allow_pickle=allow_pickle)
    metadata = source.snapshot().metadata if source.kind == Kind.SNAPSHOT else None
    return _Read(*unwrap(values), rng, metadata)


def _model_state(read: _Read, name: str, src: str) -> _Read:
    """``--model NAME``: the state dict of the manager's model ``name`` alone, keyed as the model's own."""
    models = read.state.get("models")
    if isinstance(models, dict) and isinstance(models.get(name), dict):
        return _Read(models[name], (*read.within, "models", name))
    held = f"its models: {', '.join(map(str, models))}" if isinstance(models, dict) else (
        "it holds no manager state (models/NAME); its keys: " + ", ".join(map(str, read.state)))
    raise UsageError(f"{src}: no model named {name!r} to convert ({held})")


def _self_contained_current(path: str, storage_options: dict | None) -> bool:
    """Whether the snapshot at ``path`` is of the current format and references no other snapshot."""
    storage = open_storage(path, storage_options)
    try:
        manifest = read_manifest(storage)
        return manifest.version >= 2 and not manifest.references
    finally:
        storage.close()


def convert(args: argparse.Namespace) -> str:
    """Convert; returns the target format written."""
    source = open_source(args.src, args.storage_options)
    target = _target(args.to, args.dst)
    upgrade = source.is_engine and target == "snapshot" and source.kind == Kind.SNAPSHOT and not args.model
    if upgrade and _self_contained_current(args.src, args.storage_options):
        raise UsageError(f"{args.src}: already a self-contained snapshot of the current format; copy the directory "
                         "instead")
    existing = _check_destination(args.dst, args.storage_options, args.force)
    with progress(4, f"convert {args.src}", unit="step") as bar:
        read = _Read({}) if upgrade else _read(source, args.allow_pickle)
        if args.model:
            read = _model_state(read, args.model, args.src)
        if target in ("safetensors", "dcp"):
            join_keys(read.state, read.within)  # keys that collide once joined are refused before anything is written
        bar.update(2)
        aside = _move_aside(args.dst, args.storage_options) if existing else None
        tree = open_tree(args.dst, args.storage_options)
        try:
            if upgrade:  # version 1 or incremental -> self-contained version 2 (see upgrade_snapshot)
                upgrade_snapshot(open_storage(args.src, args.storage_options),
                                 open_storage(args.dst, args.storage_options))
            else:
                _write(args, target, read)
        except BaseException:
            _remove_partial(args.dst, args.storage_options)
            if aside is not None:  # the old DST comes back: a failed --force loses nothing
                tree.move(aside, tree.root)
            raise
        if aside is not None:
            tree.remove(aside)
        bar.update(2)
    return target


def _remove_partial(dst: str, storage_options: dict | None) -> None:
    """Remove what a failed conversion wrote at ``dst``, so nothing half-written is left."""
    try:
        tree = open_tree(dst, storage_options)
        if tree.exists(tree.root):
            tree.remove(tree.root)
    except Exception:  # noqa: BLE001 - the conversion's own error is the one to report
        pass


def _write(args: argparse.Namespace, target: str, read: _Read) -> None:
    if read.rng and target != "snapshot":
        _note(f"{target} target holds the training state only; not written: "
              f"{', '.join(key_of(k) for k in sorted(read.rng))} (RNG states: convert to a snapshot to keep them)")
    if target == "snapshot":
        app_state: dict[str, Any] = {"state": StateDict(read.state)}
        Snapshot.take(args.dst, app_state, storage_options=args.storage_options, allow_pickle=args.allow_pickle,
                      metadata=read.metadata)
    elif target == "torch":
        _write_torch(read.state, args.dst, args.storage_options)
    elif target == "dcp":
        _write_dcp(read.state, args.dst, args.storage_options, read.metadata)
    else:
        _write_safetensors(read.state, read.within, args.dst, args.storage_options)


def cmd_convert(args: argparse.Namespace) -> int:
    target = convert(args)
    names = {"snapshot": "snapshot", "torch": "torch.save file", "dcp": "torch DCP directory",
             "safetensors": "safetensors file"}
    print(f"wrote {names[target]} {args.dst}")
    return 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("convert", parents=[common], help="convert between snapshot formats",
                       description="Convert SRC (an engine or DCP-adapter snapshot, a ppe torch.save file, a torch "
                                   "DCP directory or a safetensors file) to DST. Targets: snapshot (this library's "
                                   "format), torch (a torch.save file, as ppe writes), dcp (torch's own DCP format, "
                                   "read by plain dcp.load), safetensors (tensors only, nested keys joined with "
                                   "'.'). A snapshot of format version 1, or an incremental snapshot, converted to "
                                   "a snapshot becomes a self-contained snapshot of version 2 (its data files copied "
                                   "as they are, and of the snapshots it references the blocks it reads). Without "
                                   "--to, DST's suffix names the format (.pt/.pth/.pkl: torch, .safetensors), and any "
                                   "other DST is an error. What the target cannot hold is named on stderr.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--to", choices=TARGETS, help="the target format (required unless DST ends in .pt, .pth, .pkl "
                                                 "or .safetensors)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--model", metavar="NAME",
                   help="write the weights of the manager's model NAME alone (the snapshot's 0/state/models/NAME), "
                        "keyed as the model's own state_dict: model.load_state_dict(safetensors.torch.load_file(DST)) "
                        "loads them")
    p.add_argument("--allow-pickle", "--unsafe-pickle", dest="allow_pickle", action="store_true",
                   help="unpickle what needs it: a snapshot's pickled entries, a torch.save file's objects beyond "
                        "tensors and plain values (runs code from SRC: only for files you trust)")
    p.set_defaults(run_command=cmd_convert)
