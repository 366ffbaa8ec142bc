"""The decoding loop's own guarantees: rejected branches leave no trace in the target's cache
(either runner), tau and the round statistics agree, bad requests are refused up front, prompt
lookup matches like Hugging Face's, and the Gumbel-top-k draws are draws without replacement.
Greedy and sampled exactness of every proposer x runner x family: tests/test_conformance.py."""

from __future__ import annotations

import pytest
import torch

from eagle.decoding import ContextOverflowError, DynamicRunner, SpeculativeDecoder, make_runner
from eagle.proposers import DraftLM, PromptLookupProposer, TemplateProposer
from eagle.sampling import SamplingPolicy
from helpers.decoding import prompts, tree
from helpers.models import make_tiny_model
from helpers.stats import chi2_pvalue


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_oracle_accepts_full_depth_and_cache_has_no_branch_trace(cache):
    """After every round the committed KV equals that of a clean forward over the committed
    tokens: rejected branches left nothing in it (and the static cache erased nothing: stale
    slots past the committed length are only hidden)."""
    target = make_tiny_model("llama")
    # the oracle accepts rank-0 paths (nodes 1, 5, 13, ...: moved down in the cache) and rejects the
    # rest
    proposer = TemplateProposer(DraftLM(target, cache=cache), tree("eagle_default"))
    runner = make_runner(cache, target, tree_size=proposer.max_nodes)
    decoder = SpeculativeDecoder(target, proposer, eos_token_id=[], runner=runner)
    original, stale, checked = decoder._verify, [], []

    def spy(states, trees, generator):
        out = original(states, trees, generator)
        (state,), (tree_,), ((path, _, _),) = states, trees, out
        committed = state.tokens + tree_.tokens[[i - 1 for i in path[1:]]].tolist()  # root included
        assert runner.length == len(committed)  # the committed tokens and the accepted path only
        clean = DynamicRunner(target)
        clean.prefill(torch.tensor([committed]), len(committed))
        for layer in range(target.config.num_hidden_layers):
            for got, want in zip(runner.committed_kv(layer), clean.committed_kv(layer)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if cache == "static":  # the rejected nodes' KV is still there, hidden by the mask
            stale.append(
                bool(
                    runner.cache.keys[0][:, :, runner.length : runner.length + tree_.size]
                    .abs()
                    .sum()
                    > 0
                )
            )
        checked.append(len(path))
        return out

    decoder._verify = spy
    res = decoder.generate(prompts(3, target.config.vocab_size)[2], 30)
    assert res.stats.rounds[0].accepted == 5  # the whole depth of the default tree
    assert len(checked) == len(res.stats.rounds) > 3
    assert all(stale)


def test_growing_cache_holds_what_hugging_faces_cache_holds(monkeypatch):
    """The in-place cache (`GrowingLayer`) against Hugging Face's `DynamicCache` under the same
    appends, crops and path compactions, across buffer regrowths and a replaced tensor."""
    from transformers import DynamicCache

    from eagle.decoding import kv_cache

    monkeypatch.setattr(kv_cache, "MIN_CAPACITY", 4)  # regrow often
    g = torch.Generator().manual_seed(0)
    ours, ref = kv_cache.new_cache(), DynamicCache()
    for step, n in enumerate((5, 1, 3, 7, 1, 2, 9)):
        k, v = torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)
        for layer in range(2):
            got = ours.update(k + layer, v - layer, layer)
            want = ref.update(k + layer, v - layer, layer)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        if n > 2:  # a tree of n: keep a path through it, as after a verification
            prefix = ref.get_seq_length() - n
            kv_cache.keep_path(ours, prefix, [0, 2])
            kv_cache.keep_path(ref, prefix, [0, 2])
        if step == 4:  # something replaced the tensors (as beam reordering does): copied back in
            ours.layers[0].keys = ours.layers[0].keys.clone()
        assert ours.get_seq_length() == ref.get_seq_length()
        for a, b in zip(ours.layers, ref.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
            torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
    assert (
        ours.layers[0].keys.untyped_storage().data_ptr()
        == ours.layers[0]._keys_buf.untyped_storage().data_ptr()
    )
    # a known max_len caps the buffer at what the sequence needs, and a longer sequence still fits
    capped = kv_cache.new_cache(max_len=10)
    for n in (3, 4, 3):
        capped.update(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4), 0)
    assert capped.layers[0]._keys_buf.shape[-2] == 10 and capped.get_seq_length() == 10
    capped.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4), 0)
    assert capped.get_seq_length() == 12 and capped.layers[0].keys[0, 0, 10:].eq(1).all()


