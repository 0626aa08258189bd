"""The README's preemption recipe, run as written in an ordinary ppe loop: SIGTERM in the middle of an epoch,
then a resumed run trains on the batches, and ends with the weights, of an uninterrupted run, bit for bit."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

import _warm
from _readme import python_blocks

ROOT = Path(__file__).resolve().parent.parent

# What the README leaves to the user: `manager` (iters_per_epoch=len(loader)), `loader`, `train_step`.
PRELUDE = """
import sys, time
import torch, pytorch_pfn_extras as ppe
torch.manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(24, 8), torch.randn(24, 1))
loader = torch.utils.data.DataLoader(dataset, batch_size=3, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
manager = ppe.training.ExtensionsManager(model, optimizer, 3, iters_per_epoch=len(loader), out_dir="run")
seen = open("batches.txt", "a")

def train_step(batch):
    x, y = batch
    seen.write(f"{manager.iteration} {x.sum().item():.6f} {torch.rand(()).item():.6f}\\n")
    seen.flush()
    print("step", manager.iteration, flush=True)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    time.sleep(float(sys.argv[1]))
"""
EPILOGUE = """
torch.save(model.state_dict(), "final.pt")
"""


def _script(tmp: Path) -> Path:
    recipe, = python_blocks("### Preemption")
    script = tmp / "train.py"
    script.write_text(PRELUDE + recipe + EPILOGUE)
    return script


def _start(script: Path, delay: float) -> subprocess.Popen:
    return _warm.popen([sys.executable, str(script), str(delay)], cwd=script.parent, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _batches(directory: Path) -> list[str]:
    return (directory / "batches.txt").read_text().splitlines()


def test_the_readme_recipe_resumes_mid_epoch_bit_exactly(tmp_path):
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    for directory in (straight, preempted):
        directory.mkdir()
        _script(directory)
    done = _start(straight / "train.py", 0.0)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err

    run = _start(preempted / "train.py", 0.3)
    for line in run.stdout:  # 8 batches per epoch: the signal comes while iteration 10 runs
        if line.strip() == "step 9":
            run.send_signal(signal.SIGTERM)
            break
    out, err = run.communicate(timeout=300)
    assert run.returncode == 128 + signal.SIGTERM, err
    assert "saved iteration 10 to" in out
    assert not (preempted / "final.pt").exists()

    resumed = _start(preempted / "train.py", 0.0)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert "Attempted to run a finalized manager" not in err
    assert out.splitlines()[0] == "step 10"  # on from the batch after the last one trained on

    assert _batches(preempted) == _batches(straight)  # the same batches, and the same random numbers, in order
    assert len(_batches(straight)) == 24
    expected = torch.load(straight / "final.pt", weights_only=True)
    got = torch.load(preempted / "final.pt", weights_only=True)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
