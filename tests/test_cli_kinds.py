"""The ppe-snapshot command line on every kind of input: engine snapshots (the extension's layout), DCP-adapter
snapshots, ppe single files, torch's own DCP directories, safetensors files, damaged, missing, text, empty
directories, and S3 (the local moto server). Most checks call ``main()`` in this process; a few launch the real
command, for exit codes and output as a shell sees them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ppe_snapshot import RNGState, Snapshot, StateDict
from ppe_snapshot.cli import main
from ppe_snapshot.dcp import SnapshotStorageWriter
from ppe_snapshot.retention import METRICS_KEY

import _warm
from _asserts import manifest_doc
from _extension_workers import flip_byte

ROOT = Path(__file__).resolve().parent.parent
WEIGHT = torch.arange(12.0).reshape(3, 4)
BIAS = torch.tensor([1.0, 2.0, 3.0])


def _state(iteration: int, weight: torch.Tensor = WEIGHT) -> dict:
    return {"models": {"main": {"weight": weight.clone(), "bias": BIAS.clone()}}, "_start_iteration": iteration}


def _take(path: Path, iteration: int, weight: torch.Tensor = WEIGHT, rng: bool = True) -> Path:
    """An engine snapshot laid out as the extension writes it (``state``, ``rng``, position metadata)."""
    app = {"state": StateDict(_state(iteration, weight))}
    if rng:
        app["rng"] = StateDict({0: RNGState().state_dict()})
    Snapshot.take(str(path), app, metadata={"iteration": iteration, "epoch": iteration // 10,
                                            "epoch_detail": iteration / 10})
    return path


def _dcp_save(state: dict, writer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, no_dist=True)


@pytest.fixture
def kinds(tmp_path):
    """One of each input kind, and a run directory holding several."""
    run = tmp_path / "run"
    run.mkdir()
    _take(run / "snapshot_iter_10", 10)
    _take(run / "snapshot_iter_20", 20, WEIGHT + 0.5)
    torch.save(_state(5), run / "snapshot_iter_5")
    (run / "snapshot_iter_30" / "data").mkdir(parents=True)  # a crashed save's leftover
    (run / "log").write_text("[]")  # LogReport's file: not a snapshot, not listed
    model = {"weight": WEIGHT.clone(), "bias": BIAS.clone()}
    _dcp_save({"model": model}, SnapshotStorageWriter(str(tmp_path / "adapter")))
    _dcp_save({"model": model}, dcp.FileSystemWriter(str(tmp_path / "torchdcp")))
    (tmp_path / "text.txt").write_text("hello\n")
    (tmp_path / "empty").mkdir()
    return tmp_path


COMMANDS = ("ls", "inspect", "verify", "diff", "convert", "prune")


def _run(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Each command line of the CLI in a process of its own, all at once (each start imports torch: seconds)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = [(args, _warm.popen([sys.executable, "-m", "ppe_snapshot.cli", *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)) for args in commands]
    done = []
    for args, process in started:
        out, err = process.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(args, process.returncode, out, err))
    return done


def test_ls_lists_every_kind_by_position_and_marks_the_resume_candidate(kinds, capsys):
    assert main(["ls", "--json", str(kinds / "run")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["kind"], r["status"], r["iteration"]) for r in rows] == [
        ("snapshot_iter_5", "ppe-file", "complete", 5), ("snapshot_iter_10", "snapshot", "complete", 10),
        ("snapshot_iter_20", "snapshot", "complete", 20), ("snapshot_iter_30", "in-progress",
         "in-progress? (unknown: no writer recorded; written by an older version, or killed as it started)", 30)]
    assert [r["name"] for r in rows if r["resume"]] == ["snapshot_iter_20"]
    assert all(r["bytes"] > 0 for r in rows[:3]) and rows[1]["time"].endswith("Z")

    flip_byte(kinds / "run" / "snapshot_iter_20" / "data" / "rank0.bin", 3)
    assert main(["ls", "--json", str(kinds / "run")]) == 0  # the quick check does not read data
    assert [r["status"] for r in json.loads(capsys.readouterr().out)][2] == "complete"
    assert main(["ls", "--deep", "--json", str(kinds / "run")]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    damaged = rows["snapshot_iter_20"]["status"]
    assert damaged.startswith("damaged: ") and "checksum" in damaged
    assert rows["snapshot_iter_10"]["resume"] and not rows["snapshot_iter_20"]["resume"]


def test_inspect_every_kind(kinds, capsys):
    tmp = kinds
    assert main(["convert", str(tmp / "run" / "snapshot_iter_10"), str(tmp / "w.safetensors")]) == 0
    capsys.readouterr()
    expected = {
        str(tmp / "run" / "snapshot_iter_10"): ("snapshot", "0/state/models/main/weight: tensor float32[3, 4] 48 B"),
        str(tmp / "adapter"): ("dcp-adapter", "0/model.weight: tensor float32[3, 4] 48 B"),
        str(tmp / "torchdcp"): ("torch-dcp", "0/state/model/weight: tensor float32[3, 4] 48 B"),
        str(tmp / "run" / "snapshot_iter_5"): ("ppe-file", "0/state/models/main/weight: tensor float32[3, 4] 48 B"),
        str(tmp / "w.safetensors"): ("safetensors", "0/state/models.main.weight: tensor float32[3, 4] 48 B"),
    }
    for path, (kind, line) in expected.items():
        assert main(["inspect", path]) == 0, path
        out = capsys.readouterr().out
        assert out.startswith(f"{kind} {path}\n") and f"  {line}\n" in out, out
        # the extension layout also holds the RNG states: torch's generators (CUDA's where CUDA was used) and
        # numpy's 624 uint32 words
        rng = RNGState().state_dict()
        generators = sum(t.numel() for t in [rng["torch"], *rng.get("cuda", [])])
        tensor_bytes = 60 if kind != "snapshot" else 60 + generators + 624 * 4
        assert f"tensors, {tensor_bytes} B of tensors\n" in out
        assert main(["inspect", "--json", path]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["kind"] == kind and report["tensor_bytes"] == tensor_bytes
        assert {"dtype": "float32", "shape": [3, 4], "bytes": 48}.items() <= \
            next(e for e in report["entries"] if e["key"].endswith("weight")).items()


def test_verify_names_every_damaged_entry_and_accepts_ppe_files(kinds, capsys):
    snap = kinds / "run" / "snapshot_iter_10"
    manifest = manifest_doc(snap)["ranks"][0]
    for key in ("state/models/main/weight", "state/models/main/bias"):
        flip_byte(snap / "data" / "rank0.bin", manifest[key]["chunks"][0]["offset"] + 1)
    paths = [str(kinds / "run" / "snapshot_iter_5"), str(kinds / "adapter"), str(kinds / "torchdcp"),
             str(kinds / "run" / "snapshot_iter_20")]
    assert main(["verify", *paths]) == 0
    assert capsys.readouterr().out == "".join(f"OK      {p}\n" for p in paths)
    assert main(["verify", str(snap), *paths]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {snap}: 2 damaged entries" in out
    assert "  state/models/main/weight: " in out and "  state/models/main/bias: " in out
    assert main(["verify", "--quick", str(snap)]) == 0  # sizes only
    capsys.readouterr()
    truncated = kinds / "truncated.pt"
    truncated.write_bytes((kinds / "run" / "snapshot_iter_5").read_bytes()[:-200])
    assert main(["verify", str(truncated), str(kinds / "run" / "snapshot_iter_30")]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {truncated}: " in out and f"DAMAGED {kinds / 'run' / 'snapshot_iter_30'}: " in out
    assert main(["verify", str(kinds / "missing"), str(kinds / "run" / "snapshot_iter_5")]) == 2
    captured = capsys.readouterr()
    assert f"{kinds / 'missing'}: no such file or directory" in captured.err and "OK " in captured.out


def test_diff_reports_keys_shapes_and_values(kinds, capsys):
    run = kinds / "run"
    assert main(["diff", str(run / "snapshot_iter_10"), str(run / "snapshot_iter_5")]) == 1
    assert capsys.readouterr().out == "differs:   0/state/_start_iteration: 10 -> 5\n"
    assert main(["diff", "--json", str(run / "snapshot_iter_10"), str(run / "snapshot_iter_20")]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {"key": "0/state/models/main/weight", "max_abs_diff": 0.5} in report["values"]
    assert main(["diff", "--atol", "0.6", str(kinds / "adapter"), str(kinds / "torchdcp")]) == 0
    assert main(["diff", str(kinds / "adapter"), str(kinds / "torchdcp")]) == 0
    assert capsys.readouterr().out.startswith("equal: 2 entries")
    other = kinds / "other"
    Snapshot.take(str(other), {"state": StateDict({"models": {"main": {"weight": torch.zeros(4, 3)}}, "extra": 1})})
    assert main(["diff", str(run / "snapshot_iter_10"), str(other)]) == 1
    out = capsys.readouterr().out
    assert "only in A: 0/state/models/main/bias" in out and "only in B: 0/state/extra" in out
    assert "changed:   0/state/models/main/weight: float32[3, 4] -> float32[4, 3]" in out


def test_convert_to_every_target_reads_back_and_names_what_is_left_out(kinds, capsys):
    src = str(kinds / "run" / "snapshot_iter_10")
    assert main(["convert", src, str(kinds / "out.safetensors")]) == 0
    err = capsys.readouterr().err
    assert "not written: 0/rng" in err and "not written (1 non-tensor values): 0/state/_start_iteration" in err
    from safetensors.torch import load_file
    tensors = load_file(str(kinds / "out.safetensors"))
    assert set(tensors) == {"models.main.weight", "models.main.bias"}
    assert torch.equal(tensors["models.main.weight"], WEIGHT)

    assert main(["convert", "--to", "dcp", src, str(kinds / "outdcp")]) == 0
    restored = {"models": {"main": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}}, "_start_iteration": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(restored, checkpoint_id=str(kinds / "outdcp"), no_dist=True)  # plain DCP, no ppe_snapshot reader
    assert torch.equal(restored["models"]["main"]["weight"], WEIGHT) and restored["_start_iteration"] == 10

    assert main(["convert", "--to", "snapshot", str(kinds / "out.safetensors"), str(kinds / "from_st")]) == 0
    assert main(["diff", str(kinds / "from_st"), str(kinds / "out.safetensors")]) == 0
    assert main(["convert", str(kinds / "torchdcp"), str(kinds / "from_dcp.pt")]) == 0
    assert torch.equal(torch.load(kinds / "from_dcp.pt", weights_only=True)["model"]["weight"], WEIGHT)
    capsys.readouterr()

    # an existing DST, file or directory, is refused without --force and left as it was
    before = (kinds / "out.safetensors").read_bytes()
    for dst in (kinds / "out.safetensors", kinds / "outdcp"):
        assert main(["convert", src, str(dst), "--to", "safetensors" if dst.suffix else "dcp"]) == 2
        assert f"{dst}: already exists; pass --force to replace it" in capsys.readouterr().err
    assert (kinds / "out.safetensors").read_bytes() == before
    assert main(["convert", "--force", str(kinds / "run" / "snapshot_iter_20"), str(kinds / "out.safetensors")]) == 0
    assert torch.equal(load_file(str(kinds / "out.safetensors"))["models.main.weight"], WEIGHT + 0.5)


def test_a_forced_conversion_that_fails_keeps_the_old_destination(kinds, capsys):
    import fsspec
    fs = fsspec.filesystem("memory")
    fs.pipe("/cli-force/out", b"the old destination")
    # DCP directories are written to local paths only: the write fails after the old DST was moved aside
    assert main(["convert", "--force", "--to", "dcp", str(kinds / "run" / "snapshot_iter_20"),
                 "memory://cli-force/out"]) == 2
    assert "local paths only" in capsys.readouterr().err
    assert fs.cat("/cli-force/out") == b"the old destination"
    assert fs.ls("/cli-force", detail=False) == ["/cli-force/out"]


@pytest.mark.parametrize("name, message", [
    ("missing", "no such file or directory"), ("text.txt", "neither a snapshot directory"),
    ("empty", "is an empty directory, not a snapshot")])
def test_bad_paths_are_one_line_errors(kinds, capsys, name, message):
    for command in (["inspect"], ["verify"], ["diff", str(kinds / "adapter")], ["convert", "--to", "torch"]):
        args = [*command, str(kinds / name)] + ([str(kinds / "dst.pt")] if command[0] == "convert" else [])
        assert main(args) == 2, args
        captured = capsys.readouterr()
        assert captured.err == f"ppe-snapshot: {kinds / name}: {captured.err.split(': ', 2)[2]}"
        assert message in captured.err and captured.err.count("\n") == 1
    assert not (kinds / "dst.pt").exists()


def test_prune_keeps_the_newest(kinds, capsys):
    run = kinds / "run"
    assert main(["prune", str(run), "--keep-latest", "1", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and (run / "snapshot_iter_5").exists()
    assert main(["prune", str(run), "--keep-latest", "1"]) == 0
    assert sorted(p.name for p in run.iterdir()) == ["log", "snapshot_iter_20", "snapshot_iter_30"]
    assert main(["prune", str(run)]) == 2 and "--keep-latest" in capsys.readouterr().err


def test_prune_policies_from_the_shell(tmp_path, capsys):
    losses = {10: 0.9, 20: 0.3, 30: 0.5, 40: 0.7, 50: 0.8}
    for iteration, loss in losses.items():
        Snapshot.take(str(tmp_path / f"snapshot_iter_{iteration}"), {"s": StateDict(x=torch.ones(1))},
                      metadata={"iteration": iteration, METRICS_KEY: {"val/loss": loss}})
    args = ["prune", str(tmp_path), "--keep-every", "20", "--keep-best", "val/loss:1", "--keep-latest", "1"]
    assert main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove {tmp_path / 'snapshot_iter_30'}\n" in out and len(os.listdir(tmp_path)) == 5
    assert main(args) == 0  # 10, 20 and 40 (the milestones 0, 20, 40), 20 (best loss), 50 (latest)
    assert sorted(os.listdir(tmp_path)) == [f"snapshot_iter_{i}" for i in (10, 20, 40, 50)]
    assert main(["prune", str(tmp_path), "--keep-best", "val/loss:many"]) == 2
    assert "--keep-best" in capsys.readouterr().err
    assert main(["prune", str(tmp_path), "--keep-latest", "0"]) == 2


def test_s3_run_directory(kinds, s3_bucket, capsys):
    url, options = s3_bucket
    flags = [f"--storage-option=key={options['key']}", f"--storage-option=secret={options['secret']}",
             f"--storage-option=client_kwargs.endpoint_url={options['client_kwargs']['endpoint_url']}"]
    _take_s3 = f"{url}/run/snapshot_iter_10"
    Snapshot.take(_take_s3, {"state": StateDict(_state(10))}, storage_options=options, metadata={"iteration": 10})
    assert main(["ls", "--json", f"{url}/run", *flags]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["kind"], r["status"], r["resume"]) for r in rows] == [
        ("snapshot_iter_10", "snapshot", "complete", True)]
    assert main(["verify", _take_s3, *flags]) == 0
    assert main(["inspect", _take_s3, *flags]) == 0
    assert "0/state/models/main/weight: tensor float32[3, 4] 48 B" in capsys.readouterr().out
    assert main(["convert", _take_s3, f"{url}/w.safetensors", *flags]) == 0
    assert main(["diff", f"{url}/w.safetensors", str(kinds / "run" / "snapshot_iter_10"), *flags]) == 1
    assert capsys.readouterr().out.endswith("only in B: 0/state/_start_iteration\n")
    assert main(["inspect", f"{url}/nothing", *flags]) == 2
    assert f"{url}/nothing: no such file or directory" in capsys.readouterr().err


def test_the_real_command(kinds):
    """Exit codes and output as a shell sees them; never a traceback without --debug."""
    helps = _warm.popen(  # every subcommand's -h in one process (each is a SystemExit(0) after the usage)
        [sys.executable, "-c", "import sys\nfrom ppe_snapshot.cli import main\nfor c in sys.argv[1:]:\n"
         "    try:\n        main([c, '-h'])\n    except SystemExit as e:\n        print('EXIT', e.code)",
         *COMMANDS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    version, listed, failed, debugged, converted = _run(
        ["--version"], ["ls", str(kinds / "run")], ["inspect", str(kinds / "text.txt")],
        ["inspect", "--debug", str(kinds / "text.txt")],
        ["convert", str(kinds / "adapter"), str(kinds / "a.safetensors")])
    helped_out, helped_err = helps.communicate(timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("ppe-snapshot ") and "torch" in version.stdout
    assert helps.returncode == 0, helped_err
    for command, helped in zip(COMMANDS, helped_out.split("EXIT 0\n")):
        assert helped.startswith("usage: ppe-snapshot " + command)
        assert "``" not in helped and ":class:" not in helped
    assert listed.returncode == 0 and "*  snapshot_iter_20" in listed.stdout and "ppe-file" in listed.stdout
    assert failed.returncode == 2 and failed.stdout == "" and "Traceback" not in failed.stderr
    assert failed.stderr.count("\n") == 1 and str(kinds / "text.txt") in failed.stderr
    assert debugged.returncode == 2 and "Traceback" in debugged.stderr
    flip_byte(kinds / "run" / "snapshot_iter_20" / "data" / "rank0.bin", 3)
    verified, differ = _run(["verify", str(kinds / "run" / "snapshot_iter_5"), str(kinds / "run" / "snapshot_iter_20")],
                            ["diff", str(kinds / "a.safetensors"), str(kinds / "torchdcp")])
    assert verified.returncode == 1 and "Traceback" not in verified.stdout + verified.stderr
    assert f"OK      {kinds / 'run' / 'snapshot_iter_5'}" in verified.stdout
    assert f"DAMAGED {kinds / 'run' / 'snapshot_iter_20'}: " in verified.stdout
    assert converted.returncode == 0 and converted.stderr == "" and (kinds / "a.safetensors").exists()
    assert differ.returncode == 0, differ.stderr


def _colliding(tmp_path: Path) -> Path:
    """Two tensors whose keys join into one: model/a.b (ones) and model.a/b (zeros)."""
    path = tmp_path / "coll"
    Snapshot.take(str(path), {"model": StateDict({"a.b": torch.ones(2)}), "model.a": StateDict(b=torch.zeros(2))})
    return path


@pytest.mark.parametrize("target, name", [("safetensors", "c.safetensors"), ("dcp", "c.dcp")])
def test_convert_refuses_keys_that_collide_once_joined(tmp_path, capsys, target, name):
    src, dst = _colliding(tmp_path), tmp_path / name
    assert main(["convert", "--to", target, str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "'0/model/a.b' and '0/model.a/b' both become 'model.a.b'" in err[0]
    assert not dst.exists()  # nothing written
    dst.write_bytes(b"keep")  # --force: the file already there stays as it was
    assert main(["convert", "--force", "--to", target, str(src), str(dst)]) == 2
    assert dst.read_bytes() == b"keep"


def test_diff_and_inspect_keep_keys_that_collide_once_joined_apart(tmp_path, capsys):
    src = _colliding(tmp_path)
    assert main(["diff", str(src), str(src)]) == 0
    assert capsys.readouterr().out.startswith("equal: 2 entries")
    other = tmp_path / "other"
    Snapshot.take(str(other), {"model": StateDict({"a.b": torch.ones(2) * 3}), "model.a": StateDict(b=torch.zeros(2))})
    assert main(["diff", "--json", str(src), str(other)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["values"] == [{"key": "0/model/a.b", "max_abs_diff": 2.0}]
    torch_file = tmp_path / "coll.pt"  # a torch.save file keeps the nesting; inspect shows it as a snapshot's state
    assert main(["convert", "--to", "torch", str(src), str(torch_file)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", str(torch_file)]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert {"0/state/model/a.b", "0/state/model.a/b"} <= {entry["key"] for entry in entries}


def test_rng_states_are_recognised_by_what_was_saved(tmp_path, capsys):
    """A user's dict under the key "rng" is state; an RNGState under another key is an RNG state."""
    path = tmp_path / "snap"
    Snapshot.take(str(path), {"rng": StateDict(seed=1, w=torch.ones(2)), "gen": RNGState()})
    assert main(["convert", "--to", "torch", str(path), str(tmp_path / "s.pt")]) == 0
    err = capsys.readouterr().err
    assert "not written: 0/gen (RNG states" in err and "rng" not in err.replace("RNG", "")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)  # what was written loads without pickle's objects
    assert loaded["rng"]["seed"] == 1 and torch.equal(loaded["rng"]["w"], torch.ones(2)) and "gen" not in loaded