def test_a_growing_cache_lets_a_writer_fill_its_buffers_only_when_every_layer_is_ready():
    """`reserve` / `commit` (the fused kernels' loop writes the buffers itself): the same cache as
    `update` would make; no buffers where a layer is missing, replaced, of another length or full.
    """
    from eagle.decoding import kv_cache

    g = torch.Generator().manual_seed(0)
    ours, ref = kv_cache.new_cache(max_len=12), kv_cache.new_cache(max_len=12)
    assert ours.reserve(1) is None  # no layer yet: their first update creates them
    for cache in (ours, ref):
        for layer in range(2):
            cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), layer)
    for n in (2, 3):
        k, v = torch.randn(2, 1, 2, n, 4, generator=g), torch.randn(2, 1, 2, n, 4, generator=g)
        keys, values, slots, visible = ours.reserve(n)
        assert len(keys) == len(values) == 2 and slots.tolist() == list(range(visible - n, visible))
        for layer in range(2):
            keys[layer][:, :, slots] = k[layer]
            values[layer][:, :, slots] = v[layer]
            ref.update(k[layer], v[layer], layer)
        ours.commit(n)
        assert ours.get_seq_length() == ref.get_seq_length() == visible
        for a, b in zip(ours.layers, ref.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert ours.reserve(3) is None, (
        "12 slots hold 10 entries and no 3 more: update grows the buffer"
    )
    kv_cache.crop(ours, 9)
    assert ours.reserve(3) is not None, "room again: nothing is written before `commit`"
    ours.layers[1].values = ours.layers[1].values.clone()  # replaced, as beam reordering does
    assert ours.reserve(1) is None
    uneven = kv_cache.new_cache()
    for layer, n in enumerate((5, 4)):
        uneven.update(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4), layer)
    assert uneven.reserve(1) is None


def test_tau_and_stats_are_consistent():
    target = make_tiny_model("qwen2")
    decoder = SpeculativeDecoder(
        target, TemplateProposer(DraftLM(target), tree("chain5")), eos_token_id=[]
    )
    res = decoder.generate([5, 6, 7], 25)
    s = res.stats
    assert len(res.tokens) == 25 == s.new_tokens
    # the target drafting for itself on a chain of 5: the prefill gives token 1, then every round
    # accepts all 5 and adds the bonus token: 4 rounds of 6
    assert [(r.accepted, r.committed) for r in s.rounds] == [(5, 6)] * 4
    assert s.tau == 6.0 and s.forwards == 4
    assert s.accepted_histogram() == [0, 0, 0, 0, 0, 4]
    assert s.draft_s > 0 and s.verify_s > 0


def test_prompt_too_long_is_refused_before_decoding():
    target = make_tiny_model("llama", max_position_embeddings=64)
    decoder = SpeculativeDecoder(target)
    with pytest.raises(ContextOverflowError, match="exceed the target's context of 64"):
        SpeculativeDecoder(
            target, TemplateProposer(DraftLM(target), tree("eagle_default"))
        ).generate(list(range(3, 50)), 20)
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([], 5)


@pytest.mark.parametrize("runner", ["dynamic", "static"])
@pytest.mark.parametrize("proposer", ["eagle", "draft"])
def test_one_sequence_decodes_to_the_end_of_the_context_as_vanilla_does(runner, proposer):
    """A request plain decoding serves (prompt + new tokens + 1 within the context) is served by a
    tree method too: the rounds whose tree would run past the context verify none (plain steps),
    and the text is the target's own greedy text, up to the context's last slot."""
    from eagle.models.drafter import EagleDrafter
    from eagle.proposers import eagle_proposer
    from helpers.decoding import hf_greedy

    target = make_tiny_model("llama", max_position_embeddings=48)
    template = tree("eagle_default")  # 25 nodes, depth 5
    prompt = list(range(3, 23))  # 20 tokens: 20 + 27 + 1 = 48
    drafting = (
        eagle_proposer(EagleDrafter.random(target, seed=1), template, cache=runner)
        if proposer == "eagle"
        else TemplateProposer(DraftLM(make_tiny_model("llama", seed=1)), template)
    )  # a draft LM of a longer context
    decoder = SpeculativeDecoder(
        target,
        drafting,
        runner=make_runner(runner, target, tree_size=template.num_nodes),
        eos_token_id=[],
    )
    res = decoder.generate(prompt, 27)
    assert res.tokens == hf_greedy(target, prompt, 27, None)
    sizes = [r.tree_size for r in res.stats.rounds]
    assert (
        sizes[0] == template.num_nodes and sizes[-1] == 0
    )  # trees while they fit, plain steps at the end
    with pytest.raises(
        ContextOverflowError, match=r"prompt \(20\) \+ max_new_tokens \(28\) \+ 1 = 49 tokens"
    ):
        decoder.generate(prompt, 28)  # past what plain decoding serves
    with pytest.raises(
        ContextOverflowError, match=r"\+ tree \(26\) = 73 tokens"
    ):  # a batch keeps a tree's room
        decoder.generate_batch([prompt, prompt], 27)


