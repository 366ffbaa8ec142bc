"""Toy models for exact enumeration: context-dependent random target and proposal tables, and
every draft tree a proposer could draw with its probability (tests/test_acceptance.py,
tests/test_merge.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from eagle.tree import Tree

F64 = torch.float64


@dataclass
class ToyModels:
    """Context-dependent toy target p(.|prefix) and proposal q(.|prefix).

    Fixed random Dirichlet tables keyed by the prefix; `p_zero` / `q_zero` tokens get zero
    probability in every context (renormalised).
    """

    V: int
    seed: int = 0
    p_zero: tuple[int, ...] = ()
    q_zero: tuple[int, ...] = ()
    cache: dict = field(default_factory=dict)

    def _dist(self, kind: int, prefix: tuple[int, ...], zero: tuple[int, ...]) -> torch.Tensor:
        key = (kind, prefix)
        if key not in self.cache:
            rng = np.random.default_rng([self.seed, kind, len(prefix), *prefix])
            d = torch.tensor(rng.dirichlet(np.full(self.V, 0.7)), dtype=F64)
            d[list(zero)] = 0
            self.cache[key] = d / d.sum()
        return self.cache[key]

    def p(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return self._dist(0, prefix, self.p_zero)

    def q(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return self._dist(1, prefix, self.q_zero)


@dataclass(frozen=True)
class Case:
    parents: tuple[int, ...]
    scheme: str  # "iid": siblings i.i.d. from q; "wor": without replacement; "topk": one-hot
    V: int
    T: int  # number of emitted tokens whose joint distribution is checked
    p_zero: tuple[int, ...] = ()
    q_zero: tuple[int, ...] = ()
    seed: int = 0


def draft_trees(case: Case, models: ToyModels, context: tuple[int, ...]):
    """Every possible draft tree from `context`: yields (prob, tokens, q_nodes, paths).

    paths[u] is the tuple of draft tokens from the root to node u (empty for the root).
    """
    parents, n = case.parents, len(case.parents)
    children = Tree.of(parents).children
    uniform = torch.full((case.V,), 1.0 / case.V, dtype=F64)  # row 0 is unused

    def expand(i, prob, toks, qs, paths):
        if i == n:
            yield prob, torch.tensor(toks), torch.stack(qs), paths
            return
        par = parents[i]
        q = models.q(context + paths[par])
        earlier = [toks[s] for s in children[par] if s < i]
        if case.scheme == "iid":
            dist = q
        elif case.scheme == "wor":
            dist = q.clone()
            dist[earlier] = 0
            dist = dist / dist.sum()
        else:  # "topk": the len(earlier)-th most likely token, ties to the lowest index
            order = sorted(range(case.V), key=lambda x: -q[x].item())
            dist = torch.zeros_like(q)
            dist[order[len(earlier)]] = 1
        for x in torch.nonzero(dist > 0).flatten().tolist():
            yield from expand(
                i + 1, prob * dist[x].item(), toks + [x], qs + [dist], paths + [paths[par] + (x,)]
            )

    yield from expand(1, 1.0, [context[-1]], [uniform], [()])
