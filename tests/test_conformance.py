"""The conformance suite: every proposer x runner x model family against the exactness checks.

Greedy: output identical, token for token, to `model.generate(do_sample=False)`, with
max_new_tokens and EOS landing inside accepted paths. Sampling: the emitted sequences follow
the target's own distribution (chi-square against exact enumeration), long enough that bonus
tokens after fully accepted paths are emitted. Batches: several sequences of different lengths
decoded at once (`SpeculativeDecoder.generate_batch`), each held to the same checks.

A new proposer gets all of these tests by being added to `PROPOSERS`: a factory
`(target, family, runner) -> proposer` (the runner kind also names the draft model's cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from eagle.decoding import RUNNERS, SpeculativeDecoder, make_runner
from eagle.decoding.draft_cache import draft_cache
from eagle.models.drafter import EagleDrafter
from eagle.models.medusa import MedusaHeads
from eagle.proposers import (
    DraftLM,
    EagleDraftModel,
    PromptLookupProposer,
    TemplateProposer,
    eagle_proposer,
)
from eagle.proposers import medusa_proposer as medusa
from eagle.proposers.eagle import pass_shape
from eagle.proposers.merge import MergeProposer
from eagle.tree import TreeTemplate
from helpers.decoding import (
    RandomProposer,
    batch_case,
    greedy_cases,
    run_batched_greedy,
    run_greedy_cases,
    tree,
)
from helpers.models import FAMILIES, make_tiny_model
from helpers.stats import POLICIES, chi2_pvalue, exact_joint, sample_counts


@dataclass(frozen=True)
class Trees:
    """The trees a proposer drafts: full-size ones for the greedy checks, small ones (and a
    5-token vocabulary) for the sampled ones, whose joint distribution is enumerated."""

    tree: TreeTemplate
    chain: TreeTemplate
    expansion: TreeTemplate  # SpecInfer's static expansion
    medusa: TreeTemplate
    lookup: int  # prompt lookup's draft length


FULL = Trees(
    tree("eagle_default"), tree("chain5"), tree("specinfer_221"), tree("medusa_default"), 5
)
SMALL_TREE = TreeTemplate.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]], name="small")  # depth 2
SMALL = Trees(
    SMALL_TREE, TreeTemplate.chain(2), TreeTemplate.static_expansion([2, 1]), SMALL_TREE, 2
)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable  # (target, family, runner, trees) -> proposer, or None for vanilla
    runners: tuple[str, ...] = RUNNERS
    accepts: bool = False  # drafts what the target says (an oracle): deep paths must be accepted


def _draft(target, family: str, seed: int = 1) -> torch.nn.Module:
    return make_tiny_model(
        family, seed=seed, num_hidden_layers=1, vocab_size=target.config.vocab_size
    )


def _merge(target, family, runner, trees: Trees):
    """SpecInfer's merge: two small LMs (a chain, an expansion) and the target itself as a third
    SSM, so merged paths are accepted deep and the SSMs often repeat each other's tokens."""
    ssms = [
        TemplateProposer(DraftLM(_draft(target, family, seed), cache=runner), tpl)
        for seed, tpl in [(1, trees.chain), (2, trees.expansion)]
    ]
    return MergeProposer(ssms + [TemplateProposer(DraftLM(target, cache=runner), trees.chain)])


def _eagle_padded(target, family, runner, trees: Trees):
    """EAGLE on its static cache with every pass padded to one fixed shape, as compiled (run
    eagerly here, so the padding is tested without compiling)."""
    drafter = EagleDrafter.random(target, seed=1)
    cache = draft_cache("static", drafter.llama_config, drafter.dtype, drafter.device)
    model = EagleDraftModel(drafter, cache, pass_shape=pass_shape(trees.tree))
    return TemplateProposer(model, trees.tree, name="eagle")


def _eagle_vocab(target, family, runner, trees: Trees):
    """EAGLE drafting from every other token (a reduced vocabulary, FR-Spec): the tokens off it
    are never drafted, yet the target still emits them, at their own probabilities."""
    drafter = EagleDrafter.random(target, seed=1)
    drafter.restrict_vocab(torch.arange(0, drafter.config.vocab_size, 2))
    return eagle_proposer(drafter, trees.tree, cache=runner)


def _medusa_vocab(target, family, runner, trees: Trees):
    """Medusa heads drafting from every other token (trained with a reduced loss vocabulary, so
    the rest have logit -inf): the target still emits the others, at their own probabilities."""
    heads = MedusaHeads.random(target, trees.medusa.depth, seed=2)
    heads.restrict_vocab(torch.arange(0, heads.config.vocab_size, 2))
    return medusa(heads, trees.medusa)


