"""Fill a fixed tree template with a draft model (EAGLE's drafter, a small LM, Medusa's heads).

Per round: one `catch_up` pass over the tokens committed since the last round gives the
root's next-token distribution; then one `step` pass per depth over that depth's nodes that
have children in the template, each on top of the draft model's committed KV plus the
temporary KV of its ancestors. The template's ranks are filled with the top-k of each
expanded node's distribution, or, under sampling with `proposal="sample"`, by drawing
without replacement. Either way each draft token's proposal `q` is recorded exactly: a
one-hot for a deterministic choice, the parent's distribution with earlier siblings
zeroed and renormalised for a draw. After verification the temporary KV is dropped.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from eagle.decoding.engine import DecodeState, DraftTree, Proposer
from eagle.tree import TreeTemplate

PROPOSALS = ("topk", "sample")


class TreeDraftModel(Protocol):
    """A draft model with its own KV cache over the committed context (possibly none).

    The "hidden output" of a node is whatever its children's `step` needs from it: EAGLE's
    predicted feature, nothing (None) for a small LM, the unused heads' logits for Medusa."""

    def reset(self, state: DecodeState) -> None:
        """Start a new sequence (the target has just read the prompt)."""

    def catch_up(self, state: DecodeState) -> tuple[Tensor, Tensor | None]:
        """Feed the committed tokens not yet in the cache (the root included).

        Returns: the root's next-token logits (V,) and its hidden output (H,) or None."""

    def step(self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor,
             visible: Tensor) -> tuple[Tensor, Tensor | None]:
        """Score n draft nodes (n,) on top of the committed cache; their KV is kept until `end_round`.

        `visible` (n, S) bool: which of this round's S branch entries (those of earlier steps,
        then these n nodes, in order after the committed cache) each node sees.
        Returns: logits (n, V) and hidden outputs (n, H) or None."""

    def end_round(self) -> None:
        """Drop the round's branch KV (verification is done)."""

    @property
    def dtype(self) -> torch.dtype: ...


