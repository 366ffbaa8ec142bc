"""Which kernel multiplies a decoding pass's few rows by its weights, on a CPU.

A decoding step multiplies 1 row (a verification: the tree's 4-64 rows) by every weight of
the target: the products are bound by reading the weights, and a step cannot beat reading
them once (`eagle.bench.floor`). PyTorch's `F.linear` runs those products at a fraction of the
memory's speed on some CPUs: on a 2-core AMD EPYC (AVX512-BF16, no AMX) with torch 2.13's MKL,
SmolLM2's 49,152 x 576 LM head took 10.4 ms for 1 row (11 GB/s against a streaming read of
33 GB/s) and 19-21 ms for 4-16 rows, while oneDNN's product on the same weight packed once
took 5.0-5.7 ms for 1 row and 4.7-4.9 ms for 4-8 rows (LOG.md, 2026-12-03). Kernels:

  "default"  `F.linear` (PyTorch's own choice: MKL on x86 CPUs);
  "onednn"   oneDNN's inner product on a weight reordered once into its blocked layout
             (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's freezing does for
             bf16 linears), for float32 on a CPU. bf16 products already run on oneDNN
             through `F.linear`, and packing them was slower there (SmolLM2 in bf16: a step
             of 43 ms packed against 38 ms), so bf16 keeps `F.linear`;
  "fused"    our C++ kernels (`eagle.kernels.fused`): packed products and whole decoder layers;
  "fused_prefetch"  the same products and floats, each also asking for its weights ahead in
             software (one block of rows: 16 k-steps ahead; more: the blocks share the next chunk):
             a 5-token forward of SmolLM2 from 33.4 to 26.6 ms on a 2-core Intel Xeon, every product
             slower on a 2-core AMD EPYC (LOG.md), so `kernels=auto` times both.

Sibling linears (`SIBLINGS`: an attention's q/k/v projections, a gated MLP's gate/up) read the
same input one after another; on "onednn" they share one packed product of their stacked weights
(`SiblingGroup`): the first called computes every sibling's output, the others take theirs. Each
product costs ~30-45 us of call overhead on top of reading its weight, and SmolLM2's k/v weights
are 0.44 MB, so 4 products a layer instead of 7 took its float32 step to 0.88-0.94x on the
AVX512 EPYC (5-8 ms), with the same logits to the bit (LOG.md, 2026-12-03 night).

`use_kernels(model, "onednn")` switches every `nn.Linear` of a model in place: each stays the same
module object with the same parameters (so a tied LM head stays tied, a drafter that holds the
target's head sees the switch, and `state_dict` and `isinstance(m, nn.Linear)` are unchanged);
only its forward changes. The packed copy of the weight is extra memory (one more copy of every
linear weight) and is made again if the weight changes (its version counter or its storage).
An edit through `.data`, or of a weight made under `torch.inference_mode`, changes neither: after
one, switch to "default" and back (`use_kernels` frees the packed copies on a switch).
Whatever needs gradients, another device or another dtype runs `F.linear` as before, so training
is untouched; so does a pass under `torch.compile`, where Inductor's freezing packs the weights
itself, onto oneDNN too when the module is on these kernels (`eagle.decoding.compile`). A packed
product rounds differently from `F.linear` (as MKL's own kernels differ between 1 and 2 rows), so
exactness holds against the target with the same kernels: a decoding run applies one kernel
setting to every method alike, vanilla decoding included.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle.kernels import fused

KERNELS = ("default", "onednn", "fused", "fused_prefetch")
# the fused kernels' two settings: the same products and floats, "fused_prefetch" also asking for each
# weight ahead in software (faster on an Intel Xeon, slower on an AMD EPYC: LOG.md)
FUSED = ("fused", "fused_prefetch")
PACKED_DTYPES = (torch.float32,)  # what `PackedLinear.forward` packs (its checks spell it out)
# oneDNN packs a weight for a row count it is told: packed for 8 rows, the products of 1 to 64
# rows all ran at or near their best (packed for 1 row, 4-64 rows ran up to 2x slower; LOG.md)
PACK_ROWS = 8
# sibling linears of one module that Hugging Face's decoder layers (Llama, Qwen2, Mistral, Gemma,
# ...) call one after another on the same input: one packed product serves each group
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def available_kernels(device: str | torch.device = "cpu") -> tuple[str, ...]:
    """The settings that change anything on `device`: packed products exist for CPUs only (the
    fused kernels where they build here: the first call compiles them, once)."""
    if torch.device(device).type != "cpu":
        return ("default",)
    return ("default", *(("onednn",) if onednn_available() else ()), *(FUSED if fused.available() else ()))


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _weight_key(w: Tensor) -> tuple[int, int]:
    """What changes when a weight does: in place (its version counter; a weight made under
    inference mode has none) or for new storage (a `.to()` or a load swaps the parameter's data)."""
    return (0 if w.is_inference() else w._version, w.data_ptr())


class SiblingGroup:
    """Packed linears of one module that read the same input (`SIBLINGS`): the first sibling called
    on an input computes every sibling's output in one product of their stacked weights and keeps
    the others' outputs; a sibling then called on that same tensor takes its own. A sibling called
    on another input (or twice) computes the group's product anew, so a model that feeds its
    siblings different inputs is still right, only slower. Siblings must read their input
    unchanged: an input changed in place in between is caught by its version counter, except
    under inference mode, where tensors have none (no decoder layer does that)."""

    def __init__(self, members: list[PackedLinear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self._packed: Tensor | None = None
        self._bias: Tensor | None = None
        self._key: tuple | None = None
        self._input: tuple[Tensor, int] | None = None  # the last product's input and its version
        self._outputs: dict[int, Tensor] = {}  # sibling index -> its output of that product, not yet taken

    def packed(self) -> tuple[Tensor, Tensor | None]:
        """The stacked weight in oneDNN's layout (and the stacked bias), packed again whenever any
        sibling's weight or bias changed."""
        params = [p for m in self.members for p in (m.weight, m.bias) if p is not None]
        key = tuple(_weight_key(p) for p in params)
        if self._packed is None or self._key != key:
            self._packed = _pack(torch.cat([m.weight.detach() for m in self.members]))
            self._bias = (None if self.members[0].bias is None
                          else torch.cat([m.bias.detach() for m in self.members]))
            self._key = key
        return self._packed, self._bias

    def forward(self, member: PackedLinear, x: Tensor) -> Tensor:  # (..., in) -> (..., member's out)
        i = next(j for j, m in enumerate(self.members) if m is member)
        version = 0 if x.is_inference() else x._version
        if self._input is not None and self._input[0] is x and self._input[1] == version and i in self._outputs:
            out = self._outputs.pop(i)
            if not self._outputs:
                self._input = None  # every sibling served: hold no reference to the input
            return out
        weight, bias = self.packed()
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # (..., sum of outs)
        # each output contiguous, as F.linear's: a model may view it in any shape
        parts = [p.contiguous() for p in out.split(self.sizes, dim=-1)]
        self._input, self._outputs = (x, version), {j: p for j, p in enumerate(parts) if j != i}
        return parts[i]

    def release(self) -> None:
        self._packed = self._bias = self._key = self._input = None
        self._outputs = {}


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose inference products on a CPU run oneDNN's kernel on a packed weight.

    Not built directly: `use_kernels` switches an existing `nn.Linear` to this class.
    """

    _packed: Tensor | None
    _packed_key: tuple | None
    _siblings: SiblingGroup | None

    def packed_weight(self) -> Tensor:
        """The weight in oneDNN's layout, packed again whenever the weight changed (`_weight_key`)."""
        key = _weight_key(self.weight)
        if self._packed is None or self._packed_key != key:
            self._packed = _pack(self.weight)
            self._packed_key = key
        return self._packed

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        w = self.weight  # this runs ~200 times a step: the checks are the cheap ones, most likely first
        if (x.dtype != torch.float32 or w.dtype != torch.float32 or not (x.is_cpu and w.is_cpu)
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
                or torch.compiler.is_compiling()  # compiled, Inductor packs the weights itself (freezing)
                or not x.numel()):
            return F.linear(x, w, self.bias)
        if self._siblings is not None:
            return self._siblings.forward(self, x)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), bias, "none", [], "")  # any leading dims


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed copies of `model`'s float32 linear weights take (what "onednn" adds)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, nn.Linear) and m.weight.dtype in PACKED_DTYPES)


def free_memory_bytes() -> int | None:
    """Memory this machine has free now (Linux: sysconf), or None where that is not known."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf, or not these names on this OS
        return None


def check_kernels(kernels: str, device: str | torch.device = "cpu") -> str:
    """`kernels` if it runs on `device` here, else a ValueError that says why."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; choose one of {KERNELS}")
    if kernels not in available_kernels(device):
        if kernels in FUSED and torch.device(device).type == "cpu":
            fused.load()  # raises FusedUnavailable, saying why
        raise ValueError(f"kernels={kernels} runs on a CPU only (onednn: with a PyTorch build that has oneDNN, "
                         f"torch.backends.mkldnn; fused: AVX2 and a C++ compiler), not on {device} here: "
                         "use kernels=default")
    return kernels


