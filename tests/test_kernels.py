"""The linears' kernels (eagle/kernels/): oneDNN's packed products compute what
`F.linear` does, switch a model in place without changing what it is, step aside for training,
compile and other dtypes, and decode exactly: greedy output identical to `generate` of the same
target, for every method family. Which kernels are faster is measured, never asserted here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle.bench.precision import KernelChoice, faster_kernels, pick_kernels
from eagle.decoding import make_runner
from eagle.decoding.backend import MARK, PLAIN, backend_of, kernels_of
from eagle.decoding.compile import clone_outputs, compile_static
from eagle.decoding.kv_cache import GrowingCache
from eagle.decoding.static_cache import StaticKVCache
from eagle.kernels import (
    BACKENDS,
    available_kernels,
    check_kernels,
    free_memory_bytes,
    packed_bytes,
    use_kernels,
)
from eagle.kernels.fused import FusedBackbone, FusedLayer
from eagle.kernels.onednn import SIBLINGS, PackedLinear
from eagle.models.drafter import EagleDrafter, restricted_linear
from eagle.models.medusa import MedusaHeads
from eagle.proposers import (
    DraftLM,
    PromptLookupProposer,
    TemplateProposer,
    eagle_proposer,
    medusa_proposer,
)
from helpers.configs import compose_config
from helpers.decoding import greedy_cases, run_greedy_cases, tree
from helpers.models import make_tiny_model

pytestmark = pytest.mark.skipif(
    "onednn" not in available_kernels("cpu"), reason="this PyTorch build has no oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "shape", [(1, 48), (2, 48), (8, 48), (26, 48), (64, 48), (2, 5, 48), (1, 1, 1, 48)]
)
def test_packed_products_equal_f_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 200, bias=bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        use_kernels(linear, "onednn")
        got = linear(x)
    assert isinstance(linear, PackedLinear) and linear._packed is not None, (
        "the packed kernel must have run"
    )
    assert got.shape == expected.shape == (*shape[:-1], 200)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_switching_keeps_the_module_its_parameters_and_a_tied_head():
    model = make_tiny_model("llama", tie_word_embeddings=True)
    head, keys = model.lm_head, list(model.state_dict())
    use_kernels(model, "onednn")
    assert kernels_of(model) == "onednn" and model.lm_head is head and isinstance(head, nn.Linear)
    assert head.weight is model.model.embed_tokens.weight, "a tied head stays tied"
    assert list(model.state_dict()) == keys and not any("packed" in k for k in model.state_dict())
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    packed = model.lm_head._packed
    use_kernels(model, "default", release=False)  # kept for a switch back (timing both kernels)
    assert kernels_of(model) == "default" and type(model.lm_head) is nn.Linear
    assert use_kernels(model, "onednn").lm_head.packed_weight() is packed
    use_kernels(model, "default")
    assert kernels_of(model) == "default" and type(model.lm_head) is nn.Linear
    assert not hasattr(model.lm_head, "_packed")


def test_a_changed_weight_is_packed_again():
    torch.manual_seed(0)
    linear = use_kernels(nn.Linear(16, 24), "onednn").requires_grad_(False)
    x = torch.randn(3, 16)
    first = linear(x)
    with torch.no_grad():
        linear.weight.mul_(2.0)  # as load_state_dict or an optimizer step would change it
    torch.testing.assert_close(
        linear(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5
    )
    assert not torch.allclose(linear(x), first)


def _packed_products(model, *args) -> int:
    """oneDNN products one call of `model` runs (counted by the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(*args)
    return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])  # qwen2: q/k/v with biases
def test_sibling_linears_share_one_product(family):
    """q/k/v and gate/up run as one packed product each (4 a layer instead of 7, and the head),
    with the logits of separate products."""
    model = make_tiny_model(family)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.inference_mode():
        expected = model(ids).logits
        use_kernels(model, "onednn")
        layers = model.config.num_hidden_layers
        assert _packed_products(model, ids) == 4 * layers + 1
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    groups = {
        id(m._siblings) for m in model.modules() if isinstance(m, PackedLinear) and m._siblings
    }
    assert len(groups) == len(SIBLINGS) * layers
    use_kernels(model, "default")
    assert not any(hasattr(m, "_siblings") for m in model.modules()), (
        "switching back frees the shared products"
    )


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(16, 16),
            nn.Linear(16, 8),
            nn.Linear(16, 8),
        )


