"""Shared fixtures (helpers live in `tests/helpers/`): tiny random targets, one saved target
with its dumped features and distilled rows for the training tests, the saved models decode.py's
modes run on, and single-threaded torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.configs import compose_config
from helpers.data import conversations
from helpers.models import FAMILIES, make_tiny_model, save_tiny_target, small_tokenizer


@pytest.fixture(params=sorted(FAMILIES))
def tiny_target(request) -> torch.nn.Module:
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a small trained tokenizer, saved like a trained target."""
    return save_tiny_target(tmp_path_factory.mktemp("target"), small_tokenizer())


@pytest.fixture(scope="session")
def features_dir(tmp_path_factory, target_dir) -> Path:
    """`target_dir`'s features of a few conversations, dumped by data_gen (EAGLE, Medusa and
    the draft LM train on them)."""
    from data_gen.__main__ import generate

    out = tmp_path_factory.mktemp("features") / "dump"
    generate(compose_config("data_gen", conversations(
        f"target_path={target_dir}", f"out_dir={out}", "target_dtype=float32", "device=cpu",
        "max_len=32", "shard_size=8", "batch_size=4", "progress=false", "source.max_samples=16",
        "source.max_val_samples=4")))
    return out


@pytest.fixture(scope="session")
def distilled_dir(tmp_path_factory, target_dir) -> Path:
    """`target_dir`'s own continuations of a few conversations' first turns (8 + 8 tokens a
    row, 24 train and 6 validation rows): what SpecInfer's SSMs train on."""
    from data_gen.distill import generate

    out = tmp_path_factory.mktemp("distill") / "rows"
    generate(compose_config("distill", conversations(
        f"target_path={target_dir}", f"out_dir={out}", "target_dtype=float32", "device=cpu",
        "max_len=32", "prompt_len=8", "new_tokens=8", "num_prompts.train=24",
        "num_prompts.validation=6", "batch_size=8", "progress=false")))
    return out


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Path:
    """A tiny random target and draft LM sharing a small trained tokenizer, saved to disk, and
    three prompts in prompts.jsonl: what decode.py's modes run on (`helpers.configs.decode_cfg`)."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = small_tokenizer()
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        save_tiny_target(root / name, tokenizer, seed=seed, num_hidden_layers=layers)
    texts = ("def f(x):", "import os\n", "class A:")
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    return root


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core CPU spinning
    threads make them several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