PROPOSERS = [
    Case("vanilla", lambda t, f, r, trees: None),
    Case("random", lambda t, f, r, trees: RandomProposer(trees.tree)),
    Case(
        "prompt_lookup",
        lambda t, f, r, trees: PromptLookupProposer(num_tokens=trees.lookup, max_ngram=2),
    ),
    Case(
        "draft_chain",
        lambda t, f, r, trees: TemplateProposer(DraftLM(_draft(t, f), cache=r), trees.chain),
    ),
    Case(
        "draft_tree",
        lambda t, f, r, trees: TemplateProposer(DraftLM(_draft(t, f), cache=r), trees.tree),
    ),
    Case(
        "draft_tree_topk",
        lambda t, f, r, trees: TemplateProposer(
            DraftLM(_draft(t, f), cache=r), trees.tree, proposal="topk"
        ),
    ),
    # the target drafting for itself accepts whole paths: deep, non-contiguous cache compaction
    Case(
        "oracle_tree",
        lambda t, f, r, trees: TemplateProposer(DraftLM(t, cache=r), trees.tree),
        accepts=True,
    ),
    Case(
        "oracle_specinfer",
        lambda t, f, r, trees: TemplateProposer(DraftLM(t, cache=r), trees.expansion),
        accepts=True,
    ),
    Case(
        "eagle",
        lambda t, f, r, trees: eagle_proposer(EagleDrafter.random(t, seed=1), trees.tree, cache=r),
    ),
    Case(
        "eagle_chain",
        lambda t, f, r, trees: eagle_proposer(
            EagleDrafter.random(t, seed=1), trees.chain, cache=r, proposal="topk"
        ),
    ),
    Case("eagle_padded", _eagle_padded, runners=("static",)),
    Case("eagle_vocab", _eagle_vocab),
    Case(
        "medusa",
        lambda t, f, r, trees: medusa(
            MedusaHeads.random(t, trees.medusa.depth, seed=2), trees.medusa
        ),
    ),
    Case("medusa_vocab", _medusa_vocab),
    Case("specinfer_merge", _merge, accepts=True),
    # EAGLE's tree and prompt lookup's chain merged (eagle_lookup): a 1-token match, so the chain
    # drafts nearly every round and often repeats EAGLE's tokens under the same parent
    Case(
        "eagle_lookup",
        lambda t, f, r, trees: MergeProposer(
            [
                eagle_proposer(EagleDrafter.random(t, seed=1), trees.tree, cache=r),
                PromptLookupProposer(num_tokens=trees.lookup, max_ngram=2, min_ngram=1),
            ]
        ),
    ),
]
CASES = [(c, r) for c in PROPOSERS for r in c.runners]
IDS = [f"{c.name}-{r}" for c, r in CASES]
# Sampled checks cost ~10 s each: on the static runner the default run keeps those whose draft
# model's own cache turns static too (the rest differ from their dynamic case only in the target's
# runner, whose logits the greedy suite checks for every proposer); `make test-slow` runs them all.
SAMPLED_STATIC = {"draft_tree", "eagle", "eagle_padded", "specinfer_merge", "eagle_lookup"}
SAMPLED = [
    pytest.param(
        c,
        r,
        id=f"{c.name}-{r}",
        marks=[pytest.mark.slow] if r == "static" and c.name not in SAMPLED_STATIC else [],
    )
    for c, r in CASES
]


