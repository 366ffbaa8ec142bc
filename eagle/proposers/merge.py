"""SpecInfer's merge-based speculation: K small speculative models (SSMs) each draft their own
tree (a chain or an expansion template, `TemplateProposer`), and the trees are merged by shared
prefix into one token tree that the target verifies in one forward.

The SSMs are meant to be complementary (collective boost-tuning: SSM k is trained on what
SSMs 1..k-1 do not cover, `eagle.data.coverage`), so their union covers more of the target's
continuations than any one of them.

Why merging is exact
--------------------
Greedy: the verifier accepts, at each node, the child whose token is the target's argmax.
Two copies of one token under one parent would be accepted or rejected together, so keeping
one node per distinct prefix changes nothing.

Sampling: fix a canonical order of the draws: SSM 1's draws (in its tree's sibling order),
then SSM 2's, and so on. At a merged node u, the draws made there by the SSMs whose drafts
pass through u form a sequence y_1, y_2, ... with proposals q_1, q_2, ...: y_j ~ q_j given
everything drawn before it (q_j is SSM k's distribution at u, with its own earlier siblings
removed when it draws several without replacement; draws of different SSMs are independent).
SpecInfer's multi-round rule on this sequence is exact: with current residual r (r = p at
the start), y_j is accepted with min(1, r(y_j) / q_j(y_j)), contributing min(r, q_j) to each
token, and rejected with mass sum [r - q_j]_+, after which the rest of the sequence emits
norm([r - q_j]_+) by induction; the sum is r. The induction needs nothing else: which SSMs
reach u and how many draws they make there may depend on any earlier draw, as a stopping
rule may.

Merging only renames this sequence. If y_j repeats an earlier y_i at u (two SSMs proposed the
same token), it gets no node of its own: the first copy's node stands for both, and the
later SSM's subtree continues under that node (its draws there are from its q given the
same prefix, as required). What must be recorded for the copy is its proposal q_j, at its
place in the sequence: if y_i was rejected, r(y_i) = 0 from then on (rejection needs
r(y_i) < q_i(y_i), and [r - q]_+ keeps zeros), so the copy is never accepted, but its
rejection still moves the residual to norm([r - q_j]_+). Dropping it is biased; so is
folding q_j into the node's recorded proposal (the update depends on r, known only at
verification). Each merged node therefore records the proposal of its first draw, and
`DraftTree.repeats` the repeated draws (which node each repeats, and its proposal), each
queued after the newest sibling node drawn before it, in order (`eagle.acceptance.node_outcomes`).
The enumeration tests (tests/test_merge.py) show this rule exact to 1e-12, and two wrong ones
biased: dropping the repeats, and trying each right after the node it repeats.

The node budget truncates the sequence of draws in canonical order: a draw is kept only
while the merged tree has room for a new node, decided before the draw's value is looked
at (keeping a repeat because it is free would select on its value, and bias the rule), and
a dropped draw's subtree goes with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from eagle.decoding.engine import DecodeState, DraftTree, Proposer


def merge_trees(trees: Sequence[DraftTree], budget: int | None = None
                ) -> tuple[DraftTree, list[dict[int, int]]]:
    """Merge draft trees by shared prefix, in order (the canonical order of the draws).

    Args:
        trees: one draft tree per SSM (nodes 1..N_k, `parents` with parents[i] < i).
        budget: the most nodes of the merged tree (None: no limit); draws beyond it are
            dropped in canonical order, with their subtrees.
    Returns:
        the merged tree (breadth-first, siblings in order of their first draw; q and repeats
        set when the input trees carry q) and, per input tree, the map from its node indices
        to the merged tree's (the root 0 to 0; dropped nodes absent).
    """
    sampled = any(t.q is not None for t in trees)
    if sampled and not all(t.q is not None or t.size == 0 for t in trees):
        raise ValueError("merge_trees: all trees or none must carry proposals")
    # the trie in arrival order: node 0 is the root; per node its token, proposal and children
    token: list[int] = [-1]
    parent: list[int] = [-1]
    q_rows: list[Tensor | None] = [None]
    kids: list[dict[int, int]] = [{}]  # node -> {token: child node}, in order of first draw
    # node -> its newest child: later repeats are tried after it, in order
    last_kid: list[int] = [-1]
    repeats: dict[int, list[tuple[int, Tensor]]] = {}  # node -> [(twin, q)] drawn right after it
    maps: list[dict[int, int]] = []
    full = False
    for tree in trees:
        toks = tree.tokens.tolist()
        where = {0: 0}
        for v in range(1, tree.size + 1):
            if full or (budget is not None and len(token) - 1 >= budget):
                full = True  # no room: this draw and every later one are dropped, whatever they are
                break
            up = where.get(tree.parents[v])
            if up is None:  # its parent was dropped
                continue
            tok, q = toks[v - 1], None if tree.q is None else tree.q[v - 1]
            twin = kids[up].get(tok)
            if twin is None:  # a new node
                node = len(token)
                token.append(tok)
                parent.append(up)
                q_rows.append(q)
                kids.append({})
                last_kid.append(-1)
                kids[up][tok] = node
                last_kid[up] = node
            else:
                # a repeated draw: queued after the newest sibling node, at its place in the order
                node = twin
                if q is not None:
                    repeats.setdefault(last_kid[up], []).append((twin, q))
            where[v] = node
        maps.append(where)
    # renumber breadth-first (siblings in order of first draw): parents[i] < i as the engine needs
    order, head = [0], 0
    while head < len(order):
        order.extend(kids[order[head]].values())
        head += 1
    new = {old: i for i, old in enumerate(order)}
    device = trees[0].tokens.device if trees else None
    merged = DraftTree(
        tokens=torch.tensor([token[o] for o in order[1:]], dtype=torch.long, device=device),
        parents=tuple(-1 if o == 0 else new[parent[o]] for o in order),
        q=torch.stack([q_rows[o] for o in order[1:]]) if sampled and len(order) > 1 else None,
        repeats={
            new[o]: (tuple(new[t] for t, _ in rows), torch.stack([q for _, q in rows]))
            for o, rows in repeats.items()
        }
        if sampled and repeats
        else None,
    )
    return merged, [{v: new[m] for v, m in where.items()} for where in maps]


class MergeProposer(Proposer):
    """K proposers (SSMs, each drafting its own tree) merged into one tree per round.

    Args:
        proposers: the SSMs' proposers, in canonical order (SSM 1 first).
        budget: the most nodes of the merged tree (None: the sum of the SSMs' trees).
    The SSMs draft one after another; on a GPU they could run concurrently (their forwards
    are independent until the merge), which would hide all but the slowest one's cost.
    """

    name = "specinfer_merge"

    def __init__(self, proposers: Sequence[Proposer], budget: int | None = None):
        if not proposers:
            raise ValueError("specinfer_merge needs at least one SSM")
        if budget is not None and budget < 1:
            raise ValueError(f"specinfer_merge: the node budget must be >= 1, got {budget}")
        self.proposers = list(proposers)
        total = sum(p.max_nodes for p in self.proposers)
        self.budget = budget
        self.max_nodes = total if budget is None else min(budget, total)
        contexts = [p.context for p in self.proposers if getattr(p, "context", None) is not None]
        self.context = min(contexts) if contexts else None  # the shortest SSM's positions
        self._trees: list[DraftTree] = []
        self._maps: list[dict[int, int]] = []

    def reset(self, state: DecodeState) -> None:
        for p in self.proposers:
            p.reset(state)

    def fork(self) -> MergeProposer:
        return MergeProposer([p.fork() for p in self.proposers], self.budget)

    def propose(self, state: DecodeState) -> DraftTree:
        self._trees = [p.propose(state) for p in self.proposers]
        merged, self._maps = merge_trees(self._trees, self.budget)
        return merged

    def accept(self, state: DecodeState, tree: DraftTree, path: list[int]) -> None:
        for p, own, where in zip(self.proposers, self._trees, self._maps):
            p.accept(state, own, own_path(where, path))

    # A batch: each SSM drafts for every sequence (in one pass where its model can), then each
    # sequence's trees are merged.

    def reset_batch(self, states: Sequence[DecodeState]) -> None:
        for p in self.proposers:
            p.reset_batch(states)

    def propose_batch(self, states: Sequence[DecodeState]) -> list[DraftTree]:
        per_ssm = [p.propose_batch(states) for p in self.proposers]  # K lists of B trees
        self._batch_trees = [
            [trees[b] for trees in per_ssm] for b in range(len(states))
        ]  # B lists of K trees
        merged = [merge_trees(trees, self.budget) for trees in self._batch_trees]
        self._batch_maps = [maps for _, maps in merged]
        return [tree for tree, _ in merged]

    def accept_batch(
        self,
        states: Sequence[DecodeState],
        trees: Sequence[DraftTree],
        paths: Sequence[list[int]],
        keep: Sequence[int],
    ) -> None:
        for k, p in enumerate(self.proposers):
            p.accept_batch(
                states,
                [own[k] for own in self._batch_trees],
                [own_path(maps[k], path) for maps, path in zip(self._batch_maps, paths)],
                keep,
            )


def own_path(where: dict[int, int], path: list[int]) -> list[int]:
    """An SSM's own nodes along a merged tree's accepted `path`, as far as it drafted it (`where`:
    its node -> the merged tree's node)."""
    back = {m: v for v, m in where.items()}
    out = []
    for node in path:
        if node not in back:
            break
        out.append(back[node])
    return out
