"""How the decoding loop runs the target and keeps its KV: two interchangeable runners.

The loop (`eagle.engine`) asks a runner for these, for a batch of sequences (rows; one row
when decoding one sequence):
  prefill(prompts)        the prompts' KV enters the cache; logits of each one's last position
                          and the features of every position come back;
  verify(root + tree)     one forward of every row's root and draft tree on top of its committed
                          cache (tree mask, positions = the row's committed length + depth); the
                          logits and features of every node come back;
  commit(paths)           only each row's accepted path joins its committed cache;
  retire(rows)            the sequences that finished leave (the rest go on).

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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from eagle.decoding.backend import KernelBackend, backend_of
from eagle.decoding.compile import compile_static
from eagle.decoding.kv_cache import (
    cache_length,
    crop,
    keep_path,
    keep_paths,
    new_cache,
    select_rows,
)
from eagle.decoding.masks import for_layers, is_local, padded_causal, tree_attention_mask
from eagle.decoding.static_cache import StaticKVCache
from eagle.target import TargetOutput, check_attention_only, target_forward
from eagle.tree import Tree

RUNNERS = ("dynamic", "static")
STATIC_BUCKET = 256  # a static cache sized per sequence is rounded up to a multiple of this


class ContextOverflowError(ValueError):
    """The request cannot fit in the target's context (said before decoding starts)."""


class TargetRunner:
    """Runs the target for the decoding loop over a batch of B sequences (rows; B = 1 when
    decoding one). `lengths` = tokens in each row's committed cache.

    `backend` is the kernel backend the target runs on (`eagle.decoding.backend`: plain PyTorch
    unless an optional backend switched the target), read from the target when the runner is
    made and again as each decoding call begins (`decoding`)."""

    lengths: list[int]
    tree_size: int = 0  # draft nodes every verification is padded to (0: any size, unpadded)
    backend: KernelBackend

    def __init__(self, target: nn.Module):
        check_attention_only(target)
        self.target = target
        self.device = next(target.parameters()).device
        self.lengths = []
        self.backend = backend_of(target)

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """The scope of one decoding call (the engine's): the target's backend is read anew (a
        switch of kernels since is seen) and told that the weights stay fixed inside."""
        self.backend = backend_of(self.target)
        with self.backend.weights_fixed(self.target):
            yield

    @property
    def length(self) -> int:
        """Committed tokens of the longest row (of the only one, decoding one sequence)."""
        return max(self.lengths, default=0)

    def prefill(
        self, ids: Tensor, max_len: int, lengths: Sequence[int] | None = None
    ) -> TargetOutput:
        """Fill the cache with the prompts ids (B, T), right-padded: row b is its first lengths[b]
        tokens (all T when None), and may reach `max_len` tokens (tree included). Returns logits
        (B, 1, V) of each row's last prompt token and features (B, T, H)."""
        raise NotImplementedError

    def recompute(self, tokens: Sequence[int]) -> None:
        """Fill the cache of a one-sequence decode anew from its tokens, the last one (the next
        round's root, which that round feeds) left out of it: what Hugging Face's `generate` does
        when a longrope target's sequence crosses its switch (`eagle.target.longrope_switch`). The
        forward runs over every token, the root included, so that its longest position is the
        root's and every entry is rotated as a forward from there rotates it."""
        self.prefill(torch.tensor([list(tokens)], device=self.device), self.capacity)
        self._drop_last()

    def _drop_last(self) -> None:
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        """Most tokens (tree included) a sequence of the current batch may reach."""
        raise NotImplementedError

    def verify(self, tokens: Tensor, parents: Sequence[tuple[int, ...]]) -> TargetOutput:
        """Score each row's root + tree, tokens (B, n), on top of its committed cache. Row b's
        tree has parent list `parents[b]` and is its first len(parents[b]) tokens; the rest of
        its n are padding, seen by none of its nodes. Returns logits (B, n, V) and features
        (B, n, H)."""
        raise NotImplementedError

    def commit(self, paths: Sequence[Sequence[int]]) -> None:
        """Keep each row's KV of tree nodes `paths[b]` (increasing indices, root first) after its
        committed prefix; nothing else of the last verification stays visible."""
        raise NotImplementedError

    def retire(self, keep: Sequence[int]) -> None:
        """Only the rows `keep` (increasing indices into the current rows) go on decoding: the
        others finished. Later calls see the remaining rows, in order."""
        raise NotImplementedError

    def committed_kv(self, layer: int, row: int = 0) -> tuple[Tensor, Tensor]:
        """Keys and values (1, H_kv, length, D) of one row's committed tokens in one layer."""
        raise NotImplementedError


