"""Save and restore on S3 through a shaping proxy: ppe-snapshot against s3fs, boto3's TransferManager and DCP.

A lean in-memory S3 server and a proxy in front of it (``s3_shaped.py``, a separate process) cap every
connection at ``--rate-mb`` MB/s each way and add ``--latency-ms`` to each round trip, like a store across a
network where one connection is slow and many are fast. Two states of float32 tensors: 8 x 64 MiB and
512 x 1 MiB (512 MiB each; ``--scale`` shrinks both). Every method saves, then restores into existing
tensors (checked bit-exact once per method and state) after one untimed warm-up save and restore per method
(sessions, connection pools); methods are interleaved round by round and the report
gives medians, ratios to the best peer, and the most connections with bytes in transit in the proxy at once
(save / restore: the connections used in parallel).

    python benchmarks/bench_s3.py [--rounds 2] [--scale 1.0] [--rate-mb 40] [--latency-ms 15] [--no-dcp]
                                  [--torchsnapshot DIR]

Methods:
  ppe-snapshot    Snapshot.take / restore (defaults: 8 MiB parts, 16 in flight; 8 MiB ranges, 32 readers)
  ppe-snapshot-x8 the same with 8 parts / 8 ranges in flight (the peers' connection count)
  s3fs            fs.pipe({key: bytes}) / fs.cat([keys]), one object per tensor, s3fs defaults
  boto3           s3transfer TransferManager, 16 MiB parts, 8 threads, one object per tensor (reads straight
                  into the tensors)
  dcp             torch.distributed.checkpoint with FsspecWriter(thread_count=8) / FsspecReader over s3fs
  torchsnapshot   torchsnapshot 0.1.0 (aiobotocore), only with ``--torchsnapshot DIR``: a directory it is installed
                  in (``pip install --target DIR --no-deps torchsnapshot psutil aiofiles pyyaml "importlib_metadata<8"
                  zipp``; it is no dependency of this project), endpoint given through ``AWS_ENDPOINT_URL``
Peak RSS of a ppe-snapshot take of the full state is measured in a fresh process (``--rss``).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
import uuid
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRSS, Results, emit, mib  # noqa: E402

BUCKET = "bench"
CREDENTIALS = {"key": "bench", "secret": "bench"}


def make_state(kind: str, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    count, elements = (8, 16 << 20) if kind == "8x64MiB" else (512, 1 << 18)
    if kind == "8x64MiB":
        elements = max(1, round(elements * scale))
    else:
        count = max(1, round(count * scale))
    return {f"t{i:03d}": torch.rand(elements, generator=g) for i in range(count)}


def pipe_tensors(fs, root: str, state: dict) -> None:
    """An fsspec file system's own parallel upload: one object per float32 tensor, under ``root``."""
    fs.pipe({f"{root}/{k}": v.numpy().tobytes() for k, v in state.items()})


def cat_tensors(fs, root: str, targets: dict) -> None:
    """An fsspec file system's own parallel download of :func:`pipe_tensors`'s objects into ``targets``."""
    data = fs.cat([f"{root}/{k}" for k in targets])
    for k, v in targets.items():
        v.numpy()[:] = np.frombuffer(data[f"{root}/{k}"], dtype=np.float32)

