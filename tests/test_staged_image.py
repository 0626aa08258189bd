"""A staged image reused: a second take of the same step copies its tensors from the first take's staging buffer
(``TakeJob.stage(keep_image=True)``, ``Snapshot.async_take(staged_from=)``), a writer lends that buffer
(``lend_staged_image``) and does not stage into it again before it is given back, and the extension's local tier
copies a durable save's state that way (the state is copied out of training once)."""
from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest
import pytorch_pfn_extras as ppe
import torch

import ppe_snapshot
from ppe_snapshot import LocalTier, Snapshot
from ppe_snapshot.engine import LOCAL, StateDict, new_staging_buffer, prepare_take
from ppe_snapshot.writing import ProcessWriter, SimpleWriter, ThreadWriter
from _asserts import assert_same
from test_staging import assert_values, mixed_state, mutate, values_of


def test_a_take_copies_the_tensors_another_take_staged_from_that_image(tmp_path):
    state, owners = mixed_state()
    at_the_step = values_of(state)
    first = prepare_take(str(tmp_path / "first"), {"state": StateDict(state)}, pg=LOCAL)
    image = first.stage(new_staging_buffer(first.layout.size), keep_image=True)
    # The live state changes before the second take: what it holds of the first take's image comes from there.
    mutate(owners)
    after = values_of(state)
    pending = Snapshot.async_take(str(tmp_path / "second"), {"state": StateDict(state)}, staged_from=image)
    mutate(owners)
    second = pending.wait().read_object("0/state")
    first.write_and_commit()
    assert_values(Snapshot(str(tmp_path / "first")).read_object("0/state"), at_the_step)
    # Contiguous tensors (the small ones, the large one, the slice...) came from the image; views that staging
    # resolves (transposed, conjugate, negative) and the array were copied from the live state.
    image_held = {"large", "scalar", "int64", "bool", "bfloat16", "sliced"}
    for key in image_held:
        assert torch.equal(second[key], at_the_step[key]), key
    for key in ("transposed", "conj", "neg"):
        assert torch.equal(second[key], after[key]), key
    assert (second["array"] == after["array"]).all()
    assert all(torch.equal(second["small"][k], v) for k, v in at_the_step["small"].items())
    held = sum(v.numel() * v.element_size() for k, v in state.items() if k in image_held)
    held += sum(v.numel() * v.element_size() for v in state["small"].values())
    assert pending.from_image_bytes == held


def test_a_tensor_of_another_size_is_not_taken_from_the_image(tmp_path):
    x = torch.arange(8.0)
    first = prepare_take(str(tmp_path / "first"), {"s": StateDict(x=x)}, pg=LOCAL)
    image = first.stage(new_staging_buffer(first.layout.size), keep_image=True)
    assert image.view_of(x, 32) is not None
    assert image.view_of(x[:4], 16) is None  # the same first byte, fewer of them
    assert image.view_of(torch.arange(8.0), 32) is None  # equal values elsewhere in memory


def test_the_image_keeps_its_tensors_so_no_other_tensor_takes_their_address(tmp_path):
    """A temporary of the first take (an RNG state) freed while the image is lent could leave its address to a
    tensor of the second take, which the image would then hold the wrong bytes of."""
    temporary = torch.arange(8.0)
    alive = weakref.ref(temporary)
    first = prepare_take(str(tmp_path / "first"), {"s": StateDict(x=temporary)}, pg=LOCAL)
    image = first.stage(new_staging_buffer(first.layout.size), keep_image=True)
    del temporary, first
    gc.collect()
    assert alive() is not None
    del image
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("writer_class", [ThreadWriter, ProcessWriter], ids=["thread", "process"])
def test_a_writer_does_not_stage_into_a_lent_image_until_it_is_given_back(writer_class, tmp_path):
    writer = writer_class()
    try:
        x = torch.arange(1000.0)
        loan = writer.lend_staged_image()
        writer("s0", str(tmp_path), {"x": x})
        assert loan.image is not None and torch.equal(loan.image.view_of(x, 4000).view(torch.float32), x)
        writer.wait()
        x.add_(1)
        second = threading.Thread(target=writer, args=("s1", str(tmp_path), {"x": x}))
        second.start()
        second.join(1.0)
        assert second.is_alive()  # waits for the one slot, whose image is lent
        assert torch.equal(loan.image.view_of(x, 4000).view(torch.float32), torch.arange(1000.0))
        loan.release()
        second.join(30)
        assert not second.is_alive()
        writer.wait()
        assert torch.equal(Snapshot(str(tmp_path / "s1")).read_object("0/state")["x"], torch.arange(1000.0) + 1)
        loan.release()  # a second release does nothing
    finally:
        writer.finalize()


def test_a_loan_given_back_unused_lends_nothing_and_a_simple_writer_lends_nothing(tmp_path):
    assert SimpleWriter().lend_staged_image() is None
    writer = ThreadWriter()
    try:
        writer.lend_staged_image().release()
        writer("s0", str(tmp_path), {"x": torch.ones(3)})
        writer("s1", str(tmp_path), {"x": torch.ones(3)})  # not waiting for a loan no one holds
        writer.wait()
    finally:
        writer.finalize()


def _train(tmp_path, writer, iterations: int, caplog) -> tuple[torch.nn.Module, list[str]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    manager = ppe.training.ExtensionsManager(model, optimizer, max_epochs=1, iters_per_epoch=iterations,
                                             out_dir=str(tmp_path / "out"))
    manager.extend(ppe_snapshot.snapshot(writer=writer, local=LocalTier(directory=str(tmp_path / "local"))),
                   trigger=(2, "iteration"))
    with caplog.at_level(logging.DEBUG, logger="ppe_snapshot.local_tier.saves"):
        while not manager.stop_trigger:
            with manager.run_iteration():
                optimizer.zero_grad()
                model(torch.randn(4, 64)).sum().backward()
                optimizer.step()
    return model, [r.getMessage() for r in caplog.records if "bytes staged" in r.getMessage()]


@pytest.mark.parametrize("writer_class", [ThreadWriter, ProcessWriter], ids=["thread", "process"])
def test_a_local_step_saved_with_a_durable_snapshot_copies_from_its_staged_image(writer_class, tmp_path, caplog):
    writer = writer_class()
    model, staged = _train(tmp_path, writer, 4, caplog)
    # Steps 1 and 3: local only, staged from the live state; 2 and 4: with a durable snapshot, every tensor of
    # the model and the optimizer from the durable save's image (the RNG state is the local save's own).
    assert len(staged) == 4
    tensors = sum(p.numel() * 4 for p in model.parameters())
    for message in staged[0::2]:
        assert message.endswith(" 0 of them copied from the durable save's image")
    for message in staged[1::2]:
        copied = int(message.split(", ")[1].split()[0])
        assert copied >= 3 * tensors  # the parameters, Adam's two moments (and its step counts)
    local = Snapshot(str(tmp_path / "local" / "step_4" / "rank0")).read_object("0/state")
    durable = Snapshot(str(tmp_path / "out" / "snapshot_iter_4")).read_object("0/state")
    assert_same(local["models"], durable["models"])
    assert_same(local["optimizers"], durable["optimizers"])
    assert_same(local["models"]["main"], model.state_dict())