def test_diff_reports_rng_states_that_differ(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    torch.manual_seed(0)
    Snapshot.take(str(a), {"state": StateDict(w=torch.ones(2)), "rng": RNGState()})
    torch.rand(3)  # the torch generator moved on
    Snapshot.take(str(b), {"state": StateDict(w=torch.ones(2)), "rng": RNGState()})
    assert main(["diff", str(a), str(a)]) == 0
    assert capsys.readouterr().out.startswith("equal: 1 entries, RNG states equal")
    assert main(["diff", str(a), str(b)]) == 1
    assert capsys.readouterr().out == ("equal: 1 entries, but the RNG states differ (--ignore-rng to leave them "
                                       "out):\nRNG differs:   0/rng/torch\n")
    assert main(["diff", "--json", str(a), str(b)]) == 1
    assert json.loads(capsys.readouterr().out)["rng"]["values"] == [{"key": "0/rng/torch"}]
    assert main(["diff", "--ignore-rng", str(a), str(b)]) == 0


def test_diff_shows_long_values_around_their_first_difference(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    Snapshot.take(str(a), {"state": StateDict(note="x" * 200 + "A" + "y" * 50)})
    Snapshot.take(str(b), {"state": StateDict(note="x" * 200 + "B" + "y" * 50)})
    assert main(["diff", "--json", str(a), str(b)]) == 1
    (item,) = json.loads(capsys.readouterr().out)["values"]
    assert "xA" in item["a"] and "xB" in item["b"] and item["a"] != item["b"]


def test_convert_to_dcp_fails_in_one_line(tmp_path, capsys):
    src = tmp_path / "snap"
    Snapshot.take(str(src), {"state": StateDict(w=torch.ones(2))})
    (tmp_path / "file").write_text("x")
    assert main(["convert", "--to", "dcp", str(src), str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ppe-snapshot: {tmp_path / 'file' / 'sub'}: torch DCP could not write it: NotADirectoryError: "
                   f"[Errno 20] Not a directory: '{tmp_path / 'file' / 'sub'}'"]


def test_the_package_runs_as_the_command_and_ships_its_types():
    done = _warm.run([sys.executable, "-m", "ppe_snapshot", "--version"], capture_output=True, text=True,
                     env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    import ppe_snapshot
    assert {"snapshot", "snapshot_object", "SnapshotMode"} <= set(dir(ppe_snapshot)) & set(ppe_snapshot.__all__)
    assert (Path(ppe_snapshot.__file__).parent / "py.typed").exists()


def test_ls_and_verify_say_what_they_checked(kinds, capsys):
    run = kinds / "run"
    flip_byte(run / "snapshot_iter_20" / "data" / "rank0.bin", 3)
    assert main(["ls", str(run)]) == 0
    footer = capsys.readouterr().out.strip().splitlines()[-1]
    assert "unless a checksum fails" in footer and "--deep reads every checksum" in footer
    assert main(["ls", "--json", str(run)]) == 0
    assert {row["checked"] for row in json.loads(capsys.readouterr().out)} == {"quick"}
    assert main(["ls", "--deep", str(run)]) == 0
    out = capsys.readouterr().out
    assert "every checksum checked" in out and out.splitlines()[2].startswith("*  snapshot_iter_10")
    assert main(["verify", "--quick", str(run / "snapshot_iter_20")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"OK      {run / 'snapshot_iter_20'}",
        "checked: manifests and data file sizes only (--quick); without --quick every checksum is read (ppe files: "
        "loaded)"]
