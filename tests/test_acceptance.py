"""Acceptance rules: seed vectors, exactness by enumeration, planted bugs, sampler, greedy;
and Medusa's (lossy) typical acceptance on hand-computed vectors.

The exactness check enumerates every possible draft tree (with its probability) and every
verification outcome (`tree_outcome_distribution`), then compares the distribution of the
first T emitted tokens with the target's own p(x1) p(x2|x1) ... . No sampling involved, so
it is exact to float64 round-off and any biased rule shows up as a clear deviation.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import product

import pytest
import torch
from scipy.stats import chisquare

import eagle.acceptance as acceptance
from eagle.acceptance import (
    TypicalAcceptance,
    accept_prob,
    chain_parents,
    entropy,
    node_outcomes,
    residual,
    tree_outcome_distribution,
    typical_accept,
    typical_threshold,
    verify_tree_greedy,
    verify_tree_stochastic,
    verify_tree_typical,
)
from eagle.sampling import SamplingPolicy
from eagle.tree import Tree
from helpers.exact import Case, ToyModels, draft_trees
from helpers.stats import enumerate_draws

F64 = torch.float64


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def close(a, b, atol=1e-12):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=0, atol=atol
    )


# ----------------------------------------------------------------------------- seed vectors


def single_candidate_outcome(p, q):
    """Pr(Y = y) of one round with one candidate x ~ q, through node_outcomes.

    Returns accepted mass q(x) alpha(x) per token, the rejection mass and the residual.
    """
    accepted = torch.zeros_like(p)
    for x in torch.nonzero(q > 0).flatten().tolist():
        accept, final = node_outcomes(p, torch.tensor([x]), q[None])
        accepted[x] = q[x] * accept[0]
    rejected = 1 - accepted.sum()
    return accepted, rejected, final


def test_seed_vector_four_tokens():
    p, q = t(0.2, 0.3, 0.4, 0.1), t(0.5, 0.2, 0.2, 0.1)
    alpha = accept_prob(p, q, torch.arange(4))
    close(alpha, t(0.4, 1, 1, 1))
    close(q * alpha, t(0.2, 0.2, 0.2, 0.1))
    close((q * alpha).sum(), 0.7)  # beta
    close(residual(p, q), t(0, 1 / 3, 2 / 3, 0))
    accepted, rejected, final = single_candidate_outcome(p, q)
    close(accepted, t(0.2, 0.2, 0.2, 0.1))
    close(rejected, 0.3)
    close(final, t(0, 1 / 3, 2 / 3, 0))
    close(accepted + rejected * final, p)  # Pr(Y = y) = min(p, q) + [p - q]_+ = p


def test_seed_vector_three_tokens():
    q, p = t(0.7, 0.2, 0.1), t(0.4, 0.35, 0.25)
    alpha = accept_prob(p, q, torch.arange(3))
    close(alpha, t(4 / 7, 1, 1))
    close(q * alpha, t(0.4, 0.2, 0.1))
    accepted, rejected, final = single_candidate_outcome(p, q)
    close(accepted, t(0.4, 0.2, 0.1))
    close(rejected * final, t(0, 0.15, 0.15))  # residual mass [p - q]_+
    close(accepted + rejected * final, p)


def test_equal_distributions_accept_always():
    p = t(0.1, 0.6, 0.3)
    accepted, rejected, final = single_candidate_outcome(p, p.clone())
    close(accepted.sum(), 1.0)  # beta = 1
    close(rejected, 0.0)
    close(residual(p, p.clone()), p)  # a finite distribution, no 0/0
    assert torch.isfinite(final).all()


def test_unproposable_token_comes_from_residual():
    p, q = t(0.3, 0.3, 0.4), t(0.0, 0.5, 0.5)
    accepted, rejected, final = single_candidate_outcome(p, q)
    assert accepted[0] == 0  # never proposed ...
    close(rejected * final[0], 0.3)  # ... yet emitted with its full probability
    close(accepted + rejected * final, p)
    with pytest.raises(ValueError, match="zero probability"):
        node_outcomes(p, torch.tensor([0]), q[None])  # a candidate its q cannot produce


# ---------------------------------------------------------- toy models and exact enumeration


CASES = {
    "chain2": Case(tuple(chain_parents(2)), "iid", V=4, T=3),
    "chain3": Case(tuple(chain_parents(3)), "iid", V=3, T=3, seed=1),
    "siblings_iid": Case((-1, 0, 0, 0), "iid", V=4, T=2, seed=2),
    "siblings_wor": Case((-1, 0, 0, 0), "wor", V=4, T=2, seed=3),
    "siblings_topk": Case((-1, 0, 0, 0), "topk", V=5, T=3, seed=4),
    "q_zeros_wor": Case((-1, 0, 0), "wor", V=4, T=2, q_zero=(0,), seed=5),
    "q_zeros_chain": Case(tuple(chain_parents(2)), "iid", V=4, T=3, q_zero=(1, 3), seed=6),
    "p_zeros_iid": Case((-1, 0, 0, 1), "iid", V=4, T=2, p_zero=(2,), seed=7),
    "two_level_wor": Case((-1, 0, 0, 1, 1), "wor", V=3, T=3, seed=8),
    "two_level_iid": Case((-1, 0, 0, 1, 2), "iid", V=3, T=2, seed=9),
    "two_level_topk": Case((-1, 0, 0, 1, 1, 2, 3), "topk", V=4, T=3, seed=10),
}


def closed_form(node_rule=node_outcomes):
    """The outcomes of one verification by the closed form (`tree_outcome_distribution`):
    yields (end node, next token, probability)."""
    def outcomes(parents, toks, p_nodes, q_nodes):
        end_prob, end_dist = tree_outcome_distribution(parents, toks, p_nodes, q_nodes,
                                                       node_rule=node_rule)
        for u, (pu, row) in enumerate(zip(end_prob.tolist(), end_dist.tolist())):
            for y, py in enumerate(row):
                yield u, y, pu * py

    return outcomes


def sampler(parents, toks, p_nodes, q_nodes):
    """The outcomes of `verify_tree_stochastic` itself, the code the engine runs: every sequence
    of its draws followed (`enumerate_draws`), with its exact probability."""

    def run(draw):
        path, y = verify_tree_stochastic(parents, toks, p_nodes, q_nodes, draw=draw)
        return path[-1], y

    for (u, y), prob in enumerate_draws(run).items():
        yield u, y, prob


def emitted_distribution(case: Case, outcomes) -> dict[tuple[int, ...], float]:
    """Exact distribution of the first T emitted tokens, rounds repeated as needed, with one
    verification's outcomes given by `outcomes` (`closed_form(...)` or `sampler`)."""
    models = ToyModels(case.V, case.seed, case.p_zero, case.q_zero)
    memo: dict = {}

    def dist(context: tuple[int, ...], T: int) -> dict[tuple[int, ...], float]:
        if (context, T) in memo:
            return memo[context, T]
        out: dict[tuple[int, ...], float] = defaultdict(float)
        for w, toks, q_nodes, paths in draft_trees(case, models, context):
            p_nodes = torch.stack([models.p(context + path) for path in paths])  # (N+1, V)
            for u, y, pu in outcomes(case.parents, toks, p_nodes, q_nodes):
                emitted, mass = paths[u] + (y,), w * pu
                if mass == 0:
                    continue
                if len(emitted) >= T:
                    out[emitted[:T]] += mass
                else:  # the round was short: continue from the new context
                    for rest, m in dist(context + emitted, T - len(emitted)).items():
                        out[emitted + rest] += mass * m
        memo[context, T] = out
        return out

    return dist((0,), case.T)


