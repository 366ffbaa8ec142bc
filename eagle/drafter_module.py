"""Training an EAGLE-1 drafter: the LightningModule, its DataModules and the fit routine.

`FrozenTargetModule`, the DataModules and `fit_drafter` also serve Medusa's heads
(`eagle.medusa_module`): same target handling, data, optimiser, resuming and export.

Alignment (DESIGN.md §3). A sample holds tokens x_0..x_{T-1}, the target's features
f_0..f_{T-1} (f_t feeds the LM head that predicts x_{t+1}) and a loss mask m_0..m_{T-1}
(1 = a token the target produces: assistant replies, or all of plain text). The drafter's
input at t is [f_{t-1}; E(x_t)] for t = 1..T-1; its output f_hat_t targets f_t, and
lm_head(f_hat_t) is the draft distribution of x_{t+1}. So

    drafter inputs   features = f[:, :-1]     (f_{t-1})
                     input_ids = x[:, 1:]     (x_t)
    targets          f[:, 1:]                 (f_t)
    weights          m[:, 2:] + [0]           (is x_{t+1} a trained token?)

The last position's next token is not in the sample, so it gets weight 0 (as in EAGLE's
own code). Batches are right-padded: with causal attention no real position sees a pad,
and pads have weight 0.

Offline training reads features dumped by `python -m data_gen` (`FeatureDataModule`);
online training (`OnlineDataModule`) yields token samples only and the module computes the
features with the frozen target under no_grad, nothing written to disk. The target is
loaded in both cases (its embeddings and LM head are the drafter's, frozen, and never
saved with it); it is kept out of the module's submodules, so checkpoints hold the
drafter only.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from data_gen.features import FeatureShards, dump_identity, open_feature_dump
from eagle import metrics
from eagle.drafter import DrafterConfig, EagleDrafter
from eagle.schedules import SCHEDULES, lr_multiplier
from eagle.target import embeddings, lm_head, load_target, target_forward

log = logging.getLogger(__name__)


class StageError(RuntimeError):
    """A training stage that did not produce a usable artifact (stopped early, or no better
    than its baseline); nothing was exported, so later stages cannot pick it up."""


def require_planned_steps(trainer: L.Trainer, what: str, last_ckpt: str | Path) -> None:
    """Raise `StageError` when fit() stopped before `trainer.max_steps` (its `max_time` ran out):
    the schedule was planned for max_steps, so the model is unfinished. The resume point was saved."""
    planned = trainer.max_steps
    if planned is not None and planned > 0 and trainer.global_step < planned:
        raise StageError(f"{what} stopped after {trainer.global_step} of {trainer.max_steps} steps (trainer.max_time "
                         f"ran out): nothing was exported. Rerun the same command to resume from {last_ckpt}, or "
                         f"give it more time (trainer.max_time=DD:HH:MM:SS)")


def forget_timer(checkpoint: dict[str, Any]) -> None:
    """Drop Lightning's Timer state from a checkpoint being resumed: `trainer.max_time` then
    budgets each invocation, so that rerunning a run that ran out of time continues it (a
    restored Timer would stop it again at once)."""
    checkpoint.get("callbacks", {}).pop("Timer", None)


def shift_batch(input_ids: Tensor, features: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """The drafter's view of a batch (see the module docstring for the alignment).

    Args:
        input_ids: (B, T) x_0..x_{T-1}; features: (B, T, H) f_0..f_{T-1}; loss_mask: (B, T).
    Returns:
        `features_in` (B, T-1, H) f_{t-1}, `input_ids` (B, T-1) x_t, `target` (B, T-1, H) f_t,
        `weight` (B, T-1) = m_{t+1} (0 at the last position).
    """
    weight = F.pad(loss_mask[:, 2:], (0, 1)).float()  # (B, T-1)
    return {"features_in": features[:, :-1], "input_ids": input_ids[:, 1:],
            "target": features[:, 1:], "weight": weight}


class FrozenTargetModule(L.LightningModule):
    """What every module trained on a frozen target's features shares (EAGLE's drafter,
    Medusa's heads): the target, kept out of the module's submodules (checkpoints hold the
    trained part only), its tokenizer and identity (what a feature dump must match), its
    features computed online when nothing was dumped, AdamW with the LR schedule, and
    validation sums added up over an epoch.

    Subclasses call `super().__init__(target_path, target_dtype, schedule)`, then
    `self.save_hyperparameters()` with hparams lr, weight_decay, betas, eps, warmup_steps,
    schedule and min_lr_ratio, and implement `export(dir)`.
    """

    artifact = "drafter"  # what `export` writes, for messages

    def __init__(self, target_path: str, target_dtype: str, schedule: str) -> None:
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
        target, tokenizer = load_target(target_path, dtype=target_dtype)
        # plain dict entries: not submodules, so not in state_dict() or parameters()
        self.__dict__["target"] = target
        self.tokenizer = tokenizer
        self.target_identity = dump_identity(target, tokenizer, str(target_path))
        self._val: dict[str, float] = {}

    def _target_on_device(self):
        target = self.target
        if next(target.parameters()).device != self.device:
            target.to(self.device)  # an EAGLE drafter shares its E and lm_head: they move with it
        return target

    @torch.no_grad()
    def target_features(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Online features: the frozen target's last hidden state, (B, T, H)."""
        return target_forward(self._target_on_device(), input_ids, attention_mask=attention_mask).features

    def batch_features(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The batch's dumped features, or the target's computed now (online), as (B, T, H) fp32."""
        self._target_on_device()
        features = batch.get("features")
        if features is None:  # online: nothing was dumped
            features = self.target_features(batch["input_ids"], batch["attention_mask"])
        return features.float()

    def on_validation_epoch_start(self) -> None:
        self._val = {}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        forget_timer(checkpoint)

    def check_baseline(self, val: Mapping[str, float]) -> None:
        """Raise `StageError` when the trained module is no better than its baseline."""
        raise NotImplementedError

    def _add(self, key: str, value: Tensor | float) -> None:
        self._val[key] = self._val.get(key, 0.0) + float(value)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
        )
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("the LR schedule needs a finite trainer.max_steps (or max_epochs)")
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, hp.warmup_steps, int(total), hp.schedule, hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def export(self, out_dir: str | Path) -> Path:
        raise NotImplementedError


class EagleDrafterModule(FrozenTargetModule):
    """EAGLE-1 drafter training against a frozen target.

    Loss = w_feat * SmoothL1(f_hat, f) + w_tok * CE(lm_head(f_hat), softmax(lm_head(f))), both
    masked means over the weighted positions.

    Args:
        target_path: the target's Hugging Face folder (with its tokenizer).
        target_dtype: dtype the target is loaded in (its features online, E and lm_head).
        drafter_config: overrides of `DrafterConfig.from_target(target)` (e.g. a narrower MLP).
        w_feat / w_tok: loss weights (EAGLE-1: 1.0 and 0.1).
        noise: half-width of the uniform noise added to the input features in training.
        lr, weight_decay, betas, eps: AdamW (weight decay on matrices only).
        warmup_steps, schedule, min_lr_ratio: see `lr_multiplier`; the schedule ends at the
            trainer's last step.
        smooth_l1_beta: SmoothL1's switch point from quadratic to linear.
        val_depth: validation agreement at depths 1..val_depth (each depth one drafter pass).
        val_topk: the k of the top-k agreements reported besides top-1.
        seed: initialisation of the drafter.
    """

    def __init__(
        self,
        target_path: str,
        target_dtype: str = "float32",
        drafter_config: Mapping[str, Any] | None = None,
        w_feat: float = 1.0,
        w_tok: float = 0.1,
        noise: float = 0.1,
        lr: float = 3e-5,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 100,
        schedule: str = "linear",
        min_lr_ratio: float = 0.0,
        smooth_l1_beta: float = 1.0,
        val_depth: int = 5,
        val_topk: int = 4,
        seed: int = 0,
    ) -> None:
        if val_depth < 1:
            raise ValueError(f"val_depth must be >= 1, got {val_depth}")
        super().__init__(target_path, target_dtype, schedule)
        self.save_hyperparameters()
        target, tokenizer = self.target, self.tokenizer
        config = DrafterConfig.from_target(target, tokenizer, str(target_path))
        if drafter_config:
            config = DrafterConfig.from_dict({**config.to_dict(), **dict(drafter_config)})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.drafter = EagleDrafter(config, embeddings(target), lm_head(target))

    # ------------------------------------------------------------------ helpers

    def head(self, features: Tensor) -> Tensor:
        """The target's LM head (frozen): (..., H) -> (..., V)."""
        return self.drafter.logits(features)

    # ------------------------------------------------------------------ steps

    def model_step(self, batch: Mapping[str, Tensor], train: bool) -> dict[str, Tensor]:
        """Loss terms of a batch; `train` adds the input-feature noise."""
        v = shift_batch(batch["input_ids"], self.batch_features(batch), batch["loss_mask"])
        features_in = v["features_in"]
        if train and self.hparams.noise > 0:
            # U(-a, a) on the drafter's input features: it learns to draft from its own,
            # imperfect features (EAGLE's code scales a by 512/seq_len; we keep it constant)
            features_in = features_in + (torch.rand_like(features_in) * 2 - 1) * self.hparams.noise
        f_hat = self.drafter(features_in, v["input_ids"])  # (B, T-1, H)
        with torch.no_grad():
            target_logits = self.head(v["target"])  # (B, T-1, V) p = softmax of this
        draft_logits = self.head(f_hat)  # (B, T-1, V) q = softmax of this
        w = v["weight"]
        feat_err = metrics.feature_error(f_hat, v["target"], beta=self.hparams.smooth_l1_beta)  # (B, T-1)
        tok_err = metrics.soft_cross_entropy(draft_logits, target_logits)  # (B, T-1)
        feat_loss = metrics.masked_mean(feat_err, w)
        tok_loss = metrics.masked_mean(tok_err, w)
        loss = self.hparams.w_feat * feat_loss + self.hparams.w_tok * tok_loss
        return {
            "loss": loss, "feat_loss": feat_loss, "tok_loss": tok_loss,
            "feat_sum": (feat_err * w).sum().detach(), "tok_sum": (tok_err * w).sum().detach(),
            "count": w.sum(), "draft_logits": draft_logits.detach(), "target_logits": target_logits,
            "features_in": v["features_in"], "input_ids": v["input_ids"], "weight": w,
        }

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model_step(batch, train=True)
        b = batch["input_ids"].shape[0]
        top1 = metrics.masked_mean(metrics.topk_hits(out["draft_logits"], out["target_logits"]).float(),
                                   out["weight"])
        self.log("train/loss", out["loss"], on_step=True, prog_bar=True, batch_size=b)
        self.log("train/feat_loss", out["feat_loss"], on_step=True, batch_size=b)
        self.log("train/tok_loss", out["tok_loss"], on_step=True, batch_size=b)
        self.log("train/top1", top1, on_step=True, prog_bar=True, batch_size=b)
        return out["loss"]

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        out = self.model_step(batch, train=False)
        self._add("feat_sum", out["feat_sum"])
        self._add("tok_sum", out["tok_sum"])
        self._add("count", out["count"])
        ks = sorted({1, self.hparams.val_topk})
        hits = metrics.agreement_by_depth(
            lambda f, x: self.drafter(f, x), self.head, out["features_in"], out["input_ids"],
            out["target_logits"], out["weight"], depth=self.hparams.val_depth, ks=ks)
        for (d, k), (h, n) in hits.items():
            self._add(f"top{k}_d{d}/hits", h)
            self._add(f"top{k}_d{d}/count", n)
        # baseline: a drafter that returns its input feature f_{t-1} unchanged
        copy_hits, copy_count = metrics.masked_sum_count(
            metrics.topk_hits(self.head(out["features_in"]), out["target_logits"]).float(), out["weight"])
        self._add("top1_copy/hits", copy_hits)
        self._add("top1_copy/count", copy_count)

    def on_validation_epoch_end(self) -> None:
        if not self._val.get("count"):
            return
        n = self._val["count"]
        feat, tok = self._val["feat_sum"] / n, self._val["tok_sum"] / n  # exact token means
        logs = {"val/loss": self.hparams.w_feat * feat + self.hparams.w_tok * tok,
                "val/feat_loss": feat, "val/tok_loss": tok}
        for key in sorted(k for k in self._val if k.endswith("/hits")):
            name = key[: -len("/hits")]
            logs[f"val/{name}"] = self._val[key] / max(self._val[f"{name}/count"], 1.0)
        self.log_dict(logs)
        self.log("val/top1", logs["val/top1_d1"], prog_bar=True)  # = top1_d1, for the bar

    def check_baseline(self, val: Mapping[str, float]) -> None:
        if not val["val/top1_d1"] > val["val/top1_copy"]:
            raise StageError(f"the drafter's top-1 agreement {val['val/top1_d1']:.4f} is no better than copying its "
                             f"input feature ({val['val/top1_copy']:.4f}): training failed")

    # ------------------------------------------------------------------ export

    def export(self, out_dir: str | Path) -> Path:
        """Save the drafter (no target weights) with `eagle.checkpoint.save_drafter`."""
        from eagle.checkpoint import save_drafter

        out_dir = Path(out_dir)
        save_drafter(self.drafter, out_dir)
        return out_dir


# ---------------------------------------------------------------------------- data


def collate(items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Right-pad a list of samples: input_ids, loss_mask, attention_mask (B, T) and, when the
    samples carry them, features (B, T, H) in their stored dtype (pads are zeros)."""
    t = max(int(x["input_ids"].shape[0]) for x in items)
    b = len(items)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    out = {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}
    if "features" in items[0]:
        h = items[0]["features"].shape[-1]
        out["features"] = torch.zeros(b, t, h, dtype=items[0]["features"].dtype)
    for i, x in enumerate(items):
        n = int(x["input_ids"].shape[0])
        ids[i, :n] = x["input_ids"]
        mask[i, :n] = x["loss_mask"]
        attn[i, :n] = 1
        if "features" in out:
            out["features"][i, :n] = x["features"]
    return out


class FeatureDataModule(L.LightningDataModule):
    """Batches of dumped features (`python -m data_gen`), validated against the target.

    Args:
        features_dir: the dump folder (holds metadata.json).
        batch_size: samples per batch.
        num_workers: DataLoader workers.
        verify: "checksum" (sha256 of every shard, once at setup), "size" or "none".
        seed: shuffling of the training samples.
        target_identity: `data_gen.features.dump_identity` of the training target; the dump
            must match it (tokenizer hash, hidden size, vocab, LM head). None skips the check.
        tokenizer: unused (the online DataModule's argument, so both are built alike).
    """

    def __init__(self, features_dir: str | Path, batch_size: int = 8, num_workers: int = 0,
                 verify: str = "checksum", seed: int = 0, target_identity: dict | None = None,
                 tokenizer: Any = None) -> None:
        super().__init__()
        self.features_dir = Path(features_dir)
        self.batch_size, self.num_workers, self.verify, self.seed = batch_size, num_workers, verify, seed
        self.target_identity = target_identity
        self.meta: dict[str, Any] = {}
        self.splits: dict[str, FeatureShards] = {}

    def setup(self, stage: str | None = None) -> None:
        if not self.splits:
            self.meta, self.splits = open_feature_dump(self.features_dir, self.target_identity, self.verify)
            for split in ("train", "validation"):
                if split not in self.splits or len(self.splits[split]) == 0:
                    raise ValueError(f"feature dump {self.features_dir} has no {split} samples")

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, generator=g,
                          collate_fn=collate, num_workers=self.num_workers, drop_last=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["validation"], batch_size=self.batch_size, collate_fn=collate,
                          num_workers=self.num_workers)


class TokenSamples(torch.utils.data.Dataset):
    """Token samples of `data_gen.conversations` as tensors (no features)."""

    def __init__(self, samples: Sequence[Mapping[str, Any]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        s = self.samples[i]
        return {"input_ids": torch.from_numpy(np.asarray(s["input_ids"], dtype=np.int64)),
                "loss_mask": torch.from_numpy(np.asarray(s["loss_mask"], dtype=np.int64))}


class OnlineDataModule(L.LightningDataModule):
    """Token samples only: the module computes the target's features on the fly.

    Args:
        source: a sample builder of `data_gen.conversations` (a partial), called as
            `source(tokenizer=..., max_len=...)`.
        max_len: tokens per sample.
        batch_size, num_workers, seed: as `FeatureDataModule`.
        tokenizer: the target's tokenizer (given by the training entry point).
        target_identity: unused (features come from the training target itself).
    """

    def __init__(self, source: Callable[..., dict[str, list]], max_len: int = 256, batch_size: int = 8,
                 num_workers: int = 0, seed: int = 0, tokenizer: Any = None,
                 target_identity: dict | None = None) -> None:
        super().__init__()
        self.source, self.max_len, self.tokenizer = source, max_len, tokenizer
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.splits: dict[str, TokenSamples] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        if self.tokenizer is None:
            raise ValueError("OnlineDataModule needs the target's tokenizer")
        samples = self.source(tokenizer=self.tokenizer, max_len=self.max_len)
        for split in ("train", "validation"):
            if not samples.get(split):
                raise ValueError(f"the online data source gave no {split} samples")
        self.splits = {s: TokenSamples(samples[s]) for s in ("train", "validation")}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, generator=g,
                          collate_fn=collate, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["validation"], batch_size=self.batch_size, collate_fn=collate,
                          num_workers=self.num_workers)


# ----------------------------------------------------------------------------- fit


def fit_drafter(module: FrozenTargetModule, datamodule: L.LightningDataModule, trainer: L.Trainer,
                ckpt_dir: str | Path, save_dir: str | Path, resume: bool = True,
                debug: bool = False, sidecar: Mapping[str, Any] | None = None,
                check_baseline: bool = True) -> dict[str, Any]:
    """Fit (resuming from `ckpt_dir/last.ckpt`), validate, and export the drafter (EAGLE's, or
    Medusa's heads) to `save_dir`.

    A run whose last.ckpt is already at max_steps does no training but still validates and
    exports. `debug` (fast_dev_run) neither resumes nor writes a checkpoint. The returned
    metrics, with `sidecar` (e.g. the run's config), also go to `save_dir/train_metrics.json`.
    Returns the final validation metrics plus `steps`, `<artifact>_dir` (`drafter_dir`,
    `medusa_dir`) and timing.
    """
    ckpt_dir, save_dir = Path(ckpt_dir), Path(save_dir)
    last = ckpt_dir / "last.ckpt"
    ckpt_path = str(last) if resume and not debug and last.exists() else None
    step0 = 0
    if ckpt_path:
        step0 = int(torch.load(ckpt_path, map_location="cpu", weights_only=False)["global_step"])
        print(f"resuming from {ckpt_path} (step {step0})")
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    fit_time = time.perf_counter() - t0
    if not debug:
        trainer.save_checkpoint(last)  # the resume point is the final step, always
        require_planned_steps(trainer, f"the {module.artifact}", last)
    train_loss = float(trainer.callback_metrics.get("train/loss", float("nan")))  # before validate() resets it
    val = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    val = {k: float(v) for k, v in sorted(val.items())}
    if check_baseline and not debug:
        module.check_baseline(val)
    module.export(save_dir)
    result = {**val, "train/loss": train_loss, "steps": trainer.global_step, "resumed_from_step": step0,
              "fit_time_s": round(fit_time, 2), f"{module.artifact}_dir": str(save_dir)}
    (save_dir / "train_metrics.json").write_text(json.dumps({**result, **(sidecar or {})}, indent=2) + "\n")
    print(f"\n{module.artifact}: {trainer.global_step} steps (from {step0}), fit {fit_time:.0f}s; final validation:")
    for key, value in val.items():
        print(f"  {key:<18} {value:.4f}")
    print(f"--- saved {module.artifact} to {save_dir}")
    return result
