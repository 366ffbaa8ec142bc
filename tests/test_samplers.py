"""The training order: a shuffle per epoch that a resumed run takes up where the optimizer steps
left off, dealt out to the processes by the sampler itself."""

from __future__ import annotations

from types import SimpleNamespace

from torch.utils.data import DataLoader, DistributedSampler

from eagle.data.samplers import EpochShuffle
from eagle.training.datamodules import trained_batches


def test_training_samplers_resume_where_the_optimizer_steps_left_off():
    """Given (batches trained, batches per epoch, samples per batch), a sampler's next iteration
    is the rest of the epoch an uninterrupted run would be in; without it, the epoch Lightning
    sets, whole."""
    def make(**kw):
        return EpochShuffle(12, seed=5, **kw)

    epochs = []
    for e in range(3):
        sampler = make()
        sampler.set_epoch(e)
        epochs.append(list(sampler))
    assert len(epochs[1]) == 12 and epochs[0] != epochs[1]
    assert sorted(epochs[1]) == list(range(12))  # a shuffle: every sample once an epoch
    # step 6 at 4 steps an epoch: epoch 1, batch 2
    assert list(make(progress=lambda: (6, 4, 3))) == epochs[1][6:]
    assert list(make(progress=lambda: (8, 4, 3))) == epochs[2]  # an epoch boundary: all of epoch 2
    assert list(make(progress=lambda: None)) == epochs[0]


def test_training_samplers_deal_each_epoch_out_to_the_processes_themselves():
    """Under several processes each rank takes every n-th sample of the epoch's order, padded
    with its first samples (what Lightning's wrapper did), and skips its own share of the
    batches trained. The sampler is a DistributedSampler, so Lightning does not wrap it: its
    wrapper indexed a resumed part-epoch by the whole epoch's length, and DataLoader workers
    prefetching past the part hit an IndexError (every resume of a multi-GPU run with workers)."""
    whole = list(EpochShuffle(10, seed=5))
    ranks = [EpochShuffle(10, seed=5, num_replicas=3, rank=r) for r in range(3)]
    assert all(isinstance(s, DistributedSampler) and len(s) == 4 for s in ranks)
    padded = whole + whole[:2]
    assert [list(s) for s in ranks] == [padded[r::3] for r in range(3)]
    # resumed after 3 steps of 2 batches an epoch, batches of 1 per process: epoch 1, batch 1
    resumed = EpochShuffle(10, seed=5, num_replicas=3, rank=1, progress=lambda: (3, 2, 1))
    epoch1 = EpochShuffle(10, seed=5, num_replicas=3, rank=1)
    epoch1.set_epoch(1)
    assert list(resumed) == list(epoch1)[1:]
    # workers prefetching a resumed part-epoch: exactly its batches, no IndexError
    part = EpochShuffle(40, 0, progress=lambda: (5, 10, 2), num_replicas=2, rank=0)  # 5 of 10 left
    loaded = list(DataLoader(list(range(40)), batch_size=2, sampler=part, num_workers=2))
    assert [x for b in loaded for x in b.tolist()] == list(part) and len(loaded) == 5


def test_the_batches_trained_count_the_step_that_ends_each_epoch():
    """With gradient accumulation Lightning steps on an epoch's last batch too: 10 batches an
    epoch at 4 a step are 3 steps (4 + 4 + 2). After 4 steps the run is 4 batches into epoch 1;
    counting 4 batches a step put it at batch 6, skipping 2 batches of every epoch."""
    def where(step: int, per_epoch: int = 10, accumulate: int = 4):
        trainer = SimpleNamespace(num_training_batches=per_epoch, global_step=step,
                                  accumulate_grad_batches=accumulate)
        return trained_batches(SimpleNamespace(trainer=trainer, batch_size=2))

    assert where(3) == (10, 10, 2) and where(4) == (14, 10, 2) and where(7) == (24, 10, 2)
    assert where(5, accumulate=1) == (5, 10, 2)
    assert trained_batches(SimpleNamespace(trainer=None, batch_size=2)) is None
