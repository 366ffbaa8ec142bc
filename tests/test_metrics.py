"""eagle.metrics: known answers for the losses, agreement and the depth unroll."""

from __future__ import annotations

import math

import pytest
import torch

from eagle.training import metrics


def test_feature_loss_known_values():
    f = torch.zeros(1, 3, 2)
    f_hat = torch.tensor([[[0.5, 0.5], [2.0, 2.0], [9.0, 9.0]]])  # (1, 3, 2)
    # SmoothL1 (beta 1): 0.5 * d^2 for |d| < 1, |d| - 0.5 otherwise
    assert metrics.feature_error(f_hat, f).tolist() == [[0.125, 1.5, 8.5]]
    mask = torch.tensor([[1, 1, 0]])  # the third position does not count
    assert metrics.feature_loss(f_hat, f, mask).item() == pytest.approx((0.125 + 1.5) / 2)
    assert metrics.feature_loss(f, f, torch.ones(1, 3)).item() == 0.0
    assert metrics.feature_loss(f_hat, f, torch.zeros(1, 3)).item() == 0.0  # nothing counted


def test_soft_cross_entropy_known_values():
    v = 5
    uniform = torch.zeros(1, 1, v)
    assert metrics.soft_cross_entropy(uniform, torch.randn(1, 1, v)).item() == pytest.approx(
        math.log(v)
    )
    # q == p: the cross-entropy is p's entropy, its minimum over q
    logits = torch.tensor([[[2.0, 0.0, -1.0, 0.5, 0.0]]])
    p = torch.softmax(logits, -1)
    entropy = -(p * p.log()).sum().item()
    assert metrics.soft_cross_entropy(logits, logits).item() == pytest.approx(entropy, rel=1e-6)
    assert metrics.soft_cross_entropy(logits + 3.0, logits).item() == pytest.approx(
        entropy, rel=1e-6
    )
    assert metrics.soft_cross_entropy(logits.flip(-1), logits).item() > entropy
    mask = torch.tensor([[1]])
    assert metrics.token_loss(logits, logits, mask).item() == pytest.approx(entropy, rel=1e-6)


def test_topk_agreement_known_values():
    # target argmax per position: 0, 1, 2, 3
    target = torch.eye(4)[None] * 5  # (1, 4, 4)
    draft = torch.tensor(
        [
            [
                [9.0, 1.0, 0.0, 0.0],  # top-1 = 0: hit
                [9.0, 5.0, 0.0, 0.0],  # top-1 = 0, top-2 = {0, 1}: hit at k = 2
                [0.0, 1.0, 2.0, 3.0],  # ranks 3 > 2 > 1 > 0: target 2 is 2nd
                [3.0, 2.0, 1.0, 0.0],  # target 3 is last
            ]
        ]
    )
    assert metrics.topk_hits(draft, target, 1).tolist() == [[True, False, False, False]]
    assert metrics.topk_hits(draft, target, 2).tolist() == [[True, True, True, False]]
    assert metrics.topk_hits(draft, target, 9).tolist() == [[True] * 4]  # k clipped to V
    ones = torch.ones(1, 4)
    assert metrics.agreement(draft, target, ones, 1).item() == 0.25
    assert metrics.agreement(draft, target, ones, 2).item() == 0.75
    assert metrics.agreement(draft, target, torch.tensor([[0, 1, 1, 0]]), 2).item() == 1.0
    assert metrics.agreement(target, target, ones, 1).item() == 1.0


