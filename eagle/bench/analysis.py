"""Where a drafter's features go wrong: the computations behind notebooks/feature_error.ipynb.

Two views of one drafter:

* Offline, on dumped features (`depth_profile`): feed the drafter its own predicted
  features for d = 1..D chained steps (`eagle.metrics.unroll`) and measure, at each depth,
  how far `f_hat` is from the target's true feature `f` (L1 per element, cosine) and how
  often the target's greedy token is in the drafter's top-k. Error that piles up along a
  draft is what makes deep tree nodes rarely accepted; EAGLE-1's input noise is meant to
  slow that pile-up.
* Online, from a benchmark's results.json (`tree_acceptance`): how often each node of the
  draft tree, and each depth, was on the accepted path while really decoding.

Everything here is plain tensor / dict code (no plotting), so it is unit-tested; the
notebook only calls it and draws.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle.data.batches import collate, shift_batch
from eagle.training import metrics
from eagle.tree import Tree

Step = Callable[
    [Tensor, Tensor, Tensor], Tensor
]  # (features, input_ids, prev_ids) -> f_hat (B, T, H)


@dataclass
class DepthProfile:
    """Feature error and agreement at draft depths 1..D (index d-1 holds depth d).

    Means are over the positions counted at that depth (`counts`): trained positions
    (loss mask) whose depth-d unroll rests on d predicted steps (`eagle.metrics.depth_mask`).
    """

    l1: list[float]  # mean |f_hat - f| per hidden element
    cosine: list[float]  # mean cos(f_hat, f)
    agreement: dict[int, list[float]]  # k -> share of positions with the target's argmax in top-k
    counts: list[int]  # positions counted at each depth
    feature_scale: float = 0.0  # mean |f| per element of the true features (scale for l1)

    @property
    def depths(self) -> list[int]:
        return list(range(1, len(self.l1) + 1))

    def stderr(self, k: int = 1) -> list[float]:
        """Binomial standard error of the top-k agreement at each depth, sqrt(a(1-a)/n): two
        drafters whose agreements differ by less than about twice this are not told apart
        (positions of one sample are correlated, so it is, if anything, optimistic)."""
        return [math.sqrt(a * (1 - a) / max(n, 1)) for a, n in zip(self.agreement[k], self.counts)]

    def rows(self) -> list[dict[str, float]]:
        """One dict per depth, for a table."""
        out = []
        for i, d in enumerate(self.depths):
            row = {
                "depth": d,
                "l1": self.l1[i],
                "cosine": self.cosine[i],
                "positions": self.counts[i],
            }
            row |= {f"top{k}": v[i] for k, v in sorted(self.agreement.items())}
            out.append(row)
        return out


@dataclass
class _Sums:
    depth: int
    ks: Sequence[int]
    l1: list[float] = field(init=False)
    cos: list[float] = field(init=False)
    hits: dict[int, list[float]] = field(init=False)
    count: list[float] = field(init=False)
    scale: float = 0.0
    scale_count: float = 0.0

    def __post_init__(self) -> None:
        self.l1, self.cos, self.count = [0.0] * self.depth, [0.0] * self.depth, [0.0] * self.depth
        self.hits = {k: [0.0] * self.depth for k in self.ks}


@torch.no_grad()
def depth_profile(
    step: Step,
    head: Callable[[Tensor], Tensor],
    batches: Iterable[Mapping[str, Tensor]],
    depth: int = 5,
    ks: Sequence[int] = (1, 4),
) -> DepthProfile:
    """Feature error and top-k agreement of a drafter fed its own features, by depth.

    Args:
        step: the drafter as `step(features_in, input_ids, prev_ids) -> f_hat` with causal
            attention (`lambda f, x, p: drafter(f, x, prev_ids=p)`); input position t holds
            (f_{t-1}, x_t, x_{t-1}).
        head: the target's LM head, features (..., H) -> logits (..., V).
        batches: dicts with `input_ids` (B, T), `features` (B, T, H) and `loss_mask` (B, T),
            as `eagle.data.batches.collate` builds them from a feature dump.
        depth: deepest draft step D.
        ks: the k of each top-k agreement.
    """
    sums = _Sums(depth, tuple(ks))
    for batch in batches:
        v = shift_batch(batch["input_ids"], batch["features"].float(), batch["loss_mask"])
        target = v["target"]  # (B, T-1, H) f_t
        w = v["weight"]  # (B, T-1)
        labels = metrics.head_argmax(head, target, w)  # (B, T-1) the target's greedy next tokens
        sums.scale += float((target.abs().mean(-1) * w).sum())
        sums.scale_count += float(w.sum())
        for i, f_hat in enumerate(
            metrics.unroll(step, v["features_in"], v["input_ids"], v["prev_ids"], depth)
        ):
            f_hat = f_hat.float()
            m = metrics.depth_mask(w, i + 1)  # (B, T-1)
            l1 = (f_hat - target).abs().mean(-1)  # (B, T-1)
            cos = F.cosine_similarity(f_hat, target, dim=-1)  # (B, T-1)
            sums.l1[i] += float((l1 * m).sum())
            sums.cos[i] += float((cos * m).sum())
            sums.count[i] += float(m.sum())
            for k, (hits, _) in metrics.head_hits(head, f_hat, labels, m, sums.ks).items():
                sums.hits[k][i] += float(hits)
    if not any(sums.count):
        raise ValueError("no trained positions in the batches: nothing to measure")
    n = [max(c, 1.0) for c in sums.count]
    return DepthProfile(
        l1=[s / c for s, c in zip(sums.l1, n)],
        cosine=[s / c for s, c in zip(sums.cos, n)],
        agreement={k: [s / c for s, c in zip(h, n)] for k, h in sums.hits.items()},
        counts=[int(c) for c in sums.count],
        feature_scale=sums.scale / max(sums.scale_count, 1.0),
    )


def feature_batches(
    samples: Sequence[Mapping[str, Tensor]], max_samples: int | None = None, batch_size: int = 8
) -> list[dict[str, Tensor]]:
    """Right-padded batches of the first `max_samples` samples of a feature split
    (`eagle.data.features.FeatureShards`), as the drafter was trained on them."""
    n = len(samples) if max_samples is None else min(max_samples, len(samples))
    return [
        collate([samples[i] for i in range(s, min(s + batch_size, n))])
        for s in range(0, n, batch_size)
    ]


def drafter_profile(
    drafter,
    samples: Sequence[Mapping[str, Tensor]],
    depth: int = 5,
    ks: Sequence[int] = (1, 4),
    max_samples: int | None = None,
    batch_size: int = 8,
) -> DepthProfile:
    """`depth_profile` of an `eagle.models.drafter.EagleDrafter` on a feature split (float32)."""
    drafter = drafter.float().eval()
    return depth_profile(
        lambda f, x, p: drafter(f, x, prev_ids=p),
        drafter.logits,
        feature_batches(samples, max_samples, batch_size),
        depth,
        ks,
    )


# ---------------------------------------------------------------------------- benchmark


def conditional_acceptance(parents: Sequence[int], by_node: Sequence[float]) -> list[float | None]:
    """P(node on the accepted path | its parent is): the node's own acceptance once its
    branch survived. None for the root and for nodes whose parent was never accepted."""
    out: list[float | None] = [None] * len(parents)
    for i, p in enumerate(parents):
        if p >= 0 and by_node[p] > 0:
            out[i] = by_node[i] / by_node[p]
    return out


def tree_layout(parents: Sequence[int]) -> tuple[list[float], list[int]]:
    """(x, depth) coordinates to draw a tree: leaves left to right in depth-first order,
    each inner node centred over its children."""
    tree = Tree.of(parents)
    children = tree.children
    x = [0.0] * len(parents)
    next_leaf = [0]

    def place(node: int) -> None:
        if not children[node]:
            x[node] = float(next_leaf[0])
            next_leaf[0] += 1
            return
        for c in children[node]:
            place(c)
        x[node] = sum(x[c] for c in children[node]) / len(children[node])

    place(0)
    return x, list(tree.depths)


@dataclass
class TreeAcceptance:
    """One benchmark run's acceptance for a tree method."""

    eval_set: str
    temperature: float
    method: str
    tau: float
    by_depth: list[float]  # P(accepted length >= d), d = 1..
    parents: list[int] | None = None
    by_node: list[float] | None = None  # P(node i on the accepted path), i = 0..N
    depths: list[int] | None = None

    @property
    def conditional(self) -> list[float | None] | None:
        if self.parents is None or self.by_node is None:
            return None
        return conditional_acceptance(self.parents, self.by_node)


