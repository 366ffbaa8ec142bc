"""The EAGLE drafter computes what EAGLE-1 specifies, and the EAGLE proposer drafts what it should.

Model: a hand-written forward (fc -> RoPE/GQA attention -> residual -> post-attention
RMSNorm -> MLP -> residual) in plain torch; cached and tree-masked forwards equal plain
causal ones. Proposer: tree drafting equals evaluating each path sequentially with the
parents' predicted features; a trained drafter's paths are accepted, with EOS inside them;
the drafter's cache holds no branch KV between rounds. The proposer tests run with the
growing caches and with the static ones (drafter and target). Greedy and sampled exactness
of the EAGLE proposer on every runner and family: tests/test_conformance.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eagle.decoding import SpeculativeDecoder, StaticRunner, make_runner
from eagle.decoding.draft_cache import draft_cache
from eagle.decoding.masks import tree_attention_mask
from eagle.models.drafter import DrafterConfig, EagleDrafter
from eagle.proposers import eagle_proposer
from eagle.proposers.eagle import EagleDraftModel, pass_shape
from eagle.proposers.template import TemplateProposer
from eagle.target import target_forward
from eagle.tree import TreeTemplate
from helpers.decoding import greedy_cases, hf_greedy, prompts, run_greedy_cases, tree
from helpers.drafters import FakeTokenizer, perturbed, train_tiny_drafter
from helpers.models import make_tiny_model

# ---------------------------------------------------------------------------------------
# The model


def hand_forward(d: EagleDrafter, features, input_ids, positions):
    """EAGLE-1's drafter in plain torch, from the module's weights."""
    cfg = d.config
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    layer = d.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    b, t, _ = features.shape
    x = torch.cat([features, d.embed_tokens.weight[input_ids]], -1)  # (B, T, 2H): [f; E(x)]
    h = x @ d.fc.weight.T + d.fc.bias  # (B, T, H)

    q = (h @ attn.q_proj.weight.T).view(b, t, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
    k = (h @ attn.k_proj.weight.T).view(b, t, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
    v = (h @ attn.v_proj.weight.T).view(b, t, nkv, hd).transpose(1, 2)
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
    angle = positions.double()[:, None] * inv_freq[None]  # (T, hd/2)
    cos = torch.cat([angle.cos(), angle.cos()], -1).float()  # (T, hd)
    sin = torch.cat([angle.sin(), angle.sin()], -1).float()

    def rope(z):  # rotate pairs (i, i + hd/2)
        z1, z2 = z[..., : hd // 2], z[..., hd // 2:]
        return z * cos + torch.cat([-z2, z1], -1) * sin

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(nh // nkv, dim=1)  # GQA: KV head j serves query heads j*g..(j+1)*g-1
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)  # (B, nh, T, T)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * hd)  # (B, T, nh*hd)
    h = h + o @ attn.o_proj.weight.T  # no pre-attention norm

    norm = layer.post_attention_layernorm
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * norm.weight
    m = (F.silu(n @ mlp.gate_proj.weight.T) * (n @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return h + m  # no final norm


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("mistral", {"head_dim": 16}),
                                              ("qwen2", {"rope_theta": 500.0})])
def test_forward_matches_hand_computation(family, overrides):
    target = make_tiny_model(family, **overrides)
    d = perturbed(EagleDrafter.random(target, seed=3))
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 7, 32, generator=g)
    ids = torch.randint(0, 96, (2, 7), generator=g)
    with torch.no_grad():
        ours = d(feats, ids)
        ref = hand_forward(d, feats, ids, torch.arange(7))
        # explicit positions: RoPE is relative, an offset changes nothing
        shifted = d(feats, ids, position_ids=torch.arange(5, 12)[None])
    assert ours.shape == (2, 7, 32)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shifted, ref, atol=1e-5, rtol=1e-5)
    assert d.logits(ours).shape == (2, 7, 96)
    torch.testing.assert_close(d.logits(ours), target.lm_head(ours))


@pytest.mark.parametrize("inputs", ["shifted", "unshifted", "feature", "token"])
def test_fc_reads_the_configured_inputs(inputs):
    """EAGLE-1's ablation inputs: the fc reads [f_{t-1}; E(x_t)], [f_{t-1}; E(x_{t-1})], f_{t-1}
    or E(x_t), and an unshifted drafter refuses to run without x_{t-1}."""
    target = make_tiny_model("llama")
    d = EagleDrafter.random(target, seed=1, inputs=inputs)
    g = torch.Generator().manual_seed(0)
    f = torch.randn(2, 5, d.config.hidden_size, generator=g)
    x = torch.randint(0, d.config.vocab_size, (2, 5), generator=g)
    p = torch.randint(0, d.config.vocab_size, (2, 5), generator=g)
    seen = []
    d.fc.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    d(f, x, prev_ids=p)
    emb = d.embed_tokens.weight
    want = {"shifted": torch.cat([f, emb[x]], -1), "unshifted": torch.cat([f, emb[p]], -1),
            "feature": f, "token": emb[x]}[inputs]
    assert torch.equal(seen[0], want)
    assert d.needs_prev_ids == (inputs == "unshifted")
    if inputs == "unshifted":
        with pytest.raises(ValueError, match="prev_ids"):
            d(f, x)
    with pytest.raises(ValueError, match="inputs must be one of"):
        EagleDrafter.random(target, inputs="shifted_token")


def test_target_modules_are_frozen_and_never_saved():
    target = make_tiny_model("llama", tie_word_embeddings=False)
    d = EagleDrafter.random(target)
    keys = set(d.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in keys), keys
    assert keys == {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
                    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    own = {id(p) for p in d.parameters()}
    assert id(target.lm_head.weight) not in own and id(target.model.embed_tokens.weight) not in own
    assert d.embed_tokens is target.model.embed_tokens and d.lm_head is target.lm_head
    assert not d.embed_tokens.weight.requires_grad and not d.lm_head.weight.requires_grad

    feats, ids = torch.randn(1, 5, 32), torch.randint(0, 96, (1, 5))
    d.logits(d(feats, ids)).logsumexp(-1).sum().backward()
    assert d.embed_tokens.weight.grad is None and d.lm_head.weight.grad is None
    assert all(p.grad is not None for p in d.parameters())
    # moving the drafter leaves the target's modules where the target is
    d.to(torch.float64)
    assert target.lm_head.weight.dtype == torch.float32
    assert d(feats, ids).dtype == torch.float64


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_config_from_target(family):
    target = make_tiny_model(family, num_key_value_heads=1, rope_theta=2500.0, rms_norm_eps=1e-5)
    cfg = DrafterConfig.from_target(target, FakeTokenizer(96), path="runs/tiny")
    tc = target.config
    assert (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
    ) == (32, 64, 4, 1, 8, 96)
    assert cfg.rope_theta == 2500.0 and cfg.rms_norm_eps == 1e-5 and cfg.hidden_act == tc.hidden_act
    assert cfg.max_position_embeddings == tc.max_position_embeddings
    assert cfg.target["model_type"] == family and cfg.target["target_path"] == "runs/tiny"
    assert cfg.target["hidden_size"] == 32 and len(cfg.target["tokenizer_hash"]) == 16
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown key"):
        DrafterConfig.from_dict({**cfg.to_dict(), "num_layers": 2})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        DrafterConfig.from_dict({**cfg.to_dict(), "num_key_value_heads": 3})
    # the layer is built with the target's GQA shape
    d = EagleDrafter.random(target)
    assert d.layers[0].self_attn.k_proj.weight.shape == (8, 32)


def test_config_from_a_target_whose_layers_differ():
    """Gemma-3/4 give each layer type its own rotary (and Gemma-4 its own head size): the drafter
    takes its last layer's, and a partial rotary (Gemma-4's full layers) as the default one at its
    base, which a Llama layer runs."""
    gemma3 = make_tiny_model("gemma3_text")  # layers: sliding (base 1e4), full (base 1e6)
    cfg = DrafterConfig.from_target(gemma3, FakeTokenizer(96))
    assert (
        cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e6} and cfg.rope_theta == 1e6
    )
    gemma4 = make_tiny_model("gemma4_text")  # head_dim 8 sliding, 16 full (the last layer)
    cfg = DrafterConfig.from_target(gemma4, FakeTokenizer(96))
    assert gemma4.config.rope_parameters["full_attention"]["partial_rotary_factor"] < 1
    assert cfg.head_dim == 16 and cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    d = EagleDrafter.random(gemma4)
    g = torch.Generator().manual_seed(0)
    feats, ids = torch.randn(1, 6, 32, generator=g), torch.randint(0, 96, (1, 6), generator=g)
    assert (
        d.layers[0].self_attn.q_proj.weight.shape == (4 * 16, 32)
        and torch.isfinite(d(feats, ids)).all()
    )


def test_incremental_decoding_with_cache_equals_full_forward():
    d = perturbed(EagleDrafter.random(make_tiny_model("qwen2")))
    g = torch.Generator().manual_seed(1)
    feats, ids = torch.randn(2, 10, 32, generator=g), torch.randint(0, 96, (2, 10), generator=g)
    with torch.no_grad():
        full = d(feats, ids)
        cache, parts, at = d.new_cache(), [], 0
        for n in (3, 1, 4, 2):  # chunks of several tokens and single tokens
            parts.append(d(feats[:, at : at + n], ids[:, at : at + n], cache=cache))
            at += n
    assert cache.get_seq_length() == 10
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_tree_mask_forward_equals_sequential_paths():
    d = perturbed(EagleDrafter.random(make_tiny_model("mistral")))
    tpl = TreeTemplate.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
    parents, depths = tpl.parents, tpl.depths
    g = torch.Generator().manual_seed(2)
    prefix, n = 6, tpl.num_nodes
    pf, pids = (
        torch.randn(1, prefix, 32, generator=g),
        torch.randint(0, 96, (1, prefix), generator=g),
    )
    tf, tids = torch.randn(1, n, 32, generator=g), torch.randint(0, 96, (1, n), generator=g)
    visible = tpl.buffers().attn_mask[1:, 1:]  # (n, n) among the draft nodes
    with torch.no_grad():
        cache = d.new_cache()
        d(pf, pids, cache=cache)
        mask = tree_attention_mask(prefix, visible, torch.float32)  # (1, 1, n, prefix + n)
        pos = torch.tensor([prefix + depths[i] - 1 for i in range(1, n + 1)])[None]
        tree_out = d(tf, tids, position_ids=pos, attention_mask=mask, cache=cache)[0]  # (n, H)
        for v in range(1, n + 1):
            path, u = [], v
            while u > 0:
                path.insert(0, u - 1)
                u = parents[u]
            seq = d(torch.cat([pf, tf[:, path]], 1), torch.cat([pids, tids[:, path]], 1))
            torch.testing.assert_close(tree_out[v - 1], seq[0, -1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# The proposer


def draft_model(cache: str, drafter, template: TreeTemplate) -> EagleDraftModel:
    """dynamic | static | padded: static with every pass padded to one shape, as compiled
    (here run eagerly, so the padding is tested without compiling)."""
    kv = draft_cache(
        "dynamic" if cache == "dynamic" else "static",
        drafter.llama_config,
        drafter.dtype,
        drafter.device,
    )
    return EagleDraftModel(
        drafter, kv, pass_shape=pass_shape(template) if cache == "padded" else None
    )


def eagle_setup(cache: str, target, drafter, template: TreeTemplate, proposal: str = "topk"):
    """(proposer, target runner): both caches growing, or both static."""
    proposer = TemplateProposer(
        draft_model(cache, drafter, template), template, proposal=proposal, name="eagle"
    )
    return proposer, make_runner(
        "dynamic" if cache == "dynamic" else "static", target, tree_size=template.num_nodes
    )


def test_pass_shape_fits_every_pass_of_a_round():
    assert pass_shape(tree("eagle_default")) == (
        6,
        10,
    )  # catch-up of 6; depths feed 4, 4, 1, 1 of 10 expanded
    assert pass_shape(tree("chain5")) == (
        6,
        6,
    )  # the catch-up sees up to 6 entries; 4 nodes expanded


def test_padded_passes_of_a_deep_chain_fit_the_draft_cache_to_the_last_token():
    """Every padded pass writes depth + 1 rows: the last depth of a chain of 8 starts 6 entries
    after the committed ones, so near the end of a sequence its padding ran past a draft cache
    sized to the sequence ("cannot hold 55 entries"). Decoding to the last token of a budget
    must fit, and give the unpadded passes' text."""
    target = make_tiny_model("llama")
    d = EagleDrafter.random(target, seed=4)
    chain = TreeTemplate.chain(8)
    texts = []
    for cache in ("static", "padded"):
        proposer = TemplateProposer(draft_model(cache, d, chain), chain, name="eagle")
        runner = StaticRunner(
            target, tree_size=8, max_len=5 + 40 + 8 + 1
        )  # the request's exact size
        texts.append(
            SpeculativeDecoder(target, proposer, eos_token_id=[], runner=runner)
            .generate([5, 6, 7, 8, 9], 40)
            .tokens
        )
    assert len(texts[1]) == 40 and texts[1] == texts[0]


