"""Fill a fixed tree template with a draft model (EAGLE's drafter, a small LM, Medusa's heads).

Per round: one `catch_up` pass over the tokens committed since the last round gives the
root's next-token distribution; then one `step` pass per depth over that depth's nodes that
have children in the template, each on top of the draft model's committed KV plus the
temporary KV of its ancestors. The template's ranks are filled with the top-k of each
expanded node's distribution, or, under sampling with `proposal="sample"`, by drawing
without replacement. Either way each draft token's proposal `q` is recorded exactly: a
one-hot for a deterministic choice, the parent's distribution with earlier siblings
zeroed and renormalised for a draw. After verification the temporary KV is dropped.

A batch of sequences is drafted the same way, every pass over all of them at once when the
model can (`RowsDraftModel`: EAGLE's drafter, a draft LM, Medusa's heads), else by one fork
of the proposer per sequence.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from eagle.decoding.engine import DecodeState, DraftTree, Proposer
from eagle.sampling import invert_cdf
from eagle.tree import TreeTemplate

PROPOSALS = ("topk", "sample")


class TreeDraftModel(Protocol):
    """A draft model with its own KV cache over the committed context (possibly none).

    The "hidden output" of a node is whatever its children's `step` needs from it: EAGLE's
    predicted feature, nothing (None) for a small LM, the unused heads' logits for Medusa."""

    def reset(self, state: DecodeState) -> None:
        """Start a new sequence (the target has just read the prompt)."""

    def catch_up(self, state: DecodeState) -> tuple[Tensor, Tensor | None]:
        """Feed the committed tokens not yet in the cache (the root included).

        Returns: the root's next-token logits (V,) and its hidden output (H,) or None."""

    def step(self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor,
             visible: Tensor) -> tuple[Tensor, Tensor | None]:
        """Score n draft nodes (n,) on top of the committed cache; their KV is kept until
        `end_round`.

        `visible` (n, S) bool: which of this round's S branch entries (those of earlier steps,
        then these n nodes, in order after the committed cache) each node sees.
        Returns: logits (n, V) and hidden outputs (n, H) or None.

        A model with `needs_parent_tokens = True` also gets `parent_tokens` (n,), each node's
        parent's token (EAGLE's unshifted-input ablation)."""

    def end_round(self) -> None:
        """Drop the round's branch KV (verification is done)."""

    def fork(self) -> TreeDraftModel:
        """The same model (weights shared) with a cache of its own, for another sequence of a batch.
        """

    @property
    def dtype(self) -> torch.dtype: ...

    # Optional: a model drafting from a reduced vocabulary (`eagle.data.vocab`) has `draft_vocab`,
    # the token ids (K,) of its logits' K columns, and `vocab_size`, the target's V.


