"""Choose a static draft tree from measured acceptance instead of by guesswork.

Under greedy decoding whether a tree node is accepted depends only on its own path: the
drafter's top-k ranks along it and the target's argmaxes (at most one child of a node can
match the argmax). So from a given context, any subtree of a large probe tree accepts
exactly the longest prefix of the probe's accepted path that it kept.

`position_paths` runs one probe round from EVERY position of the greedy text (not only
where the probe's own rounds started: those sit right after the hard tokens that ended the
previous round, the easiest places to draft from, and predicting a small tree from them
overestimated its tau by up to 1.3 tokens, LOG.md). From those paths:

* `acceptance_by_position` gives each node's share of positions where it is accepted, and
  `best_subtree` keeps the N nodes with the largest total (a tree's tokens per round,
  averaged over positions rather than over its own rounds);
* `simulate` replays a decode with any subtree over the same text: rounds start where the
  previous one ended, exactly as in the engine, so the tau it returns is the tau that
  decoding with that subtree measures (identical in float32, where every tree produces
  the same text; a bf16 verification of another shape may round a near-tie differently);
* `replay` with `chain_hits` does the same with a chain merged into each round's tree
  (`eagle_lookup`: prompt lookup's chain, which reads only the tokens), and `choose_merged`
  ranks the candidates for that merge.

Which N is best depends on what a wider verification and a deeper draft cost on the
machine: `RoundCost` models a round's time from rounds measured on a few trees (verification
by tokens verified, drafting by passes and rows; `MachineCost`, one model per dtype where trees
decode in different ones), `choose_for_machine` ranks the candidates
by predicted tau x vanilla step / round time, and `eagle.bench.machine_tree.search_tree` writes the
winner as `machine.yaml` and benchmarks the candidates to check the prediction. At temperature > 0
siblings interact through the residual distribution: the greedy-optimal shape is a good
guess there, not a proof, and a wide greedy pick can lose; `tree_search.sampled_temperature`
ranks the candidates by decoding them at that temperature instead (`machine_t<T>.yaml`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from eagle.tree import TreeError, TreeTemplate

RankPathT = tuple[tuple[int, ...], ...]  # an accepted path as child-rank paths, root excluded
ChainHitT = tuple[int, int]  # a chain drafted at one position: (its length, its tokens accepted)


@dataclass
class Candidate:
    tree: TreeTemplate
    predicted_tau: float  # `candidates`: simulated decode over the probed texts (`simulate`);
                          # `best_subtree` alone: 1 + its nodes' acceptance per position


def position_paths(
    generate: Callable[[list[int], int], list[int]],
    probe: TreeTemplate,
    prompt: list[int],
    text: list[int],
) -> list[RankPathT]:
    """The probe's accepted path from every position of a greedy text.

    Args:
        generate: `generate(ids, max_new_tokens) -> accepted node indices of the FIRST round`
            of a greedy decode with `probe` (its prefill emits the next token, the root).
        prompt: prompt token ids; text: the greedy continuation decoded from it.
    Returns:
        entry t: the rank paths accepted in a round whose root is text[t] (t < len(text) - 1).
    """
    out = []
    for t in range(len(text) - 1):
        # A budget of 2 new tokens ends the decode after its first round: the round's accepted
        # path is recorded whole even though only its first token is committed, and the rounds a
        # longer budget would add cost a probe verification each (several per position, LOG.md)
        path = generate(prompt + text[:t], 2)
        out.append(tuple(probe.paths[i - 1] for i in path[1:]))
    return out


def acceptance_by_position(
    probe: TreeTemplate, paths: Sequence[Sequence[RankPathT]]
) -> list[float]:
    """Share of probed positions (all texts) at which each probe node is accepted; root = 1."""
    index = {p: i for i, p in enumerate(probe.paths, start=1)}
    hits, n = [0] * (probe.num_nodes + 1), 0
    for text_paths in paths:
        for path in text_paths:
            n += 1
            hits[0] += 1
            for p in path:
                hits[index[p]] += 1
    return [h / max(n, 1) for h in hits]


def replay(
    paths: Sequence[Sequence[RankPathT]],
    tree: TreeTemplate,
    max_new_tokens: int,
    chains: Sequence[Sequence[ChainHitT]] | None = None,
) -> list[tuple[int, int]]:
    """The rounds of greedy decoding with `tree` over the probed texts, replayed, as (tokens
    committed, tokens verified) per round: each round accepts the longest prefix of the probe's
    path at its root that `tree` holds, plus one token, cut at max_new_tokens (and at the text's
    end, where EOS stopped it), and the next round's root is the token after that.

    `chains` (`chain_hits`, per text): a chain merged into the tree each round by shared prefix
    (`eagle_lookup`: prompt lookup's chain beside EAGLE's tree). Every path of the merged tree is
    a prefix of a tree path or of the chain, so the round accepts the longer of the two accepted
    prefixes, exactly. Its size is counted with the chain's tokens past the shared accepted
    prefix as new nodes: a chain token that equals a rejected tree node shares it in the engine,
    so the count is an upper bound (`tests/test_tree_search.py` checks both)."""
    kept = set(tree.paths)
    rounds = []
    for i, text_paths in enumerate(paths):
        length = min(len(text_paths) + 1, max_new_tokens)  # tokens of this text
        t = 0  # index of the current root in the text (the prefill committed token 0)
        while t + 1 < length:
            accepted = 0
            for p in text_paths[t]:
                if p not in kept:
                    break
                accepted += 1
            verified = 1 + tree.num_nodes  # the root and the tree
            if chains is not None:
                chain_len, chain_accepted = chains[i][t]
                verified += chain_len - min(accepted, chain_accepted)
                accepted = max(accepted, chain_accepted)
            step = min(accepted + 1, length - 1 - t)
            rounds.append((step, verified))
            t += step
    return rounds


def simulate(
    paths: Sequence[Sequence[RankPathT]],
    tree: TreeTemplate,
    max_new_tokens: int,
    chains: Sequence[Sequence[ChainHitT]] | None = None,
) -> float:
    """tau (tokens committed per round after the prefill) of greedy decoding with `tree` (and
    `chains` merged into it) over the probed texts: `replay`'s rounds."""
    rounds = replay(paths, tree, max_new_tokens, chains)
    return sum(step for step, _ in rounds) / max(len(rounds), 1)


