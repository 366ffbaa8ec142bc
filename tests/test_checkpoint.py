"""Drafter checkpoints: round trips, target validation, clear errors, EAGLE-format export."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from safetensors import safe_open

from eagle.models.checkpoint import CheckpointError, load_drafter, save_drafter
from eagle.models.drafter import EagleDrafter
from eagle.models.export import ExportError, export_drafter, import_eagle
from eagle.target import TargetIdentity, TargetMismatchError
from helpers.drafters import FakeTokenizer, perturbed
from helpers.models import make_tiny_model


@pytest.fixture
def target():
    return make_tiny_model("llama", tie_word_embeddings=False)


@pytest.fixture
def drafter(target):
    return perturbed(EagleDrafter.random(target, FakeTokenizer(96), path="runs/tiny", seed=2))


def outputs(d: EagleDrafter) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(2, 6, 32, generator=g), torch.randint(0, 96, (2, 6), generator=g)
    with torch.no_grad():
        return d.logits(d(feats, ids))  # (2, 6, V)


def keys(path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def test_save_load_round_trip(tmp_path, target, drafter):
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architecture"] == "EagleDrafter" and config["format_version"] == 1
    assert config["target"]["tokenizer_hash"] == drafter.config.target["tokenizer_hash"]
    loaded = load_drafter(tmp_path / "d", target, FakeTokenizer(96))
    assert loaded.config == drafter.config and not loaded.training, (
        "loaded for inference, as load_target loads"
    )
    assert torch.equal(outputs(loaded), outputs(drafter))
    assert (
        load_drafter(tmp_path / "d", target, FakeTokenizer(96), dtype="bfloat16").dtype
        == torch.bfloat16
    )


def test_checkpoint_holds_no_target_tensors(tmp_path, target, drafter):
    save_drafter(drafter, tmp_path / "d")
    names = keys(tmp_path / "d" / "model.safetensors")
    assert names == set(drafter.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in names)
    assert not list(tmp_path.glob("d/*.tmp"))


def test_mismatched_target_is_refused(tmp_path, drafter):
    save_drafter(drafter, tmp_path / "d")
    where = str(tmp_path / "d")
    wider = make_tiny_model("llama", hidden_size=64)
    with pytest.raises(
        TargetMismatchError,
        match=f"drafter {where} was made for another target: hidden_size 32 != 64",
    ):
        load_drafter(where, wider)
    with pytest.raises(TargetMismatchError, match="vocab_size 96 != 80"):
        load_drafter(where, make_tiny_model("llama", vocab_size=80))
    with pytest.raises(TargetMismatchError, match="tokenizer_hash"):
        load_drafter(where, make_tiny_model("llama"), FakeTokenizer(96, extra="x"))
    # same shapes, another family: a warning, not an error
    with pytest.warns(UserWarning, match="made for a llama target, this one is mistral"):
        load_drafter(where, make_tiny_model("mistral"), FakeTokenizer(96))
    with pytest.warns(UserWarning, match="tokenizer hash .* was not checked"):
        load_drafter(where, make_tiny_model("llama"))


def test_another_lm_head_of_the_same_shapes_is_warned_about(tmp_path, target, drafter):
    """A drafter records the LM head it was trained against (training writes its fingerprint):
    the same sizes and tokenizer with another head (a base model for its chat model, a retrained
    target) load with a warning, since exactness does not depend on it; the same head is silent."""
    trained = TargetIdentity.of(target, FakeTokenizer(96), "runs/tiny", with_lm_head=True)
    drafter.config = dataclasses.replace(drafter.config, target=trained.to_dict())
    save_drafter(drafter, tmp_path / "d")
    assert (
        json.loads((tmp_path / "d" / "config.json").read_text())["target"]["lm_head_sha256"]
        == trained.lm_head_sha256
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_drafter(tmp_path / "d", target, FakeTokenizer(96))
        load_drafter(
            tmp_path / "d", target.to(torch.bfloat16), FakeTokenizer(96), dtype="float32"
        )  # rounded alike
    target.float()
    other = make_tiny_model("llama", tie_word_embeddings=False, seed=7)
    with pytest.warns(
        UserWarning, match=f"trained against another LM head .*{trained.lm_head_sha256} != "
    ):
        load_drafter(tmp_path / "d", other, FakeTokenizer(96))
    with pytest.raises(TargetMismatchError, match="tokenizer_hash"):  # still an error
        load_drafter(tmp_path / "d", other, FakeTokenizer(96, extra="x"))


def test_broken_checkpoints_give_clear_errors(tmp_path, target, drafter):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "nope", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_drafter(tmp_path / "empty", target)

    d = save_drafter(drafter, tmp_path / "d")
    weights = d / "model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_drafter(d, target, FakeTokenizer(96))
    weights.unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        load_drafter(d, target, FakeTokenizer(96))

    from safetensors.torch import save_file

    partial = {k: v for k, v in drafter.state_dict().items() if "mlp" not in k}
    save_file({k: v.contiguous() for k, v in partial.items()}, str(weights))
    with pytest.raises(CheckpointError, match="missing tensors .*mlp"):
        load_drafter(d, target, FakeTokenizer(96))

    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "num_layers": 2}))
    with pytest.raises(CheckpointError, match="unknown key"):
        load_drafter(d, target, FakeTokenizer(96))
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_drafter(d, target, FakeTokenizer(96))


# ------------------------------------------------------------------------------ exports
#
# What each engine's loader reads, from its source (file and line; the released versions named):
# - SafeAILab/EAGLE (GitHub main; eagle-llm 1.2.1 on PyPI): eagle/model/cnets1.py L524 `self.fc =
#   nn.Linear(2 * config.hidden_size, config.hidden_size, bias=bias)`, L622-623
#   `self.fc(torch.cat((inputs_embeds, hidden_states), dim=-1))`, L392-400 layer 0 has no
#   input_layernorm; eagle/model/ea_model.py L48-53 `bias = con["bias"]` (absent: True), L119-130
#   pytorch_model.bin first; eagle-llm 1.2.1 ea_model.py L101-106 `load_state_dict(...,
#   strict=True)` with `embed_tokens.weight`; eagle/model/configs.py L133-137 `rope_scaling` must
#   hold exactly two fields.
# - vLLM 0.33.0: vllm/model_executor/models/llama_eagle.py L110-118 `ReplicatedLinear(...,
#   bias=False)` for fc, L129-130 `self.fc(torch.cat((input_embeds, hidden_states), dim=-1))`,
#   L55-57 layer 0's input norm is Identity, L187-196 names get a `model.` prefix (`lm_head` aside)
#   and there is no lm_head module; models/utils.py L442-448 unknown names raise, L458 unexpected
#   `.bias` names are skipped; transformers_utils/configs/eagle.py L46-53 `architectures` -> "Eagle"
#   + arch; models/registry.py L661 EagleLlamaForCausalLM; models/llama.py L268-270 `attention_bias
#   = ... or getattr(config, "bias", False)`.
# - SGLang 0.5.23: python/sglang/srt/models/llama_eagle.py L91 `torch.nn.Linear(config.hidden_size *
#   2, config.hidden_size)` (always a bias), L101-108 cat((embeds, hidden)), L54-55 layer 0 drops
#   input_layernorm, L146-150 `model.` prefix and the draft lm_head skipped, L153 `EntryClass =
#   [LlamaForCausalLMEagle]` matched exactly against `architectures` (models/registry.py L93);
#   models/llama.py L339-341 the same `"bias"` -> attention-bias rule as vLLM.

LAYER = (
    {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    | {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    | {"layers.0.post_attention_layernorm.weight"}
)
EXPECTED = {  # format: (weights file, tensor names, architectures)
    "eagle": (
        "pytorch_model.bin",
        LAYER | {"fc.weight", "fc.bias", "embed_tokens.weight"},
        ["LlamaForCausalLM"],
    ),
    "vllm": ("model.safetensors", LAYER | {"fc.weight"}, ["LlamaForCausalLM"]),
    "sglang": ("model.safetensors", LAYER | {"fc.weight", "fc.bias"}, ["LlamaForCausalLMEagle"]),
}


def exported_state(out) -> dict[str, torch.Tensor]:
    if (out / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(out / "model.safetensors"))
    return torch.load(out / "pytorch_model.bin", weights_only=True)


def no_bias_drafter(target):
    config = EagleDrafter.random(target, FakeTokenizer(96), path="runs/tiny").config
    return perturbed(EagleDrafter.on_target(dataclasses.replace(config, fc_bias=False), target))


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_each_format_holds_what_its_engine_loads(tmp_path, target, drafter, fmt):
    source = no_bias_drafter(target) if fmt == "vllm" else drafter  # vLLM's fc has no bias
    out = export_drafter(source, tmp_path / fmt, fmt)
    weights, names, architectures = EXPECTED[fmt]
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", weights])
    state = exported_state(out)
    assert set(state) == names  # no prefix; never lm_head, norm or layers.0.input_layernorm
    h = source.config.hidden_size
    assert state["fc.weight"].shape == (h, 2 * h)
    assert torch.equal(
        state["fc.weight"][:, :h], source.fc.weight[:, h:]
    )  # embedding columns first
    assert torch.equal(state["fc.weight"][:, h:], source.fc.weight[:, :h])
    own = source.state_dict()
    for name in LAYER:
        assert state[name].shape == own[name].shape, name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == architectures and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["attention_bias"] is False
    assert (
        config["hidden_size"] == h
        and config["vocab_size"] == 96
        and config["tie_word_embeddings"] is False
    )
    if fmt == "eagle":
        assert (
            config["bias"] is True
        )  # explicit: EAGLE defaults to a bias, strict=False leaves a missing one random
        assert torch.equal(state["embed_tokens.weight"], target.model.embed_tokens.weight)
    else:
        assert config.get("bias") is not True  # vLLM and SGLang read "bias" as attention biases
    assert config["rope_scaling"] is None or len(config["rope_scaling"]) == 2 or fmt != "eagle"


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_export_import_round_trip(tmp_path, target, drafter, fmt):
    source = no_bias_drafter(target) if fmt == "vllm" else drafter
    out = export_drafter(source, tmp_path / fmt, fmt)
    back = import_eagle(out, target, FakeTokenizer(96))
    assert back.config.fc_bias is (fmt != "vllm") and torch.equal(outputs(back), outputs(source))
    with pytest.raises(TargetMismatchError, match="hidden_size 32 != 64"):
        import_eagle(out, make_tiny_model("llama", hidden_size=64))


def test_what_a_format_cannot_hold_is_refused(tmp_path, target, drafter):
    with pytest.raises(ExportError, match="model.fc_bias=false"):
        export_drafter(drafter, tmp_path / "v", "vllm")  # a trained bias vLLM would drop
    with pytest.raises(ExportError, match="no EAGLE-1 variant"):
        export_drafter(drafter, tmp_path / "s", "speculators")
    out = export_drafter(no_bias_drafter(target), tmp_path / "sg", "sglang")
    assert not exported_state(out)["fc.bias"].any()  # SGLang's fc always has one: zeros


def test_the_targets_logit_transform_and_what_an_engine_cannot_build(tmp_path):
    """The engines take the drafter's logit post-processing from its config: Gemma-2's soft-cap
    is written (SGLang applies it; for vLLM and EAGLE's code, which do not, the export warns).
    vLLM's and SGLang's Llama MLP runs silu only, and EAGLE's attention takes head_dim =
    hidden / heads: drafters they would fail to load are refused at export."""
    gemma = make_tiny_model("gemma2", tie_word_embeddings=False)
    drafter = EagleDrafter.random(gemma, FakeTokenizer(96), path="runs/tiny")
    sglang = json.loads(
        (export_drafter(drafter, tmp_path / "sg", "sglang") / "config.json").read_text()
    )
    assert sglang["final_logit_softcapping"] == 3.0 and "logit_scale" not in sglang
    with pytest.warns(
        UserWarning, match="soft-caps its logits at 3.0; the vllm EAGLE model does not"
    ):
        export_drafter(no_bias_drafter(gemma), tmp_path / "v", "vllm")
    gelu = make_tiny_model("llama", hidden_act="gelu_pytorch_tanh")
    with pytest.raises(
        ExportError, match="supports only silu; this drafter's layer uses 'gelu_pytorch_tanh'"
    ):
        export_drafter(no_bias_drafter(gelu), tmp_path / "g", "vllm")
    wide_heads = make_tiny_model("llama", head_dim=16)
    with pytest.raises(
        ExportError, match="head_dim = hidden_size / heads = 8, this drafter's is 16"
    ):
        export_drafter(EagleDrafter.random(wide_heads), tmp_path / "e", "eagle")


def test_llama3_rope_scaling_is_kept_except_for_eagles_config_class(tmp_path, target):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    config = dataclasses.replace(
        EagleDrafter.random(target).config, rope_theta=500000.0, rope_parameters=rope
    )
    drafter = EagleDrafter.on_target(config, target)
    vllm = json.loads(
        (export_drafter(no_bias_fc(drafter), tmp_path / "v", "vllm") / "config.json").read_text()
    )
    assert vllm["rope_scaling"]["rope_type"] == "llama3" and vllm["rope_theta"] == 500000.0
    with pytest.warns(UserWarning, match="accepts rope_scaling types"):
        eagle = json.loads(
            (export_drafter(drafter, tmp_path / "e", "eagle") / "config.json").read_text()
        )
    assert eagle["rope_scaling"] is None and eagle["rope_theta"] == 500000.0


def test_the_eagle_export_warns_of_a_rope_base_eagles_package_ignores(tmp_path):
    """EAGLE's PyPI package rotates with base 10000 whatever `rope_theta` says: the `eagle` export
    of a drafter for a target of another base (SmolLM2: 100000) warns, the others do not. The
    base is read from `rope_parameters`, where transformers 5.x keeps it."""

    def rope(theta: float) -> dict:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}

    target = make_tiny_model("llama", **rope(100000.0))
    assert not hasattr(target.config, "rope_theta")  # transformers 5.x: only in rope_parameters
    drafter = no_bias_fc(EagleDrafter.random(target))
    with pytest.warns(UserWarning, match="rope_theta is 100000, but EAGLE's PyPI .* base 10000"):
        out = export_drafter(drafter, tmp_path / "e", "eagle")
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 100000.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fmt in ("vllm", "sglang"):
            export_drafter(drafter, tmp_path / fmt, fmt)
        plain = make_tiny_model("llama", **rope(10000.0))
        export_drafter(EagleDrafter.random(plain), tmp_path / "plain", "eagle")


def no_bias_fc(drafter):
    with torch.no_grad():
        drafter.fc.bias.zero_()  # an all-zero bias is exportable to vLLM: nothing is lost
    return drafter


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_export_means_what_the_engines_compute(tmp_path, fmt, family):
    """Rebuild the exported drafter the way the engines do: a Llama decoder layer from the
    exported config.json without its input norm, fed fc(cat([E(x), f])) with E(x) the raw row
    of the target's table (fc's bias when the file has one), and compare it with our drafter.
    Gemma's embedding module scales its rows by sqrt(hidden), which the engines leave out: the
    export folds the factor into fc."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from eagle.decoding.masks import causal_mask

    target = make_tiny_model(family, tie_word_embeddings=False)
    drafter = perturbed(EagleDrafter.random(target, FakeTokenizer(96), path="runs/tiny", seed=2))
    source = no_bias_drafter(target) if fmt == "vllm" else drafter
    out = export_drafter(source, tmp_path / fmt, fmt)
    cfg = LlamaConfig.from_pretrained(out)
    assert (
        cfg.num_hidden_layers == 1 and cfg.rope_parameters["rope_theta"] == source.config.rope_theta
    )
    state = exported_state(out)
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias="fc.bias" in state)
    fc.load_state_dict({k.removeprefix("fc."): v for k, v in state.items() if k.startswith("fc.")})
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in state.items() if k.startswith("layers.0.")}
    )
    rotary = LlamaRotaryEmbedding(cfg)

    g = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(1, 6, 32, generator=g), torch.randint(0, 96, (1, 6), generator=g)
    with torch.no_grad():
        raw = torch.nn.functional.embedding(
            ids, target.get_input_embeddings().weight
        )  # the engines' lookup
        x = fc(torch.cat([raw, feats], -1))  # the engines: cat((inputs_embeds, hidden))
        pos = torch.arange(6)[None]
        ref = layer(
            x,
            attention_mask=causal_mask(0, 6, torch.float32),
            position_ids=pos,
            position_embeddings=rotary(x, pos),
        )
        torch.testing.assert_close(source(feats, ids), ref, atol=1e-5, rtol=1e-5)
    if family != "llama":  # and back: the import takes the factor out again
        back = import_eagle(out, target, FakeTokenizer(96))
        with torch.no_grad():
            torch.testing.assert_close(back(feats, ids), source(feats, ids), atol=1e-5, rtol=1e-5)
