"""EAGLE-1 speculative decoding: a library (no hydra here; entry points live at the repo root).

Layers, each importing only the ones before it (`tests/test_layers.py` checks it):

    eagle.{sampling, acceptance, tree, target, artifacts, hardware, cli, pipeline}   the vocabulary
    eagle.decoding    the speculative loop, target runners, caches, masks, statistics
    eagle.kernels     optional CPU kernels (oneDNN, fused C++): a backend behind the runner
    eagle.models      the EAGLE drafter, Medusa heads, checkpoints and exports
    eagle.proposers   drafting methods for the loop
    eagle.data        feature dumps, batches, samplers, distilled and regenerated data
    eagle.training    Lightning modules, data modules, the fit-and-export routine
    eagle.bench       methods by name, benchmark, timing, tree search, analysis

The names below are the public API; each is imported on first use, so `import eagle` stays
light.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "SamplingPolicy": "eagle.sampling",
    "Tree": "eagle.tree",
    "TreeTemplate": "eagle.tree",
    "resolve_tree": "eagle.tree",
    "TargetIdentity": "eagle.target",
    "load_target": "eagle.target",
    "SpeculativeDecoder": "eagle.decoding.engine",
    "DecodeResult": "eagle.decoding.stats",
    "make_runner": "eagle.decoding.runners",
    "EagleDrafter": "eagle.models.drafter",
    "load_drafter": "eagle.models.checkpoint",
    "save_drafter": "eagle.models.checkpoint",
    "MedusaHeads": "eagle.models.medusa",
    "eagle_proposer": "eagle.proposers",
    "medusa_proposer": "eagle.proposers",
    "DraftLM": "eagle.proposers",
    "TemplateProposer": "eagle.proposers",
    "PromptLookupProposer": "eagle.proposers",
    "METHODS": "eagle.bench.methods",
    "MethodContext": "eagle.bench.methods",
    "build_method": "eagle.bench.methods",
}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'eagle' has no attribute {name!r}")
