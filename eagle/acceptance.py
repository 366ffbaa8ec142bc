"""Acceptance rules of speculative decoding, for chains and token trees: the exact rules
(greedy and SpecInfer's multi-round sampling) and Medusa's typical acceptance, which is
lossy and kept apart at the end of the file.

Tree convention (used by the whole repo): nodes 0..N, node 0 is the root (the last committed
token, not a draft); `parents[0] == -1` and `parents[i] < i`; siblings are tried in node-index
order. `tokens[i]` is node i's token; `p_nodes[i]` is the target's policy distribution of the
token *after* the path ending at node i; `q_nodes[i]` is the distribution node i's token was
actually drawn from (row 0 unused). A child drawn without replacement carries its parent's q
with earlier siblings zeroed and renormalised; a deterministic proposal (top-k, prompt lookup)
carries a one-hot. The verifier never needs to know how a child was drawn.

A chain of gamma draft tokens is the tree `chain_parents(gamma)`: chain verification with a
bonus token (Leviathan et al.; Chen et al.) is tree verification on a chain.

Repeated draws (`repeats`): when several draft models propose at the same node and a later
draw repeats an earlier sibling's token, the merged tree keeps one node for the token, and the
later draw's proposal is still tried, as a repeat, at its place in the order of draws: after
the newest sibling node drawn before it (and the repeats already queued there). A repeat can
never be accepted once its token was rejected (the residual is 0 there), but its proposal must
still update the residual, or the rule is biased (`eagle.proposers.merge` has the derivation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from eagle.sampling import argmax, categorical
from eagle.tree import Tree

NodeRule = Callable[..., tuple[Tensor, Tensor]]  # (p, tokens, qs[, repeats]) -> (accept, final)
# node i -> (twins, (r, V) proposals): draws tried right after node i that repeated the tokens
# of earlier siblings `twins` (node indices); see `eagle.proposers.merge`
Repeats = Mapping[int, tuple[Sequence[int], Tensor]]


def accept_prob(p: Tensor, q: Tensor, x: Tensor | int) -> Tensor:
    """alpha(x) = min(1, p(x) / q(x)), the chance of keeping a candidate x ~ q.

    Args:
        p: (V,) target distribution.
        q: (V,) distribution x was drawn from.
        x: a token id or (m,) token ids.
    Returns:
        alpha with the shape of x.
    """
    return (p[x] / q[x]).clamp(max=1.0)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """r = norm([p - q]_+), what a rejection must be corrected with.

    Args:
        p: (..., V) target distribution.
        q: (..., V) proposal distribution.
    Returns:
        (..., V) the residual distribution.
    """
    pos = (p - q).clamp(min=0)  # (..., V)
    mass = pos.sum(-1, keepdim=True)  # (..., 1) = probability of rejecting a draw from q
    # mass == 0 only when p == q: then every draw is accepted and the residual is never
    # sampled, but it must stay a finite distribution (no 0/0) so later arithmetic stays clean
    return torch.where(mass > 0, pos / mass, p)


def node_outcomes(
    p: Tensor,
    tokens: Tensor,
    qs: Tensor,
    repeats: Sequence[tuple[Sequence[int], Tensor] | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """SpecInfer's multi-round rule at one node, in closed form.

    Children are tried in order; child i is accepted with probability
    min(1, p_cur(x_i) / q_i(x_i)) where p_cur is the current residual, and a rejection updates
    p_cur <- norm([p_cur - q_i]_+). Retrying against an unchanged p would be biased.

    Args:
        p: (V,) target distribution after the node.
        tokens: (m,) the children's tokens, in the order they are tried.
        qs: (m, V) the distribution each child was drawn from.
        repeats: optional, per child i, None or (twins, (r, V) proposals): later draws tried
            right after child i, in order, each repeating the token of an earlier child
            `twins[j]` (an index into `tokens`). A repeat's acceptance counts as its twin's;
            its rejection updates the residual like any draw.
    Returns:
        accept: (m,) probability that child i is the accepted one
            (all earlier children rejected, then child i accepted).
        final: (V,) the distribution of the correction token when all m children are
            rejected (p itself when m == 0).
    """
    if tokens.numel() == 0:
        return p.new_zeros(0), p
    tokens = tokens.to(p.device)
    owner = None  # draw j's token belongs to child owner[j]; None: one draw per child, in order
    q_draw, x_draw = qs, tokens
    if (
        repeats is not None
    ):  # the draws in the order they were made: each child, then the repeats drawn after it
        owners, rows = [], []
        for i, rep in enumerate(repeats):
            owners.append(i)
            rows.append(qs[i : i + 1])
            if rep is not None:
                twins, q_rep = rep
                if any(not 0 <= j <= i for j in twins):
                    raise ValueError("a repeated draw must repeat a child drawn before it")
                owners += list(twins)
                rows.append(q_rep.to(qs))
        owner = torch.tensor(owners, device=p.device)  # (n,) the child each draw's token belongs to
        q_draw = torch.cat(rows)  # (n, V)
        x_draw = tokens[owner]  # (n,)
    if bool((q_draw.gather(-1, x_draw[:, None]) <= 0).any()):
        # a candidate its own q could not produce means the proposer filled q_nodes wrongly
        raise ValueError("a child's token has zero probability under the q it was drawn from")
    alphas, p_cur = [], p
    for x, q in zip(x_draw.tolist(), q_draw):
        alphas.append(accept_prob(p_cur, q, x))
        p_cur = residual(p_cur, q)
    alpha = torch.stack(alphas)  # (n,)
    # draw j is the accepted one iff draws 0..j-1 were all rejected and j is accepted
    rejected_before = torch.cat([alpha.new_ones(1), (1 - alpha[:-1]).cumprod(0)])  # (n,)
    accept = alpha * rejected_before  # (n,) per draw
    if owner is not None:  # a repeat's acceptance is its twin's
        accept = alpha.new_zeros(len(tokens)).index_add_(0, owner, accept)  # (m,)
    return accept, p_cur


def _repeats_of(children: Sequence[int], repeats: Repeats | None) -> list | None:
    """One node's repeated draws for `node_outcomes`: per child, None or (twins as indices
    among `children`, (r, V) proposals); None when there are none."""
    if not repeats or not any(c in repeats for c in children):
        return None
    local = {c: j for j, c in enumerate(children)}
    out = []
    for c in children:
        if c not in repeats:
            out.append(None)
            continue
        twins, q = repeats[c]
        if any(t not in local for t in twins):
            raise ValueError(f"a draw repeated after node {c} must repeat one of its siblings")
        out.append(([local[t] for t in twins], q))
    return out


def _outcomes(
    node_rule: NodeRule, p: Tensor, tokens: Tensor, qs: Tensor, rows
) -> tuple[Tensor, Tensor]:
    # rules written for plain trees (the tests' planted bugs) take no repeats
    return node_rule(p, tokens, qs) if rows is None else node_rule(p, tokens, qs, rows)


def chain_parents(gamma: int) -> list[int]:
    """Parents of a chain of gamma draft tokens: [-1, 0, 1, ..., gamma - 1]."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    return list(range(-1, gamma))


