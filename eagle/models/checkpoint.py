"""Drafter checkpoints in our own format: EAGLE drafters and Medusa heads.

A Hugging Face-style directory (`save_drafter` / `load_drafter`):
    config.json        DrafterConfig fields (the target identity included), plus
                       "architecture": "EagleDrafter", "format_version" and "dtype"
    model.safetensors  fc + the decoder layer only: never the target's E or LM head
Loading checks the checkpoint against the target it is given (hidden size, vocabulary,
tokenizer hash) and raises `eagle.target.TargetMismatchError` naming the difference.
Medusa heads (`save_medusa` / `load_medusa`) use the same layout and checks, with
"architecture": "MedusaHeads", MedusaConfig fields and the heads' residual blocks and
projections (`heads.{k}.blocks.{j}.linear.*`, `heads.{k}.proj.weight`) as tensors.

Formats other engines read (EAGLE's own, vLLM, SGLang): `eagle.models.export`.
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

from eagle.models.drafter import DrafterConfig, EagleDrafter
from eagle.models.medusa import MedusaConfig, MedusaHeads
from eagle.target import TargetIdentity, resolve_dtype

FORMAT_VERSION = 1
ARCHITECTURE = "EagleDrafter"
MEDUSA_ARCHITECTURE = "MedusaHeads"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
EAGLE_BIN_NAME = "pytorch_model.bin"
_META_KEYS = ("architecture", "format_version", "dtype")


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot be read; the message says which file and why."""


# ---------------------------------------------------------------------------------------
# helpers


def write_atomic(path: Path, write) -> None:
    """Write through a temporary file (this process's own), so an interrupted save never leaves
    a partial file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def read_json(path: Path, kind: str = "drafter") -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path.parent} is not a {kind} checkpoint: {path.name} is missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def check_dir(ckpt: Path, kind: str = "drafter") -> None:
    if not ckpt.exists():
        raise CheckpointError(f"{kind} checkpoint {ckpt} does not exist")
    if not ckpt.is_dir():
        raise CheckpointError(f"{kind} checkpoint {ckpt} is not a directory")


def read_safetensors(path: Path, kind: str = "drafter") -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(
            f"{path.parent} is not a complete {kind} checkpoint: {path.name} is missing"
        )
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path} is corrupt or truncated ({first})") from err


def module_weights(
    drafter: nn.Module, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors to save: `state` (a gathered state dict, e.g. FSDP's) or the module's own,
    on the CPU; never the target's modules."""
    state = drafter.state_dict() if state is None else state
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    leaked = [k for k in state if "embed" in k or "lm_head" in k]
    if leaked:  # the target's modules are never part of a drafter checkpoint
        raise RuntimeError(f"drafter state_dict holds target tensors {leaked}")
    if not state:
        raise RuntimeError(
            f"no {type(drafter).__name__} tensors to save (a sharded state dict off rank 0?)"
        )
    return state


