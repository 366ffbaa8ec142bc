"""Training progress that a log file shows: tqdm on a terminal, plain lines elsewhere.

The rule is `eagle.progress`'s, which every other long loop of the repository follows. A tqdm
bar redraws one line with carriage returns and only every few batches: written to a
file, a slow run shows "0/800" for minutes. `LineProgress` prints a full line every
`every_s` seconds and after each validation instead: step, rate, elapsed time, the time
still needed, and the bar's metrics. It also says, once, when the run cannot reach its last
step within `trainer.max_time` at the current rate, long before it stops there.

`quiet_lightning` drops the few messages Lightning prints on every run that tell a user of this
repository nothing, so that what a run prints is its own.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, Timer, TQDMProgressBar

from eagle.progress import clock, on_terminal

# What every training run here printed from Lightning 2.6 and torch 2.13, and why it is noise: the
# model summary cannot size bf16-mixed weights (it says so, then counts 32 bits), torch deprecates a
# pytree class Lightning still builds, and Lightning advertises a cloud logger. Matched by the start
# of the message, so any other warning or log line still shows.
LIGHTNING_NOISE_WARNINGS = (r"Precision \S+ is not supported by the model summary",
                            r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            # every training sampler resumes mid-epoch by itself, from the
                            # optimizer steps taken (eagle.data.samplers.EpochShuffle), so the
                            # "unreliable results" this warns of do not happen here
                            r"You're resuming from a checkpoint that ended before the epoch ended")
LIGHTNING_NOISE_LOGS = ("\N{ELECTRIC LIGHT BULB} Tip: For seamless cloud logging",)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_NOISE_LOGS)


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Within it, Lightning's messages above are dropped (warnings filters and a filter on
    Lightning's rank-zero logger, both restored on exit)."""
    from lightning_utilities.core import rank_zero

    drop = _DropNoise()
    logger = rank_zero.log  # the logger rank_zero_info and rank_zero_warn write to
    logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            for message in LIGHTNING_NOISE_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        logger.removeFilter(drop)


class LineProgress(ProgressBar):
    """Progress as whole lines on stderr, every `every_s` seconds and after each validation."""

    def __init__(self, every_s: float = 30.0):
        super().__init__()
        self.every_s = every_s
        self._enabled = True
        self._t0 = self._last = 0.0
        self._step0 = 0
        self._warned = False

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = self._last = time.monotonic()
        self._step0 = trainer.global_step
        self._line(trainer, pl_module, "start")

    def on_train_batch_end(
        self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._line(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._line(trainer, pl_module, "validated")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._line(trainer, pl_module, "stopped")

    def _line(self, trainer: L.Trainer, pl_module: L.LightningModule, event: str = "") -> None:
        if not self._enabled:
            return
        step, total = trainer.global_step, trainer.max_steps
        elapsed = time.monotonic() - self._t0
        rate = (step - self._step0) / elapsed if elapsed > 0 else 0.0
        parts = [
            f"step {step}/{total}" if total and total > 0 else f"step {step}",
            f"elapsed {clock(elapsed)}",
        ]
        left = None
        if rate > 0 and total and total > 0:
            left = (total - step) / rate
            parts.insert(1, f"{rate:.2f} steps/s")
            parts.append(f"about {clock(left)} to go")
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        shown = " ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
        )
        tag = f" ({event})" if event else ""
        print(
            f"[train]{tag} {', '.join(parts)}" + (f" | {shown}" if shown else ""),
            file=sys.stderr,
            flush=True,
        )
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        remaining = timer.time_remaining() if timer is not None else None
        if (
            left is not None
            and remaining is not None
            and left > remaining
            and not self._warned
            and step > self._step0
        ):
            self._warned = True
            print(
                f"[train] warning: at this rate the run needs about {clock(left)} more, but "
                f"trainer.max_time leaves {clock(remaining)}: it will stop before step {total}, "
                f"and fail unless require_planned_steps=false (rerun to resume from last.ckpt, "
                f"or lower the load / raise trainer.max_time)",
                file=sys.stderr,
                flush=True,
            )


def progress_bar(kind: str = "auto", refresh_rate: int = 10, every_s: float = 30.0) -> ProgressBar:
    """One of "tqdm" (a bar, for terminals), "lines" (`LineProgress`, for logs that go to a file) or
    "auto": tqdm when stderr is a terminal, lines otherwise."""
    if kind == "auto":
        kind = "tqdm" if on_terminal() else "lines"
    if kind == "tqdm":
        return TQDMProgressBar(refresh_rate=refresh_rate)
    if kind == "lines":
        return LineProgress(every_s=every_s)
    raise ValueError(f"unknown progress kind {kind!r}: auto, tqdm or lines")
