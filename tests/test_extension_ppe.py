"""The snapshot extension as ppe 0.9's extension behaves, with one deliberate difference (a snapshot is a
directory): the writer looked up from the manager when the snapshot runs, initialize()'s return value, a name
saved again at every trigger, errors as ppe users catch them, argument checks, allow_pickle, imports."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
import warnings

import pytest
import pytorch_pfn_extras as ppe
import torch

import ppe_snapshot
from ppe_snapshot import Snapshot, SnapshotError, UnsupportedValueError, snapshot, snapshot_object
from ppe_snapshot import writing
from ppe_snapshot.extension import saved_state
from ppe_snapshot.storage import join
from ppe_snapshot.stored_snapshot import SIDE_SUFFIX
from ppe_snapshot.writing import BackgroundSaveError

from _extension_workers import Crash, Run, assert_same

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_manager(out_dir: str, iterations: int = 4, writer=None, seed: int = 0):
    """A manager over a small model; ``writer`` is the manager's (None: ppe's default SimpleWriter)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ppe.training.ExtensionsManager(model, optimizer, 100, iters_per_epoch=2, out_dir=out_dir,
                                             writer=writer, stop_trigger=(iterations, "iteration"))
    return manager, model


def train(manager, model) -> None:
    while not manager.stop_trigger:
        with manager.run_iteration():
            model(torch.ones(4, 3)).sum().backward()
            manager.optimizers["main"].step()
            manager.optimizers["main"].zero_grad()


def listing(path) -> list[str]:
    return sorted(os.listdir(path))


# -- the writer: the manager's, looked up when the snapshot runs ----------------------------------------------


def test_call_before_initialize_uses_the_managers_background_writer(tmp_path):
    writer = writing.ThreadWriter(out_dir=str(tmp_path))
    manager, _ = make_manager(str(tmp_path), writer=writer)
    ext = snapshot(filename="snap_{.iteration}")
    assert ext.writer is None  # nothing settled at construction
    ext(manager)  # never initialized
    assert ext.writer is writer
    assert writer.last_stats["path"] == join(str(tmp_path), "snap_0")  # saved through the manager's writer
    writer.finalize()
    assert Snapshot(str(tmp_path / "snap_0")).metadata["iteration"] == 0


def test_on_error_before_initialize_saves(tmp_path, caplog):
    manager, _ = make_manager(str(tmp_path))
    ext = snapshot_object(manager, "on_error_{.iteration}", snapshot_on_error=True)
    with caplog.at_level(logging.INFO, logger="ppe_snapshot"):
        ext.on_error(manager, Crash("boom"), None)
    assert "training failed at iteration 0; saved snapshot" in caplog.text
    Snapshot(str(tmp_path / "on_error_0")).verify()


@pytest.mark.parametrize("kind", ["SimpleWriter", "ThreadWriter", "ProcessWriter", "ThreadQueueWriter"])
def test_ppe_builtin_manager_writer_gets_engine_snapshots_from_our_writer_of_its_kind(tmp_path, kind):
    out = tmp_path / "out"
    ppe_writer = None if kind == "SimpleWriter" else getattr(ppe.writing, kind)(out_dir=str(out))
    manager, model = make_manager(str(out), writer=ppe_writer)  # None: ppe's default SimpleWriter(out_dir)
    ext = snapshot(n_retains=1)
    manager.extend(ext, trigger=(2, "iteration"))
    train(manager, model)  # the manager finalizes the extensions, then its own writer: neither raises
    assert type(ext.writer) is getattr(writing, kind)
    assert ext.writer.out_dir == str(out)
    assert listing(out) == ["snapshot_iter_4"]  # retention ran on our writer's saves
    saved = Snapshot(str(out / "snapshot_iter_4"))
    saved.verify()
    assert_same(saved.read_object("0/state/models/main"), model.state_dict())


def test_explicit_ppe_writer_is_stood_in_for_and_finalized(tmp_path):
    ppe_writer = ppe.writing.ThreadQueueWriter(out_dir=str(tmp_path))
    manager, model = make_manager(str(tmp_path / "logs"))
    ext = snapshot(writer=ppe_writer)
    manager.extend(ext, trigger=(4, "iteration"))
    train(manager, model)
    assert type(ext.writer) is writing.ThreadQueueWriter
    Snapshot(str(tmp_path / "snapshot_iter_4")).verify()
    assert ppe_writer._finalized and not ppe_writer._consumer.is_alive()  # its consumer thread was stopped