def _structure(parents: Tensor | Sequence[int], *rows: Tensor) -> Tree:
    """The validated tree of `parents`, checking that every row tensor has one row per node."""
    tree = Tree.of(parents)
    for t in rows:
        if t.shape[0] != len(tree):
            raise ValueError(f"expected {len(tree)} rows (one per node), got {t.shape[0]}")
    return tree


def tree_outcome_distribution(
    parents: Tensor | Sequence[int],
    tokens: Tensor,
    p_nodes: Tensor,
    q_nodes: Tensor,
    node_rule: NodeRule = node_outcomes,
    repeats: Repeats | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact distribution of the verification outcome of one draft tree.

    Args:
        parents: (N+1,) tree structure.
        tokens: (N+1,) long, tokens[0] is the root token.
        p_nodes: (N+1, V) target policy distribution after each node.
        q_nodes: (N+1, V) distribution each node's token was drawn from (row 0 unused).
        node_rule: the per-node rule; injectable so tests can run wrong rules through the
            same tree code.
        repeats: node i -> (twin nodes, (r, V) proposals) of draws tried right after node i
            that repeated earlier siblings' tokens (merged trees, `node_outcomes`).
    Returns:
        end_prob: (N+1,) probability that the accepted path ends at node u (u = 0: nothing
            accepted); sums to 1.
        end_dist: (N+1, V) distribution of the token emitted after that path: the residual
            left after all of u's children were rejected (p_nodes[u] at a leaf, the bonus).
    """
    children = _structure(parents, tokens, p_nodes, q_nodes).children
    reach = [p_nodes.new_ones(())] + [None] * (len(children) - 1)  # Pr(path passes node u)
    end_prob, end_dist = [], []
    for u, ch in enumerate(children):  # parents[i] < i: a node's reach is known before it
        if not ch:  # leaf: the whole path was accepted, the bonus token comes from p
            end_prob.append(reach[u])
            end_dist.append(p_nodes[u])
            continue
        accept, final = _outcomes(
            node_rule, p_nodes[u], tokens[list(ch)], q_nodes[list(ch)], _repeats_of(ch, repeats)
        )
        for c, a in zip(ch, accept):
            reach[c] = reach[u] * a
        end_prob.append(reach[u] * (1 - accept.sum()))
        end_dist.append(final)
    return torch.stack(end_prob), torch.stack(end_dist)


def verify_tree_stochastic(
    parents: Tensor | Sequence[int],
    tokens: Tensor,
    p_nodes: Tensor,
    q_nodes: Tensor,
    generator: torch.Generator | None = None,
    draw: Callable[[Tensor], int] | None = None,
    repeats: Repeats | None = None,
) -> tuple[list[int], int]:
    """Sample one verification outcome; the emitted tokens are distributed exactly as p.

    Walks from the root: at each node the children's closed-form outcome (`node_outcomes`)
    is sampled with one draw; if every child is rejected the correction token comes from the
    residual, and at a leaf the bonus token comes from p_nodes[leaf].

    Args:
        parents: (N+1,) tree structure.
        tokens: (N+1,) long, tokens[0] is the root token.
        p_nodes: (N+1, V) target policy distribution after each node: a tensor, or rows
            computed when read (`eagle.sampling.RowProbs`); only the visited nodes' are read.
        q_nodes: (N+1, V) distribution each node's token was drawn from (row 0 unused).
        generator: optional RNG on the device of p_nodes.
        draw: `draw(probs) -> index`, one draw from a distribution: at a node over its m
            children then "none" (m + 1 entries), at the end over the V tokens. Default: one
            `eagle.sampling.categorical` draw with `generator`. The tests pass one that follows
            every outcome, so the exact distribution of this code path itself is checked.
        repeats: node i -> (twin nodes, (r, V) proposals) of draws tried right after node i
            that repeated earlier siblings' tokens (merged trees, `node_outcomes`).
    Returns:
        path: accepted node indices, starting with the root 0.
        next_token: the correction or bonus token emitted after the path.
    """
    if draw is None:

        def draw(probs: Tensor) -> int:
            return int(categorical(probs, generator))

    children = _structure(parents, tokens, p_nodes, q_nodes).children
    path = [0]
    while True:
        u, ch = path[-1], children[path[-1]]
        if not ch:
            dist = p_nodes[u]  # leaf: every draft on the path accepted, bonus token from p
            break
        accept, final = _outcomes(
            node_outcomes, p_nodes[u], tokens[list(ch)], q_nodes[list(ch)], _repeats_of(ch, repeats)
        )
        # child i with probability accept[i] (the earlier ones rejected, it accepted), or none
        pick = draw(torch.cat([accept, (1 - accept.sum()).clamp_min(0)[None]]))
        if pick == len(ch):
            dist = final
            break
        path.append(ch[pick])
    return path, draw(dist)


def longest_accepted_path(
    children: Sequence[Sequence[int]],
    accepted: Sequence[bool],
    log_p: Sequence[float] | None = None,
) -> list[int]:
    """The longest root-to-node path whose every draft node is accepted.

    Args:
        children: each node's children in sibling order (`Tree.children`).
        accepted: (N+1,) whether node i passes its rule (entry 0, the root, is ignored).
        log_p: optional (N+1,) log-probability of node i's token under the target at its
            parent; among equally long paths the most likely one wins (Medusa's tie rule).
    Returns:
        node indices from the root 0; without `log_p` (or on equal likelihood) the first
        deepest path in sibling order.
    """
    # depth-first in sibling order through accepted nodes only; several siblings can pass
    # (duplicate tokens under greedy, any typical token under typical acceptance), so keep
    # the best deepest path rather than the first match
    best_path, best_score = [0], 0.0
    stack = [([0], 0.0)]
    while stack:
        path, score = stack.pop()
        if len(path) > len(best_path) or (len(path) == len(best_path) and score > best_score):
            best_path, best_score = path, score
        u = path[-1]
        stack.extend(
            (path + [c], score + (log_p[c] if log_p is not None else 0.0))
            for c in reversed(children[u])
            if accepted[c]
        )
    return best_path


def verify_tree_greedy(
    parents: Tensor | Sequence[int], tokens: Tensor, p_nodes: Tensor
) -> tuple[list[int], int]:
    """Greedy verification: accept a child whose token is the target's argmax at its parent.

    Args:
        parents: (N+1,) tree structure.
        tokens: (N+1,) long, tokens[0] is the root token.
        p_nodes: (N+1, V) target probabilities or logits after each node.
    Returns:
        path: the longest accepted path (node indices from 0); among equally long paths the
            one that comes first in sibling order.
        next_token: the target's argmax after the path (correction or bonus token).
    """
    tree = _structure(parents, tokens, p_nodes)
    best = argmax(p_nodes).tolist()  # one device sync for all nodes
    toks = tokens.tolist()
    accepted = [i > 0 and toks[i] == best[tree.parents[i]] for i in range(len(tree))]
    path = longest_accepted_path(tree.children, accepted)
    return path, best[path[-1]]


# ---------------------------------------------------------------------------------------
# Typical acceptance (Medusa): LOSSY, the emitted tokens do not follow p.


@dataclass(frozen=True)
class TypicalAcceptance:
    """Settings of Medusa's typical acceptance (`verify_tree_typical`); the defaults are
    Medusa's `posterior_threshold` and `posterior_alpha`."""

    eps: float = 0.09  # cap of the threshold: a token with p(x) > eps is always typical
    delta: float = 0.3  # scale of exp(-H(p)): flatter p, lower threshold

    def __post_init__(self) -> None:
        if not 0 < self.eps <= 1:
            raise ValueError(f"typical acceptance: eps must be in (0, 1], got {self.eps}")
        if not self.delta > 0:
            raise ValueError(f"typical acceptance: delta must be > 0, got {self.delta}")


def entropy(p: Tensor) -> Tensor:
    """H(p) = -sum_v p(v) log p(v) in nats, with 0 log 0 = 0: (..., V) -> (...).

    (Medusa's code adds 1e-5 inside the log, which lowers H by up to ~1e-5 * V; we keep the
    exact entropy.)"""
    return -torch.special.xlogy(p, p).sum(-1)


def typical_threshold(p: Tensor, eps: float, delta: float) -> Tensor:
    """Medusa's acceptance threshold min(eps, delta * exp(-H(p))): (..., V) -> (...).

    A peaked p (low entropy) demands up to eps; a flat p accepts less likely tokens."""
    return torch.clamp(delta * torch.exp(-entropy(p)), max=eps)


def typical_accept(p: Tensor, x: Tensor | int, eps: float, delta: float) -> Tensor:
    """Typical acceptance of a candidate x: p(x) > min(eps, delta * exp(-H(p))).

    Args:
        p: (V,) target distribution (after the sampling policy) at the candidate's parent,
            or (m, V) one per candidate.
        x: a token id, or (m,) token ids.
    Returns:
        bool with the shape of x.
    """
    x = torch.as_tensor(x, device=p.device)
    p_x = p[x] if p.dim() == 1 else p.gather(-1, x[..., None]).squeeze(-1)
    return p_x > typical_threshold(p, eps, delta)


def verify_tree_typical(
    parents: Tensor | Sequence[int], tokens: Tensor, p_nodes: Tensor, eps: float, delta: float
) -> tuple[list[int], int]:
    """Medusa's typical acceptance on a token tree. NOT distribution preserving.

    A node is accepted when its token is typical under the target's distribution at its
    parent (`typical_accept`); the accepted path is the longest one through accepted nodes
    (ties: the most likely under p, as Medusa picks); the token after it is the target's
    argmax there ("first token greedy"). With a one-hot p (temperature 0) only the argmax
    passes, so this is greedy verification.

    Args:
        parents: (N+1,) tree structure.
        tokens: (N+1,) long, tokens[0] is the root token.
        p_nodes: (N+1, V) target policy distribution after each node.
        eps, delta: the threshold's cap and entropy scale (Medusa: 0.09 and 0.3).
    Returns:
        path (node indices from 0) and next_token, as `verify_tree_greedy`.
    """
    tree = _structure(parents, tokens, p_nodes)
    parent_of = torch.as_tensor(tree.parents[1:], dtype=torch.long, device=p_nodes.device)
    p_parent = p_nodes[parent_of]  # (N, V): row i-1 is the distribution draft node i is judged by
    draft = tokens[1:].to(p_nodes.device)  # (N,)
    ok = typical_accept(p_parent, draft, eps, delta)  # (N,)
    log_p = torch.log(p_parent.gather(-1, draft[:, None]).squeeze(-1))  # (N,)
    path = longest_accepted_path(tree.children, [False] + ok.tolist(), [0.0] + log_p.tolist())
    return path, int(argmax(p_nodes[path[-1]]))
