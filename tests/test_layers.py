"""The floors of docs/architecture.md, checked on the code's own imports.

Every ``import`` / ``from ... import`` of every module under ``ppe_snapshot/`` counts, function-level and
``TYPE_CHECKING`` ones included, and so does ``importlib.import_module("ppe_snapshot...")`` with a literal name.
"""
from __future__ import annotations

import ast
import pathlib
import re
from collections import defaultdict

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ppe_snapshot"

#: Floors, bottom up: a module imports only modules of its own floor or below (and never in a cycle).
FLOORS = {
    "ppe_snapshot.errors": 0, "ppe_snapshot.settings": 0,  # leaves: they import nothing of ours
    "ppe_snapshot.storage": 1,
    "ppe_snapshot.engine": 2,
    "ppe_snapshot.stored_snapshot": 3,  # one snapshot in a run directory: below writing/ and run_dir/
    "ppe_snapshot.ppe_private": 3,  # every use of ppe's private API: the writers' and the extension's
    "ppe_snapshot.writing": 3, "ppe_snapshot.dcp": 3,
    "ppe_snapshot.run_dir": 4, "ppe_snapshot.retention": 4, "ppe_snapshot.cli": 4,
    "ppe_snapshot.local_tier": 4,  # the local tier's saves and restores, below the extension that drives them
    "ppe_snapshot.extension": 5,
    "ppe_snapshot": 6,  # the public API
}
#: Packages whose submodules are private to them: other modules import only the package itself.
PACKAGES = ("ppe_snapshot.storage", "ppe_snapshot.engine", "ppe_snapshot.writing", "ppe_snapshot.dcp",
            "ppe_snapshot.run_dir", "ppe_snapshot.extension", "ppe_snapshot.local_tier")
#: The one public submodule: the engine's format pieces (entries, chunk reads, value encoding, payload appending,
#: committing a manifest one builds), documented as such. The DCP adapters need them; the CLI's inspect and verify
#: show and check entries one by one. Any module may import it: a public module, like the package itself; what
#: stays private is every ``_``-prefixed module and subpackage of the engine.
PUBLIC_SUBMODULES = {"ppe_snapshot.engine.codec"}