def chain_hits(
    lookup: Callable[[list[int]], list[int]], prompt: list[int], text: list[int]
) -> list[ChainHitT]:
    """What a drafter that reads only the tokens (prompt lookup's `lookup`) proposes from every
    position of a greedy text: entry t, (the chain's length, how many of its tokens the text goes
    on with) in a round whose root is text[t], i.e. from the tokens prompt + text[:t + 1]; the
    entries line up with `position_paths`'."""
    out = []
    for t in range(len(text) - 1):
        chain = lookup(prompt + text[: t + 1])
        accepted = 0
        for token, following in zip(chain, text[t + 1 :]):
            if token != following:
                break
            accepted += 1
        out.append((len(chain), accepted))
    return out


def best_subtree(
    probe: TreeTemplate, by_node: Sequence[float], size: int, name: str | None = None
) -> Candidate:
    """The `size`-node subtree of `probe` with the largest total acceptance (its tokens per
    round at an average position: `predicted_tau` of the returned candidate).

    A template may only hold rank r under a parent if it holds ranks 0..r-1 too, so a node
    becomes eligible once its parent and its previous sibling are kept; the most accepted
    eligible node is added until `size` nodes are kept. Acceptance never grows from parent
    to child, which makes this greedy choice optimal whenever it also does not grow from a
    sibling to the next one (the usual case; a drafter whose second choice beats its first
    at some node may leave a little on the table).

    Args:
        probe: the tree the acceptance was measured on.
        by_node: P(node on the accepted path) for nodes 0..N of `probe` (node 0 = root), e.g.
            `acceptance_by_position`.
        size: draft nodes to keep (at most the probe's).
    """
    if len(by_node) != probe.num_nodes + 1:
        raise TreeError(
            f"{len(by_node)} acceptance values for the {probe.num_nodes + 1} nodes of {probe.name}"
        )
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= probe.num_nodes:
        raise TreeError(f"subtree size must be in 1..{probe.num_nodes}, got {size!r}")
    kept = {0}
    eligible = {c for c in probe.children[0] if probe.ranks[c] == 0}
    while len(kept) < size + 1:
        node = max(eligible, key=lambda i: (by_node[i], -i))  # ties: shallower / lower rank first
        eligible.remove(node)
        kept.add(node)
        siblings = probe.children[probe.parents[node]]
        nxt = siblings.index(node) + 1
        if nxt < len(siblings):
            eligible.add(siblings[nxt])
        eligible.update(c for c in probe.children[node] if probe.ranks[c] == 0)
    paths = [probe.paths[i - 1] for i in sorted(kept) if i > 0]
    per_round = 1.0 + sum(
        by_node[i] for i in kept if i > 0
    )  # tokens per round at an average position
    return Candidate(TreeTemplate.from_paths(paths, name or f"best{size}"), per_round)