class RowsDraftModel(TreeDraftModel, Protocol):
    """A `TreeDraftModel` that can also draft for B sequences at once, one pass per depth for all
    of them (each sequence a row of its cache), when `batches_rows` is true."""

    batches_rows: bool

    def begin_rows(self, states: Sequence[DecodeState]) -> None:
        """Start a batch of sequences (the target has just read their prompts)."""

    def catch_up_rows(self, states: Sequence[DecodeState]) -> tuple[Tensor, Tensor | None]:
        """`catch_up` for every sequence: the roots' logits (B, V) and hidden outputs (B, ...) or
        None."""

    def step_rows(
        self, tokens: Tensor, parent_hidden: Tensor | None, position_ids: Tensor, visible: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """`step` for every sequence: tokens and positions (B, n), the same `visible` (n, S) in
        every row (one template). Returns logits (B, n, V) and hidden outputs (B, n, ...) or None.
        """

    def end_round_rows(self, keep: Sequence[int]) -> None:
        """Drop the round's branch KV; only the rows `keep` go on (the others finished)."""


class TemplateProposer(Proposer):
    """Draft a fixed template tree with any `TreeDraftModel`.

    Args:
        model: the draft model (EAGLE drafter, small LM or Medusa heads).
        template: the tree to fill; a node's number of children is the top-k it takes.
        proposal: under sampling, "sample" (children drawn without replacement from the
            draft distribution: accepted about as often as q resembles p) or "topk"
            (deterministic top-k, one-hot q: accepted only as often as p puts mass on those
            tokens, poor when p is flat). Greedy decoding always uses top-k.
    """

    def __init__(
        self,
        model: TreeDraftModel,
        template: TreeTemplate,
        proposal: str = "sample",
        name: str = "template",
    ):
        if proposal not in PROPOSALS:
            raise ValueError(f"unknown proposal {proposal!r}; choose one of {PROPOSALS}")
        if template.num_nodes == 0:
            raise ValueError(f"tree {template.name!r} has no draft nodes; use vanilla decoding")
        self.model, self.template, self.proposal, self.name = model, template, proposal, name
        self.pass_parent_tokens = bool(getattr(model, "needs_parent_tokens", False))
        self.max_nodes = template.num_nodes
        self.context = getattr(
            model, "context", None
        )  # a draft LM's positions (EAGLE's drafter: no limit)
        tree = template.structure
        self.parents = tree.parents
        ancestors = tree.ancestors()  # (N+1, N+1) bool
        # nodes with children, grouped by depth: only these need a draft forward
        self.expanded_by_depth = [
            [i for i in range(1, len(tree)) if tree.depths[i] == d and tree.children[i]]
            for d in range(tree.depth + 1)
        ]
        # what each depth's nodes see of the branch entries forwarded so far (theirs last)
        self.visible_by_depth, seen = [], []
        for nodes in self.expanded_by_depth:
            seen = seen + nodes
            self.visible_by_depth.append(
                ancestors[nodes][:, seen]
            )  # (m, len(seen)) ancestor-or-self
        # per depth d >= 1, everything the round needs as index tensors, built once: the level of
        # parents whose children are drawn (the root, then depth d-1's expanded nodes, in the
        # order of the previous pass's rows), each child's (row, rank) among them, and the row of
        # each expanded node's parent (whose predicted feature it is fed)
        self.levels: list[_Level | None] = [None]
        for d in range(1, tree.depth + 1):
            parents = [0] if d == 1 else self.expanded_by_depth[d - 1]
            kids, rows, ranks = [], [], []
            for j, u in enumerate(parents):
                for r, c in enumerate(template.children[u]):
                    kids.append(c)
                    rows.append(j)
                    ranks.append(r)
            row_of = {u: j for j, u in enumerate(parents)}
            nodes = self.expanded_by_depth[d] if d < tree.depth else []
            self.levels.append(
                _Level(
                    width=max(len(template.children[u]) for u in parents),
                    kids=torch.tensor(kids),
                    rows=torch.tensor(rows),
                    ranks=torch.tensor(ranks),
                    nodes=torch.tensor(nodes, dtype=torch.long),
                    parent_rows=torch.tensor(
                        [row_of[self.parents[v]] for v in nodes], dtype=torch.long
                    ),
                    parent_nodes=torch.tensor([self.parents[v] for v in nodes], dtype=torch.long),
                )
            )
        self.max_width = max(lv.width for lv in self.levels[1:])  # the most children of one node
        self._device = torch.device("cpu")
        self._root_nan = torch.tensor(False)  # the last round's root logits had a NaN

    def reset(self, state: DecodeState) -> None:
        self.model.reset(state)

    def fork(self) -> TemplateProposer:
        clone = copy.copy(self)  # the template's index tensors are shared: they are only read
        clone.__dict__.pop("_forks", None)
        clone.model = self.model.fork()
        return clone

    def accept(self, state: DecodeState, tree: DraftTree, path: list[int]) -> None:
        self._check_root()
        self.model.end_round()

    def _check_root(self) -> None:
        if bool(
            self._root_nan
        ):  # the round was still exact, but such drafts are never accepted: say why
            raise ValueError(
                f"{self.name}: the draft model's logits are NaN (a float16 drafter overflowing?)"
            )

    def _on(self, device: torch.device) -> None:
        """Move the fixed index tensors to the draft model's device (once: the template is fixed).
        """
        if device != self._device:
            self.visible_by_depth = [v.to(device) for v in self.visible_by_depth]
            self.levels = [None] + [lv.to(device) for lv in self.levels[1:]]
            self._device = device

    def propose(self, state: DecodeState) -> DraftTree:
        logits, hidden = self.model.catch_up(state)  # the root's (V,) and (H,) or None

        def step(
            tokens: Tensor,
            parent_hidden: Tensor | None,
            positions: Tensor,
            visible: Tensor,
            **extra,
        ):
            logits, hidden = self.model.step(
                tokens[0],
                None if parent_hidden is None else parent_hidden[0],
                positions[0],
                visible,
                **{k: v[0] for k, v in extra.items()},
            )
            return logits[None], None if hidden is None else hidden[
                None
            ]  # one sequence as a batch of one

        return self._draft([state], logits[None], None if hidden is None else hidden[None], step)[0]

    # A batch in one pass of the model per depth, when the model can (`RowsDraftModel`: EAGLE's
    # drafter, a draft LM); otherwise one fork per sequence (`Proposer`'s default).

    def _in_one_pass(self, n: int) -> bool:
        return n > 1 and getattr(self.model, "batches_rows", False)

    def reset_batch(self, states: Sequence[DecodeState]) -> None:
        self._one_pass = self._in_one_pass(len(states))
        if not self._one_pass:
            return super().reset_batch(states)
        self.model.begin_rows(states)

    def propose_batch(self, states: Sequence[DecodeState]) -> list[DraftTree]:
        if not self._one_pass:
            return super().propose_batch(states)
        logits, hidden = self.model.catch_up_rows(states)  # (B, V), (B, H)
        return self._draft(states, logits, hidden, self.model.step_rows)

    def accept_batch(
        self,
        states: Sequence[DecodeState],
        trees: Sequence[DraftTree],
        paths: Sequence[list[int]],
        keep: Sequence[int],
    ) -> None:
        if not self._one_pass:
            return super().accept_batch(states, trees, paths, keep)
        self._check_root()
        self.model.end_round_rows(keep)

    def _draft(
        self, states: Sequence[DecodeState], logits: Tensor, hidden: Tensor | None, step
    ) -> list[DraftTree]:
        """Fill the template for B sequences at once, from each root's draft logits (B, V) and
        hidden output (B, ...) or None; `step(tokens (B, m), parent_hidden (B, m, ...) | None,
        positions (B, m), visible (m, S)[, parent_tokens=(B, m)])` scores a depth's expanded nodes
        of every sequence, returning logits (B, m, V) and hidden outputs (B, m, ...) or None."""
        tpl, model, policy = self.template, self.model, states[0].policy
        self._root_nan = (
            logits.isnan().any()
        )  # read in `accept`, once the round's work is done (no extra sync)
        device = logits.device
        self._on(device)
        b = len(states)
        logits = logits[
            :, None
        ]  # (B, 1, V): per sequence, one row per parent of the level being drawn
        hidden = None if hidden is None else hidden[:, None]
        root_pos = torch.tensor([len(s.tokens) - 1 for s in states], device=device)  # (B,)
        n = tpl.num_nodes + 1
        tokens = torch.empty(b, n, dtype=torch.long, device=device)
        tokens[:, 0] = torch.tensor([s.tokens[-1] for s in states], device=device)
        vocab = getattr(model, "draft_vocab", None)  # (K,) ids of the logits' columns; None: all V
        if vocab is not None and len(vocab) < self.max_width:
            raise ValueError(
                f"tree {tpl.name!r} takes the top {self.max_width} of a node, more than the "
                f"{len(vocab)} tokens of the draft vocabulary"
            )
        if logits.shape[-1] < self.max_width:
            raise ValueError(
                f"tree {tpl.name!r} takes the top {self.max_width} of a node, more than the draft "
                f"model's vocabulary of {logits.shape[-1]} tokens"
            )
        q = (
            None if policy.greedy else torch.zeros(b, n, logits.shape[-1], device=device)
        )  # over the columns
        for depth in range(1, tpl.depth + 1):
            level = self.levels[depth]
            picks, q_picks = self._choose(
                logits, level.width, states[0]
            )  # (B, p, width), (B, p, width, V|K) | None
            picks = picks[:, level.rows, level.ranks]  # (B, c) columns
            tokens[:, level.kids] = picks if vocab is None else vocab[picks]
            if q is not None:
                q[:, level.kids] = q_picks[:, level.rows, level.ranks]
            if not level.nodes.numel():
                break  # nothing expands below this depth
            parent_hidden = None if hidden is None else hidden[:, level.parent_rows]  # (B, m, H)
            pos = (root_pos + depth)[:, None].expand(b, len(level.nodes))  # (B, m)
            extra = (
                {"parent_tokens": tokens[:, level.parent_nodes]} if self.pass_parent_tokens else {}
            )
            logits, hidden = step(
                tokens[:, level.nodes], parent_hidden, pos, self.visible_by_depth[depth], **extra
            )
        if (
            q is not None and vocab is not None
        ):  # q over the whole vocabulary, zero off the K tokens
            q = q.new_zeros(b, n, model.vocab_size).index_copy_(2, vocab, q)
        return [
            DraftTree(tokens=tokens[i, 1:], parents=self.parents, q=None if q is None else q[i, 1:])
            for i in range(b)
        ]

    def _choose(self, logits: Tensor, m: int, state: DecodeState) -> tuple[Tensor, Tensor | None]:
        """Pick m children for each row of `logits` (..., V) at once; returns tokens (..., m) and
        their q (..., m, V) (None under greedy decoding)."""
        policy = state.policy
        if policy.greedy:
            return logits.topk(m, dim=-1).indices, None
        dist = policy.probs(logits.float())  # (p, V) the draft model's q at each parent
        if self.proposal == "topk":
            picks = dist.topk(m, dim=-1).indices
            return picks, torch.nn.functional.one_hot(picks, dist.shape[-1]).to(dist)
        return sample_without_replacement(dist, m, state.generator)


def pass_slack(shape: tuple[int, int] | None) -> int:
    """Entries a draft cache needs past its sequence for passes padded to `shape` (rows, window):
    a padded pass writes `rows` entries wherever its nodes start, so on a deep, narrow tree the
    last depth's padding runs up to rows - 1 entries past what the sequence itself needs."""
    return shape[0] if shape else 0


def fit_pass(
    cache, shape: tuple[int, int] | None, visible: Tensor, start: int, write_at: int
) -> Tensor | None:
    """Reserve `cache` for one drafter pass whose n nodes are written from `write_at` and see what
    `visible` (n, S) allows of the S entries from `start`, and return that visibility padded to
    `shape` (rows, window), the one shape a compiled pass runs; None where there is no shape or
    the pass does not fit it (a long prompt's catch-up), which then runs as it is. Padding rows
    see nothing of the branch and write past this pass's entries, where later passes overwrite
    them (EagleDraftModel, DraftLM)."""
    n, s = visible.shape
    rows, window = shape or (0, 0)
    if n > rows or s > window:
        cache.reserve(write_at + n)
        return None
    cache.reserve(max(write_at + rows, start + window))
    padded = torch.zeros(rows, window, dtype=torch.bool, device=visible.device)
    padded[:n, :s] = visible
    return padded


def pad_with_first(t: Tensor, rows: int, dim: int) -> Tensor:
    """`t` padded along `dim` to `rows` entries with copies of its first one."""
    first = t.narrow(dim, 0, 1)
    return torch.cat(
        [t, first.expand(*t.shape[:dim], rows - t.shape[dim], *t.shape[dim + 1 :])], dim
    )


@dataclass(frozen=True)
class _Level:
    """Index tensors of one depth of a template (see `TemplateProposer.__init__`)."""

    width: int  # the most children of one parent at this level: the top-k / draws per row
    kids: Tensor  # (c,) the children's node ids
    rows: Tensor  # (c,) each child's parent's row in the level
    ranks: Tensor  # (c,) each child's rank among its siblings
    nodes: Tensor  # (m,) this depth's expanded nodes (fed to the next pass), in row order
    parent_rows: Tensor  # (m,) the row of each expanded node's parent in the level
    parent_nodes: Tensor  # (m,) each expanded node's parent's node id (0: the root)

    def to(self, device: torch.device) -> _Level:
        return _Level(
            self.width,
            *(
                getattr(self, f).to(device)
                for f in ("kids", "rows", "ranks", "nodes", "parent_rows", "parent_nodes")
            ),
        )


def sample_without_replacement(
    dist: Tensor, m: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """m successive draws without replacement from each row of `dist` (..., V), and the exact q of
    each.

    Draw i comes from `dist` with draws 0..i-1 zeroed and renormalised, and that row is its
    proposal q. Each draw inverts the rows' float64 CDFs at once (`eagle.sampling.invert_cdf`):
    m cumulative sums and m uniforms per row, where Gumbel-top-k (Kool et al., 2019) needs V
    float64 uniforms and logs per row, 25x slower on a CPU at V = 8k. Once a row's support is
    exhausted its remaining picks are deterministic (the lowest ids not drawn yet), so their q
    is a one-hot.

    Returns:
        picks (..., m) long and q (..., m, V) in dist's dtype.
    """
    vocab = dist.shape[-1]
    if m > vocab:
        raise ValueError(f"cannot draw {m} distinct tokens from a vocabulary of {vocab}")
    w = dist.to(torch.float64, copy=True)  # (..., V) what is left to draw from
    picks, qs = [], []
    for _ in range(m):
        cdf = w.cumsum(-1)  # (..., V)
        total = cdf[..., -1:]  # (..., 1); 0 once the support is exhausted
        pick = invert_cdf(cdf, generator)  # (...,); vocab where exhausted
        picks.append(pick)
        qs.append(w / total.clamp_min(torch.finfo(torch.float64).tiny))  # all zero where exhausted
        w.scatter_(-1, pick.clamp_max(vocab - 1)[..., None], 0.0)
    picks, q = torch.stack(picks, -1), torch.stack(qs, -2).to(dist.dtype)  # (..., m), (..., m, V)
    exhausted = picks == vocab
    if bool(exhausted.any()):  # rare (top-k / top-p policies with few tokens): fill in Python
        flat_picks, flat_q = picks.view(-1, m), q.view(-1, m, vocab)
        for row in exhausted.view(-1, m).any(-1).nonzero()[:, 0].tolist():
            drawn = set(flat_picks[row][flat_picks[row] < vocab].tolist())
            free = (t for t in range(vocab) if t not in drawn)
            for i in (flat_picks[row] == vocab).nonzero()[:, 0].tolist():
                flat_picks[row, i] = token = next(free)
                flat_q[row, i] = torch.nn.functional.one_hot(torch.tensor(token), vocab).to(q)
    return picks, q
