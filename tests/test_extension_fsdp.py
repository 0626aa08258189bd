"""SHARDED mode with FSDP2: snapshots taken on N ranks resume on M ranks (real gloo groups)."""
from __future__ import annotations

import os

from ppe_snapshot import Snapshot

from _extension_workers import assert_same
from _fsdp_workers import fsdp_train


def test_fsdp2_run_on_two_ranks_resumes_on_three_and_on_one(dist_run, tmp_path):
    out = str(tmp_path)
    first = dist_run(fsdp_train, 2, out, 10)
    assert [r["stopped_at"] for r in first] == [10, 10]
    assert first[0]["resumed_from"] is None
    saved = first[0]["at_end"]
    manifest = Snapshot(os.path.join(out, "snapshot_iter_10")).get_manifest()
    weight = manifest["0/state/models/main/0.weight"]  # one entry holding both ranks' shards
    assert weight.shape == [30, 8] and [s.offsets for s in weight.shards] == [[0, 0], [15, 0]]

    for world_size in (3, 1):  # 30 rows over 3 ranks: even; the 3-row output layer: one row each
        resumed = dist_run(fsdp_train, world_size, out, 12 if world_size == 3 else 15)
        for r in resumed:
            assert r["started_at"] == 10
            assert r["resumed_from"] == os.path.join(out, "snapshot_iter_10")
            assert_same(r["at_start"], saved, f"world size {world_size}")
            assert r["stopped_at"] == (12 if world_size == 3 else 15)
