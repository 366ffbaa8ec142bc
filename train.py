"""Train a causal LM from scratch on the built-in Python corpus (the embedded target).

    python train.py experiment=target_tiny      # CPU target, <= 10 min on 2 cores
    python train.py experiment=draft_lm_tiny    # classic draft LM, same tokenizer
    python train.py experiment=target_test debug=fdr
    python train.py experiment=drafter_tiny     # EAGLE drafter (`drafter` config group)
    python train.py experiment=medusa_tiny      # Medusa heads (`medusa` config group)

Writes `runs/<task_name>/model/`: the model (`save_pretrained`), its tokenizer and
`eagle_target.json`, a sidecar saying what produced it. Tests call `train(cfg)` directly.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.errors import HydraException, InstantiationException, MissingConfigException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data_gen.corpus import corpus_fingerprint, corpus_id, python_version
from data_gen.tokenizer import tokenizer_sha256
from eagle.drafter_module import StageError, require_planned_steps
from eagle.hardware import resolve_precision, set_threads

ROOT = Path(__file__).resolve().parent
CONFIG_DIR = ROOT / "configs"
SIDECAR = "eagle_target.json"
# Errors caused by the configuration or the files it points at (no traceback hint).
USER_ERRORS = (ValueError, FileNotFoundError, RuntimeError, OmegaConfBaseException, HydraException)
DRAFTER_GROUPS = ("drafter", "medusa")  # config groups of drafters trained on a frozen target


def greedy_samples(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy continuations (prompt included) of each prompt, decoded without specials."""
    model.eval()
    out = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tokenizer.decode(ids[0], skip_special_tokens=True))
    return out


def build_trainer(cfg: DictConfig) -> tuple[L.Trainer, bool]:
    """The Lightning trainer of `cfg` with its callbacks and loggers, and whether it is a
    fast_dev_run (a smoke test that neither resumes nor saves). `precision: auto` becomes the
    machine's choice (`eagle.hardware.auto_precision`); without a progress bar
    (`trainer.enable_progress_bar=false`) the progress callback is left out."""
    debug = bool(cfg.trainer.get("fast_dev_run"))
    callbacks = [instantiate(c) for c in cfg.get("callbacks", {}).values() if "_target_" in c]
    if debug:  # Lightning would still write last.ckpt at train end
        callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    loggers = [instantiate(c) for c in cfg.get("logger", {}).values() if "_target_" in c]
    precision = resolve_precision(cfg.trainer.get("precision", "auto"), cfg.trainer.get("accelerator", "cpu"))
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, precision=precision)
    print(f"[train] precision {precision}, {torch.get_num_threads()} CPU threads")
    return trainer, debug


def train_drafter(cfg: DictConfig, group: str = "drafter") -> dict[str, Any]:
    """Train a drafter for a frozen target: EAGLE's (`drafter` config group, see
    eagle/drafter_module.py) or Medusa's heads (`medusa`, eagle/medusa_module.py); save it to
    `<run_dir>/<drafter|medusa>/` and return the final metrics."""
    from eagle.drafter_module import fit_drafter

    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    module = instantiate(cfg[group], _convert_="all")  # loads the target
    datamodule = instantiate(cfg.data.datamodule, _partial_=True)(
        seed=cfg.get("seed") or 0, tokenizer=module.tokenizer, target_identity=module.target_identity)
    trainer, debug = build_trainer(cfg)
    run_dir = Path(cfg.paths.run_dir)
    metrics = fit_drafter(module, datamodule, trainer, ckpt_dir=cfg.paths.ckpt_dir,
                          save_dir=run_dir / module.artifact, resume=bool(cfg.get("resume")), debug=debug,
                          check_baseline=bool(cfg.get("check_baseline", True)),
                          sidecar={"config": OmegaConf.to_container(cfg, resolve=True)})
    return {**metrics, "run_dir": str(run_dir)}


