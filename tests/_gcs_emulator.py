"""A Google Cloud Storage emulator (gcp-storage-emulator, from PyPI) on 127.0.0.1 for the tests: started and stopped
by them, its objects in memory.

gcsfs reaches it through ``endpoint_url`` with anonymous credentials. Its first call to a bucket otherwise asks
for the bucket's type over gRPC, which the emulator does not serve (a 60 s wait per bucket): conftest turns that
lookup off with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` before any worker process starts.
"""
from __future__ import annotations

import http.server
import socket
import types
from typing import Any


class _Server(http.server.HTTPServer):
    """The emulator's HTTP server (it answers one request at a time), with room for many waiting connections
    (parallel ranged reads open 16) and quiet about clients that hang up before the answer is written."""

    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class GcsEmulator:
    """A running emulator on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        import gcp_storage_emulator.server as emulator

        emulator.server = types.SimpleNamespace(HTTPServer=_Server)  # the module's only use of http.server
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._server = emulator.create_server("127.0.0.1", self.port, in_memory=True)
        self._server.start()

    @property
    def storage_options(self) -> dict[str, Any]:
        """What gcsfs (``gs://``, ``gcs://``) takes to reach the emulator."""
        return {"endpoint_url": f"http://127.0.0.1:{self.port}", "token": "anon", "project": "test"}

    def stop(self) -> None:
        self._server.stop()
