"""A classic draft LM for a real target, distilled from the target's dumped features.

Classic speculative decoding needs a small LM with the target's tokenizer. A real target ships
none here, and training one from scratch on a CPU budget gives a model far weaker than the
target. The cheapest strong start a user has is the target itself: its first L decoder
layers, its final norm and its embeddings and LM head (tied on SmolLM2). Cut from the target
untrained, such a model agrees with it on ~5% of ShareGPT's next tokens (LOG.md), so it is
then distilled: trained to match the target's next-token distribution, which the feature dump
already holds (p_{t+1} = softmax(lm_head(f_t)), no target forward needed):

    loss = CE(q_t, p_{t+1})    masked mean over the positions whose next token is trained
    (q_t = softmax(lm_head(norm(h_t))), h_t = the draft's last layer at t)

The embeddings and the LM head stay frozen (the target's own); the L layers and the norm train.
`loss_vocab` takes the loss over the K most frequent tokens of the data, as the EAGLE drafter's
(`eagle.training.drafter`): the 49,152 x 576 head would be most of a step. Validation scores
the whole vocabulary: top-1 agreement with the target's argmax, against the baseline of no
layer at all (the head on the normed input embedding, a bigram guess).

Alignment: position t reads x_0..x_t and predicts x_{t+1}; its teacher is f_t; its weight is
m_{t+1} (0 at the last position, whose next token is not in the sample).
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle.artifacts import Artifact
from eagle.models.packaged import SIDECAR
from eagle.target import LogitTransform, cut_config, decoder_body, load_target, tokenizer_hash
from eagle.training import metrics
from eagle.training.module import FrozenTargetModule, submodule_state


def _first_layers(weight: Tensor, shape: torch.Size | None, n: int, layers: int) -> Tensor:
    """`weight` of an n-layer model for a cut of `layers`: as it is, or, for a tensor that stacks
    a slice per layer along one dimension (Gemma-4's per-layer token inputs, (V, n * d)), the
    first `layers` slices of it."""
    if shape is None or weight.shape == shape or weight.dim() != len(shape):
        return weight
    differ = [i for i, (a, b) in enumerate(zip(weight.shape, shape)) if a != b]
    if len(differ) == 1 and weight.shape[differ[0]] * layers == shape[differ[0]] * n:
        return weight.narrow(differ[0], 0, shape[differ[0]])
    return weight  # load_state_dict names the mismatch


def truncated_copy(target: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A causal LM of the target's class made of its embeddings, its first `layers` decoder
    layers, its final norm and its LM head (copies, float32)."""
    from transformers import AutoModelForCausalLM

    n = target.config.num_hidden_layers
    if not 1 <= layers <= n:
        raise ValueError(f"a draft LM of {layers} layers: choose 1..{n} (the target's layers)")
    try:
        draft = AutoModelForCausalLM.from_config(cut_config(target.config, layers)).to(
            torch.float32
        )
    except (
        ValueError
    ) as e:  # a family whose config rules the cut breaks (Gemma-4 ends on a full layer)
        raise ValueError(f"cannot cut {type(target).__name__} to {layers} layers: {e}") from e
    shapes = {k: v.shape for k, v in draft.state_dict().items()}
    kept = {
        k: _first_layers(v.float(), shapes.get(k), n, layers)
        for k, v in target.state_dict().items()
        if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers
    }
    missing, unexpected = draft.load_state_dict(kept, strict=False)
    missing = [k for k in missing if k not in getattr(draft, "_tied_weights_keys", {})]
    if missing or unexpected:
        raise ValueError(
            f"cannot cut {type(target).__name__} to {layers} layers (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    draft.tie_weights()
    return draft


class DistilledDraftLMModule(FrozenTargetModule):
    """The target's first `layers` layers, distilled on its dumped features (module docstring).

    Args:
        target_path: the target's Hugging Face folder (with its tokenizer).
        layers: decoder layers of the draft LM, copied from the target's first ones.
        loss_vocab: the loss over the K most frequent tokens of the data; None = every token.
        optim: AdamW and its schedule (`eagle.training.optim.OptimConfig`).
        target_dtype: dtype of the frozen target while training (its head scores the teacher).
    """

    artifact = "model"
    quality = ("val/top1", "val/top1_no_layers", "higher")

    def __init__(
        self,
        target_path: str,
        layers: int = 2,
        loss_vocab: int | None = None,
        optim: Mapping[str, Any] | None = None,
        target_dtype: str = "float32",
    ) -> None:
        if loss_vocab is not None and loss_vocab < 1:
            raise ValueError(
                f"loss_vocab must be a number of tokens >= 1 or null, got {loss_vocab}"
            )
        super().__init__(target_path, target_dtype, optim or {"lr": 1e-4}, target_weights="head")
        self.save_hyperparameters()
        whole, _ = load_target(
            target_path, "float32", with_tokenizer=False
        )  # once, to copy its layers
        self.model = truncated_copy(whole, layers)
        del whole
        self.model.get_input_embeddings().requires_grad_(False)
        self.model.get_output_embeddings().requires_grad_(False)
        self.transform = LogitTransform.of(self.model.config)

    @property
    def final_norm(self) -> torch.nn.Module:
        """The decoder body's final norm (its name differs between families)."""
        base = decoder_body(self.model)
        for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
            if isinstance(getattr(base, name, None), torch.nn.Module):
                return getattr(base, name)
        raise ValueError(f"{type(base).__name__} has no final norm this module knows")

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.choose_loss_vocab(self.hparams.loss_vocab, self.model.config.vocab_size, "draft LM")

    def head(self, hidden: Tensor, restrict: bool) -> Tensor:
        """The (frozen, shared) LM head with the family's logit transform: (..., H) -> (..., V),
        or (..., K) over the loss vocabulary when `restrict`."""
        return self.transform(self.loss_rows(self.model.get_output_embeddings(), hidden, restrict))

    def model_step(self, batch: Mapping[str, Tensor], train: bool) -> dict[str, Tensor]:
        ids = batch["input_ids"]  # (B, T)
        weight = F.pad(batch["loss_mask"][:, 1:], (0, 1)).float()  # (B, T) m_{t+1}
        features = self.batch_features(batch).to(self.device)  # (B, T, H) f_t: the teacher
        hidden = decoder_body(self.model)(
            input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False
        ).last_hidden_state  # (B, T, H)
        restrict = train
        with torch.no_grad():
            p_logits = self.head(features, restrict)  # (B, T, V or K)
        q_logits = self.head(hidden, restrict)  # (B, T, V or K)
        err = metrics.soft_cross_entropy(q_logits, p_logits)  # (B, T)
        return {
            "loss": metrics.masked_mean(err, weight),
            "err": err,
            "weight": weight,
            "q_logits": q_logits,
            "p_logits": p_logits,
            "input_ids": ids,
        }

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model_step(batch, train=True)
        self.count_tokens(batch["attention_mask"])
        b = batch["input_ids"].shape[0]
        top1 = metrics.masked_mean(
            metrics.topk_hits(out["q_logits"], out["p_logits"]).float(), out["weight"]
        )
        self.log("train/loss", out["loss"], on_step=True, prog_bar=True, batch_size=b)
        self.log("train/top1", top1, on_step=True, prog_bar=True, batch_size=b)
        return out["loss"]

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> None:
        out = self.model_step(batch, train=False)
        w = out["weight"]
        self.val_add("loss_sum", (out["err"] * w).sum())
        self.val_add("count", w.sum())
        self.val_add(
            "top1_hits", (metrics.topk_hits(out["q_logits"], out["p_logits"]).float() * w).sum()
        )
        # the baseline: no layer at all, the head on the normed input embedding (a bigram guess)
        embedded = self.final_norm(self.model.get_input_embeddings()(out["input_ids"]))
        self.val_add(
            "base_hits",
            (metrics.topk_hits(self.head(embedded, False), out["p_logits"]).float() * w).sum(),
        )

    def on_validation_epoch_end(self) -> None:
        val = self.val_totals()
        if not val.get("count"):
            return
        n = val["count"]
        self.log_val(
            {
                "val/loss": val["loss_sum"] / n,
                "val/top1": val["top1_hits"] / n,
                "val/top1_no_layers": val["base_hits"] / n,
            },
            bar={"val/top1": "val/top1"},
        )

    def save_artifact(
        self, out_dir: Path, state: dict[str, Tensor], report: dict[str, Any]
    ) -> None:
        """A plain Hugging Face folder (the draft method loads it like any LM), with the target's
        tokenizer and the sidecar `eagle_target.json`."""
        weights = {k: v.float() for k, v in submodule_state(state, "model").items()}
        self.model.save_pretrained(out_dir, state_dict=dict(weights))
        self.tokenizer.save_pretrained(out_dir)
        params = {
            "target_path": self._target_path,
            "layers": self.hparams.layers,
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
        }
        Artifact(out_dir, SIDECAR, params, "distilled draft LM").write(
            kind="eagle_target",
            how=f"the target's first {self.hparams.layers} layers, distilled on its features",
            python_version=platform.python_version(),
            **report,
        )
