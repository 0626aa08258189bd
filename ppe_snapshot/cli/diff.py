"""``diff``: what differs between two snapshots of any supported kind; exit 0 equal, 1 different."""
from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch

from ppe_snapshot.cli.common import (
    STATE_KEY, Kind, joined_names, key_of, keyed, open_source, progress, read_app_state,
)

#: About how many characters of a value that differs are shown.
SHOWN = 60


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype == torch.bool:
        return float((a != b).any())
    if a.is_complex():
        return float((a - b).abs().max()) if a.numel() else 0.0
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _equal_values(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and np.array_equal(a, b)
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - values that cannot be compared differ
        return False


def shown_apart(a: str, b: str, width: int = SHOWN) -> tuple[str, str]:
    """``a`` and ``b`` cut to about ``width`` characters around their first difference, so they show it."""
    if len(a) <= width and len(b) <= width:
        return a, b
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, first - width // 3)

    def cut(text: str) -> str:
        return ("..." if start else "") + text[start:start + width] + ("..." if start + width < len(text) else "")
    return cut(a), cut(b)


def _differences(report: dict[str, Any]) -> bool:
    """Whether a report of :func:`compare` (its own entries, not its ``rng`` section) lists any difference."""
    return any(report[k] for k in ("only_in_a", "only_in_b", "changed", "values"))


def compare(a: dict[str, Any], b: dict[str, Any], atol: float) -> dict[str, Any]:
    """Keys only in A / only in B, dtype or shape changes, differing tensors (max abs diff) and values."""
    report: dict[str, Any] = {"only_in_a": sorted(set(a) - set(b)), "only_in_b": sorted(set(b) - set(a)),
                              "changed": [], "values": []}
    common = sorted(set(a) & set(b))
    total = sum(v.numel() * v.element_size() for k in common if isinstance(v := a[k], torch.Tensor))
    with progress(total, "diff") as bar:
        for key in common:
            x, y = a[key], b[key]
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                bar.update(x.numel() * x.element_size())
                if x.dtype != y.dtype or x.shape != y.shape:
                    report["changed"].append({"key": key, "a": f"{str(x.dtype).removeprefix('torch.')}"
                                              f"{list(x.shape)}", "b": f"{str(y.dtype).removeprefix('torch.')}"
                                              f"{list(y.shape)}"})
                    continue
                diff = _max_abs_diff(x, y)
                nan_mismatch = x.is_floating_point() and not torch.equal(x.isnan(), y.isnan())
                if diff > atol or nan_mismatch or (diff != diff):
                    report["values"].append({"key": key, "max_abs_diff": diff})
            elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                report["changed"].append({"key": key, "a": type(x).__name__, "b": type(y).__name__})
            elif not _equal_values(x, y):
                report["values"].append({"key": key, **dict(zip("ab", shown_apart(repr(x), repr(y))))})
    report["equal"] = not _differences(report)
    return report


def cmd_diff(args: argparse.Namespace) -> int:
    sources = [open_source(path, args.storage_options) for path in (args.a, args.b)]
    loaded = [read_app_state(source) for source in sources]
    states = [keyed(values) for values, _ in loaded]
    for this, other in ((0, 1), (1, 0)):
        if sources[this].kind == Kind.SAFETENSORS and sources[other].kind != Kind.SAFETENSORS:
            states[this] = _lined_up(loaded[this][0][STATE_KEY], loaded[other][0])
    report = compare(states[0], states[1], args.atol)
    rngs = [_generators(rng) for _, rng in loaded]
    if not args.ignore_rng and rngs[0] and rngs[1]:  # both hold RNG states: the generators must match exactly
        report["rng"] = _compare_generators(*rngs)
        report["equal"] = report["equal"] and report["rng"]["equal"]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["equal"] else 1
    atol = f" (atol {args.atol:g})" if args.atol else ""
    if report["equal"]:
        print(f"equal: {len(states[0])} entries{', RNG states equal' if 'rng' in report else ''}{atol}")
        return 0
    if not _differences(report):  # only the RNG states differ
        print(f"equal: {len(states[0])} entries{atol}, but the RNG states differ (--ignore-rng to leave them out):")
    _print_report(report)
    if "rng" in report and not report["rng"]["equal"]:
        _print_report(report["rng"], "RNG ")
    return 1


def _lined_up(tensors: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """A safetensors file's tensors by the keys of the entries of ``other`` (an app state) whose names ``convert``
    would write them under (``models.main.0.weight`` -> ``0/state/models/main/0.weight``); the others by their
    own key."""
    keys = joined_names(other)
    return {keys.get(name, key_of(STATE_KEY, name)): value for name, value in tensors.items()}


def _generators(rng: dict[str, Any]) -> dict[str, Any]:
    """Every generator's state by its key (``0/rng/0/torch``, ``0/gen/numpy``) from the RNG states of a snapshot."""
    out: dict[str, Any] = {}
    for key, state in rng.items():
        by_rank = state if all(isinstance(v, dict) for v in state.values()) else {None: state}
        for rank, generators in by_rank.items():
            for name, value in generators.items():
                out[key_of(*(str(part) for part in (key, rank, name) if part is not None))] = value
    return out


def _same(a: Any, b: Any) -> bool:
    """Exact equality of generator states (tensors, arrays, tuples and lists of them, numbers)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return _equal_values(a, b)


def _compare_generators(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``compare``'s report for two snapshots' generators: a generator differs or not (no amounts)."""
    report: dict[str, Any] = {"only_in_a": sorted(set(a) - set(b)), "only_in_b": sorted(set(b) - set(a)),
                              "changed": [], "values": []}
    for key in sorted(set(a) & set(b)):
        if not _same(a[key], b[key]):
            report["values"].append({"key": key})
    report["equal"] = not _differences(report)
    return report


def _print_report(report: dict[str, Any], section: str = "") -> None:
    for key in report["only_in_a"]:
        print(f"{section}only in A: {key}")
    for key in report["only_in_b"]:
        print(f"{section}only in B: {key}")
    for item in report["changed"]:
        print(f"{section}changed:   {item['key']}: {item['a']} -> {item['b']}")
    for item in report["values"]:
        if "max_abs_diff" in item:
            print(f"{section}differs:   {item['key']}: max abs diff {item['max_abs_diff']:.6g}")
        elif "a" in item:
            print(f"{section}differs:   {item['key']}: {item['a']} -> {item['b']}")
        else:
            print(f"{section}differs:   {item['key']}")


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("diff", parents=[common], help="compare two snapshots; exit 1 if they differ",
                       description="Compare the state of two snapshots (any supported kinds; keys as inspect "
                                   "prints them and read_object takes them, 0/state/models/main/0.weight): keys only in A or only in B, dtype or shape changes, tensors whose "
                                   "values differ (with the max abs difference) and other values that differ (long "
                                   "ones shown around their first difference); RNG states (recognised by what was "
                                   "saved) in a section of their own. Exit status: 0 equal, 1 different, 2 usage "
                                   "error.")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--atol", type=float, default=0.0, help="tensors within this max abs difference are equal")
    p.add_argument("--ignore-rng", action="store_true",
                   help="leave the RNG states out (compared exactly by default, reported in their own section)")
    p.set_defaults(run_command=cmd_diff)
