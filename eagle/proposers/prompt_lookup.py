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
    """Args:
        num_tokens: the chain's length.
        max_ngram: the longest suffix n-gram matched (Hugging Face's max_matching_ngram_size).
        min_ngram: the shortest (1, as Hugging Face): beside another proposer (`eagle_lookup`)
            a 1-token match drafts nearly every round, and a chain that is rarely right costs a
            verification of its length each time; a longer match is right more often.
    """

    name = "prompt_lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 2, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
            raise ValueError(
                "prompt lookup needs 1 <= min_ngram <= max_ngram and num_tokens >= 1, got "
                f"{min_ngram}, "
                f"{max_ngram} and {num_tokens}"
            )
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_nodes = num_tokens

    def fork(self) -> PromptLookupProposer:
        return PromptLookupProposer(
            self.num_tokens, self.max_ngram, self.min_ngram
        )  # it reads the state only

    def lookup(self, tokens: list[int]) -> list[int]:
        """The continuation after the earliest earlier match of the longest suffix n-gram."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n):  # every start but the suffix's own
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + self.num_tokens]
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
