"""Train a model: an EAGLE drafter, Medusa heads, a classic draft LM or SpecInfer's SSMs.

    python train.py experiment=drafter_smollm2    # the EAGLE-1 drafter, on dumped features
    python train.py experiment=medusa_smollm2     # Medusa-1 heads, on the same features
    python train.py experiment=draft_lm_smollm2   # a draft LM: the target's first layers, distilled
    python train.py experiment=ssm_boost          # an SSM, boost-tuned from the draft LM
    python train.py experiment=drafter_test debug=fdr

Every run is the same three steps: instantiate the `data` and `model` groups and the trainer,
fit (resuming `ckpt_path`, by default the run's last.ckpt), export the model to
`runs/<task_name>/<model|drafter|medusa>/` (`eagle.training.fit.fit_and_export`). A run that
stops on its time limit or ends no better than its baseline fails and exports nothing.
Tests call `train(cfg)` directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from omegaconf import DictConfig, OmegaConf, open_dict

from eagle.cli import refuse_added_settings, run_cli
from eagle.hardware import resolve_precision, set_threads
from eagle.training.fit import fit_and_export
from eagle.training.progress import quiet_lightning

ROOT = Path(__file__).resolve().parent


def build_trainer(cfg: DictConfig) -> L.Trainer:
    """The trainer of `cfg` with its callbacks and loggers. `precision: auto` becomes the
    machine's choice (`eagle.hardware.auto_precision`); a fast_dev_run writes no checkpoint;
    without a progress bar (`trainer.enable_progress_bar=false`) the progress callback goes."""
    callbacks = [instantiate(c) for c in cfg.get("callbacks", {}).values() if "_target_" in c]
    if cfg.trainer.get("fast_dev_run"):  # a smoke test: Lightning would still write last.ckpt
        callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    loggers = [instantiate(c) for c in cfg.get("logger", {}).values() if "_target_" in c]
    precision = resolve_precision(
        cfg.trainer.get("precision", "auto"), cfg.trainer.get("accelerator", "cpu")
    )
    return instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, precision=precision
    )


def train(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate data, model and trainer from `cfg`, fit, export; returns the run's metrics."""
    threads = set_threads(cfg.get("threads"))
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule: L.LightningDataModule = instantiate(cfg.data.datamodule, _convert_="all")
    model = instantiate(cfg.model, _convert_="all")
    run_dir = Path(cfg.paths.run_dir)
    with quiet_lightning():
        trainer = build_trainer(cfg)
        print(
            f"[train] {cfg.task_name}: {type(model).__name__}, precision {trainer.precision}, "
            f"{threads} CPU threads"
        )
        metrics = fit_and_export(
            model,
            datamodule,
            trainer,
            out_dir=run_dir / model.artifact,
            ckpt_dir=cfg.paths.ckpt_dir,
            ckpt_path=cfg.get("ckpt_path"),
            require_planned_steps=bool(cfg.get("require_planned_steps", True)),
            check_baseline=bool(cfg.get("check_baseline", True)),
            config=OmegaConf.to_container(cfg, resolve=True),
        )
    return {**metrics, "run_dir": str(run_dir)}


def use_job_folder(cfg: DictConfig) -> None:
    """In a sweep (`python train.py -m ...`) every job trains, checkpoints, resumes and exports
    in its own folder, `<sweep dir>/<job number>` (hydra.sweep in configs/train.yaml), never in
    `runs/<task_name>/`, which the jobs would share."""
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    if cfg.trainer.get("devices", 1) not in (1, "1") and "LOCAL_RANK" not in os.environ:
        # Lightning would relaunch the whole sweep command in each extra process
        raise ValueError(
            "a Hydra sweep cannot launch multi-process jobs: run each job on its own, or the "
            "sweep under torchrun with an explicit hydra.sweep.dir (the same folder on every rank)"
        )
    with open_dict(cfg):
        cfg.paths.run_dir = hydra_cfg.runtime.output_dir


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_added_settings(HydraConfig.get(), hydra.compose)
    use_job_folder(cfg)
    train(cfg)


if __name__ == "__main__":
    run_cli(main, ROOT)
