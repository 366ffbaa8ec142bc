"""What a generation reports: per-round statistics, and the one definition of tau.

Every method reports through these types, engine methods and the Hugging Face peers alike
(`eagle.bench.methods` rebuilds the rounds of `generate` from forward hooks), and every report
computes tau with `tau`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


def tau(committed: int, forwards: int) -> float:
    """Tokens committed per target forward after the prefill, the bonus or correction token
    included (the prefill's forward commits the first token and is not counted)."""
    return committed / max(forwards, 1)


@dataclass
class RoundStats:
    """One verification forward of the target."""

    accepted: int        # draft tokens accepted (depth reached)
    committed: int       # tokens committed this round (accepted + 1, less any truncation)
    tree_size: int       # draft nodes scored
    draft_s: float = 0.0
    verify_s: float = 0.0
    path: tuple[int, ...] = (0,)  # accepted node indices from the root (0), in tree order


@dataclass
class DecodeStats:
    """One generation: the prefill, then one `RoundStats` per target forward."""

    prompt_len: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0
    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return 1 + self.committed  # the prefill commits one token

    @property
    def committed(self) -> int:
        """Tokens committed by the rounds (after the prefill's first token)."""
        return sum(r.committed for r in self.rounds)

    @property
    def forwards(self) -> int:
        return len(self.rounds)

    @property
    def tau(self) -> float:
        return tau(self.committed, self.forwards)

    @property
    def draft_s(self) -> float:
        return sum(r.draft_s for r in self.rounds)

    @property
    def verify_s(self) -> float:
        return sum(r.verify_s for r in self.rounds)

    def accepted_histogram(self, max_depth: int | None = None) -> list[int]:
        return accepted_histogram([r.accepted for r in self.rounds], max_depth)


def accepted_histogram(accepted: Iterable[int], max_depth: int | None = None) -> list[int]:
    """Rounds by accepted depth: entry d counts rounds that accepted d draft tokens (the last
    entry also counts deeper ones when `max_depth` is given)."""
    accepted = list(accepted)
    depth = max(accepted, default=0) if max_depth is None else max_depth
    hist = [0] * (depth + 1)
    for a in accepted:
        hist[min(a, depth)] += 1
    return hist


@dataclass
class DecodeResult:
    tokens: list[int]     # the new tokens only
    stats: DecodeStats

    @property
    def seconds(self) -> float:
        return self.stats.total_s

    @property
    def tau(self) -> float:
        return self.stats.tau
