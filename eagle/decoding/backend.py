"""The kernel backend a model runs on, as the decoding runtime sees it.

The runtime (engine, runners, caches, compiled passes) is plain PyTorch. An optional backend
(`eagle.kernels`: oneDNN's packed products, our fused C++ kernels) switches a model's linears
and decoder layers in place, and marks every module it switched with itself. The runtime never
imports a backend: it reads the mark (`backend_of`) and asks the backend object the few things
that differ under it. A model no backend switched answers with `PLAIN`, plain PyTorch.

What a backend answers:

    name                          its kernel setting ("default" for plain PyTorch)
    weights_fixed(model)          a scope in which the model's weights do not change (one
                                  decoding call): a backend that checks its packed weights
                                  for changes may check once instead of every forward
    move_slots(tensors, src, dst) copy the KV entries at slots `src` to the slots from `dst`
                                  (an accepted path next to the committed prefix)
    dynamic_compile               whether `torch.compile` should trace the model's passes with
                                  dynamic shapes (`eagle.decoding.compile`)
    adopt(module)                 put a module made beside one on this backend (a drafter next
                                  to its target, a copy of a head's rows) on it too

One more channel runs beside these hooks: a forward that writes the KV cache itself (the fused
kernels' loop over the layers) asks the cache for its buffers with `reserve` and hands the new
entries back with `commit` (`eagle.decoding.kv_cache`, `eagle.decoding.static_cache`); a plain
forward never calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn

MARK = "_eagle_backend"  # the attribute a backend sets on each module it switched


class KernelBackend:
    """Plain PyTorch: the base of every backend, and the one a model without a mark runs."""

    name = "default"
    dynamic_compile = False

    def weights_fixed(self, model: nn.Module) -> AbstractContextManager:
        """A scope in which `model`'s weights do not change. Plain PyTorch reads them anew in
        every product, so nothing needs telling."""
        return nullcontext()

    def move_slots(self, tensors: Sequence[Tensor], src: Sequence[int], dst: int) -> None:
        """In each (B, H_kv, T, D) tensor, copy the entries at slots `src` (increasing) to slots
        dst..dst+len(src)-1: a gather first (a copy), then a write in place, so overlapping
        ranges are safe."""
        index = torch.as_tensor(src, dtype=torch.long)
        n = len(src)
        for t in tensors:
            own = index if index.device == t.device else index.to(t.device)  # layers over GPUs
            t[:, :, dst:dst + n] = t[:, :, own]

    def adopt(self, module: nn.Module) -> nn.Module:
        """`module` on this backend too; returns it. A new module runs plain PyTorch already."""
        return module

    def __repr__(self) -> str:
        return f"<kernel backend {self.name}>"


PLAIN = KernelBackend()


def backend_of(model: nn.Module) -> KernelBackend:
    """The backend `model` runs on: the first mark among its modules, else `PLAIN`.

    A backend switches every linear of a model it is put on, so a switched model carries its
    mark within its first few modules."""
    for module in model.modules():
        backend = module.__dict__.get(MARK)
        if backend is not None:
            return backend
    return PLAIN


def kernels_of(model: nn.Module) -> str:
    """The kernel setting `model` runs ("default": plain PyTorch)."""
    return backend_of(model).name
