"""The ppe-snapshot command: inspect, verify, convert."""
import torch

from _crafted import craft_index
from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.cli import main


def _flip_byte(path, offset=3):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_convert_torch_file_to_snapshot_and_back(tmp_path, capsys):
    model = torch.nn.Linear(4, 3)
    state = {"models": {"main": model.state_dict()}, "iteration": 7, "name": "run"}
    torch.save(state, tmp_path / "ppe.pt")

    assert main(["convert", "--to", "snapshot", str(tmp_path / "ppe.pt"), str(tmp_path / "snap")]) == 0
    restored = StateDict()
    Snapshot(str(tmp_path / "snap")).restore({"state": restored})
    assert restored["iteration"] == 7 and restored["name"] == "run"
    assert torch.equal(restored["models"]["main"]["weight"], model.weight.detach())

    assert main(["convert", str(tmp_path / "snap"), str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["iteration"] == 7
    assert torch.equal(back["models"]["main"]["bias"], model.bias.detach())


def test_verify_reports_damage_with_exit_status(tmp_path, capsys):
    Snapshot.take(str(tmp_path / "good"), {"s": StateDict(x=torch.arange(100.0))})
    Snapshot.take(str(tmp_path / "bad"), {"s": StateDict(x=torch.arange(100.0))})
    _flip_byte(tmp_path / "bad" / "data" / "rank0.bin")

    assert main(["verify", str(tmp_path / "good")]) == 0
    assert main(["verify", str(tmp_path / "good"), str(tmp_path / "bad")]) == 1
    out = capsys.readouterr().out
    assert f"OK      {tmp_path / 'good'}" in out
    assert f"DAMAGED {tmp_path / 'bad'}" in out and "checksum mismatch" in out
    # --quick checks sizes only, so a flipped byte passes it
    assert main(["verify", "--quick", str(tmp_path / "bad")]) == 0


def test_verify_reports_a_container_naming_a_child_without_an_entry(tmp_path, capsys):
    """Each entry well formed, every checksum good, yet ``s`` names a child the index lists no entry for."""
    Snapshot.take(str(tmp_path / "bad"), {"s": StateDict(x=torch.arange(100.0), n=5)})
    craft_index(tmp_path / "bad", lambda header, cols: header["entries"]["s"]["keys"].__setitem__(1, "m"))
    assert main(["verify", str(tmp_path / "bad")]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {tmp_path / 'bad'}: 's' refers to 's/m', which the manifest lists no entry of" in out
    assert main(["verify", "--quick", str(tmp_path / "bad")]) == 0  # (each entry alone)


def test_inspect_lists_entries_and_missing_snapshot_is_an_error(tmp_path, capsys):
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(x=torch.zeros(2, 3, dtype=torch.bfloat16), n=5)},
                  metadata={"iteration": 12})
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert '"iteration": 12' in out
    assert "0/s/x: tensor bfloat16[2, 3] 12 B" in out
    assert "0/s/n: value 5" in out

    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such file or directory" in capsys.readouterr().err
