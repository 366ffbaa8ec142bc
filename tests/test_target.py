"""Target access: the engine's logits are the model's own, per family (its final transform
included); the features feed the LM head; bad paths fail in one line."""

from __future__ import annotations

import pytest
import torch

from eagle.decoding.engine import ContextOverflowError, SpeculativeDecoder, check_fits
from eagle.decoding.runners import DynamicRunner, StaticRunner
from eagle.proposers import TemplateProposer
from eagle.proposers.draft_model import DraftLM
from eagle.target import (
    LogitTransform,
    TargetError,
    check_logits,
    check_model_dir,
    context_length,
    embeddings,
    head_logits,
    lm_head,
    load_target,
    load_tokenizer,
    longrope_switch,
    target_forward,
)
from eagle.tree import TreeTemplate
from helpers.models import FAMILIES, TINY, make_tiny_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_logits_are_the_models_own(family):
    """Family-agnostic: whatever the family does after its LM head (Gemma-2's soft cap, Cohere's
    scale) the engine's logits equal `model(ids).logits`, and its features feed the LM head."""
    model = make_tiny_model(family)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    out = target_forward(model, ids)
    reference = model(input_ids=ids)
    torch.testing.assert_close(out.logits, reference.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        head_logits(model, out.features), reference.logits, rtol=0, atol=1e-5
    )
    check_logits(model)
    assert embeddings(model).weight.shape == (model.config.vocab_size, model.config.hidden_size)


def test_the_features_are_the_post_norm_hidden_state():
    model = make_tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    out = target_forward(model, ids)
    reference = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.features, reference.hidden_states[-1], rtol=0, atol=1e-6)
    torch.testing.assert_close(lm_head(model)(out.features), reference.logits, rtol=0, atol=1e-6)


def test_an_unknown_logit_transform_is_refused(monkeypatch):
    """A family that transforms its logits in a way LogitTransform does not know is caught when
    the target is loaded, not decoded from the wrong distribution."""
    model = make_tiny_model("gemma2")
    monkeypatch.setattr(LogitTransform, "of", classmethod(lambda cls, config: cls()))
    with pytest.raises(TargetError, match="transforms its logits"):
        check_logits(model)


def test_llama4s_context_stops_before_its_query_scale_would_read_a_slot():
    """Llama-4's layers without rotary embeddings scale their queries by the cache's length, not by
    the positions given (a tree's nodes would be scaled by their slots): the context stops where
    that scale is 1 for every slot, and a request past it is refused before decoding."""
    model = make_tiny_model("llama4_text", floor_scale=64)
    assert model.config.max_position_embeddings == 512 and context_length(model) == 63
    with pytest.raises(ContextOverflowError, match="context of 63"):
        check_fits(50, 10, 4, context_length(model))
    model.config.attn_temperature_tuning = False
    assert context_length(model) == 512
    model.config.attn_temperature_tuning, model.config.no_rope_layers = (
        True,
        [1, 1],
    )  # every layer rotary
    assert context_length(model) == 512
    assert context_length(make_tiny_model("llama")) == 512


LONGROPE = dict(
    max_position_embeddings=64,
    original_max_position_embeddings=16,
    rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4, long_factor=[4.0] * 4
    ),
)