def _module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module under ``package`` (a copy of ``ppe_snapshot/`` anywhere) by its dotted name."""
    return {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}


MODULES = modules_of(PACKAGE)


def _imports(name: str, modules: dict[str, pathlib.Path] = MODULES) -> set[str]:
    """The modules of ours that module ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    path = modules[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return {m for m in found if m in modules and m != name}


def graph_of(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Which module of ``modules`` imports which."""
    return {name: _imports(name, modules) for name in modules}


GRAPH = graph_of(MODULES)


def _floor(module: str) -> int:
    owner = max((prefix for prefix in FLOORS if module == prefix or module.startswith(prefix + ".")), key=len)
    return FLOORS[owner]


def _package(module: str) -> str | None:
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), None)


def test_every_module_has_a_floor():
    for module in MODULES:
        assert any(module == p or module.startswith(p + ".") for p in FLOORS), f"{module} has no floor in FLOORS"


def test_no_upward_import():
    upward = [(a, b) for a, targets in GRAPH.items() for b in targets
              if _floor(b) > _floor(a)]
    assert upward == []


def test_storage_imports_only_the_leaves():
    for module, targets in GRAPH.items():
        if _package(module) == "ppe_snapshot.storage":
            outside = {t for t in targets if _package(t) != "ppe_snapshot.storage"}
            assert outside <= {"ppe_snapshot.errors", "ppe_snapshot.settings"}, module


def test_engine_imports_storage_and_errors_publicly():
    for module, targets in GRAPH.items():
        if _package(module) == "ppe_snapshot.engine":
            outside = {t for t in targets if _package(t) != "ppe_snapshot.engine"}
            assert outside <= {"ppe_snapshot.storage", "ppe_snapshot.errors", "ppe_snapshot.settings"}, module


def test_packages_are_entered_through_their_init():
    reaches = {(a, b) for a, targets in GRAPH.items() for b in targets
               if _package(b) and b != _package(b) and b not in PUBLIC_SUBMODULES and _package(a) != _package(b)}
    assert reaches == set()


def test_the_engine_surface_is_narrow():
    """At most 28 names from the package (the rest of the library's needs), each one defined; the codec's too."""
    import ppe_snapshot.engine
    import ppe_snapshot.engine.codec

    assert len(ppe_snapshot.engine.__all__) <= 28
    for module in (ppe_snapshot.engine, ppe_snapshot.engine.codec):
        assert len(set(module.__all__)) == len(module.__all__), module.__name__
        assert [name for name in module.__all__ if not hasattr(module, name)] == [], module.__name__
    assert {m for m in MODULES if _package(m) == "ppe_snapshot.engine" and m != "ppe_snapshot.engine"
            and not any(part.startswith("_") for part in m.split(".")[2:])} == PUBLIC_SUBMODULES


def test_dcp_uses_the_engine_and_its_codec_only():
    used = {t for m, targets in GRAPH.items() if _package(m) == "ppe_snapshot.dcp" for t in targets
            if _package(t) == "ppe_snapshot.engine"}
    assert used <= {"ppe_snapshot.engine", "ppe_snapshot.engine.codec"}


_VERSION_NAME = re.compile(r"(?i)(format_)?version")
_VERSIONS_HOME = "ppe_snapshot.engine._format.names"  # defines FORMAT_VERSION, the newest
#: The format versions' package: its modules alone tell versions apart (its ``table`` picks each step per version,
#: each version's module holds that version's steps and types).
VERSIONS_PACKAGE = "ppe_snapshot.engine._versions"


def _is_version(node: ast.AST) -> bool:
    """``version``, ``x.version``, ``x["version"]`` (any spelling of a format version)."""
    if isinstance(node, ast.Name):
        return bool(_VERSION_NAME.fullmatch(node.id))
    if isinstance(node, ast.Attribute):
        return bool(_VERSION_NAME.fullmatch(node.attr))
    return (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str) and bool(_VERSION_NAME.fullmatch(node.slice.value)))


def _is_int(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def version_number_problems(modules: dict[str, pathlib.Path]) -> list[str]:
    """Only ``_format/names`` binds a version name to a number (a module constant, a class field's default), and
    only the modules of ``engine/_versions/`` tell versions apart (``version == 2``): everything else asks them."""
    problems = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if _is_int(node.value) and any(_is_version(t) for t in targets) and name != _VERSIONS_HOME:
                    problems.append(f"{name}:{node.lineno}: binds a format version number")
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                operands = [node.left, *node.comparators]
                if (any(map(_is_version, operands)) and any(map(_is_int, operands))
                        and not _in_package(name, VERSIONS_PACKAGE)):
                    problems.append(f"{name}:{node.lineno}: compares a format version number")
    return problems


def test_the_format_version_is_defined_once():
    assert version_number_problems(MODULES) == []
    binds = [node.lineno for node in ast.walk(ast.parse(MODULES[_VERSIONS_HOME].read_text()))
             if isinstance(node, ast.AnnAssign) and _is_version(node.target) and _is_int(node.value)]
    assert binds, "FORMAT_VERSION moved: update _VERSIONS_HOME"


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


# -- the engine's subpackages ----------------------------------------------------------------------------------
ENGINE = "ppe_snapshot.engine"
#: The engine's subpackages, bottom up. A module imports the modules of its own subpackage directly and a lower
#: floor's subpackage only through its face (the subpackage's ``__init__``); subpackages of one floor never import
#: each other. Every subpackage is private (``_``-prefixed) and its modules are named without ``_``.
ENGINE_FLOORS = {
    "_util": 0,  # pausing the garbage collector, host memory
    "_ranks": 0,  # LOCAL, group_rank; how the ranks of a take speak
    "_format": 1,  # the bytes on disk and their checks: names, JSON, values, the manifest, entry columns, indexes
    "_state": 2,  # app state <-> entries: flatten / inflate, sharded tensors, state objects, the planner
    "_files": 3,  # data files: layout and writing (packing), verified reads
    "_versions": 4,  # the format versions: the record the read paths ask, each version's steps, commit, upgrade
    "_restore": 5,  # loading stored values, the bulk path
    "_take": 5,  # prepare, stage, write (incremental too), end a take; who writes it
}
#: The engine's top: its two public modules and the Snapshot facade, above every subpackage (named as before the
#: split: ``_``-prefixed but for the public ``codec``).
ENGINE_TOP = {ENGINE, f"{ENGINE}.codec", f"{ENGINE}._snapshot"}


def _unit(module: str) -> str:
    """The engine subpackage of an engine module (``"_format"``), or ``""`` for the engine's top."""
    rest = module[len(ENGINE) + 1:].split(".") if module != ENGINE else []
    return rest[0] if len(rest) > 1 or (rest and rest[0] in ENGINE_FLOORS) else ""


def engine_problems(modules: dict[str, pathlib.Path], graph: dict[str, set[str]]) -> list[str]:
    """What breaks the engine's subpackage floors in ``modules`` (empty: nothing)."""
    problems = []
    engine = sorted(m for m in modules if _in_package(m, ENGINE))
    for module in engine:
        parts = module[len(ENGINE) + 1:].split(".") if module != ENGINE else []
        if len(parts) == 1 and module not in ENGINE_TOP and parts[0] not in ENGINE_FLOORS:
            problems.append(f"{module}: neither a subpackage in ENGINE_FLOORS nor in ENGINE_TOP")
        if len(parts) == 2 and (parts[0] not in ENGINE_FLOORS or parts[1].startswith("_")):
            problems.append(f"{module}: a module of a subpackage in ENGINE_FLOORS, named without a leading _")
        if len(parts) > 2:
            problems.append(f"{module}: the engine's subpackages hold modules, not packages")
        source = _unit(module)
        for target in sorted(t for t in graph[module] if _in_package(t, ENGINE)):
            unit = _unit(target)
            if unit == source:
                continue
            if not unit:
                problems.append(f"{module} imports the engine's top ({target})")
            elif source and ENGINE_FLOORS.get(unit, 99) >= ENGINE_FLOORS.get(source, 99):
                problems.append(f"{module} imports {target}, not on a lower floor")
            elif target != f"{ENGINE}.{unit}":
                problems.append(f"{module} imports {target}, not through the face {ENGINE}.{unit}")
    units = {_unit(m) for m in engine}
    between = {u: {_unit(t) for m in engine if _unit(m) == u for t in graph[m] if _in_package(t, ENGINE)} - {u}
               for u in units}
    problems += [f"a cycle between the engine's subpackages {sorted(c)}" for c in _cycles(between)]
    return problems


def test_engine_subpackages_keep_their_floors():
    assert engine_problems(MODULES, GRAPH) == []
    assert {_unit(m) for m in MODULES if _in_package(m, ENGINE)} == {"", *ENGINE_FLOORS}


def test_the_engine_check_sees_a_reach_past_a_face():
    graph = {m: set(targets) for m, targets in GRAPH.items()}
    graph[f"{ENGINE}._restore.bulk"].add(f"{ENGINE}._format.index")  # past the face
    graph[f"{ENGINE}._format.names"].add(f"{ENGINE}._state")  # upward: a cycle between subpackages
    problems = engine_problems(MODULES, graph)
    assert any("not through the face" in p for p in problems)
    assert any("not on a lower floor" in p for p in problems)
    assert any("a cycle between" in p for p in problems)


# -- versions told apart only by the version record ---------------------------------------------------------------
#: A version module: a module of engine/_versions/ named for its version (``v2``, ``manifest_v2``). Every class it
#: defines is version-specific; so are the types below, defined elsewhere (name: its home, and why).
_VERSION_MODULE = re.compile(r"(\w+_)?v\d+")
VERSION_TYPES = {
    "EntryTable": ("ppe_snapshot.engine._format.manifest", "version 1's tables: entries decoded from the JSON"),
    "IndexTable": ("ppe_snapshot.engine._format.index", "versions 2 and 3: one index file's entries (its columns "
                   "as .index)"),
}
#: Attributes only some versions' objects have (name: its home, and why). ``getattr`` / ``hasattr`` / ``setattr``
#: of them is a version test anywhere; so is ``x.name`` in the engine, but for the names in _NAMES_BESIDE.
VERSION_ATTRIBUTES = {
    "complete": ("ppe_snapshot.engine._format.manifest", "a version-2 sharded entry looked up for one rank: what "
                 "gives every rank's shards (None otherwise)"),
    "indexes": ("ppe_snapshot.engine._format.manifest", "a version-2 manifest's index files (None in version 1)"),
    "table": ("ppe_snapshot.engine._versions.manifest_v2", "a version-2 table whose index file is read on first use"),
    "index": ("ppe_snapshot.engine._format.index", "an IndexTable's index file"),
}
#: Version attributes whose name also means something else in the engine: only getattr and friends are checked.
_NAMES_BESIDE = {"index": "torch DCP's read items name a shard's position so (item.storage_index.index)"}


def _version_types(modules: dict[str, pathlib.Path]) -> dict[str, str]:
    """Every version-specific type of ``modules``: its name and home."""
    types = {name: home for name, (home, _) in VERSION_TYPES.items()}
    for module, path in modules.items():
        if _in_package(module, VERSIONS_PACKAGE) and _VERSION_MODULE.fullmatch(module.rpartition(".")[2]):
            tree = ast.parse(path.read_text(), str(path))
            types.update((node.name, module) for node in tree.body if isinstance(node, ast.ClassDef))
    return types


def _type_names(node: ast.AST) -> set[str]:
    """The names a type argument gives (``T``, ``mod.T``, ``(T, U)``)."""
    if isinstance(node, ast.Tuple):
        return {n for element in node.elts for n in _type_names(element)}
    return {node.id} if isinstance(node, ast.Name) else {node.attr} if isinstance(node, ast.Attribute) else set()


def version_tests_in(tree: ast.AST, types: dict[str, str], attribute_access: bool = True
                     ) -> list[tuple[int, str, str]]:
    """The version tests in ``tree`` as (line, form, name): ``isinstance`` / ``issubclass`` / ``type(x) is`` of a
    version-specific type, ``getattr`` / ``hasattr`` / ``setattr`` of a version-specific attribute, and
    (``attribute_access``) the attribute itself."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            if node.func.id in ("isinstance", "issubclass"):
                found.update((node.lineno, node.func.id, t) for t in _type_names(node.args[1]) & set(types))
            elif (node.func.id in ("getattr", "hasattr", "setattr") and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value in VERSION_ATTRIBUTES):
                found.add((node.lineno, node.func.id, node.args[1].value))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq))
                                                   for op in node.ops):
            names = {n for operand in (node.left, *node.comparators) for n in _type_names(operand)}
            found.update((node.lineno, "type compared", t) for t in names & set(types))
        elif (attribute_access and isinstance(node, ast.Attribute) and node.attr in VERSION_ATTRIBUTES
              and node.attr not in _NAMES_BESIDE):
            found.add((node.lineno, "attribute", node.attr))
    return sorted(found)


def version_test_problems(modules: dict[str, pathlib.Path]) -> list[str]:
    """The version tests outside ``engine/_versions/`` and the tested name's home (empty: none)."""
    types = _version_types(modules)
    homes = {**types, **{name: home for name, (home, _) in VERSION_ATTRIBUTES.items()}}
    problems = []
    for module, path in modules.items():
        if _in_package(module, VERSIONS_PACKAGE):
            continue
        tree = ast.parse(path.read_text(), str(path))
        problems += [f"{module}:{line}: {form} of version-specific {name}" for line, form, name
                     in version_tests_in(tree, types, attribute_access=_in_package(module, ENGINE))
                     if homes[name] != module]
    return problems


def test_versions_are_told_apart_only_in_the_version_modules():
    """No read path tests a manifest's types or attributes to know its version: it asks the version record
    (``version_of(manifest.version)``, a ``FormatVersion``)."""
    assert version_test_problems(MODULES) == []
    assert {"Version1", "Version2", "Version3", "ShardedTable"} <= set(_version_types(MODULES))


def test_the_version_check_catches_the_old_forms():
    """The checker itself, on the three version tests the read paths made before the version record."""
    types = _version_types(MODULES)
    bulk = "if isinstance(getattr(table, 'table', table), IndexTable):\n    indexes.append(table.index)\n"
    incremental = "index = getattr(getattr(table, 'table', None), 'index', None)\n"
    loading = "if entry.complete is not None:\n    shards = entry.complete()\n"
    assert version_tests_in(ast.parse(bulk), types) == [(1, "getattr", "table"), (1, "isinstance", "IndexTable")]
    assert version_tests_in(ast.parse(incremental), types) == [(1, "getattr", "index"), (1, "getattr", "table")]
    assert version_tests_in(ast.parse(loading), types) == [(1, "attribute", "complete"), (2, "attribute", "complete")]
    assert version_tests_in(ast.parse("ok = type(t) is ShardedTable\n"), types) == [
        (1, "type compared", "ShardedTable")]


#: Names defined at the top level of several modules on purpose, with one meaning: why.
SHARED_NAMES = {
    "add_parsers": "each CLI command module's hook adding its subcommands to the parser (cli/__init__ calls each)",
    "expected_shared": "engine/_versions/table picks, per format version, the step of this name; "
                       "engine/_versions/commit_v2 "
                       "defines version 2's",
    "publish": "as expected_shared: a format version's step, picked by engine/_versions/table",
    "merge_and_commit": "as expected_shared: a format version's step, picked by engine/_versions/table",
    "PROFILE": "each store's module under storage/stores/ names its registered profile so (the recipe 'Adding a "
               "store')",
    "VERSION": "each format version's module under engine/_versions/ names its record so, for the table's row "
               "(the recipe 'Adding a format version')",
}


def _top_level_definitions(name: str) -> dict[str, str]:
    """What module ``name`` defines at its top level (classes, functions, assigned names, also under a top-level
    ``if`` or ``try``): each name with the dump of its definition."""
    found: dict[str, str] = {}

    def scan(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[node.name] = ast.dump(node)
            elif isinstance(node, ast.Assign):
                found.update((t.id, ast.dump(node.value)) for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                found[node.target.id] = ast.dump(node.value)
            elif isinstance(node, (ast.If, ast.Try)):
                scan(node.body + node.orelse + getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    scan(handler.body)

    scan(ast.parse(MODULES[name].read_text(), str(MODULES[name])).body)
    return found


def _names_with_two_meanings() -> dict[str, list[str]]:
    """Each name that other modules may import (no leading ``_``) defined differently in two or more modules."""
    definitions: dict[str, dict[str, str]] = defaultdict(dict)
    for module in MODULES:
        for name, dump in _top_level_definitions(module).items():
            if not name.startswith("_"):
                definitions[name][module] = dump
    return {name: sorted(where) for name, where in definitions.items() if len(set(where.values())) > 1}


def test_every_name_has_one_meaning():
    """A name that other modules may import means one thing in the package: no two modules define it differently
    (a copy of the same definition is the same meaning), save the names listed with their reason."""
    twice = _names_with_two_meanings()
    assert {n: where for n, where in twice.items() if n not in SHARED_NAMES} == {}
    assert set(SHARED_NAMES) <= set(twice), "an exception no longer needed: remove it"


def test_a_private_name_is_its_modules_own():
    """A top-level name with a leading ``_`` is private to its module: no other module of ours imports it (its
    meaning then is its module's alone)."""
    imported = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ppe_snapshot")):
                imported.update((module, alias.name) for alias in node.names if alias.name.startswith("_")
                                and f"{node.module}.{alias.name}" not in MODULES)
    assert imported == set()


def test_the_check_sees_imports_inside_functions():
    """The checker itself: a function-level import and a literal importlib call are edges."""
    assert "ppe_snapshot.extension" in GRAPH["ppe_snapshot"]  # imported inside __getattr__
    assert "ppe_snapshot.dcp" in GRAPH["ppe_snapshot"]  # imported inside the deprecation shim
    graph_of = defaultdict(set)
    for a, targets in GRAPH.items():
        for b in targets:
            graph_of[_floor(a)].add(_floor(b))
    assert graph_of[2] <= {0, 1, 2}


def _foreign_imports(name: str) -> set[str]:
    """The modules not of ours that module ``name`` imports, anywhere in it."""
    path = MODULES[name]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return {m for m in found if not m.startswith("ppe_snapshot")}


def test_no_private_module_of_ppe_is_imported():
    private = {(m, f) for m in MODULES for f in _foreign_imports(m)
               if f.startswith("pytorch_pfn_extras.") and any(p.startswith("_") for p in f.split(".")[1:])}
    assert private == set()


def test_what_import_ppe_snapshot_loads_stays_free_of_ppe():
    """The ProcessWriter's worker imports the package: only the extension and the writers' classes may
    load pytorch_pfn_extras (the writers lazily, through ``writing``'s ``__getattr__``)."""
    light = [m for m in MODULES if _floor(m) <= FLOORS["ppe_snapshot.run_dir"] and _package(m) != "ppe_snapshot.writing"
             and m not in ("ppe_snapshot.cli", "ppe_snapshot.ppe_private")]
    assert {m for m in light if any(f.startswith("pytorch_pfn_extras") for f in _foreign_imports(m))} == set()


def test_run_dir_never_imports_the_writers():
    reached = {t for m in MODULES if _package(m) == "ppe_snapshot.run_dir" for t in GRAPH[m]}
    assert not any(_package(t) == "ppe_snapshot.writing" for t in reached)
    assert "ppe_snapshot.writing" not in GRAPH["ppe_snapshot.stored_snapshot"]


def _string_constants(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_what_a_stored_snapshot_is_has_one_home():
    """Its side name, the metadata key of its metrics, its quick check (``verify(deep=False)``) and the removal of
    its manifest first are written only in ``stored_snapshot``."""
    home = "ppe_snapshot.stored_snapshot"
    for module in MODULES:
        if module == home:
            continue
        source = MODULES[module].read_text()
        assert not {".ppe-snapshot-next", "ppe_snapshot_metrics"} & _string_constants(module), module
        assert "verify(deep=False)" not in source.replace("``Snapshot.verify(deep=False)``", ""), module
        assert "rm_file(f\"{target}/{MANIFEST_NAME}\")" not in source, module
    assert {".ppe-snapshot-next", "ppe_snapshot_metrics"} <= _string_constants(home)


#: ppe's private names (and the manager's undocumented ``extensions``) that ppe_snapshot uses: in attribute access
#: or as a string (``getattr(x, "_task")``), only ``ppe_private`` may name them, so that one module and its test
#: (tests/test_ppe_private.py) follow ppe's changes.
PPE_PRIVATE_NAMES = {"_model_available", "_task", "_savefun", "_kwds", "_worker", "_finalized", "_started",
                     "_initialized", "_post_save", "_post_save_hooks", "_add_cleanup_hook", "extensions",
                     "_extensions"}


def test_ppe_private_names_only_in_ppe_private():
    named = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        found = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)} | _string_constants(module)
        if found & PPE_PRIVATE_NAMES:
            named[module] = found & PPE_PRIVATE_NAMES
    assert set(named) == {"ppe_snapshot.ppe_private"}, named


def _depth(cls: type) -> int:
    """Classes on the longest path from ``cls`` up to ``object``, both included."""
    return 1 + max((_depth(base) for base in cls.__bases__), default=0)


def test_writer_and_extension_hierarchies_are_at_most_four_deep():
    """Composition over inheritance: no class of the writers (a core and an executor under ppe's protocol) or of
    the extension is more than four classes from ``object``, ``object`` included (a writer: ours, ppe's
    StandardWriter, ppe's Writer; the DISTRIBUTED extension: ours, SnapshotExtension, ppe's Extension, beside the
    ranks' shared part). Exceptions aside: their depth is Python's."""
    import importlib
    deep = {}
    for module in MODULES:
        if _package(module) not in ("ppe_snapshot.writing", "ppe_snapshot.extension"):
            continue
        for name, value in vars(importlib.import_module(module)).items():
            if (isinstance(value, type) and value.__module__ == module and not issubclass(value, BaseException)
                    and _depth(value) > 4):
                deep[f"{module}.{name}"] = [c.__name__ for c in value.__mro__]
    assert deep == {}


def test_modules_stay_small():
    assert {m: n for m in MODULES if (n := len(MODULES[m].read_text().splitlines())) > 400} == {}


#: What "a file operation" is: the ``os`` / ``os.path`` calls that touch a file system (pure path arithmetic such as
#: ``os.path.join`` / ``abspath`` is not one), and the builtin ``open``.
_OS_FILE_CALLS = {"open", "remove", "unlink", "rename", "renames", "replace", "rmdir", "removedirs", "mkdir",
                  "makedirs", "listdir", "scandir", "walk", "stat", "lstat", "link", "symlink", "readlink",
                  "truncate", "fsync", "chmod", "chown", "utime", "dup2", "close"}
_OS_PATH_QUESTIONS = {"exists", "lexists", "isdir", "isfile", "islink", "ismount", "getsize", "getmtime",
                      "getatime", "getctime", "samefile", "realpath"}
_FILE_MODULES = ("shutil", "fsspec", "tempfile")
#: Above the storage floor, the file operations that are no storage (module -> the calls and why).
_NOT_STORAGE = {
    # this process's identity for the writer records (/proc/self/ns/pid, /proc/<pid>/stat): no snapshot file
    "ppe_snapshot.engine._take.writers": {"readlink", "open"},
    # which host memory is mapped how (/proc/self/maps), to pin staging buffers
    "ppe_snapshot.writing._pinning": {"open"},
    # --quiet points stdout at /dev/null
    "ppe_snapshot.cli.exits": {"open", "dup2", "close"},
}


def _file_operations(name: str) -> set[str]:
    """The file operations module ``name`` calls (``os.unlink``, ``os.path.isdir``, ``open``) and the file-system
    modules it imports (``shutil``, ``fsspec``...)."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found = {f"import {m}" for m in _foreign_imports(name) if m.split(".")[0] in _FILE_MODULES}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            found.add("open")
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "os" \
                and func.attr in _OS_FILE_CALLS:
            found.add(func.attr)
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute)
              and isinstance(func.value.value, ast.Name) and func.value.value.id == "os"
              and func.value.attr == "path" and func.attr in _OS_PATH_QUESTIONS):
            found.add(f"path.{func.attr}")
    return found


def test_files_are_touched_only_on_the_storage_floor():
    """Above ``storage`` every file and directory is reached through it (``Storage`` inside a snapshot, ``Tree``
    around them): no ``os`` file operation, no ``shutil`` / ``fsspec`` import, except what touches no storage."""
    touching = {m: ops - _NOT_STORAGE.get(m, set()) for m in MODULES if _floor(m) > FLOORS["ppe_snapshot.storage"]
                and (ops := _file_operations(m))}
    assert {m: ops for m, ops in touching.items() if ops} == {}


def test_the_file_operation_check_sees_them():
    """The checker itself: the storage floor's own modules are caught."""
    assert "import shutil" in _file_operations("ppe_snapshot.storage.trees")
    assert {"unlink", "path.lexists"} <= _file_operations("ppe_snapshot.storage.trees")
    assert "import fsspec" in _file_operations("ppe_snapshot.storage.fsspec")


# -- the recipe "Adding a format version" (docs/architecture.md), followed on a copy of the package ----------------
_TOY_VERSION = '''"""Format version 99, a toy: version 2's steps under another number, and a table type of its own."""
from __future__ import annotations

import json
from typing import Any

from ppe_snapshot.engine._format import MANIFEST_NAME, Manifest, document_v2_problem
from ppe_snapshot.engine._versions.v2 import Version2
from ppe_snapshot.storage import Storage


class Toy99Table(dict):
    """A table that only version 99 has."""


class Version99(Version2):
    number = 99
    written = True

    def problem(self, doc: dict[str, Any]) -> str | None:
        return document_v2_problem(doc)

    def write(self, storage: Storage, manifest: Manifest) -> None:
        super().write(storage, manifest)  # version 2's index files and manifest.json, then stamped 99
        doc = json.loads(storage.read_bytes(MANIFEST_NAME))
        storage.put_atomic(MANIFEST_NAME, json.dumps({**doc, "version": self.number}).encode())


VERSION = Version99()
'''

#: Run with the copy first on the path and PPE_SNAPSHOT_FORMAT_VERSION=99: a take and a restore in version 99.
_ROUND_TRIP = """
import json, sys
import torch
from ppe_snapshot import Snapshot, StateDict
from ppe_snapshot.engine._versions import version_of

saved = {"w": torch.randn(1000), "opt": {"step": 3, "m": torch.arange(7)}}
Snapshot.take(sys.argv[1], {"model": StateDict(saved)})
model = StateDict({"w": torch.zeros(1000), "opt": {"step": 0, "m": torch.zeros(7, dtype=torch.int64)}})
Snapshot(sys.argv[1]).restore({"model": model})
got = model.state_dict()
assert torch.equal(got["w"], saved["w"]) and torch.equal(got["opt"]["m"], saved["opt"]["m"]) and got["opt"]["step"] == 3
print(json.load(open(sys.argv[1] + "/manifest.json"))["version"], type(version_of(99)).__name__)
"""


def _edit(path: pathlib.Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} moved; update the recipe and this test"
    path.write_text(text.replace(old, new, 1))


def _with_version_99(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of ``ppe_snapshot/`` under ``tmp_path`` with format version 99 added as the recipe says."""
    import shutil

    root = tmp_path / "ppe_snapshot"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    versions = root / "engine" / "_versions"
    (versions / "v99.py").write_text(_TOY_VERSION)  # 1. the version's module
    _edit(versions / "table.py", "import commit_v2, v1, v2, v3\n", "import commit_v2, v1, v2, v3, v99\n")  # 2. its row
    _edit(versions / "table.py", "(v1.VERSION, v2.VERSION, v3.VERSION)",
          "(v1.VERSION, v2.VERSION, v3.VERSION, v99.VERSION)")
    _edit(root / "engine" / "_format" / "names.py", "FORMAT_VERSION: Final = 3", "FORMAT_VERSION: Final = 99")  # 3.
    return root


def layer_problems(root: pathlib.Path) -> list[str]:
    """The checks of this file that concern the engine's packages and versions, over the package at ``root``."""
    modules = modules_of(root)
    graph = graph_of(modules)
    return (engine_problems(modules, graph) + version_test_problems(modules) + version_number_problems(modules)
            + [f"import cycle {sorted(c)}" for c in _cycles(graph)]
            + [f"{m}: over 400 lines" for m, p in modules.items() if len(p.read_text().splitlines()) > 400])


def test_a_format_version_added_by_the_recipe_passes_the_layer_checks(tmp_path):
    """Version 99 added to a copy of the package by the recipe: the layer checks accept it, a take and a restore
    run in it (bit-exact; its manifest says 99); the same copy with a read path that tests the version's type is
    rejected."""
    import sys

    import _warm

    root = _with_version_99(tmp_path)
    assert layer_problems(root) == []
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path), "PPE_SNAPSHOT_FORMAT_VERSION": "99"}
    done = _warm.run([sys.executable, "-c", _ROUND_TRIP, str(tmp_path / "snap")], env=env, cwd=tmp_path,
                     capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["99", "Version99"], done.stderr

    bulk = root / "engine" / "_restore" / "bulk.py"
    bulk.write_text(bulk.read_text() + "\n\ndef _is_toy(table):\n    return isinstance(table, Toy99Table)\n")
    line = len(bulk.read_text().splitlines())
    assert layer_problems(root) == [
        f"ppe_snapshot.engine._restore.bulk:{line}: isinstance of version-specific Toy99Table"]