def use_kernels(model: nn.Module, kernels: str = "default", release: bool = True) -> nn.Module:
    """Switch every `nn.Linear` of `model` to `kernels` in place (see the module docstring), and
    on the fused settings every supported decoder layer too (`eagle.kernels.fused`); returns
    `model`. Switching to another setting frees the packed weights, unless `release` is False (a
    switch back then reuses them: timing the settings in turn); the two fused settings share theirs."""
    check_kernels(kernels, next(model.parameters()).device if kernels != "default" else "cpu")
    if kernels not in FUSED:
        fused.unfuse_layers(model, release)
    family = "fused" if kernels in FUSED else kernels  # the class, and the packed weights kept
    setting_of = {PackedLinear: "onednn", fused.FusedLinear: "fused"}
    for module in model.modules():
        if setting_of.get(type(module), family) != family:
            module.__class__ = nn.Linear  # back to plain first; then on to the setting asked for
        if type(module) is nn.Linear and kernels == "onednn":
            module.__class__ = PackedLinear  # the same object: every reference to it sees the switch
            if not hasattr(module, "_packed"):
                module._packed = module._packed_key = module._siblings = None
        elif type(module) is nn.Linear and family == "fused":
            module.__class__ = fused.FusedLinear
            if not hasattr(module, "_fused"):
                module._fused = None
        if isinstance(module, fused.FusedLinear):
            module._prefetch = kernels == "fused_prefetch"
        if release and isinstance(module, nn.Linear):
            _release(module, keep=family)
    if kernels == "onednn":
        for module in model.modules():
            for names in SIBLINGS:
                group = [getattr(module, name, None) for name in names]
                if can_share(group) and any(m._siblings is None for m in group):
                    shared = SiblingGroup(group)
                    for m in group:
                        m._siblings = shared
    elif kernels in FUSED:
        fused.fuse_layers(model, prefetch=kernels == "fused_prefetch")
    return model


