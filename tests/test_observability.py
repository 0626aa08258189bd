"""What the training loop shows an operator: snapshot stats in LogReport / PrintReport at their default
priorities, one logger hierarchy without doubled prefixes, what autoload resumed from, the commit time and
versions in the manifest."""
from __future__ import annotations

import io
import json
import logging
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from pytorch_pfn_extras.training import extensions

import ppe_snapshot
from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.engine import read_manifest
from ppe_snapshot.storage import open_storage

import _warm
from _extension_workers import Run, make_writer

ROOT = Path(__file__).resolve().parent.parent


def test_stats_reach_log_report_and_print_report_at_default_priorities(tmp_path):
    run = Run(str(tmp_path), 4, {"writer": make_writer("SimpleWriter")}, trigger=(1, "iteration"))
    printed = io.StringIO()
    run.manager.extend(extensions.PrintReport(["iteration", "snapshot/bytes"], out=printed))
    run.train()
    log = run.log_report.log
    size = os.path.getsize(tmp_path / "snapshot_iter_4" / "data" / "rank0.bin")
    # LogReport runs before the snapshot in an iteration: a save's stats are in the next iteration's report
    assert "snapshot/bytes" not in log[0]
    assert [entry["snapshot/bytes"] for entry in log[1:]] == [size] * 3
    assert all(entry["snapshot/blocking_s"] >= 0 and entry["snapshot/write_s"] >= 0 for entry in log[1:])
    lines = printed.getvalue().splitlines()
    assert any(line.replace("\x1b[J", "").split() == ["2", str(size)] for line in lines), lines


def test_stats_of_an_async_write_arrive_once_it_ended(tmp_path):
    run = Run(str(tmp_path), 4, {"writer": make_writer("ThreadWriter")}, trigger=(2, "iteration"))
    run.train()
    run.snapshot.writer.finalize()
    log = run.log_report.log
    assert [("snapshot/bytes" in e) for e in log] == [False, False, True, False]
    assert sum("snapshot/write_s" in e for e in log) <= 1  # reported once, when known


def test_one_logger_hierarchy_and_what_autoload_resumed_from(tmp_path, caplog):
    first = Run(str(tmp_path), 4, {"n_retains": 1}, trigger=(2, "iteration"))
    first.train()
    (tmp_path / "snapshot_iter_6" / "data").mkdir(parents=True)  # a crashed save's leftover, newer
    with caplog.at_level(logging.INFO, logger="ppe_snapshot"), pytest.warns(UserWarning, match="snapshot_iter_6"):
        resumed = Run(str(tmp_path), 4, {"autoload": True}, trigger=(2, "iteration"))
        resumed.manager.start_extensions()
    records = [r for r in caplog.records if r.name.startswith("ppe_snapshot")]
    assert records and all(r.name.startswith("ppe_snapshot.") for r in records)
    assert not any(r.getMessage().startswith("ppe_snapshot") for r in records)
    skipped = [r for r in records if r.levelno == logging.WARNING and "snapshot_iter_6" in r.getMessage()]
    resumed_from = [r for r in records if r.levelno == logging.INFO and "resumed from" in r.getMessage()]
    assert len(skipped) == 1 and "no manifest.json" in skipped[0].getMessage()
    assert len(resumed_from) == 1 and str(tmp_path / "snapshot_iter_4") in resumed_from[0].getMessage()


def test_a_failed_snapshot_on_error_is_not_logged_as_saved(tmp_path, caplog):
    from ppe_snapshot.writing._runners import ThreadPerSave

    class DiskGone(ThreadPerSave):
        def run(self, work, on_done):
            raise OSError("disk gone")

    class Broken(ppe_snapshot.writing.ThreadWriter):
        _runner_type = DiskGone

    run = Run(str(tmp_path), 10, {"writer": Broken(), "snapshot_on_error": True}, trigger=(100, "iteration"))

    def failing(manager):
        if manager.iteration == 3:
            raise KeyError("from training")
    run.manager.extend(failing, trigger=(1, "iteration"))
    with caplog.at_level(logging.INFO, logger="ppe_snapshot"), pytest.raises(KeyError, match="from training"):
        run.train()
    messages = [r.getMessage() for r in caplog.records]
    assert not any("saved snapshot" in m for m in messages), messages
    assert any("the snapshot on error failed" in m for m in messages)


def test_manifest_records_commit_time_and_versions_and_old_manifests_read(tmp_path):
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(x=torch.ones(2))})
    doc = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert doc["committed_at"].endswith("+00:00")
    assert doc["written_by"] == {"ppe_snapshot": doc["written_by"]["ppe_snapshot"], "torch": torch.__version__}
    manifest = read_manifest(open_storage(str(tmp_path / "s")))
    assert manifest.committed_at == doc["committed_at"] and manifest.written_by == doc["written_by"]
    for key in ("committed_at", "written_by"):  # a snapshot written before these were recorded
        del doc[key]
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(doc))
    old = read_manifest(open_storage(str(tmp_path / "s")))
    assert old.committed_at is None and old.written_by == {}
    Snapshot(str(tmp_path / "s")).verify()
    assert torch.equal(Snapshot(str(tmp_path / "s")).read_object("0/s/x"), torch.ones(2))


def test_an_autoload_skip_is_printed_once(tmp_path):
    """Logged at WARNING; the AutoloadSkipWarning beside it is ignored unless asked for, so stderr has one line."""
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(f"""
        import os, torch, pytorch_pfn_extras as ppe
        import ppe_snapshot

        def manager(autoload):
            model = torch.nn.Linear(4, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=4, out_dir={str(tmp_path)!r})
            manager.extend(ppe_snapshot.snapshot(autoload=autoload), trigger=(2, "iteration"))
            return manager

        first = manager(False)
        while not first.stop_trigger:
            with first.run_iteration():
                pass
        os.makedirs({str(tmp_path / "snapshot_iter_6" / "data")!r})  # a crashed save's leftover, newer
        resumed = manager(True)
        resumed.start_extensions()
        print("resumed at", resumed.iteration)
    """))
    done = _warm.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "resumed at 4"
    assert done.stderr.count("snapshot_iter_6") == 1, done.stderr
    assert "no manifest.json" in done.stderr
