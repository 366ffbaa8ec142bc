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
            (sized like the target's for each sequence) instead of a growing `DynamicCache`;
            every catch-up after the first is padded to `catch_up_width` tokens, so each
            drafter pass of a round has the same shapes every round.
        catch_up_width: the most tokens a round can commit (the tree's depth + 1).
        compile_mode: with `static`, compile the drafter pass (`eagle.static_cache.compile_static`).
    """

    def __init__(self, drafter: EagleDrafter, static: bool = False, catch_up_width: int = 1,
                 compile_mode: str | None = None):
        if compile_mode is not None and not static:
            raise ValueError("compiling the drafter needs its static cache (static=True)")
        self.drafter, self.static, self.catch_up_width = drafter, static, catch_up_width
        self.cache = None
        self._causal = torch.ones(catch_up_width, catch_up_width, dtype=torch.bool, device=drafter.device).tril()
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
        if not self.static:
            pos = torch.arange(start, len(state.tokens), device=device)[None]  # (1, k)
            hidden = self.drafter(features, ids, position_ids=pos, cache=self.cache)  # (1, k, H)
            last = hidden[0, -1]  # (H,) f_hat of the root
            return self.drafter.logits(last), last
        width = max(k, self.catch_up_width)  # the prompt's catch-up is longer: it runs once, unpadded
        self._check_room(have + width)
        if width > k:  # pad to a fixed width; the padding's KV lands where this round's branch will be written
            features = torch.cat([features, features.new_zeros(1, width - k, features.shape[-1])], 1)
            ids = torch.cat([ids, ids[:, -1:].expand(1, width - k)], 1)
        causal = self._causal if width == self.catch_up_width else torch.ones(
            width, width, dtype=torch.bool, device=device).tril()
        pos = torch.arange(start, start + width, device=device)  # (width,)
        scores = self._scores_fixed if width == self.catch_up_width else self._scores
        hidden, logits = scores(features, ids, torch.tensor(have, device=device), causal, pos)
        self.cache.length = have + k
        return logits[k - 1], hidden[k - 1]

    def step(self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor,
             visible: Tensor) -> tuple[Tensor, Tensor]:
        """Score n tree nodes (n,), each fed its parent's predicted feature (n, H).

        Returns:
            logits (n, V) and predicted features (n, H); the nodes' KV stays in the cache
            until `rollback`.
        """
        if parent_hidden is None:
            raise ValueError("the EAGLE drafter needs its parents' predicted features")
        committed = self.cache_len()
        if self.static:
            self._check_room(committed + visible.shape[1])
            hidden, logits = self._scores_fixed(parent_hidden[None], tokens[None],
                                                torch.tensor(committed, device=tokens.device), visible, position_ids)
            return logits, hidden
        committed -= visible.shape[1] - len(tokens)  # earlier steps' nodes sit after the committed entries
        mask = tree_attention_mask(committed, visible, self.dtype)
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

    def _check_room(self, need: int) -> None:
        if need > self.cache.max_len:
            raise RuntimeError(f"the static drafter cache ({self.cache.max_len} slots) cannot hold {need} entries; "
                               "size it for prompt + new tokens + tree (DecodeState.max_len)")

    def _scores(self, features: Tensor, ids: Tensor, start: Tensor, visible: Tensor,
                positions: Tensor) -> tuple[Tensor, Tensor]:
        """One static-cache drafter pass: features (1, n, H) and ids (1, n) written at the last n
        of the S slots after `start`, seeing the committed entries and what `visible` (n, S)
        allows, at `positions` (n,). Returns f_hat (n, H) and logits (n, V)."""
        mask = self.cache.prepare(start, visible)  # (1, 1, n, max_len)
        hidden = self.drafter(features, ids, position_ids=positions[None], attention_mask=mask, cache=self.cache)
        return hidden[0], self.drafter.logits(hidden[0])


def eagle_proposer(drafter: EagleDrafter, template: TreeTemplate, proposal: str = "topk", static: bool = False,
                   compile_mode: str | None = None) -> TemplateProposer:
    """EAGLE-1: the drafter fills `template` (top-k per expanded node, or draws under sampling
    with `proposal="sample"`); verification by `eagle.engine.SpeculativeDecoder` keeps it exact.
    `static` / `compile_mode`: see `EagleDraftModel`."""
    model = EagleDraftModel(drafter, static=static, catch_up_width=template.depth + 1, compile_mode=compile_mode)
    return TemplateProposer(model, template, proposal=proposal, name="eagle")
