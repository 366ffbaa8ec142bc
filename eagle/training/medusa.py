"""Training Medusa-1 heads on a frozen target: the LightningModule.

Alignment. A sample holds tokens x_0..x_{T-1}, the target's features f_0..f_{T-1} (f_t feeds
the LM head that predicts x_{t+1}) and a loss mask m_0..m_{T-1} (1 = a token the target
produces). Head k (k = 1..K) reads f_t and predicts x_{t+k+1}, so with the shift s = k + 1

    labels   x[:, s:] + [0] * s          (x_{t+s}; nothing past the sample's end)
    weights  m[:, s:] + [0] * s          (is x_{t+s} a trained token?)

(`shifted_labels`; s = 1 is the LM head's own task, reported as head 0 for reference).
Medusa-1 trains on hard labels, the data's tokens, with the target frozen:

    loss = sum_k lambda_k * CE(head_k(f_t), x_{t+k+1})    (masked means)

`loss_vocab=K` takes the training loss over the K tokens the data predicts most often, as the
EAGLE drafter's token loss can (`FrozenTargetModule.choose_loss_vocab`): only those K rows of
each head's V x H projection enter a step (a target's head is most of a step's arithmetic), the
labels outside them are left out of the loss, and the other rows stay the LM head they were
initialised from. The heads then draft from those K tokens only (their config's `draft_vocab`:
every other logit is -inf). Validation reports the same cross-entropy over the K tokens, and
top-k hits as decoding will see them, over the whole vocabulary: a label outside the K is a miss.

The data, the optimiser, resuming and export are shared with the EAGLE drafter
(`eagle.training.module.FrozenTargetModule`, `eagle.training.datamodules`,
`eagle.training.fit.fit_and_export`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle.models.checkpoint import save_medusa
from eagle.models.medusa import MedusaHeads
from eagle.target import head_logits
from eagle.training import metrics
from eagle.training.module import FrozenTargetModule, submodule_state


def shifted_labels(input_ids: Tensor, loss_mask: Tensor, shift: int) -> tuple[Tensor, Tensor]:
    """The token `shift` positions ahead of each position, and whether it is trained.

    Args:
        input_ids, loss_mask: (B, T).
        shift: s >= 1; head k of Medusa uses s = k + 1, the LM head s = 1.
    Returns:
        labels (B, T) long, x_{t+s} (0 where t + s >= T), and weights (B, T) float, m_{t+s}
        (0 where t + s >= T).
    """
    if shift < 1:
        raise ValueError(f"shift must be >= 1, got {shift}")
    labels = torch.zeros_like(input_ids)
    weights = torch.zeros(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)
    t = input_ids.shape[1]
    if shift < t:
        labels[:, : t - shift] = input_ids[:, shift:]
        weights[:, : t - shift] = loss_mask[:, shift:].float()
    return labels, weights


def loss_weights(
    num_heads: int, decay: float, weights: Sequence[float] | None = None
) -> list[float]:
    """lambda_1..lambda_K: `weights` when given (K of them), else decay^(k-1)."""
    if weights is not None:
        weights = [float(w) for w in weights]
        if len(weights) != num_heads or any(w < 0 for w in weights):
            raise ValueError(
                f"head_weights must be {num_heads} non-negative numbers (one per head), got "
                f"{weights}"
            )
        return weights
    if not decay > 0:
        raise ValueError(f"head_weight_decay must be > 0, got {decay}")
    return [decay ** (k - 1) for k in range(1, num_heads + 1)]


class MedusaModule(FrozenTargetModule):
    """Medusa-1 heads trained against a frozen target. The baseline of head 1 is the untrained
    head, i.e. the LM head itself, judged on x_{t+2}.

    Args:
        target_path: the target's Hugging Face folder (with its tokenizer).
        target_dtype: dtype the target is loaded in (its LM head initialises the heads).
        num_heads: K; head k predicts x_{t+k+1}.
        num_layers: residual blocks per head.
        head_weight_decay: lambda_k = decay^(k-1) unless `head_weights` is given.
        head_weights: explicit lambda_1..lambda_K.
        val_topk: the k of the top-k accuracy reported besides top-1.
        loss_vocab: train over the K most frequent tokens of the data (None: every token).
        seed: initialisation of the heads.
        optim: AdamW and its schedule (`eagle.training.optim.OptimConfig`).
        target_weights, target_device_map: how much of the target is loaded, and where
            (`eagle.training.module.FrozenTargetModule`).
    """

    artifact = "medusa"
    quality = ("val/top1_h1", "val/top1_h0_shift2", "higher")
    RESUMABLE_CHANGES = FrozenTargetModule.RESUMABLE_CHANGES | {"val_topk"}  # validation only

    def __init__(
        self,
        target_path: str,
        target_dtype: str = "float32",
        num_heads: int = 5,
        num_layers: int = 1,
        head_weight_decay: float = 0.8,
        head_weights: Sequence[float] | None = None,
        val_topk: int = 5,
        loss_vocab: int | None = None,
        seed: int = 0,
        optim: Mapping[str, Any] | None = None,
        target_weights: str = "auto",
        target_device_map: str | dict | None = None,
    ) -> None:
        lambdas = loss_weights(
            num_heads, head_weight_decay, head_weights
        )  # fail before loading the target
        if loss_vocab is not None and loss_vocab < 1:
            raise ValueError(
                f"loss_vocab must be a number of tokens >= 1 or null, got {loss_vocab}"
            )
        super().__init__(
            target_path,
            target_dtype,
            optim or {"lr": 1e-3, "schedule": "cosine"},
            target_weights,
            target_device_map,
        )
        self.save_hyperparameters()
        self.lambdas = lambdas
        self.heads = MedusaHeads.for_target(
            self.target, num_heads, num_layers, self.tokenizer, str(target_path), seed=seed
        )
        self.heads.config.target = self.target_identity.to_dict()  # with the LM head's fingerprint

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.choose_loss_vocab(self.hparams.loss_vocab, self.heads.config.vocab_size, "Medusa")
        if (
            self.loss_ids is not None
        ):  # the heads then draft from those tokens only (saved with them)
            self.heads.restrict_vocab(self.loss_ids)
        self._loss_index = None

    def to_loss_vocab(self, labels: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """Labels (B, T) as indices into the loss vocabulary; the weight of a label outside it is 0.
        """
        index = getattr(self, "_loss_index", None)
        if index is None or index.device != labels.device:
            index = torch.full(
                (self.heads.config.vocab_size,), -1, dtype=torch.long, device=labels.device
            )
            index[self.loss_ids.to(labels.device)] = torch.arange(
                self.loss_ids.numel(), device=labels.device
            )
            self._loss_index = index
        mapped = index[labels]  # (B, T), -1 outside
        return mapped.clamp(min=0), weights * (mapped >= 0)

    def model_step(self, batch: Mapping[str, Tensor], train: bool = False) -> dict[str, Any]:
        """Per-head cross-entropies (masked means) and the weighted loss of a batch. With a loss
        vocabulary the cross-entropies are over its tokens (labels outside it weigh 0); the
        logits returned for the hits are over them in training, over every token in validation
        (-inf off the drafting vocabulary, as decoding sees them)."""
        features = self.batch_features(batch)  # (B, T, H)
        restrict = self.loss_ids is not None
        logits = (
            self.heads.drafted(features) if restrict else self.heads(features)
        )  # (K, B, T, V_loss or V)
        out: dict[str, Any] = {
            "logits": [],
            "labels": [],
            "weights": [],
            "ce_sum": [],
            "ce_count": [],
            "loss_h": [],
        }
        loss = features.new_zeros(())
        for k in range(1, self.heads.num_heads + 1):
            labels, w = shifted_labels(
                batch["input_ids"], batch["loss_mask"], shift=k + 1
            )  # (B, T) x 2
            ce_labels, ce_w = self.to_loss_vocab(labels, w) if restrict else (labels, w)
            ce = F.cross_entropy(
                logits[k - 1].float().flatten(0, 1), ce_labels.flatten(), reduction="none"
            ).view_as(ce_w)  # (B, T)
            loss_k = metrics.masked_mean(ce, ce_w)
            loss = loss + self.lambdas[k - 1] * loss_k
            if restrict and not train:  # hits over every token, as decoding drafts
                hit_logits, labels_k, w_k = self.heads.to_vocab(logits[k - 1 : k])[0], labels, w
            else:
                hit_logits, labels_k, w_k = logits[k - 1], ce_labels, ce_w
            out["logits"].append(hit_logits.detach())
            out["labels"].append(labels_k)
            out["weights"].append(w_k)
            out["ce_sum"].append((ce * ce_w).sum().detach())
            out["ce_count"].append(ce_w.sum())
            out["loss_h"].append(loss_k.detach())
        out["loss"] = loss
        return out

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model_step(batch, train=True)
        self.count_tokens(batch["attention_mask"])
        b = batch["input_ids"].shape[0]
        self.log("train/loss", out["loss"], on_step=True, prog_bar=True, batch_size=b)
        for k, loss_k in enumerate(out["loss_h"], start=1):
            self.log(f"train/loss_h{k}", loss_k, on_step=True, batch_size=b)
        top1 = metrics.masked_mean(
            metrics.label_hits(out["logits"][0], out["labels"][0]).float(), out["weights"][0]
        )
        self.log("train/top1_h1", top1, on_step=True, prog_bar=True, batch_size=b)
        return out["loss"]

    def _add_hits(self, name: str, logits: Tensor, labels: Tensor, weights: Tensor) -> None:
        for k in sorted({1, self.hparams.val_topk}):
            hits, count = metrics.masked_sum_count(
                metrics.label_hits(logits, labels, k).float(), weights
            )
            self.val_add(f"top{k}_{name}/hits", hits)
            self.val_add(f"top{k}_{name}/count", count)

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        out = self.model_step(batch)
        for k in range(1, self.heads.num_heads + 1):
            self.val_add(f"ce_h{k}/sum", out["ce_sum"][k - 1])
            self.val_add(f"ce_h{k}/count", out["ce_count"][k - 1])
            self._add_hits(
                f"h{k}", out["logits"][k - 1], out["labels"][k - 1], out["weights"][k - 1]
            )
        # head 0 = the target's own LM head on x_{t+1}: the ceiling the heads are read against
        labels, w = shifted_labels(batch["input_ids"], batch["loss_mask"], shift=1)
        with torch.no_grad():
            head0 = head_logits(
                self.target, self.batch_features(batch).to(self.target.dtype)
            )  # (B, T, V)
        self._add_hits("h0", head0, labels, w)
        # baseline of head 1: an untrained head is the LM head itself, here judged on x_{t+2}
        self._add_hits("h0_shift2", head0, out["labels"][0], out["weights"][0])

    def on_validation_epoch_end(self) -> None:
        val = self.val_totals()
        if not val.get("ce_h1/count"):
            return
        logs: dict[str, float] = {}
        loss = 0.0
        for k in range(1, self.heads.num_heads + 1):
            logs[f"val/loss_h{k}"] = val[f"ce_h{k}/sum"] / max(val[f"ce_h{k}/count"], 1.0)
            loss += self.lambdas[k - 1] * logs[f"val/loss_h{k}"]
        logs["val/loss"] = loss
        for key in sorted(k for k in val if k.startswith("top") and k.endswith("/hits")):
            name = key[: -len("/hits")]
            logs[f"val/{name}"] = val[key] / max(val[f"{name}/count"], 1.0)
        self.log_val(logs, bar={"val/top1": "val/top1_h1"})

    def save_artifact(
        self, out_dir: Path, state: dict[str, Tensor], report: dict[str, Any]
    ) -> None:
        """The heads (`eagle.models.checkpoint.save_medusa`)."""
        save_medusa(self.heads, out_dir, state=submodule_state(state, "heads"))
