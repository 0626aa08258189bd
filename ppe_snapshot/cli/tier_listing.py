"""``ppe-snapshot ls`` of a local tier directory: its steps, the ranks' parts and the partner copies held there."""
from __future__ import annotations

from typing import Any, Callable

from ppe_snapshot.local_tier import inventory, steps
from ppe_snapshot.storage import open_tree


def list_tier(path: str) -> list[dict[str, Any]] | None:
    """The rows of the local tier directory at ``path`` (a local path), oldest step first; None where ``path`` holds
    no local step (not a tier directory)."""
    tree = open_tree(path)
    if not tree.is_dir(tree.root) or not steps(tree):
        return None
    return inventory(tree)


def print_tier(path: str, rows: list[dict[str, Any]], human: Callable[[int], str]) -> None:
    def ranks(held: dict[int, bool]) -> str:
        return ",".join(f"{r}" if done else f"{r}(incomplete)" for r, done in sorted(held.items())) or "-"

    table = [("STEP", "PARTS OF RANKS", "COPIES OF RANKS", "SIZE", "STATUS")]
    for row in rows:
        table.append((str(row["step"]), ranks(row["ranks"]), ranks(row["copies"]), human(row["bytes"]),
                      "complete" if row["complete"] else "incomplete (in flight, or a step that failed)"))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    print(f"{path}: a local tier directory (one node's local steps; a step is complete once every rank agreed)")
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
