"""Learning-rate schedules shared by target and drafter training."""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str = "cosine",
                  min_lr_ratio: float = 0.0) -> float:
    """Linear warmup from ~0 to 1 over `warmup_steps`, then `schedule` down to `min_lr_ratio`
    at `total_steps` (linear with ratio 0 is EAGLE-1's `get_linear_schedule_with_warmup`)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
