"""CUDA state through every path that touches the device: staging (pinned buffers, device-to-host copies),
restores into device targets, async takes, incremental takes, the CUDA generators, the writers behind the
extension, and an NCCL process group. Skipped where no CUDA device is present (CI has none)."""
from __future__ import annotations

import os

import pytest
import torch

from _asserts import assert_same
from ppe_snapshot import RNGState, Snapshot, StateDict, writing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_state() -> dict[str, torch.Tensor]:
    """Every layout the staging copy must resolve on the device, beside a CPU tensor."""
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(1024, 1024, device="cuda", generator=g)  # 4 MiB: the copy_ path
    return {
        "big": big,
        "small": torch.randn(33, device="cuda", generator=g),
        "bf16": torch.randn(64, 65, device="cuda", generator=g).to(torch.bfloat16),
        "half": torch.randn(7, device="cuda", generator=g).half(),
        "ints": torch.arange(1000, device="cuda", dtype=torch.int64),
        "mask": torch.rand(100, device="cuda", generator=g) > 0.5,
        "transposed": big[:300, :200].t(),  # not contiguous
        "offset": big.view(-1)[12345:12345 + 999],  # a view at an offset into another tensor's storage
        "empty": torch.empty(0, 3, device="cuda"),
        "cpu": torch.randn(50),
    }


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype, device=v.device) for k, v in state.items()}


def test_cuda_take_restores_bit_exact_in_place(tmp_path):
    state = cuda_state()
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(state)})
    target = StateDict(zeros_like(state))
    pointers = {k: v.data_ptr() for k, v in target.items()}
    Snapshot(str(tmp_path / "s")).restore({"s": target})
    assert_same(dict(target), state)
    assert {k: v.data_ptr() for k, v in target.items()} == pointers  # read in place, on the device
    assert all(target[k].is_cuda for k in state if k != "cpu")
    Snapshot(str(tmp_path / "s")).verify()


def test_cuda_read_object_into_device_and_host(tmp_path):
    state = cuda_state()
    Snapshot.take(str(tmp_path / "s"), {"s": StateDict(state)})
    snapshot = Snapshot(str(tmp_path / "s"))
    for key in ("big", "transposed", "bf16", "mask"):
        out = torch.zeros_like(state[key])
        assert snapshot.read_object(f"0/s/{key}", obj_out=out, memory_budget_bytes=4096) is out
        assert_same(out, state[key], key)
        assert_same(snapshot.read_object(f"0/s/{key}"), state[key], key)


def test_cuda_async_take_holds_the_values_of_the_call(tmp_path):
    """The device-to-host copy is done when async_take returns: changes made after it (and kernels queued
    before it) do not reach the snapshot."""
    a = torch.randn(2048, 2048, device="cuda")
    product = a @ a  # queued, maybe still running when the take starts
    expected = {"a": a.clone(), "product": product.clone()}
    pending = Snapshot.async_take(str(tmp_path / "s"), {"s": StateDict(a=a, product=product)})
    a.add_(1.0)
    product.zero_()
    pending.wait()
    target = StateDict(zeros_like(expected))
    Snapshot(str(tmp_path / "s")).restore({"s": target})
    assert_same(dict(target), expected)


def test_cuda_incremental_take_writes_only_the_changed_block(tmp_path):
    weights = torch.randn(4 << 20, device="cuda")  # 16 MiB
    Snapshot.take(str(tmp_path / "s1"), {"m": StateDict(w=weights)})
    for name, base in (("s2", "s1"), ("s3", "s2")):  # the plain s1 wrote blocks of 1 MiB too
        weights[5] += 1.0
        Snapshot.take(str(tmp_path / name), {"m": StateDict(w=weights)}, base=str(tmp_path / base),
                      block_bytes=1 << 20)
    assert (tmp_path / "s3" / "data" / "rank0.bin").stat().st_size <= 1 << 20
    target = StateDict(w=torch.zeros_like(weights))
    Snapshot(str(tmp_path / "s3")).restore({"m": target})
    assert torch.equal(target["w"], weights)


