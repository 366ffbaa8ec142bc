"""Shared fixtures: tiny random Hugging Face targets built offline from configs."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # peaked logits: greedy ties (and flaky argmax) become vanishingly rare
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def make_tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random fp32 causal LM of the given family, small enough for exhaustive tests."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **overrides})
    model = model_cls(config).eval()
    return model


@pytest.fixture(params=sorted(FAMILIES))
def tiny_target(request) -> torch.nn.Module:
    return make_tiny_model(request.param)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core CPU spinning
    threads make them several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
