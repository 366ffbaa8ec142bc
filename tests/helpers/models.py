"""Tiny random Hugging Face models built offline, and the repository's paths."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eagle.target import cut_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"
TREES = CONFIG_DIR / "tree"

COMMON = dict(
    vocab_size=96,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.2,
)  # peaked logits: greedy ties (and flaky argmaxes) become vanishingly rare
TINY = dict(
    COMMON,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# The family matrix: each entry exercises something the others do not.
FAMILIES = {
    "llama": TINY,
    "mistral": dict(TINY, sliding_window=16),  # one window for every layer, crossed by most tests
    "qwen2": TINY,
    # alternating sliding and full layers (per-layer-type masks) and soft-capped logits
    "gemma2": dict(
        TINY, head_dim=8, sliding_window=16, final_logit_softcapping=3.0, query_pre_attn_scalar=8
    ),
    "cohere": dict(TINY, logit_scale=0.5),  # scaled logits
    "phi3": TINY,  # fused qkv and gate/up projections
    # no intermediate_size, absolute position embeddings, one (fused) attention projection
    "gpt2": dict(COMMON, n_embd=32, n_layer=2, n_head=4, n_positions=512),
    # multi-query attention (one KV head), no num_key_value_heads field
    "falcon": dict(
        COMMON,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        multi_query=True,
        new_decoder_architecture=False,
        alibi=False,
        parallel_attn=True,
    ),
    "gpt_neox": dict(TINY, rotary_pct=0.5),  # partial rotary
    "qwen3": dict(TINY, head_dim=8),  # per-head q/k norms: the fused kernels must step aside
    # sliding and full layers with their own rotary bases, q/k norms, scaled embeddings
    "gemma3_text": dict(
        TINY, head_dim=8, sliding_window=16, query_pre_attn_scalar=8, sliding_window_pattern=2
    ),  # layer 0 sliding, layer 1 full
    "olmo2": TINY,  # norms after attention and MLP (not before), q/k norms over all heads
    # mixture-of-experts MLPs, chunked attention, a layer without rotary embeddings, and a body
    # that `base_model` does not find (its prefix names no attribute)
    "llama4_text": dict(TINY, head_dim=8, attention_chunk_size=16, no_rope_layer_interval=2),
    # attention sinks (a learned logit per head in every softmax), sliding and full layers, YaRN
    # rotary embeddings, mixture-of-experts MLPs
    "gpt_oss": dict(
        TINY,
        head_dim=8,
        sliding_window=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=16,
        ),
    ),
    # latent attention (keys of 8 + 4 rotary dims, values of 8: caches of two widths), a dense
    # layer, then a mixture of experts
    "deepseek_v3": dict(
        TINY,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    # one head size per layer type, per-layer token inputs, and its last two layers reusing the keys
    # and values of the last layers of their type before them (KV sharing)
    "gemma4_text": dict(
        TINY,
        head_dim=8,
        global_head_dim=16,
        sliding_window=16,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=96,
        num_hidden_layers=4,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
}

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20


def make_tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random fp32 causal LM of the given family, small enough for exhaustive tests."""
    torch.manual_seed(seed)
    fields = {**FAMILIES[family], **overrides}
    layers = fields.get("num_hidden_layers")
    family_layers = FAMILIES[family].get("num_hidden_layers", layers)
    if (
        layers is not None and layers < family_layers
    ):  # what the family says per layer follows the cut
        config = cut_config(
            AutoConfig.for_model(family, **{**fields, "num_hidden_layers": family_layers}), layers
        )
    else:
        config = AutoConfig.for_model(family, **fields)
    return AutoModelForCausalLM.from_config(config).eval()


def small_tokenizer():
    """A byte-level BPE of 300 tokens trained on `TEXTS`, with the built-in chat template."""
    from helpers.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(TEXTS, vocab_size=300)


def save_tiny_target(
    path: Path, tokenizer, family: str = "llama", seed: int = 0, **overrides
) -> Path:
    """A tiny random model whose vocabulary and special ids are the tokenizer's, saved with it
    like a trained target."""
    ids = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    make_tiny_model(family, seed=seed, **{**ids, **overrides}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