def test_siblings_on_other_inputs_or_changed_weights_compute_their_own():
    """A sibling called on another tensor than the group's last product (or twice, or after its
    input changed in place) computes anew; a changed weight is packed again."""
    torch.manual_seed(0)
    attn = use_kernels(_Attention(), "onednn").requires_grad_(False)
    x, y = torch.randn(3, 16), torch.randn(3, 16)

    def ref(m, t):
        return F.linear(t, m.weight, m.bias)

    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.q_proj(x), ref(attn.q_proj, x), **close)
    assert attn.k_proj(x).is_contiguous(), (
        "each output is laid out as F.linear's (a model may view it)"
    )
    torch.testing.assert_close(
        attn.k_proj(y), ref(attn.k_proj, y), **close
    )  # not x: its own product
    torch.testing.assert_close(
        attn.v_proj(x), ref(attn.v_proj, x), **close
    )  # y's product now, not x's
    torch.testing.assert_close(attn.v_proj(y), ref(attn.v_proj, y), **close)
    torch.testing.assert_close(
        attn.v_proj(y), ref(attn.v_proj, y), **close
    )  # taken once: computed anew
    attn.q_proj(x)
    x.mul_(2.0)  # changed in place between siblings: its version counter moved
    torch.testing.assert_close(attn.k_proj(x), ref(attn.k_proj, x), **close)
    with torch.no_grad():
        attn.v_proj.weight.mul_(3.0)
        attn.k_proj.bias.add_(1.0)
    attn.q_proj(y)
    torch.testing.assert_close(attn.k_proj(y), ref(attn.k_proj, y), **close)
    torch.testing.assert_close(attn.v_proj(y), ref(attn.v_proj, y), **close)
    assert (
        attn.q_proj._siblings is attn.v_proj._siblings and attn.q_proj._siblings._input is None
    ), "once every sibling took its output, the group holds no reference to the input"


def test_training_bf16_and_compile_take_f_linear():
    torch.manual_seed(0)
    linear = use_kernels(nn.Linear(16, 8), "onednn")
    x = torch.randn(4, 16, requires_grad=True)
    linear(x).sum().backward()  # gradients flow: the packed op has none, so it must not run
    assert linear._packed is None and x.grad is not None and linear.weight.grad is not None
    half = use_kernels(nn.Linear(16, 8).to(torch.bfloat16).requires_grad_(False), "onednn")
    xb = torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(half(xb), F.linear(xb, half.weight, half.bias)) and half._packed is None
    compiled = torch.compile(lambda t: linear(t), backend="eager")  # Dynamo traces F.linear
    with torch.inference_mode():
        torch.testing.assert_close(
            compiled(x.detach()), F.linear(x.detach(), linear.weight, linear.bias)
        )


# the packed product a frozen compiled linear runs, by the kernels of its module
# (eagle.decoding.compile: the backend's `dynamic_compile`)
FROZEN_OPS = {
    "default": "torch.ops.mkl._mkl_linear",
    "onednn": "torch.ops.mkldnn._linear_pointwise",
}


@pytest.mark.parametrize("kernels", list(FROZEN_OPS))
def test_compiled_passes_freeze_their_linears_onto_the_modules_kernels(kernels):
    """compile_static freezes the weights into the graph (Inductor's packed products, not `mm` on
    weights passed in each call), on MKL's product for a module on the default kernels and on
    oneDNN's for one on oneDNN (compiled with a symbolic row count), and computes what eager does.
    """
    from torch._inductor.utils import run_and_get_code

    if kernels == "default" and not torch._C.has_mkl:
        pytest.skip("this PyTorch build has no MKL")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = use_kernels(
        nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32)).requires_grad_(False),
        kernels,
    )
    run = compile_static(model, "default", model)
    x = torch.randn(1, 8, 64)
    with torch.inference_mode():
        out, code = run_and_get_code(run, x)
        torch.testing.assert_close(out, model(x))
        torch.testing.assert_close(run(x[:, :5]), model(x[:, :5]))  # another row count
    code = "\n".join(code)
    assert code.count(FROZEN_OPS[kernels]) >= 2, code
    assert "extern_kernels.mm(" not in code and "extern_kernels.addmm(" not in code