class Peers:
    """The methods, each ``save(state, prefix)`` and ``restore(targets, prefix)``."""

    def __init__(self, proxy: str) -> None:
        import boto3
        import s3fs
        from botocore.config import Config
        from s3transfer.manager import TransferConfig, TransferManager

        self.options = {**CREDENTIALS, "client_kwargs": {"endpoint_url": proxy}}
        self.fs = s3fs.S3FileSystem(**self.options)
        client = boto3.client("s3", endpoint_url=proxy, aws_access_key_id="bench", aws_secret_access_key="bench",
                              region_name="us-east-1", config=Config(max_pool_connections=16))
        self.transfer = TransferManager(client, TransferConfig(multipart_threshold=16 << 20,
                                                               multipart_chunksize=16 << 20,
                                                               max_request_concurrency=8))

    # ppe-snapshot
    def ppe_save(self, state, prefix):
        import ppe_snapshot as ps
        ps.Snapshot.take(f"s3://{BUCKET}/{prefix}", {"s": ps.StateDict(state)}, storage_options=self.options)

    def ppe_restore(self, targets, prefix):
        import ppe_snapshot as ps
        ps.Snapshot(f"s3://{BUCKET}/{prefix}", storage_options=self.options).restore({"s": ps.StateDict(targets)})

    def ppe8_save(self, state, prefix):
        import ppe_snapshot as ps
        ps.Snapshot.take(f"s3://{BUCKET}/{prefix}", {"s": ps.StateDict(state)},
                         storage_options={**self.options, "ppe_upload_concurrency": 8})

    def ppe8_restore(self, targets, prefix):
        import ppe_snapshot as ps
        ps.Snapshot(f"s3://{BUCKET}/{prefix}", storage_options={**self.options, "ppe_read_workers": 8}).restore(
            {"s": ps.StateDict(targets)})

    # torchsnapshot
    def ts_save(self, state, prefix):
        import torchsnapshot
        torchsnapshot.Snapshot.take(path=f"s3://{BUCKET}/{prefix}", app_state={"s": torchsnapshot.StateDict(state)})

    def ts_restore(self, targets, prefix):
        import torchsnapshot
        loaded = torchsnapshot.StateDict(targets)
        torchsnapshot.Snapshot(path=f"s3://{BUCKET}/{prefix}").restore(app_state={"s": loaded})
        for k, v in loaded.items():  # in place where it can; copy what it replaced
            if v is not targets[k]:
                targets[k].copy_(v)

    # s3fs
    def s3fs_save(self, state, prefix):
        pipe_tensors(self.fs, f"{BUCKET}/{prefix}", state)

    def s3fs_restore(self, targets, prefix):
        cat_tensors(self.fs, f"{BUCKET}/{prefix}", targets)

    # boto3 TransferManager
    def boto3_save(self, state, prefix):
        futures = [self.transfer.upload(io.BytesIO(memoryview(v.numpy()).cast("B")), BUCKET, f"{prefix}/{k}")
                   for k, v in state.items()]
        for f in futures:
            f.result()

    def boto3_restore(self, targets, prefix):
        futures = [self.transfer.download(BUCKET, f"{prefix}/{k}", _Sink(memoryview(v.numpy()).cast("B")))
                   for k, v in targets.items()]
        for f in futures:
            f.result()

    # DCP over fsspec
    def dcp_save(self, state, prefix):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        writer = FsspecWriter(f"s3://{BUCKET}/{prefix}", thread_count=8, sync_files=False, **self.options)
        dcp.save(dict(state), storage_writer=writer)

    def dcp_restore(self, targets, prefix):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        dcp.load(targets, storage_reader=FsspecReader(f"s3://{BUCKET}/{prefix}", **self.options))


