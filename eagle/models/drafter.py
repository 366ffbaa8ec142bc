"""The EAGLE-1 drafter: `fc` over `[f_{t-1}; E(x_t)]`, then one Llama decoder layer.

For position t the drafter reads the target's feature of the previous position, `f_{t-1}`
(the hidden state that feeds the target's LM head), and the embedding of the token already
chosen at t, `E(x_t)`; it predicts `f_hat_t`, and `lm_head(f_hat_t)` is the draft
distribution of `x_{t+1}`:

    h     = fc([f_{t-1}; E(x_t)])                    Linear(2H, H), with a bias (EAGLE-1) or not
    h     = h + Attn(h)                              no pre-attention norm (EAGLE removes it)
    f_hat = h + MLP(post_attention_layernorm(h))     no final norm

The decoder layer is Hugging Face's own `LlamaDecoderLayer` (and `LlamaRotaryEmbedding`)
built from a one-layer `LlamaConfig`, with `input_layernorm` swapped for `nn.Identity`: no
forked modeling code. Our `fc` columns are `[feature; embedding]`; EAGLE's code, vLLM and
SGLang concatenate `[embedding; feature]`, which `eagle.models.export` permutes.

`DrafterConfig.inputs` selects what the fc reads, for EAGLE-1's ablation of the drafter's
inputs (on Vicuna-7B its speedups rank them shifted, feature, token: docs/results.md):

    shifted     [f_{t-1}; E(x_t)]       EAGLE-1: the token sampled from f_{t-1} resolves which
                                        branch the next feature belongs to
    unshifted   [f_{t-1}; E(x_{t-1})]   the same token stream one step late: the feature no
                                        longer knows which of its parent's draws it follows
    feature     f_{t-1}                 feature-level autoregression without any token
    token       E(x_t)                  a one-layer draft model on the target's embeddings

`E` and `lm_head` are the target's own modules, frozen, kept in a plain tuple attribute so
that they are never registered as submodules: they are not in `state_dict()`, not in
`parameters()` (so no optimizer ever sees them) and not moved by `drafter.to()`. They stay
wherever the target is; the forward moves tensors across when the two differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from eagle.decoding.backend import backend_of, kernels_of
from eagle.decoding.masks import causal_mask
from eagle.target import LogitTransform, TargetIdentity, check_shape, embeddings, lm_head

# what the drafter's fc reads at position t (the module docstring): name -> (feature f_{t-1}, token)
INPUTS = {
    "shifted": (True, "x_t"),
    "unshifted": (True, "x_{t-1}"),
    "feature": (True, None),
    "token": (False, "x_t"),
}


@dataclass
class DrafterConfig:
    """Shape of an EAGLE drafter and the identity of the target it was trained for.

    `rope_theta` is the RoPE base; `rope_parameters` the full Hugging Face 5.x RoPE dict
    (`rope_type`, `rope_theta`, scaling keys), copied from the target so scaled RoPE
    (llama3, yarn, ...) matches. Given only `rope_theta`, default RoPE is used.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str = "silu"
    target: dict = field(default_factory=dict)  # eagle.target.TargetIdentity(...).to_dict()
    rope_parameters: dict | None = None
    # EAGLE-1's fc has a bias; vLLM's loader and EAGLE's Llama-3 drafters have none
    fc_bias: bool = True
    # what the fc reads (INPUTS); only EAGLE-1's "shifted" is served by the engines
    inputs: str = "shifted"

    def __post_init__(self) -> None:
        if self.inputs not in INPUTS:
            raise ValueError(f"drafter config: inputs must be one of {INPUTS}, got {self.inputs!r}")
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"drafter config: {name} must be a positive integer, got {value!r}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"drafter config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"drafter config: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"drafter config: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        else:
            self.rope_parameters = dict(self.rope_parameters)
            self.rope_parameters.setdefault("rope_type", "default")
            theta = self.rope_parameters.setdefault("rope_theta", float(self.rope_theta))
            if float(theta) != float(self.rope_theta):
                raise ValueError(
                    f"drafter config: rope_theta {self.rope_theta} disagrees with "
                    f"rope_parameters['rope_theta'] {theta}"
                )
        check_shape(
            "drafter config", self.target, hidden_size=self.hidden_size, vocab_size=self.vocab_size
        )

    @classmethod
    def from_target(
        cls, model: nn.Module, tokenizer=None, path: str | None = None
    ) -> DrafterConfig:
        """The drafter shape EAGLE uses for a target: its hidden size, heads, KV heads, head_dim,
        MLP width, RoPE and eps, read through the standard config attributes with each family's
        fallbacks (GPT-2 has no `intermediate_size`, multi-query models one KV head, ...)."""
        cfg = model.config
        last = _last_layer(
            cfg
        )  # what a config may set per layer (Gemma-4: head_dim), as its last layer has it
        hidden, heads = cfg.hidden_size, last.num_attention_heads
        kv_heads = getattr(last, "num_key_value_heads", None) or (
            1 if getattr(cfg, "multi_query", False) else heads
        )
        rope = _rope_of(cfg)
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0))
        return cls(
            hidden_size=hidden,
            intermediate_size=_first(last, ("intermediate_size", "n_inner", "ffn_dim"), 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=getattr(last, "head_dim", None) or hidden // heads,
            vocab_size=lm_head(model).weight.shape[0],
            rms_norm_eps=float(
                _first(cfg, ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"), 1e-6)
            ),
            rope_theta=theta,
            max_position_embeddings=_first(cfg, ("max_position_embeddings",), 2048),
            hidden_act=_first(cfg, ("hidden_act", "activation_function"), "silu"),
            target=TargetIdentity.of(model, tokenizer, path).to_dict(),
            rope_parameters={**rope, "rope_theta": theta},
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"drafter config: unknown key(s) {unknown}")
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in data
        )
        if missing:
            raise ValueError(f"drafter config: missing key(s) {missing}")
        return cls(**data)

    def llama_config(self):
        """The one-layer `LlamaConfig` the decoder layer and rotary embedding are built from."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            attention_bias=False,
            mlp_bias=False,
            # sdpa honours additive 4-D float masks (tree masks) and is fast for training
            attn_implementation="sdpa",
        )


def _last_layer(config):
    """The config as its last decoder layer sees it: heterogeneous configs (Gemma-4) set some
    attributes per layer and refuse to read them globally; any other config is itself."""
    layers = getattr(config, "per_layer_config", None)
    return layers[-1] if layers else config


def _rope_of(config) -> dict:
    """The rotary parameters of the target's last layer, for the drafter's Llama layer. Configs
    with one rotary per layer type (Gemma-3/4: {"sliding_attention": {...}, "full_attention":
    {...}}) give the last layer's type's; a rotary that a Llama layer cannot run (a partial one)
    becomes the default one at its base. The drafter's layer is its own: its rotary need only be
    the same in training and decoding (its config keeps it)."""
    rope = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default"})
    if rope and all(isinstance(v, dict) for v in rope.values()):  # one per layer type
        types = getattr(config, "layer_types", None) or ["full_attention"]
        rope = dict(rope.get(types[-1]) or next(iter(rope.values())))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        rope = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
    return rope


def _first(config, names: tuple[str, ...], default):
    """The first of `names` that `config` sets (not None), else `default`."""
    return next(
        (getattr(config, n) for n in names if getattr(config, n, None) is not None), default
    )


def restricted_linear(head: nn.Module, ids: Tensor) -> nn.Linear:
    """A linear of `head`'s rows `ids` only (K, H), on the kernels `head` runs
    (`eagle.decoding.backend`): a drafter's head over a reduced drafting vocabulary."""
    bias = getattr(head, "bias", None)
    w = head.weight
    rows = nn.Linear(w.shape[1], ids.numel(), bias=bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        rows.weight.copy_(w[ids])
        if bias is not None:
            rows.bias.copy_(bias[ids])
    rows.requires_grad_(False)
    return backend_of(head).adopt(rows)


class EagleDrafter(nn.Module):
    """EAGLE-1 drafter on top of a target's frozen embeddings and LM head.

    Args:
        config: the drafter's shape and target identity.
        embed_tokens: the target's input embedding E (frozen here; never saved).
        lm_head: the target's LM head (frozen here; never saved).
        logit_transform: what the target does to its LM head's output
            (`eagle.target.LogitTransform`), so that the drafter's distribution has the target's
            form. `on_target` wires all three.
    """

    def __init__(
        self,
        config: DrafterConfig,
        embed_tokens: nn.Embedding,
        lm_head: nn.Module,
        logit_transform: LogitTransform | None = None,
    ):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        if embed_tokens.weight.shape[-1] != config.hidden_size:
            raise ValueError(
                f"embedding width {embed_tokens.weight.shape[-1]} != drafter hidden size "
                f"{config.hidden_size}"
            )
        if lm_head.weight.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"lm_head weight {tuple(lm_head.weight.shape)} != (vocab {config.vocab_size}, "
                f"hidden {config.hidden_size})"
            )
        self.config = config
        self.llama_config = config.llama_config()
        h = config.hidden_size
        self.uses_feature, self.token = INPUTS[config.inputs]
        width = h * (int(self.uses_feature) + int(self.token is not None))
        self.fc = nn.Linear(
            width, h, bias=config.fc_bias
        )  # over [f_{t-1}; E(x_t)] (EAGLE-1's inputs)
        layer = LlamaDecoderLayer(self.llama_config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # EAGLE drops the pre-attention norm
        self.layers = nn.ModuleList([layer])  # state_dict keys `layers.0.*`, as in EAGLE's files
        self.rotary_emb = LlamaRotaryEmbedding(
            self.llama_config
        )  # inv_freq is a non-persistent buffer
        embed_tokens.requires_grad_(False)
        lm_head.requires_grad_(False)
        # a plain tuple: not registered, so not in state_dict(), parameters() or .to()
        self._target_modules = (embed_tokens, lm_head)
        self.logit_transform = logit_transform or LogitTransform()
        # (ids (K,), a linear of the head's K rows (K, H) on the head's kernels) when drafting from
        # a reduced vocabulary (`restrict_vocab`), else None; a copy, not registered, never saved
        self._draft_head: tuple[Tensor, nn.Linear] | None = None

    @classmethod
    def on_target(cls, config: DrafterConfig, model: nn.Module) -> EagleDrafter:
        """A drafter of `config` on `model`'s embeddings, LM head and logit transform."""
        return cls(config, embeddings(model), lm_head(model), LogitTransform.of(model.config))

    def share_target(self, model: nn.Module) -> None:
        """Use `model`'s E and LM head from now on (the same target loaded anew, e.g. whole
        instead of its head only)."""
        emb, head = embeddings(model), lm_head(model)
        if (
            emb.weight.shape != self.embed_tokens.weight.shape
            or head.weight.shape != self.lm_head.weight.shape
        ):
            raise ValueError(
                "share_target: the new target's embeddings or LM head have other shapes"
            )
        self._target_modules = (emb.requires_grad_(False), head.requires_grad_(False))
        self.restrict_vocab(self.draft_vocab)  # the reduced head's rows come from the new head

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target_modules[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._target_modules[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_cache(self):
        """An empty one-layer `DynamicCache` for incremental decoding."""
        from transformers import DynamicCache

        return DynamicCache(config=self.llama_config)

    @property
    def needs_prev_ids(self) -> bool:
        """Whether `forward` reads x_{t-1} (`inputs="unshifted"`)."""
        return self.token == "x_{t-1}"

    def forward(
        self,
        features: Tensor,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache=None,
        prev_ids: Tensor | None = None,
    ) -> Tensor:
        """Predict the next features.

        Args:
            features: (B, T, H) the target's features f_{t-1} (or predicted ones while drafting);
                ignored by a token-only drafter.
            input_ids: (B, T) tokens x_t.
            position_ids: (B|1, T); default arange(T) after the cache's length.
            attention_mask: None for causal attention (over the cache too), or an additive float
                mask (B|1, 1, T, S) with S = cache length + T (0 visible, very negative hidden).
            cache: a transformers `DynamicCache` (see `new_cache`) or an
                `eagle.decoding.static_cache.StaticKVCache` (then with explicit positions and
                mask) that receives this call's KV, or None.
            prev_ids: (B, T) tokens x_{t-1}, the token before each of `input_ids` (read only by
                an `inputs="unshifted"` drafter, which needs them).
        Returns:
            (B, T, H) predicted features f_hat_t.
        """
        b, t, _ = features.shape
        if input_ids.shape != (b, t):
            raise ValueError(
                f"features {tuple(features.shape)} and input_ids {tuple(input_ids.shape)} "
                "must agree on (B, T)"
            )
        if attention_mask is not None and attention_mask.dim() != 4:
            raise ValueError(
                f"attention_mask must be an additive float mask (B|1, 1, T, S), got shape "
                f"{tuple(attention_mask.shape)}"
            )
        dtype, device = self.dtype, self.device
        # read only when needed: under torch.compile the read would tie the graph to one length
        past = (
            0
            if cache is None or (position_ids is not None and attention_mask is not None)
            else int(cache.get_seq_length())
        )
        parts = [features.to(device, dtype)] if self.uses_feature else []  # f_{t-1}
        if self.token is not None:
            ids = input_ids
            if self.needs_prev_ids:
                if prev_ids is None or prev_ids.shape != input_ids.shape:
                    raise ValueError(
                        "an inputs='unshifted' drafter needs prev_ids (B, T), the token before "
                        "each input"
                    )
                ids = prev_ids
            parts.append(
                self.embed_tokens(ids.to(self.embed_tokens.weight.device)).to(device, dtype)
            )  # (B, T, H)
        h = self.fc(
            torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        )  # (B, T, 2H | H) -> (B, T, H)
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=device)[None]  # (1, T)
        position_ids = position_ids.to(device)
        if attention_mask is None:
            # sdpa's own causal flag is top-left aligned, wrong once a cache holds keys: give
            # an explicit mask then; without a cache let the kernel do causal (fast path)
            if past > 0 and t > 1:
                attention_mask = causal_mask(past, t, dtype, device)  # (1, 1, T, past + T)
        else:
            attention_mask = attention_mask.to(device, dtype)
        cos_sin = self.rotary_emb(h, position_ids=position_ids)  # 2 x (B|1, T, head_dim)
        return self.layers[0](
            h,
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=cos_sin,
            use_cache=cache is not None,
            cache=cache,
        )  # (B, T, H)

    def restrict_vocab(self, ids: Tensor | None) -> None:
        """Draft from the tokens `ids` (K,) only, or from the whole vocabulary again (None).

        FR-Spec's reduced drafting vocabulary (`eagle.data.vocab`): `logits` then scores only
        `draft_vocab`, with a K x H copy of the LM head's rows, so the head costs K/V of itself.
        Training and validation never restrict: the drafter learns the whole distribution.
        """
        if ids is None:
            self._draft_head = None
            return
        ids = torch.as_tensor(ids).flatten()
        vocab = self.config.vocab_size
        if ids.dtype == torch.bool or ids.is_floating_point():
            raise ValueError(f"a draft vocabulary is token ids, got {ids.dtype}")
        if not ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"a draft vocabulary needs 1..{vocab} token ids in [0, {vocab})")
        if ids.unique().numel() != ids.numel():
            raise ValueError("a draft vocabulary must not repeat a token")
        head = self.lm_head
        ids = ids.to(head.weight.device, torch.long)
        self._draft_head = (ids, restricted_linear(head, ids))  # runs the head's kernels

    @property
    def draft_vocab(self) -> Tensor | None:
        """The token ids `logits` scores (K,), in its columns' order; None: the whole vocabulary."""
        return None if self._draft_head is None else self._draft_head[0]

    def logits(self, hidden: Tensor) -> Tensor:
        """The target's LM head (and logit transform) on predicted features: (..., H) -> (..., V),
        on the head's device; (..., K) over `draft_vocab` when restricted (`restrict_vocab`)."""
        w = self.lm_head.weight
        hidden = hidden.to(w.device, w.dtype)
        if self._draft_head is None:
            return self.logit_transform(self.lm_head(hidden))
        ids, rows = self._draft_head
        if (
            rows.weight.dtype != w.dtype
            or rows.weight.device != w.device
            or kernels_of(rows) != kernels_of(self.lm_head)
        ):
            self.restrict_vocab(
                ids
            )  # the target moved or switched kernels since: copy its rows anew
            ids, rows = self._draft_head
        return self.logit_transform(rows(hidden))  # (..., K)

    @classmethod
    def random(
        cls,
        model: nn.Module,
        tokenizer=None,
        path: str | None = None,
        seed: int = 0,
        **overrides: Any,
    ) -> EagleDrafter:
        """An untrained drafter for `model` (PyTorch's default init under `seed`), on the
        target's device and dtype; `overrides` are `DrafterConfig` fields (e.g. `inputs`). For
        checking losslessness on a new target before any training; never used as a silent
        fallback for a missing checkpoint."""
        config = DrafterConfig.from_target(model, tokenizer, path)
        if overrides:
            config = DrafterConfig.from_dict({**config.to_dict(), **overrides})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = cls.on_target(config, model)
        p = next(model.parameters())
        return drafter.to(p.device, p.dtype)
