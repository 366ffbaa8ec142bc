"""Additive attention masks: 0 where a query may look, the dtype's minimum elsewhere.

Every mask in the repository is built here. The minimum, not -inf: a kernel never meets a
row of only -inf (which would give NaNs), and exp(min - max) is exactly 0 in every dtype.

- `causal_mask`: new tokens after a cached prefix (the drafter's training and catch-up).
- `tree_attention_mask`: tree nodes after a committed prefix in a growing cache: each node
  sees the prefix, its ancestors and itself (`eagle.tree.Tree.ancestors`); in a batch, each
  row only its own committed prefix (rows of different lengths share the cache's slots).
- `padded_causal`: right-padded prompts of a batch: causal, padding seen by nothing else.
- `window_mask`: the same on a preallocated, position-indexed cache of fixed width, so that
  every round has the same shape (`eagle.decoding.static_cache`).
- `for_layers`: what a model with local-attention layers needs instead of one mask: a 4-D mask
  is used as given by Hugging Face models, so the locality has to be in it: a sliding window
  (Mistral, Gemma-2/3, Qwen2 with a window...) or fixed chunks (Llama-4). Without that, a tree
  verification would attend to tokens the model itself never sees.
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


def tree_attention_mask(
    prefix_len: int, visible: Tensor, dtype: torch.dtype, committed: Tensor | None = None
) -> Tensor:
    """(B, 1, n, prefix_len + S) for n tree tokens on top of `prefix_len` cached tokens.

    Args:
        visible: (n, S) or (B, n, S) bool, node i may see tree entry j (ancestor or self); the
            S >= n tree entries follow the prefix in the cache, these n nodes being the last ones.
        committed: (B,) long, the committed tokens of each row of a batch (B = 1 without it:
            all `prefix_len`); a shorter row's slots committed..prefix_len-1 hold another row's
            length of padding and stale entries, hidden from it.
    """
    s = visible.shape[-1]
    visible = visible if visible.dim() == 3 else visible[None]  # (B, n, S)
    b, n = (visible.shape[0] if committed is None else len(committed)), visible.shape[1]
    mask = torch.zeros(b, 1, n, prefix_len + s, dtype=dtype, device=visible.device)
    low = torch.finfo(dtype).min
    mask[:, 0, :, prefix_len:].masked_fill_(~visible, low)
    if committed is not None:
        hidden = (
            torch.arange(prefix_len, device=visible.device) >= committed.to(visible.device)[:, None]
        )  # (B, prefix)
        mask[:, 0, :, :prefix_len].masked_fill_(hidden[:, None], low)
    return mask


def padded_causal(lengths: Tensor, t: int) -> Tensor:
    """(B, t, t) bool for prompts of `lengths` (B,) right-padded to t tokens: a token sees the
    real tokens up to itself and itself; a padding slot is seen by no other token."""
    causal = torch.ones(t, t, dtype=torch.bool, device=lengths.device).tril()
    real = torch.arange(t, device=lengths.device) < lengths[:, None]  # (B, t)
    return causal & (real[:, None, :] | torch.eye(t, dtype=torch.bool, device=lengths.device))


def window_mask(start: Tensor | int, visible: Tensor, max_len: int, dtype: torch.dtype) -> Tensor:
    """(B, 1, m, max_len) for m queries on a position-indexed cache of `max_len` slots.

    Slots before `start` (the committed context) are visible to every query; the S slots
    start..start+S-1 follow `visible` (m, S) bool; every later slot is hidden. `start` may be
    a 0-d tensor, so one compiled graph serves every committed length; for a batch it is one
    start per row (B,), and `visible` is (m, S) for every row or (B, m, S).
    """
    m, s = visible.shape[-2:]
    start = torch.as_tensor(start, device=visible.device).reshape(-1)  # (B,) or (1,)
    rows = visible if visible.dim() == 3 else visible[None]  # (B, m, S) or (1, m, S)
    b = max(start.shape[0], rows.shape[0])
    rel = (torch.arange(max_len, device=visible.device) - start[:, None]).expand(
        b, max_len
    )  # slot - its row's start
    inside = (rel >= 0) & (rel < s)
    seen = torch.gather(
        rows.expand(b, m, s), 2, rel.clamp(0, s - 1)[:, None, :].expand(b, m, max_len)
    )
    seen = (seen & inside[:, None]) | (rel < 0)[:, None]  # (B, m, max_len)
    mask = torch.zeros(seen.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~seen, torch.finfo(dtype).min)[:, None]


def sliding_window(config) -> int | None:
    """The attention window of a config whose layers use one, else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if (
        not window
        or getattr(config, "use_sliding_window", True) is False
        or (types and "sliding_attention" not in types)
    ):
        return None
    return int(window)


def attention_chunk(config) -> int | None:
    """The chunk of a config whose layers attend within fixed chunks of positions (Llama-4's
    `chunked_attention`: a query sees the keys of its own chunk only), else None."""
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk or "chunked_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    return int(chunk)


def is_local(config) -> bool:
    """Whether some layers of the model see only part of the causal context (a sliding window or
    a chunk): then its masks need every key's position, not only its order."""
    return sliding_window(config) is not None or attention_chunk(config) is not None


def for_layers(
    config, mask: Tensor, query_pos: Tensor, key_pos: Tensor
) -> Tensor | dict[str, Tensor]:
    """The `attention_mask` to give a Hugging Face model for `mask` (B, 1, n, K).

    Without local layers (`is_local`): `mask` itself. A sliding layer also hides every key at or
    before `query_pos - window` (a query sees the last `window` positions, itself included, as
    Hugging Face's own masks do); a chunked layer every key outside the query's chunk
    (`position // chunk`). As a dict by layer type for configs that list `layer_types` (their
    forward takes one), else as the one mask of every layer.

    Args:
        query_pos: (n,) or (B, n) the queries' positions; key_pos: (K,) or (B, K) the keys'
        positions
            (per row of a batch, whose rows stand at different positions).
    """
    window, chunk = sliding_window(config), attention_chunk(config)
    if window is None and chunk is None:
        return mask

    def hide(far: Tensor) -> Tensor:  # far: (n, K) or (B, n, K), True where the layer hides the key
        return mask.masked_fill(
            far[None, None] if far.dim() == 2 else far[:, None], torch.finfo(mask.dtype).min
        )

    keys, queries = key_pos[..., None, :], query_pos[..., :, None]
    masks = {"full_attention": mask}
    if window is not None:
        masks["sliding_attention"] = hide(keys <= queries - window)
    if chunk is not None:
        masks["chunked_attention"] = hide(keys // chunk != queries // chunk)
    if getattr(config, "layer_types", None):
        return masks
    return masks["sliding_attention"]