def test_cuda_generators_round_trip(tmp_path):
    torch.cuda.manual_seed_all(7)
    torch.randn(3, device="cuda")
    Snapshot.take(str(tmp_path / "s"), {"rng": RNGState()})
    expected = torch.randn(1000, device="cuda")
    torch.cuda.manual_seed_all(8)
    Snapshot(str(tmp_path / "s")).restore({"rng": RNGState()})
    assert torch.equal(torch.randn(1000, device="cuda"), expected)


@pytest.mark.parametrize("name", ["SimpleWriter", "ThreadWriter", "ProcessWriter"])
def test_cuda_extension_resumes_a_device_model(name, tmp_path):
    import pytorch_pfn_extras as ppe

    import ppe_snapshot

    def run(iterations: int) -> tuple[torch.nn.Module, object]:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64).cuda()
        optimizer = torch.optim.Adam(model.parameters())
        manager = ppe.training.ExtensionsManager(model, optimizer, 1, iters_per_epoch=iterations,
                                                 out_dir=str(tmp_path), stop_trigger=(iterations, "iteration"))
        writer = getattr(writing, name)(out_dir=str(tmp_path))
        snapshot = ppe_snapshot.snapshot(writer=writer, autoload=True)
        manager.extend(snapshot, trigger=(2, "iteration"))
        while not manager.stop_trigger:
            with manager.run_iteration():
                model(torch.randn(8, 64, device="cuda")).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        writer.finalize()
        return model, manager

    trained, _ = run(4)
    resumed, manager = run(4)  # autoload finds snapshot_iter_4 and stops at once
    assert manager.iteration == 4 and next(resumed.parameters()).is_cuda
    assert_same(resumed.state_dict(), trained.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["snapshot_iter_2", "snapshot_iter_4"]


def test_cuda_nccl_group_takes_and_restores(tmp_path):
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("torch was built without NCCL")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        state = cuda_state()
        Snapshot.take(str(tmp_path / "s"), {"s": StateDict(state)}, pg=dist.group.WORLD)
        target = StateDict(zeros_like(state))
        Snapshot(str(tmp_path / "s"), pg=dist.group.WORLD).restore({"s": target})
        assert_same(dict(target), state)
    finally:
        dist.destroy_process_group()


def test_cuda_process_writers_one_after_another_pin_their_buffers(tmp_path):
    """Each ProcessWriter unregisters its page-locked buffers when it finishes: the next one's buffers, which may
    be mapped at the same addresses, are page-locked again, and CUDA keeps working."""
    state = {"w": torch.randn(1 << 20, device="cuda")}
    saved = []
    for i in range(3):
        saved.append(state["w"].clone())
        writer = writing.ProcessWriter(out_dir=str(tmp_path))
        writer(f"s{i}", str(tmp_path), state)
        writer.wait()
        assert writer.staging_buffers[0].is_pinned()
        writer.finalize()
        assert not writer.staging_buffers[0].is_pinned()  # unregistered before the memory can be let go
        state["w"].add_(1.0)  # a kernel launch: raises if a registration left a CUDA error behind
    target = StateDict(w=torch.zeros_like(state["w"]))
    Snapshot(str(tmp_path / "s2")).restore({"state": target})
    assert torch.equal(target["w"], saved[2])


def test_cuda_a_staging_buffer_that_cannot_be_pinned_only_warns(tmp_path, monkeypatch, caplog):
    """CUDA refuses to page-lock a range registered already: the save goes on through the unpinned buffer, with a
    warning, and the refusal does not surface as the error of the next kernel launch."""
    from ppe_snapshot.writing import _process

    taken: list[torch.Tensor] = []
    new_shared_buffer = _process.new_shared_buffer

    def registered_already(nbytes: int) -> torch.Tensor:
        buffer = new_shared_buffer(nbytes)
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0))
        taken.append(buffer)
        return buffer

    monkeypatch.setattr(_process, "new_shared_buffer", registered_already)
    writer = writing.ProcessWriter(out_dir=str(tmp_path))
    try:
        state = {"w": torch.randn(1 << 20, device="cuda")}
        writer("s", str(tmp_path), state)
        writer.wait()
        assert "could not page-lock the shared staging buffer" in caplog.text
        torch.ones(4, device="cuda").add_(1.0)
        torch.cuda.synchronize()
        target = StateDict(w=torch.zeros_like(state["w"]))
        Snapshot(str(tmp_path / "s")).restore({"state": target})
        assert torch.equal(target["w"], state["w"])
    finally:
        writer.finalize()
        for buffer in taken:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))


