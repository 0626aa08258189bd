"""Retention policies (ppe_snapshot.retention): KeepLatest, KeepEvery, KeepBest, unions, a user's own policy;
pruning with them over real snapshot directories, damaged ones among the candidates, on local disk and fsspec."""
from __future__ import annotations

import uuid
import warnings

import fsspec
import pytest
import torch

from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.retention import (
    METRICS_KEY, Candidate, KeepBest, KeepEvery, KeepLatest, Policy, Union, list_snapshots, prune, select_prunable,
)
from ppe_snapshot.storage import join

FMT = "snapshot_iter_{.iteration}"


def _c(iteration: int, kind: str = "snapshot", epoch: float | None = None, **metrics: float) -> Candidate:
    name = f"s{iteration}"
    return Candidate(name, name, kind, iteration, epoch, metrics={k.replace("_", "/"): v for k, v in metrics.items()})


def _names(candidates) -> list[str]:
    return [c.name for c in candidates]


def test_keep_latest_and_keep_every_by_iteration():
    snaps = [_c(i) for i in (100, 200, 300, 450, 500, 600, 1000, 1100)]
    assert KeepLatest(2).keep(snaps) == {"s1000", "s1100"}
    # the snapshot at each multiple of 500, or the first one after it when none was taken exactly there
    assert KeepEvery(500).keep(snaps) == {"s100", "s500", "s1000"}
    assert KeepEvery(400).keep([_c(i) for i in (300, 450, 500, 900)]) == {"s300", "s450", "s900"}


def test_keep_every_by_epoch_uses_the_epoch_detail():
    snaps = [_c(i, epoch=i / 10) for i in (5, 10, 15, 20, 25, 31, 40)]
    assert KeepEvery(2, unit="epoch").keep(snaps) == {"s5", "s20", "s40"}
    assert KeepEvery(2, unit="epoch").keep([_c(1)]) == set()  # no epoch recorded: no milestone


def test_keep_best_min_max_ties_and_missing_values_warn_once():
    snaps = [_c(1, val_loss=0.5), _c(2, val_loss=0.2), _c(3), _c(4, val_loss=0.2), _c(5, val_loss=0.9)]
    best = KeepBest("val/loss")
    with pytest.warns(UserWarning, match=r"1 snapshot\(s\) have no recorded value of 'val/loss' \(e.g. s3\)"):
        assert best.keep(snaps) == {"s4"}  # a tie goes to the newer one
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per policy
        assert best.keep(snaps) == {"s4"}
        assert KeepBest("val/loss", n=3, mode="max").keep(snaps[:2] + snaps[3:]) == {"s5", "s1", "s4"}
    assert KeepBest("val/loss").recorded_keys == ("val/loss",)


def test_union_keeps_what_any_keeps_and_flattens():
    snaps = [_c(i, val_loss=float(10 - i)) for i in range(1, 8)] + [_c(8, val_loss=20.0)]
    policy = KeepLatest(1) | KeepEvery(4) | KeepBest("val/loss", n=2)
    assert isinstance(policy, Union) and len(policy.policies) == 3
    assert policy.keep(snaps) == {"s8", "s1", "s4", "s7", "s6"}
    assert policy.recorded_keys == ("val/loss",)
    assert KeepLatest(2) | KeepLatest(2) == Union(KeepLatest(2), KeepLatest(2))
    assert repr(policy) == ("KeepLatest(n=1) | KeepEvery(n=4, unit='iteration') | "
                            "KeepBest(key='val/loss', n=2, mode='min')")


