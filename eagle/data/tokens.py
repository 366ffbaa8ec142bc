"""Token streams for training a causal LM from scratch: the corpus tokenised once into flat
`.npy` streams, random fixed-length blocks for training, fixed blocks for validation, and the
unigram baseline a trained LM must beat."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from eagle.artifacts import SPLITS

log = logging.getLogger(__name__)


def corpus_fingerprint(corpus: Mapping[str, Any]) -> str:
    """sha256 over every split's paths and texts: identifies the exact corpus content."""
    h = hashlib.sha256()
    for split in SPLITS:
        for path, text in zip(corpus[split]["path"], corpus[split]["text"]):
            h.update(f"{split}\0{path}\0".encode())
            h.update(text.encode("utf-8", errors="surrogatepass"))
            h.update(b"\0")
    return h.hexdigest()


def tokenize_corpus(corpus: Mapping[str, Any], tokenizer: Any, out_dir: str | Path) -> dict:
    """Tokenise every split into one flat stream `<|bos|> file <|eos|> <|bos|> file ...`.

    Writes `{split}.npy` (uint16 when the vocabulary fits, else int32) and returns what the
    cache's sidecar records. `corpus` maps split name to a dataset (or dict) with a `text`
    column; the tokenizer must add bos itself (as the built-in one does).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    meta: dict[str, Any] = {"n_files": {}, "n_tokens": {}, "dtype": np.dtype(dtype).name}
    for split in SPLITS:
        texts = list(corpus[split]["text"])
        ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
        stream = np.fromiter(
            (t for doc in ids for t in (*doc, tokenizer.eos_token_id)), dtype=dtype
        )
        np.save(out_dir / f"{split}.npy", stream)
        meta["n_files"][split] = len(texts)
        meta["n_tokens"][split] = int(stream.size)
        log.info("tokenised %s: %d files, %d tokens", split, len(texts), stream.size)
    return meta


class BlockDataset(Dataset):
    """Blocks of `block_size + 1` tokens of a flat stream, indexed by start offset.

    With `offsets` the dataset has one item per listed offset; without, item i starts at i.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, offsets: np.ndarray | None = None):
        if tokens.size < block_size + 1:
            raise ValueError(f"{tokens.size} tokens cannot fill one block of {block_size} + 1")
        self.tokens, self.block_size, self.offsets = tokens, block_size, offsets

    def __len__(self) -> int:
        if self.offsets is not None:
            return len(self.offsets)
        return self.tokens.size - self.block_size

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.offsets[i]) if self.offsets is not None else int(i)
        block = self.tokens[start : start + self.block_size + 1]
        return torch.from_numpy(block.astype(np.int64))  # (T+1,)


Progress = Callable[[], "tuple[int, int, int] | None"]  # (batches trained, per epoch, samples per batch)


class EpochSampler(DistributedSampler):
    """A training order drawn anew each epoch from `(seed, epoch)` (`_epoch_order`).

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

    def __init__(self, length: int, seed: int = 0, progress: Progress | None = None, num_replicas: int = 1,
                 rank: int = 0):
        # not DistributedSampler.__init__, which reads a dataset and the process group: the
        # attributes it sets are set here
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not one of {num_replicas} processes")
        self.length, self.seed, self.epoch, self.progress = length, seed, 0, progress
        self.num_replicas, self.rank, self.shuffle, self.drop_last = num_replicas, rank, False, False
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
        order = self._epoch_order(np.random.default_rng([self.seed, epoch]))  # (length,)
        if self.num_replicas > 1:
            order = np.resize(order, self.total_size)[self.rank::self.num_replicas]  # padded with its start, dealt
        yield from order[skip:].tolist()

    def _epoch_order(self, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError


class EpochShuffle(EpochSampler):
    """Each epoch a shuffle of `range(n)` (samples of a dataset)."""

    def _epoch_order(self, rng: np.random.Generator) -> np.ndarray:
        return rng.permutation(self.length)


class RandomOffsetSampler(EpochSampler):
    """`num_samples` uniform random offsets into `n_offsets` per epoch (blocks of a token stream)."""

    def __init__(self, n_offsets: int, num_samples: int, seed: int = 0, progress: Progress | None = None,
                 num_replicas: int = 1, rank: int = 0):
        super().__init__(num_samples, seed, progress, num_replicas, rank)
        self.n_offsets = n_offsets

    def _epoch_order(self, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(0, self.n_offsets, size=self.length)


def fixed_block_offsets(n_tokens: int, block_size: int, max_blocks: int | None) -> np.ndarray:
    """Starts of non-overlapping blocks covering the stream, thinned evenly to `max_blocks`."""
    n_blocks = (n_tokens - 1) // block_size
    if n_blocks < 1:
        raise ValueError(f"{n_tokens} validation tokens cannot fill one block of {block_size}")
    keep = np.arange(n_blocks)
    if max_blocks is not None and max_blocks < n_blocks:
        keep = np.unique(np.linspace(0, n_blocks - 1, max_blocks).round().astype(np.int64))
    return keep * block_size


def unigram_cross_entropy(train_tokens: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of `targets` under add-one unigram frequencies of train."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size) + 1.0
    log_p = np.log(counts) - np.log(counts.sum())
    return float(-log_p[np.asarray(targets, dtype=np.int64)].mean())
