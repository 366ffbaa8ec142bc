"""Tiny random Hugging Face models built offline, and the repository's paths."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"
TREES = CONFIG_DIR / "tree"

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

TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"] * 20


def make_tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random fp32 causal LM of the given family, small enough for exhaustive tests."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **overrides})
    return model_cls(config).eval()


def small_tokenizer():
    """A byte-level BPE of 300 tokens trained on `TEXTS`, with the built-in chat template."""
    from data_gen.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(TEXTS, vocab_size=300)


def save_tiny_target(path: Path, tokenizer, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny random model whose vocabulary and special ids are the tokenizer's, saved with it
    like a trained target."""
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    make_tiny_model(family, seed=seed, **{**ids, **overrides}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
