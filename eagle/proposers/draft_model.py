"""Classic speculative decoding: a small Hugging Face LM sharing the target's tokenizer drafts
a chain (template `chain<gamma>`) or a tree from its top-k, with its own KV cache (growing or
static, `eagle.decoding.draft_cache`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from eagle.decoding.draft_cache import DraftCache, draft_cache
from eagle.decoding.engine import DecodeState
from eagle.target import lm_head, target_forward


class DraftLM:
    """A causal LM as a `TreeDraftModel` (see `eagle.proposers.template`).

    Its cache holds every committed token, the root included, after `catch_up`.
    """

    def __init__(self, model: nn.Module, cache: str | DraftCache = "dynamic"):
        p = next(model.parameters())
        self.model = model
        self.cache = draft_cache(cache, model.config, p.dtype, p.device) if isinstance(cache, str) else cache

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def fork(self) -> DraftLM:
        return DraftLM(self.model, self.cache.fresh())

    def reset(self, state: DecodeState) -> None:
        vocab = lm_head(self.model).weight.shape[0]
        if vocab != state.vocab_size:  # its ids would mean other tokens to the target, or none
            raise ValueError(f"the draft LM has a vocabulary of {vocab} tokens, the target {state.vocab_size}: "
                             "a draft LM must share the target's tokenizer")
        self.cache.begin(state.max_len)

    def end_round(self) -> None:
        self.cache.keep(self.cache.length)

    def catch_up(self, state: DecodeState) -> tuple[Tensor, None]:
        start = self.cache.length
        k = len(state.tokens) - start
        device = self.cache.device
        ids = torch.tensor([state.tokens[start:]], device=device)  # (1, k)
        causal = torch.ones(k, k, dtype=torch.bool, device=device).tril()
        positions = torch.arange(start, start + k, device=device)  # (k,): entry i holds token i
        self.cache.reserve(start + k)
        mask = self.cache.prepare(start, causal, start, positions)
        out = target_forward(self.model, ids, self.cache.hf, attention_mask=mask, position_ids=positions[None],
                             logits_slice=slice(-1, None))
        self.cache.keep(start + k)
        return out.logits[0, -1], None

    def step(self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor,
             visible: Tensor) -> tuple[Tensor, None]:
        committed, (n, s) = self.cache.length, visible.shape
        self.cache.reserve(committed + s)
        mask = self.cache.prepare(committed, visible, committed + s - n, position_ids)  # after earlier steps' nodes
        out = target_forward(self.model, tokens[None], self.cache.hf, attention_mask=mask,
                             position_ids=position_ids[None])
        return out.logits[0], None
