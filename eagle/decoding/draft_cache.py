"""The KV cache of a draft model (EAGLE's drafter, a small draft LM), in two interchangeable kinds.

A draft model keeps KV over the committed context; each round it appends the KV of the tree
nodes it drafts (the branch), which verification then discards. Both kinds offer the same
four operations, so a draft model never asks which one it has:

    begin(max_len)                 a new sequence that may reach `max_len` entries
    reserve(need)                  fail clearly unless `need` entries fit (before a pass)
    prepare(start, visible, at,    the mask of a pass whose n = visible.shape[0] tokens, at
            positions)             `positions` (n,), write their KV at entries at..at+n-1; each
                                   sees the committed entries before `start` and what `visible`
                                   (n, S) allows of the S entries from `start`
    keep(length)                   the first `length` entries are the committed context; the
                                   rest (this round's branch) is dropped
    length                         committed entries

`DynamicDraftCache` is a Hugging Face `DynamicCache` that grows and is cropped (every pass
appends, so `at` is always its current end; for a model with local layers (a sliding window or
chunks) it keeps every entry's position, and the mask applies the locality,
`eagle.decoding.masks.for_layers`).
`StaticDraftCache` is a preallocated,
position-indexed `StaticKVCache`: `keep` only lowers the committed length (branch entries stay,
hidden by the mask, until overwritten), so every pass can have a fixed shape and be compiled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from eagle.decoding.kv_cache import cache_length, crop, new_cache
from eagle.decoding.masks import for_layers, is_local, tree_attention_mask
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

    def prepare(
        self, start: int, visible: Tensor, write_at: int, positions: Tensor
    ) -> Tensor | dict:
        raise NotImplementedError

    def keep(self, length: int) -> None:
        raise NotImplementedError

    def fresh(self) -> DraftCache:
        """An empty cache of the same kind and model (another sequence of a batch)."""
        raise NotImplementedError


class DynamicDraftCache(DraftCache):
    """A growing Hugging Face `DynamicCache`, cropped back to the committed context each round."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device | str):
        super().__init__(config, dtype, device)
        self._length = 0
        self.local = is_local(config)
        self._positions: list[
            Tensor
        ] = []  # with local layers: the position of every entry, in pieces

    @property
    def length(self) -> int:
        return self._length

    def begin(self, max_len: int) -> None:
        self.hf, self._length, self._positions = new_cache(max_len), 0, []

    def prepare(
        self, start: int, visible: Tensor, write_at: int, positions: Tensor
    ) -> Tensor | dict:
        n, s = visible.shape
        end = cache_length(self.hf)
        if write_at != end or start + s - n != end:
            raise RuntimeError(
                f"a growing draft cache only appends: a pass writing at {write_at} (window from "
                f"{start}, {s} entries) does not follow its {end} entries"
            )
        mask = tree_attention_mask(start, visible, self.dtype)  # (1, 1, n, start + s)
        if not self.local:
            return mask
        self._positions.append(positions.to(self.device))
        return for_layers(self.config, mask, positions, torch.cat(self._positions))

    def fresh(self) -> DynamicDraftCache:
        return DynamicDraftCache(self.config, self.dtype, self.device)

    def keep(self, length: int) -> None:
        crop(self.hf, length)
        self._length = length
        if self.local:
            self._positions = [torch.cat(self._positions)[:length]] if self._positions else []


class StaticDraftCache(DraftCache):
    """A preallocated, position-indexed `StaticKVCache`, sized for each sequence.

    `kv_shape` (KV heads, head dim), when known, allocates every layer in `begin`: a compiled
    pass must never be the one that allocates (otherwise the first, eager forward does)."""

    fixed_shape = True

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_shape: tuple[int, int] | None = None,
    ):
        super().__init__(config, dtype, device)
        self.kv_shape, self.local = kv_shape, is_local(config)
        self.slot_pos: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.hf is None else self.hf.length

    def begin(self, max_len: int) -> None:
        if max_len < 1:
            raise ValueError(
                "a static draft cache needs the sequence's max_len (DecodeState.max_len)"
            )
        layers = self.config.num_hidden_layers
        if self.hf is None or not self.hf.fits(layers, max_len, self.dtype, self.device):
            self.hf = StaticKVCache(layers, max_len, self.dtype, self.device)
            if self.kv_shape is not None:
                self.hf.allocate(*self.kv_shape)
            # with local layers: the position held in every slot (the mask applies the locality)
            self.slot_pos = torch.arange(max_len, device=self.device) if self.local else None
        self.hf.length = 0  # buffers are kept for the next sequence; stale slots stay hidden

    def reserve(self, need: int) -> None:
        if need > self.hf.max_len:
            raise RuntimeError(
                f"the static draft cache ({self.hf.max_len} slots) cannot hold {need} entries; "
                "size it for prompt + new tokens + tree (DecodeState.max_len)"
            )

    def prepare(
        self, start: int | Tensor, visible: Tensor, write_at: int | Tensor, positions: Tensor
    ) -> Tensor:
        # no checks here: this runs inside compiled passes, with 0-d tensors for start and write_at
        mask = self.hf.prepare(start, visible, write_at)  # (1, 1, n, max_len)
        if not self.local:
            return mask
        self.slot_pos.index_copy_(0, self.hf.slots, positions)
        return for_layers(self.config, mask, positions, self.slot_pos)

    def fresh(self) -> StaticDraftCache:
        return StaticDraftCache(self.config, self.dtype, self.device, self.kv_shape)

    def keep(self, length: int) -> None:
        self.hf.length = length


