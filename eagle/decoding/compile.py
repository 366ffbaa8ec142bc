"""torch.compile for fixed-shape passes (the static runner's verification, the drafter's passes)."""

from __future__ import annotations

from collections.abc import Callable

import torch

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs


def compile_static(fn: Callable, mode: str | None) -> Callable:
    """`fn` compiled for fixed shapes (a new shape compiles a new graph, never a dynamic one).

    mode None returns `fn` unchanged (eager). The weights are frozen into the graph (Inductor's
    `freezing`): the passes only decode, and frozen float32 linears on a CPU run as MKL products on
    weights packed once, faster than `F.linear` from 1 to 26 rows (LOG.md, 2026-12-02: on SmolLM2
    a forward of 8 tokens took 59 ms compiled unfrozen, 43 ms frozen).
    A model whose weights change after its first compiled call must be compiled again.
    With CUDA graphs ("reduce-overhead") each call
    starts a new graph step and its tensor outputs are cloned: a later replay overwrites a
    graph's outputs, and callers keep some (features, drafted hidden states) across calls.
    """
    if mode is None:
        return fn
    # torch.compile takes a mode or options, not both: the mode's own options, plus freezing
    from torch._inductor import list_mode_options  # Inductor only loads when something compiles

    options = {**list_mode_options(mode), "freezing": True}
    compiled = torch.compile(fn, dynamic=False, options=options)
    if mode not in CUDA_GRAPH_MODES:
        return compiled

    def run(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return tuple(t.clone() for t in compiled(*args))

    return run
