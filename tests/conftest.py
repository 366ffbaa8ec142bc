"""Shared fixtures: tiny random Hugging Face targets built offline from configs, and one
saved target with its dumped features for the training tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
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

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
         "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"] * 20

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


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a small trained tokenizer, saved like a trained target."""
    from data_gen.tokenizer import train_bpe_tokenizer

    path = tmp_path_factory.mktemp("target")
    tokenizer = train_bpe_tokenizer(TEXTS, vocab_size=300)
    model = make_tiny_model("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def features_dir(tmp_path_factory, target_dir) -> Path:
    """`target_dir`'s features of a few stdlib samples, dumped by data_gen (EAGLE and Medusa train on them)."""
    from data_gen.__main__ import generate

    out = tmp_path_factory.mktemp("features") / "dump"
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("data_gen", overrides=[
            f"target_path={target_dir}", f"out_dir={out}", "target_dtype=float32", "device=cpu",
            "max_len=32", "shard_size=8", "batch_size=4", "progress=false", "source.max_files=24",
            "source.val_fraction=0.25", "source.max_samples=16", "source.max_val_samples=4",
        ])
    generate(cfg)
    return out


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
