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
"""

from __future__ import annotations

import torch
from torch import Tensor

from eagle.drafter import EagleDrafter
from eagle.engine import DecodeState
from eagle.kv_cache import cache_length, crop
from eagle.proposers.template import TemplateProposer
from eagle.tree import TreeTemplate


class EagleDraftModel:
    """An `EagleDrafter` as a `TreeDraftModel` (see `eagle.proposers.template`)."""

    def __init__(self, drafter: EagleDrafter):
        self.drafter = drafter
        self.cache = None

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.dtype

    def cache_len(self) -> int:
        return cache_length(self.cache)

    def reset(self) -> None:
        self.cache = self.drafter.new_cache()

    def rollback(self, length: int) -> None:
        crop(self.cache, length)

    def catch_up(self, state: DecodeState) -> tuple[Tensor, Tensor]:
        """Feed the newly committed tokens with the target's features of the positions before them.

        Returns:
            the root's draft logits (V,) and its predicted feature f_hat (H,).
        """
        if self.cache is None:
            self.reset()
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
        pos = torch.arange(start, len(state.tokens), device=device)[None]  # (1, k)
        hidden = self.drafter(features, ids, position_ids=pos, cache=self.cache)  # (1, k, H)
        last = hidden[0, -1]  # (H,) f_hat of the root
        return self.drafter.logits(last), last

    def step(self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor,
             attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Score n tree nodes (n,), each fed its parent's predicted feature (n, H).

        Returns:
            logits (n, V) and predicted features (n, H); the nodes' KV stays in the cache
            until `rollback`.
        """
        if parent_hidden is None:
            raise ValueError("the EAGLE drafter needs its parents' predicted features")
        hidden = self.drafter(parent_hidden[None], tokens[None], position_ids=position_ids[None],
                              attention_mask=attention_mask, cache=self.cache)  # (1, n, H)
        return self.drafter.logits(hidden[0]), hidden[0]


def eagle_proposer(drafter: EagleDrafter, template: TreeTemplate, proposal: str = "sample") -> TemplateProposer:
    """EAGLE-1: the drafter fills `template` (top-k per expanded node, or draws under sampling
    with `proposal="sample"`); verification by `eagle.engine.SpeculativeDecoder` keeps it exact."""
    return TemplateProposer(EagleDraftModel(drafter), template, proposal=proposal, name="eagle")
