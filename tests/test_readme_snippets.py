"""Every Python snippet of the README, run as written: the names it says are the user's are filled in here, then
the snippet runs in a fresh directory and what it promises is checked (the preemption recipe has its own test,
tests/test_readme_preemption.py)."""
from __future__ import annotations

import pytest
import pytorch_pfn_extras as ppe
import torch

from _readme import python_blocks


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _run(code: str, **names) -> dict:
    namespace = {"torch": torch, "ppe": ppe, **names}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own snippet
    return namespace


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 2))


def _manager(model: torch.nn.Module, out_dir: str, epochs: int = 1, per_epoch: int = 10):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return ppe.training.ExtensionsManager(model, optimizer, epochs, iters_per_epoch=per_epoch, out_dir=out_dir)


def _train(manager, model: torch.nn.Module, per_epoch: int) -> None:
    optimizer = manager.optimizers["main"]
    while not manager.stop_trigger:
        for _ in range(per_epoch):
            with manager.run_iteration():
                optimizer.zero_grad()
                model(torch.ones(1, 4)).sum().backward()
                optimizer.step()


def test_quick_start_then_loading_outside_the_trainer(tmp_path):
    quick_start, = python_blocks("### In a pytorch-pfn-extras training loop")
    model = _model()
    loader = [torch.ones(1, 4)] * 1000
    names = _run(quick_start, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=2,
                 loader=loader)
    _train(names["manager"], model, len(loader))
    assert sorted(p.name for p in (tmp_path / "result").iterdir()) == ["snapshot_iter_1000", "snapshot_iter_2000"]

    loading, = python_blocks("### Loading a snapshot outside the trainer")
    names = _run(loading, build_model=_model)
    assert names["state"]["_start_iteration"] == 1000
    assert names["model"].state_dict().keys() == model.state_dict().keys()

    from ppe_snapshot.cli import main  # the command line's export of the model alone, loaded as the README says
    assert main(["convert", "--to", "safetensors", "--model", "main", "result/snapshot_iter_2000",
                 "model.safetensors"]) == 0
    exported, = python_blocks("### Command line")
    names = _run(exported, build_model=_model)
    for key, value in model.state_dict().items():
        assert torch.equal(names["model"].state_dict()[key], value), key


def test_keeping_snapshots(tmp_path):
    keeping = python_blocks("### Keeping snapshots")[0]
    model = _model()
    losses = iter([3.0, 1.0, 2.0, 4.0, 5.0, 6.0, 7.0])

    @ppe.training.extension.make_extension(priority=ppe.training.extension.PRIORITY_WRITER)
    def evaluator(manager):
        ppe.reporting.report({"val/loss": next(losses)})

    manager = _manager(model, "result", epochs=7, per_epoch=1000)
    _run(keeping, manager=manager, evaluator=evaluator, ppe_snapshot=__import__("ppe_snapshot"))
    _train(manager, model, 1000)
    # the 3 newest, the 2 best by val/loss (iterations 2000 and 3000), the first after iteration 0 (KeepEvery)
    assert sorted(p.name for p in (tmp_path / "result").iterdir()) == [
        f"snapshot_iter_{i}" for i in (1000, 2000, 3000, 5000, 6000, 7000)]


