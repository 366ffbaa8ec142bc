"""Drafters in the formats serving engines load: EAGLE's own code, vLLM and SGLang.

All three build the same model (read from their sources; the tests cite file and line): `fc`
over `cat([embed(x), hidden])` (ours is `[hidden; embed]`: the export swaps the column halves),
then one Llama decoder layer whose `input_layernorm` is removed, no final norm, and the
target's embeddings and LM head. Tensor names carry no `model.` prefix (vLLM and SGLang add
it): `fc.weight`, `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`. They
differ in the rest:

- `eagle` (SafeAILab/EAGLE): architectures LlamaForCausalLM; fc bias per config `"bias"` (absent
  = true); pytorch_model.bin, with `embed_tokens.weight`; its config class rejects Llama-3
  `rope_scaling`.
- `vllm` (EagleLlamaForCausalLM): LlamaForCausalLM (vLLM prefixes "Eagle"); no fc bias (built
  without, `fc.bias` dropped); model.safetensors; never `lm_head`/`norm`/`input_layernorm`
  tensors, and `"bias": true` would mean attention biases.
- `sglang` (LlamaForCausalLMEagle): LlamaForCausalLMEagle (matched exactly); always an fc bias
  (zeros written where the drafter has none); model.safetensors; the same `"bias"` trap.

All three look up the raw rows of the target's embedding table, where our drafter reads them
through the target's module: Gemma's scales them by sqrt(hidden), so the export folds that
factor into fc's embedding columns (and the import takes it out). The target's logit
transform goes into the config (`logit_scale`, read by vLLM; `final_logit_softcapping`, read by
SGLang; the others warn that their draft distributions will differ). vLLM's and SGLang's MLP
runs silu only, and EAGLE's attention takes head_dim = hidden / heads: the export refuses
drafters they could not load.

EAGLE's PyPI package builds its rotary embedding with base 10000 whatever the config's
`rope_theta` says, so the `eagle` export warns for a target of another base (SmolLM2's is
100000): served by that package, the drafter would rotate its positions wrongly and draft for
another model.

vLLM's "speculators" format has no EAGLE-1 variant in current vLLM (only EAGLE-3 and later
are registered), so it is not written. A drafter trained with an fc bias cannot be served by
vLLM's loader: train with `model.fc_bias=false` for it (`export_drafter` refuses otherwise).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
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
    load_drafter,
    load_weights,
    module_weights,
    place,
    read_json,
    read_safetensors,
    validate_target,
    write_atomic,
)
from eagle.models.drafter import DrafterConfig, EagleDrafter
from eagle.target import TargetIdentity, embeddings, load_target

FORMATS = ("eagle", "vllm", "sglang")
ARCHITECTURES = {
    "eagle": "LlamaForCausalLM",
    "vllm": "LlamaForCausalLM",
    "sglang": "LlamaForCausalLMEagle",
}
EAGLE_ROPE_TYPES = (
    "linear",
    "dynamic",
)  # what SafeAILab/EAGLE's config class accepts in rope_scaling
EAGLE_ROPE_THETA = 10000.0  # the RoPE base EAGLE's PyPI package builds, whatever the config says


class ExportError(ValueError):
    """A drafter that cannot be written in the format asked for; the message says why and what to
    do."""


def embed_scale(embed: nn.Module) -> float:
    """The factor a target's embedding module multiplies its rows by: sqrt(hidden) for Gemma
    (transformers' `*ScaledWordEmbedding`), 1 elsewhere. Our drafter reads E(x) through the
    module, scaled; the engines look up the raw rows of the target's table (vLLM's Gemma, for
    one, scales outside the module), so the export folds the factor into fc's embedding
    columns and the import takes it out."""
    scale = getattr(embed, "scalar_embed_scale", None)
    if scale is None:
        scale = getattr(embed, "embed_scale", 1.0)
    return float(scale)


def _fold_embed_scale(w: torch.Tensor, scale: float, columns: slice) -> torch.Tensor:
    """(H, 2H) fc weight with `columns` (the embedding half) multiplied by `scale`, in float32."""
    if scale == 1.0:
        return w
    w = w.float().clone()
    w[:, columns] *= scale
    return w


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """(H, 2H) fc weight: [A | B] -> [B | A]; the permutation is its own inverse."""
    h = w.shape[1] // 2
    return torch.cat([w[:, h:], w[:, :h]], dim=1).contiguous()


def _rope_scaling(cfg: DrafterConfig, fmt: str) -> dict | None:
    """The `rope_scaling` entry (transformers-4 names, which all three engines read)."""
    rope = dict(cfg.rope_parameters)
    rope_type = rope.pop("rope_type", "default")
    rope.pop("rope_theta", None)
    if rope_type == "default":
        return None
    if fmt == "eagle" and rope_type not in EAGLE_ROPE_TYPES:
        # EAGLE's EConfig raises on any other dict (e.g. Llama-3's "llama3"): its released
        # Llama-3 drafters are written without scaling, which is what its code then runs
        warnings.warn(
            f"EAGLE's config class accepts rope_scaling types {EAGLE_ROPE_TYPES} only: the "
            f"drafter's {rope_type!r} scaling is left out (as in EAGLE's own Llama-3 drafters); "
            "EAGLE's code will run it with plain RoPE",
            stacklevel=3,
        )
        return None
    if fmt == "eagle":  # exactly two keys, or EConfig raises
        return {"type": rope_type, "factor": rope["factor"]}
    return {"rope_type": rope_type, **rope}


def rope_theta(cfg: DrafterConfig) -> float:
    """The drafter's RoPE base, the target's. Transformers 5.x keeps it in `rope_parameters`
    (a config may have no top-level `rope_theta`), so it is read there first."""
    return float((cfg.rope_parameters or {}).get("rope_theta", cfg.rope_theta))


def _warn_eagle_rope_theta(cfg: DrafterConfig) -> None:
    """EAGLE's PyPI package ignores `rope_theta`: another base decodes wrongly there."""
    theta = rope_theta(cfg)
    if theta != EAGLE_ROPE_THETA:
        warnings.warn(
            f"the target's rope_theta is {theta:g}, but EAGLE's PyPI package "
            f"(eagle-llm) builds its rotary embedding with base {EAGLE_ROPE_THETA:g} "
            "whatever the config says: served by it, this drafter drafts for another "
            "model. Serve the vllm or sglang export, or an EAGLE built from its "
            "repository",
            stacklevel=4,
        )


