"""Incremental snapshots against full ones, side by side in one run (medians of interleaved rounds).

Cases (sizes at ``--scale 1``):

adapter      a 1 GiB frozen base in 200 tensors, 16 MiB of trainable adapters with their Adam state, a
             ThreadWriter save after each step: bytes written per save against the bytes that changed, the
             write time and the loop's blocking time, incremental and full; ``torch.save`` of the same state
             for reference; the floor of an incremental save (hash every byte, write the changed ones).
embedding    a 1 GiB table of 1 KiB rows, 1 % of the rows (scattered) changed between takes: bytes written
             with 4 KiB blocks (``--embedding-block-kb``) and with the default 1 MiB blocks.
everything   a 1 GiB model and its Adam state (3 GiB), every byte changed between takes: take time,
             incremental (everything hashed, nothing referenced) against full.
restore      the adapter state's 10th incremental snapshot (its bytes in 10 snapshots' files) against a full
             snapshot of the same state: restore time, cold (page cache dropped) and warm.
retention    100 saves of the adapter case through the extension with ``KeepLatest(3)``: disk use against one
             base plus 3 x the changed bytes.
fine-tune    100 saves of a full fine-tune (a 64 MiB model in 16 Linear layers and its Adam state, every weight
             changed at every step, SimpleWriter) through the extension with ``KeepLatest(3)``, incremental and
             not: the most disk either run used (after each save) and at its end.

embedding-run  100 saves of a 16 MiB table of 1 KiB rows (1 % of the rows changed per save, 4 KiB blocks,
             ``KeepLatest(3)``, incremental, SimpleWriter): bytes written over the run, the most disk used.

    python benchmarks/bench_incremental.py [--rounds 5] [--scale 1.0] [--saves 100] [--cases adapter,...]
        [--report FILE]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, drop_cache, emit, fsync_path, gib, mib, secs, tree_bytes  # noqa: E402

from ppe_snapshot import Snapshot, StateDict  # noqa: E402
from ppe_snapshot.engine._take.incremental import HASH_THREADS  # noqa: E402
from ppe_snapshot.writing import ThreadWriter  # noqa: E402

MIB = 1 << 20
FULL, INCREMENTAL = "full (not incremental)", "incremental"
FLOOR = f"floor: xxh3 of every byte ({HASH_THREADS} threads) + write and fsync of the changed bytes"


def adapter_state(scale: float) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """200 frozen tensors of 1 GiB in all, 16 MiB of adapters and their two Adam moments; the tensors that
    change at each step."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, int(1280 * scale))
    state = {f"base/{i}": torch.randn(rows, 1024, generator=g) for i in range(200)}
    changing = []
    for i in range(16):
        for kind in ("adapter", "exp_avg", "exp_avg_sq"):
            tensor = torch.randn(max(1, int(256 * scale)), 1024, generator=g)
            state[f"{kind}/{i}"] = tensor
            changing.append(tensor)
    return state, changing


def step(changing: list[torch.Tensor]) -> None:
    for tensor in changing:
        tensor.add_(1e-3)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def written(path: str) -> int:
    """Bytes of this snapshot's own data files (what a save writes beside its small index files)."""
    return tree_bytes(os.path.join(path, "data")) if os.path.isdir(os.path.join(path, "data")) else 0


