"""The built-in corpus: the stdlib's .py files, split deterministically by file."""

from __future__ import annotations

import random

import pytest

from data_gen.corpus import (
    build_python_corpus,
    corpus_fingerprint,
    list_python_files,
    select_files,
    split_of,
)


@pytest.fixture(scope="module")
def stdlib_corpus():
    return build_python_corpus(val_fraction=0.05)


def test_split_is_deterministic_disjoint_and_complete(stdlib_corpus):
    again = build_python_corpus(val_fraction=0.05)
    train, val = list(stdlib_corpus["train"]["path"]), list(stdlib_corpus["validation"]["path"])
    assert train == list(again["train"]["path"]) and val == list(again["validation"]["path"])
    assert corpus_fingerprint(stdlib_corpus) == corpus_fingerprint(again)
    assert not set(train) & set(val)
    assert sorted(train + val) == list_python_files()
    assert 0.03 < len(val) / (len(train) + len(val)) < 0.08  # ~5% of ~1,800 files
    assert not any("site-packages" in p or "dist-packages" in p for p in train + val)
    assert all(not p.startswith("/") for p in train)  # relative paths


def test_split_ignores_listing_order():
    paths = list_python_files()
    shuffled = paths[:]
    random.Random(0).shuffle(shuffled)
    assert [split_of(p, 0.05) for p in paths] == [split_of(p, 0.05) for p in sorted(shuffled)]
    assert select_files(shuffled, 40) == select_files(paths, 40)


def test_reads_bytes_faithfully_and_skips_third_party(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "a.py").write_bytes(b"x = 1\r\ny = 'caf\xc3\xa9'\n")
    (tmp_path / "pkg" / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\ns = '\xe9'\n")
    (tmp_path / "site-packages" / "third.py").write_text("import numpy\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    for i in range(20):  # so that both splits get files
        (tmp_path / f"m{i:02d}.py").write_text(f"value = {i}\n")
    assert list_python_files(tmp_path)[:2] == ["a.py", "m00.py"]
    assert "site-packages/third.py" not in list_python_files(tmp_path)
    corpus = build_python_corpus(val_fraction=0.3, root=tmp_path)
    rows = {
        path: text
        for split in ("train", "validation")
        for path, text in zip(corpus[split]["path"], corpus[split]["text"])
    }
    assert len(rows) == 22
    assert rows["a.py"] == "x = 1\r\ny = 'café'\n"  # \r\n kept, UTF-8 decoded
    assert rows["pkg/latin1.py"] == "# -*- coding: latin-1 -*-\ns = '\ufffd'\n"  # not UTF-8


def test_small_roots_and_cache(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(40):
        (root / f"m{i:02d}.py").write_text(f"value = {i}\n")
    cache = tmp_path / "cache"
    first = build_python_corpus(val_fraction=0.3, root=root, cache_dir=cache)
    assert (cache / "corpus_meta.json").exists()
    cached = build_python_corpus(val_fraction=0.3, root=root, cache_dir=cache)
    assert corpus_fingerprint(first) == corpus_fingerprint(cached)
    assert len(first["train"]) + len(first["validation"]) == 40
    with pytest.raises(ValueError, match="was built with"):
        build_python_corpus(val_fraction=0.2, root=root, cache_dir=cache)
    with pytest.raises(ValueError, match="split is empty"):
        build_python_corpus(val_fraction=0.01, root=root, max_files=3)
    with pytest.raises(ValueError, match="val_fraction"):
        build_python_corpus(val_fraction=1.5, root=root)


def test_max_files_subset_is_fixed(stdlib_corpus):
    a = build_python_corpus(val_fraction=0.25, max_files=48)
    b = build_python_corpus(val_fraction=0.25, max_files=48)
    assert len(a["train"]) + len(a["validation"]) == 48
    assert list(a["validation"]["path"]) == list(b["validation"]["path"])
    assert len(a["validation"]) > 0
    all_paths = set(stdlib_corpus["train"]["path"]) | set(stdlib_corpus["validation"]["path"])
    assert set(a["train"]["path"]) <= all_paths


def test_training_samplers_resume_where_the_optimizer_steps_left_off():
    """Given (batches trained, batches per epoch, samples per batch), a sampler's next iteration
    is the rest of the epoch an uninterrupted run would be in; without it, the epoch Lightning
    sets, whole."""
    from eagle.data.tokens import EpochShuffle, RandomOffsetSampler

    makers = (lambda **kw: EpochShuffle(12, seed=5, **kw), lambda **kw: RandomOffsetSampler(1000, 12, seed=5, **kw))
    for make in makers:
        epochs = []
        for e in range(3):
            sampler = make()
            sampler.set_epoch(e)
            epochs.append(list(sampler))
        assert len(epochs[1]) == 12 and epochs[0] != epochs[1]
        assert list(make(progress=lambda: (6, 4, 3))) == epochs[1][6:]  # step 6 at 4 a epoch: epoch 1, batch 2
        assert list(make(progress=lambda: (8, 4, 3))) == epochs[2]  # an epoch boundary: all of epoch 2
        assert list(make(progress=lambda: None)) == epochs[0]


def test_training_samplers_deal_each_epoch_out_to_the_processes_themselves():
    """Under several processes each rank takes every n-th sample of the epoch's order, padded
    with its first samples (what Lightning's wrapper did), and skips its own share of the
    batches trained. The sampler is a DistributedSampler, so Lightning does not wrap it: its
    wrapper indexed a resumed part-epoch by the whole epoch's length, and DataLoader workers
    prefetching past the part hit an IndexError (every resume of a multi-GPU run with workers)."""
    from torch.utils.data import DataLoader, DistributedSampler

    from eagle.data.tokens import EpochShuffle

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
    part = EpochShuffle(40, 0, progress=lambda: (5, 10, 2), num_replicas=2, rank=0)  # 5 of 10 batches left
    loaded = list(DataLoader(list(range(40)), batch_size=2, sampler=part, num_workers=2))
    assert [x for b in loaded for x in b.tolist()] == list(part) and len(loaded) == 5


def test_the_batches_trained_count_the_step_that_ends_each_epoch():
    """With gradient accumulation Lightning steps on an epoch's last batch too: 10 batches an
    epoch at 4 a step are 3 steps (4 + 4 + 2). After 4 steps the run is 4 batches into epoch 1;
    counting 4 batches a step put it at batch 6, skipping 2 batches of every epoch."""
    from types import SimpleNamespace

    from eagle.training.datamodules import trained_batches

    def where(step: int, per_epoch: int = 10, accumulate: int = 4):
        trainer = SimpleNamespace(num_training_batches=per_epoch, accumulate_grad_batches=accumulate, global_step=step)
        return trained_batches(SimpleNamespace(trainer=trainer, batch_size=2))

    assert where(3) == (10, 10, 2) and where(4) == (14, 10, 2) and where(7) == (24, 10, 2)
    assert where(5, accumulate=1) == (5, 10, 2)
    assert trained_batches(SimpleNamespace(trainer=None, batch_size=2)) is None
