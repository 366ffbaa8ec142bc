"""SamplingPolicy must reproduce Hugging Face generate's warpers and greedy argmax."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from eagle.sampling import SamplingPolicy, argmax, categorical
from helpers.stats import chi2_pvalue


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution HF generate(do_sample=True) samples from (its own warper selection)."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(None, logits).softmax(-1)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.3, 5, 1.0),
        (1.0, 0, 0.9),
        (0.6, 0, 0.5),
        (0.8, 10, 0.8),
        (2.0, 3, 0.95),
        (1.0, 1, 0.3),
        (0.9, 100, 0.05),  # top_k above V is clamped; tiny top_p keeps exactly the top token
    ],
)
def test_probs_match_hf_warpers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(16, 40, generator=gen, dtype=torch.float64)  # (B, V)
    policy = SamplingPolicy(temperature, top_k, top_p)
    ours = policy.probs(logits)
    ref = hf_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    assert ((ours > 0) == (ref > 0)).all()  # same support, not just close values
    # any leading shape: (2, 8, V) gives the same rows as (16, V)
    torch.testing.assert_close(policy.probs(logits.view(2, 8, 40)).view(16, 40), ours)


def test_top_p_keeps_smallest_head_reaching_mass():
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64)
    out = SamplingPolicy(1.0, top_p=0.7).probs(probs.log())
    # 0.5 + 0.25 = 0.75 >= 0.7 is the smallest such head; 0.5 alone is not enough
    torch.testing.assert_close(out, torch.tensor([0, 0.5, 0, 0.25], dtype=torch.float64) / 0.75)


def test_top_k_keeps_ties_like_hf():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    out = SamplingPolicy(1.0, top_k=2).probs(logits)
    assert (out > 0).tolist() == [[False, True, True, True, False]]


def test_low_precision_logits_are_promoted():
    logits = torch.randn(3, 7).to(torch.bfloat16)
    assert SamplingPolicy(0.8).probs(logits).dtype == torch.float32
    assert SamplingPolicy().probs(logits).dtype == torch.float32


def test_greedy_is_one_hot_at_first_argmax():
    policy = SamplingPolicy()
    assert policy.greedy and not SamplingPolicy(0.5).greedy
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 1.0, 5.0, 5.0]], dtype=torch.float64)
    probs = policy.probs(logits)
    expected = torch.zeros_like(logits)
    expected[0, 1] = expected[1, 0] = 1  # ties resolve to the lowest index
    assert torch.equal(probs, expected)
    assert policy.sample(probs).tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_argmax_is_torch_argmax_ties_and_nans_included(dtype):
    """The lowest index among ties, as greedy search picks: rows of few distinct values (ties
    everywhere, where a kernel that kept the last maximum or split rows in blocks would pick
    another), NaNs, -inf rows, a vocabulary that is not a multiple of a vector, 1-3 dims."""
    g = torch.Generator().manual_seed(0)
    # each row's 3 ties its top thousands of times
    rows = torch.randint(0, 4, (64, 49_157), generator=g).to(dtype)
    rows[5, 40_000] = rows[7, 3] = float("nan")
    rows[9] = -float("inf")
    rows[11, -1] = 10  # the last column, past the last whole vector
    for x in (rows, rows[3], rows.view(8, 8, -1), torch.randn(4, 7, 4096, generator=g).to(dtype)):
        assert torch.equal(argmax(x), x.argmax(-1))
    assert argmax(rows)[[5, 7, 9, 11]].tolist() == [40_000, 3, 0, 49_156]


def test_sample_shapes_and_frequencies():
    policy = SamplingPolicy(1.0, top_k=3)
    logits = torch.tensor([0.0, 1.0, 2.0, -5.0, 0.5], dtype=torch.float64)
    probs = policy.probs(logits)
    gen = torch.Generator().manual_seed(1)
    draws = policy.sample(probs.expand(4000, 5), generator=gen)  # (4000,)
    assert draws.shape == (4000,) and draws.dtype == torch.long
    freq = torch.bincount(draws, minlength=5).double() / 4000
    assert freq[probs == 0].sum() == 0  # filtered tokens are never drawn
    torch.testing.assert_close(freq, probs, rtol=0, atol=0.03)
    assert policy.sample(probs.expand(2, 3, 5), generator=gen).shape == (2, 3)


def test_categorical_draws_each_token_with_its_weight():
    """Unnormalised weights with zero runs inside and at both ends: frequencies match
    weights / total (chi-square), and a zero-weight token is never drawn."""
    weights = torch.tensor(
        [[0.0, 2.0, 0.0, 0.0, 1.0, 5.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]]
    )
    gen = torch.Generator().manual_seed(0)
    runs = 6000
    draws = categorical(weights.expand(runs, 2, 7), gen)  # (runs, 2)
    assert draws.shape == (runs, 2) and draws.dtype == torch.long
    for row in range(2):
        counts = dict(enumerate(torch.bincount(draws[:, row], minlength=7).tolist()))
        assert all(counts[t] == 0 for t in range(7) if weights[row, t] == 0)
        expected = {
            t: float(w) / float(weights[row].sum()) for t, w in enumerate(weights[row]) if w > 0
        }
        assert chi2_pvalue({t: c for t, c in counts.items() if c}, expected, runs) > 1e-3


def test_categorical_edges_of_the_uniform(monkeypatch):
    """u = 0 takes the first token with mass; the largest uniform below 1 takes the last one,
    never a zero-weight token after it nor an index past the vocabulary."""
    weights = torch.tensor([0.0, 0.3, 0.7, 0.0, 0.0])
    for u, want in ((0.0, 1), (1 - 2**-53, 2)):
        monkeypatch.setattr(
            torch,
            "rand",
            lambda shape, generator=None, device=None, dtype=None, u=u: torch.full(
                shape, u, dtype=dtype
            ),
        )
        assert int(categorical(weights)) == want
        assert int(categorical(weights * 1e-30)) == want  # the scale does not matter


def test_categorical_refuses_a_row_without_mass():
    with pytest.raises(ValueError, match="no positive probability mass"):
        categorical(torch.tensor([[0.2, 0.8], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="no positive probability mass"):
        categorical(torch.tensor([0.5, float("nan")]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_validation_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingPolicy(**kwargs)