def test_cuda_graph_passes_return_what_the_function_returns():
    """The CUDA-graph wrapper ("reduce-overhead": a new graph step per call, outputs cloned so that
    a later replay cannot overwrite them) keeps its function's output structure: the drafter pass
    returns one tensor, the verification a tuple. It once turned a tensor into a tuple of its rows,
    which only a GPU ran. Off a GPU Inductor compiles without graphs; the wrapper is the same."""
    torch._dynamo.reset()
    x = torch.arange(6.0).reshape(2, 3)
    one = compile_static(lambda t: t * 2, "reduce-overhead")(x)
    assert isinstance(one, torch.Tensor) and torch.equal(one, x * 2)
    pair = compile_static(lambda t: (t + 1, t.sum(-1)), "reduce-overhead")(x)
    assert (
        isinstance(pair, tuple) and torch.equal(pair[0], x + 1) and torch.equal(pair[1], x.sum(-1))
    )
    assert clone_outputs(x) is not x and torch.equal(clone_outputs(x), x)


@pytest.mark.parametrize("kernels", list(FROZEN_OPS))
def test_a_compiled_static_runner_scores_what_the_eager_one_does(kernels):
    """Rounds of compiled static runners (frozen weights; vanilla's 1-token step and a small tree)
    against eager ones on the same kernels: the same logits round after round, request after
    request and runner after runner, so each round reads the KV that its own runner's prefill and
    previous rounds wrote (a cache frozen into the graph with the weights, as Dynamo freezes
    static-address tensors, would be the first runner's)."""
    torch._dynamo.reset()
    target = use_kernels(make_tiny_model("llama"), kernels)
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    # (draft nodes, parents, the paths committed round after round)
    shapes = [(0, (-1,), [[0]] * 6), (3, (-1, 0, 1, 0), [[0, 1, 2], [0], [0, 3], [0, 1]])]
    for size, parents, paths in shapes:
        runners = [
            make_runner("static", target, tree_size=size, max_len=None, compile_mode=mode)
            for mode in (None, "default")
        ]
        for prompt_len in (40, 12, 30):
            if (
                prompt_len == 30
            ):  # a new compiled runner of the same shape reuses the graph, with its own cache
                runners[1] = make_runner(
                    "static", target, tree_size=size, max_len=None, compile_mode="default"
                )
            prompt = torch.randint(0, vocab, (1, prompt_len), generator=gen)
            with torch.inference_mode():
                for runner in runners:
                    runner.prefill(prompt, prompt_len + 24)
                for path in paths:
                    tokens = torch.randint(0, vocab, (1, len(parents)), generator=gen)
                    eager, compiled = (runner.verify(tokens, [parents]) for runner in runners)
                    torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-4, rtol=1e-4)
                    for runner in runners:
                        runner.commit([path])


def test_packed_bytes_count_float32_linears_and_free_memory_is_known_here():
    model = make_tiny_model("llama", tie_word_embeddings=False)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert packed_bytes(model) == sum(m.weight.numel() * 4 for m in linears) > 0
    assert packed_bytes(model.to(torch.bfloat16)) == 0  # bf16 is never packed
    free = free_memory_bytes()
    assert free is None or free > 0


def test_auto_keeps_default_where_a_packed_copy_would_not_fit(monkeypatch, tmp_path, capsys):
    """kernels=auto on a CPU whose free memory could not hold a second copy of the linears (a 7B
    float32 target): default kernels, said, and nothing is packed or timed."""
    import decode as entry
    from eagle.bench import builder

    model = make_tiny_model("llama")
    monkeypatch.setattr(
        builder, "free_memory_bytes", lambda: packed_bytes(model)
    )  # half of it is too little
    monkeypatch.setattr(
        builder, "faster_kernels", lambda *a, **k: pytest.fail("nothing may be timed")
    )
    methods = entry.methods_of(compose_config("decode", [f"paths.runs_dir={tmp_path}"]))
    methods._use_kernels(model, "float32")
    assert methods.kernels == {"float32": "default"} and kernels_of(model) == "default"
    assert "packing the linears would take" in capsys.readouterr().err


