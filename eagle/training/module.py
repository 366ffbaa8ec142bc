"""What every trained model of the repository shares, as LightningModule base classes.

`TrainableModule`: AdamW with a warmup-and-decay schedule (`eagle.training.optim`), validation
sums reduced across processes, counters that survive resuming (training time, tokens seen),
and the contract `eagle.training.fit.fit_and_export` relies on: `artifact` (the folder it
exports to), `quality` (the metric that must beat its baseline) and `export(dir, report)`.

`FrozenTargetModule`: modules trained on a frozen target's features (EAGLE's drafter,
Medusa's heads): the target, kept out of the module's submodules (checkpoints hold the
trained part only), its tokenizer and identity, and its features computed online when the
data carries none.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from eagle.artifacts import write_json
from eagle.target import (
    TargetIdentity,
    TargetMismatchError,
    load_target,
    target_forward,
    tokenizer_hash,
)
from eagle.training.optim import OptimConfig


class StageError(RuntimeError):
    """A training stage that did not produce a usable artifact (stopped early, or no better
    than its baseline); nothing was exported, so later stages cannot pick it up."""


class TrainableModule(L.LightningModule):
    """Base of every trained module. Subclasses set `artifact` and `quality`, pass their
    `optim` settings (`eagle.training.optim.OptimConfig` fields) up, call
    `self.save_hyperparameters()`, add validation sums with `val_add`, and implement
    `save_artifact` (or `export`)."""

    artifact = "model"  # the folder under the run directory that `export` writes
    # (metric, its baseline, "lower" | "higher"): the trained module must beat the baseline
    quality: tuple[str, str, str] = ("val/loss", "val/baseline_loss", "lower")

    def __init__(self, optim: Mapping[str, Any]) -> None:
        super().__init__()
        self.optim = OptimConfig(**optim)  # fails on a bad schedule before any data is read
        self._val: dict[str, Tensor] = {}
        self._time_before = 0.0  # fit() seconds of earlier invocations (from the checkpoint)
        self._fit_t0: float | None = None
        self.tokens_seen = 0  # training tokens (padding excluded) of this process, all invocations
        self.resumed_from_step = 0

    # ----------------------------------------------------------------- optimisation

    def configure_optimizers(self) -> dict[str, Any]:
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("the LR schedule needs a finite trainer.max_steps (or max_epochs)")
        return self.optim.build(self, int(total))

    # ----------------------------------------------------------------- bookkeeping

    def on_train_start(self) -> None:
        self._fit_t0 = time.perf_counter()

    def train_time_s(self) -> float:
        """Wall-clock seconds spent training (validation included), across resumed invocations."""
        now = time.perf_counter() - self._fit_t0 if self._fit_t0 is not None else 0.0
        return self._time_before + now

    def count_tokens(self, attention_mask: Tensor) -> None:
        self.tokens_seen += int(attention_mask.sum())

    def tokens_seen_tensor(self) -> Tensor:
        """This process's count as a tensor on its device, for a sum over processes."""
        return torch.tensor(float(self.tokens_seen), device=self.device)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["eagle"] = {"train_time_s": self.train_time_s(), "tokens_seen": self.tokens_seen}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("eagle", {})
        self.resumed_from_step = int(checkpoint.get("global_step", 0))
        self._time_before = float(saved.get("train_time_s", 0.0))
        self.tokens_seen = int(saved.get("tokens_seen", 0))
        # trainer.max_time budgets each invocation: a restored Timer would stop a run that ran
        # out of time again at once, instead of continuing it
        checkpoint.get("callbacks", {}).pop("Timer", None)

    # ----------------------------------------------------------------- validation sums

    def on_validation_epoch_start(self) -> None:
        self._val = {}

    def val_add(self, key: str, value: Tensor | float) -> None:
        """Add to a validation sum (exact over the epoch, and over processes: `val_totals`)."""
        value = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach()
        self._val[key] = self._val[key] + value if key in self._val else value

    def val_totals(self) -> dict[str, float]:
        """The epoch's sums, added up over every process of the run."""
        if not self._val:
            return {}
        keys = sorted(self._val)
        stacked = torch.stack([self._val[k] for k in keys])
        if self.trainer is not None and self.trainer.world_size > 1:
            stacked = self.trainer.strategy.reduce(stacked, reduce_op="sum")
        return dict(zip(keys, stacked.tolist()))

    # ----------------------------------------------------------------- contract

    def check_baseline(self, val: Mapping[str, float]) -> None:
        """Raise `StageError` when `quality`'s metric is no better than its baseline."""
        metric, baseline, better = self.quality
        ours, theirs = val[metric], val[baseline]
        if not (ours < theirs if better == "lower" else ours > theirs):
            raise StageError(f"{self.artifact}: {metric} {ours:.4f} is no better than its baseline "
                             f"({baseline} {theirs:.4f}): training failed, nothing exported")

    def export(self, out_dir: Path, report: dict[str, Any]) -> Path:
        """Write the trained artifact into `out_dir` (`save_artifact`), with `report` (what the
        run measured, and its config) as `train_metrics.json` beside it."""
        out_dir = Path(out_dir)
        self.save_artifact(out_dir)
        write_json(out_dir / "train_metrics.json", report)
        return out_dir

    def save_artifact(self, out_dir: Path) -> None:
        raise NotImplementedError


class FrozenTargetModule(TrainableModule):
    """A module trained on a frozen target's features.

    Args:
        target_path: the target's Hugging Face folder (with its tokenizer).
        target_dtype: the dtype the target is loaded in.
        optim: the optimiser's settings (`OptimConfig`).
    """

    def __init__(self, target_path: str, target_dtype: str, optim: Mapping[str, Any]) -> None:
        super().__init__(optim)
        target, tokenizer = load_target(target_path, dtype=target_dtype)
        # plain dict entries: not submodules, so not in state_dict() or parameters()
        self.__dict__["target"] = target
        self.tokenizer = tokenizer
        self.target_identity = TargetIdentity.of(target, tokenizer, str(target_path), with_lm_head=True)

    def setup(self, stage: str) -> None:
        """The data must have been made for this target: a feature dump by it (`made_for`), and
        token samples with its tokenizer."""
        dm = self.trainer.datamodule if self.trainer is not None else None
        made_for = getattr(dm, "made_for", None)
        if made_for is not None:
            made_for.check(self.target_identity, f"the feature dump {getattr(dm, 'features_dir', '')}")
        tokenizer = getattr(dm, "tokenizer", None)
        if tokenizer is not None and tokenizer_hash(tokenizer) != self.target_identity.tokenizer_hash:
            raise TargetMismatchError(f"the training data is tokenised with another tokenizer than the target's "
                                      f"({tokenizer_hash(tokenizer)} != {self.target_identity.tokenizer_hash})")

    def _target_on_device(self):
        target = self.target
        if next(target.parameters()).device != self.device:
            target.to(self.device)  # an EAGLE drafter shares its E and lm_head: they move with it
        return target

    def batch_features(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The batch's dumped features, or the target's computed now (online), as (B, T, H) fp32."""
        target = self._target_on_device()
        features = batch.get("features")
        if features is None:  # online: nothing was dumped
            with torch.no_grad():
                features = target_forward(target, batch["input_ids"], attention_mask=batch["attention_mask"]).features
        return features.float()