def exactness_error(case: Case, outcomes=None) -> float:
    """Largest |Pr(first T tokens) - prod_t p(x_t | x_<t)| over all V^T sequences."""
    models = ToyModels(case.V, case.seed, case.p_zero, case.q_zero)
    got = emitted_distribution(case, outcomes or closed_form())
    err = 0.0
    for seq in product(range(case.V), repeat=case.T):
        want = 1.0
        for k, x in enumerate(seq):
            want *= models.p((0,) + seq[:k])[x].item()
        err = max(err, abs(got.get(seq, 0.0) - want))
    return err


@pytest.mark.parametrize("name", sorted(CASES))
def test_tree_verification_preserves_target_distribution(name):
    assert exactness_error(CASES[name]) < 1e-9


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_sampler_itself_preserves_target_distribution(name):
    """Not the closed form: the engine's sampler, every one of its draws enumerated."""
    assert exactness_error(CASES[name], sampler) < 1e-9


def test_enumerating_the_sampler_catches_a_wrong_rule(monkeypatch):
    monkeypatch.setattr(acceptance, "node_outcomes", retry_unchanged_p)
    assert exactness_error(CASES["siblings_wor"], sampler) > 1e-3


# ------------------------------------------------------------------------------ planted bugs


def retry_unchanged_p(p, tokens, qs):
    """WRONG: every sibling is tested against the original p (no residual update)."""
    accept, still_rejected = [], p.new_ones(())
    for x, q in zip(tokens, qs):
        alpha = accept_prob(p, q, x)
        accept.append(still_rejected * alpha)
        still_rejected = still_rejected * (1 - alpha)
    final = residual(p, qs[-1]) if len(qs) else p
    return (torch.stack(accept) if accept else p.new_zeros(0)), final


