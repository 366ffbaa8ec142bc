"""Prompt lookup decoding: draft the continuation of an earlier occurrence of the context's
last n-gram (n from `max_ngram` down to 1) as a chain.

The occurrence is the earliest one in the sequence, Hugging Face's rule: in repetitive text
the latest occurrence often sits just before the suffix itself, so its continuation runs into
the end of the sequence after a few tokens (LOG.md, 2026-11-30, measured both).
"""

from __future__ import annotations

import torch

from eagle.decoding.engine import DecodeState, DraftTree, Proposer


class PromptLookupProposer(Proposer):
    name = "prompt_lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 2):
        if max_ngram < 1 or num_tokens < 1:
            raise ValueError(f"prompt lookup needs max_ngram >= 1 and num_tokens >= 1, got {max_ngram} and {num_tokens}")
        self.num_tokens, self.max_ngram = num_tokens, max_ngram
        self.max_nodes = num_tokens

    def fork(self) -> PromptLookupProposer:
        return PromptLookupProposer(self.num_tokens, self.max_ngram)  # it reads everything off the state

    def lookup(self, tokens: list[int]) -> list[int]:
        """The continuation after the earliest earlier match of the longest suffix n-gram."""
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n):  # every start but the suffix's own
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + self.num_tokens]
        return []

    def propose(self, state: DecodeState) -> DraftTree:
        draft = self.lookup(state.tokens)
        if not draft:
            return DraftTree.empty()
        tokens = torch.tensor(draft, dtype=torch.long)
        parents = tuple(range(-1, len(draft)))  # a chain: node i's parent is i - 1
        q = None
        if not state.policy.greedy:
            # a deterministic proposal is drawn from a one-hot q: min(1, p/q) = p(x) stays exact
            q = torch.nn.functional.one_hot(tokens, state.vocab_size).float()
        return DraftTree(tokens=tokens, parents=parents, q=q)
