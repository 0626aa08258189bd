"""The snapshot extension in one process: API, engine snapshots, autoload, retention, errors, stats."""
from __future__ import annotations

import inspect
import logging
import os
import shutil
import sys
import uuid
import warnings

import pytest
import pytorch_pfn_extras as ppe
import torch
from pytorch_pfn_extras.training import extension as ppe_extension
from pytorch_pfn_extras.training import extensions as ppe_extensions

import ppe_snapshot
from ppe_snapshot import Snapshot, SnapshotError, SnapshotMode, snapshot, snapshot_object
from ppe_snapshot.storage import join

import _warm
from _crafted import craft_index
from _extension_workers import WRITERS, Crash, Run, assert_same, flip_byte, make_writer, snapshot_names

ITERS = 10


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: ITERS iterations without interruption (snapshots on, into a directory of its own)."""
    run = Run(str(tmp_path_factory.mktemp("straight")), ITERS, {})
    run.train()
    return run.state()


def _iterations(out_dir) -> list[int]:
    return [int(n[len("snapshot_iter_"):]) for n in snapshot_names(str(out_dir))]


# -- the API ----------------------------------------------------------------------------------------------


def test_same_signature_defaults_trigger_and_priority_as_ppe():
    ours, theirs = inspect.signature(snapshot), inspect.signature(ppe_extensions.snapshot)
    ours_params = [(p.name, p.kind, p.default) for p in ours.parameters.values()]
    # ppe's parameters, in ppe's order, then keyword-only opt-ins of ours.
    assert ours_params == [(p.name, p.kind, p.default) for p in theirs.parameters.values()] + \
        [("allow_pickle", inspect.Parameter.KEYWORD_ONLY, False), ("keep", inspect.Parameter.KEYWORD_ONLY, None),
         ("save_on_signals", inspect.Parameter.KEYWORD_ONLY, ()),
         ("preempted_exit_code", inspect.Parameter.KEYWORD_ONLY, None),
         ("incremental", inspect.Parameter.KEYWORD_ONLY, False), ("local", inspect.Parameter.KEYWORD_ONLY, None)]
    assert list(inspect.signature(snapshot_object).parameters) == \
        list(inspect.signature(ppe_extensions.snapshot_object).parameters)
    assert SnapshotMode is ppe_extensions.SnapshotMode
    ext = snapshot()
    assert isinstance(ext, ppe_extension.Extension)
    assert ext.trigger == (1, "epoch") and ext.priority == ppe_extension.PRIORITY_SNAPSHOT
    assert ext.needs_model_state is True
    model = torch.nn.Linear(2, 2)
    obj = snapshot_object(model, "model_{.iteration}", n_retains=2)
    assert obj._target is model and obj.filename == "model_{.iteration}" and obj.n_retains == 2


def test_argument_errors():
    with pytest.raises(TypeError, match="savefun and writer arguments cannot be specified together."):
        snapshot(savefun=torch.save, writer=ppe_snapshot.writing.SimpleWriter())
    for mode in (SnapshotMode.DISTRIBUTED, SnapshotMode.SHARDED):
        with pytest.raises(RuntimeError, match=f"snapshot_mode={mode.name} requires torch.distributed to be "
                                               "initialized"):
            snapshot(snapshot_mode=mode, saver_rank=0)
    with pytest.raises(RuntimeError, match="requires torch.distributed to be initialized"):
        snapshot(saver_rank=0)  # as in ppe, a saver rank means DISTRIBUTED
    with pytest.raises(ValueError, match="DISTRIBUTED needs saver_rank"):
        snapshot(snapshot_mode=SnapshotMode.DISTRIBUTED)
    with pytest.raises(RuntimeError, match="snapshot_mode must be one of"):
        snapshot(snapshot_mode="SHARDED")
    with pytest.raises(ValueError, match="autoload needs filename to be a format string"):
        snapshot(filename=lambda m: f"s{m.iteration}", autoload=True)
    with pytest.raises(ValueError, match="not a valid format string"):
        snapshot(filename="snap_{.iteration")


# -- what gets written --------------------------------------------------------------------------------------


def test_default_saves_engine_snapshots_with_position_metadata(tmp_path):
    run = Run(str(tmp_path), 4, {}, iters_per_epoch=3)
    run.train()
    assert _iterations(tmp_path) == [2, 4]
    snap = Snapshot(str(tmp_path / "snapshot_iter_4"))
    snap.verify()
    assert snap.metadata == {"iteration": 4, "epoch": 1, "epoch_detail": 4 / 3, "ppe_snapshot_target": "manager"}
    weight = snap.read_object("0/state/models/main/fc1.weight")
    assert torch.equal(weight, run.model.fc1.weight)
    assert snap.read_object("0/state/_start_iteration") == 4


@pytest.mark.parametrize("savefun", [None, torch.save])
def test_n_retains_with_a_callable_name_keeps_every_snapshot_as_ppe_does(tmp_path, savefun):
    # ppe documents that pruning "only works when the filename is string" and keeps a callable's every file.
    with pytest.warns(UserWarning, match="n_retains=1 is ignored, filename is a callable"):
        run = Run(str(tmp_path), 6, {"savefun": savefun, "filename": lambda m: f"c_{m.iteration}", "n_retains": 1})
    assert run.snapshot.policy is None
    run.train()
    assert sorted(os.listdir(tmp_path)) == ["c_2", "c_4", "c_6", "log"]


def test_savefun_keeps_ppe_single_files_and_callable_names(tmp_path):
    run = Run(str(tmp_path), 4, {"savefun": torch.save, "filename": lambda m: f"file_{m.iteration}.pt"})
    run.train()
    assert sorted(os.listdir(tmp_path)) == ["file_2.pt", "file_4.pt", "log"]
    state = torch.load(tmp_path / "file_4.pt", weights_only=False)
    assert state["_start_iteration"] == 4
    assert torch.equal(state["models"]["main"]["fc2.bias"], run.model.fc2.bias)


# -- resuming -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("writer", WRITERS)
def test_crash_resume_is_bit_identical_and_retains_newest(tmp_path, straight, writer):
    out = str(tmp_path)
    (tmp_path / "snapshot_iter_1" / "data").mkdir(parents=True)  # the leftover of a crashed save, older
    kwargs = {"writer": make_writer(writer), "autoload": True, "n_retains": 2}
    first = Run(out, ITERS, kwargs)
    with pytest.raises(Crash), pytest.warns(UserWarning, match="snapshot_iter_1: it has no manifest.json"):
        first.train(crash_at=7)
    first.snapshot.writer.finalize()  # the crashed process is gone; so are its writes in flight
    assert _iterations(tmp_path) == [4, 6]

    kwargs["writer"] = make_writer(writer)
    resumed = Run(out, ITERS, kwargs, seed=1)  # another initialization: everything must come from the snapshot
    resumed.manager.start_extensions()
    assert resumed.manager.iteration == 6
    assert resumed.snapshot.resumed_from == join(out, "snapshot_iter_6")
    resumed.train()
    assert_same(resumed.state(), straight)
    assert _iterations(tmp_path) == [8, 10]


@pytest.mark.parametrize("writer", ["SimpleWriter", "ProcessWriter"])
def test_resume_restores_global_rng_without_rng_in_the_target(tmp_path, writer, monkeypatch):
    """Engine snapshots carry the global RNG state themselves: dropout draws continue exactly."""
    reference = Run(str(tmp_path / "straight"), ITERS, {}, rng_in_state=False)
    reference.train()
    out = str(tmp_path / "run")
    first = Run(out, ITERS, {"writer": make_writer(writer), "autoload": True}, rng_in_state=False)
    with pytest.raises(Crash):
        first.train(crash_at=7)
    first.snapshot.writer.finalize()
    control = str(tmp_path / "control")
    shutil.copytree(out, control)

    resumed = Run(out, ITERS, {"writer": make_writer(writer), "autoload": True}, seed=1, rng_in_state=False)
    resumed.train()
    assert resumed.manager.iteration == ITERS
    assert_same(resumed.state(), reference.state())

    # The same resume without restoring the RNG state diverges: the check above can fail.
    monkeypatch.setattr(ppe_snapshot.extension.saved_state, "restore_rng", lambda snap, pg, rng_rank: None)
    diverged = Run(control, ITERS, {"writer": make_writer(writer), "autoload": True}, seed=1, rng_in_state=False)
    diverged.train()
    assert diverged.snapshot.resumed_from == join(control, "snapshot_iter_6")
    with pytest.raises(AssertionError):
        assert_same(diverged.state(), reference.state())


def test_resume_after_sigkill_mid_run(tmp_path, straight):
    out = str(tmp_path)
    child = _warm.run([sys.executable, os.path.join(os.path.dirname(__file__), "_extension_workers.py"),
                       out, str(ITERS), "7", "ThreadWriter"], capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr
    # Killed in iteration 8: the save of iteration 6 may still have been in flight.
    committed = [it for it in _iterations(tmp_path) if (tmp_path / f"snapshot_iter_{it}" / "manifest.json").exists()]
    partial = [it for it in _iterations(tmp_path) if it not in committed]
    assert committed in ([2, 4], [2, 4, 6]) and partial in ([], [6])
    resumed = Run(out, ITERS, {"autoload": True}, seed=1)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        resumed.manager.start_extensions()
    assert [str(w.message).split(": ")[1] for w in warned] == \
        [f"skipping snapshot {join(out, f'snapshot_iter_{it}')}" for it in partial]
    assert resumed.snapshot.resumed_from == join(out, f"snapshot_iter_{committed[-1]}")
    resumed.train()
    assert_same(resumed.state(), straight)


def _damage(tmp_path, iteration, how):
    snap = tmp_path / f"snapshot_iter_{iteration}"
    data = snap / "data" / "rank0.bin"
    if how == "no manifest":
        (snap / "manifest.json").unlink()
    elif how == "truncated":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size - 1)
    elif how == "missing file":
        data.unlink()
    elif how == "garbled manifest":
        (snap / "manifest.json").write_text('{"format": "ppe-snapshot", "version": 1')
    elif how == "bit flip":  # same size: only the checksums tell
        flip_byte(str(data))


def test_autoload_skips_damaged_snapshots_and_falls_back(tmp_path, straight, caplog):
    out = str(tmp_path)
    with pytest.raises(Crash):
        Run(out, ITERS, {}, trigger=(1, "iteration")).train(crash_at=7)  # snapshots 1 to 7
    damage = {7: "no manifest", 6: "truncated", 5: "missing file", 4: "garbled manifest", 3: "bit flip"}
    for it, how in damage.items():
        _damage(tmp_path, it, how)
    os.utime(tmp_path / "snapshot_iter_1", (2e9, 2e9))  # the newest mtime means nothing

    resumed = Run(out, ITERS, {"autoload": True}, seed=1)
    caplog.set_level(logging.INFO, logger="ppe_snapshot")
    with pytest.warns(UserWarning) as warned:
        resumed.manager.start_extensions()
    assert resumed.manager.iteration == 2
    messages = [str(w.message) for w in warned if "autoload" in str(w.message)]
    expected = {7: "has no manifest.json", 6: "rank0.bin is", 5: "rank0.bin is missing",
                4: "is not valid JSON", 3: "checksum"}
    assert len(messages) == len(expected)
    for (it, fragment), message in zip(expected.items(), messages):
        assert f"snapshot_iter_{it}" in message and fragment in message, message
    logged = caplog.text
    assert all(f"skipping snapshot {join(out, f'snapshot_iter_{it}')}" in logged for it in damage)
    assert f"resumed from {join(out, 'snapshot_iter_2')} at iteration 2" in logged
    resumed.train()
    assert_same(resumed.state(), straight)
    for it in (4, 6):  # damaged ones at positions saved again are replaced
        Snapshot(join(out, f"snapshot_iter_{it}")).verify()
        assert f"removed {join(out, f'snapshot_iter_{it}')}, which autoload skipped as damaged" in caplog.text


@pytest.mark.parametrize("savefun", [None, torch.save])
def test_autoload_in_one_process_skips_ppes_per_rank_files(tmp_path, savefun):
    out = str(tmp_path)
    Run(out, 4, {"savefun": savefun}).train()  # snapshots 2 and 4
    newest = tmp_path / "snapshot_iter_6"  # what SHARDED mode with a savefun wrote, as ppe does
    newest.mkdir()
    for name in ("0", "1", "complete"):
        torch.save({"_start_iteration": 6} if name != "complete" else {}, newest / name)
    resumed = Run(out, ITERS, {"savefun": savefun, "autoload": True})
    with pytest.warns(ppe_snapshot.AutoloadSkipWarning, match=r"snapshot_iter_6: it holds ppe's per-rank files of "
                                                               r"a SHARDED run \(2 ranks\); resume it with "
                                                               r"snapshot_mode=SnapshotMode.SHARDED"):
        resumed.manager.start_extensions()
    assert resumed.manager.iteration == 4


def test_autoload_without_valid_snapshot_starts_fresh(tmp_path, straight, caplog):
    out = str(tmp_path)
    Run(out, 4, {}).train()
    _damage(tmp_path, 4, "no manifest")
    _damage(tmp_path, 2, "truncated")
    fresh = Run(out, ITERS, {"autoload": True})
    with caplog.at_level(logging.INFO, logger="ppe_snapshot"), pytest.warns(UserWarning, match="skipping"):
        fresh.manager.start_extensions()
    assert fresh.manager.iteration == 0 and fresh.snapshot.resumed_from is None
    assert "found no usable snapshot" in caplog.text and "starting fresh" in caplog.text
    fresh.train()
    assert_same(fresh.state(), straight)


def test_a_fresh_run_among_an_earlier_runs_later_snapshots_is_warned_and_keeps_its_newest(tmp_path):
    out = str(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Run(out, 10, {"n_retains": 2}).train()  # into an empty directory: nothing to warn of
    assert not [w for w in caught if "past this run's first save" in str(w.message)]
    assert _iterations(tmp_path) == [8, 10]
    fresh = Run(out, 4, {"n_retains": 2}, seed=1)
    with pytest.warns(UserWarning, match=r"holds snapshots named up to iteration 10, past this run's first save "
                                         r"at iteration 2, and autoload=False resumed none of them"):
        fresh.train()
    assert _iterations(tmp_path) == [4, 8, 10]  # the earlier run's two newest, and this run's newest

def test_autoload_refuses_to_start_fresh_after_a_partial_restore(tmp_path):
    out = str(tmp_path)
    Run(out, 2, {}).train()
    _damage(tmp_path, 2, "bit flip")
    resumed = Run(out, ITERS, {"autoload": True})
    with pytest.raises(SnapshotError, match="partly overwritten"), pytest.warns(UserWarning, match="checksum"):
        resumed.manager.start_extensions()


def test_autoload_falls_back_from_an_rng_state_the_generators_refuse(tmp_path, straight):
    """A damaged RNG state (the Python generator's state vector one word short, index checksum intact) is damage,
    not a changed model: the snapshot is skipped, the older one restored, and the run goes on as if straight."""
    out = str(tmp_path)
    Run(out, 4, {}).train()  # snapshots 2 and 4
    craft_index(tmp_path / "snapshot_iter_4", lambda header, cols: (
        header["entries"]["rng/0/python/1"]["value"]["$tuple"].pop()))
    resumed = Run(out, ITERS, {"autoload": True}, seed=1)
    with pytest.warns(UserWarning, match="snapshot_iter_4: CorruptSnapshotError: RNG state: the python generator"):
        resumed.manager.start_extensions()
    assert resumed.manager.iteration == 2
    resumed.train()
    assert_same(resumed.state(), straight)


def test_autoload_reads_snapshots_written_by_ppe(tmp_path, straight):
    out = str(tmp_path)
    first = Run(out, ITERS, None)
    first.manager.extend(ppe_extensions.snapshot(), trigger=(2, "iteration"))  # ppe's own, torch.save files
    with pytest.raises(Crash):
        first.train(crash_at=5)
    os.utime(tmp_path / "snapshot_iter_2", (2e9, 2e9))
    resumed = Run(out, ITERS, {"autoload": True}, seed=1)
    resumed.train()
    assert resumed.snapshot.resumed_from == join(out, "snapshot_iter_4")
    assert_same(resumed.state(), straight)
    assert Snapshot(join(out, "snapshot_iter_10")).metadata["iteration"] == 10  # and goes on with the engine


@pytest.mark.parametrize("target", ["dict", "model"])
def test_snapshot_object_targets_resume(tmp_path, target):
    out = str(tmp_path)
    first = Run(out, ITERS, {"filename": "obj_{.iteration}"}, target=target)
    with pytest.raises(Crash):
        first.train(crash_at=5)
    with pytest.raises(Crash), pytest.warns(UserWarning, match="named up to iteration 4, past this run's first save"):
        # manager snapshots obj_3 and obj_6, of the wrong target, beside the first run's later obj_4
        Run(out, ITERS, {"filename": "obj_{.iteration}"}, trigger=(3, "iteration")).train(crash_at=6)
    resumed = Run(out, ITERS, {"filename": "obj_{.iteration}", "autoload": True}, target=target, seed=1)
    with pytest.warns(UserWarning, match="obj_6: it holds a manager target and this extension's target is a"):
        resumed.manager.start_extensions()
    assert resumed.snapshot.resumed_from == join(out, "obj_4")
    assert Snapshot(join(out, "obj_4")).metadata["ppe_snapshot_target"] == ("dict" if target == "dict" else "object")
    assert resumed.manager.iteration == 0  # the manager itself was not the target
    saved = Snapshot(join(out, "obj_4")).read_object("0/state")
    weights = saved["model"] if target == "dict" else saved
    assert_same(resumed.model.state_dict(), weights)


def test_ppe_simple_writer_is_stood_in_for_and_a_custom_one_called_with_ppe_protocol(tmp_path):
    run = Run(str(tmp_path / "a"), 4, {"writer": ppe.writing.SimpleWriter(out_dir=str(tmp_path / "a")),
                                       "n_retains": 1})
    run.train()
    assert _iterations(tmp_path / "a") == [4]
    Snapshot(str(tmp_path / "a" / "snapshot_iter_4")).verify()  # ppe's default writer: engine snapshots

    class Custom(ppe.writing.SimpleWriter):
        pass
    run = Run(str(tmp_path / "b"), 4, {"writer": Custom(out_dir=str(tmp_path / "b")), "n_retains": 1})
    run.train()
    assert _iterations(tmp_path / "b") == [4]
    assert torch.load(tmp_path / "b" / "snapshot_iter_4", weights_only=False)["_start_iteration"] == 4


# -- URLs ----------------------------------------------------------------------------------------------------


def test_memory_url_with_thread_writer(tmp_path, straight):
    url = f"memory://ext-{uuid.uuid4().hex}/run"
    first = Run(str(tmp_path), ITERS, {"writer": make_writer("ThreadWriter", out_dir=url), "n_retains": 2})
    with pytest.raises(Crash):
        first.train(crash_at=5)
    first.snapshot.writer.finalize()
    resumed = Run(str(tmp_path), ITERS, {"writer": make_writer("ThreadWriter", out_dir=url), "n_retains": 2,
                                         "autoload": True}, seed=1)
    resumed.train()
    assert resumed.snapshot.resumed_from == join(url, "snapshot_iter_4")
    assert_same(resumed.state(), straight)
    names = [c.name for c in ppe_snapshot.retention.list_snapshots(url, "snapshot_iter_{.iteration}")]
    assert names == ["snapshot_iter_8", "snapshot_iter_10"]


# -- errors in the loop ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("writer", ["SimpleWriter", "ThreadWriter"])
def test_snapshot_on_error_saves_then_reraises(tmp_path, straight, writer, caplog):
    out = str(tmp_path)
    first = Run(out, ITERS, {"writer": make_writer(writer), "snapshot_on_error": True}, trigger=(4, "iteration"))
    with caplog.at_level(logging.INFO, logger="ppe_snapshot"), pytest.raises(Crash, match="after 5 iterations"):
        first.train(crash_at=5)
    assert _iterations(tmp_path) == [4, 5]
    Snapshot(join(out, "snapshot_iter_5")).verify()  # committed before the error propagated
    assert "training failed at iteration 5; saved snapshot" in caplog.text

    resumed = Run(out, ITERS, {"autoload": True}, seed=1)
    resumed.train()
    assert resumed.snapshot.resumed_from == join(out, "snapshot_iter_5")
    assert_same(resumed.state(), straight)


def test_snapshot_on_error_at_a_saved_position_and_from_an_extension(tmp_path, caplog):
    out = str(tmp_path)
    run = Run(out, ITERS, {"snapshot_on_error": True})
    with caplog.at_level(logging.INFO, logger="ppe_snapshot"), pytest.raises(Crash):
        run.train(crash_at=4)
    assert _iterations(tmp_path) == [2, 4]
    assert "snapshot" in caplog.text and "already holds this position" in caplog.text

    run = Run(str(tmp_path / "b"), ITERS, {"snapshot_on_error": True})

    def failing(manager):
        if manager.iteration == 3:
            raise KeyError("from an extension")
    run.manager.extend(failing, trigger=(1, "iteration"))
    with pytest.raises(KeyError, match="from an extension"):
        run.train()
    assert _iterations(tmp_path / "b") == [2, 3]
    assert Snapshot(str(tmp_path / "b" / "snapshot_iter_3")).metadata["iteration"] == 3


# -- stats ------------------------------------------------------------------------------------------------------


def test_stats_logged(tmp_path, caplog):
    """(That they reach LogReport / PrintReport: tests/test_observability.py.)"""
    run = Run(str(tmp_path), 4, {"writer": make_writer("ThreadWriter")}, trigger=(1, "iteration"))
    with caplog.at_level(logging.INFO, logger="ppe_snapshot"):
        run.train()
    run.snapshot.writer.finalize()
    assert "snapshot snapshot_iter_3 at iteration 3: blocking_s=" in caplog.text


def test_autoload_into_a_changed_model_says_so(tmp_path):
    """A model whose shapes changed since the run is not a damaged snapshot: autoload raises StateMismatchError
    naming the snapshot and the entry, and tries no older snapshot."""
    def manager_for(model):
        manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 10,
                                                 iters_per_epoch=2, out_dir=str(tmp_path))
        manager.extend(ppe_snapshot.snapshot(autoload=True), trigger=(1, "iteration"))
        return manager

    saved = manager_for(torch.nn.Linear(2, 2))
    for _ in range(2):
        with saved.run_iteration():
            pass
    changed = torch.nn.Linear(3, 3)
    with pytest.raises(ppe_snapshot.StateMismatchError) as raised:
        manager_for(changed).start_extensions()
    message = str(raised.value)
    assert f"does not fit snapshot {tmp_path / 'snapshot_iter_2'}" in message
    assert "state/models/main/weight" in message and "[2, 2]" in message and "[3, 3]" in message
    assert "damaged" not in message and "snapshot_iter_1" not in message


def test_load_snapshot_outside_the_trainer(tmp_path):
    """One call loads a run's snapshot (a directory, or ppe's single file) into a fresh model and optimizer;
    a changed model is named as such, and nothing is loaded into it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, 10, iters_per_epoch=2, out_dir=str(tmp_path))
    manager.extend(ppe_snapshot.snapshot(), trigger=(2, "iteration"))
    manager.extend(ppe_snapshot.snapshot(savefun=torch.save, filename="file_{.iteration}"), trigger=(2, "iteration"))
    for _ in range(2):
        with manager.run_iteration():
            model(torch.ones(4, 2)).sum().backward()
            optimizer.step()
    for name in ("snapshot_iter_2", "file_2"):
        fresh = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        fresh_optimizer = torch.optim.Adam(fresh.parameters())
        state = ppe_snapshot.load_snapshot(str(tmp_path / name), model=fresh, optimizer=fresh_optimizer)
        assert state["_start_iteration"] == 2
        for key, value in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], value), (name, key)
        assert fresh_optimizer.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    changed = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1), torch.nn.Tanh())
    before = {k: v.clone() for k, v in changed.state_dict().items()}
    with pytest.raises(ppe_snapshot.StateMismatchError, match=r"the model does not fit the snapshot .*other shapes "
                                                              r"\(0\.bias: saved \[3\], model \[4\]"):
        ppe_snapshot.load_snapshot(str(tmp_path / "snapshot_iter_2"), model=changed)
    assert all(torch.equal(changed.state_dict()[k], v) for k, v in before.items())
    with pytest.raises(ppe_snapshot.SnapshotNotFoundError, match="nothing: no such file or directory"):
        ppe_snapshot.load_snapshot(str(tmp_path / "nothing"))