def parent_q_for_all_siblings(p, tokens, qs):
    """WRONG: uses the parent's q (= the first sibling's) for every sibling, ignoring that
    later siblings were drawn without replacement."""
    return node_outcomes(p, tokens, qs[:1].expand_as(qs))


@pytest.mark.parametrize(
    "rule,case,wrong",
    [
        (node_outcomes, "siblings_wor", False),
        (retry_unchanged_p, "siblings_wor", True),
        (parent_q_for_all_siblings, "siblings_wor", True),
        (node_outcomes, "siblings_iid", False),
        (retry_unchanged_p, "siblings_iid", True),
        (node_outcomes, "siblings_topk", False),
        (retry_unchanged_p, "siblings_topk", True),
        (node_outcomes, "two_level_wor", False),
        (parent_q_for_all_siblings, "two_level_wor", True),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_exactness_check_catches_planted_bugs(rule, case, wrong):
    err = exactness_error(CASES[case], closed_form(rule))
    if wrong:
        assert err > 1e-3, f"the exactness check missed a biased rule (error {err:.2e})"
    else:
        assert err < 1e-9


# ------------------------------------------------------------------------------ tree outcome


def draft_fixture(parents, V, seed, proposal="sampled"):
    """One fixed draft tree with a random target. Returns tokens, p_nodes, q_nodes.

    proposal="sampled": each node's children drawn without replacement from a random q;
    proposal="topk": children are q's top tokens, recorded as one-hot q (deterministic).
    """
    gen = torch.Generator().manual_seed(seed)
    n = len(parents)
    expo = -torch.rand(n, V, generator=gen, dtype=F64).log()
    p_nodes = expo / expo.sum(-1, keepdim=True)  # (N+1, V) uniform Dirichlet rows
    q_nodes = torch.full((n, V), 1.0 / V, dtype=F64)  # row 0 unused
    tokens = torch.zeros(n, dtype=torch.long)
    for ch in Tree.of(parents).children:
        q = torch.randn(V, generator=gen, dtype=F64).softmax(-1)  # (V,)
        for c in ch:
            if proposal == "topk":
                tokens[c] = q.argmax()
                q_nodes[c] = torch.nn.functional.one_hot(tokens[c], V)
            else:
                tokens[c] = torch.multinomial(q, 1, generator=gen)
                q_nodes[c] = q
            q = q.clone()
            q[tokens[c]] = 0  # the next sibling is drawn without replacement
            q = q / q.sum()
    return tokens, p_nodes, q_nodes


@pytest.mark.parametrize("proposal", ["sampled", "topk"])
@pytest.mark.parametrize("parents", [[-1, 0, 0, 0, 1, 1, 4, 2], chain_parents(4), [-1]])
def test_outcome_distribution_is_normalised(parents, proposal):
    tokens, p_nodes, q_nodes = draft_fixture(parents, 6, 0, proposal)
    end_prob, end_dist = tree_outcome_distribution(parents, tokens, p_nodes, q_nodes)
    assert end_prob.shape == (len(parents),) and end_dist.shape == p_nodes.shape
    assert (end_prob >= 0).all()
    close(end_prob.sum(), 1.0)
    close(end_dist.sum(-1), torch.ones(len(parents), dtype=F64))
    leaves = [u for u, ch in enumerate(Tree.of(parents).children) if not ch]
    close(end_dist[leaves], p_nodes[leaves])  # bonus token at a leaf


# ----------------------------------------------------------------------------------- sampler


@pytest.mark.parametrize(
    "parents,proposal,seed",
    [
        # top-k siblings: every path end has positive probability when p has full support
        ([-1, 0, 0, 0, 1, 1, 4], "topk", 2),
        # sampled siblings and a sampled chain; seeds where every path end can occur
        ([-1, 0, 0, 1, 1, 3], "sampled", 195),
        (chain_parents(3), "sampled", 1),
    ],
)
def test_sampler_matches_outcome_distribution(parents, proposal, seed):
    V, draws = 4, 3000
    tokens, p_nodes, q_nodes = draft_fixture(parents, V, seed, proposal)
    end_prob, end_dist = tree_outcome_distribution(parents, tokens, p_nodes, q_nodes)
    assert end_prob.min() > 0.01  # the fixture is informative: every path end occurs
    expected = (end_prob[:, None] * end_dist).flatten()  # (N+1) * V outcomes (end node, token)

    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(expected)
    for _ in range(draws):
        path, nxt = verify_tree_stochastic(parents, tokens, p_nodes, q_nodes, generator=gen)
        assert path[0] == 0 and all(parents[b] == a for a, b in zip(path, path[1:]))
        counts[path[-1] * V + nxt] += 1

    possible = expected > 0
    assert counts[~possible].sum() == 0  # impossible outcomes never happen
    f_exp = expected[possible] / expected[possible].sum() * draws
    assert chisquare(counts[possible].numpy(), f_exp.numpy()).pvalue > 1e-3


def test_rows_computed_on_demand_give_the_same_outcomes_and_skip_unvisited_rows():
    """`RowProbs` (what the engine passes) must change nothing but the work: with the same
    seeds, every outcome equals the one from the full p tensor, and the rows it computed are
    exactly the nodes of the accepted path, where the verifier reads p."""
    from eagle.sampling import RowProbs

    parents, V = [-1, 0, 0, 0, 1, 1, 4], 6
    tokens, _, q_nodes = draft_fixture(parents, V, 3, "sampled")
    policy = SamplingPolicy(temperature=0.7, top_p=0.9)
    logits = torch.randn(
        len(parents), V, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    p_nodes = policy.probs(logits)
    skipped = 0
    for seed in range(200):
        full = verify_tree_stochastic(
            parents, tokens, p_nodes, q_nodes, torch.Generator().manual_seed(seed)
        )
        lazy_p = RowProbs(policy, logits)
        lazy = verify_tree_stochastic(
            parents, tokens, lazy_p, q_nodes, torch.Generator().manual_seed(seed)
        )
        assert lazy == full
        path = full[0]
        assert set(lazy_p.rows) == set(path)  # p is read at the path's nodes only
        for u in lazy_p.rows:
            assert torch.equal(lazy_p.rows[u], p_nodes[u])
        skipped += len(parents) - len(lazy_p.rows)
    assert skipped > 0


# ------------------------------------------------------------------------------------ greedy


def peaked(argmax: list[int], V: int = 8) -> torch.Tensor:
    """(N+1, V) logits whose row u has its maximum at argmax[u]."""
    logits = torch.randn(len(argmax), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax)), argmax] = 10.0
    return logits


GREEDY_CASES = [  # parents, tokens, target argmax per node, accepted path, next token
    # follows the matching child at each level down to a leaf: bonus token there
    ([-1, 0, 0, 1, 2, 4], [0, 3, 1, 2, 5, 4], [1, 2, 5, 0, 4, 6], [0, 2, 4, 5], 6),
    # the first level matches, the second does not: correction at node 1
    ([-1, 0, 0, 1, 1], [0, 3, 1, 2, 5], [3, 7, 0, 0, 0], [0, 1], 7),
    # nothing accepted: the target's own token after the root
    ([-1, 0, 0, 1], [0, 3, 1, 2], [4, 2, 0, 0], [0], 4),
    # duplicate siblings both match: the longer accepted path wins
    ([-1, 0, 0, 2], [0, 1, 1, 3], [1, 5, 3, 6], [0, 2, 3], 6),
    # duplicate siblings, equally long: the first in sibling order wins
    ([-1, 0, 0], [0, 1, 1], [1, 5, 2], [0, 1], 5),
    # a chain fully accepted: bonus token
    (chain_parents(3), [0, 4, 5, 6], [4, 5, 6, 7], [0, 1, 2, 3], 7),
    # root only
    ([-1], [0], [3], [0], 3),
]


@pytest.mark.parametrize("parents,tokens,argmax,path,nxt", GREEDY_CASES)
def test_verify_tree_greedy(parents, tokens, argmax, path, nxt):
    logits = peaked(argmax)
    tokens = torch.tensor(tokens)
    assert verify_tree_greedy(parents, tokens, logits) == (path, nxt)
    assert verify_tree_greedy(torch.tensor(parents), tokens, logits.softmax(-1)) == (path, nxt)


def test_stochastic_reduces_to_greedy_for_one_hot_p_and_q():
    """Greedy target policy + deterministic proposals: the sampler must act like greedy."""
    policy, V = SamplingPolicy(), 8  # at most 8 children per node: distinct tokens fit
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        parents = [-1] + [int(torch.randint(i, (), generator=gen)) for i in range(1, 9)]
        p_nodes = policy.probs(torch.randn(len(parents), V, generator=gen, dtype=F64))
        best = p_nodes.argmax(-1).tolist()
        tokens = torch.zeros(len(parents), dtype=torch.long)
        for u, ch in enumerate(Tree.of(parents).children):
            if not ch:
                continue
            # distinct sibling tokens (top-k proposals never repeat), usually including the
            # target's choice so that long accepted paths are exercised too
            perm = torch.randperm(V, generator=gen).tolist()
            if torch.rand((), generator=gen) < 0.8:
                perm.remove(best[u])
                perm.insert(int(torch.randint(len(ch), (), generator=gen)), best[u])
            tokens[list(ch)] = torch.tensor(perm[: len(ch)])
        q_nodes = torch.nn.functional.one_hot(tokens, V).to(F64)
        greedy = verify_tree_greedy(parents, tokens, p_nodes)
        assert verify_tree_stochastic(parents, tokens, p_nodes, q_nodes, gen) == greedy


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 0], []])
def test_malformed_trees_are_rejected(parents):
    with pytest.raises(ValueError, match="parents"):
        Tree.of(parents)