def engine_config(drafter: EagleDrafter, fmt: str) -> dict:
    """The one-layer Llama `config.json` engine `fmt` reads for this drafter."""
    cfg = drafter.config
    config = {
        "architectures": [ARCHITECTURES[fmt]],
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
        "rope_theta": rope_theta(cfg),
        "rope_scaling": _rope_scaling(cfg, fmt),
        "attention_bias": False,  # vLLM and SGLang read attention biases from here or from "bias"
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "pretraining_tp": 1,
        "torch_dtype": dtype_name(drafter.dtype),
        "eagle_target": dict(
            cfg.target
        ),  # ours: what the drafter was trained for; engines ignore it
    }
    if fmt == "eagle":
        config["bias"] = cfg.fc_bias  # EAGLE's key for the fc bias (absent means true)
        _warn_eagle_rope_theta(cfg)
    transform = (
        drafter.logit_transform
    )  # the target's: the engines read it from the drafter's config
    if transform.scale != 1.0:
        config["logit_scale"] = transform.scale  # vLLM's EAGLE model multiplies by it
    if transform.softcap is not None:
        config["final_logit_softcapping"] = (
            transform.softcap
        )  # SGLang's logits processor caps with it
        if fmt != "sglang":
            warnings.warn(
                f"the target soft-caps its logits at {transform.softcap}; the {fmt} EAGLE model "
                "does not, "
                "so its draft distributions differ from ours (greedy drafts do not)",
                stacklevel=3,
            )
    return config


