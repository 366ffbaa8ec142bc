"""Decoding references: prompts, Hugging Face's greedy output, a random proposer, greedy cases,
every method by name."""

from __future__ import annotations

import torch

from eagle.bench.methods import METHODS
from eagle.decoding import DecodeState, DraftTree, Proposer, SpeculativeDecoder
from eagle.tree import TreeTemplate
from helpers.models import TREES

# every method by name, and the engine ones also on static caches
EVERY = list(METHODS) + [f"{name}:static" for name, info in METHODS.items() if info.engine]


def tree(name: str) -> TreeTemplate:
    return TreeTemplate.from_file(TREES / f"{name}.yaml")


class RandomProposer(Proposer):
    """Proposes uniformly random tokens on a fixed tree: almost everything is rejected."""

    name = "random"

    def __init__(self, template: TreeTemplate, seed: int = 0):
        self.template, self.max_nodes = template, template.num_nodes
        self.rng = torch.Generator().manual_seed(seed)

    def fork(self) -> RandomProposer:
        return RandomProposer(
            self.template, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=self.rng))
        )

    def propose(self, state: DecodeState) -> DraftTree:
        n, v = self.template.num_nodes, state.vocab_size
        tokens = torch.randint(0, v, (n,), generator=self.rng)
        q = None if state.policy.greedy else torch.full((n, v), 1.0 / v)  # i.i.d. uniform draws
        return DraftTree(tokens=tokens, parents=tuple(self.template.parents), q=q)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of different lengths (1..~90), some with repeats so prompt lookup matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 1 + (i * 37) % 90
        base = torch.randint(3, vocab, (max(length // 3, 1),), generator=g).tolist()
        out.append(
            (base * 3)[:length]
            if i % 2
            else torch.randint(3, vocab, (length,), generator=g).tolist()
        )
    return out


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def greedy_cases(target, n: int, max_news=(1, 2, 7, 24, 40), seed: int = 0):
    """(prompt, max_new_tokens, eos, reference): every other case stops at an EOS chosen as a
    token the target emits mid-way, so that the stop lands inside accepted paths."""
    cases = []
    for i, prompt in enumerate(prompts(n, target.config.vocab_size, seed=seed)):
        max_new = max_news[i % len(max_news)]
        ref = hf_greedy(target, prompt, max_new, eos=None)
        eos = ref[len(ref) // 2] if i % 2 and len(ref) > 3 else None
        cases.append(
            (
                prompt,
                max_new,
                eos,
                hf_greedy(target, prompt, max_new, eos) if eos is not None else ref,
            )
        )
    return cases


BUDGETS = (40, 1, 7, 24, 2, 40)  # new tokens per row of a batch: rows finish at different rounds


def batch_case(target, n: int = 6, seed: int = 0):
    """A batch of n prompts of different lengths (1..~90 tokens) with different budgets, and one
    EOS: a token the first row emits half-way, which may or may not come up in the others.
    Returns (prompts, budgets, eos, references), the references decoded one by one by
    `model.generate`."""
    batch = prompts(n, target.config.vocab_size, seed=seed)
    budgets = [BUDGETS[i % len(BUDGETS)] for i in range(n)]
    free = hf_greedy(target, batch[0], budgets[0], eos=None)
    eos = free[len(free) // 2]
    return batch, budgets, eos, [hf_greedy(target, p, b, eos) for p, b in zip(batch, budgets)]


def run_batched_greedy(target, proposer, runner, case, label: str) -> list:
    """Decode a `batch_case` as one batch; every row must equal its reference (and so its own
    decode alone, which the one-sequence checks compare with the same reference). Returns the
    rows' results."""
    batch, budgets, eos, refs = case
    decoder = SpeculativeDecoder(target, proposer, eos_token_id=eos, runner=runner)
    results = decoder.generate_batch(batch, budgets)
    for row, (res, ref) in enumerate(zip(results, refs)):
        assert res.tokens == ref, (
            f"{label}: row {row} ({len(batch[row])}-token prompt, {budgets[row]} new, eos {eos})"
        )
    return results


def run_greedy_cases(target, proposer, runner, cases, label: str) -> int:
    """Decode every case greedily; each must equal its reference. Returns the accepted drafts."""
    accepted = 0
    for prompt, max_new, eos, ref in cases:
        decoder = SpeculativeDecoder(
            target, proposer, eos_token_id=[] if eos is None else eos, runner=runner
        )
        res = decoder.generate(prompt, max_new)
        assert res.tokens == ref, (
            f"{label}: prompt of {len(prompt)} tokens, max_new {max_new}, eos {eos}"
        )
        accepted += sum(r.accepted for r in res.stats.rounds)
    return accepted
