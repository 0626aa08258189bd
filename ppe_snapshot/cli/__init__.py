"""``ppe-snapshot``: look at, check, compare, convert and prune snapshots from the shell.

One module per concern: ``describe`` (ls, inspect), ``verify``, ``diff``, ``convert``, ``prune``, ``common``
(what a path holds, reading it, storage options, progress bars) and ``exits`` (errors, a closed pipe).
Entry point: :func:`main`.
"""
from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Sequence

import torch

from ppe_snapshot.cli import convert, describe, diff, prune, verify
from ppe_snapshot.cli.common import parse_storage_options
from ppe_snapshot.cli.exits import drop_stdout, fail, quiet_store_logs, stdout_closed

DESCRIPTION = """\
Look at, check, compare, convert and prune snapshots: engine snapshots, DCP directories,
ppe torch.save files and safetensors files, on local paths or fsspec URLs (s3://...).

  ppe-snapshot ls RUN                 the snapshots of a run directory, the one autoload resumes from
  ppe-snapshot inspect PATH           entries (shape, dtype, bytes) and metadata of one snapshot
  ppe-snapshot verify PATH [PATH...]  check snapshots; every damaged entry is named
  ppe-snapshot diff A B               what differs between two snapshots
  ppe-snapshot convert SRC DST --to snapshot|torch|dcp|safetensors
  ppe-snapshot prune RUN --keep-latest N

Nothing is unpickled unless convert --allow-pickle is given.
Exit status: 0 success, 1 damage (verify) or a difference (diff), 2 usage error; 141 (quietly) when the reader
of the output went away (| head)."""


def _version() -> str:
    try:
        ours = version("ppe-snapshot")
    except PackageNotFoundError:
        ours = "unknown"
    return f"ppe-snapshot {ours} (torch {torch.__version__})"


def _common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes (also accepted before the subcommand)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", action="append", metavar="KEY=VALUE", default=argparse.SUPPRESS,
                        help="an fsspec option for URLs (repeatable; dotted keys nest: "
                             "client_kwargs.endpoint_url=http://...)")
    common.add_argument("--storage-options", type=json.loads, metavar="JSON", default=argparse.SUPPRESS,
                        help="fsspec options for URLs as one JSON object")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show a traceback on errors")
    return common


def parser() -> argparse.ArgumentParser:
    common = _common_options()
    top = argparse.ArgumentParser(prog="ppe-snapshot", description=DESCRIPTION, parents=[common],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=_version())
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (describe, verify, diff, convert, prune):
        module.add_parsers(sub, common)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    quiet_store_logs(debug)
    try:
        args.storage_options = parse_storage_options(getattr(args, "storage_option", None),
                                                     getattr(args, "storage_options", None))
        status = args.run_command(args)
        sys.stdout.flush()  # a closed pipe is found here, not in the interpreter's flush at exit
        return status
    except BrokenPipeError as e:
        if not stdout_closed():  # a pipe of something else (a store's connection): an error like any other
            return fail(e, args, debug)
        return drop_stdout()
    except KeyboardInterrupt:
        print("ppe-snapshot: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - user errors are one line; --debug shows the traceback
        return fail(e, args, debug)


__all__ = ["main", "parser"]