def test_a_longrope_target_crosses_its_switch_as_generate_does():
    """Phi-3's longrope rotates a forward with its long factors once its longest position reaches
    original_max_position_embeddings (16 here), and `generate` recomputes the whole cache there.
    A verification that reached past the switch rotated its tree's earlier nodes long over a
    cache rotated short (logits 3.8 off, texts parted from `generate`'s). Now trees stop short of
    it, and the round whose root reaches it recomputes the cache: greedy text equal to
    `generate`'s below the switch, across it and from a prefill past it, on both runners and
    with a chain of 5 drafted by the target itself (each round verifies 6 positions). A batch
    whose rows would sit on both sides is refused: its longest row rotates them all."""
    model = make_tiny_model("phi3", **LONGROPE)
    assert longrope_switch(model) == 16 and longrope_switch(make_tiny_model("phi3")) is None
    g = torch.Generator().manual_seed(1)
    for prompt_len, new in (
        (4, 6),
        (12, 30),
        (20, 12),
    ):  # below it, across it, past it from the prefill
        prompt = torch.randint(3, 96, (prompt_len,), generator=g).tolist()
        want = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new
        )
        for runner in (DynamicRunner(model), StaticRunner(model, tree_size=5)):
            chain = TemplateProposer(
                DraftLM(model, cache="static" if isinstance(runner, StaticRunner) else "dynamic"),
                TreeTemplate.chain(5),
            )
            got = SpeculativeDecoder(model, chain, eos_token_id=[], runner=runner).generate(
                prompt, new
            )
            assert got.tokens == want[0, prompt_len:].tolist(), (prompt_len, type(runner).__name__)
            if prompt_len == 12:  # the rounds before the switch verified less than the whole chain
                assert (
                    min(r.tree_size for r in got.stats.rounds)
                    == 0
                    < max(r.tree_size for r in got.stats.rounds)
                )
    decoder = SpeculativeDecoder(
        model, TemplateProposer(DraftLM(model), TreeTemplate.chain(5)), eos_token_id=[]
    )
    with pytest.raises(
        ContextOverflowError,
        match="switches to its long factors at 16 positions and in this batch "
        r"prompt 0 \(12 tokens \+ 10 new \+ the tree's 6\) crosses it",
    ):
        decoder.generate_batch([list(range(3, 15)), [5, 6]], 10)
    with pytest.raises(ContextOverflowError, match="the batch mixes prompts below and past it"):
        decoder.generate_batch([[5, 6], list(range(3, 23))], 2)


def test_a_yarn_target_serves_the_positions_its_factor_extends_to():
    """Qwen's documented YaRN keeps max_position_embeddings at the original 32,768 and sets factor
    4: its frequencies are fixed, so it serves 4 x 32,768 positions, where the engine refused
    every request past 32,768. Dynamic NTK stays at its length (its frequencies change past it)."""
    yarn = dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32
    )
    assert (
        context_length(make_tiny_model("qwen2", max_position_embeddings=32, rope_parameters=yarn))
        == 128
    )
    dynamic = dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)
    assert (
        context_length(
            make_tiny_model("qwen2", max_position_embeddings=32, rope_parameters=dynamic)
        )
        == 32
    )


# recurrent layers: Mamba's selective scan, Qwen3-Next's linear attention, LFM2's short convolutions
RECURRENT = {
    "mamba": dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=4),
    "qwen3_next": dict(
        TINY,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    "lfm2": dict(TINY, layer_types=None, full_attn_idxs=[1]),
}