def test_prompt_lookup_matches():
    seq = [1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2]
    assert PromptLookupProposer(num_tokens=3, max_ngram=2).lookup(seq) == [
        3,
        4,
        9,
    ]  # HF: the earliest match
    assert PromptLookupProposer(num_tokens=3, max_ngram=3).lookup([7, 1, 2, 8, 5, 1, 2]) == [
        8,
        5,
        1,
    ]  # 2-gram
    assert PromptLookupProposer(num_tokens=3, max_ngram=2).lookup([1, 2, 3]) == []
    # a shortest match (eagle_lookup's): 1-token matches draft nothing
    one_only = [5, 1, 7, 8, 2, 1]  # only the 1-gram [1] repeats
    assert PromptLookupProposer(num_tokens=2, max_ngram=2).lookup(one_only) == [7, 8]
    assert PromptLookupProposer(num_tokens=2, max_ngram=2, min_ngram=2).lookup(one_only) == []
    assert PromptLookupProposer(num_tokens=2, max_ngram=3, min_ngram=3).lookup(
        [4, 1, 2, 3, 9, 1, 2, 3]
    ) == [9, 1]
    assert (
        PromptLookupProposer(num_tokens=2, max_ngram=3, min_ngram=3).lookup(seq) == []
    )  # 2-grams only
    for bad in ({"max_ngram": 0}, {"max_ngram": 2, "min_ngram": 3}, {"min_ngram": 0}):
        with pytest.raises(ValueError, match="1 <= min_ngram <= max_ngram"):
            PromptLookupProposer(**bad)


# ---------------------------------------------------------------------------------------
# Drawing children without replacement


def test_draws_are_successive_draws_without_replacement():
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


def test_every_q_row_is_the_parent_distribution_without_the_earlier_draws():
    """Row i of q is exactly what draw i was drawn from: `dist` with draws 0..i-1 zeroed and
    renormalised (a row left un-updated or un-normalised would bias the verification)."""
    from eagle.proposers.template import sample_without_replacement

    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        dist = torch.rand(7, generator=g) ** 3
        dist /= dist.sum()
        picks, q = sample_without_replacement(dist, 4, g)
        assert len(set(picks.tolist())) == 4
        for i in range(4):
            want = dist.clone()
            want[picks[:i]] = 0
            torch.testing.assert_close(q[i], want / want.sum(), rtol=1e-6, atol=1e-7)
            assert q[i, picks[i]] > 0  # the draw came from its own row


def test_draws_reach_tokens_far_below_the_top(monkeypatch):
    """A token 1e-12 as likely as the top one owns the top 1e-12 of the CDF, and must be drawn
    first when the uniform lands there (1 - 1e-15). Float32 uniforms stop at 1 - 2^-24 and a
    float32 CDF rounds its interval away, so no token below ~1e-8 of the row could be drawn
    first while its recorded q kept its full mass."""
    from eagle.proposers.template import sample_without_replacement

    def extreme_rand(
        shape, generator=None, device=None, dtype=torch.float32
    ):  # torch.rand's range: [0, 1)
        below_one = torch.nextafter(torch.ones((), dtype=dtype), torch.zeros((), dtype=dtype))
        return torch.minimum(torch.full(shape, 1 - 1e-15, dtype=torch.float64).to(dtype), below_one)

    monkeypatch.setattr(torch, "rand", extreme_rand)
    dist = torch.tensor([1.0, 1e-12], dtype=torch.float64)
    picks, q = sample_without_replacement(dist / dist.sum(), 2)
    assert picks.tolist() == [1, 0]
    assert q[0, 1] > 0  # its recorded proposal is the true one


