"""Batches of token samples and the drafter's view of them (no Lightning here: the analysis
notebook reads dumped features with the same code the drafter was trained with).

Alignment (docs/design.md §3). A sample holds tokens x_0..x_{T-1}, the target's features
f_0..f_{T-1} (f_t feeds the LM head that predicts x_{t+1}) and a loss mask m_0..m_{T-1}
(1 = a token the target produces: assistant replies, or all of plain text). The drafter's
input at t is [f_{t-1}; E(x_t)] for t = 1..T-1; its output f_hat_t targets f_t, and
lm_head(f_hat_t) is the draft distribution of x_{t+1}. So

    drafter inputs   features = f[:, :-1]     (f_{t-1})
                     input_ids = x[:, 1:]     (x_t)
    targets          f[:, 1:]                 (f_t)
    weights          m[:, 2:] + [0]           (is x_{t+1} a trained token?)

The last position's next token is not in the sample, so it gets weight 0 (as in EAGLE's
own code). Batches are right-padded: with causal attention no real position sees a pad,
and pads have weight 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def shift_batch(input_ids: Tensor, features: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """The drafter's view of a batch (see the module docstring for the alignment).

    Args:
        input_ids: (B, T) x_0..x_{T-1}; features: (B, T, H) f_0..f_{T-1}; loss_mask: (B, T).
    Returns:
        `features_in` (B, T-1, H) f_{t-1}, `input_ids` (B, T-1) x_t, `prev_ids` (B, T-1) x_{t-1}
        (what an unshifted-input drafter reads), `target` (B, T-1, H) f_t, `weight` (B, T-1) =
        m_{t+1} (0 at the last position).
    """
    weight = F.pad(loss_mask[:, 2:], (0, 1)).float()  # (B, T-1)
    return {
        "features_in": features[:, :-1],
        "input_ids": input_ids[:, 1:],
        "prev_ids": input_ids[:, :-1],
        "target": features[:, 1:],
        "weight": weight,
    }


def collate(items: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Right-pad a list of samples: input_ids, loss_mask, attention_mask (B, T) and, when the
    samples carry them, features (B, T, H) in their stored dtype (pads are zeros)."""
    t = max(int(x["input_ids"].shape[0]) for x in items)
    b = len(items)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    out = {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}
    if "features" in items[0]:
        h = items[0]["features"].shape[-1]
        out["features"] = torch.zeros(b, t, h, dtype=items[0]["features"].dtype)
    for i, x in enumerate(items):
        n = int(x["input_ids"].shape[0])
        ids[i, :n] = x["input_ids"]
        mask[i, :n] = x["loss_mask"]
        attn[i, :n] = 1
        if "features" in out:
            out["features"][i, :n] = x["features"]
    return out


class TokenSamples(torch.utils.data.Dataset):
    """Token samples (`{"id", "input_ids", "loss_mask"}`, as `data_gen.conversations` builds
    them) as tensors, without features."""

    def __init__(self, samples: Sequence[Mapping[str, Any]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def token_rows(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every sample's (input_ids, loss_mask) (`eagle.data.vocab.count_tokens`)."""
        for s in self.samples:
            yield np.asarray(s["input_ids"]), np.asarray(s["loss_mask"])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        s = self.samples[i]
        return {
            "input_ids": torch.from_numpy(np.asarray(s["input_ids"], dtype=np.int64)),
            "loss_mask": torch.from_numpy(np.asarray(s["loss_mask"], dtype=np.int64)),
        }
