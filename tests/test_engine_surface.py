"""The engine's public surface: taking in stages, the format facts, the settings, the DCP aliases."""
from __future__ import annotations

import pytest
import torch

import ppe_snapshot.dcp
import ppe_snapshot.storage
from ppe_snapshot import SnapshotExistsError, SnapshotNotFoundError, StateDict
from ppe_snapshot.engine import LOCAL, MANIFEST_NAME, Snapshot, prepare_take, read_manifest
from ppe_snapshot.engine._format.names import (
    abort_name, data_file, new_take_id, parse_parts_name, part_name, takes_in_progress,
)
from ppe_snapshot.settings import Settings
from ppe_snapshot.storage import open_storage


def test_take_in_stages(tmp_path):
    """plan -> stage -> (the caller changes its state) -> write and commit: the staged state is what is stored."""
    weight = torch.arange(6, dtype=torch.float32)
    job = prepare_take(str(tmp_path / "s"), {"m": StateDict({"w": weight})}, pg=LOCAL, metadata={"step": 3})
    job.stage()
    weight.zero_()
    job.write_and_commit()
    out = {"m": StateDict({"w": torch.empty(6)})}
    Snapshot(str(tmp_path / "s")).restore(out)
    assert torch.equal(out["m"]["w"], torch.arange(6, dtype=torch.float32))
    assert read_manifest(open_storage(str(tmp_path / "s"))).metadata == {"step": 3}


def test_staged_image_handed_over(tmp_path):
    """What a worker process does: the job travels without its buffer and gets the shared image back."""
    job = prepare_take(str(tmp_path / "s"), {"m": StateDict({"w": torch.ones(4)})}, pg=LOCAL)
    job.stage()
    image = job.staged
    job.release_staging()
    assert job.staged is None
    job.use_staged(image)
    job.write_and_commit()
    assert Snapshot(str(tmp_path / "s")).read_object("0/m/w").tolist() == [1.0] * 4


def test_prepare_take_options_are_keyword_only(tmp_path):
    with pytest.raises(TypeError, match="positional argument"):
        prepare_take(str(tmp_path / "s"), {"m": StateDict({})}, LOCAL, None, None, False, None)  # type: ignore[misc]
    assert not (tmp_path / "s").exists()


def test_prepare_take_refuses_to_overwrite(tmp_path):
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict({"x": 1})})
    with pytest.raises(SnapshotExistsError, match="already exists"):
        prepare_take(str(tmp_path / "s"), {"m": StateDict({"x": 2})}, pg=LOCAL)


def test_read_manifest_not_found(tmp_path):
    with pytest.raises(SnapshotNotFoundError, match=f"{MANIFEST_NAME} is missing"):
        read_manifest(open_storage(str(tmp_path / "nothing")))


def test_format_names():
    assert data_file(3) == "data/rank3.bin"
    take_id = new_take_id()
    assert len(take_id) == 16 and int(take_id, 16) >= 0 and take_id != new_take_id()
    assert part_name("abc", 2) == ".parts/abc.rank2.json" and abort_name("abc") == ".parts/abc.abort"


def test_parts_names_parse_back():
    assert parse_parts_name("abc.rank2.json") == ("abc", False)
    assert parse_parts_name("abc.abort") == ("abc", True)
    assert parse_parts_name("abc") is None and parse_parts_name("abc.tmp") is None
    names = ["a.rank0.json", "a.rank1.json", "b.rank0.json", "b.abort", "c.abort", "junk"]
    assert takes_in_progress(names) == {"a"}


def test_settings_from_environment():
    assert Settings.from_environment({}) == Settings()
    env = {"PPE_SNAPSHOT_DIRECT_IO": "0", "PPE_SNAPSHOT_BOUNCE_MB": "8", "PPE_SNAPSHOT_BOUNCE_N": "3",
           "PPE_SNAPSHOT_DRAIN_THREADS": "2", "PPE_SNAPSHOT_COMMIT_TIMEOUT": "5"}
    assert Settings.from_environment(env) == Settings(False, 8 << 20, 3, 2, 5.0)


def test_the_dcp_adapters_old_import_path_works_and_says_it_is_deprecated():
    with pytest.warns(DeprecationWarning, match="import it from ppe_snapshot.dcp"):
        assert ppe_snapshot.storage.SnapshotStorageWriter is ppe_snapshot.dcp.SnapshotStorageWriter
    with pytest.warns(DeprecationWarning, match="ppe_snapshot.storage.SnapshotStorageReader is deprecated"):
        from ppe_snapshot.storage import SnapshotStorageReader
    assert SnapshotStorageReader is ppe_snapshot.dcp.SnapshotStorageReader
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ppe_snapshot.storage.Nope  # noqa: B018


def test_rng_state_crosses_ranks_as_json_and_comes_back_exactly():
    """DISTRIBUTED mode sends each rank's RNG state to the saver as JSON (nothing a peer sends is unpickled)."""
    import json
    import random

    import numpy as np
    import torch

    from ppe_snapshot import RNGState

    state = RNGState().state_dict()
    back = RNGState.from_json(json.loads(json.dumps(RNGState.to_json(state))))
    assert torch.equal(back["torch"], state["torch"]) and back["torch"].dtype == torch.uint8
    assert back["numpy"][0] == state["numpy"][0] and back["numpy"][2:] == state["numpy"][2:]
    assert back["numpy"][1].dtype == np.uint32 and np.array_equal(back["numpy"][1], state["numpy"][1])
    assert back["python"] == state["python"]
    expected = (torch.rand(3), np.random.rand(3), random.random())
    RNGState().load_state_dict(back)
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], expected[0]) and np.array_equal(drawn[1], expected[1]) and drawn[2] == expected[2]
