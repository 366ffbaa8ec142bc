"""How well a drafter predicts its target: losses and agreement, as pure tensor functions.

Shapes: features (B, T, H), logits (B, T, V), mask (B, T) with 1 on the positions that count.
Position t of these tensors is one drafter output `f_hat_t` and its target `f_t` (the
target's feature at the same position, whose LM head gives the target's next token).

*Agreement at depth d* (top-k): the share of counted positions where the target's greedy
next token `argmax lm_head(f_t)` is among the top-k of the drafter's `lm_head(f_hat_t)`,
when the drafter reached `f_hat_t` through d chained steps. Depth 1 feeds the true features
f_{t-1}; depth d feeds, at every position, the drafter's own depth d-1 predictions shifted
by one (`unroll`), with the data's tokens. Unlike real drafting, where only the last d-1
features of a branch are predicted and the committed context keeps the target's true
features, here the attention context also sees predicted features: the numbers are a
pessimistic estimate of what the drafter achieves inside a tree. Top-1 agreement at
depth 1 is the chance that a greedy chain accepts the first draft token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle.sampling import argmax


def masked_sum_count(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of values where mask, number of such positions); values and mask are (B, T)."""
    m = mask.to(values.dtype)
    return (values * m).sum(), m.sum()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of (B, T) values over the masked positions (0 when there are none)."""
    total, count = masked_sum_count(values, mask)
    return total / count.clamp_min(1.0)


def feature_error(f_hat: Tensor, f: Tensor, beta: float = 1.0) -> Tensor:
    """Per-position SmoothL1 (Huber with `beta`) between predicted and true features,
    averaged over the hidden dimension: (B, T, H) x 2 -> (B, T)."""
    return F.smooth_l1_loss(f_hat.float(), f.float(), reduction="none", beta=beta).mean(-1)


def feature_loss(f_hat: Tensor, f: Tensor, mask: Tensor, beta: float = 1.0) -> Tensor:
    """EAGLE's regression loss: masked mean of `feature_error`."""
    return masked_mean(feature_error(f_hat, f, beta), mask)


def soft_cross_entropy(draft_logits: Tensor, target_logits: Tensor) -> Tensor:
    """Per-position cross-entropy of the drafter's distribution against the target's full
    distribution, `-sum_v p(v) log q(v)` with p = softmax(target), q = softmax(draft):
    (B, T, V) x 2 -> (B, T). Equals KL(p || q) + H(p): minimal where q = p."""
    p = torch.softmax(target_logits.float(), dim=-1)
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    return -(p * log_q).sum(-1)


def token_loss(draft_logits: Tensor, target_logits: Tensor, mask: Tensor) -> Tensor:
    """EAGLE's classification loss: masked mean of `soft_cross_entropy`."""
    return masked_mean(soft_cross_entropy(draft_logits, target_logits), mask)


def label_hits(logits: Tensor, labels: Tensor, k: int = 1) -> Tensor:
    """(B, T) bool: the token `labels` (B, T) is among the top-k of `logits` (B, T, V): fewer
    than k tokens score strictly higher (a tie with the k-th counts as a hit), which is the
    k-th largest logit being <= the label's. k = 1 compares argmaxes, as greedy acceptance
    does. `torch.topk` for k > 1: on a CPU with a 49,152-token vocabulary it costs a quarter of
    counting the higher logits (a bool (B, T, V) tensor, then its sum)."""
    k = min(k, logits.shape[-1])
    if k == 1:
        return argmax(logits) == labels
    score = logits.gather(-1, labels[..., None])  # (B, T, 1)
    return (logits.topk(k, dim=-1).values[..., -1:] <= score).squeeze(-1)


def topk_hits(draft_logits: Tensor, target_logits: Tensor, k: int = 1) -> Tensor:
    """(B, T) bool: the target's argmax token is among the drafter's top-k (k = 1 compares
    argmaxes)."""
    return label_hits(draft_logits, argmax(target_logits), k)


def agreement(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, k: int = 1) -> Tensor:
    """Share of masked positions whose target argmax is in the drafter's top-k."""
    return masked_mean(topk_hits(draft_logits, target_logits, k).float(), mask)