def test_label_hits_counts_strictly_higher_logits_with_ties():
    """k > 1 (torch.topk) against its definition, fewer than k tokens score strictly higher, on
    integer logits full of ties; k = 1 is the argmax."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (3, 50, 9), generator=g).float()
    labels = torch.randint(0, 9, (3, 50), generator=g)
    higher = (logits > logits.gather(-1, labels[..., None])).sum(-1)  # (3, 50)
    for k in (2, 3, 5, 9):
        assert torch.equal(metrics.label_hits(logits, labels, k), higher < k)
    assert torch.equal(metrics.label_hits(logits, labels, 1), logits.argmax(-1) == labels)


def test_head_hits_and_argmax_on_masked_rows_match_the_full_logits():
    """The head on the masked rows only, a few rows at a time, gives the sums of the full
    (B, T, V) computation, weights included; unmasked positions get label -1."""
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(6, 13)
    feats, other = torch.randn(2, 11, 6, generator=g), torch.randn(2, 11, 6, generator=g)
    mask = (torch.rand(2, 11, generator=g) > 0.4).float() * torch.rand(2, 11, generator=g)
    with torch.no_grad():
        labels = metrics.head_argmax(head, other, mask, rows=3)
        full = head(other).argmax(-1)
        assert torch.equal(labels[mask != 0], full[mask != 0]) and (labels[mask == 0] == -1).all()
        res = metrics.head_hits(head, feats, full, mask, ks=(1, 4), rows=3)
        for k in (1, 4):
            hits, count = res[k]
            want = metrics.masked_sum_count(metrics.label_hits(head(feats), full, k).float(), mask)
            torch.testing.assert_close((hits, count), want)
        assert metrics.head_argmax(head, other, torch.zeros(2, 11)).eq(-1).all()


def test_unroll_feeds_shifted_predictions():
    # a "drafter" that returns its input features: f_hat_t = input at t
    b, t, h = 2, 6, 3
    feats = torch.arange(b * t * h, dtype=torch.float32).reshape(b, t, h)
    ids = torch.zeros(b, t, dtype=torch.long)
    outs = metrics.unroll(lambda f, x, p: f.clone(), feats, ids, ids, depth=4)
    assert len(outs) == 4
    for d, out in enumerate(outs, start=1):
        # depth d at position t = input at t shifted d-1 times = feats[t - (d-1)], floored at 0
        idx = [max(0, j - (d - 1)) for j in range(t)]
        torch.testing.assert_close(out, feats[:, idx])
    with pytest.raises(ValueError):
        metrics.unroll(lambda f, x, p: f, feats, ids, ids, depth=0)


def test_depth_mask():
    mask = torch.ones(2, 5)
    assert metrics.depth_mask(mask, 1).tolist() == mask.tolist()
    assert metrics.depth_mask(mask, 3).tolist() == [[0, 0, 1, 1, 1]] * 2
    assert mask.sum() == 10  # not modified in place


def test_agreement_by_depth_oracle_and_copier():
    """A drafter that returns the target's features exactly agrees at every depth with zero
    error; one that copies its input (the previous feature) never agrees when the target's
    next token changes at every position."""
    b, t, v = 1, 7, 4
    head = torch.nn.Linear(v, v, bias=False)
    head.weight.data = torch.eye(v)  # logits = features
    target_feats = torch.eye(v)[torch.arange(t + 1) % v][None] * 3.0  # (1, t+1, v) argmax cycles
    features_in, target = target_feats[:, :-1], target_feats[:, 1:]  # f_{t-1}, f_t
    target_logits = head(target)
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.ones(b, t)

    def oracle(f, x, p=None):
        return target.clone()

    res = metrics.agreement_by_depth(
        oracle, head, features_in, ids, ids, target_logits, mask, depth=5, ks=(1, 2)
    )
    assert set(res) == {(d, k) for d in range(1, 6) for k in (1, 2)}
    for d in range(1, 6):
        hits, count = res[(d, 1)]
        assert count.item() == t - (d - 1)  # the first d-1 positions are shallower
        assert hits.item() == count.item()
    assert metrics.feature_loss(oracle(None, None), target, mask).item() == 0.0

    def copier(f, x, p=None):
        return f.clone()

    res = metrics.agreement_by_depth(
        copier, head, features_in, ids, ids, target_logits, mask, depth=3
    )
    for d in range(1, 4):
        hits, count = res[(d, 1)]
        assert hits.item() == 0 and count.item() == t - (d - 1)
