"""Target access: load any Hugging Face causal LM and expose what EAGLE needs from it.

EAGLE reads three things from the target: the input embeddings `E`, the LM head, and the
*feature* `f_t`, the hidden state that feeds the LM head (after the final norm). We get the
feature from the decoder body (`decoder_body`, which is `model.base_model` but for Llama-4),
whose `last_hidden_state` is exactly that tensor for decoder-only families, and compute the
logits ourselves: `lm_head(feature)` followed by the family's own final transform
(`LogitTransform`: Gemma-2 soft-caps its logits, Cohere and Granite scale them), because that
transform is part of the target's distribution p. `check_logits` proves the parity with
`model(ids).logits` for a loaded model, and `tests/test_target.py` per family. No modeling code
is forked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
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
        (Path(name) / f).exists()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        raise TargetError(
            f"{name} has no tokenizer (tokenizer.json / tokenizer_config.json missing)"
        )
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise TargetError(
            f"cannot load the tokenizer of {name}: {str(err).splitlines()[0]}"
        ) from err


def load_target(
    name_or_path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    with_tokenizer: bool = True,
    weights: str = "all",
    device_map: str | dict | None = None,
):
    """Load a causal LM (and its tokenizer) from a local directory or, with access, a hub name.

    A multimodal checkpoint (Gemma-3 4B and up, Gemma-4, Llama-4) loads as its language model
    alone: EAGLE drafts text. A checkpoint that leaves any weight of the model unread (names
    that do not match) is refused, where `from_pretrained` would start it at random.

    Args:
        dtype: the dtype of its weights.
        device: where it goes (ignored with a `device_map`).
        weights: "all", or "head": only the input embeddings and the LM head are read and
            materialised (`load_head_only`), which is all offline drafter training needs.
        device_map: passed to `from_pretrained` for targets larger than one device ("auto"
            spreads the layers over the GPUs; needs `accelerate`).
    Returns:
        (model, tokenizer): the model in eval mode with gradients off; tokenizer is None when
        `with_tokenizer` is False.
    """
    from transformers import AutoModelForCausalLM

    name = check_model_dir(name_or_path)
    tokenizer = load_tokenizer(name) if with_tokenizer else None
    if weights not in ("all", "head"):
        raise ValueError(f"weights must be 'all' or 'head', got {weights!r}")
    if weights == "head":
        return load_head_only(name, resolve_dtype(dtype), device), tokenizer
    extra = {"device_map": device_map} if device_map is not None else {}
    try:
        extra.update(_language_model_only(name))
        model, info = AutoModelForCausalLM.from_pretrained(
            name, dtype=resolve_dtype(dtype), output_loading_info=True, **extra
        )
    except (OSError, ValueError) as err:
        raise TargetError(f"cannot load model {name}: {str(err).splitlines()[0]}") from err
    missing = sorted(
        set(info.get("missing_keys") or ()) - set(getattr(model, "_tied_weights_keys", None) or ())
    )
    if missing:
        raise TargetError(
            f"cannot load model {name}: {len(missing)} of its weights are not in the checkpoint "
            f"(e.g. {missing[:3]}); they would start at random"
        )
    if device_map is None:
        model.to(device)
    model.eval().requires_grad_(False)
    check_logits(model, atol=1e-4 if model.dtype == torch.float32 else 5e-2)
    return model, tokenizer


# where a multimodal checkpoint keeps its language model's weights, and where the causal LM of its
# text config wants them (Gemma-3/4's `model.language_model.*`; Llama-4's `language_model.*`)
LANGUAGE_MODEL_KEYS = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


def _language_model_only(name: str) -> dict:
    """`from_pretrained`'s arguments that load a multimodal checkpoint's language model alone: its
    text config and `LANGUAGE_MODEL_KEYS`; nothing for a causal LM's own checkpoint."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(name)
    text = config.get_text_config(decoder=True)
    if text is config or text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return {}
    return {"config": text, "key_mapping": LANGUAGE_MODEL_KEYS}