def load_weights(drafter: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    own = drafter.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing:
        raise CheckpointError(f"{source} is missing tensors {missing}")
    if unexpected:
        raise CheckpointError(f"{source} has unexpected tensors {unexpected}")
    for key, value in state.items():
        if value.shape != own[key].shape:
            raise CheckpointError(
                f"{source}: tensor {key} has shape {tuple(value.shape)}, the config "
                f"says {tuple(own[key].shape)}"
            )
    drafter.load_state_dict(state)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def place(drafter: nn.Module, model: nn.Module, dtype) -> nn.Module:
    """On the target's device; in `dtype`, or the target's dtype (a drafter in another
    dtype than its target is a classic source of lost acceptance); in eval mode, as `load_target`
    leaves the target (training switches it back)."""
    p = next(model.parameters())
    return drafter.to(p.device, resolve_dtype(dtype) if dtype is not None else p.dtype).eval()


def validate_target(
    config: DrafterConfig | MedusaConfig,
    model: nn.Module,
    tokenizer=None,
    path: str | None = None,
    name: str = "drafter",
) -> None:
    """Raise `TargetMismatchError` if a drafter (or Medusa heads) of `config` cannot serve this
    target: hidden size, vocabulary size and (when both sides know it) the tokenizer hash must
    match. A different model family with matching shapes, and an LM head whose fingerprint
    differs from the one it was trained against (hashed only when the checkpoint records one),
    are warnings."""
    trained = TargetIdentity.from_dict(
        {**config.target, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    )
    if trained.tokenizer_hash is not None and tokenizer is None:
        warnings.warn(
            f"{name}: no tokenizer given, its tokenizer hash {trained.tokenizer_hash} was not "
            "checked",
            stacklevel=3,
        )
    given = TargetIdentity.of(
        model, tokenizer, path, with_lm_head=trained.lm_head_sha256 is not None
    )
    trained.check(given, name, head="warn")


# ---------------------------------------------------------------------------------------
# our format


def _save(
    module: nn.Module,
    config: dict,
    architecture: str,
    dir: str | os.PathLike,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `config.json` (the config plus our format keys) and `model.safetensors` (`state`,
    default the module's own state dict)."""
    from safetensors.torch import save_file

    ckpt = Path(dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    state = module_weights(module, state)
    write_atomic(
        ckpt / WEIGHTS_NAME,
        lambda p: save_file(state, str(p), metadata={"format": "pt", "architecture": architecture}),
    )
    dtype = next(iter(state.values())).dtype
    config = {
        "architecture": architecture,
        "format_version": FORMAT_VERSION,
        "dtype": dtype_name(dtype),
        **config,
    }
    write_atomic(ckpt / CONFIG_NAME, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    return ckpt


def _read_config(ckpt: Path, architecture: str, kind: str, from_dict: Callable[[dict], Any]) -> Any:
    """The config of a checkpoint written by `_save` for `architecture`: `from_dict` of its
    fields without our format keys (DrafterConfig.from_dict, MedusaConfig.from_dict)."""
    check_dir(ckpt, kind)
    data = read_json(ckpt / CONFIG_NAME, kind)
    arch = data.get("architecture")
    if arch != architecture:
        hint = (
            " (it looks like an EAGLE-format export: use eagle.models.export.import_eagle)"
            if "architectures" in data and architecture == ARCHITECTURE
            else ""
        )
        raise CheckpointError(
            f"{ckpt / CONFIG_NAME}: architecture is {arch!r}, expected {architecture!r}{hint}"
        )
    version = data.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt / CONFIG_NAME}: unsupported format_version {version!r} "
            f"(this code reads 1..{FORMAT_VERSION})"
        )
    try:
        return from_dict({k: v for k, v in data.items() if k not in _META_KEYS})
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{ckpt / CONFIG_NAME}: {err}") from err


def save_drafter(
    drafter: EagleDrafter, dir: str | os.PathLike, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write `config.json` and `model.safetensors` (fc + decoder layer) into `dir`; `state`
    replaces the drafter's own tensors (a state dict gathered from sharded processes)."""
    return _save(drafter, drafter.config.to_dict(), ARCHITECTURE, dir, state)


def load_drafter_config(dir: str | os.PathLike) -> DrafterConfig:
    """The `DrafterConfig` of a checkpoint written by `save_drafter` (weights not read)."""
    return _read_config(Path(dir), ARCHITECTURE, "drafter", DrafterConfig.from_dict)


def load_drafter(
    dir: str | os.PathLike,
    model: nn.Module,
    tokenizer=None,
    path: str | None = None,
    dtype: str | torch.dtype | None = None,
) -> EagleDrafter:
    """Load a drafter saved by `save_drafter` for `model` (checked against it), on the
    target's device, in `dtype` (default: the target's dtype)."""
    ckpt = Path(dir)
    config = load_drafter_config(ckpt)
    validate_target(config, model, tokenizer, path, name=f"drafter {ckpt}")
    state = read_safetensors(ckpt / WEIGHTS_NAME)
    drafter = EagleDrafter.on_target(config, model)
    load_weights(drafter, state, ckpt / WEIGHTS_NAME)
    return place(drafter, model, dtype)


def save_medusa(
    heads: MedusaHeads, dir: str | os.PathLike, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write Medusa heads (`config.json`, `model.safetensors`) into `dir` (`state`: as
    `save_drafter`)."""
    return _save(heads, heads.config.to_dict(), MEDUSA_ARCHITECTURE, dir, state)


def load_medusa(
    dir: str | os.PathLike,
    model: nn.Module,
    tokenizer=None,
    path: str | None = None,
    dtype: str | torch.dtype | None = None,
) -> MedusaHeads:
    """Load Medusa heads saved by `save_medusa` for `model` (checked against it, as drafters
    are), on the target's device, in `dtype` (default: the target's dtype)."""
    ckpt = Path(dir)
    config = _read_config(ckpt, MEDUSA_ARCHITECTURE, "Medusa", MedusaConfig.from_dict)
    validate_target(config, model, tokenizer, path, name=f"Medusa heads {ckpt}")
    heads = MedusaHeads(config)
    load_weights(heads, read_safetensors(ckpt / WEIGHTS_NAME, "Medusa"), ckpt / WEIGHTS_NAME)
    return place(heads, model, dtype)
