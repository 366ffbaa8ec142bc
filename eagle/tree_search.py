"""Choose a static draft tree from measured acceptance instead of by guesswork.

Under greedy decoding whether a tree node is accepted depends only on its own path: the
drafter's top-k ranks along it and the target's argmaxes (at most one child of a node can
match the argmax). So from a given context, any subtree accepts exactly the longest prefix
of the probe's accepted path that it kept, and a node's acceptance rate measured inside a
large tree carries over to every tree that contains it. The expected tokens per round of
a tree is then estimated by

    tau ~ 1 + sum over its nodes of P(node on the accepted path).

It is an estimate, not an identity: over a whole decode a smaller tree starts its rounds at
other positions than the probe did, and in bf16 a differently shaped verification can
round a near-tie the other way and change the text itself (LOG.md compares the two).

Decode once with a large probe tree (`configs/tree/probe.yaml`), record P(node) for every
node (`eagle.benchmark.acceptance_by_node`), and the best tree of N nodes is the N-node
subtree with the largest sum. Which N is best depends on what a wider verification and a
deeper draft cost on the machine, so candidates of several sizes are benchmarked
(`decode.py mode=tree_search`). At temperature > 0 siblings interact through the residual
distribution, so the greedy-optimal shape is a good guess there, not a proof.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from eagle.tree import TreeError, TreeTemplate


@dataclass
class Candidate:
    tree: TreeTemplate
    predicted_tau: float  # 1 + sum of the kept nodes' measured acceptance (an estimate)


def best_subtree(probe: TreeTemplate, by_node: Sequence[float], size: int, name: str | None = None) -> Candidate:
    """The `size`-node subtree of `probe` with the highest predicted tau.

    A template may only hold rank r under a parent if it holds ranks 0..r-1 too, so a node
    becomes eligible once its parent and its previous sibling are kept; the most accepted
    eligible node is added until `size` nodes are kept. Acceptance never grows from parent
    to child, which makes this greedy choice optimal whenever it also does not grow from a
    sibling to the next one (the usual case; a drafter whose second choice beats its first
    at some node may leave a little on the table).

    Args:
        probe: the tree the acceptance was measured on.
        by_node: P(node on the accepted path) for nodes 0..N of `probe` (node 0 = root).
        size: draft nodes to keep (at most the probe's).
    """
    if len(by_node) != probe.num_nodes + 1:
        raise TreeError(f"{len(by_node)} acceptance values for the {probe.num_nodes + 1} nodes of {probe.name}")
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= probe.num_nodes:
        raise TreeError(f"subtree size must be in 1..{probe.num_nodes}, got {size!r}")
    kept = {0}
    eligible = {c for c in probe.children[0] if probe.ranks[c] == 0}
    while len(kept) < size + 1:
        node = max(eligible, key=lambda i: (by_node[i], -i))  # ties: shallower / lower rank first
        eligible.remove(node)
        kept.add(node)
        siblings = probe.children[probe.parents[node]]
        nxt = siblings.index(node) + 1
        if nxt < len(siblings):
            eligible.add(siblings[nxt])
        eligible.update(c for c in probe.children[node] if probe.ranks[c] == 0)
    paths = [probe.paths[i - 1] for i in sorted(kept) if i > 0]
    tau = 1.0 + sum(by_node[i] for i in kept if i > 0)
    return Candidate(TreeTemplate.from_paths(paths, name or f"best{size}"), tau)


def candidates(probe: TreeTemplate, by_node: Sequence[float], sizes: Sequence[int]) -> list[Candidate]:
    """`best_subtree` for each size (sizes beyond the probe's are skipped)."""
    return [best_subtree(probe, by_node, n, name=f"best{n}") for n in sizes if n <= probe.num_nodes]


def write_tree(candidate: Candidate, path: str | Path, source: str = "") -> Path:
    """Save a candidate as a `kind: paths` tree config, with where it came from as a comment."""
    path = Path(path)
    tree = candidate.tree
    header = [f"# {tree.summary()}; predicted tau {candidate.predicted_tau:.3f} at temperature 0",
              "# chosen by eagle.tree_search.best_subtree" + (f" from {source}" if source else "")]
    body = yaml.safe_dump({"kind": "paths", "paths": [list(p) for p in tree.paths]}, default_flow_style=None,
                          sort_keys=False)
    path.write_text("\n".join(header) + "\n" + body)
    return path
