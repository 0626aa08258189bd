"""Single-file saves (an explicit ``savefun`` such as ``torch.save``), the way ppe writes them.

``savefun(target, file)`` writes to ``tmp_<name>`` beside the destination,
which is then renamed over it (the storage floor's ``Tree.save_file``). Async writers stage
the target first: :class:`StagedObject` lays its tensors out, copies them into a
buffer the writer reuses and returns a skeleton (the target with placeholders), and
:func:`materialize` rebuilds the target from both in the background.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ppe_snapshot.engine import align
from ppe_snapshot.storage import open_tree

@dataclass
class FileSave:
    """One single-file save; picklable, so a worker process can run it."""
    dest: str
    savefun: Callable[..., Any]
    append: bool = False
    kwds: dict[str, Any] = field(default_factory=dict)
    #: A ppe file-system object for local paths; None means plain ``os`` calls.
    fs: Any = None
    storage_options: dict[str, Any] | None = None

    def run(self, obj: Any) -> int:
        """Save ``obj``; returns the number of bytes written."""
        tree = open_tree(self.dest, self.storage_options)
        return tree.save_file(tree.root, self._write(obj), append=self.append, via=self.fs)

    def _write(self, obj: Any) -> Callable[[Any], int]:
        def write(f: Any) -> int:
            start = f.tell()
            self.savefun(obj, f, **self.kwds)
            return f.tell() - start
        return write


@dataclass(frozen=True)
class _TensorRef:
    """Where a staged tensor lies in the staging buffer."""
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    parameter: bool
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def _stageable(value: Any) -> bool:
    return (type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout == torch.strided
            and not value.is_quantized and value.device.type in ("cpu", "cuda"))


def _children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return []


def _collect(value: Any, found: dict[int, torch.Tensor]) -> None:
    if _stageable(value):
        found[id(value)] = value
        return
    for child in _children(value):
        _collect(child, found)


class StagedObject:
    """The tensors found in a target's dicts, lists and tuples, laid out in one host buffer of :attr:`size` bytes
    (pinned where :attr:`on_cuda`): the writer hands that buffer to :meth:`copy_into`."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self._found: dict[int, torch.Tensor] = {}
        _collect(target, self._found)
        self._memo: dict[int, Any] = {}
        self.size = 0
        for key, t in self._found.items():
            self._memo[key] = _TensorRef(self.size, t.dtype, tuple(t.shape), isinstance(t, torch.nn.Parameter),
                                         t.requires_grad)
            self.size = align(self.size + self._memo[key].nbytes)
        self.on_cuda = any(t.device.type == "cuda" for t in self._found.values())

    def copy_into(self, buffer: torch.Tensor) -> Any:
        """Copy the tensors into ``buffer``; returns a deep copy of the target in which they are placeholders
        (CUDA tensors come back as CPU tensors); other values are deep-copied, so the caller may change the
        target as soon as this returns."""
        for key, t in self._found.items():
            ref = self._memo[key]
            if ref.nbytes:
                region = buffer[ref.offset:ref.offset + ref.nbytes].view(t.dtype).view(t.shape)
                region.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        if self.on_cuda:
            torch.cuda.synchronize()
        return copy.deepcopy(self._target, dict(self._memo))


def materialize(skeleton: Any, buffer: torch.Tensor) -> Any:
    """Rebuild what :func:`stage_object` staged: every placeholder becomes a tensor of its own."""
    if isinstance(skeleton, _TensorRef):
        region = buffer[skeleton.offset:skeleton.offset + skeleton.nbytes]
        tensor = region.view(skeleton.dtype).view(skeleton.shape).clone()
        if skeleton.parameter:
            return torch.nn.Parameter(tensor, requires_grad=skeleton.requires_grad)
        return tensor.requires_grad_(skeleton.requires_grad)
    if isinstance(skeleton, dict):
        for key, value in skeleton.items():
            skeleton[key] = materialize(value, buffer)
        return skeleton
    if isinstance(skeleton, list):
        skeleton[:] = [materialize(v, buffer) for v in skeleton]
        return skeleton
    if isinstance(skeleton, tuple):
        items = [materialize(v, buffer) for v in skeleton]
        return type(skeleton)._make(items) if hasattr(skeleton, "_fields") else type(skeleton)(items)
    return skeleton
