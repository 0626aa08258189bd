"""The floor above the engine keeps to public names: read from the modules' own imports (function-level ones too)."""
from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ppe_snapshot")


def _modules(*names: str) -> list[str]:
    found = []
    for name in names:
        path = os.path.join(PACKAGE, name)
        if os.path.isdir(path):
            found += [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".py")]
        else:
            found.append(path)
    return found


def _imports(path: str) -> set[str]:
    """Every module ``path`` imports, and ``module.name`` for each name taken from a module."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


ABOVE = _modules("extension", "run_dir", "retention.py")


@pytest.mark.parametrize("path", ABOVE, ids=lambda p: os.path.relpath(p, PACKAGE))
def test_no_private_module_of_writing_or_ppe(path):
    private = sorted(name for name in _imports(path)
                     if (name.startswith(("ppe_snapshot.writing.", "pytorch_pfn_extras."))
                         and any(part.startswith("_") for part in name.split(".")[1:])))
    assert private == [], f"{os.path.relpath(path, PACKAGE)} imports private names: {private}"


@pytest.mark.parametrize("path", _modules("run_dir", "retention.py"), ids=lambda p: os.path.relpath(p, PACKAGE))
def test_the_run_directory_does_not_import_the_extension_or_ppe(path):
    """``import ppe_snapshot`` loads retention; it must stay free of pytorch_pfn_extras and of the floor above."""
    upward = sorted(n for n in _imports(path) if n.startswith(("ppe_snapshot.extension", "pytorch_pfn_extras")))
    assert upward == []


def test_modules_stay_small():
    sizes = {os.path.relpath(p, PACKAGE): sum(1 for _ in open(p)) for p in ABOVE}
    assert {name: n for name, n in sizes.items() if n > 400} == {}
