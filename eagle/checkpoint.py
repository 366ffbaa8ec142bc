"""Drafter checkpoints (EAGLE drafters and Medusa heads): our own format, and EAGLE's
format for other engines.

Our format (`save_drafter` / `load_drafter`), a Hugging Face-style directory:
    config.json        DrafterConfig fields (the target identity included), plus
                       "architecture": "EagleDrafter", "format_version" and "dtype"
    model.safetensors  fc + the decoder layer only: never the target's E or LM head
Loading checks the checkpoint against the target it is given (hidden size, vocabulary,
tokenizer hash) and raises `DrafterMismatchError` naming the difference.
Medusa heads (`save_medusa` / `load_medusa`) use the same layout and checks, with
"architecture": "MedusaHeads", MedusaConfig fields and the heads' residual blocks and
projections (`heads.{k}.blocks.{j}.linear.*`, `heads.{k}.proj.weight`) as tensors.

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
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle.drafter import DrafterConfig, EagleDrafter
from eagle.medusa import MedusaConfig, MedusaHeads
from eagle.target import embeddings, lm_head, resolve_dtype, target_identity

FORMAT_VERSION = 1
ARCHITECTURE = "EagleDrafter"
MEDUSA_ARCHITECTURE = "MedusaHeads"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
EAGLE_BIN_NAME = "pytorch_model.bin"
_META_KEYS = ("architecture", "format_version", "dtype")


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot be read; the message says which file and why."""


class DrafterMismatchError(CheckpointError):
    """A drafter (or Medusa heads) trained for another target (hidden size, vocabulary, tokenizer)."""


# ---------------------------------------------------------------------------------------
# helpers


