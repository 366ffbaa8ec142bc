"""Training an EAGLE-1 drafter against a frozen target (docs/design.md §3).

The batch alignment (the drafter's input at t is [f_{t-1}; E(x_t)], its target f_t, its
weight the loss mask of x_{t+1}) is `eagle.data.batches.shift_batch`. Offline training reads
dumped features (`eagle.training.datamodules.FeatureDataModule`); online training computes
them with the frozen target (`OnlineDataModule`, `FrozenTargetModule.batch_features`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle.data.batches import shift_batch
from eagle.data.vocab import save_counts
from eagle.models.checkpoint import save_drafter
from eagle.models.drafter import DrafterConfig, EagleDrafter
from eagle.sampling import argmax
from eagle.training import metrics
from eagle.training.module import FrozenTargetModule, submodule_state


class EagleDrafterModule(FrozenTargetModule):
    """EAGLE-1 drafter training against a frozen target.

    Loss = w_feat * SmoothL1(f_hat, f) + w_tok * CE(lm_head(f_hat), softmax(lm_head(f))), both
    masked means over the weighted positions (plus, with `train_depth` > 1, the same terms for the
    drafter fed its own features, weighted by depth). Its baseline is a drafter that returns its
    input feature f_{t-1} unchanged: a trained drafter must agree with the target more often.

    Args:
        target_path: the target's Hugging Face folder (with its tokenizer).
        target_dtype: dtype the target is loaded in (its features online, E and lm_head).
        drafter_config: overrides of `DrafterConfig.from_target(target)` (e.g. a narrower MLP).
        fc_bias: give the fc a bias (EAGLE-1's) or not (what vLLM's EAGLE loader can serve).
        inputs: what the fc reads (`eagle.models.drafter.INPUTS`): EAGLE-1's "shifted"
            [f_{t-1}; E(x_t)], or an ablation ("unshifted", "feature", "token").
        w_feat / w_tok: loss weights.
        noise: half-width of the uniform noise added to the input features in training.
        smooth_l1_beta: SmoothL1's switch point from quadratic to linear.
        val_depth: validation agreement at depths 1..val_depth (each depth one drafter pass).
        val_topk: the k of the top-k agreements reported besides top-1.
        train_depth: depths the training loss unrolls the drafter to. 1 is EAGLE-1: every
            position is trained on the target's own (noised) features. d > 1 also feeds the
            drafter its own predictions, as drafting does past the first token, and adds their
            losses against the target's features at depths 2..d (`metrics.unroll`, the
            validation's unroll: the depth-k pass reads depth k-1 predictions at every position,
            so its context is all predicted where drafting's prefix is the target's own; a
            pessimistic stand-in for EAGLE-3's training-time test, without its attention masks).
            Each depth costs about one more drafter forward and backward per step.
        depth_decay: weight of depth k's loss is depth_decay ** (k - 1), summed, not averaged
            (EAGLE-3's training code: 0.8), so depth 1 keeps EAGLE-1's loss and scale.
        loss_vocab: train the token loss over the K most frequent tokens of the training data
            only (both distributions renormalised over them; FR-Spec's drafting vocabulary):
            the V x H head is most of a training step on a small target (49,152 x 576 on the
            embedded one), K rows cost K/V of it. None = EAGLE-1's loss over the whole
            vocabulary. Validation always scores the whole vocabulary.
        seed: initialisation of the drafter.
        optim: AdamW and its schedule (`eagle.training.optim.OptimConfig`).
        target_weights, target_device_map: how much of the target is loaded, and where
            (`eagle.training.module.FrozenTargetModule`).
    """

    artifact = "drafter"
    quality = ("val/top1_d1", "val/top1_copy", "higher")
    RESUMABLE_CHANGES = FrozenTargetModule.RESUMABLE_CHANGES | {
        "val_depth",
        "val_topk",
    }  # validation only

    def __init__(
        self,
        target_path: str,
        target_dtype: str = "float32",
        drafter_config: Mapping[str, Any] | None = None,
        fc_bias: bool = True,
        inputs: str = "shifted",
        w_feat: float = 1.0,
        w_tok: float = 0.1,
        noise: float = 0.1,
        smooth_l1_beta: float = 1.0,
        val_depth: int = 5,
        val_topk: int = 4,
        seed: int = 0,
        optim: Mapping[str, Any] | None = None,
        target_weights: str = "auto",
        target_device_map: str | dict | None = None,
        loss_vocab: int | None = None,
        train_depth: int = 1,
        depth_decay: float = 0.8,
    ) -> None:
        if val_depth < 1:
            raise ValueError(f"val_depth must be >= 1, got {val_depth}")
        if isinstance(train_depth, bool) or not isinstance(train_depth, int) or train_depth < 1:
            raise ValueError(f"train_depth must be an integer >= 1, got {train_depth!r}")
        if not 0 < depth_decay <= 1:
            raise ValueError(f"depth_decay must be in (0, 1], got {depth_decay}")
        if loss_vocab is not None and loss_vocab < 1:
            raise ValueError(
                f"loss_vocab must be a number of tokens >= 1 or null, got {loss_vocab}"
            )
        super().__init__(
            target_path, target_dtype, optim or {"lr": 3e-5}, target_weights, target_device_map
        )
        self.save_hyperparameters()
        target, tokenizer = self.target, self.tokenizer
        config = DrafterConfig.from_target(target, tokenizer, str(target_path))
        # the target's identity with its LM head's fingerprint: a load against another head warns
        config = DrafterConfig.from_dict(
            {
                **config.to_dict(),
                "target": self.target_identity.to_dict(),
                "fc_bias": fc_bias,
                "inputs": inputs,
                **dict(drafter_config or {}),
            }
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.drafter = EagleDrafter.on_target(config, target)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.choose_loss_vocab(self.hparams.loss_vocab, self.drafter.config.vocab_size, "token")

    def loss_head(self, features: Tensor) -> Tensor:
        """The LM head over the token loss's rows: (..., H) -> (..., K), or `head` when the loss
        takes the whole vocabulary."""
        if self.loss_ids is None:
            return self.head(features)
        return self.drafter.logit_transform(
            self.loss_rows(self.drafter.lm_head, features, restrict=True)
        )

    def on_full_target(self, target: torch.nn.Module) -> None:
        self.drafter.share_target(target)

    def head(self, features: Tensor) -> Tensor:
        """The target's LM head (frozen): (..., H) -> (..., V)."""
        return self.drafter.logits(features)

    def model_step(self, batch: Mapping[str, Tensor], train: bool) -> dict[str, Tensor]:
        """Loss terms of a batch; `train` adds the input-feature noise."""
        v = shift_batch(batch["input_ids"], self.batch_features(batch), batch["loss_mask"])
        features_in = v["features_in"]
        if train and self.hparams.noise > 0:
            # U(-a, a) on the drafter's input features: it learns to draft from its own,
            # imperfect features (EAGLE's code scales a by 512/seq_len; we keep it constant)
            features_in = features_in + (torch.rand_like(features_in) * 2 - 1) * self.hparams.noise
        depth = (
            self.hparams.train_depth if train else 1
        )  # validation unrolls on its own (validation_step)
        f_hats = metrics.unroll(
            lambda f, x, p: self.drafter(f, x, prev_ids=p),
            features_in,
            v["input_ids"],
            v["prev_ids"],
            depth,
        )  # depth x (B, T-1, H); depth 1: drafter(features_in)
        head = self.loss_head if train else self.head  # validation scores the whole vocabulary
        with torch.no_grad():
            target_logits = head(v["target"])  # (B, T-1, V or K) p = softmax of this

        def errors(f_hat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            """Per-position feature and token errors (B, T-1) of predicted features, and their
            logits."""
            draft_logits = head(f_hat)  # (B, T-1, V or K) q = softmax of this
            return (
                metrics.feature_error(f_hat, v["target"], beta=self.hparams.smooth_l1_beta),
                metrics.soft_cross_entropy(draft_logits, target_logits),
                draft_logits,
            )

        w = v["weight"]
        feat_err, tok_err, draft_logits = errors(f_hats[0])
        feat_loss = metrics.masked_mean(feat_err, w)
        tok_loss = metrics.masked_mean(tok_err, w)
        loss = self.hparams.w_feat * feat_loss + self.hparams.w_tok * tok_loss
        for d, f_d in enumerate(
            f_hats[1:], start=2
        ):  # the drafter fed its own features (train_depth > 1)
            m = metrics.depth_mask(
                w, d
            )  # (B, T-1): positions whose input went through d-1 predicted steps
            feat_d, tok_d, _ = errors(f_d)
            loss = loss + self.hparams.depth_decay ** (d - 1) * (
                self.hparams.w_feat * metrics.masked_mean(feat_d, m)
                + self.hparams.w_tok * metrics.masked_mean(tok_d, m)
            )
        return {
            "loss": loss,
            "feat_loss": feat_loss,
            "tok_loss": tok_loss,
            "feat_sum": (feat_err * w).sum().detach(),
            "tok_sum": (tok_err * w).sum().detach(),
            "count": w.sum(),
            "draft_logits": draft_logits.detach(),
            "target_logits": target_logits,
            "features_in": v["features_in"],
            "input_ids": v["input_ids"],
            "prev_ids": v["prev_ids"],
            "weight": w,
        }

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model_step(batch, train=True)
        self.count_tokens(batch["attention_mask"])
        b = batch["input_ids"].shape[0]
        top1 = metrics.masked_mean(
            metrics.topk_hits(out["draft_logits"], out["target_logits"]).float(), out["weight"]
        )
        self.log("train/loss", out["loss"], on_step=True, prog_bar=True, batch_size=b)
        self.log("train/feat_loss", out["feat_loss"], on_step=True, batch_size=b)
        self.log("train/tok_loss", out["tok_loss"], on_step=True, batch_size=b)
        self.log("train/top1", top1, on_step=True, prog_bar=True, batch_size=b)
        return out["loss"]

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        out = self.model_step(batch, train=False)
        self.val_add("feat_sum", out["feat_sum"])
        self.val_add("tok_sum", out["tok_sum"])
        self.val_add("count", out["count"])
        ks = sorted({1, self.hparams.val_topk})
        hits = metrics.agreement_by_depth(
            lambda f, x, p: self.drafter(f, x, prev_ids=p),
            self.head,
            out["features_in"],
            out["input_ids"],
            out["prev_ids"],
            out["target_logits"],
            out["weight"],
            depth=self.hparams.val_depth,
            ks=ks,
        )
        for (d, k), (h, n) in hits.items():
            self.val_add(f"top{k}_d{d}/hits", h)
            self.val_add(f"top{k}_d{d}/count", n)
        # the baseline: a drafter that returns its input feature f_{t-1} unchanged
        copy_hits, copy_count = metrics.head_hits(
            self.head, out["features_in"], argmax(out["target_logits"]), out["weight"]
        )[1]
        self.val_add("top1_copy/hits", copy_hits)
        self.val_add("top1_copy/count", copy_count)

    def on_validation_epoch_end(self) -> None:
        val = self.val_totals()
        if not val.get("count"):
            return
        n = val["count"]
        feat, tok = val["feat_sum"] / n, val["tok_sum"] / n  # exact token means
        logs = {
            "val/loss": self.hparams.w_feat * feat + self.hparams.w_tok * tok,
            "val/feat_loss": feat,
            "val/tok_loss": tok,
            "val/tokens_d1": val["top1_d1/count"],
        }  # positions behind the agreements (their error bars)
        for key in sorted(k for k in val if k.endswith("/hits")):
            name = key[: -len("/hits")]
            logs[f"val/{name}"] = val[key] / max(val[f"{name}/count"], 1.0)
        self.log_val(logs, bar={"val/top1": "val/top1_d1"})

    def save_artifact(
        self, out_dir: Path, state: dict[str, Tensor], report: dict[str, Any]
    ) -> None:
        """The drafter, without the target's weights (`eagle.models.checkpoint.save_drafter`), and
        the token counts of its training data, for drafting from a reduced vocabulary
        (`eagle.data.vocab`)."""
        save_drafter(self.drafter, out_dir, state=submodule_state(state, "drafter"))
        data = self.trainer.datamodule if self._trainer is not None else None
        if hasattr(data, "token_counts"):
            save_counts(out_dir, data.token_counts(self.drafter.config.vocab_size))
