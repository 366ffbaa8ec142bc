"""Drafter checkpoints: round trips, target validation, clear errors, EAGLE-format export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eagle.models.checkpoint import CheckpointError, load_drafter, save_drafter
from eagle.models.drafter import EagleDrafter
from eagle.models.export import export_eagle, import_eagle
from eagle.target import TargetMismatchError
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
    assert loaded.config == drafter.config
    assert torch.equal(outputs(loaded), outputs(drafter))
    assert load_drafter(tmp_path / "d", target, FakeTokenizer(96), dtype="bfloat16").dtype == torch.bfloat16


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
    with pytest.raises(TargetMismatchError, match=f"drafter {where} was made for another target: hidden_size 32 != 64"):
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


def test_export_import_round_trip_and_eagle_layout(tmp_path, target, drafter):
    out = export_eagle(drafter, tmp_path / "eagle", eagle_repo=True)
    h = drafter.config.hidden_size
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        fc = f.get_tensor("fc.weight")  # (H, 2H) in EAGLE's [E(x); f] column order
    assert names == set(drafter.state_dict())  # fc.*, layers.0.*: EAGLE's names
    assert "layers.0.input_layernorm.weight" not in names
    assert torch.equal(fc[:, :h], drafter.fc.weight[:, h:])  # embedding columns first
    assert torch.equal(fc[:, h:], drafter.fc.weight[:, :h])

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["eagle_fc_bias"] is True and "bias" not in config
    bin_state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert torch.equal(bin_state["embed_tokens.weight"], target.model.embed_tokens.weight)

    back = import_eagle(out, target, FakeTokenizer(96))
    assert torch.equal(outputs(back), outputs(drafter))
    (out / "model.safetensors").unlink()  # SafeAILab's file alone imports the same
    assert torch.equal(outputs(import_eagle(out, target, FakeTokenizer(96))), outputs(drafter))
    with pytest.raises(TargetMismatchError, match="hidden_size 32 != 64"):
        import_eagle(out, make_tiny_model("llama", hidden_size=64))


def test_export_means_what_eagle_engines_compute(tmp_path, target, drafter):
    """Rebuild the exported drafter the way EAGLE / vLLM / SGLang do: a Llama decoder layer
    from the exported config.json without its input norm, fed fc([E(x); f])."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from eagle.decoding.masks import causal_mask

    out = export_eagle(drafter, tmp_path / "eagle")
    cfg = LlamaConfig.from_pretrained(out)
    assert cfg.num_hidden_layers == 1 and cfg.rope_parameters["rope_theta"] == drafter.config.rope_theta
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size)
    fc.load_state_dict({"weight": state["fc.weight"], "bias": state["fc.bias"]})
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in state.items() if k.startswith("layers.0.")})
    rotary = LlamaRotaryEmbedding(cfg)

    g = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(1, 6, 32, generator=g), torch.randint(0, 96, (1, 6), generator=g)
    with torch.no_grad():
        x = fc(torch.cat([target.model.embed_tokens(ids), feats], -1))  # EAGLE: cat((inputs_embeds, hidden))
        pos = torch.arange(6)[None]
        ref = layer(x, attention_mask=causal_mask(0, 6, torch.float32), position_ids=pos,
                    position_embeddings=rotary(x, pos))
        torch.testing.assert_close(drafter(feats, ids), ref, atol=1e-5, rtol=1e-5)
