"""EAGLE-1 drafting: an `EagleDrafter` as a `TreeDraftModel` filling a fixed tree template.

The drafter keeps its own KV cache over the committed context. Entry i holds token x_i
(i >= 1) paired with the feature of the position before it, `[f_{i-1}; E(x_i)]`, at
position i; token x_0 has no previous feature and gets no entry, so after each round the
cache holds len(tokens) - 1 entries. (EAGLE's code puts x_1 at position 0; RoPE only sees
relative positions, so the outputs are the same.)

Per round (see `eagle.proposers.template`): `catch_up` feeds the tokens committed since the
last round with the target's TRUE features (one drafter pass), then one `step` pass per
tree depth, where each node is fed its PARENT's predicted feature f_hat. The branch KV of
those passes is dropped after verification (`end_round`). With EAGLE-1's default tree that
is 5 drafter passes per round: catch-up + depths 1-4 (depth-5 nodes are leaves).

A drafter of other inputs (`DrafterConfig.inputs`, for EAGLE-1's ablation) drafts the same
way: an unshifted one reads each entry's previous token instead of its own (the token before
a catch-up token, a node's parent's token), a token-only one ignores the features.

The cache is an `eagle.decoding.draft_cache.DraftCache`: a growing one, or a static one in
which every pass can be padded to one fixed shape (`pass_shape`) and compiled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from eagle.decoding.compile import compile_static
from eagle.decoding.draft_cache import DraftCache, RowsDraftCache, draft_cache
from eagle.decoding.engine import DecodeState
from eagle.decoding.masks import padded_causal
from eagle.models.drafter import EagleDrafter
from eagle.proposers.template import TemplateProposer, fit_pass, pad_with_first, pass_slack
from eagle.tree import TreeTemplate


class EagleDraftModel:
    """An `EagleDrafter` as a `TreeDraftModel` (see `eagle.proposers.template`).

    Args:
        drafter: the trained drafter.
        cache: its KV cache (`eagle.decoding.draft_cache`).
        compile_mode: compile the drafter pass (`eagle.decoding.compile.compile_static`); needs
            a fixed-shape cache and a `pass_shape`.
        pass_shape: (rows, window) every fixed-shape pass is padded to: the most tokens one
            pass feeds (catch-up: depth + 1; a depth's expanded nodes) and the most branch
            entries it sees. One graph then serves the catch-up and every depth; a longer pass
            (the prompt's catch-up) runs eagerly.
    """

    def __init__(self, drafter: EagleDrafter, cache: DraftCache, compile_mode: str | None = None,
                 pass_shape: tuple[int, int] | None = None):
        if (compile_mode is not None or pass_shape is not None) and not (
            cache.fixed_shape and pass_shape
        ):
            raise ValueError("compiling the drafter needs a static cache and a pass_shape")
        # drafting is inference: a drafter left in training mode (as built or loaded) would run its
        # decoder layer on PyTorch's operations instead of the fused kernels, and draw any dropout
        drafter.eval()
        self.drafter, self.cache, self.pass_shape, self.compile_mode = (
            drafter,
            cache,
            pass_shape,
            compile_mode,
        )
        self._rows: RowsDraftCache | None = None  # a batch drafted in one pass (built on first use)
        self.needs_parent_tokens = drafter.needs_prev_ids  # TemplateProposer passes them to `step`
        self._scores_fixed = compile_static(self._scores, compile_mode, drafter)

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.dtype

    @property
    def draft_vocab(self) -> Tensor | None:
        """The token ids of the logits' columns when drafting from a reduced vocabulary."""
        return self.drafter.draft_vocab

    @property
    def vocab_size(self) -> int:
        return self.drafter.config.vocab_size

    def reset(self, state: DecodeState) -> None:
        self.cache.begin(state.max_len + pass_slack(self.pass_shape))

    def fork(self) -> EagleDraftModel:
        return EagleDraftModel(self.drafter, self.cache.fresh(), self.compile_mode, self.pass_shape)

    # Several sequences in one drafter pass (`eagle.proposers.template.RowsDraftModel`): their own
    # rows of one cache, each catch-up padded to the longest one. Compiled passes keep to one
    # sequence.

    @property
    def batches_rows(self) -> bool:
        return self.compile_mode is None

    def begin_rows(self, states: Sequence[DecodeState]) -> None:
        if self._rows is None:
            cfg = self.drafter.config
            self._rows = RowsDraftCache(
                self.drafter.llama_config,
                self.drafter.dtype,
                self.drafter.device,
                kv_shape=(cfg.num_key_value_heads, cfg.head_dim),
            )
        self._rows.begin(max(s.max_len for s in states), len(states))

    def catch_up_rows(self, states: Sequence[DecodeState]) -> tuple[Tensor, Tensor]:
        """`catch_up` for every sequence at once: the root's logits (B, V) and f_hat (B, H)."""
        rows, device = self._rows, self.drafter.device
        ks = [s.new_features.shape[1] for s in states]  # new tokens per sequence
        k = max(ks)
        starts = [len(s.tokens) - n for s, n in zip(states, ks)]
        if any(
            n == 0 or start < 1 or have != start - 1
            for n, start, have in zip(ks, starts, rows.lengths)
        ):
            raise RuntimeError(
                f"EAGLE drafter rows out of step: they hold {rows.lengths} entries for sequences "
                "of "
                f"{[len(s.tokens) for s in states]} tokens with {ks} new features (was reset_batch "
                "called?)"
            )
        features = torch.cat(
            [
                torch.nn.functional.pad(s.new_features.to(device), (0, 0, 0, k - n))
                for s, n in zip(states, ks)
            ]
        )  # (B, k, H), zero-padded
        ids = torch.tensor(
            [
                s.tokens[start - 1 :] + [s.tokens[-1]] * (k - n)
                for s, start, n in zip(states, starts, ks)
            ],
            device=device,
        )  # (B, k + 1) x_{start-1}..
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(
            k, device=device
        )  # (B, k)
        visible = padded_causal(torch.tensor(ks, device=device), k)  # (B, k, k)
        mask = rows.prepare(visible, 0, positions)
        hidden = self.drafter(
            features,
            ids[:, 1:],
            position_ids=positions,
            attention_mask=mask,
            cache=rows.hf,
            prev_ids=ids[:, :-1],
        )  # (B, k, H)
        rows.advance(ks)
        root = hidden[
            torch.arange(len(ks), device=device), torch.tensor(ks, device=device) - 1
        ]  # (B, H)
        return self.drafter.logits(root), root

    def step_rows(
        self,
        tokens: Tensor,
        parent_hidden: Tensor,
        positions: Tensor,
        visible: Tensor,
        parent_tokens: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`step` for every sequence at once: tokens (B, n), parent features (B, n, H), positions
        (B, n); the same template (`visible` (n, S)) in every row. Returns (B, n, V), (B, n, H)."""
        n, s = visible.shape
        mask = self._rows.prepare(visible, s - n, positions)  # after the earlier depths' nodes
        hidden = self.drafter(
            parent_hidden,
            tokens,
            position_ids=positions,
            attention_mask=mask,
            cache=self._rows.hf,
            prev_ids=parent_tokens,
        )
        return self.drafter.logits(hidden), hidden

    def end_round_rows(self, keep: Sequence[int]) -> None:
        self._rows.keep_rows(
            keep
        )  # each row's branch entries are past its committed length: hidden

    def end_round(self) -> None:
        self.cache.keep(self.cache.length)  # the branch KV goes; the committed context stays

    def catch_up(self, state: DecodeState) -> tuple[Tensor, Tensor]:
        """Feed the newly committed tokens with the target's features of the positions before them.

        Returns:
            the root's draft logits (V,) and its predicted feature f_hat (H,).
        """
        features = state.new_features  # (1, k, H): feature j pairs with tokens[-k + j]
        k = features.shape[1]
        start = len(state.tokens) - k  # index (= position) of the first new token
        have = self.cache.length
        if k == 0 or start < 1 or have != start - 1:
            raise RuntimeError(
                f"EAGLE drafter cache out of step: it holds {have} entries, but {k} new features "
                "for "
                f"{len(state.tokens)} tokens need {start - 1} (was reset() called for this "
                "sequence?)"
            )
        device = self.drafter.device
        ids = torch.tensor([state.tokens[start - 1 :]], device=device)  # (1, k + 1) x_{start-1}..
        pos = torch.arange(start, len(state.tokens), device=device)  # (k,)
        causal = torch.ones(k, k, dtype=torch.bool, device=device).tril()
        hidden = self._pass(
            features, ids[:, 1:], have, causal, pos, write_at=have, prev_ids=ids[:, :-1]
        )
        self.cache.keep(have + k)
        return self.drafter.logits(hidden[-1]), hidden[-1]  # the LM head on the root's row only

    def step(
        self,
        tokens: Tensor,
        parent_hidden: Tensor | None,
        position_ids: Tensor,
        visible: Tensor,
        parent_tokens: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Score n tree nodes (n,), each fed its parent's predicted feature (n, H) (and, for an
        unshifted-input drafter, its parent's token (n,)).

        Returns:
            logits (n, V) and predicted features (n, H); the nodes' KV stays in the cache
            until `end_round`.
        """
        if parent_hidden is None:
            raise ValueError("the EAGLE drafter needs its parents' predicted features")
        committed, (n, s) = self.cache.length, visible.shape
        # earlier steps' nodes sit in the s - n entries after the committed ones
        hidden = self._pass(
            parent_hidden[None],
            tokens[None],
            committed,
            visible,
            position_ids,
            write_at=committed + s - n,
            prev_ids=None if parent_tokens is None else parent_tokens[None],
        )
        return self.drafter.logits(hidden), hidden

    def _pass(
        self,
        features: Tensor,
        ids: Tensor,
        start: int,
        visible: Tensor,
        positions: Tensor,
        write_at: int,
        prev_ids: Tensor | None = None,
    ) -> Tensor:
        """One drafter pass (see `_scores`), padded to `pass_shape` when there is one and the pass
        fits in it (padding rows see nothing of the branch and write past this pass's entries,
        where later passes overwrite them). Returns f_hat (n, H); the callers apply the LM head
        to the rows they need (the catch-up: only the root's)."""
        n, device = visible.shape[0], self.drafter.device
        padded = fit_pass(self.cache, self.pass_shape, visible, start, write_at)
        if padded is None:
            return self._scores(features, ids, start, visible, positions, write_at, prev_ids)
        rows = padded.shape[0]
        features = torch.cat(
            [features, features.new_zeros(1, rows - n, features.shape[-1])], 1
        )  # (1, rows, H)
        ids = pad_with_first(ids, rows, 1)  # (1, rows)
        if prev_ids is not None:
            prev_ids = pad_with_first(prev_ids, rows, 1)  # (1, rows)
        positions = pad_with_first(positions, rows, 0)  # (rows,)
        # 0-d tensors: one compiled graph serves every committed length
        hidden = self._scores_fixed(
            features,
            ids,
            torch.tensor(start, device=device),
            padded,
            positions,
            torch.tensor(write_at, device=device),
            prev_ids,
        )
        return hidden[:n]

    def _scores(
        self,
        features: Tensor,
        ids: Tensor,
        start: int | Tensor,
        visible: Tensor,
        positions: Tensor,
        write_at: int | Tensor,
        prev_ids: Tensor | None = None,
    ) -> Tensor:
        """features (1, n, H) and ids (1, n) written at entries write_at..write_at+n-1, at
        `positions` (n,), each seeing the committed entries (before `start`) and what `visible`
        (n, S) allows of the S entries from `start`. Returns f_hat (n, H)."""
        mask = self.cache.prepare(start, visible, write_at, positions)  # (1, 1, n, width)
        return self.drafter(
            features,
            ids,
            position_ids=positions[None],
            attention_mask=mask,
            cache=self.cache.hf,
            prev_ids=prev_ids,
        )[0]


def pass_shape(template: TreeTemplate) -> tuple[int, int]:
    """(rows, window) that fit every drafter pass of a round on `template`: the catch-up feeds up
    to depth + 1 tokens; depth d feeds its expanded nodes and sees all expanded nodes so far."""
    expanded = [i for i in range(1, template.num_nodes + 1) if template.children[i]]
    per_depth = [
        sum(template.depths[i] == d for i in expanded) for d in range(1, template.depth + 1)
    ]
    return max([template.depth + 1, *per_depth]), max(template.depth + 1, len(expanded))


def eagle_proposer(
    drafter: EagleDrafter,
    template: TreeTemplate,
    proposal: str = "sample",
    cache: str = "dynamic",
    compile_mode: str | None = None,
) -> TemplateProposer:
    """EAGLE-1: the drafter fills `template` (top-k per expanded node, or draws under sampling
    with `proposal="sample"`); verification by `eagle.decoding.engine.SpeculativeDecoder` keeps
    it exact. `cache`: "dynamic" or "static" (`eagle.decoding.draft_cache`); `compile_mode`
    compiles the static passes, all padded to one shape."""
    cfg = drafter.config
    kv = draft_cache(
        cache,
        drafter.llama_config,
        drafter.dtype,
        drafter.device,
        kv_shape=(cfg.num_key_value_heads, cfg.head_dim),
    )
    shape = pass_shape(template) if compile_mode is not None else None
    return TemplateProposer(
        EagleDraftModel(drafter, kv, compile_mode, shape), template, proposal=proposal, name="eagle"
    )