def setup(case: Case, runner: str, target, family: str, trees: Trees):
    """(proposer, target runner): the runner is sized for the proposer's largest tree."""
    proposer = case.build(target, family, runner, trees)
    return proposer, make_runner(runner, target, tree_size=proposer.max_nodes if proposer else 0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case,runner", CASES, ids=IDS)
def test_greedy_identical_to_generate(case, runner, family):
    target = make_tiny_model(family)
    proposer, kept = setup(
        case, runner, target, family, FULL
    )  # one runner for every prompt: no leaks
    accepted = run_greedy_cases(
        target, proposer, kept, greedy_cases(target, 12), f"{family}/{case.name}/{runner}"
    )
    if case.accepts:
        assert accepted > 60, "an oracle should accept long paths"


# families of the batched checks: rotary positions, a sliding window crossed by the prompts,
# windowed and full layers with soft-capped logits, absolute position embeddings, keys and values of
# two widths (latent attention), chunked layers
BATCH_FAMILIES = ("llama", "mistral", "gemma2", "gpt2", "deepseek_v3", "llama4_text")


@pytest.mark.parametrize("family", BATCH_FAMILIES)
@pytest.mark.parametrize("case,runner", CASES, ids=IDS)
def test_batched_greedy_identical_to_generate(case, runner, family):
    """Six prompts of 1-~90 tokens decoded as one batch, with budgets of 1-40 tokens and an EOS
    that ends some rows inside an accepted path: every row equals `generate`'s text for it
    alone. Then a smaller batch on the same runner and proposers (a finished batch leaves nothing
    behind, and a static runner reallocates for the new batch size)."""
    target = make_tiny_model(family)
    proposer, kept = setup(case, runner, target, family, FULL)
    label = f"{family}/{case.name}/{runner}"
    results = run_batched_greedy(target, proposer, kept, batch_case(target), label)
    assert len({len(r.stats.rounds) for r in results}) > 2, "rows must finish at different rounds"
    if case.accepts:
        assert sum(r.accepted for res in results for r in res.stats.rounds) > 20, (
            "an oracle should accept long paths"
        )
    run_batched_greedy(
        target, proposer, kept, batch_case(target, n=3, seed=5), label + " (second batch)"
    )


# the sampled batch checks: a proposer of each kind (the others share their machinery), both runners
SAMPLED_BATCH = [
    pytest.param(c, r, id=f"{c.name}-{r}")
    for c, r in CASES
    if (c.name, r)
    in {
        ("vanilla", "dynamic"),
        ("prompt_lookup", "dynamic"),
        ("eagle", "dynamic"),
        ("medusa", "dynamic"),
        ("draft_tree", "static"),
        ("specinfer_merge", "static"),
    }
]


@pytest.mark.parametrize("case,runner", SAMPLED_BATCH)
def test_batched_sampled_tokens_follow_target_distribution(case, runner):
    """Two prompts of different lengths decoded as one batch: each row's 4 new tokens follow the
    target's distribution after its own prompt (chi-square against exact enumeration)."""
    policy = POLICIES["t1"]
    target = make_tiny_model("llama", vocab_size=5, seed=3)
    proposer, kept = setup(case, runner, target, "llama", SMALL)
    decoder = SpeculativeDecoder(target, proposer, policy, eos_token_id=[], runner=kept)
    batch, n, runs = [[1, 3, 2], [4, 0]], 4, 800
    g = torch.Generator().manual_seed(1234)
    counts = [{}, {}]
    for _ in range(runs):
        for row, res in enumerate(decoder.generate_batch(batch, n, generator=g)):
            counts[row][tuple(res.tokens)] = counts[row].get(tuple(res.tokens), 0) + 1
    for row, prompt in enumerate(batch):
        pvalue = chi2_pvalue(counts[row], exact_joint(target, prompt, policy, n), runs)
        assert pvalue > 1e-3, f"{case.name}/{runner}: row {row}: chi2 p-value {pvalue:.2e}"


@pytest.mark.parametrize("case,runner", SAMPLED)
def test_sampled_tokens_follow_target_distribution(case, runner):
    """4 new tokens after a 3-token prompt: the prefill emits one, so a round that accepts a
    whole depth-2 path emits its bonus token within the sequence."""
    i = PROPOSERS.index(case)
    policy_name = list(POLICIES)[
        (i + RUNNERS.index(runner)) % len(POLICIES)
    ]  # every policy, in turn
    policy = POLICIES[policy_name]
    target = make_tiny_model("llama", vocab_size=5, seed=3)
    proposer, kept = setup(case, runner, target, "llama", SMALL)
    decoder = SpeculativeDecoder(target, proposer, policy, eos_token_id=[], runner=kept)
    prompt, n, runs = [1, 3, 2], 4, 800
    counts, rounds = sample_counts(lambda g: decoder.generate(prompt, n, generator=g), runs)
    expected = exact_joint(target, prompt, policy, n)
    assert set(counts) <= {s for s, pr in expected.items() if pr > 0}, (
        "emitted a sequence of probability 0"
    )
    pvalue = chi2_pvalue(counts, expected, runs)
    assert pvalue > 1e-3, f"{case.name}/{runner}/{policy_name}: chi2 p-value {pvalue:.2e}"
    if case.name != "vanilla":
        accepted = sum(r.accepted for r in rounds)
        assert accepted > 0.05 * runs, (
            "drafts must be accepted for the acceptance rule to be exercised"
        )
    if case.accepts:
        bonus = sum(
            r.accepted == 2 and r.committed == 3 for r in rounds
        )  # a full depth-2 path + its bonus
        assert bonus > 0.2 * runs, "full accepts with their bonus token must be emitted"


@pytest.mark.parametrize(
    "family,name", [("gemma2", "vanilla"), ("gemma2", "eagle"), ("cohere", "draft_tree")]
)
def test_sampling_follows_a_transformed_distribution(family, name):
    """Gemma-2 soft-caps its logits (here hard: cap 3), Cohere scales them: p is the model's own
    distribution, transform included, for the target and for the drafters that share its head."""
    case = next(c for c in PROPOSERS if c.name == name)
    target = make_tiny_model(family, vocab_size=5, seed=3)
    proposer, kept = setup(case, "dynamic", target, family, SMALL)
    decoder = SpeculativeDecoder(target, proposer, POLICIES["t1"], eos_token_id=[], runner=kept)
    prompt, n, runs = [1, 3, 2], 4, 800
    counts, _ = sample_counts(lambda g: decoder.generate(prompt, n, generator=g), runs)
    pvalue = chi2_pvalue(counts, exact_joint(target, prompt, POLICIES["t1"], n), runs)
    assert pvalue > 1e-3, f"{family}/{name}: chi2 p-value {pvalue:.2e}"
