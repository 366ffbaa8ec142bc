"""The growing KV cache of tree decoding: a Hugging Face `DynamicCache` that appends in place.

A tree verification appends every tree node's KV to the committed cache. Only the accepted
path may stay: `keep_path` moves the accepted nodes' KV next to the committed prefix and
crops the rest, so rejected branches leave no trace.

Hugging Face's own `DynamicLayer` appends with `torch.cat`, which copies the whole cache into
a new allocation at every forward: O(length) work and a fresh allocation per layer per step.
`GrowingLayer` keeps the entries in a buffer with room to spare and writes only the new rows;
the cache it hands the attention is a view of the first `length` rows. The buffer doubles when
full, but never past the sequence's known `max_len`, so it holds no more than a static cache
would. Measured (LOG.md, 2026-12-01): no difference at the CPU demo's few hundred tokens; a step
of a 4 x 1024 model with 6,144 cached tokens much faster, since the copy grows with the context.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from eagle.decoding.backend import PLAIN, KernelBackend

MIN_CAPACITY = 256  # entries a layer's first buffer holds; then it doubles


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys`/`values` are views into a larger buffer.

    Everything that reads or edits `keys`/`values` as tensors (cropping by slicing, the
    in-place writes of `keep_path`, `get_seq_length`) works unchanged, since a view of the
    buffer is what they see. When `update` finds the cache is no longer a view of its buffer
    (a method of the base class replaced it, e.g. beam reordering), it copies it into a new one.
    """

    def __init__(self, max_len: int | None = None, **kwargs):
        super().__init__(**kwargs)
        # the most entries the sequence will need (0/None: unknown): caps the buffer
        self.max_len = max_len or None
        self._keys_buf = self._values_buf = None  # (B, H_kv, capacity, D)

    def _owns(self, tensor: torch.Tensor, buf: torch.Tensor | None) -> bool:
        return (
            buf is not None
            and tensor.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.get_seq_length()
        new = old + key_states.shape[-2]
        if not (
            self._owns(self.keys, self._keys_buf)
            and self._owns(self.values, self._values_buf)
            and new <= self._keys_buf.shape[-2]
        ):
            capacity = max(2 * new, MIN_CAPACITY)  # doubling: amortised O(1) copies per entry
            if (
                self.max_len is not None
            ):  # ...but no more than the sequence needs (it may still exceed it)
                capacity = max(min(capacity, self.max_len), new)
            keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
            values = value_states.new_empty(
                (*value_states.shape[:-2], capacity, value_states.shape[-1])
            )
            if old:
                keys[..., :old, :] = self.keys
                values[..., :old, :] = self.values
            self._keys_buf, self._values_buf = keys, values
        self._keys_buf[..., old:new, :] = key_states
        self._values_buf[..., old:new, :] = value_states
        self.keys, self.values = self._keys_buf[..., :new, :], self._values_buf[..., :new, :]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._keys_buf = self._values_buf = None


class GrowingCache(DynamicCache):
    """A `DynamicCache` of `GrowingLayer`s, created lazily as layers first write; `max_len`, when
    known, is the most entries the sequence will hold (each layer's buffer stops growing there)."""

    def __init__(self, max_len: int | None = None):
        super().__init__()
        self.layer_class_to_replicate = functools.partial(GrowingLayer, max_len=max_len)

    def reserve(
        self, n: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, int] | None:
        """For a forward that writes the cache itself instead of calling `update` once per layer
        (the fused kernels' loop over the layers, `eagle.kernels.fused`), which then calls
        `commit(n)`: every layer's key and value buffers (B, H_kv, capacity, D), the slots (n,) its
        n new entries go to, and how many slots attention then reads. None, with nothing changed,
        where a layer is not ready for that: not created or initialised yet, not a view of its
        buffer (a method of the base class replaced it), lengths that differ, or no room (its
        `update` grows it)."""
        layers, old = self.layers, None
        if not layers:
            return None
        for layer in layers:
            if not (
                isinstance(layer, GrowingLayer)
                and layer.is_initialized
                and layer._keys_buf is not None
            ):
                return None
            keys, values, keys_buf, values_buf = (
                layer.keys,
                layer.values,
                layer._keys_buf,
                layer._values_buf,
            )
            old = keys.shape[-2] if old is None else old
            # a view of the buffer's first entries starts where the buffer does, with its strides
            if (
                keys.data_ptr() != keys_buf.data_ptr()
                or values.data_ptr() != values_buf.data_ptr()
                or keys.stride() != keys_buf.stride()
                or values.stride() != values_buf.stride()
                or keys.shape[-2] != old
                or values.shape[-2] != old
                or old + n > keys_buf.shape[-2]
            ):
                return None
        return (
            [layer._keys_buf for layer in layers],
            [layer._values_buf for layer in layers],
            torch.arange(old, old + n, device=layers[0].keys.device),
            old + n,
        )

    def commit(self, n: int) -> None:
        """The n entries written after `reserve(n)` become part of every layer."""
        for layer in self.layers:
            new = (
                layer.keys.shape[-2] + n
            )  # (`narrow`: a third of the time of `[..., :new, :]`, x 60 a step)
            layer.keys, layer.values = (
                layer._keys_buf.narrow(-2, 0, new),
                layer._values_buf.narrow(-2, 0, new),
            )


def new_cache(max_len: int | None = None) -> GrowingCache:
    """An empty growing cache of full layers, even for a model with sliding-window layers: a
    sliding layer keeps only its window and cannot be cropped back after a tree verification,
    so every layer keeps everything and the masks apply the window
    (`eagle.decoding.masks.for_layers`)."""
    return GrowingCache(max_len)


def cache_length(cache) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def keep_path(cache, prefix_len: int, path: list[int], backend: KernelBackend = PLAIN) -> None:
    """Keep the KV of tree nodes `path` (indices into the tree appended after `prefix_len`).

    Args:
        cache: a cache holding prefix_len + n tree entries per layer.
        prefix_len: committed length before the tree.
        path: increasing node indices to keep (the accepted root-to-node path).
        backend: the target's kernel backend, which moves the entries
            (`eagle.decoding.backend`; a fused one moves every layer's in one call).
    """
    n_keep = len(path)
    if path != list(range(n_keep)):  # a chain's accepted prefix is in place already: only crop
        # every layer's keys and values, (B, H_kv, T, D) each
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        backend.move_slots(tensors, [prefix_len + i for i in path], prefix_len)
    crop(cache, prefix_len + n_keep)


def keep_paths(cache, prefix_len: int, lengths: list[int], paths: list[list[int]]) -> None:
    """`keep_path` for a batch whose rows have committed `lengths` (<= prefix_len: the cache's
    slots are common, a shorter row's tail is stale) and accepted tree nodes `paths` (indices
    into the tree appended after `prefix_len`): row b's path moves to its own slots
    lengths[b]..; then the cache is cropped after the longest row."""
    device = cache.layers[0].keys.device
    m = max(len(p) for p in paths)
    src, dst = [], []
    for c, path in zip(lengths, paths):
        pad = list(
            range(c + len(path), c + m)
        )  # slots copied onto themselves: every row moves m entries
        src.append([prefix_len + i for i in path] + pad)
        dst.append(list(range(c, c + len(path))) + pad)
    src, dst = torch.tensor(src, device=device), torch.tensor(dst, device=device)  # (B, m)
    for layer in cache.layers:
        device = layer.keys.device  # a layer's own GPU under device_map
        s, d = (src, dst) if device == src.device else (src.to(device), dst.to(device))
        for t in (
            layer.keys,
            layer.values,
        ):  # (B, H_kv, T, D): gather first (a copy), then write in place
            shape = (t.shape[0], t.shape[1], m, t.shape[3])
            t.scatter_(
                2, d[:, None, :, None].expand(shape), t.gather(2, s[:, None, :, None].expand(shape))
            )
    crop(cache, max(c + len(p) for c, p in zip(lengths, paths)))


def select_rows(cache, rows: list[int]) -> None:
    """Keep only the batch rows `rows` of every layer (the sequences still decoding)."""
    index = torch.tensor(rows, dtype=torch.long, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        own = (
            index if layer.keys.device == index.device else index.to(layer.keys.device)
        )  # device_map
        layer.keys, layer.values = (
            layer.keys.index_select(0, own),
            layer.values.index_select(0, own),
        )


def crop(cache, length: int) -> None:
    """Drop every cache entry past `length`. A negative argument to `Cache.crop` means "remove
    that many" in every transformers 5.x release (positive values changed meaning)."""
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)
