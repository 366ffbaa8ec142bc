"""Fused float32 CPU kernels: a decoder layer in two calls, linears batch-invariant.

The `kernels=fused` and `kernels=fused_prefetch` settings (`eagle.kernels.backends`). A float32
decoding step on PyTorch's kernels costs several memory floors even with oneDNN's packed
products: none of the products reads its weight at the memory's speed, and the small operations
and Python between them (norms, rotary embedding, SwiGLU, residuals, the cache's writes) add
milliseconds. llama.cpp's step of the same model comes near one floor with one fused loop per
layer (measured: docs/performance.md). This module does the same inside the Hugging Face model:

  linears   every `nn.Linear` runs `csrc/fused.cpp`'s product on its weight packed once in panels
            of 4 SIMD vectors of outputs, or 2 where that shares the panels more evenly between
            the threads. A block of rows (up to 6 with AVX-512 against 4-vector panels and 12
            against 2-vector ones, 2 and 4 with AVX2) reads the weight front to back in one pass;
            more rows go through it a 16 KB chunk at a time, every block in turn, so it is read
            from memory once. `kernels=fused_prefetch` also asks for the weight ahead in
            software, where the CPU's own prefetchers leave a few rows' products paying for
            their arithmetic on top of the reads (with more rows than a block, the blocks share
            the asking for the next chunk);
  layers    a supported decoder layer (`supported_layer`: Llama, Mistral, Qwen2 and Qwen3
            without a sliding window, and the EAGLE drafter's Llama layer without its input
            norm) runs as two calls around the model's own cache: norm + q/k/v (+ Qwen3's
            per-head q/k norms) + rotary embedding, then `cache.update` (Hugging Face's, ours,
            any), then attention under the model's mask + o_proj + residual + norm + gated MLP
            + residual. The mask, the positions (cos and sin) and the cache are the model's
            own, so trees, static caches and padding work unchanged;
  backbone  a base model whose layers all run fused (`FusedBackbone`) loops over their kernel
            calls itself, with the model's own embedding, mask, rotary embedding and final norm
            (an RMSNorm runs in the extension: `FusedNorm`), instead of calling every layer's
            modules. It checks the layers' weights for changes before each forward, or once a
            `weights_fixed` scope (the engine decodes in one). On a cache that lets the kernels
            write its buffers (`reserve` / `commit`: the engine's static and growing caches)
            the loop itself runs in the extension (`Layers`), one call for every layer; any
            other cache gets its `update` call per layer.

Exactness by construction: each output of a product is one FMA chain over the inputs in one
SIMD lane, and a row's attention reads its keys in slot order, skipping the masked ones; so a
token's logits are bitwise the same whether its forward carries 1 token or a tree of 26
(tested). Whatever needs gradients, another dtype or device, or runs under `torch.compile` takes
the model's own forward (and `F.linear`): training is untouched. A batch of B sequences runs as
B x n rows.

The kernels are C++ (AVX-512 or AVX2 with FMA), compiled on first use for this machine's CPU by
`torch.utils.cpp_extension` (needs a C++ compiler; under a minute, once, then cached): `load()`
raises `FusedUnavailable`, saying why, where that fails, and `kernels=auto` then leaves them out.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SOURCE = Path(__file__).parent / "csrc" / "fused.cpp"
# decoder layers whose forward is the fused one: the pre-norm Llama layer with a gated SiLU MLP
# and RMSNorm, with or without q/k/v biases (Qwen2), with or without per-head q/k norms (Qwen3);
# each checked further by `supported_layer`
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
# base models whose forward `FusedBackbone` repeats when all their layers run fused
BACKBONES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
BACKBONE_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb", "config")
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' (`ACT2FN["silu"]`)


class FusedUnavailable(RuntimeError):
    """The fused kernels cannot be built or run here (no compiler, no AVX2, not a CPU)."""


def _build_tag() -> str:
    """A short hash of this CPU's model and instruction flags, and of the kernels' source: the
    build is `-march=native`, so a home folder shared by machines with other CPUs must not reuse
    it."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines()
                 if line.startswith(("model name", "flags"))][:2]
    except OSError:  # not Linux
        import platform

        lines = [platform.processor(), platform.machine()]
    # and of the source: two checkouts with different sources (branches, clones) sharing torch's
    # extension folder would otherwise rebuild one name back and forth, and a process could load
    # the other's build
    lines.append(SOURCE.read_text())
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:8]


