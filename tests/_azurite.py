"""Azurite, Azure's blob storage emulator (from npm), on 127.0.0.1 for the tests: started and stopped by them.

``make venv`` installs it under ``.venv/node`` when npm is there; tests that need it are skipped, saying why,
where it is not installed.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

from _dist import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Azurite's well-known development account (public: the emulator accepts only it).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def binary() -> str | None:
    """The azurite-blob executable: the one ``make venv`` installed, else one on PATH; None when there is none."""
    local = os.path.join(os.environ.get("VIRTUAL_ENV") or os.path.join(REPO, ".venv"), "node", "node_modules",
                         ".bin", "azurite-blob")
    return local if os.path.exists(local) else shutil.which("azurite-blob")


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