def test_savefun_selects_ppe_single_files_through_the_managers_writer(tmp_path):
    manager, model = make_manager(str(tmp_path))
    ext = snapshot(savefun=torch.save)
    manager.extend(ext, trigger=(4, "iteration"))
    train(manager, model)
    assert ext.writer is manager.writer  # ppe's own SimpleWriter, called as ppe calls it
    state = torch.load(tmp_path / "snapshot_iter_4", weights_only=False)
    assert state["_start_iteration"] == 4
    assert_same(state["models"]["main"], model.state_dict())


class _MyWriter(ppe.writing.SimpleWriter):
    """A user's own ppe writer: no stand-in for it."""


def _save_with_keyword(obj, f, tag=None):
    torch.save({**obj, "tag": tag}, f)


@pytest.mark.parametrize("make", [lambda out: _MyWriter(out_dir=out),
                                  lambda out: ppe.writing.SimpleWriter(_save_with_keyword, out_dir=out, tag="mine")],
                         ids=["subclass", "own_savefun"])
def test_other_ppe_writers_are_called_with_ppes_protocol(tmp_path, make):
    writer = make(str(tmp_path))
    manager, model = make_manager(str(tmp_path / "logs"))
    ext = snapshot(writer=writer, n_retains=1)
    manager.extend(ext, trigger=(2, "iteration"))
    train(manager, model)
    assert ext.writer is writer
    assert [n for n in listing(tmp_path) if n.startswith("snapshot")] == ["snapshot_iter_4"]  # retention ran
    saved = torch.load(tmp_path / "snapshot_iter_4", weights_only=False)  # one torch.save file
    assert saved["_start_iteration"] == 4
    assert saved.get("tag") == (None if isinstance(writer, _MyWriter) else "mine")


# -- the manager keys the extension's state as ppe's ------------------------------------------------------------


def test_the_manager_keys_the_default_snapshots_state_as_ppes(tmp_path):
    """The manager keys each extension's state by its default name: ppe's DEFAULT snapshot and ours share it, so
    each restores the other's manager state."""
    manager, _ = make_manager(str(tmp_path))
    manager.extend(snapshot())
    assert snapshot().default_name == ppe.training.extensions.snapshot().default_name == "_Snapshot"
    assert "_Snapshot" in manager.state_dict()["extensions"]


class _PlainOptimizer:
    """An optimizer of ppe's protocol only (state_dict / load_state_dict), no torch.optim.Optimizer: no step hooks."""

    def __init__(self):
        self.state = {"lr": 0.5}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


@pytest.mark.parametrize("writer", [None, "ThreadWriter"])
def test_an_optimizer_that_is_no_torch_optimizer_saves_and_resumes(tmp_path, writer):
    def manager():
        model = torch.nn.Linear(2, 2)
        return ppe.training.ExtensionsManager(model, _PlainOptimizer(), 100, iters_per_epoch=1,
                                             out_dir=str(tmp_path), stop_trigger=(3, "iteration")), model
    first, model = manager()
    kwargs = {} if writer is None else {"writer": getattr(writing, writer)(out_dir=str(tmp_path))}
    first.extend(snapshot(autoload=True, **kwargs), trigger=(1, "iteration"))
    first.optimizers["main"].state["lr"] = 0.25
    while not first.stop_trigger:
        with first.run_iteration():
            model(torch.ones(1, 2)).sum().backward()
    again, _ = manager()
    again.extend(snapshot(autoload=True), trigger=(1, "iteration"))
    again.start_extensions()
    assert again.iteration == 3 and again.optimizers["main"].state == {"lr": 0.25}


def test_manager_states_of_earlier_releases_restore_under_ppes_names():
    """Earlier releases keyed the DISTRIBUTED and SHARDED extensions' states by their own class names."""
    loaded = []

    class Manager:
        def load_state_dict(self, state):
            loaded.append(state)
    saved_state.load_into(Manager(), {"_start_iteration": 3, "extensions": {"ShardedSnapshot": {"a": 1},
                                                                            "DistributedSnapshot": {"b": 2}}})
    assert loaded[0]["extensions"] == {"ShardedSnapshot": {"a": 1}, "_ShardedSnapshot": {"a": 1},
                                       "DistributedSnapshot": {"b": 2}, "_DistributedSnapshot": {"b": 2}}


# -- initialize() returns the loaded name -------------------------------------------------------------------------