def tree_acceptance(report: Mapping[str, Any], method: str = "eagle") -> list[TreeAcceptance]:
    """Acceptance by depth and by tree node of `method`, for every run of a benchmark report
    (results.json) that has it."""
    out = []
    for run in report["runs"]:
        m = run["methods"].get(method)
        if m is None:
            continue
        parents, by_node = m.get("tree_parents"), m.get("acceptance_by_node")
        out.append(
            TreeAcceptance(
                eval_set=run["eval_set"],
                temperature=float(run["temperature"]),
                method=method,
                tau=float(m["tau"]),
                by_depth=list(m["acceptance_by_depth"]),
                parents=parents,
                by_node=by_node,
                depths=list(Tree.of(parents).depths) if parents else None,
            )
        )
    if not out:
        raise ValueError(f"the benchmark report has no {method!r} runs")
    return out


def latest_report(bench_dir: str | Path, method: str = "eagle") -> Path:
    """The newest finished results.json under `bench_dir` that has per-node acceptance for
    `method` (a benchmark that was stopped says `"status": "incomplete"` and is passed over)."""
    candidates = sorted(
        Path(bench_dir).glob("*/results.json"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for path in candidates:
        report = json.loads(path.read_text())
        runs = report.get("runs", []) if report.get("status", "complete") == "complete" else []
        if any(run["methods"].get(method, {}).get("acceptance_by_node") for run in runs):
            return path
    raise FileNotFoundError(
        f"no benchmark under {bench_dir} with per-node acceptance for {method!r}: "
        f"run `python decode.py mode=benchmark` (methods including {method})"
    )
