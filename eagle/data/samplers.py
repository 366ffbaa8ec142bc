"""The training order of a data set: a shuffle drawn anew each epoch that a resumed run takes
up where the optimizer steps left off, and deals out to the processes itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from torch.utils.data import DistributedSampler

# () -> (batches trained, batches per epoch, samples per batch), or None outside a fit
Progress = Callable[[], "tuple[int, int, int] | None"]


class EpochShuffle(DistributedSampler):
    """Each epoch a shuffle of `range(length)` drawn from `(seed, epoch)`.

    With `progress` (() -> (batches trained so far, batches per epoch, samples per batch of one
    process), or None before training), each iteration starts where the optimizer steps left
    off: in epoch `batches // per_epoch`, past its first `batches % per_epoch` batches. A run
    resumed from any step (a crash, `trainer.max_time`) then trains on exactly the samples an
    uninterrupted run would, whatever Lightning's own counters say (resumed from the checkpoint
    `fit` saves after a `max_time` stop, Lightning counts the cut epoch as done), where a
    DataLoader generator seeded once restarts from epoch 0's first batch. Without `progress`,
    `set_epoch` picks the epoch and every iteration is a whole one.

    Under several processes (`num_replicas`) each epoch's order is padded with its first
    samples to a multiple of the processes and dealt out, rank `rank` taking every
    `num_replicas`-th sample (what `DistributedSampler` does to a dataset), and the skip is this
    process's. It is a `DistributedSampler` so that Lightning does not wrap it in its own: the
    wrapper indexed the order by the full epoch's length, and a resumed part-epoch, shorter,
    ended in an IndexError as soon as DataLoader workers prefetched past it.
    """

    def __init__(self, length: int, seed: int = 0, progress: Progress | None = None,
                 num_replicas: int = 1, rank: int = 0):
        # not DistributedSampler.__init__, which reads a dataset and the process group: the
        # attributes it sets are set here
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not one of {num_replicas} processes")
        self.length, self.seed, self.epoch, self.progress = length, seed, 0, progress
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.drop_last = False, False
        self.num_samples = -(-length // num_replicas)  # this process's samples per epoch
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at each epoch start
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        epoch, skip = self.epoch, 0
        where = self.progress() if self.progress is not None else None
        if where is not None:
            batches, per_epoch, per_batch = where
            epoch, skip = batches // per_epoch, (batches % per_epoch) * per_batch
        order = np.random.default_rng([self.seed, epoch]).permutation(self.length)  # (length,)
        if self.num_replicas > 1:  # padded with its start, then dealt out
            order = np.resize(order, self.total_size)[self.rank::self.num_replicas]
        yield from order[skip:].tolist()
