"""oneDNN's inner product on weights packed once: the `kernels=onednn` setting's linears.

A decoding step multiplies a few rows by every weight of the target, so its products are
bound by reading the weights. On some CPUs PyTorch's `F.linear` (MKL) runs such products far
below the memory's speed, while oneDNN's product on a weight reordered once into its blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's freezing does) runs near it
(measured: docs/performance.md). float32 only: bf16 products already run on oneDNN through
`F.linear`, and packing them was slower there.

Sibling linears (`SIBLINGS`: an attention's q/k/v projections, a gated MLP's gate/up) read the
same input one after another; they share one packed product of their stacked weights
(`SiblingGroup`): every product pays a fixed call overhead on top of reading its weight, and a
small model's k/v weights are small, so fewer, larger products save that overhead with the same
logits to the bit.

`eagle.kernels.backends.use_kernels` switches an `nn.Linear` to `PackedLinear` in place. The
packed copy is one more copy of every linear weight in memory, and is made again when the weight
changes (its version counter or its storage). An edit through `.data`, or of a weight made under
`torch.inference_mode`, changes neither: after one, switch to "default" and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACKED_DTYPES = (torch.float32,)  # what `PackedLinear.forward` packs (its checks spell it out)
# oneDNN packs a weight for a row count it is told: packed for 8 rows, the products of 1 to 64
# rows all ran at or near their best; packed for 1 row, wider products ran slower
PACK_ROWS = 8
# sibling linears of one module that Hugging Face's decoder layers (Llama, Qwen2, Mistral, Gemma,
# ...) call one after another on the same input: one packed product serves each group
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: Tensor) -> Tensor:
    """`weight` (out, in) in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def weight_key(w: Tensor) -> tuple[int, int]:
    """What changes when a weight does: in place (its version counter; a weight made under
    inference mode has none) or for new storage (a `.to()` or a load swaps the parameter's
    data)."""
    return (0 if w.is_inference() else w._version, w.data_ptr())


class SiblingGroup:
    """Packed linears of one module that read the same input (`SIBLINGS`).

    The first sibling called on an input computes every sibling's output in one product of their
    stacked weights and keeps the others' outputs; a sibling then called on that same tensor
    takes its own. A sibling called on another input (or twice) computes the group's product
    anew, so a model that feeds its siblings different inputs is still right, only slower.
    Siblings must read their input unchanged: an input changed in place in between is caught by
    its version counter, except under inference mode, where tensors have none (no decoder layer
    does that).
    """

    def __init__(self, members: list[PackedLinear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self._packed: Tensor | None = None
        self._bias: Tensor | None = None
        self._key: tuple | None = None
        self._input: tuple[Tensor, int] | None = None  # the last product's input and its version
        self._outputs: dict[int, Tensor] = {}  # sibling index -> its output, not yet taken

    def packed(self) -> tuple[Tensor, Tensor | None]:
        """The stacked weight in oneDNN's layout (and the stacked bias), packed again whenever
        any sibling's weight or bias changed."""
        params = [p for m in self.members for p in (m.weight, m.bias) if p is not None]
        key = tuple(weight_key(p) for p in params)
        if self._packed is None or self._key != key:
            self._packed = pack(torch.cat([m.weight.detach() for m in self.members]))
            self._bias = (None if self.members[0].bias is None
                          else torch.cat([m.bias.detach() for m in self.members]))
            self._key = key
        return self._packed, self._bias

    def forward(self, member: PackedLinear, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        i = next(j for j, m in enumerate(self.members) if m is member)
        version = 0 if x.is_inference() else x._version
        kept = self._input
        if kept is not None and kept[0] is x and kept[1] == version and i in self._outputs:
            out = self._outputs.pop(i)
            if not self._outputs:
                self._input = None  # every sibling served: hold no reference to the input
            return out
        weight, bias = self.packed()
        # (..., sum of the siblings' outputs)
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        # each output contiguous, as F.linear's: a model may view it in any shape
        parts = [p.contiguous() for p in out.split(self.sizes, dim=-1)]
        self._input, self._outputs = (x, version), {j: p for j, p in enumerate(parts) if j != i}
        return parts[i]

    def release(self) -> None:
        self._packed = self._bias = self._key = self._input = None
        self._outputs = {}


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose inference products on a CPU run oneDNN's kernel on a packed weight.

    Not built directly: `use_kernels` switches an existing `nn.Linear` to this class (the same
    object and parameters; a tied head stays tied). Whatever needs gradients, another device or
    another dtype, or runs under `torch.compile` (where Inductor's freezing packs the weights
    itself) runs `F.linear`.
    """

    _packed: Tensor | None
    _packed_key: tuple | None
    _siblings: SiblingGroup | None

    def packed_weight(self) -> Tensor:
        """The weight in oneDNN's layout, packed again whenever the weight changed."""
        key = weight_key(self.weight)
        if self._packed is None or self._packed_key != key:
            self._packed = pack(self.weight)
            self._packed_key = key
        return self._packed

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        w = self.weight  # this runs for every linear of every step: cheap checks, likeliest first
        if (x.dtype != torch.float32 or w.dtype != torch.float32 or not (x.is_cpu and w.is_cpu)
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
                or torch.compiler.is_compiling()  # compiled: Inductor packs the weights itself
                or not x.numel()):
            return F.linear(x, w, self.bias)
        if self._siblings is not None:
            return self._siblings.forward(self, x)
        bias = None if self.bias is None else self.bias.detach()
        # any leading dims
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), bias, "none", [], "")


def switch_on(linear: nn.Linear) -> None:
    """`linear` (a plain `nn.Linear`) to `PackedLinear`, in place: every reference sees it."""
    linear.__class__ = PackedLinear
    if not hasattr(linear, "_packed"):  # packed weights kept by an earlier switch stay
        linear._packed = linear._packed_key = linear._siblings = None


def group_siblings(model: nn.Module) -> None:
    """Give each group of `model`'s packed sibling linears (`SIBLINGS`) one shared product."""
    for module in model.modules():
        for names in SIBLINGS:
            group = [getattr(module, name, None) for name in names]
            if can_share(group) and any(m._siblings is None for m in group):
                shared = SiblingGroup(group)
                for m in group:
                    m._siblings = shared


def release(linear: nn.Linear) -> None:
    """Free the packed weights this setting left on `linear`."""
    if not hasattr(linear, "_packed"):
        return
    if linear._siblings is not None:
        linear._siblings.release()
    for name in ("_packed", "_packed_key", "_siblings"):
        delattr(linear, name)


def can_share(group: list) -> bool:
    """Whether these linears can share one packed product: all packed, one input width, one
    dtype, and a bias on all or none."""
    return (all(type(m) is PackedLinear for m in group)
            and len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None)
                     for m in group}) == 1)


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed copies of `model`'s float32 linear weights take (what "onednn" adds)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, nn.Linear) and m.weight.dtype in PACKED_DTYPES)
