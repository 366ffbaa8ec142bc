"""EAGLE-1 drafting: an `EagleDrafter` as a `TreeDraftModel` filling a fixed tree template.

The drafter keeps its own KV cache over the committed context. Entry i holds token x_i
(i >= 1) paired with the feature of the position before it, `[f_{i-1}; E(x_i)]`, at
position i; token x_0 has no previous feature and gets no entry, so after each round the
cache holds len(tokens) - 1 entries. (EAGLE's code puts x_1 at position 0; RoPE only sees
relative positions, so the outputs are the same.)

Per round (see `eagle.proposers.template`): `catch_up` feeds the tokens committed since the
last round with the target's TRUE features (one drafter pass), then one `step` pass per
tree depth, where each node is fed its PARENT's predicted feature f_hat. The branch KV of
those passes is dropped after verification (`rollback`). With EAGLE-1's default tree that
is 5 drafter passes per round: catch-up + depths 1-4 (depth-5 nodes are leaves).

With `static=True` the same passes run on a preallocated, position-indexed cache
(`eagle.static_cache`): entry i sits in slot i - 1, a round's catch-up is padded to depth + 1
tokens, and `rollback` only lowers the committed length (the branch KV stays, hidden by the
mask, until the next round overwrites it). Each pass then has the same shapes every round,
so it can be compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eagle.drafter import EagleDrafter
from eagle.engine import DecodeState
from eagle.kv_cache import cache_length, crop, tree_attention_mask
from eagle.proposers.template import TemplateProposer
from eagle.static_cache import StaticKVCache, compile_static
from eagle.tree import TreeTemplate


class EagleDraftModel:
    """An `EagleDrafter` as a `TreeDraftModel` (see `eagle.proposers.template`).

    Args:
        drafter: the trained drafter.
        static: keep the drafter's KV in a preallocated, position-indexed `StaticKVCache`
            (sized like the target's for each sequence) instead of a growing `DynamicCache`.
        compile_mode: with `static`, compile the drafter pass (`eagle.static_cache.compile_static`).
        pass_shape: (rows, window) every compiled pass is padded to: the most tokens one pass
            feeds (catch-up: depth + 1; a depth's expanded nodes) and the most branch entries
            it sees. One graph then serves the catch-up and every depth; a longer pass (the
            prompt's catch-up) runs eagerly.
    """

    def __init__(self, drafter: EagleDrafter, static: bool = False, compile_mode: str | None = None,
                 pass_shape: tuple[int, int] | None = None):
        if compile_mode is not None and (not static or pass_shape is None):
            raise ValueError("compiling the drafter needs its static cache and a pass_shape")
        self.drafter, self.static, self.pass_shape = drafter, static, pass_shape
        self.cache = None
        self._scores_fixed = compile_static(self._scores, compile_mode)

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.dtype

    def cache_len(self) -> int:
        if self.static:
            return 0 if self.cache is None else self.cache.length
        return cache_length(self.cache)

    def reset(self) -> None:
        if not self.static:
            self.cache = self.drafter.new_cache()
        elif self.cache is not None:
            self.cache.length = 0  # buffers are kept for the next sequence; stale slots stay hidden

    def rollback(self, length: int) -> None:
        if self.static:
            self.cache.length = length  # the branch KV stays in its slots, hidden, until overwritten
        else:
            crop(self.cache, length)

    def catch_up(self, state: DecodeState) -> tuple[Tensor, Tensor]:
        """Feed the newly committed tokens with the target's features of the positions before them.

        Returns:
            the root's draft logits (V,) and its predicted feature f_hat (H,).
        """
        if self.cache is None or (self.static and not self.cache.fits(1, state.max_len, self.dtype,
                                                                       self.drafter.device)):
            self._new_cache(state.max_len)
        features = state.new_features  # (1, k, H): feature j pairs with tokens[-k + j]
        k = features.shape[1]
        start = len(state.tokens) - k  # index (= position) of the first new token
        have = self.cache_len()
        if k == 0 or start < 1 or have != start - 1:
            raise RuntimeError(
                f"EAGLE drafter cache out of step: it holds {have} entries, but {k} new features for "
                f"{len(state.tokens)} tokens need {start - 1} (was reset() called for this sequence?)")
        device = self.drafter.device
        ids = torch.tensor([state.tokens[start:]], device=device)  # (1, k)
        pos = torch.arange(start, len(state.tokens), device=device)  # (k,)
        if not self.static:
            hidden = self.drafter(features, ids, position_ids=pos[None], cache=self.cache)  # (1, k, H)
            last = hidden[0, -1]  # (H,) f_hat of the root
            return self.drafter.logits(last), last
        causal = torch.ones(k, k, dtype=torch.bool, device=device).tril()
        hidden, logits = self._pass(features, ids, have, causal, pos, write_at=have)
        self.cache.length = have + k
        return logits[-1], hidden[-1]

    def step(self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor,
             visible: Tensor) -> tuple[Tensor, Tensor]:
        """Score n tree nodes (n,), each fed its parent's predicted feature (n, H).

        Returns:
            logits (n, V) and predicted features (n, H); the nodes' KV stays in the cache
            until `rollback`.
        """
        if parent_hidden is None:
            raise ValueError("the EAGLE drafter needs its parents' predicted features")
        committed, (n, s) = self.cache_len(), visible.shape
        if self.static:  # earlier steps' nodes sit in the s - n slots after the committed entries
            hidden, logits = self._pass(parent_hidden[None], tokens[None], committed, visible, position_ids,
                                        write_at=committed + s - n)
            return logits, hidden
        mask = tree_attention_mask(committed - (s - n), visible, self.dtype)
        hidden = self.drafter(parent_hidden[None], tokens[None], position_ids=position_ids[None],
                              attention_mask=mask, cache=self.cache)  # (1, n, H)
        return self.drafter.logits(hidden[0]), hidden[0]

    def _new_cache(self, max_len: int) -> None:
        if not self.static:
            self.cache = self.drafter.new_cache()
            return
        if max_len < 1:
            raise ValueError("the static drafter cache needs the sequence's max_len (DecodeState.max_len)")
        self.cache = StaticKVCache.for_config(self.drafter.llama_config, max_len, self.dtype, self.drafter.device)

    def _pass(self, features: Tensor, ids: Tensor, start: int, visible: Tensor, positions: Tensor,
              write_at: int) -> tuple[Tensor, Tensor]:
        """A static-cache pass (see `_scores`), padded to `pass_shape` when it has one and the
        pass fits in it (padding rows see nothing of the branch and write past this pass's slots,
        where later passes overwrite them). Returns f_hat (n, H) and logits (n, V)."""
        (n, s), device = visible.shape, self.drafter.device
        rows, window = self.pass_shape or (0, 0)
        if n > rows or s > window:  # no fixed shape (not compiled), or a long prompt's catch-up
            self._check_room(write_at + n)
            return self._scores(features, ids, torch.tensor(start, device=device), visible, positions,
                                torch.tensor(write_at, device=device))
        self._check_room(max(write_at + rows, start + window))
        pad = rows - n
        features = torch.cat([features, features.new_zeros(1, pad, features.shape[-1])], 1)  # (1, rows, H)
        ids = torch.cat([ids, ids[:, :1].expand(1, pad)], 1)  # (1, rows)
        positions = torch.cat([positions, positions[:1].expand(pad)])  # (rows,)
        padded = torch.zeros(rows, window, dtype=torch.bool, device=device)
        padded[:n, :s] = visible
        hidden, logits = self._scores_fixed(features, ids, torch.tensor(start, device=device), padded, positions,
                                            torch.tensor(write_at, device=device))
        return hidden[:n], logits[:n]

    def _check_room(self, need: int) -> None:
        if need > self.cache.max_len:
            raise RuntimeError(f"the static drafter cache ({self.cache.max_len} slots) cannot hold {need} entries; "
                               "size it for prompt + new tokens + tree (DecodeState.max_len)")

    def _scores(self, features: Tensor, ids: Tensor, start: Tensor, visible: Tensor, positions: Tensor,
                write_at: Tensor) -> tuple[Tensor, Tensor]:
        """One static-cache drafter pass: features (1, n, H) and ids (1, n) written at slots
        write_at..write_at+n-1, at `positions` (n,), each seeing the committed entries (slots
        before `start`) and what `visible` (n, S) allows of the S slots from `start`.
        Returns f_hat (n, H) and logits (n, V)."""
        mask = self.cache.prepare(start, visible, write_at)  # (1, 1, n, max_len)
        hidden = self.drafter(features, ids, position_ids=positions[None], attention_mask=mask, cache=self.cache)
        return hidden[0], self.drafter.logits(hidden[0])


def pass_shape(template: TreeTemplate) -> tuple[int, int]:
    """(rows, window) that fit every drafter pass of a round on `template`: the catch-up feeds up
    to depth + 1 tokens; depth d feeds its expanded nodes and sees all expanded nodes so far."""
    expanded = [i for i in range(1, template.num_nodes + 1) if template.children[i]]
    per_depth = [sum(template.depths[i] == d for i in expanded) for d in range(1, template.depth + 1)]
    return max([template.depth + 1, *per_depth]), max(template.depth + 1, len(expanded))


def eagle_proposer(drafter: EagleDrafter, template: TreeTemplate, proposal: str = "sample", static: bool = False,
                   compile_mode: str | None = None) -> TemplateProposer:
    """EAGLE-1: the drafter fills `template` (top-k per expanded node, or draws under sampling
    with `proposal="sample"`); verification by `eagle.engine.SpeculativeDecoder` keeps it exact.
    `static` / `compile_mode`: see `EagleDraftModel` (compiled passes share one padded shape)."""
    shape = pass_shape(template) if compile_mode is not None else None
    model = EagleDraftModel(drafter, static=static, compile_mode=compile_mode, pass_shape=shape)
    return TemplateProposer(model, template, proposal=proposal, name="eagle")
