"""``diff``: what differs between two snapshots of any supported kind; exit 0 equal, 1 different."""
from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch

from ppe_snapshot.cli.common import flatten, open_source, progress, read_state


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
                report["values"].append({"key": key, "a": repr(x)[:60], "b": repr(y)[:60]})
    report["equal"] = not any(report[k] for k in ("only_in_a", "only_in_b", "changed", "values"))
    return report


def cmd_diff(args: argparse.Namespace) -> int:
    states = []
    for path in (args.a, args.b):
        state, _ = read_state(open_source(path, args.storage_options))
        states.append(flatten(state, distinct=True))
    report = compare(states[0], states[1], args.atol)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["equal"] else 1
    if report["equal"]:
        print(f"equal: {len(states[0])} entries" + (f" (atol {args.atol:g})" if args.atol else ""))
        return 0
    for key in report["only_in_a"]:
        print(f"only in A: {key}")
    for key in report["only_in_b"]:
        print(f"only in B: {key}")
    for item in report["changed"]:
        print(f"changed:   {item['key']}: {item['a']} -> {item['b']}")
    for item in report["values"]:
        if "max_abs_diff" in item:
            print(f"differs:   {item['key']}: max abs diff {item['max_abs_diff']:.6g}")
        else:
            print(f"differs:   {item['key']}: {item['a']} -> {item['b']}")
    return 1


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("diff", parents=[common], help="compare two snapshots; exit 1 if they differ",
                       description="Compare the state of two snapshots (any supported kinds; nested keys joined "
                                   "with '.'): keys only in A or only in B, dtype or shape changes, tensors whose "
                                   "values differ (with the max abs difference) and other values that differ. "
                                   "Exit status: 0 equal, 1 different, 2 usage error.")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--atol", type=float, default=0.0, help="tensors within this max abs difference are equal")
    p.set_defaults(run_command=cmd_diff)
