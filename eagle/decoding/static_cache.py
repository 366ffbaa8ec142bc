"""A preallocated, position-indexed KV cache for static-shape decoding (gpt-fast style).

Every layer's keys and values live in buffers of fixed length `max_len`. A forward of n
tokens writes their KV at slots the caller chooses (`prepare`), and attention always reads
all `max_len` slots through an additive mask of that fixed width, so each forward's shapes
depend on n and `max_len` only: a compiler (and CUDA graphs) sees the same graph every round.

Nothing is ever erased. Slots past the committed length hold stale KV (rejected tree nodes,
padding, an earlier sequence); the mask hides them and later writes overwrite them. After a
verification `move` copies the accepted path's KV down next to the committed prefix.

Each layer's keys and values are tensors of their own, as in Hugging Face's `StaticCache`:
a compiled graph then updates them in place. (Views of one shared buffer compile into a copy
of the whole buffer per write: on the CPU that made compiled decoding far slower than eager;
LOG.md, 2026-11-30.)

Hugging Face attention layers talk to it like any cache object: `update(key, value,
layer_idx, ...)` stores the new KV and returns the full buffers. The model itself never
builds a mask or positions from it: the caller always passes a 4-D mask and position ids,
which every transformers 5.x release uses as given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eagle.decoding.masks import window_mask


class StaticKVCache:
    """Keys and values (B, H_kv, max_len, D) of every layer, indexed by slot (keys and values
    may differ in D).

    Each layer's buffers are allocated at its first `update`, from the shape of the keys and
    values the model writes: no config field has to say how many KV heads a family has (multi-
    query, grouped, fused projections all come out right). The first forward on a cache must
    therefore run eagerly (the prefill does); `allocate` sizes every layer up front when the
    shape is known.

    A batch of B sequences has B rows of slots. Each row may write at slots of its own (a batch
    whose sequences have different lengths): `prepare` with one start per row.

    Args:
        num_layers: the layers of the model it serves.
        max_len: slots per layer; fixed for the cache's lifetime.
        batch: rows (sequences decoded together).
    """

    def __init__(
        self,
        num_layers: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        batch: int = 1,
    ):
        self.max_len, self.dtype, self.device, self.batch = (
            max_len,
            dtype,
            torch.device(device),
            batch,
        )
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers
        # where the next forward writes: (n,) slots of every row, or (B, n) per row
        self.slots = torch.zeros(0, dtype=torch.long, device=device)
        self.length = 0  # committed entries (slots 0..length-1); bookkeeping of the owner

    def allocate(self, kv_heads: int, head_dim: int) -> StaticKVCache:
        """Allocate every layer now, for keys and values of (B, kv_heads, *, head_dim)."""
        for i in range(len(self.keys)):
            self._allocate(i, (kv_heads, head_dim), (kv_heads, head_dim))
        return self

    def _allocate(
        self,
        layer: int,
        key_shape: tuple[int, int],
        value_shape: tuple[int, int],
        device: torch.device | None = None,
    ) -> None:
        """(heads, dim) of the layer's keys and of its values: they differ where attention is
        latent (DeepSeek-V3's keys carry a rotary part that its values do not). On `device`, the
        layer's own (a target spread over GPUs by `device_map`), else the cache's."""
        (kh, kd), (vh, vd) = key_shape, value_shape
        device = device or self.device
        self.keys[layer] = torch.zeros(
            self.batch, kh, self.max_len, kd, dtype=self.dtype, device=device
        )
        self.values[layer] = torch.zeros(
            self.batch, vh, self.max_len, vd, dtype=self.dtype, device=device
        )
        if device.type != "cpu":
            for t in (self.keys[layer], self.values[layer]):
                # fixed addresses: CUDA graphs mutate them in place, never copy them. Not on a CPU,
                # where compiled passes freeze their weights (eagle.decoding.compile): Dynamo
                # freezes every static-address tensor with them, as a constant, and the cache's
                # writes would be lost
                torch._dynamo.mark_static_address(t)

    def fits(
        self, num_layers: int, max_len: int, dtype: torch.dtype, device, batch: int = 1
    ) -> bool:
        return (
            len(self.keys) == num_layers
            and self.max_len == max_len
            and self.dtype == dtype
            and self.device == torch.device(device)
            and self.batch == batch
        )

    def prepare(
        self, start: Tensor | int, visible: Tensor, write_at: Tensor | int | None = None
    ) -> Tensor:
        """Aim the next forward's n = visible.shape[-2] writes at slots write_at..write_at+n-1
        (default: the last n of the S slots after `start`), and return that forward's mask
        (B, 1, n, max_len) (see `window_mask`). `start` and `write_at` are one slot for every
        row (an int or a 0-d tensor) or one per row (B,); `visible` is (n, S) or (B, n, S)."""
        n, s = visible.shape[-2:]
        write_at = start + (s - n) if write_at is None else write_at
        offsets = torch.arange(n, device=self.device)
        per_row = isinstance(write_at, Tensor) and write_at.dim() == 1 and self.batch > 1
        self.slots = (
            write_at[:, None] + offsets if per_row else write_at + offsets
        )  # (B, n) or (n,)
        return window_mask(start, visible, self.max_len, self.dtype)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Called by each attention layer with its new (B, H_kv, n, D) keys and values;
        returns the whole layer (B, H_kv, max_len, D) for attention under the mask."""
        if self.keys[layer_idx] is None:
            self._allocate(
                layer_idx,
                (key_states.shape[1], key_states.shape[-1]),
                (value_states.shape[1], value_states.shape[-1]),
                key_states.device,
            )
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        slots = (
            self.slots if self.slots.device == keys.device else self.slots.to(keys.device)
        )  # layers over GPUs
        if slots.dim() == 1:  # every row writes at the same slots
            keys.index_copy_(2, slots, key_states)
            values.index_copy_(2, slots, value_states)
        else:  # (B, n): each row at its own
            index = slots[:, None, :, None]  # (B, 1, n, 1)
            keys.scatter_(2, index.expand_as(key_states), key_states)
            values.scatter_(2, index.expand_as(value_states), value_states)
        return keys, values

    def reserve(self, n: int) -> tuple[list[Tensor], list[Tensor], Tensor, int] | None:
        """For a forward that writes the cache itself instead of calling `update` once per layer
        (the fused kernels' loop over the layers, `eagle.kernels.fused`), which then calls
        `commit(n)`: every layer's buffers, the slots `prepare` aimed the n new tokens at, and how
        many slots attention reads (all of them, under the mask). None where a layer is not
        allocated yet (its first `update` does it) or `prepare` aimed another number of tokens."""
        if self.slots.shape[-1] != n or any(k is None for k in self.keys):
            return None
        return self.keys, self.values, self.slots, self.max_len

    def commit(self, n: int) -> None:
        """Nothing to do: the slots were the writer's to fill, and `length` is the owner's
        bookkeeping."""

    def select_rows(self, rows) -> None:
        """Keep only the batch rows `rows` (sequences still decoding) of every layer."""
        rows = list(rows)
        self.keys = [
            None if t is None else t.index_select(0, torch.tensor(rows, device=t.device))
            for t in self.keys
        ]
        self.values = [
            None if t is None else t.index_select(0, torch.tensor(rows, device=t.device))
            for t in self.values
        ]
        self.batch = len(rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def move(self, src: Tensor, dst: Tensor) -> None:
        """Copy the entries at slots `src` to slots `dst` in every layer, both (k,) for every row or
        (B, k) per row (a gather, then a write: overlapping ranges are safe)."""
        for t in self.keys + self.values:
            if t is None:
                continue
            s, d = (
                (src, dst) if t.device == src.device else (src.to(t.device), dst.to(t.device))
            )  # device_map
            if s.dim() == 1:
                t.index_copy_(2, d, t.index_select(2, s))
            else:
                shape = (t.shape[0], t.shape[1], s.shape[1], t.shape[3])
                t.scatter_(
                    2,
                    d[:, None, :, None].expand(shape),
                    t.gather(2, s[:, None, :, None].expand(shape)),
                )