@pytest.mark.parametrize(
    "cache,inputs",
    [
        ("dynamic", "shifted"),
        ("static", "shifted"),
        ("padded", "shifted"),
        ("dynamic", "unshifted"),
        ("padded", "unshifted"),
        ("dynamic", "feature"),
        ("static", "token"),
    ],
)
def test_tree_drafting_equals_sequential_evaluation_with_parent_features(cache, inputs):
    """Every drafted node's f_hat equals a plain causal drafter run over the committed
    tokens (with the target's true features) and then the node's path (each node fed its
    parent's f_hat); children are the top-k of their parent. Checked in every round, so
    catch-up after partial acceptance and branch-KV removal are covered too, and so is the
    decode-time pairing [f_{t-1}; E(x_t)]: shifting it by one token fails here (no tau needed).
    The ablation's other inputs draft by the same rule (an unshifted drafter reads each
    position's previous token: the token before a catch-up token, a node's parent's)."""
    target = make_tiny_model("llama")
    d = EagleDrafter.random(target, seed=4, inputs=inputs)
    tpl = tree("eagle_default")
    model = draft_model(cache, d, tpl)
    proposer = TemplateProposer(model, tpl, name="eagle")
    calls: dict[str, list] = {"catch_up": [], "step": []}
    catch_up, step, propose = model.catch_up, model.step, proposer.propose

    def spy_catch_up(state):
        out = catch_up(state)
        calls["catch_up"].append(out)
        return out

    def spy_step(tokens, parent_hidden, position_ids, visible, **kw):
        out = step(tokens, parent_hidden, position_ids, visible, **kw)
        calls["step"].append((parent_hidden, out))
        return out

    checked = []

    def spy_propose(state):
        calls["catch_up"].clear()
        calls["step"].clear()
        drafted = propose(state)
        committed = torch.tensor([state.tokens])
        features = target_forward(target, committed[:, :-1]).features  # (1, L, H): f_0..f_{L-1}
        root_logits, root_hidden = calls["catch_up"][0]
        ref = d(features, committed[:, 1:], prev_ids=committed[:, :-1])[0, -1]
        torch.testing.assert_close(root_hidden, ref, atol=1e-4, rtol=1e-4)
        hidden, logits = {0: root_hidden}, {0: root_logits}
        depth_calls = [nodes for nodes in proposer.expanded_by_depth[1:] if nodes]
        assert len(depth_calls) == len(calls["step"])
        for nodes, (parent_hidden, (out_logits, out_hidden)) in zip(
            depth_calls, calls["step"], strict=True
        ):
            for j, v in enumerate(nodes):
                assert torch.equal(parent_hidden[j], hidden[tpl.parents[v]])
                hidden[v], logits[v] = out_hidden[j], out_logits[j]
                path, u = [], v
                while u > 0:
                    path.insert(0, u)
                    u = tpl.parents[u]
                feats = torch.cat(
                    [features, torch.stack([hidden[tpl.parents[u]] for u in path])[None]], 1
                )
                seq = torch.cat([committed, drafted.tokens[[u - 1 for u in path]][None]], 1)
                ref = d(feats, seq[:, 1:], prev_ids=seq[:, :-1])[0, -1]
                torch.testing.assert_close(out_hidden[j], ref, atol=1e-4, rtol=1e-4)
        for v, kids in enumerate(tpl.children):
            if kids:
                want = logits[v].topk(len(kids)).indices
                assert drafted.tokens[[k - 1 for k in kids]].tolist() == want.tolist()
        checked.append(len(state.tokens))
        return drafted

    proposer.propose = spy_propose
    model.catch_up, model.step = spy_catch_up, spy_step
    prompt = prompts(4, 96)[3]
    runner = make_runner(
        "dynamic" if cache == "dynamic" else "static", target, tree_size=tpl.num_nodes
    )
    res = SpeculativeDecoder(target, proposer, eos_token_id=[], runner=runner).generate(prompt, 12)
    assert res.tokens == hf_greedy(target, prompt, 12, None)
    assert len(checked) == len(res.stats.rounds) > 3


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sampled_children_record_the_proposals_they_were_drawn_from(cache):
    """Under sampling, each expanded node's children are distinct draws from its draft
    distribution q, and child i records q with its earlier siblings zeroed and renormalised:
    exactly what the verification must divide by (a row left as q, or not renormalised, fails)."""
    from eagle.sampling import SamplingPolicy

    target = make_tiny_model("llama")
    drafter = EagleDrafter.random(target, seed=6)
    tpl = tree("eagle_default")
    model = draft_model(cache, drafter, tpl)
    proposer = TemplateProposer(model, tpl, proposal="sample", name="eagle")
    policy = SamplingPolicy(temperature=1.5)
    logits: dict[int, torch.Tensor] = {}
    catch_up, step = model.catch_up, model.step

    def spy_catch_up(state):
        out = catch_up(state)
        logits.clear()
        logits[0] = out[0]
        return out

    def spy_step(tokens, parent_hidden, position_ids, visible, **kw):
        out = step(tokens, parent_hidden, position_ids, visible, **kw)
        depth = int(position_ids[0]) - root_pos[0]
        for j, v in enumerate(proposer.expanded_by_depth[depth]):
            logits[v] = out[0][j]
        return out

    root_pos, rounds = [0], []
    propose = proposer.propose

    def spy_propose(state):
        root_pos[0] = len(state.tokens) - 1
        drafted = propose(state)
        for v, kids in enumerate(tpl.children):
            if not kids:
                continue
            q = policy.probs(logits[v].float())  # the parent's draft distribution
            toks = drafted.tokens[[k - 1 for k in kids]].tolist()
            assert len(set(toks)) == len(toks), "children drawn with replacement"
            for i, k in enumerate(kids):
                want = q.clone()
                want[toks[:i]] = 0
                torch.testing.assert_close(
                    drafted.q[k - 1], want / want.sum(), rtol=1e-5, atol=1e-7
                )
        rounds.append(1)
        return drafted

    model.catch_up, model.step, proposer.propose = spy_catch_up, spy_step, spy_propose
    runner = make_runner(
        "dynamic" if cache == "dynamic" else "static", target, tree_size=tpl.num_nodes
    )
    decoder = SpeculativeDecoder(target, proposer, policy, eos_token_id=[], runner=runner)
    decoder.generate(prompts(3, 96)[2], 20, generator=torch.Generator().manual_seed(0))
    assert len(rounds) > 3