def test_row_count_mismatch_is_rejected():
    parents, V = chain_parents(2), 3
    with pytest.raises(ValueError, match="rows"):
        verify_tree_greedy(parents, torch.zeros(3, dtype=torch.long), torch.zeros(2, V))
    with pytest.raises(ValueError, match="rows"):
        tree_outcome_distribution(
            parents, torch.zeros(3, dtype=torch.long), torch.ones(3, V) / V, torch.ones(4, V) / V
        )


# ---------------------------------------------------------------------------------------
# Typical acceptance (Medusa; lossy)


def test_typical_acceptance_hand_computed():
    # p = (0.6, 0.25, 0.1, 0.05): H = -(0.6 ln 0.6 + 0.25 ln 0.25 + 0.1 ln 0.1 + 0.05 ln 0.05)
    #   = 0.306495 + 0.346574 + 0.230259 + 0.149787 = 1.033114 nats; exp(-H) = 0.355897
    p = torch.tensor([0.6, 0.25, 0.1, 0.05], dtype=torch.float64)
    assert float(entropy(p)) == pytest.approx(1.033114, abs=1e-6)
    # delta * exp(-H) = 0.3 * 0.355897 = 0.106769 > eps = 0.09: eps binds, 0.1 > 0.09 passes
    assert float(typical_threshold(p, eps=0.09, delta=0.3)) == pytest.approx(0.09)
    assert typical_accept(p, torch.arange(4), 0.09, 0.3).tolist() == [True, True, True, False]
    # eps = 0.2: delta * exp(-H) = 0.106769 binds, and 0.1 falls below it
    assert float(typical_threshold(p, eps=0.2, delta=0.3)) == pytest.approx(0.106769, abs=1e-6)
    assert typical_accept(p, torch.arange(4), 0.2, 0.3).tolist() == [True, True, False, False]
    # uniform over 4: H = ln 4, exp(-H) = 1/4, threshold min(0.09, 0.075) = 0.075 < 0.25: all
    # typical
    u = torch.full((4,), 0.25, dtype=torch.float64)
    assert float(typical_threshold(u, 0.09, 0.3)) == pytest.approx(0.075)
    assert bool(typical_accept(u, torch.arange(4), 0.09, 0.3).all())
    # temperature 0 (one-hot p): H = 0, threshold min(eps, delta) = 0.09: only the argmax passes
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert float(entropy(one_hot)) == 0.0
    assert typical_accept(one_hot, torch.arange(4), 0.09, 0.3).tolist() == [
        False,
        True,
        False,
        False,
    ]
    assert bool(typical_accept(p, 2, 0.09, 0.3))
    with pytest.raises(ValueError, match="eps must be in"):
        TypicalAcceptance(eps=0.0)


