"""The kernel settings as backends: which run here, and switching a model to one in place.

`use_kernels(model, setting)` switches every `nn.Linear` of a model in place: each stays the
same module object with the same parameters (so a tied LM head stays tied, a drafter that holds
the target's head sees the switch, and `state_dict` and `isinstance(m, nn.Linear)` are
unchanged); only its forward changes. On the fused settings every supported decoder layer
(and a backbone whose layers all are) runs fused as well (`eagle.kernels.fused`). Every linear
switched carries the setting's backend object (`eagle.decoding.backend.MARK`), which the
decoding runtime asks what differs under it:

  `OneDNN`  compiled passes trace with dynamic shapes, so that Inductor's frozen linears run
            on oneDNN's product too (`eagle.decoding.compile`);
  `Fused`   the weights are checked for changes once per decoding call (`weights_fixed`), and
            an accepted path's KV moves in one call of the extension (`move_slots`).

Whatever needs gradients, another device or another dtype runs `F.linear` as before, so
training is untouched; so does a pass under `torch.compile`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from eagle.decoding.backend import MARK, KernelBackend
from eagle.kernels import fused, onednn

KERNELS = ("default", "onednn", "fused", "fused_prefetch")
# the fused kernels' two settings: the same products and floats, "fused_prefetch" also asking
# for each weight ahead in software (faster on some CPUs, slower on others: docs/performance.md)
FUSED = ("fused", "fused_prefetch")


class OneDNN(KernelBackend):
    """Linears on oneDNN's packed products (`eagle.kernels.onednn`)."""

    name = "onednn"
    # Inductor's frozen float32 linears run MKL's product where the row count is fixed and
    # oneDNN's where it is symbolic: dynamic shapes keep compiled passes on oneDNN
    dynamic_compile = True

    def adopt(self, module: nn.Module) -> nn.Module:
        return use_kernels(module, self.name)


class Fused(KernelBackend):
    """Linears and decoder layers on our C++ kernels (`eagle.kernels.fused`), with software
    prefetch in their products or not."""

    def __init__(self, prefetch: bool):
        self.prefetch = prefetch
        self.name = "fused_prefetch" if prefetch else "fused"

    def weights_fixed(self, model: nn.Module) -> AbstractContextManager:
        return fused.weights_fixed(model)

    def move_slots(self, tensors: Sequence[Tensor], src: Sequence[int], dst: int) -> None:
        if all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors):
            fused.load().move_slots(list(tensors), list(src), dst)  # every tensor in one call
        else:
            super().move_slots(tensors, src, dst)

    def adopt(self, module: nn.Module) -> nn.Module:
        return use_kernels(module, self.name)


BACKENDS = {"onednn": OneDNN(), "fused": Fused(prefetch=False),
            "fused_prefetch": Fused(prefetch=True)}


def available_kernels(device: str | torch.device = "cpu") -> tuple[str, ...]:
    """The settings that change anything on `device`: packed products exist for CPUs only (the
    fused kernels where they build here: the first call compiles them, once)."""
    if torch.device(device).type != "cpu":
        return ("default",)
    return ("default", *(("onednn",) if onednn.onednn_available() else ()),
            *(FUSED if fused.available() else ()))


def check_kernels(kernels: str, device: str | torch.device = "cpu") -> str:
    """`kernels` if it runs on `device` here, else a ValueError that says why."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; choose one of {KERNELS}")
    if kernels not in available_kernels(device):
        if kernels in FUSED and torch.device(device).type == "cpu":
            fused.load()  # raises FusedUnavailable, saying why
        raise ValueError(f"kernels={kernels} runs on a CPU only (onednn: with a PyTorch build that "
                         "has oneDNN, torch.backends.mkldnn; fused: AVX2 and a C++ compiler), not "
                         f"on {device} here: use kernels=default")
    return kernels


def use_kernels(model: nn.Module, kernels: str = "default", release: bool = True) -> nn.Module:
    """Switch every `nn.Linear` of `model` to `kernels` in place (see the module docstring), and
    on the fused settings every supported decoder layer too; returns `model`. Switching to
    another setting frees the packed weights, unless `release` is False (a switch back then
    reuses them: timing the settings in turn); the two fused settings share theirs."""
    check_kernels(kernels, next(model.parameters()).device if kernels != "default" else "cpu")
    backend = BACKENDS.get(kernels)  # None: plain PyTorch
    if kernels not in FUSED:
        fused.unfuse_layers(model, release)
    family = "fused" if kernels in FUSED else kernels  # the class, and the packed weights kept
    family_of = {onednn.PackedLinear: "onednn", fused.FusedLinear: "fused"}
    for module in model.modules():
        if family_of.get(type(module), family) != family:
            module.__class__ = nn.Linear  # back to plain first; then on to the setting asked for
        if type(module) is nn.Linear and family == "onednn":
            onednn.switch_on(module)
        elif type(module) is nn.Linear and family == "fused":
            fused.switch_on(module)
        if isinstance(module, fused.FusedLinear):
            module._prefetch = kernels == "fused_prefetch"
        if release and isinstance(module, nn.Linear):
            if family != "onednn":
                onednn.release(module)
            if family != "fused":
                fused.release(module)
        if type(module) in family_of:
            module.__dict__[MARK] = backend
        else:
            module.__dict__.pop(MARK, None)
    if family == "onednn":
        onednn.group_siblings(model)
    elif family == "fused":
        fused.fuse_layers(model, prefetch=kernels == "fused_prefetch")
    return model


def free_memory_bytes() -> int | None:
    """Memory this machine has free now (Linux: sysconf), or None where that is not known."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf, or not these names on this OS
        return None
