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

import inspect
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from eagle.artifacts import replace_folder, write_json
from eagle.target import (
    TargetIdentity,
    TargetMismatchError,
    embeddings,
    is_head_only,
    lm_head,
    load_target,
    target_forward,
    tokenizer_hash,
)
from eagle.training.optim import OptimConfig


class StageError(RuntimeError):
    """A training stage that did not produce a usable artifact (stopped early, or no better
    than its baseline); nothing was exported, so later stages cannot pick it up."""


def plan_in_steps(trainer: L.Trainer, total: int) -> None:
    """Make a run sized in epochs (`max_epochs`) stop at its optimizer steps instead. When
    `trainer.max_time` stops a run inside an epoch, Lightning counts that epoch as finished: a
    resumed run sized in epochs then trains one part-epoch less than planned, on every resume,
    and never reaches its plan. Our training samplers place every batch by the steps taken
    (`eagle.data.samplers.EpochShuffle`), so a plan in steps resumes exactly. Called each time
    fit sets up (before it restores a checkpoint's loops), so every invocation plans alike."""
    if trainer.max_steps is None or trainer.max_steps < 0:
        trainer.fit_loop.epoch_loop.max_steps = total
        trainer.fit_loop.max_epochs = -1  # the steps end it


class TrainableModule(L.LightningModule):
    """Base of every trained module. Subclasses set `artifact` and `quality`, pass their
    `optim` settings (`eagle.training.optim.OptimConfig` fields) up, call
    `self.save_hyperparameters()`, add validation sums with `val_add`, and implement
    `save_artifact` (or `export`)."""

    artifact = "model"  # the folder under the run directory that `export` writes
    # (metric, its baseline, "lower" | "higher"): the trained module must beat the baseline
    quality: tuple[str, str, str] = ("val/loss", "val/baseline_loss", "lower")
    # seconds, read at the start of training and by `train_time_s` (tests replace it with a fake)
    clock = staticmethod(time.perf_counter)

    def __init__(self, optim: Mapping[str, Any]) -> None:
        super().__init__()
        self.optim = OptimConfig(**optim)  # fails on a bad schedule before any data is read
        self._val: dict[str, Tensor] = {}
        self._time_before = 0.0  # fit() seconds of earlier invocations (from the checkpoint)
        self._fit_t0: float | None = None
        self.tokens_seen = 0  # training tokens (padding excluded) of this process, this invocation
        self._tokens_before = 0  # of every process, earlier invocations (from the checkpoint)
        self.resumed_from_step = 0
        self.validated_at: int | None = None  # the step the last validation during fit() ran at

    # ----------------------------------------------------------------- optimisation

    def configure_optimizers(self) -> dict[str, Any]:
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("the LR schedule needs a finite trainer.max_steps (or max_epochs)")
        plan_in_steps(self.trainer, int(total))
        return self.optim.build(self, int(total))

    # ----------------------------------------------------------------- bookkeeping

    def on_train_start(self) -> None:
        self._fit_t0 = self.clock()

    def train_time_s(self) -> float:
        """Wall-clock seconds spent training (validation included), across resumed invocations."""
        now = self.clock() - self._fit_t0 if self._fit_t0 is not None else 0.0
        return self._time_before + now

    def count_tokens(self, attention_mask: Tensor) -> None:
        self.tokens_seen += int(attention_mask.sum())

    def tokens_seen_total(self) -> int:
        """Training tokens of every process, every invocation. A collective under DDP/FSDP:
        every process calls it (checkpoint saves and the end of fit do)."""
        local = torch.tensor(float(self.tokens_seen), dtype=torch.float64, device=self.device)
        if self._trainer is not None and self.trainer.world_size > 1:
            local = self.trainer.strategy.reduce(local, reduce_op="sum")
        return self._tokens_before + int(local.item())

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # every process saves (Lightning writes rank 0's dict): the count is the sum over ranks
        checkpoint["eagle"] = {
            "train_time_s": self.train_time_s(),
            "tokens_seen": self.tokens_seen_total(),
            "data": self.data_identity(),
        }

    # hyperparameters a resumed run may change, extended by subclasses: what neither the
    # optimisation nor the data order depends on (where a target loads from, what validation
    # measures, what the export prints)
    RESUMABLE_CHANGES: frozenset[str] = frozenset()

    def data_identity(self) -> dict[str, Any]:
        """What decides the batch each step takes (the samplers place batches by the steps taken,
        `eagle.training.datamodules.trained_batches`): the samples per batch, gradient accumulation,
        the shuffling seed and the training data's fingerprint, where its data module has them."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is None:
            return {}
        found = {
            "batch_size": getattr(dm, "batch_size", None),
            "seed": getattr(dm, "seed", None),
            "accumulate_grad_batches": self.trainer.accumulate_grad_batches,
            "data": getattr(dm, "fingerprint", None),
        }
        return {k: v for k, v in found.items() if v is not None}

    def check_resume(self, checkpoint: dict[str, Any]) -> None:
        """Refuse to resume a checkpoint trained with other settings: Lightning would restore its
        optimizer, LR schedule and data position under the new ones (the old learning rate, another
        batch order) while the run's report recorded the new, or fail on weights of another shape.
        """
        if (
            self._trainer is None
        ):  # `load_from_checkpoint`: weights read outside a fit, nothing resumes
            return
        # a setting added after the checkpoint was written stands at its default there
        defaults = {
            name: p.default
            for name, p in inspect.signature(type(self).__init__).parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        written = checkpoint.get("hyper_parameters") or {}
        saved = _flat({**{k: v for k, v in defaults.items() if k not in written}, **written})
        now = _flat(dict(self.hparams))
        unset = object()
        changed = [
            f"{k}: {saved.get(k, '(unset)')!r} -> {now.get(k, '(unset)')!r}"
            for k in sorted(set(saved) | set(now))
            if k.split(".")[0] not in self.RESUMABLE_CHANGES
            and saved.get(k, unset) != now.get(k, unset)
        ]
        before = checkpoint.get("eagle", {}).get("data")
        if before is not None:  # (checkpoints written before the data was recorded are not checked)
            after = (
                self.data_identity()
            )  # what both record (a data module may record more than it did)
            changed += [
                f"data {k}: {before[k]!r} -> {after[k]!r}"
                for k in sorted(set(before) & set(after))
                if before[k] != after[k]
            ]
        if changed:  # the way out first: a command line shows the first 400 characters
            where = getattr(self.trainer, "ckpt_path", None) or "the checkpoint"
            raise StageError(
                "this run's settings differ from those its checkpoint was trained with: resume "
                "with "
                "theirs, or start anew with another task_name or ckpt_path=null (which overwrites "
                "the "
                "checkpoints). Resuming would restore its optimizer, LR schedule and place in the "
                "data "
                f"under the new settings. {where} (its -> this run's): " + "; ".join(changed)
            )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.check_resume(checkpoint)  # before Lightning loads any weight, optimizer or loop state
        saved = checkpoint.get("eagle", {})
        self.resumed_from_step = int(checkpoint.get("global_step", 0))
        self._time_before = float(saved.get("train_time_s", 0.0))
        self._tokens_before, self.tokens_seen = int(saved.get("tokens_seen", 0)), 0
        # trainer.max_time budgets each invocation: a restored Timer would stop a run that ran
        # out of time again at once, instead of continuing it
        checkpoint.get("callbacks", {}).pop("Timer", None)

    # ----------------------------------------------------------------- validation sums

    def on_validation_epoch_start(self) -> None:
        self._val = {}

    def on_validation_end(self) -> None:
        # fit_and_export reuses a validation of the final step instead of running it again
        trainer = self.trainer
        during_fit = trainer.state.fn == "fit" and not trainer.sanity_checking
        self.validated_at = self.global_step if during_fit else None

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

    def log_val(self, logs: Mapping[str, float], bar: Mapping[str, str] | None = None) -> None:
        """Log epoch-level validation metrics computed from `val_totals` (equal on every
        process); `bar` adds aliases shown in the progress bar ({alias: metric})."""
        bar = dict(bar or {})
        # sync_dist: a mean of equal values, and what Lightning expects of epoch-level logs
        for key, value in logs.items():
            self.log(key, value, prog_bar=bar.get(key) == key, sync_dist=True)
        for alias, key in bar.items():
            if alias != key:
                self.log(alias, logs[key], prog_bar=True, sync_dist=True)

    # ----------------------------------------------------------------- contract

    def check_baseline(self, val: Mapping[str, float]) -> None:
        """Raise `StageError` when `quality`'s metric is no better than its baseline."""
        metric, baseline, better = self.quality
        ours, theirs = val[metric], val[baseline]
        if not (ours < theirs if better == "lower" else ours > theirs):
            raise StageError(
                f"{self.artifact}: {metric} {ours:.4f} is no better than its baseline "
                f"({baseline} {theirs:.4f}): training failed, nothing exported"
            )

    def export(
        self, out_dir: Path, report: dict[str, Any], state: Mapping[str, Tensor] | None = None
    ) -> Path:
        """Write the trained artifact into `out_dir` (`save_artifact`), with `report` (what the
        run measured, and its config) as `train_metrics.json` beside it.

        `state` is this module's full state dict (default `self.state_dict()`); under FSDP only
        the strategy's gathered one (`lightning_module_state_dict()`) holds whole tensors."""
        out_dir = Path(out_dir)
        # written beside it and moved in whole: a stage killed mid-export (Ctrl-C, out of memory, a
        # time cap) leaves no folder that a later stage, or a Makefile marker, takes for a finished
        # one
        partial = out_dir.with_name(f".{out_dir.name}.partial")
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        self.save_artifact(partial, dict(self.state_dict() if state is None else state), report)
        write_json(partial / "train_metrics.json", report)
        replace_folder(partial, out_dir)
        return out_dir

    def save_artifact(
        self, out_dir: Path, state: dict[str, Tensor], report: dict[str, Any]
    ) -> None:
        """Write the artifact from `state` (this module's full state dict)."""
        raise NotImplementedError


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {"optim.lr": 0.001, ...}, sequences as lists (a list and a tuple, or an
    OmegaConf ListConfig, of the same values compare equal)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat(value, name + "."))
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            flat[name] = list(value)
        else:
            flat[name] = value
    return flat