@pytest.mark.parametrize("filename, expected", [("snapshot_iter_{.iteration}", "snapshot_iter_4"),
                                                ("myfile.dat", "myfile.dat"),
                                                ("snaps/iter_{.iteration}", "snaps/iter_4")])
def test_initialize_returns_the_loaded_name_relative_to_out_dir(tmp_path, filename, expected):
    manager, model = make_manager(str(tmp_path))
    manager.extend(snapshot(filename=filename), trigger=(2, "iteration"))
    train(manager, model)

    fresh, _ = make_manager(str(tmp_path), seed=1)
    ext = snapshot(filename=filename, autoload=True)
    assert ext.initialize(fresh) == expected
    assert ext.resumed_from == join(str(tmp_path), expected)  # the full path
    assert fresh.iteration == 4

    assert snapshot(filename="other_{.iteration}", autoload=True).initialize(make_manager(str(tmp_path))[0]) is None
    assert snapshot(filename=filename).initialize(make_manager(str(tmp_path))[0]) is None  # autoload off


# -- a name without format fields is saved again at every trigger --------------------------------------------------


@pytest.mark.parametrize("writer", ["SimpleWriter", "ThreadWriter", "ProcessWriter"])
def test_fixed_name_is_replaced_at_every_trigger(tmp_path, writer):
    run = Run(str(tmp_path), 6, {"filename": "snapshot_latest", "writer": getattr(writing, writer)()},
              trigger=(1, "iteration"))
    run.train()
    run.snapshot.writer.finalize()
    assert listing(tmp_path) == ["log", "snapshot_latest"]  # nothing left beside it
    latest = Snapshot(str(tmp_path / "snapshot_latest"))
    latest.verify()
    assert latest.metadata["iteration"] == 6
    assert_same(latest.read_object("0/state/models/main"), run.model.state_dict())

    resumed = Run(str(tmp_path), 8, {"filename": "snapshot_latest", "autoload": True}, seed=1)
    assert resumed.snapshot.initialize(resumed.manager) == "snapshot_latest"
    assert resumed.manager.iteration == 6


def test_fixed_name_is_replaced_without_an_atomic_exchange(tmp_path, monkeypatch):
    from ppe_snapshot.storage import LocalTree
    monkeypatch.setattr(LocalTree, "swap", lambda self, a, b: False)  # a platform without renameat2
    run = Run(str(tmp_path), 3, {"filename": "latest"}, trigger=(1, "iteration"))
    run.train()
    assert listing(tmp_path) == ["latest", "log"]
    assert Snapshot(str(tmp_path / "latest")).metadata["iteration"] == 3


def test_callable_name_saved_twice_replaces_like_ppe(tmp_path):
    run = Run(str(tmp_path), 4, {"filename": lambda m: f"epoch_{m.epoch}"}, trigger=(1, "iteration"),
              iters_per_epoch=4)
    run.train()  # iterations 1..3 are all epoch 0
    assert listing(tmp_path) == ["epoch_0", "epoch_1", "log"]
    assert Snapshot(str(tmp_path / "epoch_0")).metadata["iteration"] == 3


def test_fixed_name_on_memory_url(tmp_path):
    url = f"memory://fixed-{uuid.uuid4().hex}/run"
    run = Run(str(tmp_path), 3, {"filename": "latest", "writer": writing.ThreadWriter(out_dir=url)},
              trigger=(1, "iteration"))
    run.train()
    run.snapshot.writer.finalize()
    names = [c.name for c in ppe_snapshot.retention.list_snapshots(url, "latest")]
    assert names == ["latest"] and Snapshot(f"{url}/latest").metadata["iteration"] == 3


def test_fixed_name_on_s3(tmp_path, s3_bucket):
    bucket, options = s3_bucket
    url = f"{bucket}/run"
    make = lambda: writing.SimpleWriter(out_dir=url, storage_options=options)  # noqa: E731
    Run(str(tmp_path), 3, {"filename": "latest", "writer": make()}, trigger=(1, "iteration")).train()
    found = ppe_snapshot.retention.list_snapshots(url, "latest", options)
    assert [c.name for c in found] == ["latest"]
    assert Snapshot(f"{url}/latest", storage_options=options).metadata["iteration"] == 3
    resumed = Run(str(tmp_path), 5, {"filename": "latest", "writer": make(), "autoload": True}, seed=1)
    assert resumed.snapshot.initialize(resumed.manager) == "latest" and resumed.manager.iteration == 3


