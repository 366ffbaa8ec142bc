"""Shared fixtures: tiny random Hugging Face targets built offline from configs."""

from __future__ import annotations

import pytest
import torch
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