def _trees(parents: Sequence[tuple[int, ...]], width: int, device) -> tuple[Tensor, Tensor]:
    """Each row's tree visibility (B, width, width) and depths (B, width), padded to `width`."""
    trees = [Tree.of(p) for p in parents]
    return (
        torch.stack([t.ancestors(width, device) for t in trees]),
        torch.stack([t.depth_offsets(width, device) for t in trees]),
    )


class DynamicRunner(TargetRunner):
    """A Hugging Face `DynamicCache`: the tree's KV is appended, then compacted and cropped.

    In a batch the rows share the cache's slots: a verification appends every row's tree after
    the longest row's context, each row sees only its own committed prefix and tree (the slots
    between a shorter row's end and the tree are stale or padding, hidden by the mask), and its
    accepted path is then moved down next to its own prefix (`keep_paths`)."""

    def __init__(self, target: nn.Module):
        super().__init__(target)
        self.cache = None
        self._capacity = self._prefix = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    def prefill(
        self, ids: Tensor, max_len: int, lengths: Sequence[int] | None = None
    ) -> TargetOutput:
        b, t = ids.shape
        self.lengths = [t] * b if lengths is None else [int(n) for n in lengths]
        self.cache, self._capacity = new_cache(max_len), max_len
        ids = ids.to(self.device)
        if all(n == t for n in self.lengths):  # Hugging Face's own causal mask and positions
            return target_forward(self.target, ids, self.cache, logits_slice=slice(-1, None))
        real = torch.tensor(self.lengths, device=self.device)
        dtype = next(self.target.parameters()).dtype
        mask = tree_attention_mask(0, padded_causal(real, t), dtype)  # (B, 1, t, t)
        positions = torch.arange(t, device=self.device)
        return target_forward(
            self.target,
            ids,
            self.cache,
            attention_mask=for_layers(self.target.config, mask, positions, positions),
            position_ids=positions.expand(b, t),
            logits_slice=real - 1,
        )

    def verify(self, tokens: Tensor, parents: Sequence[tuple[int, ...]]) -> TargetOutput:
        b, n = tokens.shape
        self._prefix = prefix = cache_length(
            self.cache
        )  # the cache grows by the tree until `commit`
        ragged = any(c != prefix for c in self.lengths)
        if not ragged and all(len(p) == n and Tree.of(p).is_chain for p in parents):
            return target_forward(
                self.target, tokens, self.cache
            )  # the causal mask and positions are the trees'
        visible, depths = _trees(parents, n, self.device)  # (B, n, n), (B, n)
        committed = torch.tensor(self.lengths, device=self.device)
        positions = committed[:, None] + depths  # (B, n)
        mask = tree_attention_mask(
            prefix, visible, next(self.target.parameters()).dtype, committed if ragged else None
        )
        keys = torch.cat(
            [torch.arange(prefix, device=self.device).expand(b, prefix), positions], 1
        )  # (B, prefix + n)
        return target_forward(
            self.target,
            tokens,
            self.cache,
            attention_mask=for_layers(self.target.config, mask, positions, keys),
            position_ids=positions,
        )

    def commit(self, paths: Sequence[Sequence[int]]) -> None:
        paths = [list(p) for p in paths]
        if len(paths) == 1 and self.lengths[0] == self._prefix:
            keep_path(self.cache, self._prefix, paths[0], self.backend)
        else:
            keep_paths(self.cache, self._prefix, self.lengths, paths)
        self.lengths = [c + len(p) for c, p in zip(self.lengths, paths)]

    def retire(self, keep: Sequence[int]) -> None:
        if len(keep) == len(self.lengths):
            return
        select_rows(self.cache, list(keep))
        self.lengths = [self.lengths[i] for i in keep]
        crop(self.cache, self.length)

    def _drop_last(self) -> None:
        crop(self.cache, self.lengths[0] - 1)
        self.lengths = [self.lengths[0] - 1]

    def committed_kv(self, layer: int, row: int = 0) -> tuple[Tensor, Tensor]:
        kv = self.cache.layers[layer]
        n = self.lengths[row]
        return kv.keys[row : row + 1, :, :n], kv.values[row : row + 1, :, :n]


