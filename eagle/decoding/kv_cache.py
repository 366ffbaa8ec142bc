"""Helpers for Hugging Face's growing `DynamicCache` in tree decoding.

A tree verification appends every tree node's KV to the committed cache. Only the accepted
path may stay: `keep_path` moves the accepted nodes' KV next to the committed prefix and
crops the rest, so rejected branches leave no trace.
"""

from __future__ import annotations

import torch


def new_cache():
    """An empty growing cache of full layers, even for a model with sliding-window layers: a
    sliding layer keeps only its window and cannot be cropped back after a tree verification,
    so every layer keeps everything and the masks apply the window
    (`eagle.decoding.masks.for_layers`)."""
    from transformers import DynamicCache

    return DynamicCache()


def cache_length(cache) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def keep_path(cache, prefix_len: int, path: list[int]) -> None:
    """Keep the KV of tree nodes `path` (indices into the tree appended after `prefix_len`).

    Args:
        cache: a cache holding prefix_len + n tree entries per layer.
        prefix_len: committed length before the tree.
        path: increasing node indices to keep (the accepted root-to-node path).
    """
    n_keep = len(path)
    contiguous = path == list(range(n_keep))
    if not contiguous:  # a chain's accepted prefix is already in place: only crop
        src = torch.as_tensor(path, dtype=torch.long) + prefix_len
        for layer in cache.layers:
            device = layer.keys.device
            # (B, H_kv, T, D): gather first (a copy), then write back in place
            layer.keys[:, :, prefix_len:prefix_len + n_keep] = layer.keys[:, :, src.to(device)]
            layer.values[:, :, prefix_len:prefix_len + n_keep] = layer.values[:, :, src.to(device)]
    crop(cache, prefix_len + n_keep)


def crop(cache, length: int) -> None:
    """Drop every cache entry past `length`. A negative argument to `Cache.crop` means "remove
    that many" in every transformers 5.x release (positive values changed meaning)."""
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)
