"""Training a causal LM from scratch: the LightningModule and a token-block DataModule.

Used to build the embedded target (and a classic draft LM) on the built-in corpus. Any
Hugging Face decoder-only architecture works: the module builds the model with
`AutoModelForCausalLM.from_config`, so the result is saved and loaded like any HF model.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from eagle.drafter_module import forget_timer
from eagle.schedules import lr_multiplier

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")
TOKENS_META = "meta.json"


# ----------------------------------------------------------------------------- model


def build_causal_lm(model_config: Mapping[str, Any]) -> PreTrainedModel:
    """A randomly initialised HF causal LM from a config dict holding `model_type`."""
    kwargs = dict(model_config)
    model_type = kwargs.pop("model_type", None)
    if model_type is None:
        raise ValueError("model_config needs a `model_type` (e.g. llama)")
    config = AutoConfig.for_model(model_type, **kwargs)
    return AutoModelForCausalLM.from_config(config)


RESIDUAL_INITS = ("gpt2", "zero")


def init_residual_projections(
    model: PreTrainedModel, mode: str, names: tuple[str, ...] = ("o_proj", "down_proj")
) -> int:
    """Re-initialise the projections that write into the residual stream.

    `gpt2`: divide their init by sqrt(2 L), so the 2 L residual branches add O(1) variance
    in total instead of growing with depth. `zero`: start them at zero (as modded-nanogpt
    does), so every layer starts as the identity and the untrained stack is a bigram model
    (lm_head of the embedding); deep stacks then leave the unigram plateau much sooner.
    Returns the number of projections changed.
    """
    if mode not in RESIDUAL_INITS:
        raise ValueError(f"residual_init must be one of {RESIDUAL_INITS} or null, got {mode!r}")
    n_layers = model.config.num_hidden_layers
    changed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in names and isinstance(module, torch.nn.Linear):
                if mode == "zero":
                    module.weight.zero_()
                else:
                    module.weight.mul_(1.0 / math.sqrt(2 * n_layers))
                changed += 1
    if changed == 0:
        raise ValueError(f"no {names} projections in {type(model).__name__} to re-initialise")
    return changed


class CausalLMModule(L.LightningModule):
    """Next-token training of a Hugging Face causal LM.

    Args:
        model_config: kwargs of the HF config, with `model_type` (vocab size and special
            token ids are normally filled in from the tokenizer by the caller).
        lr: peak learning rate (AdamW).
        weight_decay: decoupled weight decay, applied to matrices only (not norms/biases).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup length, in optimizer steps.
        min_lr_ratio: the cosine schedule ends at `lr * min_lr_ratio` at the trainer's last
            step (`trainer.estimated_stepping_batches`).
        residual_init: `gpt2`, `zero` or None: init of the projections into the residual
            stream (`init_residual_projections`; Llama-family module names).
    """

    def __init__(
        self,
        model_config: Mapping[str, Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        residual_init: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_causal_lm(model_config)
        if residual_init is not None:
            init_residual_projections(self.model, residual_init)
        self._val_nll = 0.0  # summed over the epoch's target tokens
        self._val_count = 0
        self._time_before = 0.0  # fit() seconds of earlier runs, restored from the checkpoint
        self._fit_t0: float | None = None

    def train_time_s(self) -> float:
        """Wall-clock seconds spent in fit() (validation included), across resumed runs."""
        now = time.perf_counter() - self._fit_t0 if self._fit_t0 is not None else 0.0
        return self._time_before + now

    def on_fit_start(self) -> None:
        self._fit_t0 = time.perf_counter()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["train_time_s"] = self.train_time_s()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._time_before = float(checkpoint.get("train_time_s", 0.0))
        forget_timer(checkpoint)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def model_step(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Mean next-token cross-entropy of a batch of blocks.

        Args:
            batch: (B, T+1) token ids; positions 0..T-1 are the input, 1..T the targets.
        Returns:
            (loss, number of target tokens)
        """
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T) each
        logits = self(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        return loss, y.numel()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss, _ = self.model_step(batch)
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=batch.shape[0])
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_nll, self._val_count = 0.0, 0

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss, n = self.model_step(batch)
        self._val_nll += loss.item() * n
        self._val_count += n

    def on_validation_epoch_end(self) -> None:
        if self._val_count == 0:
            return
        val_loss = self._val_nll / self._val_count  # exact token mean over all val blocks
        self.log("val/loss", val_loss, prog_bar=True)
        self.log("val/ppl", math.exp(min(val_loss, 50.0)))

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.lr,
            betas=tuple(hp.betas),
            eps=hp.eps,
        )
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("the LR schedule needs a finite trainer.max_steps (or max_epochs)")
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_multiplier(step, hp.warmup_steps, int(total), "cosine", hp.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ------------------------------------------------------------------------------ data


def tokenize_corpus(corpus: Mapping[str, Any], tokenizer: Any, out_dir: str | Path) -> dict:
    """Tokenise every split into one flat stream `<|bos|> file <|eos|> <|bos|> file ...`.

    Writes `{split}.npy` (uint16 when the vocabulary fits, else int32) and `meta.json`.
    `corpus` maps split name to a dataset (or dict) with a `text` column; the tokenizer
    must add bos itself (as the built-in one does).
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


class RandomOffsetSampler(Sampler[int]):
    """`num_samples` uniform random offsets per epoch, reseeded by `(seed, epoch)`."""

    def __init__(self, n_offsets: int, num_samples: int, seed: int = 0):
        self.n_offsets, self.num_samples, self.seed, self.epoch = n_offsets, num_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at each epoch start
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        yield from rng.integers(0, self.n_offsets, size=self.num_samples).tolist()


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


class TokenBlockDataModule(L.LightningDataModule):
    """Random fixed-length blocks for training, fixed blocks for validation.

    The corpus is tokenised once into `tokens_dir` (`train.npy`, `validation.npy`,
    `meta.json`) and memory-mapped afterwards; it is redone when the tokenizer or corpus
    changes (`tokenizer_sha256`, `corpus_fingerprint` in the meta).

    Args:
        tokens_dir: where the token streams are cached.
        block_size: tokens of context per training example (each item holds one more: the
            last target).
        batch_size: blocks per batch.
        val_max_blocks: validate on at most this many blocks, spread evenly over the
            validation stream (None = all).
        train_samples_per_epoch: blocks per "epoch" (None = train tokens // block_size); an
            epoch is only the unit that reseeds the random offsets.
        num_workers: DataLoader workers.
        seed: seed of the random training offsets.
        corpus: split name -> dataset with a `text` column; needed only to (re)tokenise.
        tokenizer: HF tokenizer; needed only to (re)tokenise.
        tokenizer_sha256: identifies the tokenizer in the cache meta.
        corpus_fingerprint: identifies the corpus in the cache meta.
    """

    def __init__(
        self,
        tokens_dir: str | Path,
        block_size: int = 256,
        batch_size: int = 8,
        val_max_blocks: int | None = None,
        train_samples_per_epoch: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        corpus: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        tokenizer_sha256: str | None = None,
        corpus_fingerprint: str | None = None,
    ) -> None:
        super().__init__()
        self.tokens_dir = Path(tokens_dir)
        self.block_size, self.batch_size = block_size, batch_size
        self.val_max_blocks, self.train_samples_per_epoch = val_max_blocks, train_samples_per_epoch
        self.num_workers, self.seed = num_workers, seed
        self.corpus, self.tokenizer = corpus, tokenizer
        self.source = {"tokenizer_sha256": tokenizer_sha256, "corpus_fingerprint": corpus_fingerprint}
        self.meta: dict[str, Any] = {}
        self.tokens: dict[str, np.ndarray] = {}

    def _cached_meta(self) -> dict[str, Any] | None:
        path = self.tokens_dir / TOKENS_META
        if not path.exists():
            return None
        meta = json.loads(path.read_text())
        if self.corpus is not None and meta.get("source") != self.source:
            return None  # built from another tokenizer or corpus: stale
        return meta

    def prepare_data(self) -> None:
        if self._cached_meta() is not None:
            return
        if self.corpus is None or self.tokenizer is None:
            raise FileNotFoundError(
                f"no token cache in {self.tokens_dir} and no corpus/tokenizer to build it from"
            )
        meta = tokenize_corpus(self.corpus, self.tokenizer, self.tokens_dir)
        meta["source"] = self.source
        (self.tokens_dir / TOKENS_META).write_text(json.dumps(meta, indent=2) + "\n")

    def setup(self, stage: str | None = None) -> None:
        if self.tokens:
            return
        meta = self._cached_meta()
        if meta is None:
            raise FileNotFoundError(f"no token cache in {self.tokens_dir}: call prepare_data()")
        self.meta = meta
        self.tokens = {s: np.load(self.tokens_dir / f"{s}.npy", mmap_mode="r") for s in SPLITS}
        self.val_offsets = fixed_block_offsets(
            self.tokens["validation"].size, self.block_size, self.val_max_blocks
        )

    def train_dataloader(self) -> DataLoader:
        train = BlockDataset(self.tokens["train"], self.block_size)
        num_samples = self.train_samples_per_epoch or max(1, len(train) // self.block_size)
        sampler = RandomOffsetSampler(len(train), num_samples, seed=self.seed)
        return DataLoader(
            train, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        val = BlockDataset(self.tokens["validation"], self.block_size, self.val_offsets)
        return DataLoader(val, batch_size=self.batch_size, num_workers=self.num_workers)

    def val_targets(self) -> np.ndarray:
        """Every token the validation loss is computed on, (n_blocks * block_size,)."""
        val = self.tokens["validation"]
        return np.concatenate([val[o + 1 : o + self.block_size + 1] for o in self.val_offsets])

    def unigram_val_loss(self, vocab_size: int) -> float:
        """The add-one unigram model's cross-entropy on exactly the validation targets."""
        return unigram_cross_entropy(self.tokens["train"], self.val_targets(), vocab_size)