@pytest.fixture(scope="module")
def trained_llama():
    """A tiny Llama target and a drafter trained on its own greedy continuations."""
    return train_tiny_drafter()


@pytest.mark.parametrize("cache", ["dynamic", "static", "padded"])
def test_greedy_identical_with_accepting_drafter_and_eos_inside_path(trained_llama, cache):
    """EOS chosen as a token the decoder accepts mid-path, so the stop must cut the path."""
    target, drafter = trained_llama
    inside = 0
    for name in ("eagle_default", "chain5"):
        proposer, runner = eagle_setup(cache, target, drafter, tree(name))
        for prompt in prompts(8, 96, seed=9):
            blocks: list[list[int]] = []
            free = SpeculativeDecoder(target, proposer, eos_token_id=[], runner=runner).generate(
                prompt, 32, on_commit=blocks.append
            )
            assert free.tokens == hf_greedy(target, prompt, 32, None), (
                f"{name}: prompt of {len(prompt)}"
            )
            # a token that first appears inside an accepted path, not at its end
            at, eos = 0, None
            for block in blocks:
                for j, tok in enumerate(block[:-1]):
                    if eos is None and tok not in free.tokens[: at + j]:
                        eos = tok
                at += len(block)
            if eos is None:
                continue
            res = SpeculativeDecoder(target, proposer, eos_token_id=eos, runner=runner).generate(
                prompt, 32
            )
            assert res.tokens == hf_greedy(target, prompt, 32, eos), (
                f"{name}: prompt of {len(prompt)}, eos {eos}"
            )
            last = res.stats.rounds[-1]
            assert last.committed < last.accepted + 1  # the accepted path was cut at the EOS
            inside += 1
    assert inside >= 4


