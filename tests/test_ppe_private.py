"""The private names of pytorch_pfn_extras that ``ppe_snapshot.ppe_private`` relies on, checked against the
installed ppe: a ppe release that renames one fails here, naming it, instead of somewhere in a training loop."""
from __future__ import annotations

import pytorch_pfn_extras as ppe
import torch
from pytorch_pfn_extras import writing as ppe_writing

from ppe_snapshot import ppe_private


def test_the_installed_ppe_is_one_the_private_names_were_checked_against():
    installed = ".".join(ppe.__version__.split(".")[:2])
    assert installed in ppe_private.TESTED_PPE, (
        f"pytorch_pfn_extras {ppe.__version__} is not among the versions ppe_snapshot/ppe_private.py was checked "
        f"against {ppe_private.TESTED_PPE}: check every name its docstring lists against this ppe, then add it")


def test_writers_keep_their_private_names(tmp_path):
    writer = ppe_writing.SimpleWriter(out_dir=str(tmp_path))
    seen = []
    assert ppe_private.takes_cleanup_hooks(writer)
    ppe_private.add_cleanup_hook(writer, lambda: seen.append("hook"))
    writer("a.pt", str(tmp_path), {"x": torch.ones(1)})  # ppe runs its hooks after each save ...
    ppe_private.run_cleanup_hooks(writer)  # ... and so do we
    assert seen == ["hook", "hook"]
    assert ppe_private.savefun_and_keywords(writer) == (torch.save, {})
    assert ppe_private.is_ppe_default_fs(writer.fs) and type(writer.fs).__name__ == "_PosixFileSystem"

    thread = ppe_writing.ThreadWriter(out_dir=str(tmp_path), tag="x")
    assert ppe_private.savefun_and_keywords(thread) == (torch.save, {"tag": "x"})
    assert ppe_private.never_ran(thread)
    ppe_private.mark_finalized(thread)
    thread.finalize()  # would raise "worker is not created" unless marked

    queued = ppe_writing.ThreadQueueWriter(out_dir=str(tmp_path))
    try:
        assert type(ppe_private.queue_task(queued)) is ppe_writing.SimpleWriter
    finally:
        queued.finalize()


def test_the_manager_keeps_its_private_names(tmp_path):
    model = torch.nn.Linear(2, 2)
    manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 1,
                                             iters_per_epoch=1, out_dir=str(tmp_path))
    assert ppe_private.running_extensions(manager) is None  # not started yet
    manager.extend(lambda m: None, name="noop", trigger=(1, "iteration"))
    assert [name for name, _ in ppe_private.extension_entries(manager)] == ["noop"]  # registered
    manager.start_extensions()
    running = ppe_private.running_extensions(manager)
    assert [name for name, _ in running] == ["noop"]
    ppe_private.set_running_extensions(manager, [])
    assert ppe_private.running_extensions(manager) == []
    assert hasattr(manager, "_model_available")
    assert list(ppe_private.extension_states(manager.state_dict())) == ["noop"]
    manager._model_available = False  # what ppe sets when no extension needing the models is due
    with ppe_private.models_available(manager):
        assert manager._model_available is True
    assert manager._model_available is False
