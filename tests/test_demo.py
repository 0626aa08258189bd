"""The main demo (``make demo``): a real run killed with SIGKILL and resumed, told as it happened."""

import os
import re
import sys
from pathlib import Path

import _warm

ROOT = Path(__file__).resolve().parent.parent


def test_demo_resumes_bit_exact_and_says_what_the_kill_left(tmp_path):
    keep = tmp_path / "runs"
    done = _warm.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--keep", str(keep)],
                     capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "PASS: the final model and optimizer state are bit-identical" in out
    complete_at_kill = re.search(r"complete at the kill: (.*?)(;|\n)", out).group(1).split(", ")
    finished_after = re.findall(r"the writer process finished (snapshot_iter_\d+) after the trainer died", out)
    resumed = re.search(r"autoload resumed from (\S+) at iteration (\d+)", out)
    # What the demo says was complete is what autoload resumed from: the newest of it, nothing it called partial.
    newest = max(complete_at_kill + finished_after, key=lambda name: int(name.rsplit("_", 1)[1]))
    assert Path(resumed.group(1)).name == newest
    assert resumed.group(2) == newest.rsplit("_", 1)[1]
    assert "had no manifest.json yet" not in out
    tool = Path(sys.executable).parent / "ppe-snapshot"
    hint = f"try: {tool if tool.exists() else 'ppe-snapshot'} ls {keep / 'crashed'}"
    assert hint in out