class TemplateProposer(Proposer):
    """Draft a fixed template tree with any `TreeDraftModel`.

    Args:
        model: the draft model (EAGLE drafter, small LM or Medusa heads).
        template: the tree to fill; its `max_rank` is the top-k per expanded node.
        proposal: under sampling, "sample" (children drawn without replacement from the
            draft distribution: accepted about as often as q resembles p) or "topk"
            (deterministic top-k, one-hot q: accepted only as often as p puts mass on those
            tokens, poor when p is flat). Greedy decoding always uses top-k.
    """

    def __init__(self, model: TreeDraftModel, template: TreeTemplate, proposal: str = "sample",
                 name: str = "template"):
        if proposal not in PROPOSALS:
            raise ValueError(f"unknown proposal {proposal!r}; choose one of {PROPOSALS}")
        if template.num_nodes == 0:
            raise ValueError(f"tree {template.name!r} has no draft nodes; use vanilla decoding")
        self.model, self.template, self.proposal, self.name = model, template, proposal, name
        self.max_nodes = template.num_nodes
        tree = template.structure
        self.parents = tree.parents
        ancestors = tree.ancestors()  # (N+1, N+1) bool
        # nodes with children, grouped by depth: only these need a draft forward
        self.expanded_by_depth = [[i for i in range(1, len(tree)) if tree.depths[i] == d and tree.children[i]]
                                  for d in range(tree.depth + 1)]
        # what each depth's nodes see of the branch entries forwarded so far (theirs last)
        self.visible_by_depth, seen = [], []
        for nodes in self.expanded_by_depth:
            seen = seen + nodes
            self.visible_by_depth.append(ancestors[nodes][:, seen])  # (m, len(seen)) ancestor-or-self

    def reset(self, state: DecodeState) -> None:
        self.model.reset(state)

    def accept(self, state: DecodeState, tree: DraftTree, path: list[int]) -> None:
        self.model.end_round()

    def propose(self, state: DecodeState) -> DraftTree:
        tpl, model, policy = self.template, self.model, state.policy
        root_logits, root_hidden = model.catch_up(state)
        root_pos = len(state.tokens) - 1
        n = tpl.num_nodes + 1
        tokens = torch.empty(n, dtype=torch.long, device=root_logits.device)
        tokens[0] = state.tokens[-1]
        q = None if policy.greedy else torch.zeros(n, root_logits.shape[-1], device=root_logits.device)
        logits = {0: root_logits}
        hidden = {0: root_hidden}
        for depth in range(1, tpl.depth + 1):
            for parent in [0] if depth == 1 else self.expanded_by_depth[depth - 1]:
                kids = list(tpl.children[parent])  # a list: a tuple would index dimensions
                tokens[kids], q_kids = self._choose(logits[parent], len(kids), state)
                if q is not None:
                    q[kids] = q_kids
            nodes = self.expanded_by_depth[depth] if depth < tpl.depth else []
            if not nodes:
                continue
            parent_hidden = None if root_hidden is None else torch.stack(
                [hidden[self.parents[v]] for v in nodes])
            pos = torch.full((len(nodes),), root_pos + depth, dtype=torch.long, device=tokens.device)
            if self.visible_by_depth[depth].device != tokens.device:  # once: the template is fixed
                self.visible_by_depth = [v.to(tokens.device) for v in self.visible_by_depth]
            visible = self.visible_by_depth[depth]
            out_logits, out_hidden = model.step(tokens[nodes], parent_hidden, pos, visible)
            for j, v in enumerate(nodes):
                logits[v] = out_logits[j]
                hidden[v] = None if out_hidden is None else out_hidden[j]
        return DraftTree(tokens=tokens[1:], parents=self.parents, q=None if q is None else q[1:])

    def _choose(self, logits: Tensor, m: int, state: DecodeState) -> tuple[Tensor, Tensor | None]:
        """Pick m children from a node's logits (V,); returns tokens (m,) and their q (m, V)."""
        policy = state.policy
        if policy.greedy:
            return logits.topk(m).indices, None
        dist = policy.probs(logits.float())  # (V,) the drafter's q at this node
        if self.proposal == "topk":
            picks = dist.topk(m).indices
            return picks, torch.nn.functional.one_hot(picks, dist.shape[-1]).to(dist)
        return sample_without_replacement(dist, m, state.generator)


def sample_without_replacement(dist: Tensor, m: int, generator: torch.Generator | None = None
                               ) -> tuple[Tensor, Tensor]:
    """m successive draws without replacement from `dist` (V,), and the exact q of each.

    Gumbel-top-k: the m largest of log(dist) + Gumbel noise, in order, are distributed exactly
    as m successive draws where each excludes the earlier ones (Kool et al., 2019), in one
    pass over the vocabulary instead of m. Draw i's proposal is `dist` with draws 0..i-1
    zeroed and renormalised. Once the support is exhausted the remaining picks are
    deterministic (the -inf keys, in topk's order), so their q is a one-hot.

    Returns:
        picks (m,) long and q (m, V).
    """
    # float64 keys: with float32 uniforms the largest Gumbel is ~ -log(-log(1 - 2^-24)) = 16.6, so a
    # token below ~3.6e-9 of the top token's probability could never be drawn first, while its
    # recorded q keeps its full mass
    u = torch.rand(dist.shape, generator=generator, device=dist.device, dtype=torch.float64)
    u = u.clamp_min_(torch.finfo(torch.float64).tiny)
    keys = dist.double().log() - (-u.log()).log()  # log p + Gumbel(0, 1); -inf off the support
    picks = keys.topk(m).indices  # (m,) in draw order
    q = dist.expand(m, -1).clone()  # (m, V)
    rows, cols = torch.tril_indices(m, m, offset=-1, device=dist.device)
    q[rows, picks[cols]] = 0.0  # row i excludes draws 0..i-1
    mass = q.sum(-1, keepdim=True)  # (m, 1)
    exhausted = mass[:, 0] <= 0
    q = torch.where(mass > 0, q / mass.clamp_min(torch.finfo(q.dtype).tiny), q)
    if exhausted.any():
        q[exhausted] = torch.nn.functional.one_hot(picks[exhausted], dist.shape[-1]).to(q)
    return picks, q
