"""torch.compile for fixed-shape passes (the static runner's verification, the drafter's passes)."""

from __future__ import annotations

from collections.abc import Callable

import torch

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that capture CUDA graphs


def compile_static(fn: Callable, mode: str | None) -> Callable:
    """`fn` compiled for fixed shapes (a new shape compiles a new graph, never a dynamic one).

    mode None returns `fn` unchanged (eager). With CUDA graphs ("reduce-overhead") each call
    starts a new graph step and its tensor outputs are cloned: a later replay overwrites a
    graph's outputs, and callers keep some (features, drafted hidden states) across calls.
    """
    if mode is None:
        return fn
    compiled = torch.compile(fn, mode=None if mode == "default" else mode, dynamic=False)
    if mode not in CUDA_GRAPH_MODES:
        return compiled

    def run(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return tuple(t.clone() for t in compiled(*args))

    return run
