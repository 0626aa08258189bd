"""Azurite, Azure's blob storage emulator (from npm), on 127.0.0.1 for the tests: started and stopped by them.

``make venv`` installs it under ``<venv>/node`` when npm is there; tests that need it are skipped, saying why,
where it is not installed.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from _dist import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Azurite's well-known development account (public: the emulator accepts only it).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def binary() -> str | None:
    """The azurite-blob executable: the one ``make venv`` installed (in the virtualenv running the tests, which
    ``make test VENV=...`` need not activate, an active one, or the checkout's ``.venv``), else one on PATH; None
    when there is none."""
    for venv in (sys.prefix, os.environ.get("VIRTUAL_ENV"), os.path.join(REPO, ".venv")):
        local = os.path.join(venv or "", "node", "node_modules", ".bin", "azurite-blob")
        if venv and os.path.exists(local):
            return local
    return shutil.which("azurite-blob")


class Azurite:
    """A running azurite-blob process on a free port of 127.0.0.1, its data in a temporary directory."""

    def __init__(self, executable: str) -> None:
        self.port = free_port()
        self._data = tempfile.mkdtemp(prefix="azurite-")
        self._process = subprocess.Popen(
            [executable, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", self._data,
             "--skipApiVersionCheck", "--loose", "--silent"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("azurite did not start: " + self._process.stderr.read().decode()[-2000:])
                time.sleep(0.1)

    @property
    def storage_options(self) -> dict[str, str]:
        """What adlfs (``az://``) takes to reach the emulator."""
        return {"connection_string": f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                                     f"BlobEndpoint=http://127.0.0.1:{self.port}/{ACCOUNT};"}

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self._data, ignore_errors=True)