def candidates(
    probe: TreeTemplate,
    paths: Sequence[Sequence[RankPathT]],
    sizes: Sequence[int],
    max_new_tokens: int,
) -> list[Candidate]:
    """`best_subtree` for each size (sizes beyond the probe's are skipped), with the tau
    that `simulate` predicts for it."""
    by_node = acceptance_by_position(probe, paths)
    out = []
    for n in sizes:
        if n <= probe.num_nodes:
            tree = best_subtree(probe, by_node, n, name=f"best{n}").tree
            out.append(Candidate(tree, simulate(paths, tree, max_new_tokens)))
    return out


# ---------------------------------------------------------------------------------------
# choosing for the machine: a measured cost model of the round (Sequoia chooses its tree for
# the hardware; so does this)


def drafter_passes(tree: TreeTemplate) -> tuple[int, int]:
    """(passes, rows) of EAGLE's drafting on `tree` per round: the catch-up plus one pass per
    depth that has expanded nodes, and the expanded nodes fed in those passes."""
    expanded = [i for i in range(1, tree.num_nodes + 1) if tree.children[i]]
    depths = {tree.depths[i] for i in expanded}
    return 1 + len(depths), len(expanded)


@dataclass(frozen=True)
class RoundCost:
    """What a round costs on this machine, fitted to rounds measured on a few trees.

    Verification: milliseconds by the number of tokens verified (root + tree), interpolated
    linearly between the measured sizes (a CPU's matmuls are not linear in the tokens, so no
    single slope fits). Verifying more tokens never costs less, but a few short decodes on a
    shared machine can read so (LOG.md: 41 tokens 9.3 ms, 26 tokens 9.7 ms): the measured costs
    are made non-decreasing by pooling adjacent violators (isotonic regression), so noise never
    ranks a wider tree as cheaper. Drafting: `a + b * passes + c * rows` (`drafter_passes`),
    least squares.
    """

    verify_ms: tuple[tuple[int, float], ...]  # (tokens, ms), sorted by tokens
    draft_coef: tuple[float, float, float]  # a, b, c

    @classmethod
    def fit(cls, measured: Sequence[tuple[TreeTemplate, float, float]]) -> RoundCost:
        """From (tree, draft ms per round, verify ms per round) of at least three trees."""
        import numpy as np

        if len(measured) < 3:
            raise ValueError("the cost model needs rounds measured on at least three trees")
        by_tokens: dict[int, list[float]] = {}
        for tree, _, verify in measured:
            by_tokens.setdefault(tree.num_nodes + 1, []).append(verify)
        sizes = sorted(by_tokens)
        pooled = isotonic(
            [sum(by_tokens[n]) / len(by_tokens[n]) for n in sizes],
            [len(by_tokens[n]) for n in sizes],
        )
        verify_ms = tuple(zip(sizes, pooled))
        x = np.array([[1.0, *drafter_passes(t)] for t, _, _ in measured])  # (k, 3)
        y = np.array([d for _, d, _ in measured])
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        return cls(verify_ms, tuple(float(c) for c in coef))

    def verify(self, tokens: int) -> float:
        """Interpolated between the measured sizes; below them, the first segment extended; above
        them, the last one at no less than the mean slope of all: a last segment that pooling
        made flat would price every token past the widest timed round (a chain merged into a
        wide tree) at nothing."""
        ns, ms = [n for n, _ in self.verify_ms], [m for _, m in self.verify_ms]
        if len(ns) == 1:
            return ms[0] * tokens / ns[0]
        if tokens > ns[-1]:
            slope = max((ms[-1] - ms[-2]) / (ns[-1] - ns[-2]), (ms[-1] - ms[0]) / (ns[-1] - ns[0]))
            return ms[-1] + slope * (tokens - ns[-1])
        i = max(j for j in range(len(ns) - 1) if ns[j] <= tokens) if tokens >= ns[0] else 0
        return ms[i] + (ms[i + 1] - ms[i]) * (tokens - ns[i]) / (ns[i + 1] - ns[i])

    def draft(self, tree: TreeTemplate) -> float:
        a, b, c = self.draft_coef
        passes, rows = drafter_passes(tree)
        return a + b * passes + c * rows

    def round_ms(self, tree: TreeTemplate, tokens: int | None = None) -> float:
        """A round of `tree`, verifying `tokens` (default: the root and the tree; more where a
        chain is merged into it)."""
        return self.draft(tree) + self.verify(tree.num_nodes + 1 if tokens is None else tokens)

    def to_dict(self) -> dict:
        return {
            "verify_ms": [list(p) for p in self.verify_ms],
            "draft_ms": dict(zip("abc", self.draft_coef)),
            "draft_formula": "a + b * passes + c * rows",
        }