def test_cuda_many_small_tensors_gathered_and_a_large_one_pipelined(tmp_path):
    """Small device tensors are staged in gathered runs (one transfer each) and restored in bulk through
    page-locked slabs (one transfer per slab, then scattered on the device); a tensor larger than a buffer goes
    through several pipelined ones; non-contiguous ones the usual way. Values at the call, bit-exact, in place."""
    from ppe_snapshot.engine._files import device_reads

    g = torch.Generator(device="cuda").manual_seed(3)
    state = {f"s{i}": torch.randn(i % 50 + 1, device="cuda", generator=g) for i in range(3000)}
    state.update(ints=torch.arange(77, device="cuda"), flags=torch.rand(9, device="cuda", generator=g) > 0.5,
                 bf16=torch.randn(31, device="cuda", generator=g).to(torch.bfloat16),
                 big=torch.randn(device_reads.DEVICE_BUFFER_BYTES // 4 * 2 + 12345, device="cuda", generator=g),
                 transposed=torch.randn(40, 30, device="cuda", generator=g).t())
    expected = {k: v.clone() for k, v in state.items()}
    pending = Snapshot.async_take(str(tmp_path / "s"), {"s": StateDict(state)})
    for tensor in state.values():  # after the call: not in the snapshot
        if tensor.dtype == torch.bool:
            tensor.logical_not_()
        else:
            tensor.add_(1)
    pending.wait()
    target = StateDict(zeros_like(expected))
    pointers = {k: v.data_ptr() for k, v in target.items()}
    Snapshot(str(tmp_path / "s")).restore({"s": target})
    assert_same(dict(target), expected)
    assert {k: v.data_ptr() for k, v in target.items()} == pointers


def test_cuda_small_tensors_of_one_dtype_and_any_shape_through_the_gather_and_the_slabs(tmp_path):
    """A run of one dtype (scalars, vectors, matrices) is gathered by one concatenation; restored, the targets of a
    slab of vectors are copied out of it by one split copy, those of other shapes through views of their shapes.
    Bit-exact, in place, values at the call."""
    g = torch.Generator(device="cuda").manual_seed(4)
    shaped = {f"m{i}": torch.randn(i % 7 + 1, 3, device="cuda", generator=g) for i in range(500)}
    shaped.update({f"c{i}": torch.tensor(float(i), device="cuda") for i in range(100)})
    vectors = {f"v{i}": torch.randn(i % 11 + 1, device="cuda", generator=g) for i in range(500)}
    expected = {"s": {k: v.clone() for k, v in shaped.items()}, "v": {k: v.clone() for k, v in vectors.items()}}
    pending = Snapshot.async_take(str(tmp_path / "s"), {"s": StateDict(shaped), "v": StateDict(vectors)})
    for tensor in [*shaped.values(), *vectors.values()]:
        tensor.add_(1)
    pending.wait()
    for key in ("s", "v"):
        target = StateDict(zeros_like(expected[key]))
        Snapshot(str(tmp_path / "s")).restore({key: target})
        assert_same(dict(target), expected[key])


def test_cuda_negative_and_conjugate_views_in_a_slab_of_vectors_receive_the_values(tmp_path):
    """A slab of vectors is copied out in one call, which refuses a negative or conjugate target; such targets
    still show the saved values, not the saved bytes."""
    g = torch.Generator(device="cuda").manual_seed(5)
    state = {f"v{i}": torch.randn(i % 11 + 1, device="cuda", generator=g) for i in range(300)}
    state.update({f"c{i}": torch.randn(i + 2, dtype=torch.complex64, device="cuda", generator=g) for i in range(3)})
    state.update(negated=torch.randn(9, device="cuda", generator=g),
                 conjugated=torch.randn(4, dtype=torch.complex64, device="cuda", generator=g))
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(state)})
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    targets.update(negated=torch.zeros(9, device="cuda")._neg_view(),
                   conjugated=torch.zeros(4, dtype=torch.complex64, device="cuda").conj())
    Snapshot(str(tmp_path / "s")).restore({"m": StateDict(targets)})
    assert_same({k: v.resolve_neg().resolve_conj() for k, v in targets.items()}, state)