HEAD_ONLY = "_eagle_head_only"  # attribute set on a model of which only E and the LM head are real


def is_head_only(model: nn.Module) -> bool:
    return bool(getattr(model, HEAD_ONLY, False))


def _checkpoint_tensors(folder: Path, keys: list[list[str]]) -> dict[str, Tensor] | None:
    """Tensors of a safetensors checkpoint (one file or an index of shards): for each list of
    names of one parameter, the first stored under one of them (or under it without the base
    model's prefix), keyed by the list's first name; None when one is missing."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (folder / "model.safetensors").exists():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    else:
        return None
    # a multimodal checkpoint's language model, under the names of the text model's
    as_text = {_text_key(k): k for k in weight_map}
    found = {}
    for names in keys:
        candidates = [c for n in names for c in (n, n.split(".", 1)[-1])]
        stored = next(
            (as_text.get(c, c) for c in candidates if c in weight_map or c in as_text), None
        )
        if stored is None:
            return None
        with safe_open(str(folder / weight_map[stored]), framework="pt") as f:
            found[names[0]] = f.get_tensor(stored)
    return found


def _text_key(key: str) -> str:
    """A checkpoint's tensor name as the causal LM of its text config names it
    (`LANGUAGE_MODEL_KEYS`)."""
    for pattern, replacement in LANGUAGE_MODEL_KEYS.items():
        key = re.sub(pattern, replacement, key)
    return key


def load_head_only(name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> nn.Module:
    """The target with only its input embeddings and LM head read from disk, on `device`; the
    other weights stay on the meta device (no memory): an 8B target costs ~2 GB instead of 16
    in bf16. Enough for offline drafter training (E, lm_head, the logit transform, the
    identity); a forward fails. Falls back to a full load (on the CPU, then trimmed) when the
    checkpoint is not in safetensors or names its tensors unexpectedly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = _language_model_only(name).get("config") or AutoConfig.from_pretrained(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # E's and the head's parameters (with the head's bias where a family has one), each under
    # every name it has: a tied head shares E's weight
    wanted = {id(p) for m in (embeddings(model), lm_head(model)) for p in m.parameters()}
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in wanted:
            groups.setdefault(id(p), []).append(n)
    tensors = (
        _checkpoint_tensors(Path(name), list(groups.values())) if Path(name).is_dir() else None
    )
    if tensors is None:  # not safetensors, or other names: load it all once, keep the head
        full = dict(
            load_target(name, dtype=dtype, with_tokenizer=False)[0].named_parameters(
                remove_duplicate=False
            )
        )
        tensors = {names[0]: full[names[0]].data for names in groups.values()}
        del full
    for names in groups.values():
        real = nn.Parameter(tensors[names[0]].to(device, dtype), requires_grad=False)
        for n in names:
            owner, _, attr = n.rpartition(".")
            setattr(model.get_submodule(owner), attr, real)
    setattr(model, HEAD_ONLY, True)
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class LogitTransform:
    """What a family does to its LM head's output before it is a distribution.

    Gemma-2/3's `final_logit_softcapping` (cap * tanh(logits / cap)); Cohere's `logit_scale`
    (a factor); Granite's `logits_scaling` (a divisor). Identity for every other family.
    """

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> LogitTransform:
        scale = float(getattr(config, "logit_scale", None) or 1.0)
        scale /= float(getattr(config, "logits_scaling", None) or 1.0)
        return cls(scale=scale, softcap=getattr(config, "final_logit_softcapping", None) or None)

    def __call__(self, logits: Tensor) -> Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def head_logits(model: nn.Module, features: Tensor) -> Tensor:
    """The target's logits of its features: the LM head, then the family's `LogitTransform`.

    Args:
        features: (..., H) the hidden states that feed the LM head.
    Returns:
        (..., V) the logits `model(...)` itself would return.
    """
    return LogitTransform.of(model.config)(lm_head(model)(features))


def check_logits(model: nn.Module, atol: float = 1e-4) -> None:
    """Raise `TargetError` unless `head_logits(base_model(ids))` reproduces `model(ids).logits`
    on a short random sequence: a family whose final transform this module does not know would
    otherwise be decoded from the wrong distribution (silently: greedy argmaxes may agree)."""
    p = next(model.parameters())
    ids = torch.randint(
        0, lm_head(model).weight.shape[0], (1, 8), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(p.device)
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        got = target_forward(model, ids).logits.float()
    err = (got - want).abs().max().item()
    if not err <= atol * max(1.0, want.abs().max().item()):
        raise TargetError(
            f"{type(model).__name__}: the LM head of its features differs from its own logits by "
            f"{err:.3g}: it transforms its logits in a way eagle.target.LogitTransform does not "
            "know"
        )


def context_length(model: nn.Module) -> int | None:
    """The positions the model was built for (`max_position_embeddings`), or fewer where only
    fewer decode exactly here; None when its config says nothing.

    Llama-4's layers without rotary embeddings scale their queries by
    `1 + attn_scale * log1p(floor((s + 1) / floor_scale))`, with `s` counted from the cache's
    length, not from the positions the forward is given: a tree's node, or a shorter row of a
    batch, would be scaled as the slot it sits in. Below `floor_scale - 1` slots that scale is 1
    at every slot, so the context stops there."""
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    for rope in rope_parameters(config):
        # YaRN as Qwen documents it keeps max_position_embeddings at the original length: its
        # frequencies are fixed, so it serves factor x original positions (dynamic NTK does not:
        # past its length its frequencies follow the forward's longest position, a tree's included)
        original = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        if rope.get("rope_type") == "yarn" and rope.get("factor") and original:
            limit = max(limit or 0, int(rope["factor"] * original))
    if getattr(config, "attn_temperature_tuning", False) and 0 in (
        getattr(config, "no_rope_layers", None) or ()
    ):
        limit = min(limit or config.floor_scale, config.floor_scale - 1)
    return limit


def rope_parameters(config) -> list[dict]:
    """The rotary parameters of a config, one dict per kind of layer (Gemma-3 keys them by layer
    type); [{}] when it has none."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [dict(rope)]


def longrope_switch(model: nn.Module) -> int | None:
    """Where a longrope target (Phi-3/3.5/4 long-context) changes rotary: a forward whose longest
    position reaches `original_max_position_embeddings` rotates every position with the long
    factors, one below it with the short ones, and Hugging Face's `generate` recomputes the whole
    cache when a sequence first crosses it. None for other targets."""
    config = model.config
    for rope in rope_parameters(config):
        if rope.get("rope_type") == "longrope":
            return int(
                rope.get("original_max_position_embeddings")
                or getattr(config, "original_max_position_embeddings", None)
                or config.max_position_embeddings
            )
    return None


def embeddings(model: nn.Module) -> nn.Embedding:
    """The target's input embedding table E (frozen, shared with the drafter)."""
    return model.get_input_embeddings()


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder body whose `last_hidden_state` feeds the LM head: `model.base_model`, or the
    `model` attribute where the class's `base_model_prefix` names no attribute (Llama-4's text
    model names "language_model" and keeps its body in `model`, so `base_model` is the whole LM)."""
    body = model.base_model
    if body is model:
        body = getattr(model, "model", None)
        if not isinstance(body, nn.Module):
            raise TargetError(
                f"{type(model).__name__}: no decoder body found (neither base_model nor .model)"
            )
    return body


# config lists with one entry per decoder layer (sliding or full, rotary or not), and lists of layer
# indices
PER_LAYER = ("layer_types", "no_rope_layers")
LAYER_INDICES = ("moe_layers",)


def cut_config(config, layers: int):
    """The config of the same class for the first `layers` decoder layers: what it says per layer
    (`PER_LAYER` lists, `LAYER_INDICES`, the per-layer attributes of heterogeneous configs) follows
    the cut, and of the layers that reuse earlier layers' keys and values (Gemma-4's last
    `num_kv_shared_layers`) only those kept stay."""
    n = config.num_hidden_layers
    fields = config.to_dict()
    for key, value in fields.items():
        if isinstance(value, list) and len(value) == n and key.endswith(PER_LAYER):
            fields[key] = value[:layers]
        elif isinstance(value, list) and key in LAYER_INDICES:
            fields[key] = [i for i in value if i < layers]
    if isinstance(fields.get("per_layer_config"), dict):  # keyed by layer index ("05" or 5)
        fields["per_layer_config"] = {
            k: v for k, v in fields["per_layer_config"].items() if int(k) < layers
        }
    if fields.get("num_kv_shared_layers"):
        fields["num_kv_shared_layers"] = max(0, fields["num_kv_shared_layers"] - (n - layers))
    return config.__class__.from_dict({**fields, "num_hidden_layers": layers})


# layer types whose cache is keys and values, one entry per token (Hugging Face's names); "dummy"
# layers keep none (they reuse another layer's, or have no attention)
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention", "dummy")


# attention implementations that honour an additive 4-D mask (None: a config that never set one)
MASKED_ATTENTION = (None, "sdpa", "eager")


def check_attention_only(model: nn.Module) -> None:
    """Raise `TargetError` unless every layer of `model` is attention of a kind the engine knows.

    A tree verification scores every node on top of the committed context and then keeps one
    path: keys and values are kept or dropped per token, but a recurrent state (Mamba, linear
    attention, short convolutions: Jamba, Qwen3-Next, LFM2, Falcon-H1, ...) has folded every
    node into one state that cannot be taken back. Attention the engine has not been proved on
    (DeepSeek-V3.2's indexed, V4's compressed) is refused too. The layer types are Hugging
    Face's own (`get_layer_types_and_kwargs`, which names all of these), or the config's."""
    config = model.config
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types = get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]
    except (ImportError, AttributeError):  # an older transformers, a config without per-layer views
        types = getattr(config, "layer_types", None) or []
    other = sorted(set(types) - set(ATTENTION_LAYERS))
    if other:
        raise TargetError(
            f"{type(model).__name__} has layers of type {other}: this engine verifies trees on "
            "caches of keys and values per token, dropping the rejected nodes, and knows only the "
            f"attention layers {list(ATTENTION_LAYERS[:3])}; a recurrent state (Mamba, linear "
            "attention, convolutions) cannot drop them"
        )
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASKED_ATTENTION:
        # flash attention takes padding masks only: a tree's 4-D mask would be dropped and every
        # node would see its siblings, silently
        raise TargetError(
            f"{type(model).__name__} runs attention_implementation={impl!r}, which does not take "
            "the 4-D tree masks every verification passes: load it with "
            "attn_implementation='sdpa' "
            f"(or one of {list(MASKED_ATTENTION[1:])})"
        )


def lm_head(model: nn.Module) -> nn.Module:
    """The target's LM head (frozen, shared with the drafter)."""
    return model.get_output_embeddings()