def _write_atomic(path: Path, write) -> None:
    """Write through a temporary file, so an interrupted save never leaves a partial file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _read_json(path: Path, kind: str = "drafter") -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path.parent} is not a {kind} checkpoint: {path.name} is missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _check_dir(ckpt: Path, kind: str = "drafter") -> None:
    if not ckpt.exists():
        raise CheckpointError(f"{kind} checkpoint {ckpt} does not exist")
    if not ckpt.is_dir():
        raise CheckpointError(f"{kind} checkpoint {ckpt} is not a directory")


def _read_safetensors(path: Path, kind: str = "drafter") -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"{path.parent} is not a complete {kind} checkpoint: {path.name} is missing")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path} is corrupt or truncated ({first})") from err


def _weights(drafter: nn.Module) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    leaked = [k for k in state if "embed" in k or "lm_head" in k]
    if leaked:  # the target's modules are never part of a drafter checkpoint
        raise RuntimeError(f"drafter state_dict holds target tensors {leaked}")
    return state


def _load_weights(drafter: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    own = drafter.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing:
        raise CheckpointError(f"{source} is missing tensors {missing}")
    if unexpected:
        raise CheckpointError(f"{source} has unexpected tensors {unexpected}")
    for key, value in state.items():
        if value.shape != own[key].shape:
            raise CheckpointError(f"{source}: tensor {key} has shape {tuple(value.shape)}, the config "
                                  f"says {tuple(own[key].shape)}")
    drafter.load_state_dict(state)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _place(drafter: nn.Module, model: nn.Module, dtype) -> nn.Module:
    """On the target's device; in `dtype`, or the target's dtype (a drafter in another
    dtype than its target is a classic source of lost acceptance)."""
    p = next(model.parameters())
    return drafter.to(p.device, resolve_dtype(dtype) if dtype is not None else p.dtype)


def validate_target(config: DrafterConfig | MedusaConfig, model: nn.Module, tokenizer=None,
                    path: str | None = None, name: str = "drafter") -> None:
    """Raise `DrafterMismatchError` if a drafter (or Medusa heads) of `config` cannot serve this target.

    Hidden size, vocabulary size and (when both sides know it) the tokenizer hash must match;
    a different model_type with matching shapes is only a warning.
    """
    ident = target_identity(model, tokenizer, path)
    trained = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size, **config.target}
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size")):
        if trained[key] != ident[key]:
            raise DrafterMismatchError(f"{name} was trained for a target with {what} {trained[key]}, "
                                       f"this target has {ident[key]}")
    want, have = trained.get("tokenizer_hash"), ident.get("tokenizer_hash")
    if want is not None and have is not None and want != have:
        raise DrafterMismatchError(f"{name} was trained for a target whose tokenizer hash is {want}, this "
                                   f"target's tokenizer hashes to {have} (different vocabulary or special tokens)")
    if want is not None and tokenizer is None:
        warnings.warn(f"{name}: no tokenizer given, its tokenizer hash {want} was not checked", stacklevel=3)
    if trained.get("model_type") and trained["model_type"] != ident["model_type"]:
        warnings.warn(f"{name} was trained for a {trained['model_type']} target, this one is "
                      f"{ident['model_type']}; the shapes match, loading anyway", stacklevel=3)


# ---------------------------------------------------------------------------------------
# our format


def _save(module: nn.Module, config: dict, architecture: str, dir: str | os.PathLike) -> Path:
    """Write `config.json` (the config plus our format keys) and `model.safetensors`."""
    from safetensors.torch import save_file

    ckpt = Path(dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    state = _weights(module)
    _write_atomic(ckpt / WEIGHTS_NAME,
                  lambda p: save_file(state, str(p), metadata={"format": "pt", "architecture": architecture}))
    dtype = next(module.parameters()).dtype
    config = {"architecture": architecture, "format_version": FORMAT_VERSION, "dtype": _dtype_name(dtype), **config}
    _write_atomic(ckpt / CONFIG_NAME, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    return ckpt


def _read_config(ckpt: Path, architecture: str, kind: str, from_dict: Callable[[dict], Any]) -> Any:
    """The config of a checkpoint written by `_save` for `architecture`: `from_dict` of its
    fields without our format keys (DrafterConfig.from_dict, MedusaConfig.from_dict)."""
    _check_dir(ckpt, kind)
    data = _read_json(ckpt / CONFIG_NAME, kind)
    arch = data.get("architecture")
    if arch != architecture:
        hint = (" (it looks like an EAGLE-format export: use eagle.checkpoint.import_eagle)"
                if "architectures" in data and architecture == ARCHITECTURE else "")
        raise CheckpointError(f"{ckpt / CONFIG_NAME}: architecture is {arch!r}, expected {architecture!r}{hint}")
    version = data.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(f"{ckpt / CONFIG_NAME}: unsupported format_version {version!r} "
                              f"(this code reads 1..{FORMAT_VERSION})")
    try:
        return from_dict({k: v for k, v in data.items() if k not in _META_KEYS})
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{ckpt / CONFIG_NAME}: {err}") from err


def save_drafter(drafter: EagleDrafter, dir: str | os.PathLike) -> Path:
    """Write `config.json` and `model.safetensors` (fc + decoder layer) into `dir`."""
    return _save(drafter, drafter.config.to_dict(), ARCHITECTURE, dir)


def load_drafter_config(dir: str | os.PathLike) -> DrafterConfig:
    """The `DrafterConfig` of a checkpoint written by `save_drafter` (weights not read)."""
    return _read_config(Path(dir), ARCHITECTURE, "drafter", DrafterConfig.from_dict)


def load_drafter(dir: str | os.PathLike, model: nn.Module, tokenizer=None, path: str | None = None,
                 dtype: str | torch.dtype | None = None) -> EagleDrafter:
    """Load a drafter saved by `save_drafter` for `model` (checked against it), on the
    target's device, in `dtype` (default: the target's dtype)."""
    ckpt = Path(dir)
    config = load_drafter_config(ckpt)
    validate_target(config, model, tokenizer, path, name=f"drafter {ckpt}")
    state = _read_safetensors(ckpt / WEIGHTS_NAME)
    drafter = EagleDrafter(config, embeddings(model), lm_head(model))
    _load_weights(drafter, state, ckpt / WEIGHTS_NAME)
    return _place(drafter, model, dtype)


def save_medusa(heads: MedusaHeads, dir: str | os.PathLike) -> Path:
    """Write Medusa heads (`config.json`, `model.safetensors`) into `dir`."""
    return _save(heads, heads.config.to_dict(), MEDUSA_ARCHITECTURE, dir)


def load_medusa(dir: str | os.PathLike, model: nn.Module, tokenizer=None, path: str | None = None,
                dtype: str | torch.dtype | None = None) -> MedusaHeads:
    """Load Medusa heads saved by `save_medusa` for `model` (checked against it, as drafters
    are), on the target's device, in `dtype` (default: the target's dtype)."""
    ckpt = Path(dir)
    config = _read_config(ckpt, MEDUSA_ARCHITECTURE, "Medusa", MedusaConfig.from_dict)
    validate_target(config, model, tokenizer, path, name=f"Medusa heads {ckpt}")
    heads = MedusaHeads(config)
    _load_weights(heads, _read_safetensors(ckpt / WEIGHTS_NAME, "Medusa"), ckpt / WEIGHTS_NAME)
    return _place(heads, model, dtype)


# ---------------------------------------------------------------------------------------
# EAGLE's format


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
        "torch_dtype": _dtype_name(drafter.dtype),
        "eagle_target": dict(cfg.target),  # ours: what the drafter was trained for; others ignore it
    }


def export_eagle(drafter: EagleDrafter, dir: str | os.PathLike, eagle_repo: bool = False) -> Path:
    """Write the drafter in EAGLE's format (see the module docstring for which engine reads
    which file). `eagle_repo=True` also writes `pytorch_model.bin` with the target's
    `embed_tokens.weight`, which SafeAILab/EAGLE's strict loader requires."""
    from safetensors.torch import save_file

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    state = _weights(drafter)
    state["fc.weight"] = _swap_halves(state["fc.weight"])  # ours [f; E] -> EAGLE's [E; f]
    _write_atomic(out / WEIGHTS_NAME, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    if eagle_repo:
        emb = drafter.embed_tokens.weight.detach().to("cpu", drafter.dtype).contiguous()
        _write_atomic(out / EAGLE_BIN_NAME, lambda p: torch.save({**state, "embed_tokens.weight": emb}, p))
    _write_atomic(out / CONFIG_NAME, lambda p: p.write_text(json.dumps(eagle_config(drafter), indent=2) + "\n"))
    return out


def import_eagle(dir: str | os.PathLike, model: nn.Module, tokenizer=None, path: str | None = None,
                 dtype: str | torch.dtype | None = None) -> EagleDrafter:
    """Load an EAGLE-1 format drafter (ours exported, or a published one) for `model`.

    Reads `model.safetensors`, else `pytorch_model.bin`; drops the embedding table (the
    target's is used); a missing `fc.bias` (drafters trained without one) becomes zeros.
    """
    src = Path(dir)
    _check_dir(src)
    data = _read_json(src / CONFIG_NAME)
    if data.get("architecture") == ARCHITECTURE:
        raise CheckpointError(f"{src} is in our own format: use eagle.checkpoint.load_drafter")
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
        ident = target_identity(model, tokenizer, path)
        trained = data.get("eagle_target") or {k: ident[k] for k in ("target_path", "model_type")}
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
        state = _read_safetensors(weights_path)
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
    _load_weights(drafter, state, weights_path)
    return _place(drafter, model, dtype)
