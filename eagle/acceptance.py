"""Exact acceptance rules of speculative sampling, for chains and token trees.

Tree convention (used by the whole repo): nodes 0..N, node 0 is the root (the last committed
token, not a draft); `parents[0] == -1` and `parents[i] < i`; siblings are tried in node-index
order. `tokens[i]` is node i's token; `p_nodes[i]` is the target's policy distribution of the
token *after* the path ending at node i; `q_nodes[i]` is the distribution node i's token was
actually drawn from (row 0 unused). A child drawn without replacement carries its parent's q
with earlier siblings zeroed and renormalised; a deterministic proposal (top-k, prompt lookup)
carries a one-hot. The verifier never needs to know how a child was drawn.

A chain of gamma draft tokens is the tree `chain_parents(gamma)`: chain verification with a
bonus token (Leviathan et al.; Chen et al.) is tree verification on a chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

NodeRule = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


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


def node_outcomes(p: Tensor, tokens: Tensor, qs: Tensor) -> tuple[Tensor, Tensor]:
    """SpecInfer's multi-round rule at one node, in closed form.

    Children are tried in order; child i is accepted with probability
    min(1, p_cur(x_i) / q_i(x_i)) where p_cur is the current residual, and a rejection updates
    p_cur <- norm([p_cur - q_i]_+). Retrying against an unchanged p would be biased.

    Args:
        p: (V,) target distribution after the node.
        tokens: (m,) the children's tokens, in the order they are tried.
        qs: (m, V) the distribution each child was drawn from.
    Returns:
        accept: (m,) probability that child i is the accepted one
            (all earlier children rejected, then child i accepted).
        final: (V,) the distribution of the correction token when all m children are
            rejected (p itself when m == 0).
    """
    if tokens.numel() == 0:
        return p.new_zeros(0), p
    q_x = qs.gather(-1, tokens[:, None]).squeeze(-1)  # (m,)
    if bool((q_x <= 0).any()):
        # a candidate its own q could not produce means the proposer filled q_nodes wrongly
        raise ValueError("a child's token has zero probability under the q it was drawn from")
    alphas, p_cur = [], p
    for i, x in enumerate(tokens.tolist()):
        alphas.append(accept_prob(p_cur, qs[i], x))
        p_cur = residual(p_cur, qs[i])
    alpha = torch.stack(alphas)  # (m,)
    # child i is the accepted one iff children 0..i-1 were all rejected and i is accepted
    rejected_before = torch.cat([alpha.new_ones(1), (1 - alpha[:-1]).cumprod(0)])  # (m,)
    return alpha * rejected_before, p_cur


def chain_parents(gamma: int) -> list[int]:
    """Parents of a chain of gamma draft tokens: [-1, 0, 1, ..., gamma - 1]."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    return list(range(-1, gamma))


def children_lists(parents: Tensor | Sequence[int]) -> list[list[int]]:
    """Validate a parent array and return each node's children in sibling (index) order.

    Args:
        parents: (N+1,) with parents[0] == -1 and 0 <= parents[i] < i.
    Returns:
        N+1 lists of child indices.
    """
    par = parents.tolist() if isinstance(parents, Tensor) else list(parents)
    if not par or par[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {par[:1]}")
    children: list[list[int]] = [[] for _ in par]
    for i in range(1, len(par)):
        if not 0 <= par[i] < i:
            raise ValueError(f"parents[{i}] = {par[i]} must satisfy 0 <= parents[i] < {i}")
        children[par[i]].append(i)
    return children


def _check_sizes(children: list[list[int]], *rows: Tensor) -> None:
    for t in rows:
        if t.shape[0] != len(children):
            raise ValueError(f"expected {len(children)} rows (one per node), got {t.shape[0]}")


def tree_outcome_distribution(
    parents: Tensor | Sequence[int],
    tokens: Tensor,
    p_nodes: Tensor,
    q_nodes: Tensor,
    node_rule: NodeRule = node_outcomes,
) -> tuple[Tensor, Tensor]:
    """Exact distribution of the verification outcome of one draft tree.

    Args:
        parents: (N+1,) tree structure.
        tokens: (N+1,) long, tokens[0] is the root token.
        p_nodes: (N+1, V) target policy distribution after each node.
        q_nodes: (N+1, V) distribution each node's token was drawn from (row 0 unused).
        node_rule: the per-node rule; injectable so tests can run wrong rules through the
            same tree code.
    Returns:
        end_prob: (N+1,) probability that the accepted path ends at node u (u = 0: nothing
            accepted); sums to 1.
        end_dist: (N+1, V) distribution of the token emitted after that path: the residual
            left after all of u's children were rejected (p_nodes[u] at a leaf, the bonus).
    """
    children = children_lists(parents)
    _check_sizes(children, tokens, p_nodes, q_nodes)
    reach = [p_nodes.new_ones(())] + [None] * (len(children) - 1)  # Pr(path passes node u)
    end_prob, end_dist = [], []
    for u, ch in enumerate(children):  # parents[i] < i: a node's reach is known before it
        if not ch:  # leaf: the whole path was accepted, the bonus token comes from p
            end_prob.append(reach[u])
            end_dist.append(p_nodes[u])
            continue
        accept, final = node_rule(p_nodes[u], tokens[ch], q_nodes[ch])
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
) -> tuple[list[int], int]:
    """Sample one verification outcome; the emitted tokens are distributed exactly as p.

    Walks from the root: at each node the children's closed-form outcome (`node_outcomes`)
    is sampled with one draw; if every child is rejected the correction token comes from the
    residual, and at a leaf the bonus token comes from p_nodes[leaf].

    Args:
        parents: (N+1,) tree structure.
        tokens: (N+1,) long, tokens[0] is the root token.
        p_nodes: (N+1, V) target policy distribution after each node.
        q_nodes: (N+1, V) distribution each node's token was drawn from (row 0 unused).
        generator: optional RNG on the device of p_nodes.
    Returns:
        path: accepted node indices, starting with the root 0.
        next_token: the correction or bonus token emitted after the path.
    """
    children = children_lists(parents)
    _check_sizes(children, tokens, p_nodes, q_nodes)
    path = [0]
    while True:
        u, ch = path[-1], children[path[-1]]
        if not ch:
            dist = p_nodes[u]  # leaf: every draft on the path accepted, bonus token from p
            break
        accept, final = node_outcomes(p_nodes[u], tokens[ch], q_nodes[ch])
        # one uniform picks child i with probability accept[i], or none (index m) otherwise
        u01 = torch.rand((), generator=generator, dtype=accept.dtype, device=accept.device)
        pick = int((accept.cumsum(0) <= u01).sum())
        if pick == len(ch):
            dist = final
            break
        path.append(ch[pick])
    return path, int(torch.multinomial(dist, 1, generator=generator))


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
    children = children_lists(parents)
    _check_sizes(children, tokens, p_nodes)
    best = p_nodes.argmax(-1).tolist()  # one device sync for all nodes
    toks = tokens.tolist()
    # depth-first in sibling order through accepted nodes only; duplicate sibling tokens can
    # both match, so keep the first deepest path rather than the first match
    best_path: list[int] = [0]
    stack = [[0]]
    while stack:
        path = stack.pop()
        if len(path) > len(best_path):
            best_path = path
        u = path[-1]
        stack.extend(path + [c] for c in reversed(children[u]) if toks[c] == best[u])
    return best_path, best[best_path[-1]]
