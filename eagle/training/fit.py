"""One routine for every training run: fit (resuming through Lightning), check, export.

    fit(ckpt_path)  ->  the planned steps reached?  ->  validate  ->  better than the
    baseline?  ->  export (one writer)

A run that stops on `trainer.max_time` before `trainer.max_steps`, or whose model is no
better than its baseline, raises `StageError` and exports nothing, so a later stage never
picks up a half-trained model; its resume point (`last.ckpt`) is saved either way, and
rerunning the same command continues it (`ckpt_path="last"`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import lightning as L

from eagle.training.module import StageError, TrainableModule


def planned_steps(trainer: L.Trainer) -> int | None:
    """The optimizer steps the run (and its LR schedule) was planned for: `trainer.max_steps`, or
    what `max_epochs` amounts to."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return trainer.max_steps
    total = trainer.estimated_stepping_batches
    return int(total) if math.isfinite(total) else None


def check_planned_steps(trainer: L.Trainer, what: str, last_ckpt: str | Path) -> None:
    """Raise `StageError` when fit() stopped before its planned steps (`trainer.max_time` ran out):
    the schedule was planned for them, so the model is unfinished."""
    planned = planned_steps(trainer)
    if planned is not None and trainer.global_step < planned:
        raise StageError(
            f"{what} stopped after {trainer.global_step} of {planned} steps (trainer.max_time "
            f"ran out): nothing was exported. Rerun the same command to resume from {last_ckpt}, "
            "or "
            f"give it more time (trainer.max_time=DD:HH:MM:SS)"
        )


def fit_and_export(
    module: TrainableModule,
    datamodule: L.LightningDataModule,
    trainer: L.Trainer,
    out_dir: str | Path,
    ckpt_dir: str | Path,
    ckpt_path: str | None = "last",
    require_planned_steps: bool = True,
    check_baseline: bool = True,
    config: dict | None = None,
) -> dict[str, Any]:
    """Fit `module`, check it, and export it to `out_dir` (`module.export`).

    Args:
        ckpt_dir: where the run's `last.ckpt` (the resume point, written after fit) lives.
        ckpt_path: what to resume from: "last" (this run's last.ckpt when there is one), a
            checkpoint file, or None (start fresh). A fast_dev_run neither resumes nor saves.
        require_planned_steps: fail when `trainer.max_time` stopped the run before `max_steps`
            (off only where a time budget matters more, e.g. scripts/gpu/bench.sh; the report
            still says how many steps ran).
        check_baseline: fail when the module is no better than its baseline (`module.quality`).
        config: the run's resolved config, stored with the report.
    Returns:
        the final validation metrics, the run's counters, and `<artifact>_dir`.
    """
    debug = bool(trainer.fast_dev_run)
    last = Path(ckpt_dir) / "last.ckpt"
    if debug or (ckpt_path == "last" and not any(Path(ckpt_dir).glob("last*.ckpt"))):
        # nothing to resume: a fresh run (Lightning would warn that "last" found nothing)
        ckpt_path = None
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    fit_time = time.perf_counter() - t0
    if not debug:
        trainer.save_checkpoint(
            last, weights_only=False
        )  # the resume point is the final step, always
        if require_planned_steps:
            check_planned_steps(trainer, f"the {module.artifact}", last)
    train_loss = float(
        trainer.callback_metrics.get("train/loss", math.nan)
    )  # before validate() resets it
    if (
        module.validated_at == trainer.global_step and not debug
    ):  # fit() ended on a validation: its metrics
        val = {
            k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if k.startswith("val/")
        }
    else:
        val = {
            k: float(v)
            for k, v in sorted(
                trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()
            )
        }
    if check_baseline and not debug:
        module.check_baseline(val)
    steps, train_time = trainer.global_step, module.train_time_s()
    tokens = module.tokens_seen_total()  # every process's
    report = {
        **val,
        "train/loss": train_loss,
        "steps": steps,
        "planned_steps": planned_steps(trainer),
        "resumed_from_step": module.resumed_from_step,
        "tokens_seen": tokens,
        "fit_time_s": round(fit_time, 2),
        "train_time_s": round(train_time, 2),
        "tokens_per_s": round(tokens / train_time, 1) if train_time > 0 else None,
        "processes": trainer.world_size,
    }
    out_dir = Path(out_dir)
    # every process takes part (FSDP gathers the full weights here); rank 0 alone gets them
    state = trainer.strategy.lightning_module_state_dict()
    if trainer.is_global_zero:  # one writer of the artifact, one report
        module.export(out_dir, {**report, "config": config or {}}, state)
        print(
            f"\n{module.artifact}: {steps} of {report['planned_steps']} steps (from "
            f"{module.resumed_from_step}), "
            f"{tokens:,} tokens on {trainer.world_size} process(es), {report['tokens_per_s']} "
            "tokens/s over "
            f"{train_time:.0f}s of training; final validation:"
        )
        for key, value in val.items():
            print(f"  {key:<22} {value:.4f}")
        print(f"--- saved the {module.artifact} to {out_dir}")
    trainer.strategy.barrier()  # the others return once the artifact is complete
    return {**report, f"{module.artifact}_dir": str(out_dir)}