@dataclass
class TargetOutput:
    logits: Tensor  # (B, T, V)
    features: Tensor  # (B, T, H): the hidden state that feeds the LM head


def target_forward(
    model: nn.Module,
    input_ids: Tensor,
    cache=None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    logits_slice: slice | Tensor | None = None,
) -> TargetOutput:
    """One forward of the target returning logits and features together.

    `logits_slice` restricts the LM head to some positions (prefill needs only the last),
    which matters for large vocabularies: a slice of every row's positions, or one position
    per row (B,) (right-padded prompts of a batch: each row's last real token; logits (B, 1, V)).
    Features are always returned for every position.
    """
    out = decoder_body(model)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=cache is not None,
    )
    features = out.last_hidden_state  # (B, T, H)
    if isinstance(logits_slice, Tensor):
        rows = torch.arange(features.shape[0], device=features.device)
        head_in = features[rows, logits_slice.to(features.device)][
            :, None
        ]  # the last layer's device (device_map)
    else:
        head_in = features if logits_slice is None else features[:, logits_slice]
    return TargetOutput(logits=head_logits(model, head_in), features=features)


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
    def of(
        cls,
        model: nn.Module,
        tokenizer=None,
        path: str | os.PathLike | None = None,
        with_lm_head: bool = False,
    ) -> TargetIdentity:
        """The identity of a loaded target (with its LM head's fingerprint if asked: a hash of
        the whole head, worth it for feature dumps and training, not for every load)."""
        cfg = model.config
        return cls(
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(lm_head(model).weight.shape[0]),
            model_type=str(cfg.model_type),
            tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else None,
            lm_head_sha256=lm_head_fingerprint(model) if with_lm_head else None,
            target_path=str(path) if path is not None else str(getattr(cfg, "_name_or_path", "")),
        )

    @classmethod
    def from_dict(cls, data: dict) -> TargetIdentity:
        if not isinstance(data, dict) or "hidden_size" not in data or "vocab_size" not in data:
            raise ValueError(
                f"a target identity needs at least hidden_size and vocab_size, got {data!r}"
            )
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def mismatch(self, other: TargetIdentity, keys: tuple[str, ...] = CHECKED) -> str | None:
        """The first of `keys` both identities know and disagree on, as a phrase; else None."""
        for key in keys:
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine is not None and theirs is not None and mine != theirs:
                return f"{key} {mine!r} != {theirs!r}"
        return None

    def check(self, target: TargetIdentity, what: str, head: str = "error") -> None:
        """Raise `TargetMismatchError` unless `what` (made for `self`) can serve `target`; warn when
        only the model family differs. `head="warn"` only warns when the LM heads' fingerprints
        differ: what a drafter needs to stay exact is the sizes and the tokenizer, and a head
        that differs (a retrained target, or one whose checkpoint was rounded to another dtype
        than the one it was trained against) costs acceptance, not exactness."""
        if head not in ("error", "warn"):
            raise ValueError(f"head must be 'error' or 'warn', got {head!r}")
        keys = (
            self.CHECKED
            if head == "error"
            else tuple(k for k in self.CHECKED if k != "lm_head_sha256")
        )
        diff = self.mismatch(target, keys)
        if diff is not None:
            raise TargetMismatchError(
                f"{what} was made for another target: {diff} (made for {self.target_path!r}, "
                f"given {target.target_path!r})"
            )
        if head == "warn" and self.mismatch(target, ("lm_head_sha256",)) is not None:
            warnings.warn(
                f"{what} was trained against another LM head than this target's (fingerprint "
                f"{self.lm_head_sha256} != {target.lm_head_sha256}; made for {self.target_path!r}, "
                "given "
                f"{target.target_path!r}): decoding stays exact, but expect fewer accepted tokens "
                "unless "
                "this is the same model",
                stacklevel=3,
            )
        if self.model_type and target.model_type and self.model_type != target.model_type:
            warnings.warn(
                f"{what} was made for a {self.model_type} target, this one is {target.model_type}; "
                f"the shapes match, using it anyway",
                stacklevel=3,
            )


def check_shape(owner: str, target: dict, **shape: int) -> None:
    """A trained module's record of its target (`TargetIdentity.to_dict()`) must be a dict that
    agrees with the module's own shape (hidden_size=..., vocab_size=...); raise ValueError
    otherwise."""
    if not isinstance(target, dict):
        raise ValueError(
            f"{owner}: target must be a dict (TargetIdentity.to_dict()), got {target!r}"
        )
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
        blob = {
            k: state.get(k) for k in ("model", "added_tokens", "pre_tokenizer", "post_processor")
        }
    else:
        blob = {
            "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
            "special": tokenizer.all_special_tokens,
        }
    return hashlib.sha256(
        json.dumps(blob, sort_keys=True, ensure_ascii=False).encode()
    ).hexdigest()[:16]
