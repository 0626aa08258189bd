"""Engine vs torch.save, torch.distributed.checkpoint (save, async_save, load) on one process.

Cases: (a) a model + Adam state of about 1 GiB in large tensors, (b) about
200 MiB in about 5,000 small tensors. Every method runs once per round,
rounds interleave the methods, and the report gives medians and ratios.

    python benchmarks/bench_engine.py [--rounds 3] [--dir /path/on/the/disk] [--scale 1.0]
"""
from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRSS, Results, drop_cache, emit, fsync_path, gbps, gib, mib, rss, secs, timer, warm_cache  # noqa: E402

import ppe_snapshot as ps  # noqa: E402


def large_state(scale: float, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """21 Linear(2048, 2048) layers after one Adam step: params + exp_avg + exp_avg_sq ~ 1 GiB (on ``device``)."""
    torch.manual_seed(0)
    layers = max(1, round(21 * scale))
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)]).to(device)
    optim = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    return model, optim


def small_state(scale: float) -> ps.StateDict:
    torch.manual_seed(0)
    return ps.StateDict({f"t{i}": torch.randn(10240) for i in range(max(1, round(5000 * scale)))})


def state_bytes(app: dict) -> int:
    total = 0
    for obj in app.values():
        sd = obj.state_dict()
        stack = [sd]
        while stack:
            v = stack.pop()
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
            elif isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
    return total


def plain_state(app: dict) -> dict:
    """The app state as the plain nested dicts torch.save and DCP take."""
    return {k: dict(v.state_dict()) if isinstance(v, ps.StateDict) else v.state_dict() for k, v in app.items()}


def load_plain(app: dict, state: dict) -> None:
    for k, v in app.items():
        v.load_state_dict(state[k])


def _write_raw(path: str, nbytes: int, flags: int) -> float:
    block = mmap.mmap(-1, 64 << 20)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(len(block)))
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    for _ in range(0, nbytes, len(block)):
        os.write(fd, block)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - start


def measure_disk(root: str, nbytes: int) -> dict[str, float]:
    """The disk's own bandwidth on ``nbytes``: sequential write + fsync through the page cache and
    with O_DIRECT (the better of the two is what the disk can do), then a cold read."""
    path = os.path.join(root, "disk.raw")
    direct = _write_raw(path, nbytes, os.O_DIRECT)
    write = _write_raw(path, nbytes, 0)
    block = bytearray(64 << 20)
    drop_cache(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(block):
            pass
    read = time.perf_counter() - start
    os.remove(path)
    return {"write_bw": nbytes / write, "direct_bw": nbytes / direct, "best_write_bw": nbytes / min(write, direct),
            "read_bw": nbytes / read}


def save_methods(app: dict, root: str) -> dict:
    """name -> callable(path) returning (blocking seconds, durable seconds)."""

    def engine(path):
        start = time.perf_counter()
        ps.Snapshot.take(path, app)
        t = time.perf_counter() - start
        return t, t

    def engine_async(path):
        start = time.perf_counter()
        pending = ps.Snapshot.async_take(path, app)
        blocking = time.perf_counter() - start
        pending.wait()
        return blocking, time.perf_counter() - start

    def torch_save(path):
        start = time.perf_counter()
        torch.save(plain_state(app), path)
        fsync_path(path)
        t = time.perf_counter() - start
        return t, t

    def dcp_save(path):
        start = time.perf_counter()
        dcp.save(plain_state(app), checkpoint_id=path)
        t = time.perf_counter() - start
        return t, t

    def dcp_async(path):
        start = time.perf_counter()
        future = dcp.async_save(plain_state(app), checkpoint_id=path)
        blocking = time.perf_counter() - start
        future.result()
        return blocking, time.perf_counter() - start

    return {"ppe-snapshot take": engine, "ppe-snapshot async_take": engine_async, "torch.save+fsync": torch_save,
            "dcp.save": dcp_save, "dcp.async_save": dcp_async}


def restore_methods(app: dict) -> dict:
    def engine(path):
        ps.Snapshot(path).restore(app)

    def torch_load(path):
        load_plain(app, torch.load(path, weights_only=True))

    def dcp_load(path):
        state = plain_state(app)
        dcp.load(state, checkpoint_id=path)
        load_plain(app, state)

    return {"ppe-snapshot take": engine, "torch.save+fsync": torch_load, "dcp.save": dcp_load}


def run_case(case: str, app: dict, root: str, rounds: int, results: Results) -> None:
    nbytes = state_bytes(app)
    print(f"== {case}: {gib(nbytes)} in {sum(1 for _ in _tensors(app))} tensors", flush=True)
    saves, restores = save_methods(app, root), restore_methods(app)
    for r in range(rounds):
        results.add(case, "disk (write+fsync, cold read)", measure_disk(root, nbytes))
        for name, save in saves.items():
            path = os.path.join(root, f"{case}-{r}-{name.replace(' ', '_')}")
            with PeakRSS() as mem:
                blocking, durable = save(path)
            metrics = {"blocking": blocking, "durable": durable, "save_bw": nbytes / durable,
                       "rss_extra": mem.extra}
            if name in restores:
                warm_cache(path)  # same cache state for every method (O_DIRECT writes skip the cache)
                with timer(metrics, "restore_warm"):
                    restores[name](path)
                if name == "ppe-snapshot take":
                    drop_cache(path)
                    with timer(metrics, "restore_cold"):
                        restores[name](path)
                    metrics["restore_cold_bw"] = nbytes / metrics["restore_cold"]
            results.add(case, name, metrics)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
            print(f"   round {r} {name}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()
                                                       if k != "rss_extra") + f", rss_extra={mib(mem.extra)}",
                  flush=True)