def test_typical_tree_takes_the_longest_accepted_path():
    #        0
    #      /   \
    #     1     2          1 and 2 both typical at the root
    #     |    / \
    #     3   4   5        3 typical, 4 typical, 5 not
    #         |
    #         6            6 typical: the longest path is 0-2-4-6, though 1 comes first
    parents = [-1, 0, 0, 1, 2, 2, 4]
    tokens = torch.tensor([9, 0, 1, 2, 3, 0, 2])
    p = torch.full((7, 4), 0.02)
    p[0] = torch.tensor([0.5, 0.4, 0.05, 0.05])  # root: tokens 0 and 1 typical
    p[1] = torch.tensor([0.1, 0.1, 0.7, 0.1])  # node 1: its child token 2 typical
    p[2] = torch.tensor(
        [0.02, 0.03, 0.05, 0.9]
    )  # node 2: child token 3 typical, token 0 (node 5) not
    p[4] = torch.tensor([0.1, 0.1, 0.7, 0.1])  # node 4: child token 2 typical
    p[6] = torch.tensor([0.1, 0.6, 0.2, 0.1])  # after the path: argmax token 1 is emitted
    p[3] = p[5] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    assert verify_tree_typical(parents, tokens, p, 0.09, 0.3) == ([0, 2, 4, 6], 1)
    # equally long paths: the more likely one wins, even second in sibling order (Medusa)
    par2 = [-1, 0, 0]
    toks2 = torch.tensor([9, 0, 1])
    p2 = torch.tensor([[0.3, 0.6, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]])
    assert verify_tree_typical(par2, toks2, p2, 0.09, 0.3) == ([0, 2], 2)
    # nothing typical: the root alone, then the argmax
    assert verify_tree_typical(
        par2, torch.tensor([9, 2, 2]), torch.tensor([[0.95, 0.04, 0.01]] * 3), 0.09, 0.3
    ) == ([0], 0)


@pytest.mark.parametrize("parents,tokens,argmax,path,nxt", GREEDY_CASES)
def test_typical_with_one_hot_p_is_greedy(parents, tokens, argmax, path, nxt):
    """At temperature 0 (one-hot p) only the argmax is typical: greedy verification."""
    p_nodes = SamplingPolicy().probs(peaked(argmax))
    assert verify_tree_typical(parents, torch.tensor(tokens), p_nodes, 0.09, 0.3) == (path, nxt)