def test_kernels_are_checked():
    with pytest.raises(ValueError, match="unknown kernels"):
        check_kernels("fast")
    with pytest.raises(ValueError, match="kernels=onednn runs on a CPU"):
        check_kernels("onednn", "cuda")
    with pytest.raises(ValueError, match="kernels=fused runs on a CPU"):
        check_kernels("fused", "cuda")
    assert available_kernels("cuda") == ("default",)


def test_a_restricted_head_runs_the_heads_kernels():
    head = nn.Linear(16, 40, bias=True).requires_grad_(False)
    ids = torch.tensor([3, 0, 39, 7])
    assert type(restricted_linear(head, ids)) is nn.Linear
    rows = restricted_linear(use_kernels(head, "onednn"), ids)
    assert isinstance(rows, PackedLinear)
    x = torch.randn(2, 16)
    torch.testing.assert_close(
        rows(x), F.linear(x, head.weight, head.bias)[:, ids], rtol=1e-5, atol=1e-5
    )


def test_a_drafters_reduced_head_follows_every_switch_of_the_targets_kernels():
    """A drafter's reduced drafting head (`restrict_vocab`) is a copy of the target's head rows on
    the head's kernels: a switch of the target's kernels, between the two fused settings or from
    fused to F.linear, rebuilds it on the new ones (it kept the old ones unless oneDNN came or
    went)."""
    target = make_tiny_model("llama")
    drafter = EagleDrafter.random(target, seed=1)
    hidden = torch.randn(3, target.config.hidden_size)
    ids = torch.tensor([7, 2, 30, 11])
    with torch.inference_mode():
        full = drafter.logits(hidden)
    drafter.restrict_vocab(ids)
    for setting in ("fused", "fused_prefetch", "default", "onednn", "fused", "default"):
        if setting not in available_kernels("cpu"):
            continue
        use_kernels(target, setting)
        with torch.inference_mode():
            got = drafter.logits(hidden)
        assert kernels_of(drafter._draft_head[1]) == setting == kernels_of(drafter.lm_head), setting
        torch.testing.assert_close(got, full[:, ids], rtol=1e-5, atol=1e-5)


def _on_forward(model, call):
    """`call(kernels, tokens)` before each forward of `model`'s decoder body (what a runner
    runs)."""

    def hook(module, args, kwargs):
        call(kernels_of(module), kwargs["input_ids"].shape[-1])

    model.model.register_forward_pre_hook(hook, with_kwargs=True)


def _fake_clock(model, cost):
    """A clock that each forward of `model` advances by `cost(kernels, tokens)` ms: the forward's
    kernels and the tokens it carries."""
    now = [0.0]
    _on_forward(model, lambda kernels, n: now.__setitem__(0, now[0] + cost(kernels, n) / 1000))
    return lambda: now[0]


def test_pick_kernels_lets_the_step_decide_and_the_tree_break_a_tie():
    """The choice follows the step, which vanilla decoding pays every token: a setting whose
    tree verification is faster but whose step is slower loses (kernels=auto once chose such a
    setting, and plain decoding ran slower on it). Steps within the margin tie, and the tree's
    verification decides, a near-tie of that keeping the plainer setting."""
    # an AMD EPYC's probe: fused steps faster, fused_prefetch verifies trees faster
    epyc = {
        "default": {1: 69.0, 26: 80.0},
        "onednn": {1: 55.0, 26: 60.0},
        "fused": {1: 15.6, 26: 59.4},
        "fused_prefetch": {1: 17.9, 26: 45.7},
    }
    assert pick_kernels(epyc) == ("fused", "the fastest step")
    # steps within 5%: the faster tree verification
    xeon = {"fused": {1: 26.1, 26: 59.4}, "fused_prefetch": {1: 26.3, 26: 45.7}}
    best, why = pick_kernels(xeon)
    assert best == "fused_prefetch"
    assert "steps within 5% of the fastest: fused, fused_prefetch" in why
    # both within 5%: the plainer (earlier) setting
    near = {"fused": {1: 26.1, 26: 46.0}, "fused_prefetch": {1: 26.3, 26: 45.7}}
    assert pick_kernels(near)[0] == "fused"
    assert pick_kernels({"default": {1: 10.0}, "onednn": {1: 9.7}}) == (
        "default",
        "steps within 5% of the fastest: default, onednn; the plainest",
    )
    assert pick_kernels({"default": {1: 10.0}, "onednn": {1: 9.7}}, margin=0.0)[0] == "onednn"
    with pytest.raises(ValueError, match="1-token step"):
        pick_kernels({"default": {26: 1.0}})


