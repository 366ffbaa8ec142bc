"""torch.compile for fixed-shape passes (the static runner's verification, the drafter's passes)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from eagle.decoding.backend import backend_of

CUDA_GRAPH_MODES = (
    "reduce-overhead",
    "max-autotune",
)  # torch.compile modes that capture CUDA graphs


def compile_static(fn: Callable, mode: str | None, module: nn.Module | None = None) -> Callable:
    """`fn` compiled (one graph per shape, but see the row count below); on a CPU with `module`'s
    weights frozen into the graph.

    mode None returns `fn` unchanged (eager). `module` is the model `fn` runs.

    On a CPU the weights are frozen (Inductor's `freezing`): the passes only decode, and frozen
    float32 linears run as products on weights packed once. Which packed product Inductor picks
    depends on the row count: MKL's where it is fixed, oneDNN's where it is symbolic. MKL's
    few-row products are fast on some CPUs and several times slower than oneDNN's from 2 rows on
    others, which is what the kernel backends choose by measurement (`eagle.kernels`). A module
    whose backend asks for it (`backend_of(module).dynamic_compile`: the oneDNN backend) is
    compiled with dynamic shapes, so that its frozen linears run on oneDNN too (one graph serves
    every row count above 1; a single row stays its own graph, where MKL's product is as fast).
    Otherwise every new shape compiles a new graph, never a dynamic one.

    Dynamo decides whether parameters are frozen constants from Inductor's global `freezing` flag
    when it traces (torch 2.13 ignores a `freezing` compile option there), so every call runs with
    that flag patched on: tracing happens inside a call, on the first one and on any recompile.
    Dynamo freezes static-address tensors with the weights, which is why a CPU's static caches are
    not marked so (`eagle.decoding.static_cache`). A model whose weights change after its first
    compiled call must be compiled again.

    Elsewhere nothing is frozen; with CUDA graphs ("reduce-overhead") each call starts a new
    graph step and its tensor outputs are cloned: a later replay overwrites a graph's outputs,
    and callers keep some (features, drafted hidden states) across calls.
    """
    if mode is None:
        return fn
    # Inductor only loads when something compiles
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    on_cpu = module is not None and next(module.parameters()).device.type == "cpu"
    dynamic = on_cpu and backend_of(module).dynamic_compile
    compiled = torch.compile(fn, dynamic=dynamic, options=list_mode_options(mode) or None)
    if on_cpu:

        def frozen(*args):
            with inductor_config.patch(freezing=True):
                return compiled(*args)

        return frozen
    if mode not in CUDA_GRAPH_MODES:
        return compiled

    def run(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return clone_outputs(compiled(*args))

    return run


def clone_outputs(out):
    """`out` with its tensors cloned and its structure kept: a tensor stays a tensor (the drafter
    pass returns one), a tuple a tuple (the verification returns logits and features)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
