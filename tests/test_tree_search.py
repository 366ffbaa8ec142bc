"""eagle.tree_search: the best subtree of a probe from measured per-node acceptance."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from eagle.engine import SpeculativeDecoder
from eagle.tree import TreeError, TreeTemplate
from eagle.tree_search import best_subtree, candidates, write_tree


def test_rank_budget_probe():
    t = TreeTemplate.rank_budget(3, 1)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0))
    probe = TreeTemplate.from_config({"kind": "budget", "max_depth": 8, "max_rank_sum": 2})
    assert probe.num_nodes == sum((d + 1) * (d + 2) // 2 for d in range(1, 9))
    with pytest.raises(TreeError, match="missing key 'max_rank_sum'"):
        TreeTemplate.from_config({"kind": "budget", "max_depth": 3})


def test_best_subtree_follows_the_measured_acceptance():
    probe = TreeTemplate.rank_budget(3, 1)  # nodes 1..9 = the paths above
    #          root  [0]  [1]  [0,0] [0,1] [1,0] [0,0,0] [0,0,1] [0,1,0] [1,0,0]
    by_node = [1.0, 0.7, 0.2, 0.5, 0.15, 0.1, 0.4, 0.05, 0.1, 0.05]
    c = best_subtree(probe, by_node, 3)
    assert c.tree.paths == ((0,), (0, 0), (0, 0, 0)) and c.predicted_tau == pytest.approx(2.6)
    c = best_subtree(probe, by_node, 5)
    assert c.tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert c.predicted_tau == pytest.approx(1 + 0.7 + 0.2 + 0.5 + 0.15 + 0.4)
    # rank 1 needs rank 0 first: [0,1] cannot be kept before [0,0] even if measured higher
    skewed = list(by_node)
    skewed[4] = 0.6
    assert best_subtree(probe, skewed, 2).tree.paths == ((0,), (0, 0))
    assert [x.tree.num_nodes for x in candidates(probe, by_node, [1, 4, 50])] == [1, 4]
    with pytest.raises(TreeError, match="subtree size"):
        best_subtree(probe, by_node, 0)
    with pytest.raises(TreeError, match="acceptance values"):
        best_subtree(probe, by_node[:-1], 2)


def test_written_tree_loads_back(tmp_path):
    probe = TreeTemplate.rank_budget(3, 1)
    c = best_subtree(probe, [1.0, 0.7, 0.2, 0.5, 0.15, 0.1, 0.4, 0.05, 0.1, 0.05], 4)
    path = write_tree(c, tmp_path / "best4.yaml", source="a test")
    assert TreeTemplate.from_file(path).paths == c.tree.paths
    assert "predicted tau 2.800" in path.read_text()


def test_a_subtree_accepts_the_kept_prefix_of_the_probes_path():
    """Why the prediction is exact: under greedy decoding at most one child of a node matches
    the target's argmax, so the accepted path of any subtree is the longest prefix of the
    probe's accepted path that the subtree kept. Checked on the first round of 24 prompts
    (first-round contexts are identical in both runs), drafting with a perturbed copy of
    the target so that accepted paths are long and take ranks other than 0."""
    from eagle.proposers import DraftLM, TemplateProposer

    target = make_tiny_model("llama", seed=0)
    draft = make_tiny_model("llama", seed=0)
    with torch.no_grad():
        w = draft.lm_head.weight
        w += 0.5 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    probe = TreeTemplate.rank_budget(4, 2)
    by_node = [1.0] + [1.0 / (1 + i) for i in range(probe.num_nodes)]  # any values: a shape to test
    sub = best_subtree(probe, by_node, 9).tree
    kept = set(sub.paths)

    def first_path(template, prompt):
        dec = SpeculativeDecoder(target, TemplateProposer(DraftLM(draft), template), eos_token_id=[])
        path = dec.generate(prompt, 12).stats.rounds[0].path
        return [template.paths[i - 1] for i in path[1:]]

    g = torch.Generator().manual_seed(0)
    deepest, other_ranks = 0, 0
    for n in range(24):
        prompt = [1] + torch.randint(3, 90, (3 + n,), generator=g).tolist()
        full = first_path(probe, prompt)
        want = []
        for p in full:
            if p not in kept:
                break
            want.append(p)
        assert first_path(sub, prompt) == want
        deepest = max(deepest, len(full))
        other_ranks += any(any(p) for p in full)
    assert deepest >= 3 and other_ranks >= 3  # the check saw long paths through ranks > 0
