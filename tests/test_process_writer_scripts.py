"""The ProcessWriter in the scripts users write: without a ``__main__`` guard it works (its worker never imports
the script unless a save refers to something defined there), and where it must import it, the error says why."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import ppe_snapshot

ROOT = Path(__file__).resolve().parent.parent

TRAIN = """
import torch, pytorch_pfn_extras as ppe
import ppe_snapshot
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=3, out_dir={out!r})
manager.extend(ppe_snapshot.snapshot(writer=ppe_snapshot.writing.ProcessWriter({writer_args})),
               trigger=(1, "iteration"))
"""
LOOP = """
while not manager.stop_trigger:
    with manager.run_iteration():
        print("iteration", manager.iteration, flush=True)
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
torch.save(model.state_dict(), {out!r} + "/final.pt")
"""


def _run(script: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=script.parent)


def _final_weights_equal_the_snapshots(out: Path) -> None:
    model = torch.nn.Linear(4, 3)
    ppe_snapshot.load_snapshot(str(out / "snapshot_iter_3"), model=model)
    final = torch.load(out / "final.pt", weights_only=True)
    assert all(torch.equal(value, final[key]) for key, value in model.state_dict().items())


def test_a_script_without_main_guard_saves_with_the_process_writer(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(out=str(tmp_path), writer_args="") + LOOP.format(out=str(tmp_path)))
    done = _run(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("iteration 0\n") == 1  # the training ran once: the worker did not run the script
    assert [p.name for p in sorted(tmp_path.glob("snapshot_iter_*"))] == [f"snapshot_iter_{i}" for i in (1, 2, 3)]
    _final_weights_equal_the_snapshots(tmp_path)


def test_a_savefun_defined_in_a_guarded_script_is_found_by_the_worker(tmp_path):
    script = tmp_path / "train.py"
    body = TRAIN.format(out=str(tmp_path), writer_args="savefun=save_twice") + LOOP.format(out=str(tmp_path))
    script.write_text("import torch\n\ndef save_twice(obj, f):\n    torch.save(obj, f)\n    torch.save(obj, f)\n\n"
                      "if __name__ == '__main__':\n" + textwrap.indent(body, "    "))
    done = _run(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("iteration 0\n") == 1
    state = torch.load(tmp_path / "snapshot_iter_3", weights_only=True)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert all(torch.equal(value, final[key]) for key, value in state["models"]["main"].items())


def test_a_savefun_in_a_script_without_main_guard_fails_naming_the_guard(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\n\ndef save_twice(obj, f):\n    torch.save(obj, f)\n"
                      + TRAIN.format(out=str(tmp_path), writer_args="savefun=save_twice")
                      + LOOP.format(out=str(tmp_path)))
    done = _run(script)
    assert done.returncode != 0
    raised = [line for line in done.stderr.splitlines() if line.startswith("ppe_snapshot.writing.Background")]
    assert len(raised) == 1 and 'no `if __name__ == "__main__":` guard' in raised[0] and "Fix:" in raised[0]
    assert done.stdout.count("iteration 0\n") == 1  # the import in the worker ran no training (it was refused)
    assert not (tmp_path / "snapshot_iter_1").exists()


def test_a_savefun_in_a_module_run_with_dash_m_is_found_by_the_worker(tmp_path):
    package = tmp_path / "trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    body = TRAIN.format(out=str(tmp_path), writer_args="savefun=save_twice") + LOOP.format(out=str(tmp_path))
    (package / "run.py").write_text("import torch\n\ndef save_twice(obj, f):\n    torch.save(obj, f)\n\n"
                                    "if __name__ == '__main__':\n" + textwrap.indent(body, "    "))
    done = subprocess.run([sys.executable, "-m", "trainer.run"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])},
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("iteration 0\n") == 1
    state = torch.load(tmp_path / "snapshot_iter_3", weights_only=True)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert all(torch.equal(value, final[key]) for key, value in state["models"]["main"].items())