def submodule_state(state: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries of a module's state dict under `prefix.`, with the prefix removed."""
    head = prefix + "."
    return {k[len(head) :]: v for k, v in state.items() if k.startswith(head)}


class FrozenTargetModule(TrainableModule):
    """A module trained on a frozen target's features.

    Offline (the batches carry dumped features) only the target's embeddings and LM head are
    needed, and only they are loaded (`eagle.target.load_head_only`): about 2 GB per process for
    an 8B target in bf16 instead of 16. Online, the whole target is loaded once per process, at
    `setup`, in `target_dtype` (or spread over devices with `target_device_map`).

    Args:
        target_path: the target's Hugging Face folder (with its tokenizer).
        target_dtype: the dtype the target is loaded in.
        optim: the optimiser's settings (`OptimConfig`).
        target_weights: "auto" (the head only, unless the data has no features), "head" or "all".
        target_device_map: `from_pretrained`'s device_map for the whole target (e.g. "auto");
            None = this process's device.
    """

    # the same target from another folder, spread otherwise, loaded whole or head only: the same run
    RESUMABLE_CHANGES = frozenset({"target_path", "target_device_map", "target_weights"})

    def __init__(
        self,
        target_path: str,
        target_dtype: str,
        optim: Mapping[str, Any],
        target_weights: str = "auto",
        target_device_map: str | dict | None = None,
    ) -> None:
        super().__init__(optim)
        if target_weights not in ("auto", "head", "all"):
            raise ValueError(f"target_weights must be auto, head or all, got {target_weights!r}")
        self._target_path, self._target_weights = str(target_path), target_weights
        self._target_args = {"dtype": target_dtype, "device_map": target_device_map}
        whole = target_weights == "all"
        target, tokenizer = load_target(
            target_path,
            target_dtype,
            weights="all" if whole else "head",
            device_map=target_device_map if whole else None,
        )
        self._set_target(target)
        self.tokenizer = tokenizer
        self.target_identity = TargetIdentity.of(
            target, tokenizer, str(target_path), with_lm_head=True
        )

    def _set_target(self, target: torch.nn.Module) -> None:
        # a plain entry: not a submodule, so not in state_dict() or parameters()
        self.__dict__["target"] = target

    def data_identity(self) -> dict[str, Any]:
        """The batches' identity and the target that scores them (sizes, tokenizer, LM head): the
        same samples dumped again by a retrained target of the same shapes (`overwrite=true`, the
        same dump name) carry other features and labels, and `target_path` may change on a resume
        (folders move), so without this a resume would go on training for the old target."""
        ident = self.target_identity
        return {
            **super().data_identity(),
            "target": {
                k: getattr(ident, k)
                for k in TargetIdentity.CHECKED
                if getattr(ident, k) is not None
            },
        }

    def setup(self, stage: str) -> None:
        """The data must have been made for this target: a feature dump by it (`made_for`), and
        token samples with its tokenizer. Data without features get the whole target."""
        dm = self.trainer.datamodule if self.trainer is not None else None
        made_for = getattr(dm, "made_for", None)
        if made_for is not None:
            made_for.check(
                self.target_identity, f"the feature dump {getattr(dm, 'features_dir', '')}"
            )
        tokenizer = getattr(dm, "tokenizer", None)
        if (
            tokenizer is not None
            and tokenizer_hash(tokenizer) != self.target_identity.tokenizer_hash
        ):
            raise TargetMismatchError(
                f"the training data is tokenised with another tokenizer than the target's "
                f"({tokenizer_hash(tokenizer)} != {self.target_identity.tokenizer_hash})"
            )
        rows = embeddings(self.target).weight.shape[0]
        if (
            not getattr(dm, "has_features", True)
            and hasattr(dm, "top_token_id")
            and (top := dm.top_token_id()) >= rows
        ):
            # token samples the target embeds on the fly: the embedding would fail with a bare
            # IndexError (a device-side assert on a GPU); a feature dump was checked when it was
            # made
            raise TargetMismatchError(
                f"the training samples hold token id {top}, past the target's {rows} embedding "
                f"rows: its tokenizer ({self._target_path}) has more ids than its model embeds "
                "(tokens added without resizing the embeddings?)"
            )
        if is_head_only(self.target) and not getattr(dm, "has_features", False):
            if self._target_weights == "head":
                raise ValueError(
                    "target_weights=head loads only the target's embeddings and LM head, but the "
                    "data carry no features (online): use target_weights=auto or all"
                )
            self.load_full_target()

    # ----------------------------------------------------------------- a reduced loss vocabulary

    # (K,) the loss's vocabulary rows (`choose_loss_vocab`); None = all
    loss_ids: Tensor | None = None

    def choose_loss_vocab(self, k: int | None, vocab_size: int, what: str) -> None:
        """Take the loss over the K tokens the training data predicts most often (FR-Spec's
        drafting vocabulary): the V x H head is most of a step on a small target. Chosen once,
        from the data module's token counts (every process counts the same training split)."""
        if k is None or self.loss_ids is not None:
            return
        from eagle.data.vocab import draft_vocabulary

        data = self.trainer.datamodule if self._trainer is not None else None
        if not hasattr(data, "token_counts"):
            raise ValueError(
                "a reduced loss vocabulary needs a data module that counts its tokens "
                "(token_counts)"
            )
        self.loss_ids, coverage = draft_vocabulary(
            data.token_counts(vocab_size), min(k, vocab_size)
        )
        self._loss_rows = None
        print(
            f"[train] {what} loss over the {self.loss_ids.numel():,} most frequent of "
            f"{vocab_size:,} tokens: "
            f"{coverage:.1%} of the training data's predicted tokens"
        )

    def loss_rows(self, head: torch.nn.Module, hidden: Tensor, restrict: bool) -> Tensor:
        """`head` (a frozen Linear) on `hidden`: (..., H) -> (..., V), or (..., K) over `loss_ids`
        when `restrict` and a loss vocabulary was chosen, with a K x H copy of its rows made once
        per device and dtype (the head is frozen)."""
        w, bias = head.weight, getattr(head, "bias", None)
        hidden = hidden.to(w.device, w.dtype)
        if not restrict or self.loss_ids is None:
            return torch.nn.functional.linear(hidden, w, bias)
        cached = getattr(self, "_loss_rows", None)
        if cached is None or cached[0].device != w.device or cached[0].dtype != w.dtype:
            ids = self.loss_ids.to(w.device)
            cached = (
                w.index_select(0, ids),
                None if bias is None else bias.index_select(0, ids),
            )  # (K, H), (K,)
            self._loss_rows = cached
        return torch.nn.functional.linear(hidden, *cached)

    def load_full_target(self) -> None:
        """Replace the head-only target by the whole model (online features), on this process's
        device unless a device map spreads it; `on_full_target` lets subclasses re-point."""
        args = self._target_args
        # straight onto this process's device: the module itself is still on the CPU in setup()
        device = self.trainer.strategy.root_device if self._trainer is not None else self.device
        target, _ = load_target(
            self._target_path,
            args["dtype"],
            device=device,
            with_tokenizer=False,
            device_map=args["device_map"],
        )
        self._set_target(target)
        self.on_full_target(target)

    def on_full_target(self, target: torch.nn.Module) -> None:
        """Called when the whole target replaces the head-only one (the modules built on its E and
        LM head re-point to the new ones)."""

    def _target_on_device(self):
        target = self.target
        if getattr(target, "hf_device_map", None):
            return target  # spread over devices by its device map: it stays where it is
        if is_head_only(target):  # only E and the head are real: move them
            for module in (embeddings(target), lm_head(target)):
                module.to(self.device)
        elif next(target.parameters()).device != self.device:
            target.to(self.device)  # an EAGLE drafter shares its E and lm_head: they move with it
        return target

    def batch_features(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The batch's dumped features, or the target's computed now (online), as (B, T, H) fp32."""
        target = self._target_on_device()
        features = batch.get("features")
        if features is None:  # online: nothing was dumped
            if is_head_only(target):
                raise ValueError(
                    "a batch without features, but only the target's embeddings and LM head are "
                    "loaded (target_weights=head, or no setup): its features cannot be computed"
                )
            device = embeddings(target).weight.device
            with torch.no_grad():
                features = target_forward(
                    target,
                    batch["input_ids"].to(device),  # features only: no logits
                    attention_mask=batch["attention_mask"].to(device),
                    logits_slice=slice(0, 0),
                ).features
        return features.to(self.device).float()