def isotonic(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent
    violators: a run that decreases is replaced by its weighted mean, until none does)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(n)]


@dataclass(frozen=True)
class MachineCost:
    """A round's time for each tree in the dtype it decodes in.

    On a CPU with fast bf16 a wide tree may keep bf16 while chains and small trees keep float32
    (`eagle.bench.machine_tree.measure_round_cost`), and a verification of n tokens costs
    differently in each: one curve fitted through both would price a bf16 tree by float32's
    neighbours and the reverse. So each dtype gets its own `RoundCost`, fitted on every round timed
    in it (a tree kept in one dtype was timed in both, and counts in both fits); a dtype timed on
    fewer than the three trees a fit needs prices its trees by their own measured rounds."""

    by_dtype: dict[str, RoundCost]  # dtype -> the fit of the rounds timed in it
    dtypes: dict[str, str]  # tree name -> the dtype it decodes in
    measured_ms: dict[str, float]  # tree name -> its measured round (draft + verify) in that dtype

    @classmethod
    def fit(
        cls, measured: Sequence[tuple[TreeTemplate, str, float, float]], dtypes: dict[str, str]
    ) -> MachineCost:
        """From (tree, dtype, draft ms per round, verify ms per round) of every tree in every dtype
        timed, and the dtype each tree keeps (`dtypes`, by tree name)."""
        by_dtype: dict[str, list[tuple[TreeTemplate, float, float]]] = {}
        for tree, dtype, draft, verify in measured:
            by_dtype.setdefault(dtype, []).append((tree, draft, verify))
        own = {
            tree.name: draft + verify
            for tree, dtype, draft, verify in measured
            if dtype == dtypes[tree.name]
        }
        missing = sorted(set(dtypes) - set(own))
        if missing:
            raise ValueError(f"trees without a round timed in their dtype: {missing}")
        return cls(
            {d: RoundCost.fit(rows) for d, rows in by_dtype.items() if len(rows) >= 3},
            dict(dtypes),
            own,
        )

    def round_ms(self, tree: TreeTemplate, tokens: int | None = None) -> float:
        """As `RoundCost.round_ms`, in the tree's dtype. A dtype without a fit prices the tree by
        its measured round, and tokens past the tree's by what they add in a fitted dtype
        (float32's where it has one; in proportion, where no dtype has one)."""
        cost = self.by_dtype.get(self.dtypes[tree.name])
        if cost is not None:
            return cost.round_ms(tree, tokens)
        measured, own = self.measured_ms[tree.name], tree.num_nodes + 1
        if tokens is None or tokens == own:
            return measured
        ref = self.by_dtype.get("float32") or next(iter(self.by_dtype.values()), None)
        if ref is None:
            return measured * tokens / own
        return measured + ref.verify(tokens) - ref.verify(own)

    def to_dict(self) -> dict:
        return {
            "by_dtype": {d: c.to_dict() for d, c in self.by_dtype.items()},
            "measured_round_ms": self.measured_ms,
            "unfitted_dtypes": sorted(set(self.dtypes.values()) - set(self.by_dtype)),
        }


