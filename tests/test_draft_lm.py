"""The distilled draft LM (eagle.training.draft_lm): the target's first layers, trained on its
dumped features to match its next-token distribution, exported as a plain LM that the `draft`
method decodes exactly."""

from __future__ import annotations

import math

import pytest
import torch

from eagle.decoding import make_runner
from eagle.proposers import DraftLM, TemplateProposer
from eagle.target import load_target
from eagle.training.draft_lm import DistilledDraftLMModule, truncated_copy
from helpers.configs import compose_train
from helpers.decoding import hf_greedy, run_greedy_cases, tree
from helpers.models import make_tiny_model
from train import train


def test_a_cut_of_the_target_is_its_first_layers():
    target = make_tiny_model("llama", num_hidden_layers=3)
    ids = torch.tensor([[5, 9, 2, 7, 7, 1]])
    with torch.no_grad():
        states = target(
            ids, output_hidden_states=True
        ).hidden_states  # embeddings, layer 1..3 (the last normed)
        whole = truncated_copy(target, 3)
        torch.testing.assert_close(whole(ids).logits, target(ids).logits)
        one = truncated_copy(target, 1)
        torch.testing.assert_close(one.model(ids).last_hidden_state, target.model.norm(states[1]))
    assert one.config.num_hidden_layers == 1 and target.config.num_hidden_layers == 3
    with pytest.raises(ValueError, match="choose 1..3"):
        truncated_copy(target, 4)


def test_a_cut_keeps_what_its_config_says_per_layer_for_its_layers_only():
    """Llama-4 lists per layer whether it uses rotary embeddings, and which layers are mixtures of
    experts; Gemma-3 which layers slide: a cut's config must describe its own layers."""
    llama4 = truncated_copy(
        make_tiny_model("llama4_text", num_hidden_layers=3, no_rope_layer_interval=2), 2
    )
    assert llama4.config.no_rope_layers == [1, 0] and llama4.config.moe_layers == [0, 1]
    assert llama4.config.layer_types == ["chunked_attention", "full_attention"]
    gemma3 = truncated_copy(make_tiny_model("gemma3_text", num_hidden_layers=3), 1)
    assert gemma3.config.layer_types == ["sliding_attention"]
    # Gemma-4: full layers' head size per layer, and its last 2 of 4 layers reuse earlier keys and
    # values
    gemma4 = make_tiny_model("gemma4_text")
    assert gemma4.config.to_dict()["per_layer_config"] == {
        "1": {"head_dim": 16},
        "3": {"head_dim": 16},
    }
    two = truncated_copy(gemma4, 2)
    assert two.config.num_kv_shared_layers == 0 and two.config.to_dict()["per_layer_config"] == {
        "1": {"head_dim": 16}
    }
    ids = torch.tensor([[5, 9, 2, 7, 7, 1]])
    with (
        torch.no_grad()
    ):  # its per-layer token inputs (V, layers x 8) are the target's first two layers'
        states = gemma4(ids, output_hidden_states=True).hidden_states
        torch.testing.assert_close(two.model(ids).last_hidden_state, gemma4.model.norm(states[2]))
    with pytest.raises(ValueError, match="cannot cut Gemma4ForCausalLM to 3 layers"):
        truncated_copy(
            gemma4, 3
        )  # Gemma-4 makes its last layer a full one: layer 2 would change its kind


def draft_cfg(tmp_path, target_dir, features_dir, *overrides: str):
    return compose_train(
        [
            "experiment=draft_lm_smollm2",
            f"model.target_path={target_dir}",
            "model.layers=1",
            "model.loss_vocab=16",
            f"data.datamodule.features_dir={features_dir}",
            f"paths.runs_dir={tmp_path}",
            "logger=csv",
            "trainer.max_steps=6",
            "trainer.val_check_interval=6",
            "model.optim.warmup_steps=1",
            *overrides,
        ]
    )