class _Sink(io.RawIOBase):
    """A seekable file over a tensor's memory: s3transfer writes downloaded ranges straight into it."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.position = view, 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = offset if whence == 0 else (self.position + offset if whence == 1 else len(self.view) + offset)
        return self.position

    def tell(self) -> int:
        return self.position

    def write(self, data) -> int:
        n = len(data)
        self.view[self.position:self.position + n] = data
        self.position += n
        return n


def _server_call(endpoint: str, what: str) -> dict:
    method = "POST" if what == "__reset" else "GET"
    with urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{what}", method=method)) as r:
        body = r.read()
    return json.loads(body) if body else {}


def _remove_prefix(fs, prefix: str) -> None:
    keys = fs.find(f"{BUCKET}/{prefix}")
    if keys:
        fs.rm(keys)


def rss_child(scale: float) -> None:
    """In a fresh process: peak RSS above the state of a take of each state (one line of JSON)."""
    import ppe_snapshot as ps
    proxy = sys.argv[sys.argv.index("--proxy") + 1]
    options = {**CREDENTIALS, "client_kwargs": {"endpoint_url": proxy}}
    out = {}
    for kind in ("8x64MiB", "512x1MiB"):
        state = make_state(kind, scale)
        with PeakRSS() as peak:
            ps.Snapshot.take(f"s3://{BUCKET}/rss-{uuid.uuid4().hex[:8]}", {"s": ps.StateDict(state)},
                             storage_options=options)
        out[kind] = peak.extra
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rate-mb", type=float, default=40.0)
    parser.add_argument("--latency-ms", type=float, default=15.0)
    parser.add_argument("--methods", default="ppe-snapshot,ppe-snapshot-x8,s3fs,boto3,dcp,torchsnapshot")
    parser.add_argument("--torchsnapshot", metavar="DIR", help="a directory torchsnapshot is installed in")
    parser.add_argument("--no-dcp", action="store_true", help="skip DCP (its restore takes tens of seconds)")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--report", help="also write the markdown report here")
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--proxy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.scale)
        return
    warnings.filterwarnings("ignore")
    here = os.path.dirname(os.path.abspath(__file__))
    server = subprocess.Popen([sys.executable, os.path.join(here, "s3_shaped.py"), "--rate-mb", str(args.rate_mb),
                               "--latency-ms", str(args.latency_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        urls = json.loads(server.stdout.readline())
        run(args, urls)
    finally:
        server.stdin.close()
        server.wait()


def run(args, urls: dict) -> None:
    peers = Peers(urls["proxy"])
    peers.fs.mkdir(BUCKET)
    methods = [m for m in args.methods.split(",") if not (args.no_dcp and m == "dcp")
               and not (m == "torchsnapshot" and not args.torchsnapshot)]
    if args.torchsnapshot:
        sys.path.insert(0, args.torchsnapshot)
        os.environ.update(AWS_ENDPOINT_URL=urls["proxy"], AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                          AWS_DEFAULT_REGION="us-east-1")
    functions = {"ppe-snapshot": (peers.ppe_save, peers.ppe_restore),
                 "ppe-snapshot-x8": (peers.ppe8_save, peers.ppe8_restore),
                 "s3fs": (peers.s3fs_save, peers.s3fs_restore), "boto3": (peers.boto3_save, peers.boto3_restore),
                 "dcp": (peers.dcp_save, peers.dcp_restore), "torchsnapshot": (peers.ts_save, peers.ts_restore)}
    states = {kind: make_state(kind, args.scale) for kind in ("8x64MiB", "512x1MiB")}
    for method in methods:  # warm-up, untimed: sessions and connection pools, thread pools, imports
        tiny = {"t": torch.rand(1 << 20)}
        functions[method][0](tiny, f"warm-{method}")
        functions[method][1]({"t": torch.zeros(1 << 20)}, f"warm-{method}")
        _remove_prefix(peers.fs, f"warm-{method}")
    results = Results()
    checked: set[tuple[str, str]] = set()
    for round_ in range(args.rounds):
        order = methods if round_ % 2 == 0 else methods[::-1]
        for kind, state in states.items():
            for method in order:
                save, restore = functions[method]
                prefix = f"{method}-{kind}-{uuid.uuid4().hex[:8]}"
                targets = {k: torch.zeros_like(v) for k, v in state.items()}
                metrics = {}
                _server_call(urls["endpoint"], "__reset")
                start = time.perf_counter()
                save(state, prefix)
                metrics["save"] = time.perf_counter() - start
                metrics["save_conns"] = _server_call(urls["endpoint"], "__stats")["peak_carrying"]
                _server_call(urls["endpoint"], "__reset")
                start = time.perf_counter()
                restore(targets, prefix)
                metrics["restore"] = time.perf_counter() - start
                metrics["restore_conns"] = _server_call(urls["endpoint"], "__stats")["peak_carrying"]
                if (method, kind) not in checked:
                    assert all(torch.equal(targets[k], v) for k, v in state.items()), (method, kind)
                    checked.add((method, kind))
                results.add(kind, method, metrics)
                print(f"round {round_} {kind} {method}: save {metrics['save']:.2f} s, restore "
                      f"{metrics['restore']:.2f} s, connections {metrics['save_conns']}/{metrics['restore_conns']}",
                      flush=True)
                del targets
                _remove_prefix(peers.fs, prefix)
    rss = None if args.no_rss else _rss(args, urls)
    emit(report(args, results, states, methods, rss), args.report)


def _rss(args, urls: dict) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", "--scale", str(args.scale),
                          "--proxy", urls["proxy"]], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(args, results: Results, states: dict, methods: list[str], rss: dict | None) -> str:
    total = sum(v.numel() * v.element_size() for v in next(iter(states.values())).values())
    lines = [f"## bench_s3: {mib(total)} per state through a {args.rate_mb:g} MB/s per connection, "
             f"{args.latency_ms:g} ms proxy",
             "", f"{platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}, medians of {args.rounds} "
             "interleaved rounds; connections: the most with bytes in transit at once (save / restore)", "",
             "| method | " + " | ".join(f"{k} save | {k} restore" for k in states) + " | connections |",
             "|---" * (2 * len(states) + 2) + "|"]
    for method in methods:
        cells, conns = [], []
        for kind in states:
            for op in ("save", "restore"):
                value = results.median(kind, method, op)
                peers = [results.median(kind, m, op) for m in methods if not m.startswith("ppe-snapshot")]
                best = min((p for p in peers if p is not None), default=None)
                ratio = f" ({value / best:.2f}x best peer)" if method.startswith("ppe-snapshot") and best else ""
                cells.append(f"{value:.2f} s{ratio}")
            conns.append(f"{results.median(kind, method, 'save_conns'):.0f} / "
                         f"{results.median(kind, method, 'restore_conns'):.0f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " | " + ", ".join(conns) + " |")
    if rss is not None:
        lines += ["", "Peak RSS above the state of one ppe-snapshot take (fresh process): " +
                  ", ".join(f"{k}: {mib(v)}" for k, v in rss.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