def test_faster_kernels_times_each_setting_alike_and_leaves_the_model_on_the_choice():
    """Every setting is timed the same way, in turns: switched on, one untimed step and one
    untimed tree (what a switch leaves to do), then the timed rounds, each read by the clock
    and verified through the engine's runner; the medians go to `pick_kernels`, the model is
    left on its choice with the others' packed weights freed, and the figures are said."""
    model = make_tiny_model("llama")
    settings = available_kernels("cpu")
    costs = {
        "default": (4.0, 9.0),
        "onednn": (2.0, 8.0),
        "fused": (1.0, 7.0),
        "fused_prefetch": (1.5, 3.0),
    }  # (step, tree) ms: the tree is faster on prefetch

    events = []
    _on_forward(model, lambda kernels, n: events.append((kernels, n)))
    clock = _fake_clock(model, lambda k, n: costs[k][0 if n == 1 else 1])
    choice = faster_kernels(model, kernels=settings, prefix=8, rounds=2, turns=2, clock=clock)
    best = min(settings, key=lambda k: costs[k][0])
    assert choice.kernels == best == kernels_of(model) and choice.why == "the fastest step"
    assert choice.ms == {
        k: {1: pytest.approx(costs[k][0]), 26: pytest.approx(costs[k][1])} for k in settings
    }
    assert choice.rounds == 4
    rounds = [e for e in events if e[1] != 8]  # the prefills carry the prompt's 8 tokens
    turn = [(k, n) for k in settings for n in (1, 26) + (1, 1) + (26, 26)]
    assert rounds == turn * 2, "each turn: every setting in order, 2 untimed and 4 timed rounds"
    packed = [hasattr(m, "_packed") for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(packed) if best == "onednn" else not any(packed), "the others' packing is freed"
    said = choice.describe()
    assert said.startswith(f"{best}, the fastest step (median of 4 rounds each, measured here: ")
    for k in settings:
        assert f"{k} a step {costs[k][0]:.2f} ms, 26 tokens {costs[k][1]:.2f} ms" in said


def test_auto_says_each_settings_figures_and_its_choice(monkeypatch, capsys):
    """kernels=auto prints what it measured for every setting and what it chose, and why."""
    from eagle.bench import builder

    ms = {"default": {1: 3.0, 26: 5.0}, "fused": {1: 1.0, 26: 4.0}}
    choice = KernelChoice(kernels="fused", ms=ms, why="the fastest step", rounds=9)
    monkeypatch.setattr(builder, "faster_kernels", lambda model, kernels: choice)
    assert builder.choose_kernels(make_tiny_model("llama"), "auto", "cpu", "float32") is choice
    err = capsys.readouterr().err
    assert (
        "[kernels] float32: fused, the fastest step (median of 9 rounds each, measured here: "
        "default a step 3.00 ms, 26 tokens 5.00 ms; "
        "fused a step 1.00 ms, 26 tokens 4.00 ms)"
    ) in err


def test_a_switched_model_carries_its_backend_and_the_runner_reads_it():
    """Each setting's backend object marks the linears it switched; the runtime reads it from
    the model (`backend_of`), a runner as each decoding call begins; default leaves no mark."""
    model = make_tiny_model("llama")
    runner = make_runner("dynamic", model)
    assert backend_of(model) is PLAIN is runner.backend and kernels_of(model) == "default"
    for setting in available_kernels("cpu")[1:]:
        use_kernels(model, setting)
        assert backend_of(model) is BACKENDS[setting] and kernels_of(model) == setting
        assert backend_of(model.lm_head).name == setting
        assert backend_of(model).dynamic_compile == (setting == "onednn")
        with runner.decoding():
            assert runner.backend is BACKENDS[setting]
    use_kernels(model, "default")
    assert backend_of(model) is PLAIN
    assert not any(MARK in m.__dict__ for m in model.modules()), "default leaves no mark"


def _eagle(target, runner, vocab=False):
    drafter = use_kernels(EagleDrafter.random(target, seed=1), kernels_of(target))
    if vocab:
        drafter.restrict_vocab(torch.arange(0, drafter.config.vocab_size, 2))
        assert kernels_of(drafter._draft_head[1]) == kernels_of(target)
    return eagle_proposer(drafter, tree("eagle_default"), cache=runner)


def _draft(target, runner):
    small = make_tiny_model(
        "llama", seed=1, num_hidden_layers=1, vocab_size=target.config.vocab_size
    )
    return TemplateProposer(
        DraftLM(use_kernels(small, kernels_of(target)), cache=runner), tree("eagle_default")
    )


def _medusa(target, runner):
    template = tree("medusa_default")
    heads = use_kernels(MedusaHeads.random(target, template.depth, seed=2), kernels_of(target))
    return medusa_proposer(heads, template)


PROPOSERS = {
    "vanilla": lambda t, r: None,
    "prompt_lookup": lambda t, r: PromptLookupProposer(num_tokens=5, max_ngram=2),
    "eagle": _eagle,
    "eagle_vocab": lambda t, r: _eagle(t, r, vocab=True),
    "draft_tree": _draft,
    "medusa": _medusa,
}


@pytest.mark.parametrize("runner", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["vanilla", "eagle"])
def test_greedy_on_fused_qwen3_layers_identical_to_generate(name, runner):
    """Qwen3's layers (RMSNorms of each head's q and k) run fused too, in the extension's loop:
    greedy output equals `generate` of the same target."""
    if "fused" not in available_kernels("cpu"):
        pytest.skip("kernels=fused do not run here")
    target = use_kernels(make_tiny_model("qwen3"), "fused")
    assert all(isinstance(m.forward, FusedLayer) for m in target.model.layers)
    assert isinstance(target.model.__dict__.get("forward"), FusedBackbone)
    proposer = PROPOSERS[name](target, runner)
    kept = make_runner(runner, target, tree_size=proposer.max_nodes if proposer else 0)
    run_greedy_cases(
        target, proposer, kept, greedy_cases(target, 8), f"fused/qwen3/{name}/{runner}"
    )


@pytest.mark.parametrize("kernels", ["onednn", "fused", "fused_prefetch"])
@pytest.mark.parametrize("runner", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_with_packed_kernels_identical_to_generate(name, runner, kernels, monkeypatch):
    """Every model of the run on packed products (target, drafter, draft LM, heads), or on the
    fused kernels: greedy output equals `generate` of the same target, token for token (the
    engine's caches let the extension loop over the layers and write them; `generate`'s Hugging
    Face cache takes a call per layer)."""
    if kernels not in available_kernels("cpu"):
        pytest.skip(f"kernels={kernels} do not run here")
    # forwards whose layers the extension's loop ran (it commits the cache's new entries)
    loops = []
    for cache_class in (GrowingCache, StaticKVCache):
        monkeypatch.setattr(
            cache_class,
            "commit",
            lambda self, n, c=cache_class.commit: loops.append(n) or c(self, n),
        )
    target = use_kernels(make_tiny_model("llama"), kernels)
    proposer = PROPOSERS[name](target, runner)
    kept = make_runner(runner, target, tree_size=proposer.max_nodes if proposer else 0)
    run_greedy_cases(target, proposer, kept, greedy_cases(target, 8), f"{kernels}/{name}/{runner}")
    assert bool(loops) == (kernels != "onednn"), (
        "the target's forwards must have run the extension's loop"
    )
    if kernels == "onednn":
        assert all(
            (m._siblings._packed if m._siblings else m._packed) is not None
            for m in target.modules()
            if isinstance(m, PackedLinear)
        ), "every linear of the target must have run packed"
    else:
        layers = [m.forward for m in target.model.layers]
        assert all(isinstance(f, FusedLayer) and f._packed is not None for f in layers), (
            "every layer must have run fused"
        )
        if name.startswith(
            "eagle"
        ):  # the drafter's layer too (it is built in training mode; drafting is not)
            drafter_layer = proposer.model.drafter.layers[0].forward
            assert isinstance(drafter_layer, FusedLayer) and drafter_layer._packed is not None