def case_adapter(root: str, rounds: int, scale: float, results: Results) -> dict[str, float]:
    state, changing = adapter_state(scale)
    app = {"m": StateDict(state)}
    writers = {FULL: ThreadWriter(), INCREMENTAL: ThreadWriter(incremental=True)}
    for method, writer in writers.items():  # a first save each (the incremental one's base)
        writer(f"{method[:4]}_0", root, app["m"])
        writer.wait()
    for r in range(1, rounds + 1):
        for method in (list(writers) if r % 2 else list(reversed(writers))):
            step(changing)
            writer, name = writers[method], f"{method[:4]}_{r}"
            writer(name, root, app["m"])
            blocking = writer.last_stats["blocking_s"]
            writer.wait()
            path = os.path.join(root, name)
            results.add("adapter", method, {"blocking": blocking, "write": writer.last_stats["write_s"],
                                            "written": written(path)})
            if method == FULL:
                shutil.rmtree(os.path.join(root, f"{method[:4]}_{r - 1}"))
    for writer in writers.values():
        writer.finalize()
    tensors = list(state.values())
    shares = [tensors[k::HASH_THREADS] for k in range(HASH_THREADS)]
    pool = ThreadPoolExecutor(HASH_THREADS)
    for r in range(rounds):  # the floor of an incremental save: hash every byte, write the changed ones
        start = time.perf_counter()
        list(pool.map(hash_all, shares))
        hashed = time.perf_counter()
        path = os.path.join(root, "changed.bin")
        with open(path, "wb") as f:
            for tensor in changing:
                f.write(memoryview(tensor.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.remove(path)
        results.add("adapter", FLOOR, {"write": time.perf_counter() - start, "hash": hashed - start,
                                       "written": nbytes(changing)})
    for r in range(rounds):
        path = os.path.join(root, "plain.pt")
        start = time.perf_counter()
        torch.save(state, path)
        fsync_path(path)
        results.add("adapter", "torch.save (full, synced)", {"write": time.perf_counter() - start,
                                                             "written": os.path.getsize(path)})
        os.remove(path)
    pool.shutdown()
    return {"changed": nbytes(changing), "state": nbytes(state.values())}


def hash_all(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        xxhash.xxh3_64_intdigest(memoryview(tensor.numpy()).cast("B"))


def case_embedding(root: str, rounds: int, scale: float, block_kb: int, results: Results) -> dict[str, float]:
    rows = max(1024, int((1 << 20) * scale))
    table = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    app = {"m": StateDict(table=table)}
    methods = {f"incremental, {block_kb} KiB blocks": block_kb << 10, "incremental, 1 MiB blocks (default)": MIB}
    previous = {}
    for method, block in methods.items():
        previous[method] = os.path.join(root, f"emb_{block}_0")
        Snapshot.take(previous[method], app, block_bytes=block)
    for r in range(rounds + 1):  # round 0 cuts the full first take's one chunk per tensor into blocks
        changed = torch.randperm(rows, generator=g)[: rows // 100]
        table[changed] += 1.0
        for method, block in methods.items():
            path = os.path.join(root, f"emb_{block}_{r + 1}")
            start = time.perf_counter()
            Snapshot.take(path, app, base=previous[method], block_bytes=block)
            if r:
                results.add("embedding", method, {"take": time.perf_counter() - start, "written": written(path)})
            previous[method] = path
        if not r:
            continue
        full = os.path.join(root, f"emb_full_{r}")
        start = time.perf_counter()
        Snapshot.take(full, app)
        results.add("embedding", FULL, {"take": time.perf_counter() - start, "written": written(full)})
        shutil.rmtree(full)
    return {"state": table.numel() * 4, "rows changed": rows // 100}


def case_everything(root: str, rounds: int, scale: float, results: Results) -> dict[str, float]:
    g = torch.Generator().manual_seed(3)
    n = max(1, int(1024 * scale))
    state = {f"{kind}/{i}": torch.randn(n, 1024, generator=g) for i in range(256)
             for kind in ("param", "exp_avg", "exp_avg_sq")}  # 3 x 1 GiB
    app = {"m": StateDict(state)}
    base = os.path.join(root, "all_inc_0")
    Snapshot.take(base, app)
    for r in range(1, rounds + 1):
        for method in ([FULL, INCREMENTAL] if r % 2 else [INCREMENTAL, FULL]):
            for tensor in state.values():
                tensor.add_(1e-3)
            path = os.path.join(root, f"all_{method[:4]}_{r}")
            start = time.perf_counter()
            Snapshot.take(path, app, base=base if method == INCREMENTAL else None)
            results.add("everything", method, {"take": time.perf_counter() - start, "written": written(path)})
            if method == INCREMENTAL:
                assert Snapshot(path).references == ()  # every byte changed: nothing to reference
                shutil.rmtree(base)
                base = path
            else:
                shutil.rmtree(path)
    return {"state": nbytes(state.values())}


def case_restore(root: str, rounds: int, scale: float, results: Results) -> dict[str, float]:
    state, changing = adapter_state(scale)
    app = {"m": StateDict(state)}
    run = os.path.join(root, "chain")
    previous = os.path.join(run, "i0")
    Snapshot.take(previous, app)
    for i in range(1, 11):
        step(changing)
        path = os.path.join(run, f"i{i}")
        Snapshot.take(path, app, base=previous)
        previous = path
    full = os.path.join(root, "full10")
    Snapshot.take(full, app)
    target = {"m": StateDict({k: torch.empty_like(v) for k, v in state.items()})}
    methods = {"10th incremental": previous, "full": full}
    for r in range(rounds):
        for cache in ("cold", "warm"):
            for method in (list(methods) if r % 2 else list(reversed(methods))):
                path = methods[method]
                if cache == "cold":
                    drop_cache(run)
                    drop_cache(full)
                start = time.perf_counter()
                Snapshot(path).restore(target)
                results.add(f"restore ({cache})", method, {"restore": time.perf_counter() - start})
    for key, value in target["m"].items():
        assert torch.equal(value, state[key]), key
    return {"references": len(Snapshot(previous).references)}


def case_retention(root: str, saves: int, scale: float) -> dict[str, float]:
    import pytorch_pfn_extras as ppe

    import ppe_snapshot
    from ppe_snapshot.retention import KeepLatest

    state, _ = adapter_state(scale)
    model = torch.nn.Module()
    trainable = []
    for key, value in state.items():
        if key.startswith("exp_avg"):  # Adam makes its own
            continue
        parameter = torch.nn.Parameter(value, requires_grad=key.startswith("adapter/"))
        model.register_parameter(key.replace("/", "_"), parameter)
        if parameter.requires_grad:
            trainable.append(parameter)
    optimizer = torch.optim.Adam(trainable)
    out = os.path.join(root, "retention")
    manager = ppe.training.ExtensionsManager(model, optimizer, saves, iters_per_epoch=1, out_dir=out)
    manager.extend(ppe_snapshot.snapshot(writer=ThreadWriter(), incremental=True, keep=KeepLatest(3)),
                   trigger=(1, "iteration"))
    start = time.perf_counter()
    while not manager.stop_trigger:
        with manager.run_iteration():
            optimizer.zero_grad()
            sum(p.square().sum() for p in trainable).backward()
            optimizer.step()
    elapsed = time.perf_counter() - start
    frozen = nbytes(v for k, v in state.items() if k.startswith("base/"))
    trained = nbytes(trainable) * 3  # the adapters and their two Adam moments
    return {"disk": tree_bytes(out), "frozen": frozen, "changed": trained, "elapsed": elapsed,
            "names": len(os.listdir(out))}


def case_fine_tune(root: str, saves: int, scale: float, incremental: bool) -> dict[str, float]:
    import pytorch_pfn_extras as ppe

    import ppe_snapshot
    from ppe_snapshot.retention import KeepLatest
    from ppe_snapshot.writing import SimpleWriter

    torch.manual_seed(0)
    width = max(8, int(1024 * scale))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(16)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    out = os.path.join(root, "fine-tune-" + ("incremental" if incremental else "full"))
    manager = ppe.training.ExtensionsManager(model, optimizer, saves, iters_per_epoch=1, out_dir=out)
    manager.extend(ppe_snapshot.snapshot(writer=SimpleWriter(), incremental=incremental, keep=KeepLatest(3)),
                   trigger=(1, "iteration"))
    inputs, most, start = torch.randn(4, width), 0, time.perf_counter()
    while not manager.stop_trigger:
        with manager.run_iteration():
            optimizer.zero_grad()
            model(inputs).square().sum().backward()
            optimizer.step()
        most = max(most, tree_bytes(out))
    return {"most": most, "end": tree_bytes(out), "names": len(os.listdir(out)),
            "elapsed": time.perf_counter() - start}


def case_embedding_run(root: str, saves: int, scale: float, block_kb: int) -> dict[str, float]:
    import pytorch_pfn_extras as ppe

    import ppe_snapshot
    from ppe_snapshot.retention import KeepLatest
    from ppe_snapshot.settings import SETTINGS
    from ppe_snapshot.writing import SimpleWriter

    SETTINGS.block_bytes = block_kb << 10
    torch.manual_seed(0)
    rows = max(100, int(16384 * scale))
    model = torch.nn.Embedding(rows, 256)
    out = os.path.join(root, "embedding-run")
    manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), saves,
                                             iters_per_epoch=1, out_dir=out)
    manager.extend(ppe_snapshot.snapshot(writer=SimpleWriter(), incremental=True, keep=KeepLatest(3)),
                   trigger=(1, "iteration"))
    g, most, total = torch.Generator().manual_seed(1), 0, 0
    while not manager.stop_trigger:
        with manager.run_iteration(), torch.no_grad():
            model.weight[torch.randint(0, rows, (rows // 100,), generator=g)] += 1
        total += written(os.path.join(out, f"snapshot_iter_{manager.iteration}"))
        most = max(most, tree_bytes(out))
    return {"table": rows * 1024, "written": total, "most": most, "end": tree_bytes(out),
            "names": len(os.listdir(out))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=100)
    parser.add_argument("--embedding-block-kb", type=int, default=4)
    parser.add_argument("--cases", default="adapter,embedding,everything,restore,retention")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--report", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cases = args.cases.split(",")
    results = Results()
    lines = [f"# bench_incremental: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"scale {args.scale}, {args.rounds} rounds (medians)", ""]
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_incremental_")
    try:
        if "adapter" in cases:
            facts = case_adapter(root, args.rounds, args.scale, results)
            full_write = results.median("adapter", FULL, "write")
            inc = {m: results.median("adapter", INCREMENTAL, m) for m in ("write", "written", "blocking")}
            floor = results.median("adapter", FLOOR, "write")
            lines += [f"## adapter: {gib(facts['state'])} state, {mib(facts['changed'])} changed per save "
                      "(ThreadWriter)",
                      "", results.table("adapter", [("blocking", "loop blocked", secs), ("write", "write", secs),
                                                    ("written", "bytes written", mib)]), "",
                      f"written / changed bytes: {inc['written'] / facts['changed']:.3f} (target <= 1.1); "
                      f"write time incremental / full: {inc['write'] / full_write:.3f} (target <= 0.2; the floor "
                      f"/ full: {floor / full_write:.3f}, incremental / floor: {inc['write'] / floor:.2f}); "
                      f"blocking incremental / full: "
                      f"{inc['blocking'] / results.median('adapter', FULL, 'blocking'):.3f} (target <= 1)", ""]
        if "embedding" in cases:
            facts = case_embedding(root, args.rounds, args.scale, args.embedding_block_kb, results)
            lines += [f"## embedding: {gib(facts['state'])} table of 1 KiB rows, {facts['rows changed']} rows "
                      "(1 %) changed between takes", "",
                      results.table("embedding", [("take", "take", secs), ("written", "bytes written", mib)]), ""]
            for method in results.methods("embedding"):
                lines.append(f"- {method}: written / table = "
                             f"{results.median('embedding', method, 'written') / facts['state']:.4f}")
            lines += ["", "(target: <= 0.05 of the table)", ""]
        if "everything" in cases:
            facts = case_everything(root, args.rounds, args.scale, results)
            ratio = results.median("everything", INCREMENTAL, "take") / results.median("everything", FULL, "take")
            lines += [f"## everything changes: {gib(facts['state'])} (model + Adam), Snapshot.take", "",
                      results.table("everything", [("take", "take", secs), ("written", "bytes written", mib)]), "",
                      f"take time incremental / full: {ratio:.3f} (target <= 1.05)", ""]
        if "restore" in cases:
            facts = case_restore(root, args.rounds, args.scale, results)
            lines += [f"## restore: the 10th incremental snapshot (reads {facts['references']} other snapshots' "
                      "files) against a full one", ""]
            for cache in ("cold", "warm"):
                case = f"restore ({cache})"
                ratio = results.median(case, "10th incremental", "restore") / results.median(case, "full", "restore")
                lines += [f"### {cache}", "", results.table(case, [("restore", "restore", secs)]), "",
                          f"incremental / full: {ratio:.3f} (target <= 1.1)", ""]
        if "retention" in cases:
            facts = case_retention(root, args.saves, args.scale)
            bound = facts["frozen"] + 3 * facts["changed"]
            lines += [f"## retention: {args.saves} saves, KeepLatest(3), the adapter case (extension, ThreadWriter)",
                      "", f"disk use {mib(facts['disk'])} in {facts['names']} names; one base + 3 x changed = "
                      f"{mib(bound)}; ratio {facts['disk'] / bound:.3f} (target <= 1.1); "
                      f"{args.saves} iterations in {facts['elapsed']:.1f} s", ""]
        if "embedding-run" in cases:
            facts = case_embedding_run(root, args.saves, args.scale, args.embedding_block_kb)
            lines += [f"## embedding-run: {args.saves} saves of a {mib(facts['table'])} table, 1 % of the rows "
                      f"changed per save, {args.embedding_block_kb} KiB blocks, KeepLatest(3), incremental", "",
                      f"written over the run {mib(facts['written'])} ({facts['written'] / facts['table']:.2f} x the "
                      f"table); most disk use {mib(facts['most'])} ({facts['most'] / facts['table']:.2f} x); at the "
                      f"end {mib(facts['end'])} in {facts['names']} names", ""]
        if "fine-tune" in cases:
            runs = {incremental: case_fine_tune(root, args.saves, args.scale, incremental)
                    for incremental in (False, True)}
            lines += [f"## fine-tune: {args.saves} saves, KeepLatest(3), every weight changes (extension, "
                      "SimpleWriter)", "", "| method | most disk use | at the end | names at the end | run |",
                      "|---|---|---|---|---|"]
            for incremental, facts in runs.items():
                lines.append(f"| {INCREMENTAL if incremental else FULL} | {mib(facts['most'])} | "
                             f"{mib(facts['end'])} | {facts['names']} | {facts['elapsed']:.1f} s |")
            lines += ["", f"most disk use incremental / full: {runs[True]['most'] / runs[False]['most']:.3f} "
                      "(target <= 1.05)", ""]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit("\n".join(lines), args.report)


if __name__ == "__main__":
    main()
