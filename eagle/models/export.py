"""Drafters in the formats other engines read (EAGLE's own, vLLM, SGLang).

EAGLE's format (`export_eagle` / `import_eagle`), as published drafters such as
yuhuili/EAGLE-llama2-chat-7B have it and as engines load it:
    config.json        a one-layer LlamaConfig ("architectures": ["LlamaForCausalLM"])
    model.safetensors  fc.weight, fc.bias, layers.0.self_attn.{q,k,v,o}_proj.weight,
                       layers.0.mlp.{gate,up,down}_proj.weight,
                       layers.0.post_attention_layernorm.weight
with the fc columns in EAGLE's order `[E(x); f]` (ours is `[f; E(x)]`). Who reads what:
  - vLLM (`EagleLlamaForCausalLM`, models/llama_eagle.py) and SGLang
    (`LlamaForCausalLMEagle`) load `model.safetensors` (or `*.bin`), prefix the names with
    `model.`, and take the embeddings (and LM head) from the target when they are absent.
  - SafeAILab/EAGLE's `EaModel.from_pretrained` reads only `pytorch_model.bin`, strictly,
    including `embed_tokens.weight`: `export_eagle(..., eagle_repo=True)` writes that file too.
  - fc bias: EAGLE-1 drafters have one (EAGLE reads config key "bias", default true). vLLM
    uses "bias" for attention biases and "eagle_fc_bias" for the fc, so we write
    "eagle_fc_bias": true and leave "bias" out. Some vLLM releases build the fc without a
    bias whatever the config says and skip `fc.bias` silently: check yours.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from eagle.models.checkpoint import (
    ARCHITECTURE,
    CONFIG_NAME,
    EAGLE_BIN_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    check_dir,
    dtype_name,
    load_weights,
    module_weights,
    place,
    read_json,
    read_safetensors,
    validate_target,
    write_atomic,
)
from eagle.models.drafter import DrafterConfig, EagleDrafter
from eagle.target import TargetIdentity, embeddings, lm_head


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """(H, 2H) fc weight: [A | B] -> [B | A]; the permutation is its own inverse."""
    h = w.shape[1] // 2
    return torch.cat([w[:, h:], w[:, :h]], dim=1).contiguous()


def eagle_config(drafter: EagleDrafter) -> dict:
    """EAGLE's Llama-style config.json for a drafter (transformers 4.x names for RoPE, which
    EAGLE, vLLM and SGLang read; transformers 5 converts them on load)."""
    cfg = drafter.config
    rope = dict(cfg.rope_parameters)
    rope_type = rope.pop("rope_type", "default")
    rope.pop("rope_theta", None)
    scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "eagle_fc_bias": True,  # vLLM's key for fc.bias ("bias" would switch on attention biases there)
        "torch_dtype": dtype_name(drafter.dtype),
        "eagle_target": dict(cfg.target),  # ours: what the drafter was trained for; others ignore it
    }


def export_eagle(drafter: EagleDrafter, dir: str | os.PathLike, eagle_repo: bool = False) -> Path:
    """Write the drafter in EAGLE's format (see the module docstring for which engine reads
    which file). `eagle_repo=True` also writes `pytorch_model.bin` with the target's
    `embed_tokens.weight`, which SafeAILab/EAGLE's strict loader requires."""
    from safetensors.torch import save_file

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    state = module_weights(drafter)
    state["fc.weight"] = _swap_halves(state["fc.weight"])  # ours [f; E] -> EAGLE's [E; f]
    write_atomic(out / WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    if eagle_repo:
        emb = drafter.embed_tokens.weight.detach().to("cpu", drafter.dtype).contiguous()
        write_atomic(out / EAGLE_BIN_NAME, lambda p: torch.save({**state, "embed_tokens.weight": emb}, p))
    write_atomic(out / CONFIG_NAME, lambda p: p.write_text(json.dumps(eagle_config(drafter), indent=2) + "\n"))
    return out


def import_eagle(dir: str | os.PathLike, model: nn.Module, tokenizer=None, path: str | None = None,
                 dtype: str | torch.dtype | None = None) -> EagleDrafter:
    """Load an EAGLE-1 format drafter (ours exported, or a published one) for `model`.

    Reads `model.safetensors`, else `pytorch_model.bin`; drops the embedding table (the
    target's is used); a missing `fc.bias` (drafters trained without one) becomes zeros.
    """
    src = Path(dir)
    check_dir(src)
    data = read_json(src / CONFIG_NAME)
    if data.get("architecture") == ARCHITECTURE:
        raise CheckpointError(f"{src} is in our own format: use eagle.models.checkpoint.load_drafter")
    layers = data.get("num_hidden_layers", 1)
    if layers != 1:
        raise CheckpointError(f"{src / CONFIG_NAME}: num_hidden_layers is {layers}; an EAGLE-1 drafter has 1")
    try:
        heads = data["num_attention_heads"]
        theta = float(data.get("rope_theta", 10000.0))
        scaling = dict(data.get("rope_scaling") or {})
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)  # "type" is the old spelling of "rope_type"
        rope = {**scaling, "rope_type": rope_type, "rope_theta": theta}
        ident = TargetIdentity.of(model, tokenizer, path)
        trained = data.get("eagle_target") or {"target_path": ident.target_path, "model_type": ident.model_type}
        config = DrafterConfig(
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or data["hidden_size"] // heads,
            vocab_size=data["vocab_size"],
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            hidden_act=data.get("hidden_act", "silu"),
            target={**trained, "hidden_size": data["hidden_size"], "vocab_size": data["vocab_size"]},
            rope_parameters=rope,
        )
    except KeyError as err:
        raise CheckpointError(f"{src / CONFIG_NAME} lacks key {err}") from err
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{src / CONFIG_NAME}: {err}") from err
    validate_target(config, model, tokenizer, path, name=f"drafter {src}")

    if (src / WEIGHTS_NAME).is_file():
        weights_path = src / WEIGHTS_NAME
        state = read_safetensors(weights_path)
    elif (src / EAGLE_BIN_NAME).is_file():
        weights_path = src / EAGLE_BIN_NAME
        try:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch.load raises many types on a bad file
            raise CheckpointError(f"{weights_path} is corrupt or not a state dict ({err})") from err
    else:
        raise CheckpointError(f"{src} holds neither {WEIGHTS_NAME} nor {EAGLE_BIN_NAME}")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    state.pop("embed_tokens.weight", None)  # the target's own table is used
    state.pop("lm_head.weight", None)
    if "fc.weight" not in state:
        raise CheckpointError(f"{weights_path} is missing tensors ['fc.weight']")
    state["fc.weight"] = _swap_halves(state["fc.weight"])  # EAGLE's [E; f] -> ours [f; E]
    if "fc.bias" not in state:
        state["fc.bias"] = torch.zeros(config.hidden_size, dtype=state["fc.weight"].dtype)
    drafter = EagleDrafter(config, embeddings(model), lm_head(model))
    load_weights(drafter, state, weights_path)
    return place(drafter, model, dtype)
