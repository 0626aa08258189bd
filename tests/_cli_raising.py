"""The ``ppe-snapshot`` commands run in this process with their failures raised, for the seeded sweeps
(``_random_crafting.py``, ``_random_run_dirs.py``): a command prints what failed as one line and exits, which
would hide the failure's type; here it is raised as it is, to be judged by its type."""
from __future__ import annotations

import contextlib
import io
from typing import Any

import ppe_snapshot.cli


def _raise(error: BaseException, *_: Any) -> int:
    raise error


def run_command(*argv: str, statuses: tuple[int, ...] = (0, 1)) -> None:
    """Run ``ppe-snapshot argv``, its output dropped; whatever failed raised, and an exit status outside
    ``statuses`` without a failure raised as a RuntimeError (by default 1 is accepted too: verify found damage,
    diff a difference)."""
    ppe_snapshot.cli.fail = _raise  # type: ignore[attr-defined]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = ppe_snapshot.cli.main(list(argv))
    if status not in statuses:
        raise RuntimeError(f"ppe-snapshot {argv[0]} exited {status} without raising")
