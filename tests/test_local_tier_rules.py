"""The local tier's rules that need no second process: its arguments, its triggers, partners, the choice of step,
what the durable snapshots' names settle, the reuse of a retired part's data file."""
from __future__ import annotations

import os
from typing import Any

import pytest
import pytorch_pfn_extras as ppe
import torch

import ppe_snapshot
from ppe_snapshot import LocalTier, run_dir
from ppe_snapshot.engine import LOCAL, Snapshot, StateDict
from ppe_snapshot.local_tier import check_triggers, layout, partners, wards
from ppe_snapshot.local_tier.recovery import Settled, choose, settled, settled_by_names, usable
from ppe_snapshot.storage import UnchangedFiles, open_tree
from ppe_snapshot.storage.local import open_blob_writer


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="n_retains=0"):
        LocalTier(n_retains=0)
    with pytest.raises(ValueError, match="partners=2"):
        LocalTier(partners=2)
    with pytest.raises(ValueError, match="period > 0"):
        LocalTier(trigger=(0, "iteration"))
    with pytest.raises(ValueError, match="whole number"):
        LocalTier(trigger=(1.5, "iteration"))
    with pytest.raises(ValueError, match="verify='never'"):
        LocalTier(verify="never")
    with pytest.raises(TypeError, match="LocalTier or a dict"):
        ppe_snapshot.snapshot(local="/dev/shm/x")
    with pytest.raises(ValueError, match="savefun"):
        ppe_snapshot.snapshot(savefun=torch.save, local=LocalTier())
    assert ppe_snapshot.snapshot(local={"n_retains": 3}).local_tier == LocalTier(n_retains=3)


class _Interval:
    def __init__(self, period, unit):
        self.period, self.unit = period, unit


@pytest.mark.parametrize("local, durable, iters_per_epoch", [
    ((4, "iteration"), (8, "iteration"), None),
    ((1, "iteration"), (1, "epoch"), 10),
    ((0.5, "epoch"), (2, "epoch"), 10),
])
def test_a_local_trigger_more_frequent_and_dividing_is_accepted(local, durable, iters_per_epoch):
    check_triggers(local, _Interval(*durable), iters_per_epoch)


@pytest.mark.parametrize("local, durable, why", [
    ((8, "iteration"), (8, "iteration"), "more frequent"),
    ((3, "iteration"), (8, "iteration"), "divide"),
    ((16, "iteration"), (8, "iteration"), "more frequent"),
    ((3, "iteration"), (1, "epoch"), "divide"),
])
def test_a_local_trigger_that_does_not_fit_is_refused(local, durable, why):
    with pytest.raises(ValueError, match=why):
        check_triggers(local, _Interval(*durable), 10)


def test_a_trigger_that_is_no_interval_is_refused():
    with pytest.raises(ValueError, match="not an interval"):
        check_triggers((1, "iteration"), lambda manager: True, 10)


def test_the_extension_refuses_a_local_trigger_that_does_not_divide_its_own(tmp_path):
    model = torch.nn.Linear(2, 2)
    manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=1,
                                             iters_per_epoch=10, out_dir=str(tmp_path))
    manager.extend(ppe_snapshot.snapshot(local=LocalTier(directory=str(tmp_path / "local"), trigger=(3, "iteration"))),
                   trigger=(5, "iteration"))
    with pytest.raises(ValueError, match=r"\(3, 'iteration'\).*divide"):
        with manager.run_iteration():
            pass


def test_partners_form_a_ring_over_the_nodes():
    assert partners(["a", "a", "b", "b"]) == {0: 2, 1: 3, 2: 0, 3: 1}
    assert partners(["a", "a", "a"]) == {}
    ring = partners(["a", "b", "c"])
    assert ring == {0: 1, 1: 2, 2: 0}
    uneven = partners(["a", "a", "b"])
    assert uneven == {0: 2, 1: 2, 2: 0}
    assert wards(uneven, 2) == [0, 1] and wards(uneven, 0) == [2]
    assert all(n != m for (r, p) in partners(["a", "b", "a", "b"]).items() for n, m in [("ab"[r % 2], "ab"[p % 2])])


