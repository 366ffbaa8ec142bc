"""Error margins over prompts: 95% bootstrap intervals of tau and speedup, and how often one
method stays ahead of another.

A benchmark decodes few prompts (the demo: 4 per set and temperature), and which prompts they
are decides much of a ranking: one MT-bench extraction question whose answer copies its text
lifted prompt lookup's mean speedup over 16 prompts past EAGLE's (LOG.md). So a speedup is
reported with an interval that resamples the prompts, and a lead with the share of resamples
that keep it.

Every resample draws n of the run's n prompts with replacement and pools them as the benchmark
does (total tokens / total time; tau = committed tokens / forwards). All methods of a run are
resampled with the same draws (the same seed), each prompt's runs of every method kept together:
a prompt that is fast for everyone moves them together, and the ratio's interval carries the
timing noise of both sides. With few prompts an interval is coarse (4 prompts allow 35 distinct
resamples), and it says how much *these* prompts spread, not how another draw of prompts would
land: read it as a lower bound on the uncertainty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

RESAMPLES = 2000

PerPrompt = Mapping[
    str, Sequence[float]
]  # `MethodResult.per_prompt`: tokens, committed, forwards, seconds
PER_PROMPT_KEYS = {"tokens", "committed", "forwards", "seconds"}
# the pooled ratios: tokens/s (total tokens / total time) and tau (committed tokens / forwards)
RATIOS = {"speed": ("tokens", "seconds"), "tau": ("committed", "forwards")}


def resamplable(per_prompt: PerPrompt | None) -> bool:
    """Whether a method's per-prompt record can be resampled: every key, and more than one prompt.
    """
    return bool(per_prompt) and PER_PROMPT_KEYS <= set(per_prompt) and len(per_prompt["tokens"]) > 1


def resamples(n: int, count: int = RESAMPLES, seed: int = 0) -> torch.Tensor:
    """(count, n) prompt indices, each row n draws with replacement: the same for every method of
    a run with the same seed (the pairing)."""
    return torch.randint(0, n, (count, n), generator=torch.Generator().manual_seed(seed))


def _pooled(per_prompt: PerPrompt, idx: torch.Tensor, what: str) -> torch.Tensor:
    """(R,) the ratio `what` (RATIOS) pooled over each resample's prompts."""
    num, den = RATIOS[what]
    a = torch.tensor(per_prompt[num], dtype=torch.float64)[idx].sum(1)
    b = torch.tensor(per_prompt[den], dtype=torch.float64)[idx].sum(1)
    return a / b.clamp_min(1e-12)


def _interval(x: torch.Tensor) -> tuple[float, float]:
    lo, hi = torch.quantile(x, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def bootstrap_interval(
    method: PerPrompt, baseline: PerPrompt, count: int = RESAMPLES, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """95% percentile intervals of `method`'s tau and of its speedup over `baseline`, resampling
    prompts, paired (`tau_interval`, `speedup_interval`: the same draws).

    Args:
        method, baseline: per-prompt lists `tokens`, `committed`, `forwards`, `seconds`
            (`MethodResult.per_prompt`), over the same prompts in the same order.
    """
    return {
        "tau": tau_interval(method, count, seed),
        "speedup": speedup_interval(method, baseline, count, seed),
    }


def tau_interval(method: PerPrompt, count: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of `method`'s tau alone (no baseline needed), resampling prompts."""
    return _interval(_pooled(method, resamples(len(method["tokens"]), count, seed), "tau"))


def speedup_interval(
    method: PerPrompt, baseline: PerPrompt, count: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """95% percentile interval of `method`'s tokens/s over `baseline`'s, resampling the prompts of
    both with the same draws. A percentile interval need not hold the point estimate (where every
    resample gives the same ratio, rounding alone can put it outside)."""
    idx = resamples(len(method["tokens"]), count, seed)
    return _interval(_pooled(method, idx, "speed") / _pooled(baseline, idx, "speed"))


def lead_share(
    leader: PerPrompt, other: PerPrompt, count: int = RESAMPLES, seed: int = 0, what: str = "speed"
) -> float:
    """The share of resamples of the prompts (paired) in which `leader` decodes more tokens/s
    than `other` (`what="speed"`), or accepts more tokens a forward (`what="tau"`); a tie counts
    half (two drafters with the same greedy taus share 50%, not 0%)."""
    idx = resamples(len(leader["tokens"]), count, seed)
    a, b = _pooled(leader, idx, what), _pooled(other, idx, what)
    return float(((a > b).double() + 0.5 * (a == b).double()).mean())


def tau_difference(
    method: PerPrompt, reference: PerPrompt, count: int = RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """95% interval of `method`'s tau minus `reference`'s, resampling prompts (paired): two
    drafters decoding the same prompts share each prompt's difficulty, so their difference is
    measured far more sharply than their two intervals side by side suggest."""
    idx = resamples(len(method["tokens"]), count, seed)
    return _interval(_pooled(method, idx, "tau") - _pooled(reference, idx, "tau"))


def error_bars(values: Sequence[float], intervals: Sequence) -> list[list[float]]:
    """matplotlib's yerr (2, N) for bars at `values` with 95% intervals (None: no bar): never
    negative, since a percentile interval need not hold its point estimate."""
    return [
        [max(0.0, v - ci[0]) if ci else 0.0 for v, ci in zip(values, intervals)],
        [max(0.0, ci[1] - v) if ci else 0.0 for v, ci in zip(values, intervals)],
    ]
