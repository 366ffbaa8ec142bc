"""eagle.bench.analysis: feature error and agreement by draft depth, tree acceptance from a report.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from eagle.bench.analysis import (
    conditional_acceptance,
    depth_profile,
    drafter_profile,
    latest_report,
    tree_acceptance,
    tree_layout,
)
from eagle.models.drafter import EagleDrafter
from eagle.tree import Tree, TreeError
from helpers.models import make_tiny_model


def batch(features: torch.Tensor, loss_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    b, t, _ = features.shape
    ids = torch.arange(b * t).reshape(b, t) % 7
    return {
        "input_ids": ids,
        "features": features,
        "loss_mask": torch.ones(b, t, dtype=torch.long) if loss_mask is None else loss_mask,
    }


def test_oracle_drafter_has_zero_error_and_full_agreement():
    torch.manual_seed(0)
    feats = torch.randn(2, 9, 16)
    head = torch.nn.Linear(16, 11)
    truth = feats[:, 1:]  # what the drafter should predict at every input position

    prof = depth_profile(lambda f, x, p: truth, head, [batch(feats)], depth=5, ks=(1, 3))
    assert prof.l1 == [0.0] * 5
    assert prof.cosine == pytest.approx([1.0] * 5)
    assert prof.agreement == {1: [1.0] * 5, 3: [1.0] * 5}
    # depth d counts the positions whose unroll rests on d predicted steps: 8 - (d - 1) per row,
    # less the last position (its next token is not in the sample)
    assert prof.counts == [2 * (7 - d + 1) for d in range(1, 6)]


def test_error_piles_up_along_a_draft_by_the_lag():
    """A drafter that copies its input feature predicts f_{t-d+1} for f_{t+1} at depth d: with
    f_t = (t + 1) * ones the L1 error per element is exactly d and the cosine stays 1."""
    t, h = 10, 4
    feats = (torch.arange(t, dtype=torch.float32) + 1)[None, :, None].expand(1, t, h).contiguous()
    head = torch.nn.Linear(h, 5)
    prof = depth_profile(lambda f, x, p: f, head, [batch(feats)], depth=4, ks=(1,))
    assert prof.l1 == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert prof.cosine == pytest.approx([1.0] * 4)
    assert prof.feature_scale == pytest.approx(
        sum(range(2, t)) / (t - 2)
    )  # targets f_2..f_{t-1}, weighted


def test_opposite_features_never_agree_top1_but_always_top_v():
    torch.manual_seed(1)
    feats = torch.randn(3, 6, 8)
    head = torch.nn.Linear(8, 5, bias=False)
    prof = depth_profile(lambda f, x, p: -feats[:, 1:], head, [batch(feats)], depth=1, ks=(1, 5))
    assert prof.agreement[1] == [0.0]  # argmax(W(-f)) = argmin(Wf) != argmax(Wf)
    assert prof.agreement[5] == [1.0]
    assert prof.cosine == pytest.approx([-1.0])
    assert prof.stderr(1) == [0.0] and prof.stderr(5) == [0.0]  # certain outcomes
    prof.agreement[1] = [0.5]
    assert prof.stderr(1) == [pytest.approx(0.5 / prof.counts[0] ** 0.5)]


def test_loss_mask_selects_positions_and_empty_mask_is_refused():
    feats = torch.randn(1, 6, 4)
    mask = torch.tensor([[0, 0, 0, 1, 1, 0]])
    head = torch.nn.Linear(4, 3)
    prof = depth_profile(lambda f, x, p: f, head, [batch(feats, mask)], depth=1)
    # weight at input position j is m_{j+2}: positions 1 and 2 count
    want = ((feats[0, 1:3] - feats[0, 2:4]).abs().mean(-1)).mean()
    assert prof.counts == [2] and prof.l1[0] == pytest.approx(float(want))
    with pytest.raises(ValueError, match="no trained positions"):
        depth_profile(lambda f, x, p: f, head, [batch(feats, torch.zeros_like(mask))], depth=1)


def test_drafter_profile_runs_a_real_drafter():
    target = make_tiny_model("llama", seed=0)
    drafter = EagleDrafter.random(target)
    feats = torch.randn(5, 12, target.config.hidden_size)
    samples = [
        {
            "input_ids": torch.randint(0, 50, (12,)),
            "features": feats[i],
            "loss_mask": torch.ones(12, dtype=torch.long),
        }
        for i in range(5)
    ]
    prof = drafter_profile(drafter, samples, depth=3, ks=(1, 4), max_samples=4, batch_size=3)
    assert prof.counts == [4 * (10 - d + 1) for d in (1, 2, 3)]
    assert all(0 <= a <= 1 for a in prof.agreement[4])
    assert [r["depth"] for r in prof.rows()] == [1, 2, 3] and "top4" in prof.rows()[0]


def test_tree_helpers():
    parents = [-1, 0, 0, 1, 1, 3]
    assert Tree.of(parents).depths == (0, 1, 1, 2, 2, 3)
    by_node = [1.0, 0.6, 0.3, 0.3, 0.0, 0.15]
    assert conditional_acceptance(parents, by_node) == [None, 0.6, 0.3, 0.5, 0.0, 0.5]
    assert conditional_acceptance(parents, [1.0, 0.0, 0.3, 0.0, 0.0, 0.0])[3] is None
    x, depth = tree_layout(parents)
    assert depth == [0, 1, 1, 2, 2, 3]
    assert x[5] == 0.0 and x[4] == 1.0 and x[2] == 2.0  # leaves left to right
    assert x[3] == 0.0 and x[1] == 0.5 and x[0] == 1.25  # parents centred over children
    with pytest.raises(TreeError, match=r"parents\[1\] = 2 must satisfy 0 <= parents\[i\] < 1"):
        tree_layout([-1, 2, 0])


def report(by_node):
    m = {
        "tau": 2.5,
        "acceptance_by_depth": [0.6, 0.3],
        "tree_parents": [-1, 0, 0, 1],
        "acceptance_by_node": by_node,
    }
    return {
        "runs": [
            {"eval_set": "humaneval", "temperature": 0.0, "methods": {"eagle": m, "vanilla": {}}},
            {"eval_set": "humaneval", "temperature": 1.0, "methods": {"vanilla": {}}},
        ]
    }


def test_tree_acceptance_from_a_report(tmp_path):
    runs = tree_acceptance(report([1.0, 0.5, 0.1, 0.3]))
    assert len(runs) == 1 and runs[0].depths == [0, 1, 1, 2]
    assert runs[0].conditional == [None, 0.5, 0.1, pytest.approx(0.6)]
    with pytest.raises(ValueError, match="no 'medusa' runs"):
        tree_acceptance(report([1.0, 0.5, 0.1, 0.3]), method="medusa")

    # newest first: "new" lacks per-node data, so "old" is picked over the older "oldest"
    runs = (("oldest", [1.0, 0.2, 0.2, 0.2]), ("old", [1.0, 0.5, 0.1, 0.3]), ("new", None))
    for mtime, (name, by_node) in enumerate(runs, start=1_000_000):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(report(by_node)))
        os.utime(tmp_path / name / "results.json", (mtime, mtime))
    assert latest_report(tmp_path) == tmp_path / "old" / "results.json"
    with pytest.raises(FileNotFoundError, match="decode.py mode=benchmark"):
        latest_report(tmp_path / "new")