def _take_latest(path: str, iteration: int) -> None:
    """An engine snapshot as the extension writes it, at ``iteration``, of the state of a Run trained that far."""
    run = Run(os.path.dirname(path) + "/scratch", iteration, {"filename": "unused"}, trigger=(1000, "iteration"))
    run.train()
    run.manager.start_extensions()
    writing.SimpleWriter()(os.path.basename(path), os.path.dirname(path), run.manager.state_dict(),
                           metadata={"iteration": iteration, "epoch": run.manager.epoch,
                                     "epoch_detail": run.manager.epoch_detail, "ppe_snapshot_target": "manager"})


@pytest.mark.parametrize("left", ["name_half_removed", "both_complete"])
def test_what_an_interrupted_replacement_leaves_is_recognised(tmp_path, left):
    """The two states a kill can leave mid-replacement (see tests/test_crash.py for real kills)."""
    out = tmp_path / "out"
    out.mkdir()
    _take_latest(str(out / "latest"), 2)
    _take_latest(str(out / f"latest{SIDE_SUFFIX}"), 3)  # the new one, complete, beside the name
    if left == "name_half_removed":
        (out / "latest" / "manifest.json").unlink()  # the old one was being removed (no exchange)
    resumed = Run(str(out), 5, {"filename": "latest", "autoload": True, "n_retains": 1}, seed=1,
                  trigger=(1, "iteration"))
    resumed.manager.start_extensions()
    assert resumed.snapshot.resumed_name == f"latest{SIDE_SUFFIX}"  # the newest complete one
    assert resumed.manager.iteration == 3
    resumed.train()  # the next save settles the leftovers
    assert sorted(n for n in listing(out) if n.startswith("latest")) == ["latest"]
    assert Snapshot(str(out / "latest")).metadata["iteration"] == 5


# -- errors as ppe users catch them ---------------------------------------------------------------------------------


def test_failed_snapshot_on_error_is_logged_not_warned(tmp_path, caplog):
    (tmp_path / "blocker").write_text("a file where the output directory should be")
    run = Run(str(tmp_path / "logs"), 10, {"writer": writing.SimpleWriter(out_dir=str(tmp_path / "blocker")),
                                          "snapshot_on_error": True}, trigger=(100, "iteration"))
    with warnings.catch_warnings(), caplog.at_level(logging.ERROR, logger="ppe_snapshot"):
        warnings.simplefilter("error")  # as test setups with -W error do
        with pytest.raises(Crash, match="after 3 iterations"):
            run.train(crash_at=3)
    assert "the snapshot on error failed: NotADirectoryError" in caplog.text


def test_background_failure_surfaces_as_runtime_error_at_the_next_snapshot(tmp_path):
    (tmp_path / "blocker").write_text("")
    run = Run(str(tmp_path / "logs"), 10, {"writer": writing.ThreadWriter(out_dir=str(tmp_path / "blocker"))},
              trigger=(1, "iteration"))
    with pytest.raises(RuntimeError) as raised:  # what code written for ppe's writers catches
        run.train()
    assert isinstance(raised.value, BackgroundSaveError) and isinstance(raised.value.__cause__, NotADirectoryError)
    assert "Traceback" in str(raised.value) and run.manager.iteration in (2, 3)
    run.snapshot.writer.finalize()


def test_background_failure_surfaces_as_runtime_error_at_finalize(tmp_path):
    (tmp_path / "blocker").write_text("")
    run = Run(str(tmp_path / "logs"), 2, {"writer": writing.ThreadWriter(out_dir=str(tmp_path / "blocker"))},
              trigger=(2, "iteration"))
    with pytest.raises(RuntimeError) as raised:
        run.train()  # the last save fails in the background; the manager's finalize reports it
    assert isinstance(raised.value.__cause__, NotADirectoryError)


# -- bad arguments are named -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["3", None, 2.5, True])
def test_n_retains_must_be_an_int(bad):
    with pytest.raises(TypeError, match="n_retains must be an int"):
        snapshot(n_retains=bad)


@pytest.mark.parametrize("bad", [object(), "ThreadWriter", writing.ThreadWriter, ppe.writing.SimpleWriter, 3])
def test_writer_must_be_a_writer_instance(bad):
    with pytest.raises(TypeError, match="writer must be a writer instance"):
        snapshot(writer=bad)


@pytest.mark.parametrize("bad", ["../x_{.iteration}", "/tmp/x_{.iteration}", "a/../../x", "s3://b/x", "C:/x"])
def test_filename_outside_out_dir_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="filename"):
        snapshot(filename=bad)
    with pytest.raises(ValueError, match="filename"):
        snapshot_object(torch.nn.Linear(1, 1), bad)