def test_distilled_draft_lm_trains_exports_and_decodes_exactly(
    tmp_path, target_dir, features_dir, capsys
):
    metrics = train(draft_cfg(tmp_path, target_dir, features_dir))
    assert "draft LM loss over the 16 most frequent" in capsys.readouterr().out
    assert metrics["steps"] == 6 and math.isfinite(metrics["val/loss"])
    assert (
        0.0 <= metrics["val/top1_no_layers"] <= 1.0
        and metrics["val/top1"] > metrics["val/top1_no_layers"]
    )
    folder = tmp_path / "draft_lm_smollm2" / "model"
    target, tokenizer = load_target(target_dir)
    draft, _ = load_target(folder)  # a plain LM with the target's tokenizer
    assert (
        draft.config.num_hidden_layers == 1 and draft.config.vocab_size == target.config.vocab_size
    )
    # the frozen embeddings are the target's, unchanged by training
    torch.testing.assert_close(
        draft.get_input_embeddings().weight, target.get_input_embeddings().weight
    )
    proposer = TemplateProposer(DraftLM(draft, cache="dynamic"), tree("chain5"))
    prompt = tokenizer("def f(x):")["input_ids"]
    cases = [(prompt, 12, None, hf_greedy(target, prompt, 12, eos=None))]
    run_greedy_cases(
        target,
        proposer,
        make_runner("dynamic", target, tree_size=proposer.max_nodes),
        cases,
        "draft LM",
    )


def test_the_draft_lm_refuses_a_bad_loss_vocab(target_dir):
    with pytest.raises(ValueError, match="loss_vocab must be"):
        DistilledDraftLMModule(str(target_dir), loss_vocab=0)


def _draft_passes(target, draft, template, compile_mode):
    """A draft LM's passes padded to the template's one shape (compiled with `compile_mode`), a
    static target runner of the template's width (compiled too)."""
    from eagle.proposers.eagle import pass_shape

    proposer = TemplateProposer(
        DraftLM(draft, cache="static", compile_mode=compile_mode, pass_shape=pass_shape(template)),
        template,
    )
    return proposer, make_runner(
        "static", target, tree_size=template.num_nodes, compile_mode=compile_mode
    )


@pytest.mark.parametrize("name", ["eagle_default", "chain5"])
def test_a_draft_lm_padded_to_one_pass_shape_drafts_what_it_drafts_unpadded(name):
    """The draft LM's passes padded to one shape (what its compiled passes run, here eagerly):
    every greedy text equals `generate`'s, and the rounds accept what the unpadded passes accept
    (the target drafting for itself: a pass that saw a wrong entry would lose acceptances)."""
    from helpers.decoding import greedy_cases

    target = make_tiny_model("llama")
    draft = make_tiny_model("llama")  # the same weights (seed 0): an oracle
    cases = greedy_cases(target, 6)
    template = tree(name)
    padded = run_greedy_cases(
        target, *_draft_passes(target, draft, template, None), cases, f"padded/{name}"
    )
    plain = TemplateProposer(DraftLM(draft, cache="static"), template)
    assert (
        padded
        == run_greedy_cases(
            target,
            plain,
            make_runner("static", target, tree_size=template.num_nodes),
            cases,
            f"unpadded/{name}",
        )
        > 0
    )


@pytest.mark.slow
def test_a_compiled_draft_lm_decodes_what_generate_does():
    """draft:static compiled as EAGLE's drafter is (its passes padded to one shape, one graph):
    the classic peer's drafting on a GPU is then not bound by launches where EAGLE's is not."""
    from helpers.decoding import greedy_cases

    torch._dynamo.reset()
    target, draft = make_tiny_model("llama"), make_tiny_model("llama", num_hidden_layers=1, seed=3)
    cases = greedy_cases(target, 4)
    for name in ("eagle_default", "chain5"):
        run_greedy_cases(
            target, *_draft_passes(target, draft, tree(name), "default"), cases, f"compiled/{name}"
        )
