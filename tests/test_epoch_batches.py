"""``epoch_batches``: the ppe loop resumed from a snapshot taken mid-epoch (an iteration trigger and a crash)
trains on the batches of an uninterrupted run, in its order, with an augmenting dataset and a loader that has
its own generator; a loader that does not match the manager's epoch is refused."""
from __future__ import annotations

import pytest
import pytorch_pfn_extras as ppe
import torch

import ppe_snapshot


class Augmented(torch.utils.data.Dataset):
    """Draws from torch's global generator while loading, as random augmentations do."""

    def __init__(self) -> None:
        self.x = torch.randn(20, 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] + torch.rand(4)


class Crash(Exception):
    pass


def _train(out_dir: str, crash_at: int | None = None) -> tuple[list[float], torch.nn.Module]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    loader = torch.utils.data.DataLoader(Augmented(), batch_size=4, shuffle=True, generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ppe.training.ExtensionsManager(model, optimizer, 3, iters_per_epoch=len(loader), out_dir=out_dir)
    manager.extend(ppe_snapshot.snapshot(autoload=True), trigger=(3, "iteration"))
    seen = []
    while not manager.stop_trigger:
        for batch in ppe_snapshot.epoch_batches(manager, loader):
            with manager.run_iteration():
                if manager.iteration == crash_at:
                    raise Crash
                seen.append(batch.sum().item())
                optimizer.zero_grad()
                model(batch).sum().backward()
                optimizer.step()
    return seen, model


def test_a_run_resumed_mid_epoch_trains_on_the_batches_of_an_uninterrupted_one(tmp_path):
    straight, model = _train(str(tmp_path / "straight"))
    assert len(straight) == 15
    with pytest.raises(Crash):
        _train(str(tmp_path / "crashed"), crash_at=8)  # saved at 6: one batch into the second epoch
    resumed, resumed_model = _train(str(tmp_path / "crashed"))
    assert resumed == straight[6:]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed_model.state_dict().values()))


def test_a_loader_that_does_not_match_the_managers_epoch_is_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    manager = ppe.training.ExtensionsManager(model, torch.optim.SGD(model.parameters(), lr=0.1), 1,
                                             iters_per_epoch=10, out_dir=str(tmp_path))
    manager.iteration = 7
    with pytest.raises(ValueError, match="iteration 7 of epoch 0, which a loader of 5 batches per epoch does not "
                                         "reach: create the manager with iters_per_epoch=len"):
        next(ppe_snapshot.epoch_batches(manager, [torch.ones(2)] * 5))
    with pytest.raises(TypeError, match="needs a loader with a length"):
        next(ppe_snapshot.epoch_batches(manager, iter([torch.ones(2)])))
