"""Exact enumeration of a target's distribution and chi-square tests against it."""

from __future__ import annotations

import itertools

import torch
from scipy.stats import chisquare

from eagle.sampling import SamplingPolicy

POLICIES = {"t1": SamplingPolicy(temperature=1.0), "topk": SamplingPolicy(temperature=0.8, top_k=3),
            "topp": SamplingPolicy(temperature=1.0, top_p=0.8)}


def exact_joint(model, prompt: list[int], policy: SamplingPolicy, n: int) -> dict[tuple, float]:
    """P(x1..xn) = prod p(x_i | prompt, x_<i) under the policy, by enumeration."""
    vocab = model.config.vocab_size
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=n):
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1:-1]
            p = policy.probs(logits.double())
            out[seq] = float(torch.prod(p[torch.arange(n), torch.tensor(seq)]))
    return out


def chi2_pvalue(counts: dict, expected: dict, runs: int) -> float:
    """Chi-square p-value of observed counts against exact probabilities, merging the rarest
    cells so that every expected count is >= 5."""
    obs, exp, acc_o, acc_e = [], [], 0, 0.0
    for s in sorted(expected, key=expected.get, reverse=True):
        acc_o += counts.get(s, 0)
        acc_e += expected[s] * runs
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o, acc_e = 0, 0.0
    obs[-1] += acc_o
    exp[-1] += acc_e
    return float(chisquare(obs, exp).pvalue)


def sample_counts(generate, runs: int, seed: int = 1234) -> tuple[dict[tuple, int], list]:
    """Counts of the token sequences `generate(generator)` returns (a `DecodeResult`) over
    `runs` draws, and every round's statistics."""
    g = torch.Generator().manual_seed(seed)
    counts: dict[tuple, int] = {}
    rounds = []
    for _ in range(runs):
        res = generate(g)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        rounds += res.stats.rounds
    return counts, rounds


class _Replay:
    """One replay of a run: the draws follow `prefix`, then the first outcome of each new draw,
    leaving the other outcomes of new draws in `pending` for later replays."""

    def __init__(self, prefix: tuple[int, ...], pending: list[tuple[int, ...]]):
        self.prefix, self.pending, self.taken, self.prob = prefix, pending, [], 1.0

    def __call__(self, probs: torch.Tensor) -> int:
        if len(self.taken) < len(self.prefix):
            choice = self.prefix[len(self.taken)]
        else:
            support = torch.nonzero(probs > 0).flatten().tolist()
            choice = support[0]
            self.pending.extend(tuple(self.taken) + (other,) for other in support[1:])
        self.taken.append(choice)
        self.prob *= float(probs[choice])
        return choice


def enumerate_draws(run) -> dict:
    """Every outcome of `run(draw)` with its exact probability, for a `run` whose only
    randomness is its calls `draw(probs) -> index` (a 1-D tensor of probabilities): `run` is
    replayed once per sequence of draws, depth first over each draw's support."""
    out: dict = {}
    pending: list[tuple[int, ...]] = [()]
    while pending:
        draw = _Replay(pending.pop(), pending)
        outcome = run(draw)
        out[outcome] = out.get(outcome, 0.0) + draw.prob
    return out