def unroll(step: Callable[[Tensor, Tensor, Tensor], Tensor], features: Tensor, input_ids: Tensor,
           prev_ids: Tensor, depth: int) -> list[Tensor]:
    """The drafter's predictions when fed its own features, depth 1 to `depth`.

    Args:
        step: the drafter, `step(features (B, T, H), input_ids (B, T), prev_ids (B, T)) -> f_hat
            (B, T, H)` with causal attention; input position t holds (f_{t-1}, x_t, x_{t-1}).
        features: (B, T, H) the true input features f_{t-1}.
        input_ids: (B, T) the tokens x_t (the data's, at every depth).
        prev_ids: (B, T) the tokens x_{t-1} (the data's; an unshifted-input drafter reads them).
        depth: number of chained steps.
    Returns:
        `depth` tensors (B, T, H); entry d-1 is the depth-d prediction of f_t. At depth d the
        input at t is the depth d-1 prediction at t-1 (position 0 keeps its true feature:
        nothing predicts it), so the depth-d prediction at t rests on true features at
        t-d and earlier only. Positions t < d-1 are shallower; see `depth_mask`.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    outs = [step(features, input_ids, prev_ids)]
    for _ in range(depth - 1):
        fed = torch.cat([features[:, :1], outs[-1][:, :-1]], dim=1)  # (B, T, H) shifted by one
        outs.append(step(fed, input_ids, prev_ids))
    return outs


def depth_mask(mask: Tensor, depth: int) -> Tensor:
    """Mask without the first depth-1 positions, where a depth-`depth` unroll bottoms out at
    the true first feature before using `depth` predicted steps."""
    out = mask.clone()
    out[:, : depth - 1] = 0
    return out


def _scored_rows(mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The positions where `mask` (B, T) is non-zero, flattened: (N,) float weights, then each
    of `tensors` (B, T, ...) as (N, ...)."""
    keep = mask.reshape(-1) != 0
    flat = tuple(t.reshape(-1, *t.shape[2:])[keep] for t in tensors)
    return (mask.reshape(-1)[keep].float(), *flat)


def head_argmax(
    head: Callable[[Tensor], Tensor], features: Tensor, mask: Tensor, rows: int = 1024
) -> Tensor:
    """(B, T) long: argmax of head(features) (B, T, H) at the positions where `mask` is
    non-zero, -1 elsewhere. The head runs on those rows only, `rows` at a time: padding costs
    nothing and no (B, T, V) logits tensor is held (gigabytes for one batch of long
    conversations on a 49,152-token vocabulary)."""
    idx = (mask.reshape(-1) != 0).nonzero().squeeze(-1)  # (N,)
    flat = features.reshape(-1, features.shape[-1])  # (B * T, H)
    out = torch.full((flat.shape[0],), -1, dtype=torch.long, device=features.device)
    for s in range(0, len(idx), rows):
        out[idx[s : s + rows]] = argmax(head(flat[idx[s : s + rows]]))
    return out.view(mask.shape)


def head_hits(
    head: Callable[[Tensor], Tensor],
    features: Tensor,
    labels: Tensor,
    mask: Tensor,
    ks: Sequence[int] = (1,),
    rows: int = 1024,
) -> dict[int, tuple[Tensor, Tensor]]:
    """{k: (hits, count)}: the sum of `mask` (B, T) over the positions whose `labels` token is
    among the top-k of head(features) (`label_hits`), and the sum of `mask`. As `head_argmax`,
    the head runs on the masked rows only, `rows` at a time."""
    w, f, y = _scored_rows(mask, features, labels)
    hits = {k: w.new_zeros(()) for k in ks}
    for s in range(0, len(w), rows):
        logits = head(f[s : s + rows])  # (rows, V)
        for k in ks:
            hits[k] = (
                hits[k] + (label_hits(logits, y[s : s + rows], k).float() * w[s : s + rows]).sum()
            )
    return {k: (h, w.sum()) for k, h in hits.items()}


def agreement_by_depth(
    step: Callable[[Tensor, Tensor, Tensor], Tensor],
    head: Callable[[Tensor], Tensor],
    features: Tensor,
    input_ids: Tensor,
    prev_ids: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    depth: int = 5,
    ks: Sequence[int] = (1,),
) -> dict[tuple[int, int], tuple[Tensor, Tensor]]:
    """Hits and counts of top-k agreement at depths 1..depth: {(d, k): (hits, count)}.

    `head` maps features to logits (the target's LM head). Sums and counts (not means) so
    that a validation epoch can add them up exactly."""
    out = {}
    labels = argmax(target_logits)  # (B, T) once: an argmax over V costs as much as a head on a CPU
    for d, f_hat in enumerate(unroll(step, features, input_ids, prev_ids, depth), start=1):
        for k, hits_count in head_hits(head, f_hat, labels, depth_mask(mask, d), ks).items():
            out[(d, k)] = hits_count
    return out
