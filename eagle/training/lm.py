"""Fine-tuning a causal LM on token rows: SpecInfer's SSMs, boost-tuned from the draft LM on
the target's own continuations (`eagle.training.datamodules.DistilledDataModule`).

Any Hugging Face decoder-only architecture works: the module builds the model with
`AutoModelForCausalLM.from_config`, so the result is saved and loaded like any HF model. Its
baseline is the unigram model of the training tokens: a trained LM must predict validation
tokens better.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from eagle.artifacts import Artifact
from eagle.models.packaged import SIDECAR  # one sidecar name for every target folder
from eagle.target import tokenizer_hash
from eagle.training.module import TrainableModule, submodule_state


def build_causal_lm(model_config: Mapping[str, Any]) -> PreTrainedModel:
    """A randomly initialised HF causal LM from a config dict holding `model_type`."""
    kwargs = dict(model_config)
    model_type = kwargs.pop("model_type", None)
    if model_type is None:
        raise ValueError("model_config needs a `model_type` (e.g. llama)")
    config = AutoConfig.for_model(model_type, **kwargs)
    return AutoModelForCausalLM.from_config(config)


class CausalLMModule(TrainableModule):
    """Next-token training of a Hugging Face causal LM.

    Args:
        model_config: kwargs of the HF config, with `model_type`; the vocabulary size and
            special token ids are taken from the data's tokenizer. Null: init_from's own
            config (a real model's many keys need not be repeated in a YAML file).
        optim: AdamW and its schedule (`eagle.training.optim.OptimConfig`).
        init_from: a trained LM's folder to start from (boost-tuning an SSM from the draft LM):
            its weights must fit `model_config` exactly.
    """

    artifact = "model"
    quality = ("val/loss", "val/unigram_loss", "lower")

    def __init__(
        self,
        model_config: Mapping[str, Any] | None,
        optim: Mapping[str, Any] | None = None,
        init_from: str | None = None,
    ) -> None:
        super().__init__(optim or {"lr": 1e-3, "schedule": "cosine"})
        self.save_hyperparameters()
        self.model: PreTrainedModel | None = None
        self.tokenizer = None
        self.data_info: dict[str, Any] = {}
        self.unigram_loss = float("nan")
        if model_config is None and not init_from:
            raise ValueError("model_config is null: set it, or init_from (a model folder whose "
                             "config is taken)")
        if model_config is not None and "vocab_size" in model_config:
            self.model = build_causal_lm(model_config)  # complete (a checkpoint's hparams)

    def setup(self, stage: str) -> None:
        """Take the tokenizer, data facts and unigram baseline of the data module."""
        dm = self.trainer.datamodule
        self.tokenizer, self.data_info = dm.tokenizer, dm.describe()
        self.unigram_loss = dm.unigram_val_loss(len(dm.tokenizer))

    def configure_model(self) -> None:
        """Build the model once the tokenizer is known; its vocabulary and special ids go into
        the hparams, so `load_from_checkpoint` rebuilds the same model."""
        if self.model is not None:
            return
        tok = self.tokenizer
        base = self.hparams.model_config
        if base is None:  # init_from's own config (its keys, as for_model takes them)
            own = AutoConfig.from_pretrained(self.hparams.init_from).to_dict()
            base = {k: v for k, v in own.items()
                    if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")}
        config = {**base, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                  "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        self.hparams.model_config = config
        self.model = build_causal_lm(config)
        if self.hparams.init_from:
            self._load_init(self.hparams.init_from)

    def _load_init(self, path: str) -> None:
        """Start from a trained LM's weights (a checkpoint, if one resumes, replaces them)."""
        source = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        try:
            self.model.load_state_dict(source.state_dict())
        except RuntimeError as err:
            raise ValueError(f"init_from={path}: its weights do not fit model_config ({err})") \
                from None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def model_step(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Mean next-token cross-entropy of a batch of rows.

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
        loss, n = self.model_step(batch)
        self.tokens_seen += n
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=batch.shape[0])
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss, n = self.model_step(batch)
        self.val_add("nll", loss * n)
        self.val_add("count", n)

    def on_validation_epoch_end(self) -> None:
        val = self.val_totals()
        if not val.get("count"):
            return
        val_loss = val["nll"] / val["count"]  # exact token mean over all val rows
        self.log_val({"val/loss": val_loss, "val/ppl": math.exp(min(val_loss, 50.0)),
                      "val/unigram_loss": self.unigram_loss}, bar={"val/loss": "val/loss"})

    def save_artifact(self, out_dir: Path, state: dict[str, torch.Tensor],
                      report: dict[str, Any]) -> None:
        """The model and its tokenizer (`save_pretrained`: they load like any HF model), and the
        sidecar `eagle_target.json`: the data it saw and the run's report."""
        weights = {k: v.float() for k, v in submodule_state(state, "model").items()}
        n_params = sum({v.data_ptr(): v.numel() for v in weights.values()}.values())  # tied once
        self.model.save_pretrained(out_dir, state_dict=dict(weights))  # (it edits the dict given)
        self.tokenizer.save_pretrained(out_dir)
        params = {"corpus_fingerprint": self.data_info.get("corpus_fingerprint"),
                  "tokenizer_hash": tokenizer_hash(self.tokenizer),
                  "model_config": self.hparams.model_config}
        Artifact(out_dir, SIDECAR, params, "trained LM").write(
            kind="eagle_target", python_version=platform.python_version(), **self.data_info,
            n_params=n_params, **report)
