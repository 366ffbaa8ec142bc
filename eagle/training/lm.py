"""Training a causal LM from scratch (the embedded target, a classic draft LM).

Any Hugging Face decoder-only architecture works: the module builds the model with
`AutoModelForCausalLM.from_config`, so the result is saved and loaded like any HF model. The
vocabulary and special token ids come from the tokenizer of the data
(`eagle.training.datamodules.TokenBlockDataModule`), once it is built. Its baseline is the
unigram model of the training tokens: a trained LM must predict validation tokens better.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from eagle.artifacts import Artifact
from eagle.models.packaged import SIDECAR  # one sidecar name for every target folder
from eagle.target import tokenizer_hash
from eagle.training.module import TrainableModule, submodule_state

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


def ngrams(ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """Every n-gram of `ids`, overlapping, in order."""
    return [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]


def repeats_ngram(ids: Sequence[int], n: int) -> bool:
    """Whether some n-gram occurs twice in `ids` (overlaps count: `a a a ... a` repeats)."""
    grams = ngrams(ids, n)
    return len(set(grams)) < len(grams)


@torch.inference_mode()
def repetition_rate(model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int, n: int = 8) -> dict[str, Any]:
    """How much a model's greedy text loops: the share of greedy continuations (the new tokens
    only) that contain a repeated n-gram, and the share of their n-grams that repeat an earlier
    one of the same continuation (finer: a model that loops from its 10th token scores higher
    than one that repeats once at the end).

    Args:
        model: a causal LM (eval mode).
        prompts: (P, T) token ids, one prompt per row, all of the same length (no padding).
        new_tokens: greedy tokens generated per prompt (EOS is suppressed, so that every rate is
            over the same length).
        n: the n-gram length.
    Returns:
        {"rate": share in [0, 1], "repeated_ngrams": share in [0, 1], "prompts": P,
         "new_tokens": ..., "n": ...}
    """
    ids = model.generate(input_ids=prompts.to(model.device), attention_mask=torch.ones_like(prompts),
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=model.config.pad_token_id)
    continuations = ids[:, prompts.shape[1]:].tolist()  # (P, new_tokens)
    grams = [ngrams(c, n) for c in continuations]
    repeats = [len(g) - len(set(g)) for g in grams]  # every occurrence after a gram's first
    looping = sum(r > 0 for r in repeats)
    total = sum(len(g) for g in grams)
    return {"rate": looping / len(continuations), "repeated_ngrams": sum(repeats) / max(total, 1),
            "prompts": len(continuations), "new_tokens": new_tokens, "n": n}


class CausalLMModule(TrainableModule):
    """Next-token training of a Hugging Face causal LM.

    Args:
        model_config: kwargs of the HF config, with `model_type`; the vocabulary size and
            special token ids are taken from the data's tokenizer.
        optim: AdamW and its schedule (`eagle.training.optim.OptimConfig`).
        residual_init: `gpt2`, `zero` or None: init of the projections into the residual
            stream (`init_residual_projections`; Llama-family module names).
        samples: greedy completions of these prompts are printed and stored with the model.
        sample_tokens: new tokens per sample.
        init_from: a trained LM's folder to start from (fine-tuning, e.g. boost-tuning an SSM
            from the draft LM): its weights must fit `model_config` exactly. With `model_config`
            null, the model is built from init_from's own config (a real model's many keys need
            not be repeated in a YAML file).
        repetition: `{prompts, prompt_tokens, new_tokens, n}`: after training, the share of greedy
            continuations of held-out prompts that repeat an n-gram (`repetition_rate`), stored
            with the model; None skips it.
    """

    artifact = "model"
    quality = ("val/loss", "val/unigram_loss", "lower")
    RESUMABLE_CHANGES = frozenset({"samples", "sample_tokens", "repetition"})  # what the export prints and records

    def __init__(
        self,
        model_config: Mapping[str, Any] | None,
        optim: Mapping[str, Any] | None = None,
        residual_init: str | None = None,
        samples: Sequence[str] = (),
        sample_tokens: int = 48,
        init_from: str | None = None,
        repetition: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(optim or {"lr": 1e-3, "schedule": "cosine"})
        self.save_hyperparameters()
        self.model: PreTrainedModel | None = None
        self.tokenizer = None
        self.data_info: dict[str, Any] = {}
        self.unigram_loss = float("nan")
        if model_config is None and not init_from:
            raise ValueError("model_config is null: set it, or init_from (a model folder whose config is taken)")
        if model_config is not None and "vocab_size" in model_config:  # complete (a checkpoint's hparams): build now
            self._build(dict(model_config))

    def _build(self, model_config: dict[str, Any]) -> None:
        self.model = build_causal_lm(model_config)
        if self.hparams.residual_init is not None:
            init_residual_projections(self.model, self.hparams.residual_init)

    def setup(self, stage: str) -> None:
        """Take the tokenizer, corpus facts and unigram baseline of the data module."""
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
            base = {k: v for k, v in AutoConfig.from_pretrained(self.hparams.init_from).to_dict().items()
                    if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")}
        config = {**base, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                  "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        self.hparams.model_config = config
        self._build(config)
        if self.hparams.init_from:
            self._load_init(self.hparams.init_from)

    def _load_init(self, path: str) -> None:
        """Start from a trained LM's weights (before a checkpoint, if one resumes, replaces them)."""
        source = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        try:
            self.model.load_state_dict(source.state_dict())
        except RuntimeError as err:
            raise ValueError(f"init_from={path}: its weights do not fit model_config ({err})") from None

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
        val_loss = val["nll"] / val["count"]  # exact token mean over all val blocks
        self.log_val({"val/loss": val_loss, "val/ppl": math.exp(min(val_loss, 50.0)),
                      "val/unigram_loss": self.unigram_loss}, bar={"val/loss": "val/loss"})

    def greedy_samples(self) -> dict[str, str]:
        """Greedy continuations (prompt included) of the `samples` prompts, without specials."""
        model, out = self.model.eval(), {}
        for prompt in self.hparams.samples:
            enc = self.tokenizer(prompt, return_tensors="pt").to(model.device)
            with torch.inference_mode():
                ids = model.generate(**enc, max_new_tokens=self.hparams.sample_tokens, do_sample=False)
            out[prompt] = self.tokenizer.decode(ids[0], skip_special_tokens=True)
        return out

    def held_out_repetition(self) -> dict[str, Any]:
        """`repetition_rate` on prompts cut from the starts of the validation blocks (files the
        model never trained on)."""
        spec = dict(self.hparams.repetition)
        blocks = [b for batch in self.trainer.datamodule.val_dataloader() for b in batch]
        prompts = torch.stack([b[: spec["prompt_tokens"]] for b in blocks[: spec["prompts"]]])
        return repetition_rate(self.model.eval(), prompts, spec["new_tokens"], spec["n"])

    def save_artifact(self, out_dir: Path, state: dict[str, torch.Tensor], report: dict[str, Any]) -> None:
        """The model and its tokenizer (`save_pretrained`: they load like any HF model), and the
        sidecar `eagle_target.json`: the data it saw, the run's report and greedy samples."""
        weights = {k: v.float() for k, v in submodule_state(state, "model").items()}
        samples = {} if self.sharded() else self.greedy_samples()  # a shard cannot generate alone
        if self.hparams.repetition and not self.sharded():
            report = {**report, "repetition": self.held_out_repetition()}
            print(f"--- greedy repetition on held-out prompts: {report['repetition']}")
        for prompt, text in samples.items():
            print(f"--- greedy sample for {prompt!r}:\n{text}")
        n_params = sum({v.data_ptr(): v.numel() for v in weights.values()}.values())  # tied weights once
        self.model.save_pretrained(out_dir, state_dict=dict(weights))  # (it edits the dict it is given)
        self.tokenizer.save_pretrained(out_dir)
        params = {"corpus_fingerprint": self.data_info.get("corpus_fingerprint"),
                  "tokenizer_hash": tokenizer_hash(self.tokenizer), "model_config": self.hparams.model_config}
        Artifact(out_dir, SIDECAR, params, "trained LM").write(
            kind="eagle_target", python_version=platform.python_version(), **self.data_info,
            n_params=n_params, **report, samples=samples)
