"""A fault-injecting HTTP proxy on 127.0.0.1 in front of a test object-store server (S3, GCS or Azure).

Requests pass through unchanged, except those matching a rule, which get the
rule's status (an S3-style XML error) instead of reaching the server. Every
request is logged as ``(method, path with query, status)`` for the tests to
count attempts. A gate (``hold_until``) holds the first matching requests
until that many are in the proxy at once: proof that a client sends them in
parallel (a client sending one at a time gets 500s when the gate gives up).
A cut (``cut_off``) forwards a request but sends only the first half of the
response's body, announced whole, then closes the connection (logged as 0).
"""
from __future__ import annotations

import http.client
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_ERROR_CODES = {500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout"}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}


@dataclass
class _Rule:
    method: str
    pattern: re.Pattern
    statuses: list[int]  # consumed one per matching request
    forever: bool

    def take(self, method: str, path: str) -> int | None:
        if method != self.method or not self.pattern.search(path) or not self.statuses:
            return None
        return self.statuses[0] if self.forever else self.statuses.pop(0)


class FaultProxy:
    """``FaultProxy(upstream_url)``; use :attr:`url` as the S3 endpoint."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname, parts.port)
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self.log: list[tuple[str, str, int]] = []
        self._gates: list[tuple[str, re.Pattern, threading.Barrier, list[int], float]] = []
        self._cuts: list[_Rule] = []
        self.gates_passed = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def fail(self, method: str, pattern: str, statuses: list[int]) -> None:
        """The next requests of ``method`` whose path matches ``pattern`` get ``statuses``, one each."""
        with self._lock:
            self._rules.append(_Rule(method, re.compile(pattern), list(statuses), False))

    def fail_always(self, method: str, pattern: str, status: int) -> None:
        with self._lock:
            self._rules.append(_Rule(method, re.compile(pattern), [status], True))

    def cut_off(self, method: str, pattern: str, count: int) -> None:
        """The next ``count`` responses to requests of ``method`` matching ``pattern`` break off halfway."""
        with self._lock:
            self._cuts.append(_Rule(method, re.compile(pattern), [0] * count, False))

    def hold_until(self, method: str, pattern: str, count: int, timeout: float = 30.0) -> None:
        """Hold the first ``count`` requests of ``method`` matching ``pattern`` until all ``count`` have arrived;
        if they do not within ``timeout`` seconds, those held get 500. :attr:`gates_passed` counts gates opened."""
        with self._lock:
            self._gates.append((method, re.compile(pattern), threading.Barrier(count), [count], timeout))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def requests(self, method: str, pattern: str) -> list[int]:
        """Statuses of the logged requests of ``method`` whose path matches ``pattern``, in order."""
        with self._lock:
            return [status for m, path, status in self.log if m == method and re.search(pattern, path)]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _injected(self, method: str, path: str) -> int | None:
        with self._lock:
            for rule in self._rules:
                status = rule.take(method, path)
                if status is not None:
                    return status
        return None

    def _gate(self, method: str, path: str) -> int | None:
        """Wait at the first open gate this request matches; 500 when the gate gave up."""
        with self._lock:
            for gate_method, pattern, barrier, left, timeout in self._gates:
                if gate_method == method and pattern.search(path) and left[0] > 0:
                    left[0] -= 1
                    break
            else:
                return None
        try:
            if barrier.wait(timeout) == 0:
                with self._lock:
                    self.gates_passed += 1
        except threading.BrokenBarrierError:
            return 500
        return None

    def _cut(self, method: str, path: str) -> bool:
        with self._lock:
            return any(rule.take(method, path) is not None for rule in self._cuts)

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.log.append((method, path, status))

    def _handler_class(self) -> type:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                status = proxy._gate(self.command, self.path) or proxy._injected(self.command, self.path)
                if status is not None:
                    code = _ERROR_CODES.get(status, "InternalError")
                    data = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                            f"<Message>injected by the test proxy</Message></Error>").encode()
                    headers, length = [("Content-Type", "application/xml")], None
                else:
                    status, headers, data, length = self._forward(body)
                    if status < 300 and proxy._cut(self.command, self.path):
                        proxy._record(self.command, self.path, 0)
                        self._send(status, headers, data[:len(data) // 2], str(len(data)))
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                proxy._record(self.command, self.path, status)  # before the client can see the reply
                self._send(status, headers, data, length)

            def _forward(self, body: bytes) -> tuple[int, list, bytes, str | None]:
                conn = http.client.HTTPConnection(*proxy._upstream, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                            conn.putheader(name, value)
                    conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body)
                    response = conn.getresponse()
                    data = response.read()
                    headers = [(k, v) for k, v in response.getheaders()
                               if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"]
                    length = response.getheader("Content-Length") if self.command == "HEAD" else None
                    return response.status, headers, data, length
                finally:
                    conn.close()

            def _send(self, status: int, headers: list, data: bytes, length: str | None = None) -> None:
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler
