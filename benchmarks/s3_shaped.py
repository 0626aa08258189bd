"""A lean in-memory S3 server and a traffic-shaping TCP proxy in front of it, for benchmarks.

    python benchmarks/s3_shaped.py [--rate-mb 40] [--latency-ms 15] [--upstream http://127.0.0.1:PORT]

prints one JSON line ``{"endpoint": <server>, "proxy": <proxy>}`` and serves until stdin closes.

The server speaks as much S3 (path-style, no authentication) as s3fs, boto3 / s3transfer and DCP's fsspec
storage need: create bucket, PUT / GET (with ``Range``) / HEAD / DELETE / copy of objects, multi-object delete,
ListObjectsV2 (prefix, delimiter), and multipart create / upload-part / complete / abort. Bodies are kept
as the bytes objects they arrived in (a completed multipart object is its parts, not a joined copy) and
served as memoryview slices, so the server costs little CPU beside the clients. ETags are random: nothing
here hashes the data. ``aws-chunked`` bodies (checksum trailers) are decoded.

With ``--upstream``, no S3 server runs here: the proxy shapes the connections to that server (the GCS and
Azure emulators of ``bench_gcs_azure.py``), and ``endpoint`` is that server.

The proxy gives every connection a bandwidth cap per direction (``--rate-mb`` MB/s) and delays every byte
by half of ``--latency-ms`` in each direction (so each round trip gains the latency). ``GET /__stats`` on the
server answers, for the connections through the proxy since the last ``POST /__reset``: how many carried
at least 1 MiB (``busy``), the most that were open at once (``peak_open``), the most that moved bytes
within one 100 ms window (``peak_active``), and the most that had bytes in transit in the proxy at once
(``peak_carrying``: the connections really used in parallel).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import sys
import time
import uuid
from email.utils import formatdate
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

_XML = '<?xml version="1.0" encoding="UTF-8"?>'
_NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


class _Object:
    """An object as a list of bytes segments (the parts of a multipart upload stay separate)."""

    def __init__(self, segments: list[bytes]) -> None:
        self.segments = [s for s in segments if s]
        self.starts, total = [], 0
        for s in self.segments:
            self.starts.append(total)
            total += len(s)
        self.size = total
        self.etag = f'"{uuid.uuid4().hex}"'
        self.modified = formatdate(time.time(), usegmt=True)

    def views(self, start: int, end: int) -> list[memoryview]:
        """Memoryviews of bytes ``start..end`` (end exclusive)."""
        out = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while start < end and i < len(self.segments):
            base, seg = self.starts[i], self.segments[i]
            piece = memoryview(seg)[start - base:min(end - base, len(seg))]
            out.append(piece)
            start += len(piece)
            i += 1
        return out


class Store:
    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, _Object]] = {}
        self.uploads: dict[str, tuple[str, str, dict[int, bytes]]] = {}


class Stats:
    """What the proxied connections did since the last reset."""

    WINDOW = 0.1  # seconds: a connection that moved bytes within the last window is active

    def __init__(self) -> None:
        self.conns: dict[int, int] = {}  # id -> bytes moved since reset
        self.last_moved: dict[int, float] = {}  # id -> loop time bytes last moved
        self.open = 0
        self.peak_open = 0
        self.peak_active = 0
        self.carrying: dict[int, int] = {}  # connection -> its directions holding bytes in the proxy
        self.peak_carrying = 0

    def moved(self, key: int, n: int, now: float) -> None:
        if key in self.conns:
            self.conns[key] += n
        self.last_moved[key] = now

    def sample(self, now: float) -> None:
        active = sum(1 for t in self.last_moved.values() if now - t <= self.WINDOW)
        self.peak_active = max(self.peak_active, active)
        for key in [k for k, t in self.last_moved.items() if now - t > 10]:
            del self.last_moved[key]

    def carry(self, key: int, delta: int) -> None:
        """A direction of connection ``key`` starts (+1) or stops (-1) holding bytes in the proxy."""
        count = self.carrying.get(key, 0) + delta
        if count:
            self.carrying[key] = count
        else:
            self.carrying.pop(key, None)
        self.peak_carrying = max(self.peak_carrying, len(self.carrying))

    def reset(self) -> None:
        self.conns = {k: 0 for k in self.conns}
        self.peak_open = self.open
        self.peak_active = 0
        self.peak_carrying = len(self.carrying)

    def report(self) -> dict:
        return {"busy": sum(1 for v in self.conns.values() if v >= 1 << 20), "peak_open": self.peak_open,
                "peak_active": self.peak_active, "peak_carrying": self.peak_carrying}


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        pieces = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                break
            pieces.append(await reader.readexactly(size))
            await reader.readline()
        body = b"".join(pieces)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
    if "aws-chunked" in headers.get("content-encoding", ""):
        body = _decode_aws_chunked(body)
    return body


def _decode_aws_chunked(body: bytes) -> bytes:
    out, pos = [], 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[eol + 2:eol + 2 + size])
        pos = eol + 2 + size + 2


class Server:
    def __init__(self, store: Store, stats: Stats) -> None:
        self.store, self.stats = store, stats

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = h.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await _read_body(reader, headers)
                status, extra, payload = self.route(method, target, headers, body)
                length = extra.pop("Content-Length", None) or sum(len(p) for p in payload)
                head = [f"HTTP/1.1 {status} X", f"Content-Length: {length}", "Server: lean-s3",
                        f"x-amz-request-id: {uuid.uuid4().hex[:16]}"]
                head += [f"{k}: {v}" for k, v in extra.items()]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
                if method != "HEAD":
                    for piece in payload:
                        writer.write(piece)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def route(self, method: str, target: str, headers: dict[str, str], body: bytes):
        split = urlsplit(target)
        query = {k: v[0] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        parts = unquote(split.path).lstrip("/").split("/", 1)
        bucket, key = parts[0], (parts[1] if len(parts) > 1 else "")
        if bucket == "__stats":
            return 200, {"Content-Type": "application/json"}, [json.dumps(self.stats.report()).encode()]
        if bucket == "__reset":
            self.stats.reset()
            return 200, {}, []
        objects = self.store.buckets.get(bucket)
        if not key:
            return self.bucket_op(method, bucket, query, body)
        if objects is None:
            return _error(404, "NoSuchBucket", bucket)
        if method == "PUT" and "uploadId" in query:
            upload = self.store.uploads.get(query["uploadId"])
            if upload is None:
                return _error(404, "NoSuchUpload", key)
            upload[2][int(query["partNumber"])] = body
            return 200, {"ETag": f'"{uuid.uuid4().hex}"'}, []
        if method == "PUT" and "x-amz-copy-source" in headers:  # a copy (s3fs's rename)
            source_bucket, _, source_key = unquote(headers["x-amz-copy-source"]).lstrip("/").partition("/")
            source = self.store.buckets.get(source_bucket, {}).get(source_key.split("?")[0])
            if source is None:
                return _error(404, "NoSuchKey", source_key)
            objects[key] = obj = _Object(source.segments)
            xml = (f"{_XML}<CopyObjectResult {_NS}><ETag>{escape(obj.etag)}</ETag>"
                   f"<LastModified>2026-01-01T00:00:00.000Z</LastModified></CopyObjectResult>")
            return 200, {"Content-Type": "application/xml"}, [xml.encode()]
        if method == "PUT":
            objects[key] = obj = _Object([body])
            return 200, {"ETag": obj.etag}, []
        if method == "POST" and "uploads" in query:
            upload_id = uuid.uuid4().hex
            self.store.uploads[upload_id] = (bucket, key, {})
            xml = (f"{_XML}<InitiateMultipartUploadResult {_NS}><Bucket>{bucket}</Bucket><Key>{escape(key)}</Key>"
                   f"<UploadId>{upload_id}</UploadId></InitiateMultipartUploadResult>")
            return 200, {"Content-Type": "application/xml"}, [xml.encode()]
        if method == "POST" and "uploadId" in query:
            upload = self.store.uploads.pop(query["uploadId"], None)
            if upload is None:
                return _error(404, "NoSuchUpload", key)
            numbers = [int(n.split(b"</PartNumber>")[0]) for n in body.split(b"<PartNumber>")[1:]]
            objects[key] = obj = _Object([upload[2][n] for n in sorted(numbers)])
            xml = (f"{_XML}<CompleteMultipartUploadResult {_NS}><Bucket>{bucket}</Bucket><Key>{escape(key)}</Key>"
                   f"<ETag>{escape(obj.etag)}</ETag></CompleteMultipartUploadResult>")
            return 200, {"Content-Type": "application/xml"}, [xml.encode()]
        if method == "DELETE" and "uploadId" in query:
            self.store.uploads.pop(query["uploadId"], None)
            return 204, {}, []
        if method == "DELETE":
            objects.pop(key, None)
            return 204, {}, []
        obj = objects.get(key)
        if obj is None:
            return _error(404, "NoSuchKey", key) if method == "GET" else (404, {}, [])
        meta = {"ETag": obj.etag, "Last-Modified": obj.modified, "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream"}
        if method == "HEAD":
            return 200, {**meta, "Content-Length": str(obj.size)}, []
        rng = headers.get("range")
        if rng:
            first, _, last = rng.split("=", 1)[1].partition("-")
            start = int(first)
            end = min(obj.size, int(last) + 1 if last else obj.size)
            if start >= obj.size:
                return _error(416, "InvalidRange", key)
            return 206, {**meta, "Content-Range": f"bytes {start}-{end - 1}/{obj.size}"}, obj.views(start, end)
        return 200, meta, obj.views(0, obj.size)

    def bucket_op(self, method: str, bucket: str, query: dict, body: bytes):
        objects = self.store.buckets.get(bucket)
        if method == "PUT":
            self.store.buckets.setdefault(bucket, {})
            return 200, {}, []
        if objects is None:
            return _error(404, "NoSuchBucket", bucket)
        if method == "HEAD":
            return 200, {}, []
        if method == "DELETE":
            del self.store.buckets[bucket]
            return 204, {}, []
        if method == "POST" and "delete" in query:
            keys = [unquote(k.split(b"</Key>")[0].decode()) for k in body.split(b"<Key>")[1:]]
            for k in keys:
                objects.pop(k, None)
            xml = f"{_XML}<DeleteResult {_NS}>" + "".join(
                f"<Deleted><Key>{escape(k)}</Key></Deleted>" for k in keys) + "</DeleteResult>"
            return 200, {"Content-Type": "application/xml"}, [xml.encode()]
        if method == "GET" and "location" in query:
            return 200, {}, [f"{_XML}<LocationConstraint {_NS}/>".encode()]
        if method == "GET":
            return self.listing(bucket, objects, query)
        return _error(400, "NotImplemented", method)

    def listing(self, bucket: str, objects: dict[str, _Object], query: dict):
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        keys, prefixes = [], set()
        for k in sorted(objects):
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix):]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
            else:
                keys.append(k)
        contents = "".join(
            f"<Contents><Key>{escape(k)}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
            f"<ETag>{escape(objects[k].etag)}</ETag><Size>{objects[k].size}</Size><StorageClass>STANDARD"
            f"</StorageClass></Contents>" for k in keys)
        common = "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in sorted(prefixes))
        xml = (f"{_XML}<ListBucketResult {_NS}><Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix>"
               f"<KeyCount>{len(keys) + len(prefixes)}</KeyCount><MaxKeys>100000</MaxKeys>"
               f"<Delimiter>{escape(delimiter)}</Delimiter><IsTruncated>false</IsTruncated>{contents}{common}"
               f"</ListBucketResult>")
        return 200, {"Content-Type": "application/xml"}, [xml.encode()]


def _error(status: int, code: str, resource: str):
    xml = f"{_XML}<Error><Code>{code}</Code><Message>{code}</Message><Resource>{escape(resource)}</Resource></Error>"
    return status, {"Content-Type": "application/xml"}, [xml.encode()]


class _Direction:
    """One direction of a proxied connection: bytes go out ``delay`` s after they arrived, at most ``rate`` B/s."""

    HIGH = 4 << 20  # bytes queued before the source is paused

    def __init__(self, proxy: "Proxy", key: int) -> None:
        self.proxy, self.key = proxy, key
        self.source: asyncio.Transport | None = None
        self.dest: asyncio.Transport | None = None
        self.pending: list[bytes] = []  # arrived before the destination was connected
        self.free_at = 0.0
        self.queued = 0
        self.paused = False

    def feed(self, data: bytes) -> None:
        if self.dest is None:
            self.pending.append(data)
            return
        loop = self.proxy.loop
        send_at = max(loop.time() + self.proxy.delay, self.free_at)
        self.free_at = send_at + len(data) / self.proxy.rate
        if not self.queued:
            self.proxy.stats.carry(self.key, 1)
        self.queued += len(data)
        loop.call_at(send_at, self._send, data)
        if self.queued > self.HIGH and not self.paused and self.source is not None:
            self.paused = True
            self.source.pause_reading()

    def _send(self, data: bytes) -> None:
        assert self.dest is not None
        if not self.dest.is_closing():
            self.dest.write(data)
        self.queued -= len(data)
        if not self.queued:
            self.proxy.stats.carry(self.key, -1)
        self.proxy.stats.moved(self.key, len(data), self.proxy.loop.time())
        if self.paused and self.queued <= self.HIGH // 2 and self.source is not None:
            self.paused = False
            self.source.resume_reading()

    def connect(self, dest: asyncio.Transport) -> None:
        self.dest = dest
        for data in self.pending:
            self.feed(data)
        self.pending = []

    def close(self) -> None:
        """The source ended: close the destination once everything queued has gone out."""
        if self.dest is not None:
            self.proxy.loop.call_at(max(self.free_at, self.proxy.loop.time()) + 0.001, self.dest.close)


class _Side(asyncio.Protocol):
    def __init__(self, outgoing: _Direction, on_lost=None) -> None:
        self.outgoing, self.on_lost = outgoing, on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.outgoing.source = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.outgoing.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.outgoing.close()
        if self.on_lost is not None:
            self.on_lost()


class Proxy:
    """Per connection and direction: at most ``rate`` bytes/s, every byte delayed by ``delay`` seconds."""

    def __init__(self, upstream: tuple[str, int], rate: float, delay: float, stats: Stats) -> None:
        self.upstream, self.rate, self.delay, self.stats = upstream, rate, delay, stats
        self.loop = asyncio.get_running_loop()

    def protocol(self) -> asyncio.Protocol:
        """The protocol of one accepted client connection; it opens its own connection to the server."""
        key = uuid.uuid4().int
        up, down = _Direction(self, key), _Direction(self, key)
        stats = self.stats
        stats.conns[key] = 0
        stats.open += 1
        stats.peak_open = max(stats.peak_open, stats.open)

        def lost() -> None:
            stats.open -= 1

        client = _Side(up, lost)

        async def connect() -> None:
            transport, _ = await self.loop.create_connection(lambda: _Side(down), *self.upstream)
            up.connect(transport)
            down.connect(client_transport[0])

        client_transport: list = []
        original = client.connection_made

        def made(transport: asyncio.BaseTransport) -> None:
            original(transport)
            client_transport.append(transport)
            self.loop.create_task(connect())

        client.connection_made = made  # type: ignore[method-assign]
        return client


async def serve(rate_mb: float, latency_ms: float, upstream: str | None = None) -> None:
    store, stats = Store(), Stats()
    if upstream is None:
        server = await asyncio.start_server(Server(store, stats).handle, "127.0.0.1", 0, limit=64 << 20)
        port = server.sockets[0].getsockname()[1]
    else:  # shape the connections to another server (no statistics then)
        port = urlsplit(upstream).port
    shaper = Proxy(("127.0.0.1", port), rate_mb * 1e6, latency_ms / 2000, stats)
    proxy = await asyncio.get_running_loop().create_server(shaper.protocol, "127.0.0.1", 0)
    proxy_port = proxy.sockets[0].getsockname()[1]
    print(json.dumps({"endpoint": upstream or f"http://127.0.0.1:{port}", "proxy": f"http://127.0.0.1:{proxy_port}"}),
          flush=True)
    loop = asyncio.get_running_loop()

    def sample() -> None:
        stats.sample(loop.time())
        loop.call_later(Stats.WINDOW / 2, sample)

    sample()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    os._exit(0)  # without cancelling the connections' tasks one by one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mb", type=float, default=40.0, help="per-connection cap, MB/s each way")
    parser.add_argument("--latency-ms", type=float, default=15.0, help="added to every round trip")
    parser.add_argument("--upstream", help="shape the connections to this server (http://127.0.0.1:PORT) instead "
                                           "of serving S3 here")
    args = parser.parse_args()
    asyncio.run(serve(args.rate_mb, args.latency_ms, args.upstream))


if __name__ == "__main__":
    main()
