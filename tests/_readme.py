"""The README's Python snippets, as written, for tests that run them (filling only the names the README says
are the user's)."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(heading: str) -> list[str]:
    """The ```python blocks of the README's section under ``heading`` (a Markdown heading line, e.g.
    ``"### Preemption"``), up to the next heading of the same or a higher level."""
    level = len(heading.split(" ", 1)[0])
    blocks: list[list[str]] = []
    inside = False
    fence: str | None = None  # the language of the fenced block we are in
    for line in README.read_text().splitlines():
        if fence is not None:
            if line.startswith("```"):
                fence = None
            elif inside and fence == "python":
                blocks[-1].append(line)
        elif line.startswith("```"):
            fence = line[3:].strip()
            if inside and fence == "python":
                blocks.append([])
        elif line == heading:
            inside = True
        elif inside and re.match(rf"#{{1,{level}}} ", line):
            break
    return ["\n".join(lines) + "\n" for lines in blocks]