def test_draws_past_an_exhausted_support_are_one_hot():
    from eagle.proposers.template import sample_without_replacement

    dist = torch.tensor([0.0, 0.7, 0.0, 0.3, 0.0])
    picks, q = sample_without_replacement(dist, 4, torch.Generator().manual_seed(0))
    assert sorted(picks[:2].tolist()) == [1, 3] and len(set(picks.tolist())) == 4
    assert torch.isfinite(q).all() and torch.allclose(q.sum(-1), torch.ones(4))
    for i in (2, 3):
        assert q[i, picks[i]] == 1.0  # deterministic picks: one-hot proposals


def test_a_generator_on_another_device_is_refused_before_decoding():
    """Sampling draws on the model's device (CUDA sampling refuses a CPU generator): a generator
    elsewhere is refused with the fix, before any forward (the target here is on `meta`)."""
    from eagle.sampling import SamplingPolicy, seeded_generator

    target = make_tiny_model("llama").to("meta")
    decoder = SpeculativeDecoder(target, policy=SamplingPolicy(temperature=1.0))
    with pytest.raises(
        ValueError, match="generator is on cpu but the model on meta: create it there"
    ):
        decoder.generate([1, 5, 7], 4, generator=seeded_generator(0, "cpu"))


def test_inputs_the_engine_cannot_decode_are_refused_clearly():
    """A batch is not one prompt; a draft model of another vocabulary (its ids would mean other
    tokens, or none) is refused before its first tree is verified; a drafter whose logits are
    NaN (a float16 overflow) would still decode exactly, accepting nothing: it is named."""
    from eagle.decoding.engine import DraftTree, Proposer, check_tree

    target = make_tiny_model("llama")
    vocab = target.config.vocab_size
    with pytest.raises(
        ValueError, match=r"one sequence: give \(T,\) or \(1, T\) token ids, not \(2, 3\)"
    ):
        SpeculativeDecoder(target).generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), 3)
    for other in (
        vocab - 6,
        vocab + 4,
    ):  # smaller: ids that fit but mean other tokens; larger: ids past V
        draft = make_tiny_model("llama", vocab_size=other)
        decoder = SpeculativeDecoder(target, TemplateProposer(DraftLM(draft), tree("chain5")))
        with pytest.raises(
            ValueError, match=f"draft LM has a vocabulary of {other} tokens, the target {vocab}"
        ):
            decoder.generate([1, 5, 7], 4)

    class Outside(Proposer):
        name = "outside"

        def propose(self, state):
            return DraftTree(tokens=torch.tensor([vocab]), parents=(-1, 0))

    with pytest.raises(
        ValueError, match=f"outside drafted token ids outside the target's vocabulary of {vocab}"
    ):
        SpeculativeDecoder(target, Outside()).generate([1, 5, 7], 4)
    with pytest.raises(ValueError, match="proposal distributions over 7 tokens"):
        check_tree(
            DraftTree(tokens=torch.tensor([3]), parents=(-1, 0), q=torch.zeros(1, 7)), vocab, "p"
        )

    nan_drafter = make_tiny_model("llama")
    with torch.no_grad():
        nan_drafter.lm_head.weight.fill_(float("nan"))
    decoder = SpeculativeDecoder(target, TemplateProposer(DraftLM(nan_drafter), tree("chain5")))
    with pytest.raises(ValueError, match="the draft model's logits are NaN"):
        decoder.generate([1, 5, 7], 4)


def test_a_static_cache_keeps_each_layer_on_its_own_device():
    """A target spread over GPUs (`device_map="auto"`) calls each layer's cache update with that
    layer's tensors: its buffers go where they come from, and the slots, moves and row
    selections follow them ("meta" stands in for a second GPU here). Before, every layer was
    allocated on the first layer's device and `index_copy_` failed on the others."""
    from eagle.decoding.static_cache import StaticKVCache

    cache = StaticKVCache(2, 16, torch.float32, "cpu", batch=2)
    cache.prepare(0, torch.ones(4, 4, dtype=torch.bool).tril())
    cache.update(torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8), 0)
    cache.update(torch.zeros(2, 2, 4, 8, device="meta"), torch.zeros(2, 2, 4, 8, device="meta"), 1)
    assert (
        [k.device.type for k in cache.keys]
        == ["cpu", "meta"]
        == [v.device.type for v in cache.values]
    )
    cache.move(torch.tensor([2, 3]), torch.tensor([0, 1]))
    cache.select_rows([1])
    assert [tuple(k.shape) for k in cache.keys] == [(1, 2, 16, 8)] * 2 and cache.keys[
        1
    ].device.type == "meta"


