"""How the decoding loop runs the target and keeps its KV: two interchangeable runners.

The loop (`eagle.engine`) asks a runner for three things:
  prefill(prompt)         the prompt's KV enters the cache; logits of its last position and
                          the features of every position come back;
  verify(root + tree)     one forward of the root and the draft tree on top of the committed
                          cache (tree mask, positions = committed length + depth); the logits
                          and features of every node come back;
  commit(path)            only the accepted path joins the committed cache.

`DynamicRunner` uses a Hugging Face `DynamicCache` that grows by the tree every round and is
compacted and cropped afterwards (`eagle.decoding.kv_cache.keep_path`); every round has new shapes.
`StaticRunner` uses a preallocated, position-indexed `StaticKVCache`: the tree is padded to
a fixed width, attention always spans the whole buffer, and rejected nodes are hidden by the
mask rather than erased, so every round runs the same graph, which `torch.compile` (and CUDA
graphs) can capture. The accepted path's KV is moved next to the committed prefix at the
start of the next verification, inside its graph: a fixed-size index copy (the path padded
with slots copied onto themselves) instead of a few small kernels per layer between graphs.
Both runners give the same tokens: the tests run every exactness test on both.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from eagle.decoding.compile import compile_static
from eagle.decoding.kv_cache import cache_length, keep_path, new_cache
from eagle.decoding.masks import for_layers, sliding_window, tree_attention_mask
from eagle.decoding.static_cache import StaticKVCache
from eagle.target import TargetOutput, target_forward
from eagle.tree import Tree

RUNNERS = ("dynamic", "static")
STATIC_BUCKET = 256  # a static cache sized per sequence is rounded up to a multiple of this


class ContextOverflowError(ValueError):
    """The request cannot fit in the target's context (said before decoding starts)."""


class TargetRunner:
    """Runs the target for the decoding loop; `length` = tokens in the committed cache."""

    length: int = 0
    tree_size: int = 0  # draft nodes every verification is padded to (0: any size, unpadded)

    def __init__(self, target: nn.Module):
        self.target = target
        self.device = next(target.parameters()).device

    def prefill(self, ids: Tensor, max_len: int) -> TargetOutput:
        """Fill the cache with the prompt ids (1, T) for a sequence that may reach `max_len`
        tokens (tree included). Returns logits (1, 1, V) of the last position and features (1, T, H)."""
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        """Most tokens (tree included) the current sequence may reach."""
        raise NotImplementedError

    def verify(self, tokens: Tensor, parents: tuple[int, ...]) -> TargetOutput:
        """Score root + tree tokens (1, n) with parent list `parents` (len n) on top of the
        committed cache. Returns logits (1, n, V) and features (1, n, H)."""
        raise NotImplementedError

    def commit(self, path: list[int]) -> None:
        """Keep the KV of tree nodes `path` (increasing indices, root first) after the
        committed prefix; nothing else of the last verification stays visible."""
        raise NotImplementedError

    def committed_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """Keys and values (1, H_kv, length, D) of the committed tokens in one layer."""
        raise NotImplementedError


class DynamicRunner(TargetRunner):
    """A Hugging Face `DynamicCache`: the tree's KV is appended, then compacted and cropped."""

    def __init__(self, target: nn.Module):
        super().__init__(target)
        self.cache = None
        self._capacity = self._prefix = 0

    @property
    def length(self) -> int:
        return cache_length(self.cache)

    @property
    def capacity(self) -> int:
        return self._capacity

    def prefill(self, ids: Tensor, max_len: int) -> TargetOutput:
        self.cache, self._capacity = new_cache(max_len), max_len
        return target_forward(self.target, ids.to(self.device), self.cache, logits_slice=slice(-1, None))

    def verify(self, tokens: Tensor, parents: tuple[int, ...]) -> TargetOutput:
        tree = Tree.of(parents)
        self._prefix = prefix = self.length  # the cache grows by the tree until `commit`
        if tree.is_chain:  # the causal mask and default positions are the tree's: skip building them
            return target_forward(self.target, tokens, self.cache)
        dtype = next(self.target.parameters()).dtype
        positions = prefix + tree.depth_offsets(device=self.device)  # (n,)
        mask = tree_attention_mask(prefix, tree.ancestors(device=self.device), dtype)
        keys = torch.cat([torch.arange(prefix, device=self.device), positions])  # (prefix + n,)
        return target_forward(self.target, tokens, self.cache, attention_mask=for_layers(
            self.target.config, mask, positions, keys), position_ids=positions[None])

    def commit(self, path: list[int]) -> None:
        keep_path(self.cache, self._prefix, path)

    def committed_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        kv = self.cache.layers[layer]
        return kv.keys[:, :, :self.length], kv.values[:, :, :self.length]