@pytest.mark.parametrize("make, fragment", [
    (lambda: KeepLatest(0), "KeepLatest(n): n must be a positive int"),
    (lambda: KeepEvery(2, unit="step"), "must be 'iteration' or 'epoch'"),
    (lambda: KeepBest("x", mode="lowest"), "must be 'min' or 'max'"),
    (lambda: KeepBest(""), "non-empty str"),
])
def test_bad_policy_arguments(make, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_policy_or_something_else_and_bad_keep_are_type_errors():
    with pytest.raises(TypeError):
        KeepLatest(1) | 3  # noqa: B018
    with pytest.raises(TypeError, match="retention takes an int .* or a policy"):
        select_prunable([_c(1)], "latest")


def test_select_prunable_never_removes_the_newest_nor_protected_nor_busy_and_damaged_never_count():
    cands = [_c(1, val_loss=0.1), _c(2, "damaged"), _c(3, val_loss=0.5), _c(4, val_loss=0.4),
             Candidate("i5", "i5", "incomplete", 5, None, busy=True), _c(6, "damaged"), _c(7, val_loss=0.9),
             Candidate("i8", "i8", "incomplete", 8, None)]
    # a policy keeping nothing still keeps the newest complete one (s7) and anything newer than it
    class KeepNone(Policy):
        def keep(self, snapshots):
            return set()
    assert _names(select_prunable(cands, KeepNone())) == ["s1", "s2", "s3", "s4", "s6"]
    assert _names(select_prunable(cands, KeepBest("val/loss"))) == ["s2", "s3", "s4", "s6"]
    # a damaged snapshot never counts as kept: KeepLatest(2) keeps s4 and s7, not s6
    assert _names(select_prunable(cands, KeepLatest(2))) == ["s1", "s2", "s3", "s6"]
    # rejected by autoload: as damaged; a protected name (resumed from) stays while it is the newest complete
    assert _names(select_prunable(cands, KeepLatest(1), rejected={"s7"}, protect={"s4"})) == ["s1", "s2", "s3"]
    assert _names(select_prunable(cands, KeepLatest(1), protect={"s4"})) == ["s1", "s2", "s3", "s4", "s6"]
    assert _names(select_prunable(cands, 2)) == _names(select_prunable(cands, KeepLatest(2)))
    assert select_prunable(cands, 0) == [] and select_prunable(cands, -1) == []


def _take(out: str, iteration: int, storage_options=None, **metrics: float) -> None:
    metadata = {"iteration": iteration, "epoch_detail": iteration / 10}
    if metrics:
        metadata[METRICS_KEY] = {k.replace("_", "/"): v for k, v in metrics.items()}
    Snapshot.take(join(out, f"snapshot_iter_{iteration}"), {"state": StateDict({"w": torch.arange(4.0)})},
                  storage_options=storage_options, metadata=metadata)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_prune_with_a_union_over_real_snapshots_reads_recorded_values(tmp_path, where):
    out = str(tmp_path) if where == "local" else f"memory://policies-{uuid.uuid4().hex}/run"
    for i, loss in [(1, 0.9), (2, 0.3), (3, 0.5), (4, 0.6), (5, 0.7), (6, 0.8)]:
        _take(out, i, val_loss=loss)
    _take(out, 7)  # no value recorded: not a KeepBest candidate, but kept as the newest
    fs, root = fsspec.core.url_to_fs(out)
    # damage snapshot 4 (a data file truncated): the quick check of listing sees it
    data = [p for p in fs.find(f"{root}/snapshot_iter_4") if not p.endswith("manifest.json")]
    with fs.open(data[0], "wb") as f:
        f.write(b"x")
    found = {c.name: c for c in list_snapshots(out, FMT)}
    assert found["snapshot_iter_2"].metrics == {"val/loss": 0.3} and found["snapshot_iter_7"].metrics == {}
    assert found["snapshot_iter_4"].kind == "damaged"
    policy = KeepEvery(5) | KeepBest("val/loss", n=2)  # milestones 1 (the first of 0..4) and 5; best 2 and 3
    with pytest.warns(UserWarning, match="no recorded value"):
        planned = prune(out, FMT, policy, dry_run=True)
    assert sorted(planned) == sorted(join(out, f"snapshot_iter_{i}") for i in (4, 6))
    assert len(list_snapshots(out, FMT)) == 7  # dry run removed nothing
    assert sorted(prune(out, FMT, policy)) == sorted(planned)  # the same policy warns once
    assert [c.name for c in list_snapshots(out, FMT)] == [f"snapshot_iter_{i}" for i in (1, 2, 3, 5, 7)]