def _tensors(app: dict):
    stack = [v.state_dict() for v in app.values()]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def async_growth(root: str, count: int, scale: float) -> list[int]:
    """RSS after each of ``count`` consecutive async takes of a ~256 MiB state."""
    torch.manual_seed(0)
    app = {"s": ps.StateDict({f"t{i}": torch.randn(4 << 20) for i in range(max(1, round(16 * scale)))})}
    samples = []
    for i in range(count):
        path = os.path.join(root, f"growth-{i}")
        ps.Snapshot.async_take(path, app).wait()
        shutil.rmtree(path)
        samples.append(rss())
    return samples


def report(results: Results, sizes: dict[str, int], growth: list[int], args) -> str:
    out = [f"Command: `python benchmarks/bench_engine.py --rounds {args.rounds} --scale {args.scale}`  ",
           f"Machine: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
           f"Python {platform.python_version()}, data dir {args.dir}  ",
           f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; medians of {args.rounds} interleaved rounds.", ""]
    for case, nbytes in sizes.items():
        out += [f"### {case} ({gib(nbytes)})", "",
                results.table(case, [("blocking", "blocking", secs), ("durable", "durable", secs),
                                     ("save_bw", "durable throughput", gbps),
                                     ("restore_warm", "restore (page cache)", secs),
                                     ("restore_cold", "restore (cold)", secs),
                                     ("rss_extra", "peak extra RSS", mib),
                                     ("write_bw", "disk write+fsync", gbps),
                                     ("direct_bw", "disk O_DIRECT write+fsync", gbps),
                                     ("read_bw", "disk cold read", gbps)]),
                ""]
        med = lambda m, k: results.median(case, m, k)  # noqa: E731
        eng = "ppe-snapshot take"
        lines = [
            f"- durable save vs the disk's best write+fsync bandwidth (buffered or O_DIRECT): "
            f"{med(eng, 'save_bw') / med('disk (write+fsync, cold read)', 'best_write_bw'):.0%}",
            f"- durable save vs dcp.save: {med('dcp.save', 'durable') / med(eng, 'durable'):.2f}x",
            f"- durable save vs torch.save+fsync: {med('torch.save+fsync', 'durable') / med(eng, 'durable'):.2f}x",
            f"- restore (page cache) vs torch.load+load_state_dict: {med('torch.save+fsync', 'restore_warm') / med(eng, 'restore_warm'):.2f}x",
            f"- restore (page cache) vs dcp.load: {med('dcp.save', 'restore_warm') / med(eng, 'restore_warm'):.2f}x",
            f"- cold restore vs disk cold read bandwidth: {med(eng, 'restore_cold_bw') / med('disk (write+fsync, cold read)', 'read_bw'):.0%}",
            f"- sync take peak extra RSS: {med(eng, 'rss_extra') / nbytes:.1%} of the state",
            f"- async take peak extra RSS: {med('ppe-snapshot async_take', 'rss_extra') / nbytes:.0%} of the state "
            f"(one staging copy = 100%)",
        ]
        out += lines + [""]
    if growth:
        out += [f"### RSS over {len(growth)} consecutive async takes (~256 MiB state each)", "",
                f"RSS after take 1: {mib(growth[0])}, after take 10: {mib(growth[min(9, len(growth) - 1)])}, "
                f"after take {len(growth)}: {mib(growth[-1])}, max: {mib(max(growth))}", ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink or grow both states")
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    parser.add_argument("--growth", type=int, default=50, help="consecutive async takes for the RSS check")
    parser.add_argument("--report", help="write the markdown report here too")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    root = os.path.join(args.dir, "bench_engine")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    results, sizes = Results(), {}
    try:
        model, optim = large_state(args.scale)
        app = {"model": model, "optim": optim}
        sizes["(a) model + Adam, large tensors"] = state_bytes(app)
        run_case("(a) model + Adam, large tensors", app, root, args.rounds, results)
        del app, model, optim
        app = {"state": small_state(args.scale)}
        sizes["(b) ~5,000 small tensors"] = state_bytes(app)
        run_case("(b) ~5,000 small tensors", app, root, args.rounds, results)
        del app
        growth = async_growth(root, args.growth, args.scale) if args.growth else []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(results, sizes, growth, args)
    emit(text, args.report)


if __name__ == "__main__":
    main()