class StaticRunner(TargetRunner):
    """A preallocated, position-indexed cache; every verification has the same shapes.

    Args:
        target: a Hugging Face causal LM (eval mode).
        tree_size: draft nodes per verification; smaller trees are padded to it (vanilla: 0).
        max_len: fixed slots per layer; None sizes the buffer per sequence, rounded up to a
            multiple of `STATIC_BUCKET` (under compile each new size is a new graph, so there
            the buffer only grows: a warm-up on the longest request builds the graph the
            others reuse).
        compile_mode: None (eager), "default", or "reduce-overhead" (CUDA graphs); see
            `eagle.decoding.compile.compile_static`. The prefill always runs eagerly.
    """

    def __init__(self, target: nn.Module, tree_size: int = 0, max_len: int | None = None,
                 compile_mode: str | None = None):
        super().__init__(target)
        if max_len is not None and max_len < 1:
            raise ValueError(f"static cache max_len must be positive, got {max_len}")
        self.tree_size = tree_size
        self.width = tree_size + 1  # root + tree, every round
        self.max_len = max_len
        self.cache: StaticKVCache | None = None
        self.window = sliding_window(target.config)
        self.compiled = compile_mode is not None
        self._forward = compile_static(self._scores, compile_mode)
        # slots moved per commit: the longest path (padded); vanilla decoding never moves anything
        self.moves = self.width if tree_size else 0
        self._src = self._dst = torch.zeros(0, dtype=torch.long, device=self.device)  # the pending move
        self._buffers: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.length

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else self.cache.max_len

    def _allocate(self, need: int) -> None:
        size = self.max_len or -(-need // STATIC_BUCKET) * STATIC_BUCKET
        if self.compiled and not self.max_len and self.cache is not None and self.cache.max_len >= need:
            size = self.cache.max_len  # compiled, each size is one more graph: keep the largest built
        if need > size:
            raise ContextOverflowError(f"the request needs {need} cache slots (prompt + new tokens + tree) but "
                                       f"the static cache holds {size}; raise its max_len")
        dtype = next(self.target.parameters()).dtype
        if self.cache is None or not self.cache.fits(self.target.config.num_hidden_layers, size, dtype, self.device):
            self.cache = StaticKVCache(self.target.config.num_hidden_layers, size, dtype, self.device)
        self.cache.length = 0

    def _scores(self, ids: Tensor, start: Tensor, visible: Tensor, offsets: Tensor, src: Tensor,
                dst: Tensor) -> tuple[Tensor, Tensor]:
        """First the last commit's move (slots `src` to `dst`, (moves,)); then ids (1, n) written at
        the last n of the S slots after `start`, seeing what `visible` (n, S) allows besides the
        committed context, at positions start + offsets (n,)."""
        if src.numel():
            self.cache.move(src, dst)
        positions = start + offsets  # (n,)
        mask = self.cache.prepare(start, visible)  # (1, 1, n, max_len)
        if self.window is not None:  # key positions: committed slot i holds position i, tree slots their node's
            slots = torch.arange(self.cache.max_len, device=self.device)
            rel = slots - start
            tree = (rel >= 0) & (rel < visible.shape[1])
            keys = torch.where(tree, start + offsets[rel.clamp(0, visible.shape[1] - 1)], slots)  # (max_len,)
            mask = for_layers(self.target.config, mask, positions, keys)
        out = target_forward(self.target, ids, self.cache, attention_mask=mask, position_ids=positions[None])
        return out.logits, out.features

    def prefill(self, ids: Tensor, max_len: int) -> TargetOutput:
        self._allocate(max_len)
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        positions = torch.arange(t, device=self.device)
        mask = for_layers(self.target.config, self.cache.prepare(0, causal), positions,
                          torch.arange(self.cache.max_len, device=self.device))  # slot i holds position i
        out = target_forward(self.target, ids.to(self.device), self.cache, attention_mask=mask,
                             position_ids=positions[None], logits_slice=slice(-1, None))
        self.cache.length = t
        self._pending([])
        return out

    def _pending(self, path: list[int]) -> None:
        """Queue the move of the path's KV to the `moves` slots after the committed length:
        node i of `path` from slot length + path[i], the rest of them onto themselves."""
        ids = (path + list(range(len(path), self.moves)))[:self.moves]  # vanilla: nothing (its path is [0])
        self._src = torch.tensor([self.length + i for i in ids], device=self.device)
        self._dst = torch.arange(self.length, self.length + self.moves, device=self.device)

    def flush(self) -> None:
        """Apply the pending move now (the next verification would); for inspecting the cache."""
        if self._src.numel():
            self.cache.move(self._src, self._dst)
        self._pending([])

    def verify(self, tokens: Tensor, parents: tuple[int, ...]) -> TargetOutput:
        n = tokens.shape[1]
        if n > self.width:
            raise ValueError(f"a tree of {n - 1} draft nodes does not fit this static runner's {self.width - 1}")
        tree = Tree.of(parents)
        visible, offsets = self._padded(tree)
        ids = torch.cat([tokens, tokens[:, :1].expand(1, self.width - n)], 1)  # (1, width): padded with the root
        start = torch.tensor(self.length, device=self.device)
        logits, features = self._forward(ids, start, visible, offsets, self._src, self._dst)
        return TargetOutput(logits=logits[:, :n], features=features[:, :n])

    def _padded(self, tree: Tree) -> tuple[Tensor, Tensor]:
        """The tree's visibility (width, width) and depths (width,), padded to this runner's
        width and kept on the device for the next rounds (one tree shape, usually)."""
        if tree.parents not in self._buffers:
            self._buffers[tree.parents] = (tree.ancestors(self.width, self.device),
                                           tree.depth_offsets(self.width, self.device))
        return self._buffers[tree.parents]

    def commit(self, path: list[int]) -> None:
        self._pending(path)
        self.cache.length += len(path)

    def committed_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        self.flush()
        return self.cache.keys[layer][:, :, :self.length], self.cache.values[layer][:, :, :self.length]


def make_runner(kind: str, target: nn.Module, tree_size: int = 0, max_len: int | None = None,
                compile_mode: str | None = None) -> TargetRunner:
    """A target runner of `kind`: "dynamic" (growing cache; `max_len` and `compile_mode` do not
    apply) or "static" (preallocated, fixed shapes padded to `tree_size` draft nodes, compilable)."""
    if kind == "dynamic":
        if compile_mode is not None:
            raise ValueError("compile needs the static runner (runner=static): the dynamic one changes shape every round")
        return DynamicRunner(target)
    if kind == "static":
        return StaticRunner(target, tree_size=tree_size, max_len=max_len, compile_mode=compile_mode)
    raise ValueError(f"unknown runner {kind!r}; choose one of {RUNNERS}")
