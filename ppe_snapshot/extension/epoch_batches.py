"""``epoch_batches``: the ordinary ppe loop, resumable in the middle of an epoch.

A loop ``while not manager.stop_trigger: for batch in loader: with manager.run_iteration(): ...`` resumed from
a snapshot taken mid-epoch (a preemption save, an iteration trigger) starts the epoch over, draws another
shuffle, and runs into the manager it finalized. Iterating ``epoch_batches(manager, loader)`` instead gives the
batches of the manager's epoch that it has not trained on yet, in the order of the interrupted run, and stops
when the manager does.

Why the order is the same: each epoch's shuffle is drawn from a torch generator seeded with a value of the
epoch and the run's initial torch seed (which the snapshot's RNG state carries), the global generators set
aside meanwhile, so it does not depend on where in the epoch the run was interrupted. The batches already
trained on are read again and dropped, inside that set-aside state: the random numbers the resumed run draws
from then on (dropout, augmentations) are the ones the interrupted run drew.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from ppe_snapshot.engine import RNGState


def _epoch_seed(epoch: int) -> int:
    """The seed of an epoch's shuffle: from the run's initial torch seed, which a restored RNG state brings back."""
    digest = hashlib.blake2b(f"{torch.initial_seed()}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def epoch_batches(manager: Any, loader: Any) -> Iterator[Any]:
    """The batches of ``manager``'s current epoch from ``loader`` that it has not trained on yet.

    Use it in place of ``loader`` in ppe's loop::

        while not manager.stop_trigger:
            for batch in ppe_snapshot.epoch_batches(manager, loader):
                with manager.run_iteration():
                    train_step(batch)

    ``loader`` has ``len(loader)`` batches per epoch, as the manager counts
    (``iters_per_epoch=len(loader)``). Autoload runs first (the manager's
    extensions are started here), so a run resumed from a snapshot taken after
    ``k`` batches of an epoch continues with batch ``k + 1`` of that epoch's
    order; the ``k`` batches are read and dropped (they cost their loading
    time once). Iteration stops when the manager's stop trigger fires, so the
    loop never runs an iteration on a finalized manager.

    Each epoch's shuffle is drawn from torch seeded by the epoch number and the
    run's initial seed (``torch.initial_seed()``, restored with the RNG state
    that engine snapshots hold): seed the run (``torch.manual_seed``) when it
    must also match a run that did not use autoload, and keep the RNG state in
    single-file snapshots (``savefun=torch.save``) through ``state_objects``.
    A loader with its own ``generator`` has it seeded the same way; a sampler
    with ``set_epoch`` (``DistributedSampler``) is told the epoch.
    """
    if manager.stop_trigger:  # also starts the extensions: autoload sets the position
        return
    try:
        per_epoch = len(loader)
    except TypeError as e:
        raise TypeError("epoch_batches needs a loader with a length (the batches of one epoch); "
                        f"{type(loader).__name__} has none") from e
    epoch = manager.epoch
    done = manager.iteration - epoch * per_epoch
    if not 0 <= done < per_epoch:
        raise ValueError(f"the manager is at iteration {manager.iteration} of epoch {epoch}, which a loader of "
                         f"{per_epoch} batches per epoch does not reach: create the manager with "
                         "iters_per_epoch=len(loader)")
    for batch in _resume(loader, epoch, done):
        yield batch
        if manager.stop_trigger:
            return


def _resume(loader: Any, epoch: int, done: int) -> Iterator[Any]:
    """``loader``'s batches of ``epoch`` after the first ``done``, shuffled as in every run."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    current = RNGState().state_dict() if done else None
    with torch.random.fork_rng(devices=[]):
        seed = _epoch_seed(epoch)
        torch.manual_seed(seed)
        generator = getattr(loader, "generator", None)
        if generator is not None:
            generator.manual_seed(seed)
        batches = iter(loader)
        # The shuffle is drawn at the first batch: read it (or the batches to drop) while torch is seeded.
        first = [next(batches)] if not done else []
        for _ in itertools.islice(batches, done):
            pass
    if current is not None:  # dropping batches drew from the other generators too
        RNGState().load_state_dict(current)
    return itertools.chain(first, batches)