def _release(module: nn.Linear, keep: str) -> None:
    """Free what the packed settings other than `keep` left on this linear."""
    names = {"onednn": ("_packed", "_packed_key", "_siblings"), "fused": ("_fused",)}
    for setting, attrs in names.items():
        if setting == keep or not hasattr(module, attrs[0]):
            continue
        if getattr(module, "_siblings", None) is not None and setting == "onednn":
            module._siblings.release()
        for name in attrs:
            delattr(module, name)


def can_share(group: list) -> bool:
    """Whether these linears can share one packed product: all packed, one input width, one
    dtype, and a bias on all or none."""
    return (all(type(m) is PackedLinear for m in group)
            and len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in group}) == 1)


def kernels_of(model: nn.Module) -> str:
    """The kernels `model`'s linears run: "onednn", "fused" or "fused_prefetch" when any runs them,
    else "default"."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            return "onednn"
        if isinstance(m, fused.FusedLinear):
            return fused.setting(m)
    return "default"


def restricted_linear(head: nn.Module, ids: Tensor) -> nn.Linear:
    """A linear of `head`'s rows `ids` only (K, H), with the same kernels as `head` (a drafter's
    head over a reduced drafting vocabulary)."""
    bias = getattr(head, "bias", None)
    rows = nn.Linear(head.weight.shape[1], ids.numel(), bias=bias is not None, device=head.weight.device,
                     dtype=head.weight.dtype)
    with torch.no_grad():
        rows.weight.copy_(head.weight[ids])
        if bias is not None:
            rows.bias.copy_(bias[ids])
    rows.requires_grad_(False)
    kernels = "onednn" if isinstance(head, PackedLinear) else fused.setting(head) if isinstance(head, fused.FusedLinear) else None
    return use_kernels(rows, kernels) if kernels else rows