@pytest.mark.parametrize("family", sorted(RECURRENT))
def test_a_model_with_recurrent_layers_is_refused_by_name(family):
    """A tree's rejected nodes cannot be taken out of a recurrent state: the runners and a draft
    LM refuse such a model in one line, before any decoding (it used to end in an IndexError)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **RECURRENT[family]))
    with pytest.raises(TargetError, match="recurrent state"):
        DynamicRunner(model)
    with pytest.raises(TargetError, match="recurrent state"):
        StaticRunner(model, tree_size=4)
    with pytest.raises(TargetError, match="recurrent state"):
        DraftLM(model)


def test_an_attention_that_drops_the_tree_mask_is_refused():
    """Flash attention takes padding masks only: a verification's 4-D tree mask would be dropped
    and every node would attend to its siblings, silently. The runners and draft LMs refuse it."""
    model = make_tiny_model("llama")
    # what from_pretrained(attn_implementation=...) sets
    model.config._attn_implementation = "flash_attention_2"
    for build in (DynamicRunner, lambda m: StaticRunner(m, tree_size=4), DraftLM):
        with pytest.raises(
            TargetError,
            match="attention_implementation='flash_attention_2'.*attn_implementation='sdpa'",
        ):
            build(model)


def test_logits_slice_keeps_all_features():
    model = make_tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    out = target_forward(model, ids, logits_slice=slice(-1, None))
    assert out.logits.shape == (1, 1, model.config.vocab_size)
    assert out.features.shape == (1, 9, model.config.hidden_size)


def test_save_load_round_trip(tmp_path):
    model = make_tiny_model("qwen2")
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(TargetError, match="has no tokenizer"):
        load_target(tmp_path / "m")
    loaded, tok = load_target(tmp_path / "m", with_tokenizer=False)
    assert tok is None
    ids = torch.randint(0, model.config.vocab_size, (1, 11))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_missing_paths_fail_clearly(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        check_model_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="no config.json"):
        load_target(tmp_path / "empty")
    with pytest.raises(TargetError, match="does not exist"):
        load_tokenizer("./not/a/model")


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "phi3"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_head_only_load_reads_exactly_the_embeddings_and_lm_head(tmp_path, family, tied):
    """Offline drafter training needs E, the LM head and its logit transform: the rest of an 8B
    target (14 of its 16 GB in bf16) stays on the meta device."""
    from eagle.target import TargetIdentity, is_head_only

    make_tiny_model(family, tie_word_embeddings=tied).save_pretrained(tmp_path)
    full, _ = load_target(tmp_path, with_tokenizer=False)
    head, _ = load_target(tmp_path, with_tokenizer=False, weights="head")
    assert is_head_only(head) and not is_head_only(full)
    for part in (embeddings, lm_head):
        for (name, p), q in zip(
            part(head).named_parameters(), part(full).parameters(), strict=True
        ):
            assert p.device.type == "cpu" and not p.requires_grad, name
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert (lm_head(head).weight is embeddings(head).weight) == tied
    real = {id(p) for p in head.parameters() if p.device.type != "meta"}
    assert real == {id(p) for part in (embeddings, lm_head) for p in part(head).parameters()}
    assert (
        sum(p.numel() for p in head.parameters() if p.device.type != "meta")
        < sum(p.numel() for p in full.parameters()) / 2
    )  # the decoder layers were not read
    assert LogitTransform.of(head.config) == LogitTransform.of(full.config)
    assert TargetIdentity.of(head, with_lm_head=True) == TargetIdentity.of(full, with_lm_head=True)


# multimodal checkpoints whose language model a user points the repository at (Gemma-3 4B and up,
# Gemma-4, Llama-4 as released): a text config and a small vision tower each
VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)
MULTIMODAL = {
    "gemma3": (FAMILIES["gemma3_text"], dict(vision_config=VISION, mm_tokens_per_image=4)),
    "gemma4": (
        FAMILIES["gemma4_text"],
        dict(
            vision_config=dict(
                hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
            ),
            audio_config=None,
        ),
    ),
    "llama4": (
        FAMILIES["llama4_text"],
        dict(
            vision_config=dict(
                VISION, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16
            )
        ),
    ),
}


@pytest.mark.parametrize("family", sorted(MULTIMODAL))
def test_a_multimodal_checkpoint_loads_as_its_language_model(tmp_path, family):
    """EAGLE drafts text: the target is the checkpoint's language model, with the logits the
    multimodal model gives text, read in full or head only (Gemma-3's checkpoint names it
    `model.language_model.*`, which the causal LM of its text config would not find)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text, extra = MULTIMODAL[family]
    torch.manual_seed(0)
    whole = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(family, text_config=text, **extra)
    ).eval()
    whole.save_pretrained(tmp_path)
    target, _ = load_target(tmp_path, with_tokenizer=False)
    assert target.config is target.config.get_text_config(decoder=True)
    ids = torch.randint(3, 90, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(
            target(input_ids=ids).logits, whole(input_ids=ids).logits, rtol=0, atol=1e-5
        )
    head, _ = load_target(tmp_path, with_tokenizer=False, weights="head")
    torch.testing.assert_close(lm_head(head).weight, lm_head(target).weight, rtol=0, atol=0)
    torch.testing.assert_close(embeddings(head).weight, embeddings(target).weight, rtol=0, atol=0)


def test_a_checkpoint_that_leaves_weights_unread_is_refused(tmp_path):
    """`from_pretrained` starts a weight the checkpoint lacks at random, with a printed report:
    decoding would be exact against a model nobody trained."""
    from safetensors.torch import load_file, save_file

    make_tiny_model("llama").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TargetError, match=r"1 of its weights are not in the checkpoint.*down_proj"):
        load_target(tmp_path, with_tokenizer=False)
