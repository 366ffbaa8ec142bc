"""Prompt lookup decoding: draft the continuation of an earlier occurrence of the context's
last n-gram (n from `max_ngram` down to `min_ngram`) as a chain.

Which occurrence: `match="earliest"` is Hugging Face's rule (the first occurrence in the
sequence); `"latest"` the most recent one. In repetitive text the latest occurrence often
sits just before the suffix itself, so its continuation runs into the end of the sequence
after a few tokens; the earliest one leaves room for the whole draft (LOG.md measures both).
"""

from __future__ import annotations

import torch

from eagle.engine import DecodeState, DraftTree, Proposer


class PromptLookupProposer(Proposer):
    name = "prompt_lookup"

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1, match: str = "earliest"):
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
            raise ValueError("need 1 <= min_ngram <= max_ngram and num_tokens >= 1")
        if match not in ("earliest", "latest"):
            raise ValueError(f"match must be 'earliest' or 'latest', got {match!r}")
        self.num_tokens, self.max_ngram, self.min_ngram, self.match = num_tokens, max_ngram, min_ngram, match

    def lookup(self, tokens: list[int]) -> list[int]:
        """The continuation after the earliest (or latest) earlier match of the longest suffix n-gram."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            starts = range(len(tokens) - n)  # every start but the suffix's own
            for start in (starts if self.match == "earliest" else reversed(starts)):
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
