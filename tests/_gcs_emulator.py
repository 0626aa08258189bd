"""A Google Cloud Storage emulator (gcp-storage-emulator, from PyPI) on 127.0.0.1 for the tests: started and stopped
by them, its objects in memory.

gcsfs reaches it through ``endpoint_url`` with anonymous credentials. Its first call to a bucket otherwise asks
for the bucket's type over gRPC, which the emulator does not serve (a 60 s wait per bucket): conftest turns that
lookup off with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` before any worker process starts.

gcsfs uploads a small object (an index file, a manifest) as ``multipart/related`` with bare ``\n`` line breaks,
which the emulator parses with the ``email`` package: that takes ``\r\n--boundary`` as the delimiter, so an object
ending in ``\r`` was stored one byte short (its checksum then failing, the snapshot counted as damaged).
:func:`_crlf_closing_delimiter` fixes that up before the emulator parses the body.
"""
from __future__ import annotations

import http.server
import re
import types
from typing import Any

from _dist import free_port


class _Server(http.server.HTTPServer):
    """The emulator's HTTP server (it answers one request at a time), with room for many waiting connections
    (parallel ranged reads open 16) and quiet about clients that hang up before the answer is written."""

    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


def _crlf_closing_delimiter(body: bytes | None, handler: Any) -> bytes | None:
    """A ``multipart/related`` body with bare ``\n`` line breaks, as gcsfs writes it, with ``\r\n`` before its
    closing delimiter, so that the parser strips that and not the last byte of the object when it is ``\r``."""
    content_type = handler.headers.get("Content-Type") or ""
    found = re.search(r'boundary="?([^";]+)', content_type)
    if not body or found is None or not content_type.startswith("multipart/related"):
        return body
    opening, closing = f"--{found.group(1)}\n".encode(), f"\n--{found.group(1)}--".encode()
    if body.startswith(opening) and body.endswith(closing):
        return body[:-len(closing)] + b"\r" + closing
    return body


class GcsEmulator:
    """A running emulator on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        import gcp_storage_emulator.server as emulator

        emulator.server = types.SimpleNamespace(HTTPServer=_Server)  # the module's only use of http.server
        decode = emulator.__dict__.setdefault("_unfixed_decode_raw_data", emulator._decode_raw_data)  # once
        emulator._decode_raw_data = lambda raw, handler: _crlf_closing_delimiter(decode(raw, handler), handler)
        self.port = free_port()
        self._server = emulator.create_server("127.0.0.1", self.port, in_memory=True)
        self._server.start()

    @property
    def storage_options(self) -> dict[str, Any]:
        """What gcsfs (``gs://``, ``gcs://``) takes to reach the emulator."""
        return {"endpoint_url": f"http://127.0.0.1:{self.port}", "token": "anon", "project": "test"}

    def stop(self) -> None:
        self._server.stop()
