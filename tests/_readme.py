"""The README's Python snippets, as written, for tests that run them (filling only the names the README says
are the user's)."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(heading: str) -> list[str]:
    """The ```python blocks of the README's section under ``heading`` (a Markdown heading line, e.g.
    ``"### Preemption"``), up to the next heading of the same or a higher level."""
    text = README.read_text()
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n")
    end = re.compile(rf"\n#{{1,{len(level)}}} ").search(text, start + 1)
    section = text[start:end.start() if end else len(text)]
    return re.findall(r"```python\n(.*?)```", section, re.S)
