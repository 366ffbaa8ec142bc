"""The optimiser every training run uses, as one config: AdamW (weight decay on matrices only)
with linear warmup and a decay schedule from `transformers` (the library's, not ours)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SCHEDULES = ("linear", "cosine", "constant")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its learning-rate schedule (the `optim` node of every `configs/model/` file).

    The schedule warms up linearly from 0 over `warmup_steps`, then until the trainer's last
    step decays "linear" to 0 (EAGLE-1's `get_linear_schedule_with_warmup`), "cosine" to
    `min_lr_ratio * lr`, or stays "constant".
    """

    lr: float
    betas: Sequence[float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0  # on matrices only; norms and biases are not decayed
    warmup_steps: int = 100
    schedule: str = "linear"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        if self.schedule == "linear" and self.min_lr_ratio:
            raise ValueError(
                "the linear schedule decays to 0; use schedule=cosine for a floor (min_lr_ratio)"
            )
        if self.lr < 0 or self.warmup_steps < 0:
            raise ValueError(
                f"optim: lr and warmup_steps must be >= 0, got {self.lr} and {self.warmup_steps}"
            )

    def build(self, module: nn.Module, total_steps: int) -> dict[str, Any]:
        """What Lightning's `configure_optimizers` returns: the optimiser over `module`'s
        trainable parameters and the schedule stepped every optimizer step."""
        optimizer = adamw(module, self.lr, self.betas, self.eps, self.weight_decay)
        scheduler = lr_schedule(
            optimizer, self.schedule, self.warmup_steps, total_steps, self.min_lr_ratio
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def adamw(
    module: nn.Module, lr: float, betas, eps: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms and biases (1-D) are not decayed."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=tuple(betas),
        eps=eps,
    )


def lr_schedule(
    optimizer: torch.optim.Optimizer,
    schedule: str,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
):
    """Linear warmup from 0 over `warmup_steps`, then `schedule` until `total_steps` (see
    `OptimConfig`), as `transformers.get_scheduler` builds it."""
    from transformers import get_scheduler

    OptimConfig(lr=0.0, schedule=schedule, min_lr_ratio=min_lr_ratio)  # the same checks
    name = {"linear": "linear", "cosine": "cosine_with_min_lr", "constant": "constant_with_warmup"}[
        schedule
    ]
    extra = {"min_lr_rate": min_lr_ratio} if schedule == "cosine" else None
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=extra,
    )