def test_names_inside_out_dir_are_accepted():
    for name in ("x:{.iteration}", "a/b/{.iteration}", "a..b_{.iteration}", "./x_{.iteration}"):
        snapshot(filename=name)


def test_callable_filename_outside_out_dir_is_refused_at_save(tmp_path):
    manager, _ = make_manager(str(tmp_path / "out"))
    ext = snapshot(filename=lambda m: "../escaped")
    with pytest.raises(ValueError, match="filename '../escaped' leads out of the output directory"):
        ext(manager)
    assert listing(tmp_path) == ["out"]


def test_ppe_style_mock_writer_is_accepted(tmp_path):
    class Recorder:
        def __init__(self):
            self.calls = []

        def __call__(self, filename, out_dir, target, *, savefun=None, append=False):
            self.calls.append(filename)

        def finalize(self):
            pass
    recorder = Recorder()
    manager, _ = make_manager(str(tmp_path / "unused"))
    ext = snapshot(writer=recorder, filename="snap_{.iteration}")
    ext(manager)
    assert recorder.calls == ["snap_0"]


# -- allow_pickle ---------------------------------------------------------------------------------------------


class Opaque:
    """A value only pickle can store."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value


class Holder:
    def __init__(self) -> None:
        self.obj = Opaque(0)

    def state_dict(self) -> dict:
        return {"obj": self.obj}

    def load_state_dict(self, state: dict) -> None:
        self.obj = state["obj"]


def test_allow_pickle_for_the_take_and_autoload(tmp_path):
    holder = Holder()
    manager, _ = make_manager(str(tmp_path))
    with pytest.raises(UnsupportedValueError, match="state/obj"):  # names the value's path
        snapshot_object(holder, "refused_{.iteration}")(manager)
    assert not (tmp_path / "refused_0").exists()

    holder.obj = Opaque(7)
    snapshot_object(holder, "h_{.iteration}", allow_pickle=True)(manager)
    restored = Holder()
    ext = snapshot_object(restored, "h_{.iteration}", autoload=True, allow_pickle=True)
    assert ext.initialize(make_manager(str(tmp_path))[0]) == "h_0"
    assert restored.obj == Opaque(7)

    # Without the opt-in, autoload refuses to unpickle (it would run code from the snapshot).
    untrusting = snapshot_object(Holder(), "h_{.iteration}", autoload=True)
    with pytest.warns(UserWarning, match="saved with pickle.*allow_pickle=True"), \
            pytest.raises(SnapshotError, match="allow_pickle=True"):
        untrusting.initialize(make_manager(str(tmp_path))[0])


def test_writer_allow_pickle(tmp_path):
    writer = writing.ThreadWriter(out_dir=str(tmp_path), allow_pickle=True)
    writer("w", "", {"obj": Opaque(3)})
    writer.finalize()
    assert Snapshot(str(tmp_path / "w"), allow_pickle=True).read_object("0/state/obj") == Opaque(3)
    with pytest.raises(TypeError, match="allow_pickle"):
        writing.SimpleWriter(allow_pickle="yes")


# -- autoload skips a malformed manifest --------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("metadata", ["not", "an", "object"]), ("version", 999),
                                          ("world_size", "1"), ("take_id", 5)])
def test_autoload_skips_a_malformed_manifest_and_training_goes_on(tmp_path, field, value):
    Run(str(tmp_path), 4, {}).train()  # snapshot_iter_2, snapshot_iter_4
    manifest = tmp_path / "snapshot_iter_4" / "manifest.json"
    data = json.loads(manifest.read_text())
    assert field in data
    data[field] = value
    manifest.write_text(json.dumps(data))
    resumed = Run(str(tmp_path), 6, {"autoload": True}, seed=1)
    with pytest.warns(UserWarning, match="snapshot_iter_4"):
        assert resumed.snapshot.initialize(resumed.manager) == "snapshot_iter_2"
    assert resumed.manager.iteration == 2
    resumed.train()  # and training goes on
    assert resumed.manager.iteration == 6


# -- imports ----------------------------------------------------------------------------------------------------


def test_import_alone_makes_the_subpackages_usable():
    code = ("import sys, ppe_snapshot\n"
            "assert 'pytorch_pfn_extras' not in sys.modules\n"  # the engine's users stay light
            "assert callable(ppe_snapshot.retention.list_snapshots)\n"
            "assert callable(ppe_snapshot.storage.open_storage)\n"
            "w = ppe_snapshot.writing.ThreadWriter(); w.finalize()\n"
            "print(ppe_snapshot.writing.ProcessWriter.__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ProcessWriter"


def test_the_writer_process_does_not_import_ppe():
    code = "import sys, ppe_snapshot.writing._worker; print('pytorch_pfn_extras' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_snapshot_on_error_replaces_an_older_snapshot_under_a_fixed_name(tmp_path, caplog):
    run = Run(str(tmp_path), 10, {"filename": "latest", "snapshot_on_error": True}, trigger=(4, "iteration"))
    with caplog.at_level(logging.INFO, logger="ppe_snapshot"), pytest.raises(Crash):
        run.train(crash_at=5)
    assert "training failed at iteration 5; saved snapshot" in caplog.text
    assert Snapshot(str(tmp_path / "latest")).metadata["iteration"] == 5  # not the one of iteration 4


def test_the_writer_contract_decides_what_a_writer_is_given(tmp_path):
    """Our writers are SnapshotWriters and get the engine keywords; ppe's are not; a writer of one's own that
    declares the contract (SnapshotWriter.register) gets them too and is read back for its stats."""
    ours = [getattr(writing, name)() for name in ("SimpleWriter", "ThreadWriter", "ThreadQueueWriter",
                                                    "ProcessWriter", "ProcessQueueWriter")]
    assert all(isinstance(w, writing.SnapshotWriter) for w in ours)
    for w in ours:
        w.finalize()
    assert not isinstance(ppe.writing.SimpleWriter(), writing.SnapshotWriter)

    class Recording(ppe.writing.Writer):
        allow_pickle, storage_options = False, None

        def __init__(self) -> None:
            super().__init__(out_dir=str(tmp_path))
            self.calls: list[dict] = []
            self.last_stats: dict = {}

        def __call__(self, filename, out_dir, target, **kwargs) -> None:
            self.calls.append(kwargs)
            self.last_stats = {"path": filename, "bytes": 7, "blocking_s": 0.5, "write_s": 0.25}

        def wait(self) -> None:
            pass

    writing.SnapshotWriter.register(Recording)
    manager, _ = make_manager(str(tmp_path))
    ext = snapshot(writer=Recording(), filename="snap_{.iteration}")
    ext(manager)
    (kwargs,) = ext.writer.calls
    assert sorted(kwargs) == ["allow_pickle", "extra_state", "metadata", "pg", "savefun"]
    assert kwargs["metadata"]["ppe_snapshot_target"] == "manager" and list(kwargs["extra_state"]) == ["rng"]
    # What it does not define, the contract's defaults give it: no incremental saves, no base, no last_save.
    recording = Recording()
    assert (recording.incremental, recording.base, recording.last_save) == (False, None, None)
    with pytest.raises(TypeError, match=r"incremental=True needs a ppe_snapshot writer .*got Recording"):
        snapshot(writer=recording, incremental=True)(manager)


def test_condition_and_any_callable_writer_as_in_ppe():
    """ppe's contract: ``condition()`` at every call, the writer called when it returns True, and the
    writer finalized with the extension; any writer object of ppe's protocol will do."""
    from unittest import mock
    target, condition, writer = mock.MagicMock(), mock.MagicMock(side_effect=[True, False]), mock.MagicMock()
    ext = snapshot(target=target, condition=condition, writer=writer)
    manager = mock.MagicMock()
    ext(manager)
    ext(manager)
    assert condition.call_count == 2 and writer.call_count == 1
    (name, out_dir, state), kwargs = writer.call_args
    assert state is target.state_dict.return_value and kwargs == {"savefun": None}
    ext.finalize(manager)
    assert writer.finalize.call_count == 1


def test_a_url_out_dir_leaves_nothing_local(tmp_path, monkeypatch):
    """ppe's manager makes its default writer's out_dir a local directory even for a URL (``./memory:/...``);
    the snapshot that stands in for that writer removes the empty stray, and saves to the URL."""
    monkeypatch.chdir(tmp_path)
    url = f"memory://{uuid.uuid4().hex}/run"
    model = torch.nn.Linear(2, 2)
    manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 1,
                                             iters_per_epoch=2, out_dir=url)
    manager.extend(snapshot(), trigger=(1, "iteration"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            pass
    assert os.listdir(tmp_path) == []
    Snapshot(join(url, "snapshot_iter_2")).verify()
