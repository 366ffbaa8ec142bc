"""The decoding runtime: one speculative loop for every method (`engine`), the target runners
that keep its KV (`runners`: growing or static), the draft models' caches (`draft_cache`),
attention masks (`masks`), per-round statistics (`stats`), compilation (`compile`), and the
interface to an optional kernel backend (`backend`; the kernels live in `eagle.kernels`).

Imports only the vocabulary at the top of `eagle` (sampling, acceptance, tree, target).
"""

from eagle.decoding.engine import (
           DecodeState,
           DraftTree,
           Proposer,
           SpeculativeDecoder,
           VanillaProposer,
)
from eagle.decoding.runners import (
           RUNNERS,
           ContextOverflowError,
           DynamicRunner,
           StaticRunner,
           make_runner,
)
from eagle.decoding.stats import DecodeResult, DecodeStats, RoundStats, tau

__all__ = [
    "RUNNERS",
    "ContextOverflowError",
    "DecodeResult",
    "DecodeState",
    "DecodeStats",
    "DraftTree",
    "DynamicRunner",
    "Proposer",
    "RoundStats",
    "SpeculativeDecoder",
    "StaticRunner",
    "VanillaProposer",
    "make_runner",
    "tau",
]