def train(cfg: DictConfig) -> dict[str, Any]:
    """Build corpus, tokenizer, data and model from `cfg`, train, save, and return metrics."""
    set_threads(cfg.get("threads"))
    groups = [g for g in DRAFTER_GROUPS if cfg.get(g) is not None]  # experiment=drafter_* / medusa_*
    if len(groups) > 1:
        raise ValueError(f"the config sets both {groups[0]} and {groups[1]}: one drafter per run")
    if groups:
        return train_drafter(cfg, groups[0])
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    run_dir, ckpt_dir, model_dir = (Path(cfg.paths[k]) for k in ("run_dir", "ckpt_dir", "model_dir"))

    corpus = instantiate(cfg.data.corpus)
    fingerprint = corpus_fingerprint(corpus)
    # Objects go in through partials: instantiate() would copy kwargs into an OmegaConf node.
    build_tokenizer = instantiate(cfg.data.tokenizer, _partial_=True)
    tokenizer = build_tokenizer(texts=list(corpus["train"]["text"]), corpus_fingerprint=fingerprint)
    tok_sha = tokenizer_sha256(tokenizer)
    datamodule = instantiate(cfg.data.datamodule, _partial_=True)(
        corpus=corpus,
        tokenizer=tokenizer,
        tokenizer_sha256=tok_sha,
        corpus_fingerprint=fingerprint,
        seed=cfg.seed,
    )
    datamodule.prepare_data()
    datamodule.setup("fit")

    model_config = OmegaConf.to_container(cfg.model.model_config, resolve=True)
    model_config.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    module = instantiate(cfg.model, _partial_=True, _convert_="all")(model_config=model_config)
    n_params = sum(p.numel() for p in module.parameters())

    trainer, debug = build_trainer(cfg)

    last_ckpt = ckpt_dir / "last.ckpt"
    resume = cfg.get("resume") and not debug and last_ckpt.exists()
    ckpt_path = str(last_ckpt) if resume else None
    if ckpt_path:
        print(f"resuming from {ckpt_path}")
    step0 = 0
    if ckpt_path:
        step0 = torch.load(ckpt_path, map_location="cpu", weights_only=False, mmap=True)["global_step"]

    t0 = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    run_time = time.perf_counter() - t0
    train_time = module.train_time_s()  # across resumed runs
    if not debug:
        trainer.save_checkpoint(last_ckpt)  # the resume point is the final step, always
        require_planned_steps(trainer, cfg.task_name, last_ckpt)

    train_loss = float(trainer.callback_metrics.get("train/loss", float("nan")))
    val = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    val_loss = float(val["val/loss"])
    unigram_loss = datamodule.unigram_val_loss(len(tokenizer))
    if cfg.get("check_baseline", True) and not debug and not val_loss < unigram_loss:
        raise StageError(f"{cfg.task_name}: validation loss {val_loss:.4f} is no better than the unigram model's "
                         f"{unigram_loss:.4f}: training failed, nothing saved to {model_dir}")

    dm_cfg = cfg.data.datamodule
    tokens_per_step = dm_cfg.batch_size * dm_cfg.block_size * cfg.trainer.accumulate_grad_batches
    steps = trainer.global_step

    model = module.model.float().eval()
    samples = greedy_samples(model, tokenizer, list(cfg.samples.prompts), cfg.samples.max_new_tokens)

    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    meta = datamodule.meta
    sidecar = {
        "kind": "eagle_target",
        "corpus": corpus_id(),
        "python_version": python_version(),
        "corpus_fingerprint": fingerprint,
        "tokenizer_sha256": tok_sha,
        "n_files": meta["n_files"],
        "n_tokens": meta["n_tokens"],
        "n_params": n_params,
        "steps": steps,
        "tokens_per_step": tokens_per_step,
        "tokens_seen": steps * tokens_per_step,
        "resumed_from_step": step0,
        "train_time_s": round(train_time, 2),  # fit() wall-clock, validation included, all runs
        "train_time_this_run_s": round(run_time, 2),
        "tokens_per_s": round(steps * tokens_per_step / train_time, 1) if train_time > 0 else None,
        "val_tokens": int(datamodule.val_targets().size),
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 50.0)),
        "unigram_val_loss": unigram_loss,
        "samples": dict(zip(cfg.samples.prompts, samples)),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    (model_dir / SIDECAR).write_text(json.dumps(sidecar, indent=2) + "\n")

    print(f"\nparams {n_params / 1e6:.2f}M, steps {steps}, tokens seen {sidecar['tokens_seen']:,}, "
          f"fit {train_time:.0f}s ({sidecar['tokens_per_s']} tokens/s)")
    print(f"val loss {val_loss:.4f} nats/token (ppl {sidecar['val_ppl']:.2f}); "
          f"unigram val loss {unigram_loss:.4f} on the same {sidecar['val_tokens']:,} tokens")
    for prompt, text in zip(cfg.samples.prompts, samples):
        print(f"--- greedy sample for {prompt!r}:\n{text}")
    print(f"--- saved model, tokenizer and {SIDECAR} to {model_dir}")
    return {
        "train/loss": train_loss,
        "val/loss": val_loss,
        "val/ppl": sidecar["val_ppl"],
        "unigram/val_loss": unigram_loss,
        "steps": steps,
        "tokens_seen": sidecar["tokens_seen"],
        "train_time_s": train_time,
        "tokens_per_s": sidecar["tokens_per_s"],
        "model_dir": str(model_dir),
        "run_dir": str(run_dir),
    }


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception as one line: its type and message, line breaks folded, long ones cut."""
    if isinstance(exc, InstantiationException) and exc.__cause__ is not None:
        where = re.search(r"full_key: (\S+)", str(exc))
        inner = one_line(exc.__cause__, limit)
        return f"{inner} (building {where.group(1)})" if where else inner
    if isinstance(exc, MissingConfigException) and exc.options:
        first = str(exc).strip().splitlines()[0]
        return f"{first} (available: {', '.join(sorted(exc.options))})"
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def check_overrides(config_name: str, overrides: list[str]) -> None:
    """Compose the config once up front, so that a bad override fails before any work."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        compose(config_name, overrides=overrides, return_hydra_config=True)


def run_cli(main: Callable[[], Any], config_name: str, overrides: list[str]) -> None:
    """Run a `@hydra.main` entry point; any error is printed as one line, exit status 1.

    `HYDRA_FULL_ERROR=1` in the environment shows the full traceback instead.
    """
    os.environ.setdefault("PROJECT_ROOT", str(ROOT))  # runs/ under the repo, whatever the cwd
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    try:
        if not any(arg.startswith("-") for arg in overrides):  # plain overrides, no Hydra flags
            check_overrides(config_name, overrides)
        os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its report
        main()
    except Exception as exc:
        if full_error:
            raise
        hint = "" if isinstance(exc, USER_ERRORS) else " (HYDRA_FULL_ERROR=1 shows the traceback)"
        print(f"error: {one_line(exc)}{hint}", file=sys.stderr)
        sys.exit(1)


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    run_cli(main, "train", sys.argv[1:])