def test_incremental_snapshots(tmp_path):
    incremental, = python_blocks("### Incremental snapshots")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4096), torch.nn.Linear(4096, 2))
    model[0].requires_grad_(False)  # a frozen base: written once
    manager = _manager(model, "result", epochs=5, per_epoch=1000)
    _run(incremental, manager=manager, ppe_snapshot=__import__("ppe_snapshot"))
    _train(manager, model, 1000)
    from ppe_snapshot import Snapshot

    run = tmp_path / "result"
    # n_retains=3: the first snapshot is retired (its frozen bytes are read by the kept ones), the second removed
    assert sorted(p.name for p in run.iterdir()) == [f"snapshot_iter_{i}" for i in (1000, 3000, 4000, 5000)]
    assert not (run / "snapshot_iter_1000" / "manifest.json").exists()
    newest = Snapshot(str(run / "snapshot_iter_5000"))
    assert newest.references == ("snapshot_iter_1000",)
    entries = newest.get_manifest()
    assert [c.file for c in entries["0/state/models/main/0.weight"].chunks] == ["../snapshot_iter_1000/data/rank0.bin"]
    assert [c.file for c in entries["0/state/models/main/1.weight"].chunks] == ["data/rank0.bin"]  # trained
    saved = newest.read_object("0/state/models/main")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_the_local_tier(tmp_path):
    """The snippet's run killed (abandoned without finalize) after iteration 1150: the restart resumes from local
    step 1100, newer than the durable snapshot of iteration 1000, at the tier's default directory."""
    local, = python_blocks("### The local tier: snapshots in memory, a partner's copy, durable storage behind")
    ppe_snapshot = __import__("ppe_snapshot")
    tier = ppe_snapshot.LocalTier().resolved_directory(str(tmp_path / "result"))
    try:
        model = _model()
        manager = _manager(model, "result", epochs=1, per_epoch=1150)
        first = _run(local, manager=manager, ppe_snapshot=ppe_snapshot)["extension"]
        _train(manager, model, 1150)
        first._local.saves.finish()  # the steps in flight end, as they would in the background of a live run
        assert sorted(p.name for p in (tmp_path / "result").iterdir()) == ["snapshot_iter_1000"]
        again = _model()
        manager = _manager(again, "result", epochs=1, per_epoch=1200)
        second = _run(local, manager=manager, ppe_snapshot=ppe_snapshot)["extension"]
        with manager.run_iteration():
            pass
        assert second.resumed_from == f"{tier}/step_1100/rank0"
        assert manager.iteration == 1101
        saved = ppe_snapshot.Snapshot(second.resumed_from).read_object("0/state/models/main")
        assert saved.keys() == again.state_dict().keys()
        assert all(torch.equal(saved[k], v) for k, v in again.state_dict().items())
        assert not all(torch.equal(saved[k], v) for k, v in model.state_dict().items())  # trained 50 more
    finally:
        import os
        import shutil
        shutil.rmtree(tier, ignore_errors=True)
        try:  # the user's folder of tiers, where no other run has one
            os.rmdir(os.path.dirname(tier))
        except OSError:
            pass


def test_migrating_from_ppe_resumes_from_ppes_snapshot(tmp_path):
    migrating = python_blocks("### Migrating from ppe")[0]
    before, after = migrating.split("# after")
    first = _model()
    manager = _manager(first, "result")
    _run(before, manager=manager)
    _train(manager, first, 10)
    assert (tmp_path / "result" / "snapshot_iter_10").is_file()  # ppe's single file

    second = _model()
    manager = _manager(second, "result", epochs=2)
    _run(after, manager=manager)
    manager.start_extensions()
    assert manager.iteration == 10
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


def test_keeping_ppes_single_files(tmp_path):
    single_files = python_blocks("### Migrating from ppe")[1]
    model = _model()
    manager = _manager(model, "result")
    _run(single_files, manager=manager, ppe_snapshot=__import__("ppe_snapshot"))
    _train(manager, model, 10)
    state = torch.load(tmp_path / "result" / "snapshot_iter_10", weights_only=True)
    assert torch.equal(state["models"]["main"]["0.weight"], model[0].weight)


def test_the_engine(s3_endpoint):
    import boto3  # (here: s3_endpoint has skipped this test where the S3 test stack is missing)

    engine, = python_blocks("### The engine")
    boto3.client("s3", region_name="us-east-1", **s3_endpoint).create_bucket(Bucket="bucket")
    model = _model()
    storage_options = {"client_kwargs": s3_endpoint, "key": "testing", "secret": "testing"}
    names = _run(engine, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=100,
                 storage_options=storage_options)
    assert torch.equal(names["weight"], model[0].weight)
    assert names["Snapshot"]("s3://bucket/run1/step100", storage_options=storage_options).metadata == {}
    assert "0/extra/step" in names["Snapshot"]("ckpt/step200").get_manifest()


@pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable)")
def test_the_dcp_adapter():
    adapter, = python_blocks("### torch.distributed.checkpoint")
    saved = {"weight": torch.arange(6.0).reshape(2, 3)}
    state_dict = {"weight": saved["weight"].clone()}
    _run(adapter, state_dict=state_dict)
    assert torch.equal(state_dict["weight"], saved["weight"])
