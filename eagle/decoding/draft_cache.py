"""The KV cache of a draft model (EAGLE's drafter, a small draft LM), in two interchangeable kinds.

A draft model keeps KV over the committed context; each round it appends the KV of the tree
nodes it drafts (the branch), which verification then discards. Both kinds offer the same
four operations, so a draft model never asks which one it has:

    begin(max_len)                 a new sequence that may reach `max_len` entries
    reserve(need)                  fail clearly unless `need` entries fit (before a pass)
    prepare(start, visible, at)    the mask of a pass whose n = visible.shape[0] tokens write
                                   their KV at entries at..at+n-1; each sees the committed
                                   entries before `start` and what `visible` (n, S) allows of
                                   the S entries from `start`
    keep(length)                   the first `length` entries are the committed context; the
                                   rest (this round's branch) is dropped
    length                         committed entries

`DynamicDraftCache` is a Hugging Face `DynamicCache` that grows and is cropped (every pass
appends, so `at` is always its current end). `StaticDraftCache` is a preallocated,
position-indexed `StaticKVCache`: `keep` only lowers the committed length (branch entries stay,
hidden by the mask, until overwritten), so every pass can have a fixed shape and be compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eagle.decoding.kv_cache import cache_length, crop
from eagle.decoding.masks import tree_attention_mask
from eagle.decoding.static_cache import StaticKVCache

CACHE_KINDS = ("dynamic", "static")


class DraftCache:
    """Interface of a draft model's KV cache (see the module docstring)."""

    fixed_shape = False  # whether passes may be padded to one fixed shape (and compiled)

    def __init__(self, config, dtype: torch.dtype, device: torch.device | str):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.hf = None  # what the model's layers receive as their cache

    @property
    def length(self) -> int:
        raise NotImplementedError

    def begin(self, max_len: int) -> None:
        raise NotImplementedError

    def reserve(self, need: int) -> None:
        """Raise unless `need` entries fit (a growing cache always has room)."""

    def prepare(self, start: int, visible: Tensor, write_at: int) -> Tensor:
        raise NotImplementedError

    def keep(self, length: int) -> None:
        raise NotImplementedError


class DynamicDraftCache(DraftCache):
    """A growing Hugging Face `DynamicCache`, cropped back to the committed context each round."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device | str):
        super().__init__(config, dtype, device)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def begin(self, max_len: int) -> None:
        from transformers import DynamicCache

        self.hf, self._length = DynamicCache(config=self.config), 0

    def prepare(self, start: int, visible: Tensor, write_at: int) -> Tensor:
        n, s = visible.shape
        end = cache_length(self.hf)
        if write_at != end or start + s - n != end:
            raise RuntimeError(f"a growing draft cache only appends: a pass writing at {write_at} (window from "
                               f"{start}, {s} entries) does not follow its {end} entries")
        return tree_attention_mask(start, visible, self.dtype)  # (1, 1, n, start + s)

    def keep(self, length: int) -> None:
        crop(self.hf, length)
        self._length = length


class StaticDraftCache(DraftCache):
    """A preallocated, position-indexed `StaticKVCache`, sized for each sequence."""

    fixed_shape = True

    @property
    def length(self) -> int:
        return 0 if self.hf is None else self.hf.length

    def begin(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError("a static draft cache needs the sequence's max_len (DecodeState.max_len)")
        if self.hf is None or not self.hf.fits(self.hf_layers, max_len, self.dtype, self.device):
            self.hf = StaticKVCache.for_config(self.config, max_len, self.dtype, self.device)
        self.hf.length = 0  # buffers are kept for the next sequence; stale slots stay hidden

    @property
    def hf_layers(self) -> int:
        return self.config.num_hidden_layers

    def reserve(self, need: int) -> None:
        if need > self.hf.max_len:
            raise RuntimeError(f"the static draft cache ({self.hf.max_len} slots) cannot hold {need} entries; "
                               "size it for prompt + new tokens + tree (DecodeState.max_len)")

    def prepare(self, start: int | Tensor, visible: Tensor, write_at: int | Tensor) -> Tensor:
        # no checks here: this runs inside compiled passes, with 0-d tensors for start and write_at
        return self.hf.prepare(start, visible, write_at)  # (1, 1, n, max_len)

    def keep(self, length: int) -> None:
        self.hf.length = length


def draft_cache(kind: str, config, dtype: torch.dtype, device: torch.device | str) -> DraftCache:
    """A draft cache of `kind` ("dynamic" or "static") for a model with Hugging Face `config`."""
    kinds = {"dynamic": DynamicDraftCache, "static": StaticDraftCache}
    if kind not in kinds:
        raise ValueError(f"unknown draft cache kind {kind!r}; choose one of {CACHE_KINDS}")
    return kinds[kind](config, dtype, device)