class StaticRunner(TargetRunner):
    """A preallocated, position-indexed cache; every verification has the same shapes.

    In a batch each row writes its tree right after its own committed prefix (slots of its
    own), so rows never share slots; a row that finished stays in the buffers, parked: it
    verifies a lone root that nothing reads, so that the shapes (and a compiled graph) stay.

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

    def __init__(
        self,
        target: nn.Module,
        tree_size: int = 0,
        max_len: int | None = None,
        compile_mode: str | None = None,
    ):
        super().__init__(target)
        if max_len is not None and max_len < 1:
            raise ValueError(f"static cache max_len must be positive, got {max_len}")
        self.tree_size = tree_size
        self.width = tree_size + 1  # root + tree, every round
        self.max_len = max_len
        self.cache: StaticKVCache | None = None
        self.local = is_local(
            target.config
        )  # sliding or chunked layers: masks need the keys' positions
        self.compiled = compile_mode is not None
        self._forward = compile_static(self._scores, compile_mode, target)
        # slots moved per commit: the longest path (padded); vanilla decoding never moves anything
        self.moves = self.width if tree_size else 0
        self._src = self._dst = torch.zeros(
            0, dtype=torch.long, device=self.device
        )  # the pending move
        self._buffers: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}
        self._rows: list[int] = []  # the cache row of each sequence still decoding
        self._filled: list[int] = []  # committed tokens of every cache row, parked ones included

    @property
    def lengths(self) -> list[int]:
        return [self._filled[r] for r in self._rows]

    @lengths.setter
    def lengths(self, value: list[int]) -> None:  # set by the base class only, before any prefill
        self._rows, self._filled = list(range(len(value))), list(value)

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else self.cache.max_len

    def _allocate(self, need: int, batch: int) -> None:
        size = self.max_len or -(-need // STATIC_BUCKET) * STATIC_BUCKET
        if (
            self.compiled
            and not self.max_len
            and self.cache is not None
            and self.cache.max_len >= need
        ):
            size = (
                self.cache.max_len
            )  # compiled, each size is one more graph: keep the largest built
        if need > size:
            raise ContextOverflowError(
                f"the request needs {need} cache slots (prompt + new tokens + tree) but "
                f"the static cache holds {size}; raise its max_len (decode.py: static_max_len)"
            )
        dtype = next(self.target.parameters()).dtype
        layers = self.target.config.num_hidden_layers
        if self.cache is None or not self.cache.fits(layers, size, dtype, self.device, batch):
            self.cache = StaticKVCache(layers, size, dtype, self.device, batch)

    def _scores(
        self, ids: Tensor, start: Tensor, visible: Tensor, offsets: Tensor, src: Tensor, dst: Tensor
    ) -> tuple[Tensor, Tensor]:
        """First the last commit's move (slots `src` to `dst`, (moves,) or per row (B, moves));
        then ids (B, n) written at the n slots after `start` (0-d, or per row (B,)), seeing what
        `visible` ((n, n) or (B, n, n)) allows besides the committed context, at positions
        start + offsets ((n,) or (B, n))."""
        if src.numel():
            self.cache.move(src, dst)
        positions = start[..., None] + offsets  # (n,) or (B, n)
        mask = self.cache.prepare(start, visible)  # (B, 1, n, max_len)
        if self.local:  # key positions: committed slot i holds position i, tree slots their node's
            slots = torch.arange(self.cache.max_len, device=self.device)
            first = start.reshape(-1, 1)  # (B, 1)
            rel = slots - first  # (B, max_len)
            width = visible.shape[-1]
            tree = (rel >= 0) & (rel < width)
            depth = (
                offsets.reshape(-1, width)
                .expand(rel.shape[0], width)
                .gather(1, rel.clamp(0, width - 1))
            )
            keys = torch.where(tree, first + depth, slots)  # (B, max_len)
            mask = for_layers(self.target.config, mask, positions, keys)
        out = target_forward(
            self.target,
            ids,
            self.cache,
            attention_mask=mask,
            position_ids=positions if positions.dim() == 2 else positions[None],
        )
        return out.logits, out.features

    def prefill(
        self, ids: Tensor, max_len: int, lengths: Sequence[int] | None = None
    ) -> TargetOutput:
        b, t = ids.shape
        self._allocate(max_len, b)
        self.lengths = [t] * b if lengths is None else [int(n) for n in lengths]
        ragged = any(n != t for n in self.lengths)
        real = torch.tensor(self.lengths, device=self.device)
        visible = (
            padded_causal(real, t)
            if ragged
            else torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        )
        positions = torch.arange(t, device=self.device)
        mask = for_layers(
            self.target.config,
            self.cache.prepare(0, visible),
            positions,
            torch.arange(self.cache.max_len, device=self.device),
        )  # slot i holds position i
        out = target_forward(
            self.target,
            ids.to(self.device),
            self.cache,
            attention_mask=mask,
            position_ids=positions.expand(b, t),
            logits_slice=real - 1 if ragged else slice(-1, None),
        )
        self.cache.length = max(
            self._filled
        )  # what the cache says to a model that asks (get_seq_length)
        self._pending([[]] * b)
        return out

    def _pending(self, paths: Sequence[Sequence[int]]) -> None:
        """Queue the move of each row's path KV to the `moves` slots after its committed length:
        node i of the path from slot length + path[i], the rest of them onto themselves (parked
        rows: all of them). One cache row: (moves,) slots; several: (rows, moves)."""
        path_of = dict(zip(self._rows, paths))
        src, dst = [], []
        for row, c in enumerate(self._filled):
            path = list(path_of.get(row, []))
            ids = (path + list(range(len(path), self.moves)))[
                : self.moves
            ]  # vanilla: nothing (its path is [0])
            src.append([c + i for i in ids])
            dst.append(list(range(c, c + self.moves)))
        shape = (-1,) if len(self._filled) == 1 else (len(self._filled), self.moves)
        self._src = torch.tensor(src, dtype=torch.long, device=self.device).reshape(shape)
        self._dst = torch.tensor(dst, dtype=torch.long, device=self.device).reshape(shape)

    def flush(self) -> None:
        """Apply the pending move now (the next verification would); for inspecting the cache."""
        if self._src.numel():
            self.cache.move(self._src, self._dst)
        self._pending([[]] * len(self._rows))

    def verify(self, tokens: Tensor, parents: Sequence[tuple[int, ...]]) -> TargetOutput:
        b, n = tokens.shape
        parents = [tuple(p) for p in parents]
        if n > self.width:
            raise ValueError(
                f"a tree of {n - 1} draft nodes does not fit this static runner's {self.width - 1}"
            )
        ids = torch.cat(
            [tokens, tokens[:, :1].expand(b, self.width - n)], 1
        )  # (B, width): padded with the root
        if self.cache.batch == 1:  # one sequence: no per-row indices anywhere
            visible, offsets = self._padded(parents[0])
            start = torch.tensor(self._filled[0], device=self.device)
            logits, features = self._forward(ids, start, visible, offsets, self._src, self._dst)
            return TargetOutput(logits=logits[:, :n], features=features[:, :n])
        rows = torch.tensor(self._rows, device=self.device)
        full = torch.zeros(self.cache.batch, self.width, dtype=torch.long, device=self.device)
        full[rows] = ids  # parked rows verify a lone token nothing reads
        trees = dict(zip(self._rows, parents))
        padded = [
            self._padded(trees.get(r, (-1,))) for r in range(self.cache.batch)
        ]  # parked: a lone root
        visible, offsets = torch.stack([v for v, _ in padded]), torch.stack([o for _, o in padded])
        start = torch.tensor(self._filled, device=self.device)
        logits, features = self._forward(full, start, visible, offsets, self._src, self._dst)
        return TargetOutput(logits=logits[rows, :n], features=features[rows, :n])

    def _padded(self, parents: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """A tree's visibility (width, width) and depths (width,), padded to this runner's
        width and kept on the device for the next rounds (one tree shape, usually)."""
        if parents not in self._buffers:
            tree = Tree.of(parents)
            self._buffers[parents] = (
                tree.ancestors(self.width, self.device),
                tree.depth_offsets(self.width, self.device),
            )
        return self._buffers[parents]

    def commit(self, paths: Sequence[Sequence[int]]) -> None:
        self._pending(paths)
        for row, path in zip(self._rows, paths):
            self._filled[row] += len(path)
        self.cache.length = max(self._filled)

    def _drop_last(self) -> None:
        self._filled[0] -= 1  # the root's slot is written again by the next verification
        self.cache.length = self._filled[0]

    def retire(self, keep: Sequence[int]) -> None:
        kept = [self._rows[i] for i in keep]
        for row in set(self._rows) - set(kept):
            # A parked row still verifies a lone root each round (the batch keeps its shape) at
            # its committed length, which may end within a tree's width of the cache's end (its
            # last path was committed whole, then cut to its budget): park it at slot 0, where
            # its writes stay in the cache. Nothing reads a finished row's KV.
            self._filled[row] = 0
        self._rows = kept  # the move queued by the last commit stays: it moves the live rows' paths
        self.cache.length = max(self._filled)

    def committed_kv(self, layer: int, row: int = 0) -> tuple[Tensor, Tensor]:
        self.flush()
        r, n = self._rows[row], self.lengths[row]
        return self.cache.keys[layer][r : r + 1, :, :n], self.cache.values[layer][r : r + 1, :, :n]


def make_runner(
    kind: str,
    target: nn.Module,
    tree_size: int = 0,
    max_len: int | None = None,
    compile_mode: str | None = None,
) -> TargetRunner:
    """A target runner of `kind`: "dynamic" (growing cache; `max_len` and `compile_mode` do not
    apply) or "static" (preallocated, fixed shapes padded to `tree_size` draft nodes, compilable).
    """
    if kind == "dynamic":
        if compile_mode is not None:
            raise ValueError(
                "compile needs the static runner (runner=static): the dynamic one changes shape "
                "every round"
            )
        return DynamicRunner(target)
    if kind == "static":
        return StaticRunner(target, tree_size=tree_size, max_len=max_len, compile_mode=compile_mode)
    raise ValueError(f"unknown runner {kind!r}; choose one of {RUNNERS}")
