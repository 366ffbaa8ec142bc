"""Classic speculative decoding: a small Hugging Face LM sharing the target's tokenizer drafts
a chain (template `chain<gamma>`) or a tree from its top-k, with its own KV cache (growing or
static, `eagle.decoding.draft_cache`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from eagle.decoding.compile import compile_static
from eagle.decoding.draft_cache import DraftCache, RowsDraftCache, draft_cache
from eagle.decoding.engine import DecodeState
from eagle.decoding.masks import padded_causal
from eagle.proposers.template import fit_pass, pad_with_first, pass_slack
from eagle.target import check_attention_only, context_length, lm_head, target_forward


class DraftLM:
    """A causal LM as a `TreeDraftModel` (see `eagle.proposers.template`).

    Its cache holds every committed token, the root included, after `catch_up`.

    Args:
        model: the draft LM (it shares the target's tokenizer).
        cache: "dynamic", "static" (`eagle.decoding.draft_cache`) or a cache.
        compile_mode: compile its passes (`eagle.decoding.compile.compile_static`), as EAGLE's
            drafter's are: on a GPU eager passes are bound by their launches.
        pass_shape: (rows, window) every pass is padded to (`eagle.proposers.eagle.pass_shape`
            of the template), so that one compiled graph serves them all; None: unpadded.
    """

    def __init__(
        self,
        model: nn.Module,
        cache: str | DraftCache = "dynamic",
        compile_mode: str | None = None,
        pass_shape: tuple[int, int] | None = None,
    ):
        check_attention_only(model)
        p = next(model.parameters())
        self.model = model
        self.cache = (
            draft_cache(cache, model.config, p.dtype, p.device) if isinstance(cache, str) else cache
        )
        self._rows: RowsDraftCache | None = None  # a batch drafted in one pass (built on first use)
        self.compile_mode, self.pass_shape = compile_mode, pass_shape
        self._scores_fixed = compile_static(self._scores, compile_mode, model)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context(self) -> int | None:
        """The positions the draft LM reads (a GPT-2's position table ends there)."""
        return context_length(self.model)

    def fork(self) -> DraftLM:
        return DraftLM(self.model, self.cache.fresh(), self.compile_mode, self.pass_shape)

    def reset(self, state: DecodeState) -> None:
        self._check_vocab(state)
        self.cache.begin(state.max_len + pass_slack(self.pass_shape))

    def _check_vocab(self, state: DecodeState) -> None:
        vocab = lm_head(self.model).weight.shape[0]
        if vocab != state.vocab_size:  # its ids would mean other tokens to the target, or none
            raise ValueError(
                f"the draft LM has a vocabulary of {vocab} tokens, the target {state.vocab_size}: "
                "a draft LM must share the target's tokenizer"
            )

    def end_round(self) -> None:
        self.cache.keep(self.cache.length)

    def catch_up(self, state: DecodeState) -> tuple[Tensor, None]:
        start = self.cache.length
        k = len(state.tokens) - start
        device = self.cache.device
        ids = torch.tensor([state.tokens[start:]], device=device)  # (1, k)
        causal = torch.ones(k, k, dtype=torch.bool, device=device).tril()
        positions = torch.arange(start, start + k, device=device)  # (k,): entry i holds token i
        logits = self._pass(ids, start, causal, positions, write_at=start, last_only=True)
        self.cache.keep(start + k)
        return logits[-1], None

    def step(
        self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor, visible: Tensor
    ) -> tuple[Tensor, None]:
        committed, (n, s) = self.cache.length, visible.shape
        # after the earlier steps' nodes
        return self._pass(
            tokens[None], committed, visible, position_ids, write_at=committed + s - n
        ), None

    def _pass(
        self,
        ids: Tensor,
        start: int,
        visible: Tensor,
        positions: Tensor,
        write_at: int,
        last_only: bool = False,
    ) -> Tensor:
        """ids (1, n) written at entries write_at.., at `positions` (n,), seeing the committed
        entries and what `visible` (n, S) allows of the S after `start`; padded to `pass_shape`
        when there is one and the pass fits it (`fit_pass`). Returns logits (n, V), or of the last
        row only (1, V) with `last_only` unpadded."""
        n, device = visible.shape[0], self.cache.device
        padded = fit_pass(self.cache, self.pass_shape, visible, start, write_at)
        if padded is None:
            return self._scores(ids, start, visible, positions, write_at, last_only)
        rows = padded.shape[0]
        # 0-d tensors: one compiled graph serves every committed length
        return self._scores_fixed(
            pad_with_first(ids, rows, 1),
            torch.tensor(start, device=device),
            padded,
            pad_with_first(positions, rows, 0),
            torch.tensor(write_at, device=device),
        )[:n]

    def _scores(
        self,
        ids: Tensor,
        start: int | Tensor,
        visible: Tensor,
        positions: Tensor,
        write_at: int | Tensor,
        last_only: bool = False,
    ) -> Tensor:
        mask = self.cache.prepare(start, visible, write_at, positions)
        out = target_forward(
            self.model,
            ids,
            self.cache.hf,
            attention_mask=mask,
            position_ids=positions[None],
            logits_slice=slice(-1, None) if last_only else None,
        )
        return out.logits[0]

    # Several sequences in one pass (`eagle.proposers.template.RowsDraftModel`): their own rows of
    # one cache, each catch-up padded to the longest one.

    @property
    def batches_rows(self) -> bool:  # compiled passes keep to one sequence, as EAGLE's
        return self.compile_mode is None

    def begin_rows(self, states: Sequence[DecodeState]) -> None:
        self._check_vocab(states[0])
        if self._rows is None:
            self._rows = RowsDraftCache(self.model.config, self.dtype, self.cache.device)
        self._rows.begin(max(s.max_len for s in states), len(states))

    def catch_up_rows(self, states: Sequence[DecodeState]) -> tuple[Tensor, None]:
        """`catch_up` for every sequence at once: the root's logits (B, V)."""
        rows, device = self._rows, self.cache.device
        ks = [
            len(s.tokens) - have for s, have in zip(states, rows.lengths)
        ]  # new tokens per sequence
        k = max(ks)
        ids = torch.tensor(
            [
                s.tokens[have:] + [s.tokens[-1]] * (k - n)
                for s, have, n in zip(states, rows.lengths, ks)
            ],
            device=device,
        )  # (B, k), padded
        positions = torch.tensor(rows.lengths, device=device)[:, None] + torch.arange(
            k, device=device
        )  # (B, k)
        real = torch.tensor(ks, device=device)
        mask = rows.prepare(padded_causal(real, k), 0, positions)
        out = target_forward(
            self.model,
            ids,
            rows.hf,
            attention_mask=mask,
            position_ids=positions,
            logits_slice=real - 1,
        )
        rows.advance(ks)
        return out.logits[:, 0], None

    def step_rows(
        self, tokens: Tensor, parent_hidden: Tensor | None, positions: Tensor, visible: Tensor
    ) -> tuple[Tensor, None]:
        """`step` for every sequence at once: tokens (B, n) at positions (B, n). Returns (B, n, V).
        """
        n, s = visible.shape
        mask = self._rows.prepare(visible, s - n, positions)  # after the earlier depths' nodes
        return target_forward(
            self.model, tokens, self._rows.hf, attention_mask=mask, position_ids=positions
        ).logits, None

    def end_round_rows(self, keep: Sequence[int]) -> None:
        self._rows.keep_rows(
            keep
        )  # each row's branch entries are past its committed length: hidden