def export_drafter(drafter: EagleDrafter, out_dir: str | os.PathLike, fmt: str = "vllm") -> Path:
    """Write `drafter` in engine format `fmt` ("eagle", "vllm" or "sglang") into `out_dir`."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        hint = " (vLLM's speculators format has no EAGLE-1 variant)" if fmt == "speculators" else ""
        raise ExportError(f"unknown export format {fmt!r}{hint}; choose one of {FORMATS}")
    if drafter.config.inputs != "shifted":
        raise ExportError(
            f"this drafter reads inputs={drafter.config.inputs!r} (an ablation); the engines build "
            "EAGLE-1's fc over [E(x_t); f_{t-1}] only"
        )
    cfg = drafter.config
    if fmt in ("vllm", "sglang") and cfg.hidden_act != "silu":
        raise ExportError(
            f"{fmt}'s EAGLE-1 model builds a Llama MLP, which supports only silu; this drafter's "
            f"layer uses {cfg.hidden_act!r} (its target's)"
        )
    if fmt == "eagle" and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ExportError(
            "EAGLE's code takes head_dim = hidden_size / heads = "
            f"{cfg.hidden_size // cfg.num_attention_heads}, "
            f"this drafter's is {cfg.head_dim}: export it for vllm or sglang"
        )
    state = module_weights(drafter)
    hidden, dtype = cfg.hidden_size, state["fc.weight"].dtype
    fc = _fold_embed_scale(
        state["fc.weight"], embed_scale(drafter.embed_tokens), slice(hidden, None)
    )
    state["fc.weight"] = _swap_halves(fc).to(dtype)  # ours [f; E] -> the engines' [E; f]
    has_bias = "fc.bias" in state
    if fmt == "vllm" and has_bias:
        if state["fc.bias"].abs().max() > 0:
            raise ExportError(
                "vLLM's EAGLE loader builds fc without a bias and drops fc.bias: this drafter's "
                "bias "
                "would be lost. Train it with model.fc_bias=false to serve it with vLLM"
            )
        state.pop("fc.bias")  # all zeros: nothing is lost
    if fmt == "sglang" and not has_bias:  # SGLang's fc always has one, loaded from the file
        state["fc.bias"] = torch.zeros(drafter.config.hidden_size, dtype=state["fc.weight"].dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = engine_config(drafter, fmt)
    # SafeAILab/EAGLE reads pytorch_model.bin first; its 1.2 release strictly, with the embeddings
    if fmt == "eagle":
        emb = drafter.embed_tokens.weight.detach().to("cpu", drafter.dtype).contiguous()
        write_atomic(
            out / EAGLE_BIN_NAME, lambda p: torch.save({**state, "embed_tokens.weight": emb}, p)
        )
    else:
        write_atomic(
            out / WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"})
        )
    write_atomic(out / CONFIG_NAME, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    return out


def export_formats(
    target: str,
    drafter: str,
    formats: Sequence[str] | None,
    out_dir: str | os.PathLike,
    dtype: str | None = None,
) -> Path:
    """Write the drafter saved in `drafter` (checked against the target in `target`) in each of
    `formats`, one folder each under `out_dir`. A format named there that cannot hold it is
    named with the reason, after the others are written. None writes every format that can
    hold it and says why it skips the others. Only the target's embeddings and LM head are read
    (the export's embedding table and logit transform): a 70B target is not loaded whole."""
    model, tokenizer = load_target(target, weights="head")
    loaded = load_drafter(drafter, model, tokenizer, str(target), dtype=dtype)
    out, refused = Path(out_dir), []
    for fmt in FORMATS if formats is None else formats:
        try:
            print(f"[export] {fmt}: {export_drafter(loaded, out / fmt, fmt)}")
        except ExportError as err:
            if formats is None:
                print(f"[export] {fmt}: skipped: {err}")
            else:
                refused.append(f"{fmt}: {err}")
    if refused:
        raise ExportError("; ".join(refused))
    return out


def import_eagle(
    dir: str | os.PathLike,
    model: nn.Module,
    tokenizer=None,
    path: str | None = None,
    dtype: str | torch.dtype | None = None,
) -> EagleDrafter:
    """Load an EAGLE-1 drafter in any engine format (ours exported, or a published one) for `model`.

    Reads `model.safetensors`, else `pytorch_model.bin`; drops the embedding table and LM head
    (the target's are used). The fc has a bias when the file holds one or the config says
    `"bias": true`.
    """
    src = Path(dir)
    check_dir(src)
    data = read_json(src / CONFIG_NAME)
    if data.get("architecture") == ARCHITECTURE:
        raise CheckpointError(
            f"{src} is in our own format: use eagle.models.checkpoint.load_drafter"
        )
    layers = data.get("num_hidden_layers", 1)
    if layers != 1:
        raise CheckpointError(
            f"{src / CONFIG_NAME}: num_hidden_layers is {layers}; an EAGLE-1 drafter has 1"
        )
    state, weights_path = _read_weights(src)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    state.pop("embed_tokens.weight", None)  # the target's own table is used
    state.pop("lm_head.weight", None)
    if "fc.weight" not in state:
        raise CheckpointError(f"{weights_path} is missing tensors ['fc.weight']")
    fc = state["fc.weight"]
    scale = embed_scale(embeddings(model))  # the engines feed raw rows; ours come scaled (Gemma)
    state["fc.weight"] = _fold_embed_scale(
        _swap_halves(fc), 1.0 / scale, slice(fc.shape[1] // 2, None)
    ).to(fc.dtype)
    try:
        config = _drafter_config(
            data, model, tokenizer, path, fc_bias="fc.bias" in state or data.get("bias") is True
        )
    except KeyError as err:
        raise CheckpointError(f"{src / CONFIG_NAME} lacks key {err}") from err
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{src / CONFIG_NAME}: {err}") from err
    validate_target(config, model, tokenizer, path, name=f"drafter {src}")
    if config.fc_bias and "fc.bias" not in state:  # "bias": true without the tensor
        raise CheckpointError(
            f"{weights_path}: the config says the fc has a bias, the file holds no fc.bias"
        )
    drafter = EagleDrafter.on_target(config, model)
    load_weights(drafter, state, weights_path)
    return place(drafter, model, dtype)


def _read_weights(src: Path) -> tuple[dict[str, torch.Tensor], Path]:
    if (src / WEIGHTS_NAME).is_file():
        return read_safetensors(src / WEIGHTS_NAME), src / WEIGHTS_NAME
    if (src / EAGLE_BIN_NAME).is_file():
        try:
            return torch.load(
                src / EAGLE_BIN_NAME, map_location="cpu", weights_only=True
            ), src / EAGLE_BIN_NAME
        except Exception as err:  # torch.load raises many types on a bad file
            raise CheckpointError(
                f"{src / EAGLE_BIN_NAME} is corrupt or not a state dict ({err})"
            ) from err
    raise CheckpointError(f"{src} holds neither {WEIGHTS_NAME} nor {EAGLE_BIN_NAME}")


def _drafter_config(data: dict, model: nn.Module, tokenizer, path, fc_bias: bool) -> DrafterConfig:
    """Our `DrafterConfig` from an engine's one-layer Llama config."""
    heads = data["num_attention_heads"]
    theta = float(data.get("rope_theta", 10000.0))
    scaling = dict(data.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)  # "type" is the old spelling of "rope_type"
    ident = TargetIdentity.of(model, tokenizer, path)
    trained = data.get("eagle_target") or {
        "target_path": ident.target_path,
        "model_type": ident.model_type,
    }
    return DrafterConfig(
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
        rope_parameters={**scaling, "rope_type": rope_type, "rope_theta": theta},
        fc_bias=fc_bias,
    )