class RowsDraftCache:
    """The KV of one draft model for B sequences drafted together: a position-indexed
    `StaticKVCache` of B rows, each with its own committed length (rows of different lengths
    write at slots of their own; a row's entry i holds its position i, branch entries their
    node's). Passes run eagerly: each round's shapes depend on the batch.

        begin(max_len, rows)         B sequences that may reach `max_len` entries
        prepare(visible, offset,     the mask of a pass whose n tokens per row, at `positions`
                positions)           (B, n), write after each row's committed entries and the
                                     `offset` branch entries of earlier passes; each sees its
                                     row's committed entries and what `visible` ((n, S) or
                                     (B, n, S)) allows of the S entries after them
        advance(counts)              each row commits that many more entries
        keep_rows(rows)              only these rows (sequences still decoding) stay
    """

    def __init__(
        self,
        config,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_shape: tuple[int, int] | None = None,
    ):
        self.config, self.dtype, self.device, self.kv_shape = (
            config,
            dtype,
            torch.device(device),
            kv_shape,
        )
        self.local = is_local(config)
        self.hf: StaticKVCache | None = None
        self.lengths: list[int] = []
        self.slot_pos: Tensor | None = None  # (B, max_len) with local layers: each slot's position

    def begin(self, max_len: int, rows: int) -> None:
        layers = self.config.num_hidden_layers
        if self.hf is None or not self.hf.fits(layers, max_len, self.dtype, self.device, rows):
            self.hf = StaticKVCache(layers, max_len, self.dtype, self.device, batch=rows)
            if self.kv_shape is not None:
                self.hf.allocate(*self.kv_shape)
        self.lengths, self.hf.length = [0] * rows, 0
        if self.local:
            self.slot_pos = torch.arange(max_len, device=self.device).repeat(rows, 1)

    def prepare(self, visible: Tensor, offset: int, positions: Tensor) -> Tensor | dict:
        n, s = visible.shape[-2:]
        committed = torch.tensor(self.lengths, device=self.device)  # (B,)
        if max(self.lengths) + offset + n > self.hf.max_len:
            raise RuntimeError(
                f"the draft cache ({self.hf.max_len} slots) cannot hold "
                f"{max(self.lengths) + offset + n} "
                "entries; size it for prompt + new tokens + tree (DecodeState.max_len)"
            )
        mask = self.hf.prepare(committed, visible, committed + offset)  # (B, 1, n, max_len)
        if not self.local:
            return mask
        slots = (
            self.hf.slots
            if self.hf.slots.dim() == 2
            else self.hf.slots.expand(len(self.lengths), n)
        )
        self.slot_pos.scatter_(1, slots, positions)
        return for_layers(self.config, mask, positions, self.slot_pos)

    def advance(self, counts: Sequence[int]) -> None:
        self.lengths = [c + k for c, k in zip(self.lengths, counts)]
        self.hf.length = max(
            self.lengths
        )  # what the cache says to a model that asks (get_seq_length)

    def keep_rows(self, rows: Sequence[int]) -> None:
        if len(rows) == len(self.lengths):
            return
        self.hf.select_rows(rows)
        self.lengths = [self.lengths[i] for i in rows]
        if self.slot_pos is not None:
            self.slot_pos = self.slot_pos[list(rows)]


def draft_cache(
    kind: str,
    config,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_shape: tuple[int, int] | None = None,
) -> DraftCache:
    """A draft cache of `kind` ("dynamic" or "static") for a model with Hugging Face `config`
    (a static one allocated up front when `kv_shape`, (KV heads, head dim), is given)."""
    if kind == "dynamic":
        return DynamicDraftCache(config, dtype, device)
    if kind == "static":
        return StaticDraftCache(config, dtype, device, kv_shape)
    raise ValueError(f"unknown draft cache kind {kind!r}; choose one of {CACHE_KINDS}")
