"""How the command ends when something goes wrong: one line on stderr naming the path and what to do, the
stores' own log lines without their tracebacks, and quietly when the reader of stdout went away (``| head``)."""
from __future__ import annotations

import argparse
import logging
import os
import select
import sys
import traceback

from ppe_snapshot.cli.common import UsageError
from ppe_snapshot.errors import UnsupportedFormatError

#: Exit status of a user error or a failure.
ERROR_EXIT = 2
#: The exit status of a command whose output pipe closed early: 128 + SIGPIPE, as a shell reports a process
#: that SIGPIPE ended (git, ls, cat), and nothing on stderr.
BROKEN_PIPE_EXIT = 141
#: The arguments of the subcommands that name paths or URLs.
PATH_ARGUMENTS = ("run", "path", "paths", "a", "b", "src", "dst")
#: Errors of the stores' clients that mean no (usable) credentials were found.
CREDENTIAL_ERRORS = frozenset({
    "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",  # botocore (s3://)
    "DefaultCredentialsError", "RefreshError",  # google.auth (gs://)
    "ClientAuthenticationError", "CredentialUnavailableError",  # azure (az://, abfs://)
})
#: What to do about them, by URL scheme.
CREDENTIALS_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials, an instance role), or pass "
          "--storage-option key=... --storage-option secret=... (a public bucket: --storage-option anon=true)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS (or run 'gcloud auth application-default login'), or pass "
          "--storage-option token=<key file> (a public bucket: --storage-option token=anon)",
    "az": "set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY), or "
          "pass --storage-option account_name=... --storage-option account_key=...",
}
SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
OTHER_HINT = "give the store's credentials as its client reads them, or pass them with --storage-option KEY=VALUE"


class _OneLine(logging.Formatter):
    """A store's log record as one line: its traceback (``logger.exception``) left out."""

    def format(self, record: logging.LogRecord) -> str:
        return f"ppe-snapshot: note: {record.name}: {' '.join(record.getMessage().split())}"


def quiet_store_logs(debug: bool) -> None:
    """Warnings that the stores' clients log (gcsfs's retries given up...) as one line each; ``--debug``: as
    they log them, tracebacks included."""
    if debug or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine())
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)


def _urls(args: argparse.Namespace) -> list[str]:
    """The URLs (``scheme://...``) the command line named."""
    found = []
    for name in PATH_ARGUMENTS:
        value = getattr(args, name, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and "://" in item:
                found.append(item)
    return found


def _is_credential_error(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in CREDENTIAL_ERRORS:
            return True
        current = current.__cause__ or current.__context__
    return False


def fail(error: BaseException, args: argparse.Namespace | None, debug: bool) -> int:
    """Say what went wrong in one line on stderr (``--debug``: the traceback first): the URLs the command named
    when the message does not, and what to do about missing credentials. Returns the exit status."""
    if debug:
        traceback.print_exception(error)
    message = " ".join(str(error).split()) or type(error).__name__
    if not isinstance(error, (UsageError, OSError, UnsupportedFormatError)) and type(error).__name__ not in message:
        message = f"{type(error).__name__}: {message}"
    urls = [url for url in (_urls(args) if args is not None else []) if url not in message]
    if urls and not isinstance(error, UsageError):
        message = f"{', '.join(urls)}: {message}"
    if _is_credential_error(error):
        schemes = {SCHEMES.get(url.partition("://")[0].lower()) for url in _urls(args)} if args is not None else set()
        message = f"{message}; " + "; ".join(
            CREDENTIALS_HINTS[scheme] if scheme else OTHER_HINT for scheme in sorted(schemes, key=str) or [None])
    print(f"ppe-snapshot: {message}", file=sys.stderr)
    return ERROR_EXIT


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader went away (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no real stdout
        return False


def drop_stdout() -> int:
    """The reader of stdout went away: what is left to write goes nowhere (so that the interpreter's flush at exit
    does not complain). Returns the exit status."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return BROKEN_PIPE_EXIT


__all__ = ["BROKEN_PIPE_EXIT", "ERROR_EXIT", "drop_stdout", "fail", "quiet_store_logs", "stdout_closed"]
