"""SpecInfer's merge-based speculation (`eagle.proposers.merge`): merging by shared prefix, and
exactness of the merged tree under sampling by enumeration.

Every joint draft of K toy SSMs is enumerated with its probability, merged by `merge_trees`
(the code the proposer runs), and verified in closed form and by the engine's sampler with
every draw followed; the distribution of the first T emitted tokens must equal the target's
p(x1) p(x2|x1) ... to float64 round-off. The same check with the repeated draws' proposals
dropped (what merging without `repeats` would do) must fail. Greedy output identical to
`generate`, and sampled output against the target's distribution in the engine, are in the
conformance suite (tests/test_conformance.py, case "specinfer_merge").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import product
from math import prod

import pytest
import torch

from eagle.acceptance import chain_parents, tree_outcome_distribution, verify_tree_stochastic
from eagle.decoding.engine import DraftTree
from eagle.proposers.merge import MergeProposer, merge_trees
from helpers.exact import Case, ToyModels, draft_trees
from helpers.stats import enumerate_draws

F64 = torch.float64


# ------------------------------------------------------------------------- merging by prefix


def tree(tokens, parents, q=None):
    return DraftTree(tokens=torch.tensor(tokens), parents=tuple(parents), q=q)


def test_shared_prefixes_merge_and_repeats_keep_their_proposals():
    qa, qb = torch.eye(9)[:2].double(), torch.eye(9)[2:4].double()
    a = tree([5, 6], chain_parents(2), qa)  # SSM 1: 5 -> 6
    b = tree([5, 7], chain_parents(2), qb)  # SSM 2: 5 -> 7 (shares the 5)
    merged, maps = merge_trees([a, b])
    assert merged.tokens.tolist() == [5, 6, 7]
    assert merged.parents == (-1, 0, 1, 1)
    torch.testing.assert_close(merged.q, torch.stack([qa[0], qa[1], qb[1]]))
    twins, q_rep = merged.repeats[1]  # b's 5 was drawn after node 1 and repeats node 1
    assert list(merged.repeats) == [1] and twins == (1,)
    torch.testing.assert_close(q_rep, qb[:1])
    assert maps == [{0: 0, 1: 1, 2: 2}, {0: 0, 1: 1, 2: 3}]


def test_a_repeat_goes_after_the_sibling_drawn_just_before_it():
    q = torch.eye(9).double()
    a = tree([1, 2], (-1, 0, 0), q[[1, 2]])  # SSM 1 draws 1 then 2 at the root
    b = tree([1], (-1, 0), q[[3]])           # SSM 2 draws 1 again: tried after 2, not after 1
    merged, _ = merge_trees([a, b])
    assert merged.tokens.tolist() == [1, 2]
    assert list(merged.repeats) == [2] and merged.repeats[2][0] == (1,)  # drawn after 2, repeats 1
    c = tree([2], (-1, 0), q[[4]])  # SSM 3 repeats 2: still after 2, after SSM 2's repeat
    merged, _ = merge_trees([a, b, c])
    assert merged.repeats[2][0] == (1, 2)
    torch.testing.assert_close(merged.repeats[2][1], q[[3, 4]])


def test_breadth_first_order_and_budget():
    a = tree([1, 2, 3], chain_parents(3))
    b = tree([4, 5], chain_parents(2))
    merged, maps = merge_trees([a, b])
    assert merged.tokens.tolist() == [1, 4, 2, 5, 3]  # depth by depth, siblings by first draw
    assert merged.parents == (-1, 0, 0, 1, 2, 3)
    assert merged.q is None and merged.repeats is None  # greedy trees carry no proposals
    cut, maps = merge_trees([a, b], budget=4)
    assert sorted(cut.tokens.tolist()) == [1, 2, 3, 4]  # b's second draw has no room
    assert maps[1] == {0: 0, 1: 2}


def test_proposer_limits():
    with pytest.raises(ValueError, match="at least one"):
        MergeProposer([])

    class Fixed:
        max_nodes = 5

    assert MergeProposer([Fixed(), Fixed()]).max_nodes == 10
    assert MergeProposer([Fixed(), Fixed()], budget=7).max_nodes == 7
    short = type("Short", (Fixed,), {"context": 32})
    # checked before decoding: the shortest SSM's
    assert MergeProposer([Fixed(), Fixed()]).context is None
    assert (
        MergeProposer([Fixed(), short(), type("Long", (Fixed,), {"context": 64})()]).context == 32
    )
    with pytest.raises(ValueError, match="budget"):
        MergeProposer([Fixed()], budget=0)


# ------------------------------------------------------------------ exactness by enumeration


@dataclass(frozen=True)
class MergeCase:
    ssms: tuple[
        tuple[tuple[int, ...], str], ...
    ]  # per SSM: its tree's parents and scheme (iid/wor/topk)
    V: int
    T: int  # emitted tokens whose joint distribution is checked
    budget: int | None = None
    seed: int = 0


CHAIN2 = tuple(chain_parents(2))
MERGE_CASES = {
    "two_chains": MergeCase(((CHAIN2, "iid"), (CHAIN2, "iid")), V=3, T=3),
    "chain_and_expansion": MergeCase(((CHAIN2, "iid"), ((-1, 0, 0), "wor")), V=3, T=2, seed=1),
    "three_single_drafts": MergeCase((((-1, 0), "iid"),) * 3, V=3, T=2, seed=2),
    "four_single_drafts": MergeCase(
        (((-1, 0), "iid"),) * 4, V=3, T=2, seed=5
    ),  # a, b, a, b: repeats in a row
    "topk_and_sampled": MergeCase((((-1, 0, 0), "topk"), (CHAIN2, "iid")), V=3, T=2, seed=3),
    "budget": MergeCase(((CHAIN2, "iid"), (CHAIN2, "iid")), V=3, T=3, budget=3, seed=4),
}


def merged_drafts(case: MergeCase, context: tuple[int, ...], merge=merge_trees):
    """Every joint draft of the SSMs, merged: yields (probability, merged DraftTree)."""
    per_ssm = []
    for k, (parents, scheme) in enumerate(case.ssms):
        models = ToyModels(case.V, seed=100 * (case.seed + 1) + k)  # SSM k's own proposal tables
        per_ssm.append(list(draft_trees(Case(parents, scheme, case.V, case.T), models, context)))
    for combo in product(*per_ssm):
        trees = [
            DraftTree(tokens=toks[1:], parents=parents, q=q[1:])
            for (_, toks, q, _), (parents, _) in zip(combo, case.ssms)
        ]
        yield prod(w for w, *_ in combo), merge(trees, case.budget)[0]


def closed_form(parents, toks, p_nodes, q_nodes, repeats):
    end_prob, end_dist = tree_outcome_distribution(parents, toks, p_nodes, q_nodes, repeats=repeats)
    for u, (pu, row) in enumerate(zip(end_prob.tolist(), end_dist.tolist())):
        for y, py in enumerate(row):
            yield u, y, pu * py


def sampler(parents, toks, p_nodes, q_nodes, repeats):
    def run(draw):
        path, y = verify_tree_stochastic(
            parents, toks, p_nodes, q_nodes, draw=draw, repeats=repeats
        )
        return path[-1], y

    for (u, y), prob in enumerate_draws(run).items():
        yield u, y, prob


def exactness_error(
    case: MergeCase, outcomes, drop_repeats: bool = False, merge=merge_trees
) -> tuple[float, int]:
    """Largest |Pr(first T tokens) - prod p| over all sequences, and how many merged drafts had
    repeated draws (the check must exercise them)."""
    target = ToyModels(case.V, case.seed)
    memo: dict = {}
    seen_repeats = 0

    def dist(context, T):
        nonlocal seen_repeats
        if (context, T) in memo:
            return memo[context, T]
        out = defaultdict(float)
        for w, merged in merged_drafts(case, context, merge):
            parents = merged.parents
            paths = [()]
            for i in range(1, len(parents)):
                paths.append(paths[parents[i]] + (int(merged.tokens[i - 1]),))
            toks = torch.cat([torch.tensor([context[-1]]), merged.tokens])
            p_nodes = torch.stack([target.p(context + path) for path in paths])
            q_nodes = torch.cat([torch.full((1, case.V), 1.0 / case.V, dtype=F64), merged.q])
            seen_repeats += merged.repeats is not None
            repeats = None if drop_repeats else merged.repeats
            for u, y, pu in outcomes(parents, toks, p_nodes, q_nodes, repeats):
                emitted, mass = paths[u] + (y,), w * pu
                if mass == 0:
                    continue
                if len(emitted) >= T:
                    out[emitted[:T]] += mass
                else:
                    for rest, m in dist(context + emitted, T - len(emitted)).items():
                        out[emitted + rest] += mass * m
        memo[context, T] = out
        return out

    got = dist((0,), case.T)
    err = 0.0
    for seq in product(range(case.V), repeat=case.T):
        want = prod(target.p((0,) + seq[:k])[x].item() for k, x in enumerate(seq))
        err = max(err, abs(got.get(seq, 0.0) - want))
    return err, seen_repeats


@pytest.mark.parametrize("name", sorted(MERGE_CASES))
@pytest.mark.parametrize("outcomes", [closed_form, sampler], ids=["closed_form", "sampler"])
def test_merged_trees_preserve_target_distribution(name, outcomes):
    err, seen_repeats = exactness_error(MERGE_CASES[name], outcomes)
    assert seen_repeats > 0, "the case must produce repeated draws"
    assert err < 1e-9


@pytest.mark.parametrize("name", ["two_chains", "three_single_drafts", "chain_and_expansion"])
def test_merging_without_the_repeats_is_biased(name):
    err, _ = exactness_error(MERGE_CASES[name], closed_form, drop_repeats=True)
    assert err > 1e-3, f"the check missed a merge that drops repeated draws (error {err:.2e})"


def repeats_after_their_twins(trees, budget=None):
    """WRONG: each repeated draw tried right after the node it repeats, not at its place in the
    order of draws."""
    merged, maps = merge_trees(trees, budget)
    if merged.repeats:
        moved: dict[int, list] = defaultdict(list)
        for twins, q in merged.repeats.values():
            for twin, row in zip(twins, q):
                moved[twin].append(row)
        merged.repeats = {t: ((t,) * len(rows), torch.stack(rows)) for t, rows in moved.items()}
    return merged, maps


@pytest.mark.parametrize("name", ["three_single_drafts", "topk_and_sampled"])
def test_repeats_out_of_order_are_biased(name):
    err, _ = exactness_error(MERGE_CASES[name], closed_form, merge=repeats_after_their_twins)
    assert err > 1e-3, f"the check missed repeats tried out of order (error {err:.2e})"
