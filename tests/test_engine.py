"""The decoding loop is lossless: greedy output equals `model.generate(do_sample=False)`
token for token, and sampled output follows the target's own distribution, with either
target runner (a growing Hugging Face cache, or the static position-indexed one)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from conftest import chi2_pvalue, make_tiny_model

from eagle.engine import ContextOverflowError, DecodeState, DraftTree, Proposer, SpeculativeDecoder
from eagle.proposers import DraftLM, PromptLookupProposer, TemplateProposer
from eagle.sampling import SamplingPolicy
from eagle.target_runner import DynamicRunner, StaticRunner
from eagle.tree import TreeTemplate

TREES = Path(__file__).resolve().parents[1] / "configs" / "tree"


class RandomProposer(Proposer):
    """Proposes uniformly random tokens on a fixed tree: almost everything is rejected."""

    name = "random"

    def __init__(self, template: TreeTemplate, seed: int = 0):
        self.template = template
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, state: DecodeState) -> DraftTree:
        n, v = self.template.num_nodes, state.vocab_size
        tokens = torch.randint(0, v, (n,), generator=self.rng)
        q = None if state.policy.greedy else torch.full((n, v), 1.0 / v)  # i.i.d. uniform draws
        return DraftTree(tokens=tokens, parents=tuple(self.template.parents), q=q)


def tree(name: str) -> TreeTemplate:
    return TreeTemplate.from_file(TREES / f"{name}.yaml")


def make_runner(cache: str, target, proposer=None):
    """A target runner of kind `cache`; the static one is sized for `proposer`'s largest tree
    (prompt lookup's trees vary in size, so they are padded to it)."""
    if cache == "dynamic":
        return DynamicRunner(target)
    size = 0
    if isinstance(proposer, PromptLookupProposer):
        size = proposer.num_tokens
    elif proposer is not None:
        size = proposer.template.num_nodes
    return StaticRunner(target, tree_size=size)


def proposers(family: str, target):
    """Every proposer kind, including an oracle (the target drafting for itself), which
    accepts whole paths and so exercises the cache compaction of deep, non-contiguous paths."""
    draft = make_tiny_model(family, seed=1, num_hidden_layers=1)
    return {
        "vanilla": None,
        "random": RandomProposer(tree("eagle_default")),
        "prompt_lookup": PromptLookupProposer(num_tokens=5, max_ngram=2),
        "draft_chain": TemplateProposer(DraftLM(draft), tree("chain5")),
        "draft_tree": TemplateProposer(DraftLM(draft), tree("eagle_default")),
        "oracle_tree": TemplateProposer(DraftLM(target), tree("eagle_default")),
        "oracle_static": TemplateProposer(DraftLM(target), tree("specinfer_221")),
    }


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of different lengths (1..~90), some with repeats so prompt lookup matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 1 + (i * 37) % 90
        base = torch.randint(3, vocab, (max(length // 3, 1),), generator=g).tolist()
        out.append((base * 3)[:length] if i % 2 else torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_greedy_identical_to_generate(family, cache):
    target = make_tiny_model(family)
    vocab = target.config.vocab_size
    cases = []  # (prompt, max_new_tokens, eos)
    for i, prompt in enumerate(prompts(20, vocab)):
        max_new = [1, 2, 7, 24, 40][i % 5]
        ref = hf_greedy(target, prompt, max_new, eos=None)
        # every other prompt: make a token that the target emits mid-way the EOS, so that the
        # stop lands inside an accepted path
        eos = ref[len(ref) // 2] if i % 2 and len(ref) > 3 else None
        cases.append((prompt, max_new, eos, hf_greedy(target, prompt, max_new, eos) if eos is not None else ref))
    for name, proposer in proposers(family, target).items():
        accepted = 0
        runner = make_runner(cache, target, proposer)  # one per proposer: stale slots of earlier prompts stay
        for prompt, max_new, eos, ref in cases:
            decoder = SpeculativeDecoder(target, proposer, SamplingPolicy(), eos_token_id=eos if eos is not None else [],
                                         runner=runner)
            res = decoder.generate(prompt, max_new, tree_size_hint=25)
            assert res.tokens == ref, f"{family}/{name}/{cache}: prompt of {len(prompt)} tokens, max_new {max_new}, eos {eos}"
            accepted += sum(r.accepted for r in res.stats.rounds)
        if name.startswith("oracle"):
            assert accepted > 100, "the oracle should accept long paths"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_oracle_accepts_full_depth_and_cache_has_no_branch_trace(cache):
    """After every round the committed KV equals that of a clean forward over the committed
    tokens: rejected branches left nothing in it (and the static cache erased nothing: stale
    slots past the committed length are only hidden)."""
    target = make_tiny_model("llama")
    # the oracle accepts rank-0 paths (nodes 1, 5, 13, ...: moved down in the cache) and rejects the rest
    proposer = TemplateProposer(DraftLM(target), tree("eagle_default"))
    runner = make_runner(cache, target, proposer)
    decoder = SpeculativeDecoder(target, proposer, eos_token_id=[], runner=runner)
    original, stale, checked = decoder._verify, [], []

    def spy(state, tree_, generator):
        out = original(state, tree_, generator)
        path = out[0]
        committed = state.tokens + tree_.tokens[[i - 1 for i in path[1:]]].tolist()  # root included
        assert runner.length == len(committed)  # the committed tokens and the accepted path only
        clean = DynamicRunner(target)
        clean.prefill(torch.tensor([committed]), len(committed))
        for layer in range(target.config.num_hidden_layers):
            for got, want in zip(runner.committed_kv(layer), clean.committed_kv(layer)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if cache == "static":  # the rejected nodes' KV is still there, hidden by the mask
            stale.append(bool(runner.cache.keys[0][:, :, runner.length:runner.length + tree_.size].abs().sum() > 0))
        checked.append(len(path))
        return out

    decoder._verify = spy
    res = decoder.generate(prompts(3, target.config.vocab_size)[2], 30)
    assert res.stats.rounds[0].accepted == 5  # the whole depth of the default tree
    assert len(checked) == len(res.stats.rounds) > 3
    assert all(stale)


def test_tau_and_stats_are_consistent():
    target = make_tiny_model("qwen2")
    decoder = SpeculativeDecoder(target, TemplateProposer(DraftLM(target), tree("chain5")), eos_token_id=[])
    res = decoder.generate([5, 6, 7], 25)
    s = res.stats
    assert len(res.tokens) == 25 == s.new_tokens
    assert s.tau == pytest.approx(sum(r.committed for r in s.rounds) / len(s.rounds))
    assert s.tau > 5  # oracle chain of 5: every round commits 6 (the last one may be cut)
    assert sum(s.accepted_histogram()) == len(s.rounds)
    assert s.draft_s > 0 and s.verify_s > 0


def test_prompt_too_long_is_refused_before_decoding():
    target = make_tiny_model("llama", max_position_embeddings=64)
    decoder = SpeculativeDecoder(target)
    with pytest.raises(ContextOverflowError, match="exceed the target's context of 64"):
        decoder.generate(list(range(3, 50)), 20, tree_size_hint=25)
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([], 5)


def test_prompt_lookup_matches():
    seq = [1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2]
    assert PromptLookupProposer(num_tokens=3, max_ngram=2).lookup(seq) == [3, 4, 9]  # HF: earliest
    assert PromptLookupProposer(num_tokens=3, max_ngram=2, match="latest").lookup(seq) == [5, 6, 1]
    assert PromptLookupProposer(num_tokens=3, max_ngram=3).lookup([7, 1, 2, 8, 5, 1, 2]) == [8, 5, 1]  # 2-gram
    assert PromptLookupProposer(num_tokens=3, max_ngram=2).lookup([1, 2, 3]) == []
    with pytest.raises(ValueError, match="earliest"):
        PromptLookupProposer(match="first")


# ---------------------------------------------------------------------------------------
# Sampling: the emitted tokens follow the target's own distribution (chi-square).

def exact_joint(model, prompt: list[int], policy: SamplingPolicy, n: int) -> dict[tuple, float]:
    """P(x1..xn) = prod p(x_i | prompt, x_<i) under the policy, by enumeration."""
    vocab = model.config.vocab_size
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=n):
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1:-1]
            p = policy.probs(logits.double())
            out[seq] = float(torch.prod(p[torch.arange(n), torch.tensor(seq)]))
    return out


POLICIES = {"t1": SamplingPolicy(temperature=1.0), "topk": SamplingPolicy(temperature=0.8, top_k=3),
            "topp": SamplingPolicy(temperature=1.0, top_p=0.8)}


@pytest.mark.parametrize("policy_name,kind,cache", [
    ("t1", "draft_sample", "dynamic"), ("topk", "draft_sample", "dynamic"), ("topp", "draft_sample", "dynamic"),
    ("t1", "draft_topk", "dynamic"), ("topk", "random", "dynamic"), ("topp", "oracle", "dynamic"),
    ("topk", "random", "static")])
def test_sampled_tokens_follow_target_distribution(policy_name, kind, cache):
    policy = POLICIES[policy_name]
    target = make_tiny_model("llama", vocab_size=5, seed=3)
    draft = make_tiny_model("llama", vocab_size=5, seed=4, num_hidden_layers=1)
    small_tree = TreeTemplate.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]], name="small")
    proposer = {
        "draft_sample": TemplateProposer(DraftLM(draft), small_tree, proposal="sample"),
        "draft_topk": TemplateProposer(DraftLM(draft), small_tree, proposal="topk"),
        "random": RandomProposer(small_tree),
        "oracle": TemplateProposer(DraftLM(target), small_tree, proposal="sample"),
    }[kind]
    prompt, n, runs = [1, 3, 2], 3, 1000
    decoder = SpeculativeDecoder(target, proposer, policy, eos_token_id=[], runner=make_runner(cache, target, proposer))
    g = torch.Generator().manual_seed(1234)
    counts: dict[tuple, int] = {}
    for _ in range(runs):
        seq = tuple(decoder.generate(prompt, n, generator=g).tokens)
        counts[seq] = counts.get(seq, 0) + 1
    expected = exact_joint(target, prompt, policy, n)
    assert set(counts) <= {s for s, pr in expected.items() if pr > 0}, "emitted a sequence of probability 0"
    pvalue = chi2_pvalue(counts, expected, runs)
    assert pvalue > 1e-3, f"{kind}/{cache}: chi2 p-value {pvalue:.2e}"


def test_gumbel_top_k_draws_are_successive_draws_without_replacement():
    """P(first = a, second = b) = d(a) d(b) / (1 - d(a)); q rows exclude earlier draws."""
    from eagle.proposers.template import sample_without_replacement

    dist = torch.tensor([0.5, 0.25, 0.15, 0.1])
    g = torch.Generator().manual_seed(0)
    runs, counts = 4000, {}
    for _ in range(runs):
        picks, q = sample_without_replacement(dist, 2, g)
        key = tuple(picks.tolist())
        counts[key] = counts.get(key, 0) + 1
    a, b = key
    torch.testing.assert_close(q[0], dist)
    want = dist.clone()
    want[a] = 0
    torch.testing.assert_close(q[1], want / want.sum())
    d = [0.5, 0.25, 0.15, 0.1]  # exact in float64 (dist is float32)
    expected = {(i, j): d[i] * d[j] / (1 - d[i]) for i in range(4) for j in range(4) if i != j}
    assert sum(expected.values()) == pytest.approx(1.0)
    assert chi2_pvalue(counts, expected, runs) > 1e-3


def test_draws_past_an_exhausted_support_are_one_hot():
    from eagle.proposers.template import sample_without_replacement

    dist = torch.tensor([0.0, 0.7, 0.0, 0.3, 0.0])
    picks, q = sample_without_replacement(dist, 4, torch.Generator().manual_seed(0))
    assert sorted(picks[:2].tolist()) == [1, 3] and len(set(picks.tolist())) == 4
    assert torch.isfinite(q).all() and torch.allclose(q.sum(-1), torch.ones(4))
    for i in (2, 3):
        assert q[i, picks[i]] == 1.0  # deterministic picks: one-hot proposals
