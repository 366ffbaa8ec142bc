"""EAGLE drafters for tests: perturbed random ones, and one trained on a tiny target."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle.models.drafter import EagleDrafter
from eagle.target import target_forward
from helpers.models import make_tiny_model


def perturbed(drafter: EagleDrafter, seed: int = 1) -> EagleDrafter:
    """Give the norm weight non-trivial values (a fresh one is all ones)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = drafter.layers[0].post_attention_layernorm.weight
        w.copy_(1 + 0.5 * torch.randn(w.shape, generator=g))
    return drafter


class FakeTokenizer:
    """Enough of a tokenizer for `tokenizer_hash`: a vocabulary and special tokens."""

    def __init__(self, vocab: int, extra: str = ""):
        self.vocab = {f"t{i}{extra if i == 5 else ''}": i for i in range(vocab)}
        self.all_special_tokens = ["t0", "t1", "t2"]

    def get_vocab(self):
        return self.vocab


def train_tiny_drafter(target=None, steps: int = 60):
    """A tiny Llama target and a drafter trained for a few seconds on the target's own greedy
    continuations (SmoothL1 on features + 0.1 CE on the target's distribution)."""
    target = target if target is not None else make_tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(3, target.config.vocab_size, (16, 4), generator=g)
    with torch.no_grad():
        seqs = target.generate(starts, do_sample=False, max_new_tokens=44, min_new_tokens=44,
                               pad_token_id=0, attention_mask=torch.ones_like(starts))
        feats = target_forward(target, seqs).features  # (B, T, H)
        p = target.lm_head(feats[:, 1:]).softmax(-1)  # (B, T-1, V)
    d = EagleDrafter.random(target, seed=0)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(steps):
            f_hat = d(feats[:, :-1], seqs[:, 1:])  # [f_{t-1}; E(x_t)] -> f_t
            loss = F.smooth_l1_loss(f_hat, feats[:, 1:]) + 0.1 * F.cross_entropy(
                d.logits(f_hat).flatten(0, 1), p.flatten(0, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return target, d.eval().requires_grad_(False)
