"""The readers of docs/format.md (sections 10 and 13: one tensor read with json, numpy and xxhash alone) against
snapshots ppe-snapshot wrote: the format document must stay true to the code."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from _asserts import written_as
from ppe_snapshot import Snapshot, StateDict

FORMAT_DOC = Path(__file__).resolve().parent.parent / "docs" / "format.md"
#: Small blocks, so that a tensor of the state has several chunks and an incremental take references most of them.
BLOCK = 64 << 10


def doc_reader(section: int) -> SimpleNamespace:
    """The imports, constants and functions of the Python block of ``section`` (its example call left out)."""
    text = FORMAT_DOC.read_text()
    body = re.search(rf"^## {section}\. .*?(?=^## |\Z)", text, re.S | re.M)
    assert body, f"docs/format.md has no section {section}"
    (block,) = re.findall(r"```python\n(.*?)```", body.group(0), re.S)
    tree = ast.parse(block)
    tree.body = [node for node in tree.body if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call)]
    namespace: dict = {}
    exec(compile(tree, f"<docs/format.md, section {section}>", "exec"), namespace)
    return SimpleNamespace(**namespace)


def assert_same(array: np.ndarray, tensor: torch.Tensor | np.ndarray) -> None:
    expected = tensor.numpy() if isinstance(tensor, torch.Tensor) else tensor
    assert array.dtype == expected.dtype and array.shape == expected.shape
    assert array.tobytes() == expected.tobytes()


def model_state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(5, 7, generator=generator),
        "bias": torch.randn(7, dtype=torch.float64, generator=generator),
        "half": torch.randn(100_000, generator=generator).half(),  # 200 KB: several chunks of 64 KiB
        "mask": torch.rand(3, 3, generator=generator) > 0.5,
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "counts": np.arange(6, dtype=np.int32).reshape(2, 3),
        "rep_table": torch.arange(12, dtype=torch.int16),
    }


def take(path: Path, state: dict, **kwargs) -> str:
    Snapshot.take(str(path), {"model": StateDict(state)}, block_bytes=BLOCK, **kwargs)
    return str(path)


def manifest_take_id(path: str) -> str:
    return json.loads(Path(path, "manifest.json").read_text())["take_id"]


def test_section_10_reads_every_tensor_of_a_version_1_snapshot(tmp_path):
    state = model_state()
    with written_as(1):
        path = take(tmp_path / "s", state, replicated=["model/rep_*"])
    assert json.loads(Path(path, "manifest.json").read_text())["version"] == 1
    reader = doc_reader(10)
    for key, value in state.items():
        assert_same(reader.read_tensor(path, f"0/model/{key}"), value)


def test_section_13_reads_every_tensor_of_a_version_2_snapshot(tmp_path):
    state = model_state()
    path = take(tmp_path / "s", state, replicated=["model/rep_*"])
    reader = doc_reader(13)
    header, _ = reader.read_index(path, "index/shared.idx", manifest_take_id(path))
    assert "model/rep_table" in header["tensors"]  # the shared index is read too
    header, columns = reader.read_index(path, "index/rank0.idx", manifest_take_id(path))
    assert len(columns["chunk_nbytes"]) > len(header["tensors"])  # a tensor of several chunks
    for key, value in state.items():
        assert_same(reader.read_tensor(path, f"model/{key}"), value)


def test_section_13_reads_a_version_3_snapshot_through_its_references(tmp_path):
    state = model_state()
    base = take(tmp_path / "s1", state)
    state["half"][:1000] = 7.0  # the first block changes; the others are referenced
    path = take(tmp_path / "s2", state, base=base)
    reader = doc_reader(13)
    header, _ = reader.read_index(path, "index/rank0.idx", manifest_take_id(path))
    assert json.loads(Path(path, "manifest.json").read_text())["version"] == 3
    assert any(name.startswith("../s1/") for name, _ in header["files"])
    for key, value in state.items():
        assert_same(reader.read_tensor(path, f"model/{key}"), value)


@pytest.mark.parametrize("section", [10, 13])
def test_the_doc_readers_refuse_a_damaged_chunk(tmp_path, section):
    with written_as(1 if section == 10 else 2):
        path = take(tmp_path / "s", {"weight": torch.ones(64)})
    data = Path(path, "data", "rank0.bin")
    damaged = bytearray(data.read_bytes())
    damaged[10] ^= 0xFF
    data.write_bytes(bytes(damaged))
    key = "0/model/weight" if section == 10 else "model/weight"
    with pytest.raises(ValueError, match="data/rank0.bin is damaged at byte 0"):
        doc_reader(section).read_tensor(path, key)
