"""Classic speculative decoding: a small Hugging Face LM sharing the target's tokenizer drafts
a chain (template `chain<gamma>`) or a tree from its top-k, with its own KV cache."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from eagle.engine import DecodeState
from eagle.kv_cache import cache_length, crop, new_cache, tree_attention_mask
from eagle.target import target_forward


class DraftLM:
    """A causal LM as a `TreeDraftModel` (see `eagle.proposers.template`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache = None
        self._device = next(model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def cache_len(self) -> int:
        return cache_length(self.cache)

    def rollback(self, length: int) -> None:
        crop(self.cache, length)

    def reset(self) -> None:
        self.cache = new_cache(self.model)

    def catch_up(self, state: DecodeState) -> tuple[Tensor, None]:
        start = self.cache_len()
        x = torch.tensor([state.tokens[start:]], device=self._device)  # (1, new)
        out = target_forward(self.model, x, self.cache, logits_slice=slice(-1, None))
        return out.logits[0, -1], None

    def step(self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor,
             visible: Tensor) -> tuple[Tensor, None]:
        committed = self.cache_len() - (visible.shape[1] - len(tokens))  # earlier steps' nodes follow it
        mask = tree_attention_mask(committed, visible, self.dtype)
        out = target_forward(self.model, tokens[None], self.cache, attention_mask=mask,
                             position_ids=position_ids[None])
        return out.logits[0], None
