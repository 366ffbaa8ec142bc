"""The data of every training run, as Lightning DataModules.

- `FeatureDataModule`: a feature dump (`python -m data_gen`) for a drafter trained offline.
- `OnlineDataModule`: token samples only; the frozen target computes the features.
- `DistilledDataModule`: the target's own continuations (`python -m data_gen.distill`) as
  token rows for a small LM, optionally without those earlier SSMs cover (boost-tuning).

None of them needs the model: the modules check that the data was made for their target
(`made_for`, `tokenizer`; `eagle.training.module.FrozenTargetModule.setup`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader

from eagle.artifacts import SPLITS
from eagle.data.batches import TokenSamples, collate
from eagle.data.features import (
    FeatureDumpError,
    made_for,
    open_feature_dump,
    samples_fingerprint,
    verify_shard,
)
from eagle.data.samplers import EpochShuffle
from eagle.data.vocab import count_tokens
from eagle.target import TargetIdentity, load_tokenizer, tokenizer_hash


def eval_sampler(datamodule: L.LightningDataModule, dataset) -> dict[str, Any]:
    """DataLoader arguments that give each process of a multi-process run its own part of the
    validation set, every sample exactly once: Lightning's default sampler pads the ranks with
    repeated samples, which would bias the summed metrics (`TrainableModule.val_totals`)."""
    trainer = datamodule.trainer
    if trainer is None or trainer.world_size <= 1:
        return {}
    n, world = len(dataset), trainer.world_size
    if n < world:  # a process without a batch would hang the others' collectives
        raise ValueError(f"{n} validation samples cannot be split over {world} processes: "
                         f"make the validation split larger")
    if _sharded(trainer.strategy):  # every forward gathers weights from every process
        fewest, most = (-(-k // datamodule.batch_size) for k in (n // world, -(-n // world)))
        if fewest != most:  # one process would gather alone in its extra batch: a hang
            raise ValueError(
                f"{n} validation samples over {world} processes in batches of "
                f"{datamodule.batch_size} "
                f"give some processes {most} batches and others {fewest}; with sharded weights "
                f"every process must run as many: use {world * datamodule.batch_size * fewest} or "
                f"{world * datamodule.batch_size * most} validation samples"
            )
    return {
        "sampler": UnrepeatedDistributedSampler(
            dataset, num_replicas=world, rank=trainer.global_rank, shuffle=False
        )
    }


def trained_batches(datamodule: L.LightningDataModule) -> tuple[int, int, int] | None:
    """Where training stands, for the training samplers (`eagle.data.samplers.EpochShuffle`):
    (batches trained, batches per epoch, samples per batch of one process), from the optimizer
    steps taken (exact after a resume, where Lightning's epoch counter may not be); None
    outside a fit. With gradient accumulation an epoch ends on a step of its own (Lightning
    steps on its last batch), so an epoch takes ceil(batches / accumulation) steps."""
    trainer = datamodule.trainer
    per_epoch = getattr(trainer, "num_training_batches", None)
    if trainer is None or not per_epoch or math.isinf(per_epoch):
        return None
    per_epoch, accumulate = int(per_epoch), trainer.accumulate_grad_batches
    epochs, steps = divmod(trainer.global_step, -(-per_epoch // accumulate))
    return epochs * per_epoch + steps * accumulate, per_epoch, datamodule.batch_size


def shard(datamodule: L.LightningDataModule) -> dict[str, int]:
    """This process's share of a training sampler (`num_replicas`, `rank`): the data-parallel
    processes Lightning would deal a dataset out to; {} in one process or outside a fit."""
    trainer = datamodule.trainer
    kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
    return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]} if kwargs else {}


def _sharded(strategy) -> bool:
    """Does every forward of this strategy gather weights from every process (FSDP, DeepSpeed)?"""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    return isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy))


class SampleDataModule(L.LightningDataModule):
    """Batches of samples (`eagle.data.batches.collate`): shuffled for training, in order for
    validation. Subclasses fill `self.splits` in `setup`."""

    # do the batches carry the target's features (else the target computes them)?
    has_features = False

    def __init__(self, batch_size: int = 8, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.splits: dict[str, torch.utils.data.Dataset] = {}

    def _check_splits(self, where: str) -> None:
        for split in SPLITS:
            if split not in self.splits or len(self.splits[split]) == 0:
                raise ValueError(f"{where} has no {split} samples")

    def train_dataloader(self) -> DataLoader:
        train = self.splits["train"]
        order = EpochShuffle(
            len(train), self.seed, progress=partial(trained_batches, self), **shard(self)
        )
        return DataLoader(
            train,
            batch_size=self.batch_size,
            sampler=order,
            collate_fn=collate,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        val = self.splits["validation"]
        return DataLoader(
            val,
            batch_size=self.batch_size,
            collate_fn=collate,
            num_workers=self.num_workers,
            **eval_sampler(self, val),
        )

    def top_token_id(self) -> int:
        """The largest token id of any sample (-1 for none): the target's embedding must have a
        row for it (`FrozenTargetModule.setup`)."""
        self._check_splits("top_token_id: the data module (was setup() called?)")
        return max(
            (
                int(ids.max())
                for split in SPLITS
                for ids, _ in self.splits[split].token_rows()
                if ids.size
            ),
            default=-1,
        )

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token is predicted in the training split
        (`eagle.data.vocab.count_tokens`)."""
        self._check_splits("token_counts: the data module (was setup() called?)")
        return count_tokens(self.splits["train"].token_rows(), vocab_size)


class FeatureDataModule(SampleDataModule):
    """Batches of dumped features (`python -m data_gen`).

    Args:
        features_dir: the dump folder (holds metadata.json).
        batch_size: samples per batch.
        num_workers: DataLoader workers.
        verify: "checksum" (sha256 of every shard, once at setup), "size" or "none".
        seed: shuffling of the training samples.
    """

    has_features = True

    def __init__(
        self,
        features_dir: str | Path,
        batch_size: int = 8,
        num_workers: int = 0,
        verify: str = "checksum",
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        self.features_dir, self.verify = Path(features_dir), verify
        self.meta: dict[str, Any] = {}
        self.made_for: TargetIdentity | None = None  # the target the features came from
        # the training samples' (set up from the dump's metadata)
        self.fingerprint: str | None = None

    def setup(self, stage: str | None = None) -> None:
        if not self.splits:
            trainer = self.trainer
            world, rank = (
                (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
            )
            shared = self.verify == "checksum" and world > 1
            self.meta, self.splits = open_feature_dump(
                self.features_dir, verify="size" if shared else self.verify
            )
            if shared:
                self._checksum_shared(trainer, world, rank)
            self.made_for = made_for(self.meta)
            self._check_splits(f"feature dump {self.features_dir}")
            # the training samples' identity, wherever the dump lies (a resumed run must see the
            # same)
            self.fingerprint = (
                self.meta.get("params", {}).get("splits", {}).get("train", {}).get("fingerprint")
            )

    def _checksum_shared(self, trainer: L.Trainer, world: int, rank: int) -> None:
        """Each of `world` processes hashes every world-th shard (a 7B dump holds hundreds of GB:
        hashed once, not once per GPU), and all of them agree before any trains, so a corrupt
        shard stops every process rather than one, with the others waiting on it."""
        jobs = [
            (split, info)
            for split in SPLITS
            for info in self.meta["splits"].get(split, {}).get("shards", [])
        ]
        failure = None
        try:
            for split, info in jobs[rank::world]:
                verify_shard(self.features_dir / split / info["name"], info, "checksum")
        except FeatureDumpError as err:
            failure = err
        if not trainer.strategy.reduce_boolean_decision(failure is None, all=True):
            raise failure or FeatureDumpError(
                f"feature dump {self.features_dir}: a shard failed its checksum in "
                "another process (its message is in that process's output)"
            )


class OnlineDataModule(SampleDataModule):
    """Token samples only: the training module computes the target's features on the fly.

    Args:
        source: a sample builder of `data_gen.conversations` (a partial), called as
            `source(tokenizer=..., max_len=...)`.
        tokenizer_path: the folder of the tokenizer to render the samples with: the target's.
        max_len: tokens per sample.
        batch_size, num_workers, seed: as `FeatureDataModule`.
    """

    def __init__(
        self,
        source: Callable[..., dict[str, list]],
        tokenizer_path: str | Path,
        max_len: int = 256,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, num_workers, seed)
        if not callable(source):  # configs/data/online.yaml names no source of its own
            raise ValueError(
                "data=online needs a sample source: add data_gen@_global_=sharegpt "
                "source.path=/data/conversations.json (or =text)"
            )
        self.source, self.tokenizer_path, self.max_len = source, tokenizer_path, max_len
        self.tokenizer = None
        # the training samples' (as a dump of them would record)
        self.fingerprint: str | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        samples = self.source(tokenizer=self.tokenizer, max_len=self.max_len)
        self.splits = {s: TokenSamples(samples.get(s, [])) for s in SPLITS}
        self._check_splits("the online data source")
        self.fingerprint = samples_fingerprint(samples.get("train", []))


class DistilledDataModule(L.LightningDataModule):
    """Self-distilled rows (`python -m data_gen.distill`: prompt + the target's continuation)
    as whole token rows for training a causal LM, an SSM for SpecInfer's merge.

    Collective boost-tuning: with `covered_by`, the training rows that any of those SSMs
    already covers (`eagle.data.coverage`: its argmax is the target's on >= `threshold` of
    the continuation) are left out, so this SSM learns the rest. Validation keeps every row.

    Args:
        distill_dir: the distillation folder (holds metadata.json).
        tokenizer_path: the target's folder: its tokenizer must be the one the rows were made with.
        batch_size: rows per batch.
        covered_by: model folders of the SSMs trained before this one (boost-tuning).
        threshold: the coverage threshold.
        num_workers: DataLoader workers.
        seed: shuffling of the training rows.
    """

    def __init__(
        self,
        distill_dir: str | Path,
        tokenizer_path: str | Path,
        batch_size: int = 8,
        covered_by: Sequence[str] = (),
        threshold: float = 0.5,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.distill_dir, self.tokenizer_path = Path(distill_dir), str(tokenizer_path)
        self.batch_size, self.covered_by, self.threshold = batch_size, list(covered_by), threshold
        self.num_workers, self.seed = num_workers, seed
        self.tokenizer = None
        self.rows: dict[str, torch.Tensor] = {}
        self.info: dict[str, Any] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.rows:
            return
        from eagle.data.coverage import CoverCriterion, agreement, covered
        from eagle.data.distill import load_distilled, split_rows

        meta, splits = load_distilled(self.distill_dir)
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        if meta.get("tokenizer_hash") not in (None, tokenizer_hash(self.tokenizer)):
            raise ValueError(
                f"{self.distill_dir} was made with another tokenizer than {self.tokenizer_path}'s"
            )
        rows = {split: split_rows(splits[split], f"{self.distill_dir} {split}") for split in SPLITS}
        self.rows = {split: ids for split, (ids, _, _) in rows.items()}
        n_train = len(self.rows["train"])
        keep = torch.ones(n_train, dtype=torch.bool)
        if self.covered_by:
            from transformers import AutoModelForCausalLM

            criterion = CoverCriterion(self.threshold)
            _, argmax, prompt_len = rows["train"]
            for path in self.covered_by:
                ssm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                keep &= ~covered(agreement(ssm, self.rows["train"], argmax, prompt_len), criterion)
            print(
                f"[boost] {int(keep.sum())} of {n_train} training rows are not covered by "
                f"{self.covered_by} "
                f"(threshold {self.threshold}): this SSM trains on those"
            )
            if not keep.any():
                raise ValueError(
                    f"the SSMs {self.covered_by} cover every training row at threshold "
                    f"{self.threshold}: "
                    f"nothing is left for another SSM (raise the threshold or use fewer SSMs)"
                )
        self.rows["train"] = self.rows["train"][keep]
        self.info = {
            "corpus": f"self-distilled:{self.distill_dir.name}",
            "corpus_fingerprint": meta["params"]["splits"]["train"]["fingerprint"],
            "n_tokens": int(self.rows["train"].numel()),
            "val_tokens": int(self.rows["validation"][:, 1:].numel()),
            "train_rows": int(keep.sum()),
            "all_train_rows": n_train,
            "covered_by": self.covered_by,
        }
        # the rows this SSM trains on
        self.fingerprint = f"{self.info['corpus_fingerprint']}:{self.info['train_rows']}"

    def describe(self) -> dict[str, Any]:
        return dict(self.info)

    def train_dataloader(self) -> DataLoader:
        train = list(self.rows["train"])
        order = EpochShuffle(
            len(train), self.seed, progress=partial(trained_batches, self), **shard(self)
        )
        return DataLoader(
            train,
            batch_size=self.batch_size,
            sampler=order,
            num_workers=self.num_workers,
            drop_last=len(train) >= self.batch_size,
        )

    def val_dataloader(self) -> DataLoader:
        val = list(self.rows["validation"])
        return DataLoader(
            val, batch_size=self.batch_size, num_workers=self.num_workers, **eval_sampler(self, val)
        )

    def unigram_val_loss(self, vocab_size: int) -> float:
        """The add-one unigram model of the training rows, on the validation targets: the
        baseline a trained LM must beat."""
        return unigram_cross_entropy(
            self.rows["train"].numpy().ravel(),
            self.rows["validation"][:, 1:].numpy().ravel(),
            vocab_size,
        )


def unigram_cross_entropy(train_tokens: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of `targets` under add-one unigram frequencies of train."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size) + 1.0
    log_p = np.log(counts) - np.log(counts.sum())
    return float(-log_p[np.asarray(targets, dtype=np.int64)].mean())