@functools.cache
def load():
    """The compiled extension (built once per CPU and source; cached on disk by torch)."""
    from torch.utils.cpp_extension import load as build

    here = Path(sys.executable).parent
    if shutil.which("ninja") is None and (here / "ninja").exists():
        # the `ninja` package's binary sits beside this interpreter, not always on PATH
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", ...: a build each
    if capability not in ("AVX512", "AVX2"):
        raise FusedUnavailable(f"the fused kernels need AVX2 or AVX-512; this CPU offers "
                               f"{capability}")
    try:
        return build(name=f"eagle_fused_{capability.lower()}_{_build_tag()}",
                     sources=[str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                     extra_ldflags=["-fopenmp"])
    except (OSError, RuntimeError, ImportError) as err:  # no compiler or ninja; a failed build
        raise FusedUnavailable(f"building {SOURCE.name} failed ({type(err).__name__}: {err}); "
                               "kernels=fused needs a C++ compiler (g++) and ninja") from err


@functools.cache
def available() -> bool:
    """Whether the fused kernels can run here (builds them on first call; a failure is not
    retried)."""
    try:
        load()
    except FusedUnavailable:
        return False
    return True


def _key(params: list[Tensor | None]) -> tuple:
    """What changes when any of these weights does: in place (version) or new storage
    (pointer)."""
    return tuple((0 if p.is_inference() else p._version, p.data_ptr())
                 for p in params if p is not None)


def _runs_fused(x: Tensor, weight: Tensor) -> bool:
    """The cheap checks, most likely first: float32 inference on a CPU, not traced."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.is_cpu and weight.is_cpu
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.compiler.is_compiling() and x.numel() > 0)


def _wants_grad(params: list[Tensor | None]) -> bool:
    """Whether autograd would track any of these parameters now: the kernels run outside it, so
    a layer with one trainable weight (a frozen model's trainable MLPs, say) takes its own
    forward. Free under `torch.inference_mode` or `no_grad`, as every decoding path runs."""
    return torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in params)


class FusedLinear(nn.Linear):
    """An `nn.Linear` whose float32 inference products on a CPU run the fused kernels' product.

    Not built directly: `eagle.kernels.use_kernels(model, "fused")` switches an existing
    `nn.Linear` to this class (the same object and parameters; a tied head stays tied).
    """

    _fused: tuple | None  # (key, packed weight)
    _prefetch: bool = False  # kernels=fused_prefetch: the product asks for its weights ahead

    def packed_weight(self) -> Tensor:
        key = _key([self.weight])
        if self._fused is None or self._fused[0] != key:
            self._fused = (key, load().pack(self.weight.detach()))
        return self._fused[1]

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        if not _runs_fused(x, self.weight) or _wants_grad([self.bias]):
            return F.linear(x, self.weight, self.bias)
        # contiguous: the kernel reads `out` floats from the bias's first
        bias = None if self.bias is None else self.bias.detach().contiguous()
        return load().linear(x, self.packed_weight(), self.out_features, bias, self._prefetch)


def switch_on(linear: nn.Linear) -> None:
    """`linear` (a plain `nn.Linear`) to `FusedLinear`, in place: every reference sees it."""
    linear.__class__ = FusedLinear
    if not hasattr(linear, "_fused"):  # a packed weight kept by an earlier switch stays
        linear._fused = None


def release(linear: nn.Linear) -> None:
    """Free the packed weight this setting left on `linear`."""
    if hasattr(linear, "_fused"):
        del linear._fused


def _norm_weight(norm: nn.Module) -> Tensor | None:
    return None if isinstance(norm, nn.Identity) else norm.weight


def _param(module: nn.Module, name: str) -> Tensor | None:
    """`getattr(module, name)` for a registered parameter (or None), without the module's
    `__getattr__`; anything else (a parametrization, a plain attribute) through it."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


def supported_layer(layer: nn.Module) -> bool:
    """Whether `layer` is a decoder layer whose computation the fused forward repeats (to float
    rounding): a pre-norm Llama-family layer (`LAYERS`), RMSNorm (or no input norm, as EAGLE's
    drafter), q/k/v/o projections (biases or not) with RMSNorms of each head's q and k (Qwen3)
    or none, no sliding window, and a gated SiLU MLP."""
    if type(layer).__name__ not in LAYERS:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    norms_ok = all(isinstance(n, nn.Identity)
                   or (type(n).__name__ in NORMS and hasattr(n, "variance_epsilon"))
                   for n in (layer.input_layernorm, layer.post_attention_layernorm))
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
        getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (norms_ok and not isinstance(layer.post_attention_layernorm, nn.Identity)
            and all(isinstance(m, nn.Linear) for m in linears)
            and _qk_norms(attn) is not False and _window(attn) is None
            and type(getattr(mlp, "act_fn", None)).__name__ in SILU
            and hasattr(attn, "scaling") and hasattr(attn, "head_dim")
            and hasattr(attn, "layer_idx")
            and len({(q.bias is None) for q in linears[:3]}) == 1
            and len({(m.bias is None) for m in linears[4:6]}) == 1)


def _qk_norms(attn: nn.Module) -> tuple[nn.Module, nn.Module] | None | bool:
    """The attention's per-head RMSNorms of q and k (Qwen3: over each head's head_dim, before
    the rotary embedding), None without any, False for norms the kernels do not run."""
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is None and k_norm is None:
        return None
    ok = all(type(n).__name__ in NORMS and hasattr(n, "variance_epsilon")
             and isinstance(n.weight, Tensor) and n.weight.shape == (attn.head_dim,)
             for n in (q_norm, k_norm))
    return (q_norm, k_norm) if ok else False


def _window(attn: nn.Module) -> int | None:
    """The layer's sliding window: its own (Qwen2, per layer type), else its config's
    (Mistral)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(getattr(attn, "config", None), "sliding_window", None)


class FusedLayer:
    """The fused forward of one supported decoder layer, with its weights packed once (again
    when any changes). Installed as the layer's `forward`; anything it does not run goes to
    `original`."""

    def __init__(self, layer: nn.Module, original):
        self.layer, self.original = layer, original
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.gate_up = [mlp.gate_proj, mlp.up_proj]
        self.linears = [*self.qkv, attn.o_proj, *self.gate_up, mlp.down_proj]
        self.norms = (layer.input_layernorm, layer.post_attention_layernorm)
        self.layer_idx = attn.layer_idx  # where its keys and values go in the model's cache
        norm1, norm2 = self.norms
        # (module, name) of every parameter the packed weights come from (EAGLE's drafter layer
        # has no input norm)
        self.owners = [(m, name) for m in self.linears for name in ("weight", "bias")]
        self.owners += [] if isinstance(norm1, nn.Identity) else [(norm1, "weight")]
        self.owners += [(norm2, "weight")]
        self.qk_norms = _qk_norms(attn)
        self.owners += [(n, "weight") for n in self.qk_norms or ()]
        self._packed: tuple | None = None
        # kernels=fused_prefetch: its products ask for their weights ahead (`fuse_layers`)
        self.prefetch = False

    def _params(self) -> list[Tensor | None]:
        # read from each module's parameter dict, not through `nn.Module.__getattr__`: its
        # lookups were a visible share of a small model's step when every layer checked itself
        # each forward
        return [_param(m, name) for m, name in self.owners]

    def slots(self) -> list[tuple[dict, str]] | None:
        """Where `_params` reads each parameter: (the module's parameter dict, the name), in
        `_params`' order; None when one is not a registered parameter (a parametrization)."""
        if any(name not in m._parameters for m, name in self.owners):
            return None
        return [(m._parameters, name) for m, name in self.owners]

    def packed(self) -> dict:
        """The layer's packed weights and what its two kernel calls take besides the inputs,
        built again when any parameter changes (in place or replaced)."""
        key = _key(self._params())
        if self._packed is None or self._packed[0] != key:
            ext, layer = load(), self.layer
            attn, mlp, config = layer.self_attn, layer.mlp, layer.self_attn.config
            norm1, norm2 = self.norms
            qk = self.qk_norms

            def stack(mods, part):
                if getattr(mods[0], part) is None:
                    return None
                return torch.cat([getattr(m, part).detach() for m in mods])

            norm1_weight = _norm_weight(norm1)
            self._packed = (key, {
                "qkv": ext.pack(stack(self.qkv, "weight")), "qkv_bias": stack(self.qkv, "bias"),
                "o": ext.pack(attn.o_proj.weight.detach()), "o_bias": stack([attn.o_proj], "bias"),
                "gate_up": ext.pack(stack(self.gate_up, "weight")),
                "gate_up_bias": stack(self.gate_up, "bias"),
                "down": ext.pack(mlp.down_proj.weight.detach()),
                "down_bias": stack([mlp.down_proj], "bias"),
                # (contiguous: the kernels read each norm's d floats from its first; a strided
                # view is copied once, here)
                "norm1": None if norm1_weight is None else norm1_weight.detach().contiguous(),
                "eps1": getattr(norm1, "variance_epsilon", 0.0),
                "norm2": norm2.weight.detach().contiguous(), "eps2": norm2.variance_epsilon,
                "q_norm": qk[0].weight.detach().contiguous() if qk else None,
                "k_norm": qk[1].weight.detach().contiguous() if qk else None,
                "eps_qk": qk[0].variance_epsilon if qk else 0.0,
                "heads": (config.num_attention_heads, config.num_key_value_heads, attn.head_dim),
                "scaling": attn.scaling, "inter": mlp.gate_proj.out_features,
            })
        return self._packed[1]

    def release(self) -> None:
        self._packed = None

    def __call__(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        layer = self.layer
        attn = layer.self_attn
        cos_sin, mask = kwargs.get("position_embeddings"), kwargs.get("attention_mask")
        # (attentions asked for in the config are captured by hooks on the attention module,
        # which the kernels never call; no parameter list is read when decoding, under no grad)
        if (args or hidden_states.dim() != 3 or cos_sin is None
                or kwargs.get("output_attentions")
                or getattr(attn.config, "output_attentions", False)
                or not _runs_fused(hidden_states, attn.q_proj.weight)
                or (torch.is_grad_enabled() and _wants_grad(self._params()))
                or cos_sin[0].shape[-1] != attn.head_dim or layer.training
                or not _fused_mask(mask, hidden_states.shape[1])):
            return self.original(hidden_states, *args, **kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return self.run(hidden_states, cos_sin, mask, cache, kwargs)

    def run(self, hidden_states: Tensor, cos_sin: tuple[Tensor, Tensor], mask: Tensor | None,
            cache, kwargs: dict | None = None, packed: dict | None = None) -> Tensor:
        """The layer on `hidden_states` (B, n, d), its inputs checked by the caller; `packed`:
        its `packed()`, when the caller has just checked it (`FusedBackbone`)."""
        ext, w = load(), self.packed() if packed is None else packed
        cos, sin = cos_sin
        q, k, v = ext.attention_inputs(hidden_states, w["norm1"], w["eps1"], w["qkv"],
                                       w["qkv_bias"], cos.to(torch.float32),
                                       sin.to(torch.float32), *w["heads"], w["q_norm"],
                                       w["k_norm"], w["eps_qk"], self.prefetch)
        if cache is not None:  # what the model's attention does
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs or {})
        if mask is not None and mask.shape[-1] > k.shape[-2]:
            mask = mask[..., : k.shape[-2]]  # as the model's attention reads it
        return ext.attention_mlp(hidden_states, q, k, v, mask, w["scaling"], w["o"], w["o_bias"],
                                 w["norm2"], w["eps2"], w["gate_up"], w["inter"], w["down"],
                                 w["gate_up_bias"], w["down_bias"], self.prefetch)


def _fused_mask(mask, n: int) -> bool:
    """A mask the kernels read for n new tokens: none (causal), or one 4-D bool or additive
    float32 mask (B or 1, 1, n, L), the same for every head and a row per token; a mask per
    head, or one row broadcast over the tokens, goes to the model's own attention."""
    return mask is None or (isinstance(mask, Tensor) and mask.dim() == 4
                            and mask.dtype in (torch.bool, torch.float32)
                            and mask.shape[1] == 1 and mask.shape[2] == n)


class FusedBackbone:
    """The base model's forward (`LlamaModel`'s and its twins', `BACKBONES`) when each of its
    decoder layers runs fused: the same steps (the embedding, the positions, the model's own
    causal mask and rotary embedding, the layers, the final norm), with each layer's two kernel
    calls made from one loop instead of through every layer's module calls, their output
    capture and their per-layer checks. Installed as the backbone's `forward`; a call that asks
    for anything else (gradients, attentions or hidden states of every layer, another dtype, a
    mask per layer type) goes to `original`."""

    # read as Hugging Face's forward reads them
    PASSED = {"cache_position", "return_dict", "output_attentions", "output_hidden_states"}

    def __init__(self, backbone: nn.Module, original, prefetch: bool = False):
        self.backbone, self.original = backbone, original
        self.prefetch = prefetch  # kernels=fused_prefetch (its `Layers` loop is built with it)
        # (layers, the `unchanged` arguments, their packed weights)
        self._checked: tuple | None = None
        # (the packed weights, the extension's `Layers` over them, or None)
        self._loop: tuple | None = None
        self._fixed = 0  # the `weights_fixed` scopes this backbone is in
        self._verified = False  # checked since the innermost scope began: not again in it

    def packed_layers(self, layers: list[FusedLayer]) -> list[dict]:
        """Each layer's `packed()`, checked for changed parameters in one call of the extension
        (`unchanged`) instead of one Python check per layer (inside a `weights_fixed` scope,
        once for the scope); packed again where any changed."""
        checked = self._checked
        if ((self._verified and checked is not None and checked[0] == layers)
                or self.still_packed(layers)):
            self._verified = self._fixed > 0
            return checked[2]
        self._verified = False
        packed = [layer.packed() for layer in layers]  # packs again what changed
        slots = [layer.slots() for layer in layers]
        if any(s is None for s in slots):
            self._checked = None  # a parameter not in its module's dict: check layer by layer
            return packed
        owners, names = zip(*[slot for layer in slots for slot in layer])
        tensors = [owner[name] for owner, name in zip(owners, names)]
        keys = torch.tensor([k for t in tensors for k in ((0, 0) if t is None else _key([t])[0])],
                            dtype=torch.long)
        self._checked = (layers, (list(owners), list(names), tensors, keys), packed)
        self._verified = self._fixed > 0
        return packed

    def still_packed(self, layers: list[FusedLayer] | None = None) -> bool:
        """Whether `layers` (by default the backbone's fused layers now) are the ones packed
        last and their packed weights are those of their parameters now (False: not known)."""
        checked = self._checked
        layers = self._fused_layers() if layers is None else layers
        return checked is not None and checked[0] == layers and load().unchanged(*checked[1])

    def layers_loop(self, layers: list[FusedLayer], packed: list[dict]):
        """The extension's loop over these layers (`Layers`), built again when they are packed
        again; None where layer i does not keep its keys and values in the cache's layer i."""
        loop = self._loop
        if loop is None or loop[0] is not packed:
            in_order = all(layer.layer_idx == i for i, layer in enumerate(layers))
            self._loop = loop = (packed, load().Layers(packed, self.prefetch) if in_order else None)
        return loop[1]

    def _fused_layers(self) -> list[FusedLayer] | None:
        # zip, not a slice: slicing a ModuleList builds a new one (an `add_module` call a layer)
        count = range(self.backbone.config.num_hidden_layers)
        layers = [layer.__dict__.get("forward") for _, layer in zip(count, self.backbone.layers)]
        return layers if all(isinstance(f, FusedLayer) for f in layers) else None

    def __call__(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                 position_ids: Tensor | None = None, cache=None,
                 inputs_embeds: Tensor | None = None, use_cache: bool | None = None, **kwargs):
        from transformers.cache_utils import DynamicCache
        from transformers.masking_utils import create_causal_mask
        from transformers.modeling_outputs import BaseModelOutputWithPast

        model = self.backbone
        cache = kwargs.pop("past_key_values", cache)  # the name before transformers 5.x

        def own():  # the model's own forward, on what this call has computed so far
            return self.original(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, cache=cache,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)

        layers = self._fused_layers()
        config = model.config  # HF's forward takes these flags from the config when not given
        if (layers is None or model.training or (input_ids is None) == (inputs_embeds is None)
                or any(k not in self.PASSED for k in kwargs)
                or kwargs.get("output_attentions", getattr(config, "output_attentions", False))
                or kwargs.get("output_hidden_states",
                              getattr(config, "output_hidden_states", False))
                or kwargs.get("return_dict") is False
                or isinstance(attention_mask, dict)  # masks per layer type, made by `generate`
                or (torch.is_grad_enabled()
                    and any(_wants_grad(layer._params()) for layer in layers))):
            return own()
        if inputs_embeds is None:
            inputs_embeds, input_ids = model.embed_tokens(input_ids), None  # (B, n, d)
        first = layers[0].layer.self_attn
        if inputs_embeds.dim() != 3 or not _runs_fused(inputs_embeds, first.q_proj.weight):
            return own()
        if use_cache is None:
            use_cache = model.config.use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=model.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            n = inputs_embeds.shape[1]
            position_ids = (torch.arange(n, device=inputs_embeds.device) + past)[None]
        mask = create_causal_mask(config=model.config, inputs_embeds=inputs_embeds,
                                  attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        cos_sin = model.rotary_emb(inputs_embeds, position_ids=position_ids)
        if (not _fused_mask(mask, inputs_embeds.shape[1])
                or cos_sin[0].shape[-1] != first.head_dim):
            return own()
        hidden, packed = inputs_embeds, self.packed_layers(layers)
        # a cache that lets the kernels write its buffers (ours: static and growing; `reserve`
        # changes nothing) takes no call per layer: the whole loop runs in the extension
        reserve = getattr(cache, "reserve", None)
        buffers = reserve(hidden.shape[1]) if reserve is not None else None
        loop = None
        if buffers is not None and len(buffers[0]) == len(layers):
            loop = self.layers_loop(layers, packed)
        if loop is not None:
            keys, values, slots, visible = buffers
            cos, sin = cos_sin
            hidden = loop.forward(hidden, cos, sin, mask, keys, values, slots, visible)
            cache.commit(hidden.shape[1])
        else:
            for layer, weights in zip(layers, packed):
                # kwargs reach `cache.update`, as Hugging Face's layers pass them
                hidden = layer.run(hidden, cos_sin, mask, cache, kwargs, weights)
        return BaseModelOutputWithPast(last_hidden_state=model.norm(hidden), cache=cache)


class FusedNorm:
    """A fused base model's final RMSNorm in the extension: PyTorch's six operations on a
    step's row are slow once the weights' stream has evicted their code and data. Installed as
    the norm's `forward`, so the model's own forward (a call `FusedBackbone` steps aside from)
    normalises the same way, to the bit; anything not fused goes to `original`."""

    def __init__(self, norm: nn.Module, original):
        self.norm, self.original = norm, original

    def __call__(self, hidden_states: Tensor) -> Tensor:
        weight = _param(self.norm, "weight")
        if weight is None or not _runs_fused(hidden_states, weight):
            return self.original(hidden_states)
        return load().rms_norm(hidden_states, weight.detach(), self.norm.variance_epsilon)


@contextmanager
def weights_fixed(model: nn.Module) -> Iterator[None]:
    """Inside: `model`'s weights do not change, so each fused backbone in it checks its layers'
    parameters for changes (`unchanged`) once, as the scope begins (or at its first forward, if
    nothing was packed yet), not before every forward. The check reads hundreds of Python and
    tensor objects that the stream of the weights has just evicted from the caches. The engine
    decodes inside one (through its runner's backend, `eagle.kernels.backends.Fused`); a change
    made inside (a callback that edits the weights mid-generation) is seen in the next scope,
    or outside one."""
    backbones = [f for m in model.modules()
                 if isinstance(f := m.__dict__.get("forward"), FusedBackbone)]
    for backbone in backbones:
        backbone._fixed += 1
        backbone._verified = backbone.still_packed()  # checked now, or at the first forward
    try:
        yield
    finally:
        for backbone in backbones:
            backbone._fixed -= 1
            backbone._verified = False


def fuse_layers(model: nn.Module, prefetch: bool = False) -> int:
    """Install the fused forward on every supported decoder layer of `model`
    (`supported_layer`), with software prefetch in its products or not
    (`kernels=fused_prefetch`; a layer or backbone fused before takes the new setting); returns
    how many run it."""
    count = 0
    for module in model.modules():
        if supported_layer(module):
            if not isinstance(module.__dict__.get("forward"), FusedLayer):
                kept = module.__dict__.pop("_eagle_fused", None)  # left by a switch that kept it
                module.forward = kept or FusedLayer(module, module.forward)
            module.forward.prefetch = prefetch
            count += 1
    for module in model.modules():  # then the backbones whose layers all run fused
        installed = module.__dict__.get("forward")
        if isinstance(installed, FusedBackbone) and installed.prefetch != prefetch:
            # its loop is built again with the setting
            installed.prefetch, installed._loop = prefetch, None
        if (type(module).__name__ in BACKBONES
                and all(hasattr(module, a) for a in BACKBONE_PARTS)
                and not isinstance(installed, FusedBackbone)):
            backbone = FusedBackbone(module, module.forward, prefetch)
            if backbone._fused_layers() is not None:
                module.forward = backbone
                norm = module.norm
                if (type(norm).__name__ in NORMS and hasattr(norm, "variance_epsilon")
                        and not isinstance(norm.__dict__.get("forward"), FusedNorm)):
                    norm.forward = FusedNorm(norm, norm.forward)
    return count


def unfuse_layers(model: nn.Module, release: bool = True) -> None:
    """Give every fused layer of `model` its own forward back; its packed weights are freed, or
    kept for the next `fuse_layers` if `release` is False."""
    for module in model.modules():
        layer = module.__dict__.get("forward")
        if isinstance(layer, (FusedBackbone, FusedNorm)):
            del module.forward
        elif isinstance(layer, FusedLayer):
            del module.forward
            if release:
                layer.release()
            else:
                module.__dict__["_eagle_fused"] = layer
        elif release:
            kept = module.__dict__.pop("_eagle_fused", None)
            if kept is not None:
                kept.release()
