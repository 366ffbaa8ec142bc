"""Target access: load any Hugging Face causal LM and expose what EAGLE needs from it.

EAGLE reads three things from the target: the input embeddings `E`, the LM head, and the
*feature* `f_t`, the hidden state that feeds the LM head (after the final norm). We get the
feature from the decoder body (`model.base_model`), whose `last_hidden_state` is exactly
that tensor for Llama, Mistral, Qwen2 and most decoder-only families, and compute the
logits ourselves with `lm_head(feature)`; `tests/test_target.py` checks the parity per
family. No modeling code is forked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class TargetError(RuntimeError):
    """A target (or tokenizer) that cannot be used; the message says why in one line."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise TargetError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _looks_like_hub_name(name: str) -> bool:
    # "org/model" with no path separators beyond the one slash; anything else is a path.
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def check_model_dir(name_or_path: str | os.PathLike) -> str:
    """Fail early, in one line, on a path that does not exist (hub names pass through)."""
    name = str(name_or_path)
    if Path(name).expanduser().exists():
        path = Path(name).expanduser()
        if not (path / "config.json").exists():
            raise TargetError(f"{path} is not a Hugging Face model directory (no config.json)")
        return str(path)
    if _looks_like_hub_name(name):
        return name  # hub names stay usable by users with access; never a default here
    raise TargetError(f"model path {name!r} does not exist")


def load_tokenizer(name_or_path: str | os.PathLike):
    from transformers import AutoTokenizer

    name = check_model_dir(name_or_path)
    if Path(name).exists() and not any(
        (Path(name) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        raise TargetError(f"{name} has no tokenizer (tokenizer.json / tokenizer_config.json missing)")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise TargetError(f"cannot load the tokenizer of {name}: {str(err).splitlines()[0]}") from err


def load_target(name_or_path: str | os.PathLike, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu", with_tokenizer: bool = True):
    """Load a causal LM (and its tokenizer) from a local directory or, with access, a hub name.

    Returns:
        (model, tokenizer): the model in eval mode with gradients off; tokenizer is None when
        `with_tokenizer` is False.
    """
    from transformers import AutoModelForCausalLM

    name = check_model_dir(name_or_path)
    tokenizer = load_tokenizer(name) if with_tokenizer else None
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=resolve_dtype(dtype))
    except (OSError, ValueError) as err:
        raise TargetError(f"cannot load model {name}: {str(err).splitlines()[0]}") from err
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def embeddings(model: nn.Module) -> nn.Embedding:
    """The target's input embedding table E (frozen, shared with the drafter)."""
    return model.get_input_embeddings()


def lm_head(model: nn.Module) -> nn.Module:
    """The target's LM head (frozen, shared with the drafter)."""
    return model.get_output_embeddings()


@dataclass
class TargetOutput:
    logits: Tensor    # (B, T, V)
    features: Tensor  # (B, T, H): the hidden state that feeds the LM head


def target_forward(model: nn.Module, input_ids: Tensor, cache=None, attention_mask: Tensor | None = None,
                   position_ids: Tensor | None = None, logits_slice: slice | None = None) -> TargetOutput:
    """One forward of the target returning logits and features together.

    `logits_slice` restricts the LM head to some positions (prefill needs only the last),
    which matters for large vocabularies; features are always returned for every position.
    """
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           cache=cache, use_cache=cache is not None)
    features = out.last_hidden_state  # (B, T, H)
    head_in = features if logits_slice is None else features[:, logits_slice]
    return TargetOutput(logits=lm_head(model)(head_in), features=features)


class TargetMismatchError(ValueError):
    """Something made for one target (a drafter, Medusa heads, a feature dump) met another."""


@dataclass(frozen=True)
class TargetIdentity:
    """What a drafter, Medusa heads or a feature dump must match to be used with a target.

    Sizes always; the tokenizer hash (equal hash, same ids) and the LM head's fingerprint (a
    retrained target with the same shapes) when known. `target_path` and `model_type` are
    informational: folders move, and a different family with equal shapes is only warned about.
    Stored as a plain dict (`to_dict`) in checkpoints and dump metadata.
    """

    hidden_size: int
    vocab_size: int
    model_type: str = ""
    tokenizer_hash: str | None = None
    lm_head_sha256: str | None = None
    target_path: str = ""

    CHECKED = ("hidden_size", "vocab_size", "tokenizer_hash", "lm_head_sha256")

    @classmethod
    def of(cls, model: nn.Module, tokenizer=None, path: str | os.PathLike | None = None,
           with_lm_head: bool = False) -> TargetIdentity:
        """The identity of a loaded target (with its LM head's fingerprint if asked: a hash of
        the whole head, worth it for feature dumps and training, not for every load)."""
        cfg = model.config
        return cls(hidden_size=int(cfg.hidden_size), vocab_size=int(lm_head(model).weight.shape[0]),
                   model_type=str(cfg.model_type),
                   tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else None,
                   lm_head_sha256=lm_head_fingerprint(model) if with_lm_head else None,
                   target_path=str(path) if path is not None else str(getattr(cfg, "_name_or_path", "")))

    @classmethod
    def from_dict(cls, data: dict) -> TargetIdentity:
        if not isinstance(data, dict) or "hidden_size" not in data or "vocab_size" not in data:
            raise ValueError(f"a target identity needs at least hidden_size and vocab_size, got {data!r}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def mismatch(self, other: TargetIdentity) -> str | None:
        """The first checked field both identities know and disagree on, as a phrase; else None."""
        for key in self.CHECKED:
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine is not None and theirs is not None and mine != theirs:
                return f"{key} {mine!r} != {theirs!r}"
        return None

    def check(self, target: TargetIdentity, what: str) -> None:
        """Raise `TargetMismatchError` unless `what` (made for `self`) can serve `target`; warn when
        only the model family differs."""
        diff = self.mismatch(target)
        if diff is not None:
            raise TargetMismatchError(f"{what} was made for another target: {diff} (made for {self.target_path!r}, "
                                      f"given {target.target_path!r})")
        if self.model_type and target.model_type and self.model_type != target.model_type:
            warnings.warn(f"{what} was made for a {self.model_type} target, this one is {target.model_type}; "
                          f"the shapes match, using it anyway", stacklevel=3)


def check_shape(owner: str, target: dict, **shape: int) -> None:
    """A trained module's record of its target (`TargetIdentity.to_dict()`) must be a dict that
    agrees with the module's own shape (hidden_size=..., vocab_size=...); raise ValueError otherwise."""
    if not isinstance(target, dict):
        raise ValueError(f"{owner}: target must be a dict (TargetIdentity.to_dict()), got {target!r}")
    for key, value in shape.items():
        if key in target and target[key] != value:
            raise ValueError(f"{owner}: {key} {value} disagrees with its target's {target[key]}")


def lm_head_fingerprint(model: nn.Module) -> str:
    """Hash of the target's LM head rounded to bf16: tells a retrained target (same shapes,
    same tokenizer) from another, whatever dtype either was loaded in."""
    import hashlib

    w = lm_head(model).weight.detach().to("cpu", torch.bfloat16).contiguous()
    return hashlib.sha256(w.view(torch.int16).numpy().tobytes()).hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """A stable hash (16 hex digits) of what maps text to ids: two tokenizers with the same
    hash give the same ids. Fast tokenizers hash their model (vocabulary and merges), added
    tokens and pre/post-processing; others their vocabulary and special tokens."""
    import hashlib

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        blob = {k: state.get(k) for k in ("model", "added_tokens", "pre_tokenizer", "post_processor")}
    else:
        blob = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
                "special": tokenizer.all_special_tokens}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]
