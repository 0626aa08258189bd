"""Conversions of a real training run's snapshots with the command line, read back the way their users read them:
a DCP round trip that autoload resumes from, bit-exactly; one spelling of a key in every subcommand; one model's
weights exported for model.load_state_dict."""
from __future__ import annotations

import pickle
import re
import shutil

import pytest
import pytorch_pfn_extras as ppe
import torch

import ppe_snapshot
from ppe_snapshot.cli import main

from _asserts import assert_same

ITERATIONS = 4


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _run(out_dir, iterations: int = ITERATIONS):
    """A manager with Adam (its state keyed by ints) and an autoloading snapshot extension (whose state holds
    empty dicts), trained to ``iterations``."""
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, 100, iters_per_epoch=2, out_dir=str(out_dir),
                                             stop_trigger=(iterations, "iteration"))
    manager.extend(ppe_snapshot.snapshot(autoload=True), trigger=(2, "iteration"))
    manager.start_extensions()
    while not manager.stop_trigger:
        with manager.run_iteration():
            model(torch.randn(4, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return manager, model, optimizer


def test_a_dcp_round_trip_keeps_what_autoload_needs(tmp_path, capsys):
    _run(tmp_path / "run")
    original = tmp_path / "run" / f"snapshot_iter_{ITERATIONS}"
    assert main(["convert", "--to", "dcp", str(original), str(tmp_path / "dcp")]) == 0
    assert main(["convert", "--to", "snapshot", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    assert "not written: 0/rng" in capsys.readouterr().err  # the one thing DCP does not hold, named

    back = ppe_snapshot.Snapshot(str(tmp_path / "back"))
    saved = ppe_snapshot.Snapshot(str(original)).read_object("0/state")
    assert_same(back.read_object("0/state"), saved)  # empty dicts, int keys, order: all as saved
    assert back.metadata == ppe_snapshot.Snapshot(str(original)).metadata

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "back", resumed_dir / f"snapshot_iter_{ITERATIONS}")
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    shutil.copytree(original, reference_dir / original.name)
    resumed = _run(resumed_dir, ITERATIONS)
    reference = _run(reference_dir, ITERATIONS)
    assert resumed[0].iteration == reference[0].iteration == ITERATIONS
    assert_same(resumed[1].state_dict(), reference[1].state_dict(), "model")
    assert_same(resumed[2].state_dict(), reference[2].state_dict(), "optimizer")
    assert list(resumed[2].state_dict()["state"]) == [0, 1, 2, 3]


#: A line naming an entry: ``  KEY: ...`` (inspect), ``differs:   KEY: ...``, ``only in B: KEY`` (diff).
KEY_LINE = re.compile(r"^(?:  |differs:\s+|changed:\s+|only in [AB]:\s+)(\S+?)(?::\s|$)")


def _printed_keys(capsys, *argv: str) -> list[str]:
    """The keys a subcommand prints."""
    main(list(argv))
    return [m.group(1) for line in capsys.readouterr().out.splitlines() if (m := KEY_LINE.match(line))]


def test_every_subcommand_spells_a_key_as_read_object_takes_it(tmp_path, capsys):
    _run(tmp_path / "run")
    run = tmp_path / "run"
    older, newer = run / "snapshot_iter_2", run / f"snapshot_iter_{ITERATIONS}"
    snap = ppe_snapshot.Snapshot(str(newer))
    weight = "0/state/models/main/0.weight"
    assert weight in _printed_keys(capsys, "inspect", str(newer))
    differing = _printed_keys(capsys, "diff", "--ignore-rng", str(older), str(newer))
    assert weight in differing and "0/state/_start_iteration" in differing
    for key in differing:
        snap.read_object(key)  # each one names an entry
    assert main(["convert", "--to", "safetensors", str(newer), str(tmp_path / "all.safetensors")]) == 0
    err = capsys.readouterr().err
    assert "not written: 0/rng (RNG states" in err and ": 0/state/_start_iteration, " in err
    assert snap.read_object("0/state/_start_iteration") == ITERATIONS
    # other kinds are spelled as the snapshot that convert --to snapshot makes of them
    for target, name in (("torch", "state.pt"), ("dcp", "state.dcp"), ("safetensors", "all.safetensors")):
        if target != "safetensors":
            assert main(["convert", "--to", target, str(newer), str(tmp_path / name)]) == 0
        assert main(["convert", "--to", "snapshot", str(tmp_path / name), str(tmp_path / f"{name}.snap")]) == 0
        capsys.readouterr()
        copy = ppe_snapshot.Snapshot(str(tmp_path / f"{name}.snap"))
        printed = _printed_keys(capsys, "inspect", str(tmp_path / name))
        assert printed and set(printed) <= set(copy.get_manifest()), (target, printed)
    assert main(["diff", str(tmp_path / "all.safetensors"), str(newer), "--ignore-rng"]) == 1
    assert "only in B: 0/state/_start_iteration" in capsys.readouterr().out  # tensors lined up, equal


def test_the_weights_of_one_model_export_as_its_state_dict(tmp_path, capsys):
    _, model, _ = _run(tmp_path / "run")
    snapshot = tmp_path / "run" / f"snapshot_iter_{ITERATIONS}"
    out = tmp_path / "model.safetensors"
    assert main(["convert", "--to", "safetensors", "--model", "main", str(snapshot), str(out)]) == 0
    assert capsys.readouterr().err == ""  # nothing left out that the model's state dict holds
    from safetensors.torch import load_file

    fresh = _model()
    fresh.load_state_dict(load_file(str(out)))  # strict: exactly the model's keys
    assert_same(fresh.state_dict(), model.state_dict())
    assert main(["convert", "--to", "safetensors", "--model", "other", str(snapshot), str(tmp_path / "o")]) == 2
    assert "no model named 'other' to convert (its models: main)" in capsys.readouterr().err


def test_a_crafted_record_in_a_dcp_checkpoint_is_corrupt(tmp_path, capsys):
    """What convert records in planner_data is untrusted input too: a record that does not fit the state (here,
    an index that would grow a list by 10^12 items) is refused, nothing allocated."""
    from ppe_snapshot.cli.dcp_dirs import EXTRAS_KEY

    ppe_snapshot.Snapshot.take(str(tmp_path / "s"), {"state": ppe_snapshot.StateDict(a=[torch.ones(2)], b={})})
    assert main(["convert", "--to", "dcp", str(tmp_path / "s"), str(tmp_path / "d")]) == 0
    metadata_file = tmp_path / "d" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    assert metadata.planner_data[EXTRAS_KEY]["empty"] == [[["b"], {}, 1]]
    metadata.planner_data[EXTRAS_KEY]["empty"] = [[["a", 10 ** 12], {}, 0]]
    metadata_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ppe_snapshot.CorruptSnapshotError, match="index 1000000000000 beyond a list of 1"):
        ppe_snapshot.load_snapshot(str(tmp_path / "d"))


def test_a_dtype_safetensors_cannot_store_is_named_before_anything_is_written(tmp_path, capsys):
    """complex128 (and, with older safetensors, complex64, float8 and unsigned types): refused by name, no file."""
    ppe_snapshot.Snapshot.take(str(tmp_path / "s"), {"m": ppe_snapshot.StateDict(
        w=torch.ones(2), c=torch.ones(2, dtype=torch.complex128), d=torch.zeros(3, dtype=torch.complex128))})
    assert main(["convert", str(tmp_path / "s"), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"UnsupportedValueError: safetensors \S+ cannot store torch\.complex128, the dtype of m\.c, m\.d;",
                     err), err
    assert not (tmp_path / "out.safetensors").exists()