def test_the_newest_step_every_rank_can_restore_is_chosen():
    held = [{"own": [2, 4], "copies": {"2": [2, 4]}}, {"own": [2, 4], "copies": {"3": [2, 4]}},
            {"own": [2], "copies": {"0": [2, 4]}}, {"own": [], "copies": {"1": [2, 4]}}]
    # Rank 2 lacks step 4 and rank 3 every step: their partners (0 and 1) hold copies.
    # Ranks 0 and 1 restore their own parts; rank 2 and 3 hold copies of them, spares should those fail.
    assert choose(held, 4) == {"step": 4, "fetch": {"2": 0, "3": 1}, "spare": {"0": 2, "1": 3}}
    assert usable(choose(held, 4), 3) and not usable(choose(held, 4), 4)  # not newer than the durable snapshot
    held[0]["copies"] = {"2": [2]}
    assert choose(held, 4) == {"step": 2, "fetch": {"3": 1}, "spare": {"0": 2, "1": 3, "2": 0}}
    held[1]["copies"] = {}
    assert choose(held, 4) is None


def test_durable_names_settle_a_restart_only_when_the_local_step_is_newer_than_all():
    plan = {"step": 10, "fetch": {}, "spare": {}}
    seen = [{"own": [10], "named": {"newest": 8, "complete": True}}, {"own": [10], "named": {"newest": 9,
                                                                                          "complete": False}}]
    assert settled_by_names(seen) == {"newest": 9, "complete": False}  # every rank's newest; complete on all
    assert settled(plan, settled_by_names(seen)) == Settled(None)  # no rank-wide fallback: parts checked first
    seen[1]["named"]["complete"] = True
    assert settled(plan, settled_by_names(seen)) == Settled(9)
    seen[1]["named"]["newest"] = 10  # a durable name at the step (complete or not): they must be listed
    assert settled(plan, settled_by_names(seen)) is None
    seen[1]["named"] = None  # a rank that could not tell
    assert settled_by_names(seen) is None and settled(plan, None) is None
    assert settled(None, {"newest": None, "complete": False}) is None  # no step to restore
    assert settled(plan, {"newest": None, "complete": False}) == Settled(None)  # no durable name at all


def test_named_positions_come_from_the_names_and_one_existence_check(tmp_path):
    fmt = "snapshot_iter_{.iteration}"
    assert run_dir.named_positions(str(tmp_path), fmt) == run_dir.NamedPositions(None, False)
    (tmp_path / "snapshot_iter_12").mkdir()  # a save in progress: no manifest
    (tmp_path / "other_3").mkdir()
    assert run_dir.named_positions(str(tmp_path), fmt) == run_dir.NamedPositions(12, False)
    (tmp_path / "snapshot_iter_4").mkdir()
    (tmp_path / "snapshot_iter_4" / "manifest.json").write_text("not read")
    assert run_dir.named_positions(str(tmp_path), fmt) == run_dir.NamedPositions(12, True)
    (tmp_path / "snapshot_iter_4").rename(tmp_path / "snapshot_iter_x4")  # no longer a match
    (tmp_path / "snapshot_iter_2").write_bytes(b"")  # a single-file snapshot counts as complete
    assert run_dir.named_positions(str(tmp_path), fmt) == run_dir.NamedPositions(12, True)
    assert run_dir.named_positions(str(tmp_path), "snapshot_epoch_{.epoch}") == run_dir.NamedPositions(None, False)
    (tmp_path / "snapshot_epoch_1").mkdir()
    assert run_dir.named_positions(str(tmp_path), "snapshot_epoch_{.epoch}") is None  # the names tell no iteration