def choose_for_machine(
    found: Sequence[Candidate], cost: RoundCost | MachineCost, vanilla_ms: float
) -> list[dict]:
    """Every candidate with its predicted round time and speedup (tau x vanilla step / round),
    best first: the first is the tree for this machine."""
    rows = [
        {
            "tree": c.tree.name,
            "nodes": c.tree.num_nodes,
            "depth": c.tree.depth,
            "predicted_tau": c.predicted_tau,
            "predicted_round_ms": cost.round_ms(c.tree),
            "predicted_speedup": c.predicted_tau * vanilla_ms / cost.round_ms(c.tree),
        }
        for c in found
    ]
    return sorted(rows, key=lambda r: -r["predicted_speedup"])


def choose_merged(
    found: Sequence[Candidate],
    paths: Sequence[Sequence[RankPathT]],
    chains: Sequence[Sequence[ChainHitT]],
    cost: RoundCost | MachineCost,
    vanilla_ms: float,
    max_new_tokens: int,
) -> list[dict]:
    """Every candidate with a chain merged into it each round (`chains`: prompt lookup's, for
    `eagle_lookup`), best first: its rounds replayed over the probed texts (`replay`), each priced
    by the cost model at the tokens it verifies, so a chain that drafts often makes a wide tree
    dearer. The chain itself is priced at nothing: prompt lookup is a search of the tokens."""
    rows = []
    for c in found:
        rounds = replay(paths, c.tree, max_new_tokens, chains)
        n, committed = max(len(rounds), 1), sum(step for step, _ in rounds)
        ms = sum(cost.round_ms(c.tree, verified) for _, verified in rounds)
        rows.append(
            {
                "tree": c.tree.name,
                "nodes": c.tree.num_nodes,
                "depth": c.tree.depth,
                "predicted_tau": committed / n,
                "predicted_verified": sum(v for _, v in rounds) / n,
                "predicted_round_ms": ms / n,
                "predicted_speedup": committed * vanilla_ms / ms if ms else 0.0,
            }
        )
    return sorted(rows, key=lambda r: -r["predicted_speedup"])


def write_tree(candidate: Candidate, path: str | Path, source: str = "") -> Path:
    """Save a candidate as a `kind: paths` tree config, with where it came from as a comment."""
    path = Path(path)
    tree = candidate.tree
    header = [
        f"# {tree.summary()}; predicted tau {candidate.predicted_tau:.3f} (greedy)",
        "# chosen by eagle.bench.tree_search.best_subtree" + (f" from {source}" if source else ""),
    ]
    body = yaml.safe_dump(
        {"kind": "paths", "paths": [list(p) for p in tree.paths]},
        default_flow_style=None,
        sort_keys=False,
    )
    path.write_text("\n".join(header) + "\n" + body)
    return path
