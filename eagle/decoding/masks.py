"""Additive attention masks: 0 where a query may look, the dtype's minimum elsewhere.

Every mask in the repository is built here. The minimum, not -inf: a kernel never meets a
row of only -inf (which would give NaNs), and exp(min - max) is exactly 0 in every dtype.

- `causal_mask`: new tokens after a cached prefix (the drafter's training and catch-up).
- `tree_attention_mask`: tree nodes after a committed prefix in a growing cache: each node
  sees the prefix, its ancestors and itself (`eagle.tree.Tree.ancestors`).
- `window_mask`: the same on a preallocated, position-indexed cache of fixed width, so that
  every round has the same shape (`eagle.decoding.static_cache`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(past: int, length: int, dtype: torch.dtype, device=None) -> Tensor:
    """(1, 1, length, past + length) for `length` new tokens after `past` cached ones."""
    q = torch.arange(length, device=device)[:, None] + past  # (T, 1) absolute query index
    k = torch.arange(past + length, device=device)[None]  # (1, S)
    mask = torch.zeros(length, past + length, dtype=dtype, device=device)
    mask.masked_fill_(k > q, torch.finfo(dtype).min)
    return mask[None, None]


def tree_attention_mask(prefix_len: int, visible: Tensor, dtype: torch.dtype) -> Tensor:
    """(1, 1, n, prefix_len + S) for n tree tokens on top of `prefix_len` committed tokens.

    Args:
        visible: (n, S) bool, node i may see tree entry j (ancestor or self); the S >= n tree
            entries follow the prefix in the cache, these n nodes being the last ones.
    """
    n, s = visible.shape
    mask = torch.zeros(1, 1, n, prefix_len + s, dtype=dtype, device=visible.device)
    mask[0, 0, :, prefix_len:].masked_fill_(~visible, torch.finfo(dtype).min)
    return mask


def window_mask(start: Tensor | int, visible: Tensor, max_len: int, dtype: torch.dtype) -> Tensor:
    """(1, 1, m, max_len) for m queries on a position-indexed cache of `max_len` slots.

    Slots before `start` (the committed context) are visible to every query; the S slots
    start..start+S-1 follow `visible` (m, S) bool; every later slot is hidden. `start` may be
    a 0-d tensor, so one compiled graph serves every committed length.
    """
    s = visible.shape[1]
    rel = torch.arange(max_len, device=visible.device) - start  # (max_len,) slot relative to start
    inside = (rel >= 0) & (rel < s)
    seen = (visible[:, rel.clamp(0, s - 1)] & inside) | (rel < 0)  # (m, max_len)
    mask = torch.zeros(seen.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~seen, torch.finfo(dtype).min)[None, None]