def test_a_compiled_static_runner_keeps_its_largest_cache():
    """Under compile a static cache's size is part of the graph: after a long request a shorter
    one reuses the big cache (no new graph inside a timed region), where an eager runner sizes
    each sequence to fit (less attention over empty slots). The prefill runs eagerly, so this
    compiles nothing."""
    from eagle.decoding import StaticRunner
    from eagle.decoding.runners import STATIC_BUCKET

    target = make_tiny_model("llama")
    ids = torch.tensor([prompts(1, 96)[0][:8]])
    compiled, eager = StaticRunner(target, compile_mode="default"), StaticRunner(target)
    for runner in (compiled, eager):
        runner.prefill(ids, STATIC_BUCKET + 10)
        assert runner.capacity == 2 * STATIC_BUCKET
        runner.prefill(ids, 20)
    assert compiled.capacity == 2 * STATIC_BUCKET and eager.capacity == STATIC_BUCKET
    fixed = StaticRunner(target, max_len=300, compile_mode="default")
    fixed.prefill(ids, 20)
    assert fixed.capacity == 300


def test_warm_up_decodes_the_longest_prompt_for_the_whole_budget_on_a_static_runner():
    """The warm-up request is the largest of the timed ones: a shorter one (16 tokens of the
    first prompt, as before) sized a static cache below the timed requests', whose new size
    then compiled inside the timed region. A growing cache takes the shorter warm-up asked for."""
    from eagle.bench.benchmark import warm_up

    calls = []

    class Recorder:
        def __init__(self, static):
            self.static = static

        def generate(self, ids, max_new_tokens, policy, generator=None):
            calls.append((len(ids), max_new_tokens))

    prompts = [[1] * 5, [1] * 40, [1] * 12]
    for static in (False, True):
        warm_up(Recorder(static), prompts, 128, SamplingPolicy())
        assert calls == [(40, 128)]
        calls.clear()
        warm_up(Recorder(static), prompts, 64, SamplingPolicy(), count=2)
        assert calls == [(40, 64), (12, 64)]
        calls.clear()
    warm_up(Recorder(True), prompts, 128, SamplingPolicy(), tokens=32)
    assert calls == [(40, 128)]  # static: the whole budget whatever is asked
    calls.clear()
    warm_up(Recorder(False), prompts, 128, SamplingPolicy(), count=2, tokens=32)
    assert calls == [(40, 32), (12, 32)]
    calls.clear()
    warm_up(Recorder(False), prompts, 16, SamplingPolicy(), tokens=32)
    assert calls == [(40, 16)]  # never beyond the timed budget


def test_requests_that_cannot_be_served_are_refused_before_decoding():
    """No new tokens asked (it used to stream one and report zero); a tree wider than the draft
    model's vocabulary (it failed in top-k after the prefill); a Hugging Face method with a prompt
    past the context (it decoded garbage)."""
    from eagle.bench.methods import METHODS, HFMethod
    from eagle.tree import TreeTemplate

    target = make_tiny_model("llama", max_position_embeddings=64)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"max_new_tokens must be >= 1, got {bad}"):
            SpeculativeDecoder(target).generate([1, 5, 7], bad)
    roomy = make_tiny_model("llama")  # a context of 512: room for the 101 tree tokens
    wide = TreeTemplate.from_paths(
        [[r] for r in range(100)], "wide100"
    )  # the vocabulary has 96 tokens
    with pytest.raises(
        ValueError,
        match="'wide100' takes the top 100 of a node, more than the draft model's "
        "vocabulary of 96 tokens",
    ):
        SpeculativeDecoder(roomy, TemplateProposer(DraftLM(roomy), wide)).generate([1, 5, 7], 4)
    hf = HFMethod("hf_generate", METHODS["hf_generate"], target, eos_token_id=None)
    with pytest.raises(ContextOverflowError, match="exceed the target's context of 64"):
        hf.generate(list(range(3, 63)), 8, SamplingPolicy())
    # a draft LM with fewer positions than the target (GPT-2's table of 32): refused before
    # decoding, not an index error in its position table mid-decode
    short = make_tiny_model("gpt2", max_position_embeddings=32)
    chain = TemplateProposer(DraftLM(short), TreeTemplate.chain(3), name="draft")
    with pytest.raises(
        ContextOverflowError,
        match=r"\(40\) \+ max_new_tokens \(4\) \+ tree \(4\) = 48 tokens "
        "exceed draft's draft model's context of 32",
    ):
        SpeculativeDecoder(roomy, chain).generate(list(range(3, 43)), 4)
    assert len(SpeculativeDecoder(roomy, chain).generate(list(range(3, 23)), 4).tokens) == 4