def _run(tmp_path, epochs: int, iterations: int, verify: str = "changed") -> tuple[Any, Any, torch.nn.Module]:
    """A DEFAULT-mode run of ``iterations`` iterations at most (10 per epoch; durable snapshots every 8 iterations,
    local steps every 2), autoloading; each iteration adds 1 to the weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=epochs,
                                             iters_per_epoch=10, out_dir=str(tmp_path / "out"))
    extension = ppe_snapshot.snapshot(autoload=True, local=LocalTier(directory=str(tmp_path / "local"),
                                                                     trigger=(2, "iteration"), verify=verify))
    manager.extend(extension, trigger=(8, "iteration"))
    for _ in range(iterations):
        if manager.stop_trigger:
            break
        with manager.run_iteration(), torch.no_grad():
            model.weight += 1.0
    return manager, extension, model


def test_a_local_step_newer_than_every_durable_name_is_restored_without_opening_them(tmp_path, monkeypatch):
    """The names under the output directory show local step 10 newer than every durable snapshot: none is
    opened. A durable name at 12 (a save in progress) leaves it open: the snapshots are listed and checked, and
    step 10 is still the newest complete one."""
    opened: list[str] = []
    classify = run_dir.listing._classify
    monkeypatch.setattr(run_dir.listing, "_classify", lambda tree, out_dir, rel, *more: (
        opened.append(rel), classify(tree, out_dir, rel, *more))[1])
    _, _, model = _run(tmp_path, 1, 10)  # durable snapshot 8, local steps to 10
    want = model.weight.detach().clone()
    assert sorted(os.listdir(tmp_path / "out")) == ["snapshot_iter_8"]
    for listed in ([], ["snapshot_iter_12", "snapshot_iter_8"]):
        opened.clear()
        manager, extension, model = _run(tmp_path, 2, 1)
        assert manager.iteration == 11 and extension.resumed_from == str(tmp_path / "local" / "step_10" / "rank0")
        assert torch.equal(model.weight.detach(), want + 1.0)
        assert sorted(opened) == listed
        (tmp_path / "out" / "snapshot_iter_12").mkdir(exist_ok=True)  # for the second pass


def test_the_tiers_staging_is_made_ready_at_start_and_after_the_first_optimizer_step(tmp_path, monkeypatch):
    """The local tier's own staging buffer, like a writer's: made ready at initialize() for the model (Adam has no
    state yet) and after the first optimizer step for the model and Adam's state; the first local step stages into
    that buffer, which fits, and restores bit-exact."""
    from ppe_snapshot.local_tier import LocalSaves
    asked: list[int] = []
    prepare = LocalSaves.prepare_staging
    monkeypatch.setattr(LocalSaves, "prepare_staging", lambda self, state: (
        asked.append(sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(state)
                         if isinstance(t, torch.Tensor))), prepare(self, state))[1])
    model = torch.nn.Linear(2048, 1024)
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=4, out_dir=str(tmp_path / "out"))
    extension = ppe_snapshot.snapshot(local=LocalTier(directory=str(tmp_path / "local"), trigger=(2, "iteration")))
    manager.extend(extension, trigger=(4, "iteration"))
    x = torch.randn(4, 2048)
    for _ in range(2):
        with manager.run_iteration():
            model(x).sum().backward()
            optimizer.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    saves = extension._local.saves
    saves.finish()
    weights = (2048 * 1024 + 1024) * 4
    assert asked == [weights, 3 * weights + 8]  # Adam: exp_avg, exp_avg_sq and a 4-byte step per tensor
    assert saves._buffers.all[0].numel() >= 3 * weights
    got = Snapshot(str(tmp_path / "local" / "step_2" / "rank0"), pg=LOCAL).read_object("0/state/models/main")
    assert all(torch.equal(got[k], v) for k, v in want.items())


def _take_part(tmp_path, step: int, numel: int) -> tuple[dict[str, torch.Tensor], str]:
    state = {"w": torch.arange(numel, dtype=torch.float32) + step}
    part = layout.own_part(step, 0)
    Snapshot.take(str(tmp_path / part), {"s": StateDict(state)}, pg=LOCAL)
    return state, part


def test_a_retired_parts_data_file_is_written_over_by_the_next_part_of_its_slot(tmp_path):
    """Retention keeps a retired part's data file as its slot's spare; the next part of the slot is written into
    that same file (its memory pages reused, not freed and allocated again), cut to its own size, and restores
    bit-exact; the spare is never a step."""
    tree = open_tree(str(tmp_path))
    _, old = _take_part(tmp_path, 2, 1 << 16)
    layout.write_marker(tree, old, {"step": 2, "world_size": 1, "rank": 0})
    inode = os.stat(tmp_path / old / "data" / "rank0.bin").st_ino
    _, kept = _take_part(tmp_path, 4, 1 << 16)
    layout.write_marker(tree, kept, {"step": 4, "world_size": 1, "rank": 0})
    layout.prune_parts(tree, 0, [], keep=1)
    assert layout.steps(tree) == [4] and os.stat(tmp_path / ".spare-rank0.bin").st_ino == inode
    new = layout.own_part(6, 0)
    layout.reuse_spare(tree, new)
    state, _ = _take_part(tmp_path, 6, 1000)  # smaller than the file it is written into
    assert not (tmp_path / ".spare-rank0.bin").exists()
    data = tmp_path / new / "data" / "rank0.bin"
    assert os.stat(data).st_ino == inode and os.path.getsize(data) < 1 << 18
    got = {"w": torch.zeros(1000)}
    Snapshot(str(tmp_path / new), pg=LOCAL).restore({"s": StateDict(got)})
    assert torch.equal(got["w"], state["w"])
    assert layout.steps(tree) == [4, 6] and [row["step"] for row in layout.inventory(tree)] == [4, 6]


def test_a_file_written_again_is_cut_to_its_new_size_not_emptied(tmp_path):
    """What lets a spare's pages be reused: a writer opened over an existing file keeps the bytes below the new
    size (written over in place) and drops the rest."""
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * 8192)
    writer = open_blob_writer(str(path), 4096)
    assert path.read_bytes() == b"x" * 4096
    writer.write([memoryview(b"y" * 4096)])
    writer.close()
    assert path.read_bytes() == b"y" * 4096


@pytest.mark.parametrize("verify", ["changed", "always"])
def test_an_own_part_is_checked_only_where_its_files_changed_unless_asked_always(tmp_path, monkeypatch, verify):
    """A DEFAULT-mode restart from local step 10: the part's marker records its files, and the restore reads it
    unhashed (an ``UnchangedFiles``) while they are unchanged; a byte of it changed, the restore checks it, finds it
    damaged and falls back to durable snapshot 8. ``verify="always"``: no record, every restore checks."""
    from ppe_snapshot.extension import saved_state
    restored: list[Any] = []
    restore_part = saved_state.restore_part
    monkeypatch.setattr(saved_state, "restore_part", lambda source, *more: (
        restored.append(source), restore_part(source, *more))[1])
    _, extension, _ = _run(tmp_path, 1, 10, verify)
    extension._local.saves.finish()
    marker = layout.read_marker(open_tree(str(tmp_path / "local")), layout.own_part(10, 0))
    assert ("files" in marker) == (verify == "changed")
    manager, extension, _ = _run(tmp_path, 2, 1, verify)
    assert manager.iteration == 11 and type(restored[-1]) is (UnchangedFiles if verify == "changed" else str)
    extension._local.saves.finish()
    data = tmp_path / "local" / "step_10" / "rank0" / "data" / "rank0.bin"
    with open(data, "r+b") as f:
        f.seek(8)
        f.write(b"\xff")
    manager, extension, _ = _run(tmp_path, 2, 1, verify)
    assert type(restored[-1]) is str and manager.iteration == 9
    assert extension.resumed_from == str(tmp_path / "out" / "snapshot_iter_8")