def test_trained_drafter_is_accepted(trained_llama):
    target, drafter = trained_llama
    proposer = eagle_proposer(drafter, tree("eagle_default"))
    committed = rounds = 0
    for prompt in prompts(6, 96, seed=5):
        res = SpeculativeDecoder(target, proposer, eos_token_id=[]).generate(prompt, 40)
        committed += sum(r.committed for r in res.stats.rounds)
        rounds += len(res.stats.rounds)
    assert committed / rounds > 1.3  # tau; an untrained drafter gets ~1.05 here


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_drafter_cache_holds_committed_context_only(trained_llama, cache):
    target, drafter = trained_llama
    proposer, runner = eagle_setup(cache, target, drafter, tree("eagle_default"))
    model = proposer.model
    seen = []
    catch_up, accept = model.catch_up, proposer.accept

    def spy_catch_up(state):
        out = catch_up(state)
        assert model.cache.length == len(state.tokens) - 1  # x_1..x_L: x_0 has no previous feature
        return out

    def spy_accept(state, tree_, path):
        accept(state, tree_, path)
        new = state.new_features.shape[1]  # the block just committed, fed at the next catch-up
        assert model.cache.length == len(state.tokens) - 1 - new, (
            "branch KV left in the drafter cache"
        )
        seen.append(len(path))

    model.catch_up, proposer.accept = spy_catch_up, spy_accept
    SpeculativeDecoder(target, proposer, eos_token_id=[], runner=runner).generate(
        prompts(3, 96)[2], 40
    )
    assert len(seen) > 5 and max(seen) > 2  # several rounds, some accepting deep paths


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["default", "onednn"])
def test_compiled_static_decoding_identical_to_generate(trained_llama, kernels):
    """torch.compile (inductor on the CPU, ~20 s of compiling) of the static target and drafter
    passes changes no token: vanilla and EAGLE, trees and chains, EOS inside a path; with the
    linears frozen onto MKL's packed products or, on oneDNN kernels, onto oneDNN's (compiled with
    dynamic shapes, eagle.decoding.compile)."""
    from eagle.kernels import available_kernels, use_kernels

    if kernels not in available_kernels("cpu"):
        pytest.skip(f"no {kernels} kernels in this PyTorch build")
    torch._dynamo.reset()  # fresh graphs (and recompile budget) for each kernels setting
    target, drafter = trained_llama
    use_kernels(target, kernels), use_kernels(drafter, kernels)
    try:
        cases = greedy_cases(target, 6)  # generate's own output, eager, on the same kernels
        for name in ("eagle_default", "chain5"):
            template = tree(name)
            proposer = eagle_proposer(drafter, template, cache="static", compile_mode="default")
            runner = StaticRunner(target, tree_size=template.num_nodes, compile_mode="default")
            run_greedy_cases(target, proposer, runner, cases, f"compiled/{kernels}/{name}")
        run_greedy_cases(
            target,
            None,
            StaticRunner(target, compile_mode="default"),
            cases,
            f"compiled/{kernels}/vanilla",
        )
    finally:
        use_kernels(target, "default"), use_kernels(drafter, "default")
