"""Sampling policies: the distribution a model's next token is actually drawn from.

Speculative sampling is only exact when `p` (target) and `q` (proposer) are the distributions
the tokens are really drawn from, *after* temperature, top-k and top-p. One `SamplingPolicy`
object therefore produces both: `policy.probs(target_logits)` is `p`, `policy.probs(draft_logits)`
is `q`. The warpers follow Hugging Face `generate` exactly (same order, same tie rules), so a
sampled decode here and `model.generate(do_sample=True, ...)` target the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingPolicy:
    """Temperature, then top-k, then top-p; `temperature == 0` means greedy.

    Note that Hugging Face's `GenerationConfig` defaults to `top_k=50`; here `top_k=0`
    (disabled) is the default, so pass `top_k` explicitly when comparing with `generate`.
    """

    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(
                f"temperature must be a number >= 0 (0 means greedy), got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """The distribution actually sampled from.

        Args:
            logits: (..., V) raw model scores.
        Returns:
            (..., V) probabilities in float32, or float64 if the logits are float64. Greedy
            gives a one-hot at `argmax` (the lowest index among ties).
        """
        # bf16/fp16 softmax and cumsum would bias top-p and the acceptance ratios p/q
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logits = logits.to(dtype)
        if self.greedy:
            return torch.zeros_like(logits).scatter_(-1, argmax(logits)[..., None], 1.0)

        scores = logits / self.temperature
        if self.top_k > 0:
            # HF TopKLogitsWarper: drop scores below the k-th largest; ties with it survive
            k = min(self.top_k, scores.size(-1))
            kth = torch.topk(scores, k, dim=-1).values[..., -1:]  # (..., 1)
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p < 1.0:
            # HF TopPLogitsWarper: ascending sort, drop the low tail whose mass is <= 1 - top_p,
            # which keeps the smallest head reaching top_p; the top token always stays
            sorted_scores, order = torch.sort(scores, descending=False)  # (..., V)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop_sorted = cum <= 1 - self.top_p
            drop_sorted[..., -1] = False
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, -float("inf"))
        return scores.softmax(-1)

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Draw one token per row of `probs` (the output of `self.probs`).

        Args:
            probs: (..., V) probabilities.
            generator: optional RNG, on the same device as `probs`.
        Returns:
            (...) long token ids; greedy takes the argmax and draws nothing.
        """
        if self.greedy:
            return argmax(probs)
        return categorical(probs, generator)


def argmax(scores: Tensor) -> Tensor:
    """(..., V) -> (...) long: the index of each row's largest score, the lowest among ties (as
    `torch.argmax` and Hugging Face's greedy search pick; a NaN counts as the largest).

    Taken as `max(-1).indices`, which PyTorch documents with the same tie rule: on a CPU that
    kernel runs several times faster than `argmax`'s over a vocabulary of thousands of tokens
    (LOG.md), which showed in every greedy verification and in the drafter's training step,
    where the top-1 agreement takes two argmaxes a step.
    """
    return scores.max(-1).indices


class RowProbs:
    """`policy.probs` of each row of `logits` (N, V), computed the first time the row is read.

    Sampled verification reads p only at the nodes of the accepted path (its children's
    outcomes, or the bonus token at a leaf), about tau of a tree's N rows. Computing all N costs a
    softmax per row, and under top-p a sort of the whole vocabulary per row. Indexing takes one
    integer row."""

    def __init__(self, policy: SamplingPolicy, logits: Tensor):
        self.policy, self.logits, self.rows = policy, logits, {}

    @property
    def shape(self) -> torch.Size:
        return self.logits.shape

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, u: int) -> Tensor:
        if u not in self.rows:
            self.rows[u] = self.policy.probs(self.logits[u])  # (V,)
        return self.rows[u]


def categorical(weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw from each row of `weights` (..., V), non-negative and not necessarily normalised.

    Inverts each row's CDF, accumulated in float64: a uniform in [0, total) lands in token i's
    interval [cdf[i-1], cdf[i]) with probability weights[i] / total, resolved down to ~1e-16 of
    the row's mass, and a token of zero weight has an empty interval, so it is never drawn.
    Why not `torch.multinomial`: on a CPU it costs ~200 us for one row of 8k tokens (2.7 ms at
    128k), against ~20 us here, and a sampled round draws several times.

    Returns:
        (...) long token ids.
    Raises:
        ValueError: a row has no positive mass (or a NaN).
    """
    cdf = weights.to(torch.float64).cumsum(-1)  # (..., V)
    total = cdf[..., -1:]  # (..., 1)
    if not bool((total > 0).all()):  # also catches NaN
        raise ValueError("cannot draw from a row with no positive probability mass (or a NaN)")
    return invert_cdf(cdf, generator)


def invert_cdf(cdf: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """The token each row's uniform lands on: the first i with cdf[i] > u, u uniform in
    [0, cdf[-1]). cdf (..., V) float64, non-decreasing. A row of zero mass gives V (no token):
    callers that allow one check for it. Returns (...) long."""
    total = cdf[..., -1:]  # (..., 1)
    # u <= 1 - 2^-53, so u * total rounds to below total: the draw lands on a token with mass
    u = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=torch.float64) * total
    return torch.searchsorted(cdf, u, right=True)[..., 0]


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` (the model's: CUDA sampling refuses a CPU generator), seeded."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """Raise ValueError when `generator` lives on another device than the model's."""
    if generator is None:
        return
    g = generator.device
    if g.type != device.type or (
        g.index is not None and device.index is not None and g.index != device.index
    ):
        raise ValueError(
            f"the generator is on {g} but the model on {device}: create it there "
            f"(eagle.sampling.seeded_generator(seed, device))"
        )
