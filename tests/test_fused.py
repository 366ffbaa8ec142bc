"""The fused kernels (eagle/kernels/fused.py): their products and decoder layers compute what
PyTorch's and Hugging Face's do, a token's logits do not depend on how many tokens its forward
carries (bitwise), unsupported layers and passes keep their own forward, and switching settings
restores the model. Greedy decoding on them, for every method family, is in test_kernels.py."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from eagle.decoding.backend import PLAIN, kernels_of
from eagle.decoding.engine import SpeculativeDecoder
from eagle.decoding.masks import causal_mask, tree_attention_mask
from eagle.kernels import BACKENDS, fused, use_kernels
from eagle.models.drafter import EagleDrafter
from helpers.models import make_tiny_model

pytestmark = pytest.mark.skipif(not fused.available(), reason="the fused kernels do not build here")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "shape",
    [(1, 48), (3, 48), (5, 48), (26, 48), (2, 5, 48), (1, 1, 1, 48), (4, 7), (7, 200), (26, 200)],
)  # 7 and 26 rows: several blocks of rows
def test_fused_products_equal_f_linear_and_each_row_its_own_product(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(shape[-1], 200, bias=bias)  # 200 outputs: the last panel is partly padding
    x = torch.randn(shape)
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        use_kernels(linear, "fused")
        got = linear(x)
        rows = x.reshape(-1, shape[-1])
        alone = torch.cat([linear(rows[i : i + 1]) for i in range(len(rows))])
    assert isinstance(linear, fused.FusedLinear) and linear._fused is not None, (
        "the fused product must have run"
    )
    assert got.shape == expected.shape == (*shape[:-1], 200)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(alone, got.reshape(-1, 200)), (
        "a row's product must not depend on the rows beside it"
    )


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("threads", [1, 2])  # panels of 4 vectors, or of 2 (`panel_vectors`)
@pytest.mark.parametrize("rows", [7, 13, 16])
def test_products_of_several_blocks_run_in_chunks_and_give_each_row_its_own_bits(
    rows, threads, prefetch
):
    # more rows than a block go through a panel a chunk of k-steps at a time (1000 inputs: several
    # chunks and a part one for either packing), each block's sums put aside between chunks: every
    # row's outputs are still its own product's, bitwise
    ext, before = fused.load(), torch.get_num_threads()
    torch.manual_seed(0)
    out = 3 * ext.panel_width()
    weight, x, bias = torch.randn(out, 1000), torch.randn(rows, 1000), torch.randn(out)
    try:
        torch.set_num_threads(threads)
        packed = ext.pack(weight)
        got = ext.linear(x, packed, out, bias, prefetch)
        alone = torch.cat(
            [ext.linear(x[i : i + 1], packed, out, bias, prefetch) for i in range(rows)]
        )
    finally:
        torch.set_num_threads(before)
    assert packed.size(2) == ext.panel_width() // threads
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    assert torch.equal(got, alone), "a row's product must not depend on the rows beside it"


@pytest.mark.parametrize("rows", [1, 7])
def test_narrow_panels_share_a_weight_evenly_and_give_the_same_bits(rows):
    # 3 panels of 4 vectors would go 2 to 1 to 2 threads; 6 panels of 2 go 3 to 3. Each output lane
    # is the same FMA chain in either packing, so the products are bitwise the same
    ext, threads = fused.load(), torch.get_num_threads()
    torch.manual_seed(0)
    out = 3 * ext.panel_width()
    weight, x = torch.randn(out, 96), torch.randn(rows, 96)  # 7 rows: a block of 6 and 1
    try:
        torch.set_num_threads(1)
        wide = ext.pack(weight)
        torch.set_num_threads(2)
        narrow = ext.pack(weight)
        y_wide, y_narrow = (
            ext.linear(x, wide, out, None, False),
            ext.linear(x, narrow, out, None, True),
        )
    finally:
        torch.set_num_threads(threads)
    assert wide.shape == (3, 96, ext.panel_width()) and narrow.shape == (
        6,
        96,
        ext.panel_width() // 2,
    )
    assert torch.equal(y_wide, y_narrow)
    torch.testing.assert_close(y_narrow, x @ weight.T, rtol=1e-5, atol=1e-4)


def _layer_inputs(model, n: int, past: int):
    """A layer's keyword arguments for n new tokens after `past` cached ones, as the model builds
    them."""
    positions = torch.arange(past, past + n)[None]
    hidden = torch.randn(1, n, model.config.hidden_size)
    return hidden, model.model.rotary_emb(hidden, positions)


def _layer_on_both_kernels(model, hidden, cos_sin, mask, past: int) -> dict[str, torch.Tensor]:
    """The first layer's output on PyTorch's kernels and on the fused ones, over the same `past`
    random cached entries; checks that the fused forward ran."""
    layer = model.model.layers[0]
    outs = {}
    for kernels in ("default", "fused"):
        use_kernels(model, kernels)
        cache = DynamicCache()
        torch.manual_seed(1)
        if past:
            k0 = torch.randn(1, model.config.num_key_value_heads, past, layer.self_attn.head_dim)
            cache.update(k0, torch.randn_like(k0), 0)
        with torch.inference_mode():
            outs[kernels] = layer(
                hidden, attention_mask=mask, position_embeddings=cos_sin, cache=cache
            )
    assert isinstance(layer.__dict__.get("forward"), fused.FusedLayer), (
        "the fused forward must have run"
    )
    return outs


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3"]
)  # qwen2: q/k/v biases; qwen3: q/k norms
@pytest.mark.parametrize("mask_kind", ["none", "float", "bool", "tree"])
def test_a_fused_layer_computes_what_the_layer_does(family, mask_kind):
    torch.manual_seed(0)
    model = make_tiny_model(family, num_hidden_layers=1)
    past, n = (
        (0 if mask_kind == "none" else 6),
        4,
    )  # no mask: causal from slot 0, as the models pass it
    hidden, cos_sin = _layer_inputs(model, n, past)
    if mask_kind == "tree":  # nodes 0 <- 1, 0 <- 2 <- 3: node 1 does not see node 2, nor 3 node 1
        visible = torch.tensor(
            [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool
        )
        mask = tree_attention_mask(past, visible, torch.float32)
    elif mask_kind == "none":
        mask = None  # causal: what sdpa's callers pass when nothing else is masked
    else:
        mask = causal_mask(past, n, torch.float32)
        mask = mask == 0 if mask_kind == "bool" else mask
    outs = _layer_on_both_kernels(model, hidden, cos_sin, mask, past)
    torch.testing.assert_close(outs["fused"], outs["default"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_kind", ["float", "bool"])
@pytest.mark.parametrize("past, head_dim", [(37, 40), (70, 64)])  # 40: 2 x 16 + 8 (or 5 x 8) floats
def test_long_contexts_with_hidden_slots_inside_runs_of_seen_ones(mask_kind, past, head_dim):
    """The kernels take a run of seen slots a vector at a time and the keys' dot products a vector
    of keys at a time (eagle/kernels/csrc/fused.cpp): contexts of several runs and keys, with a
    slot hidden here and there inside a run, and rows of different lengths."""
    torch.manual_seed(0)
    model = make_tiny_model(
        "llama",
        num_hidden_layers=1,
        hidden_size=6 * head_dim,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=96,
        initializer_range=0.05,
    )
    n = 5
    hidden, cos_sin = _layer_inputs(model, n, past)
    visible = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]],
        dtype=torch.bool,
    )
    mask = tree_attention_mask(past, visible, torch.float32)  # (1, 1, n, past + n)
    hidden_slots = torch.rand(n, past) < 0.15  # each row hides some committed slots of its own
    hidden_slots[:, 0] = False
    mask[0, 0, :, :past][hidden_slots] = torch.finfo(torch.float32).min
    if mask_kind == "bool":
        mask = mask == 0
    outs = _layer_on_both_kernels(model, hidden, cos_sin, mask, past)
    torch.testing.assert_close(outs["fused"], outs["default"], rtol=1e-4, atol=1e-4)


def test_the_drafters_layer_without_its_input_norm_is_fused_and_right():
    target = make_tiny_model("llama")
    drafter = EagleDrafter.random(target, seed=1)
    assert fused.supported_layer(drafter.layers[0]), (
        "EAGLE's layer (no input norm) is a supported layer"
    )
    x = torch.randn(1, 5, target.config.hidden_size)
    cos_sin = drafter.rotary_emb(x, torch.arange(5)[None])
    with torch.inference_mode():
        expected = drafter.layers[0](
            x, attention_mask=causal_mask(0, 5, torch.float32), position_embeddings=cos_sin
        )
        use_kernels(drafter, "fused")
        got = drafter.layers[0](
            x, attention_mask=causal_mask(0, 5, torch.float32), position_embeddings=cos_sin
        )
    assert isinstance(drafter.layers[0].__dict__.get("forward"), fused.FusedLayer)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _steps_and_reference(
    model, ids, start: int, family: str, **config
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ids[start:] from one-token steps of `model` after a cache of ids[:start], and
    the logits of all of ids on PyTorch's kernels (a fresh tiny model of the same family and config)
    """
    with torch.inference_mode():
        cache = DynamicCache()
        model(ids[:, :start], cache=cache)
        steps = torch.cat(
            [model(ids[:, t : t + 1], cache=cache).logits[0] for t in range(start, ids.shape[1])]
        )
        reference = use_kernels(make_tiny_model(family, **config), "default")(ids).logits[0]
    return steps, reference


@pytest.mark.parametrize(
    "family, length", [("llama", 12), ("qwen2", 12), ("qwen3", 12), ("llama", 60)]
)  # 60: vectors of keys
def test_a_tokens_logits_do_not_depend_on_how_many_tokens_its_forward_carries(family, length):
    model = use_kernels(make_tiny_model(family), "fused")
    assert fused.fuse_layers(model) == model.config.num_hidden_layers
    ids = torch.randint(3, model.config.vocab_size, (1, length))
    start = length - 5
    with torch.inference_mode():
        whole = model(ids).logits[0]
    steps, reference = _steps_and_reference(model, ids, start, family)
    assert torch.equal(steps, whole[start:]), (
        "5 one-token steps must give the 5-token forward's logits, bitwise"
    )
    torch.testing.assert_close(whole, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", ["fused", "fused_prefetch"])
def test_residual_products_of_many_rows_in_chunks_give_each_tokens_logits(kernels):
    # down_proj of 300 inputs goes through its panels in several chunks (and a part one), and 20 new
    # tokens are more rows than a block: its sums go aside between chunks and are added to the
    # residual stream at the end; each token's logits are still those of its one-token step
    model = use_kernels(make_tiny_model("llama", intermediate_size=300), kernels)
    ids = torch.randint(3, model.config.vocab_size, (1, 30))
    with torch.inference_mode():
        cache = DynamicCache()
        model(ids[:, :10], cache=cache)
        many = model(ids[:, 10:], cache=cache).logits[0]
    steps, reference = _steps_and_reference(model, ids, 10, "llama", intermediate_size=300)
    assert torch.equal(steps, many), (
        "20 one-token steps must give the 20-token forward's logits, bitwise"
    )
    torch.testing.assert_close(many, reference[10:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim",
    [
        (6, 2, 64),  # groups of 3, as SmolLM2: whole blocks of value vectors
        (6, 1, 40),  # one group of 6 in jobs of 4 + 2 heads; 40 = 2 x 16 + 8 (or 5 x 8) floats
        (9, 3, 24),  # single vectors and a scalar tail
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_jobs_of_one_head_or_several_give_every_head_the_same_bits(
    heads, kv_heads, head_dim, threads
):
    """A forward of a few tokens runs one head a job (few jobs: the threads' balance), one of 40
    runs the heads of a group together; each head's attention, and so every logit, is the same
    (the last tokens see 38-39 keys: two vectors of keys, then keys one at a time)."""
    shape = dict(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=96,
        initializer_range=0.05,
    )  # 40 tokens: tamer logits
    model = use_kernels(make_tiny_model("llama", **shape), "fused")
    ids = torch.randint(3, model.config.vocab_size, (1, 40))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            whole = model(ids).logits[0]
            cache = DynamicCache()
            model(ids[:, :38], cache=cache)
            steps = [model(ids[:, t : t + 1], cache=cache).logits[0] for t in range(38, 40)]
    finally:
        torch.set_num_threads(old)
    with torch.inference_mode():
        expected = make_tiny_model("llama", **shape)(ids).logits[0]  # PyTorch's kernels
    assert torch.equal(torch.cat(steps), whole[38:]), (
        "a head's attention must not depend on its job's other heads"
    )
    torch.testing.assert_close(whole, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "family", ["mistral", "gemma2", "phi3", "gpt2", "olmo2", "deepseek_v3", "llama4_text"]
)
def test_other_layers_keep_their_forward_and_still_run_fused_products(family):
    """A sliding window (mistral here), other norms and MLPs (gemma2), fused projections (phi3),
    norms after attention and MLP (olmo2), latent attention (deepseek_v3), experts and attention
    chunks (llama4_text): the layer keeps its own forward; its linears still take the fused
    products."""
    model = use_kernels(make_tiny_model(family), "fused")
    assert fused.fuse_layers(model) == 0 and kernels_of(model) == "fused"
    ids = torch.randint(3, model.config.vocab_size, (1, 9))
    with torch.inference_mode():
        got = model(ids).logits
        expected = use_kernels(model, "default")(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_backbones_loop_gives_the_layers_logits_and_steps_aside_when_asked_for_more(family):
    """With every layer fused, the base model's forward is one loop over the kernels
    (`FusedBackbone`): the logits of the model's own forward over the same fused layers, bitwise,
    with padding and a cache; a call asking for every layer's hidden states takes the model's own.
    """
    model = use_kernels(make_tiny_model(family), "fused")
    backbone = model.model.__dict__.get("forward")
    assert isinstance(backbone, fused.FusedBackbone)
    original, calls = backbone.original, []
    backbone.original = lambda **k: calls.append(1) or original(**k)
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    padding = torch.ones_like(ids)
    padding[0, :2] = 0  # row 0 left-padded, as generate pads a batch

    def run():
        cache = DynamicCache()
        return [
            model(ids[:, :6], attention_mask=padding[:, :6], cache=cache).logits,
            model(ids[:, 6:], attention_mask=padding, cache=cache).logits,
        ]

    with torch.inference_mode():
        got = run()
        assert not calls, "every pass must have run the backbone's loop"
        del model.model.forward  # the model's own forward, over the same fused layers
        expected = run()
        model.model.forward = backbone
        every = model(ids, attention_mask=padding, output_hidden_states=True)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert calls and len(every.hidden_states) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(every.logits[:, 6:], got[1], rtol=1e-5, atol=1e-5)


def test_a_batch_runs_fused_and_each_sequence_gets_its_own_logits():
    model = use_kernels(make_tiny_model("llama"), "fused")
    ids = torch.randint(3, model.config.vocab_size, (3, 7))
    with torch.inference_mode():
        batch = model(ids).logits
        alone = torch.cat([model(ids[b : b + 1]).logits for b in range(3)])
    assert all(layer.forward._packed is not None for layer in model.model.layers), (
        "the batch must have run fused"
    )
    assert torch.equal(batch, alone), (
        "a sequence's logits must not depend on the sequences beside it"
    )


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3"]
)  # qwen2: biases, which are packed too; qwen3: q/k norms
def test_weights_changed_in_place_or_replaced_are_packed_again(family):
    model = make_tiny_model(family)
    plain = make_tiny_model(family)
    fast = use_kernels(model, "fused")
    ids = torch.randint(3, model.config.vocab_size, (1, 6))

    def same():
        plain.load_state_dict(fast.state_dict())
        with torch.inference_mode():
            return torch.allclose(
                fast(ids).logits, plain(ids).logits, atol=1e-4
            )  # float rounding, AVX2 or AVX-512

    assert same()
    layer = fast.model.layers[1]
    changes = [
        lambda: layer.mlp.down_proj.weight.mul_(2),
        lambda: layer.post_attention_layernorm.weight.add_(1),
        lambda: layer.input_layernorm.weight.mul_(-1),
        lambda: fast.model.norm.weight.mul_(3),
    ]
    if family == "qwen2":
        changes.append(lambda: layer.self_attn.k_proj.bias.add_(1))
    if family == "qwen3":
        changes += [
            lambda: layer.self_attn.q_norm.weight.mul_(3),
            lambda: layer.self_attn.k_norm.weight.add_(1),
        ]
    for (
        change
    ) in changes:  # each change alone must reach the logits (the sizes make it large enough)
        with torch.no_grad():
            change()
        assert same(), "a weight changed in place was not packed again"
    layer.self_attn.o_proj.weight = nn.Parameter(torch.randn_like(layer.self_attn.o_proj.weight))
    assert same(), "a replaced parameter was not packed again"
    if (
        family == "qwen3"
    ):  # the norms are read in place (views), so only a replaced one shows a missed repack
        layer.self_attn.k_norm.weight = nn.Parameter(-layer.self_attn.k_norm.weight.detach())
        assert same(), "a replaced k norm was not packed again"


def test_inside_weights_fixed_the_weights_are_checked_once_and_again_in_the_next_scope(monkeypatch):
    model = use_kernels(make_tiny_model("llama"), "fused")
    ext, calls = fused.load(), []
    check = ext.unchanged
    monkeypatch.setattr(ext, "unchanged", lambda *args: calls.append(1) or check(*args))
    ids = torch.randint(3, model.config.vocab_size, (1, 6))
    with torch.inference_mode():
        model(ids)  # packs
        calls.clear()
        for _ in range(3):
            model(ids)
        assert len(calls) == 3, "outside a scope every forward checks"
        calls.clear()
        with fused.weights_fixed(model):
            for _ in range(3):
                model(ids)
        assert len(calls) == 1, "inside a scope the weights are checked once"
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(2)
        with fused.weights_fixed(model):
            got = model(ids).logits
        plain = make_tiny_model("llama")
        plain.load_state_dict(model.state_dict())
        torch.testing.assert_close(
            got, plain(ids).logits, rtol=1e-5, atol=1e-5
        )  # the change was packed
        calls.clear()
        SpeculativeDecoder(model).generate(ids, 5)
    assert len(calls) == 1, "the engine decodes in one scope: one check for its 5 forwards"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", [[0, 2], [0, 1, 3], [0, 2, 3, 6], [0, 5]])
def test_the_extension_moves_an_accepted_path_as_the_indexing_does(monkeypatch, dtype, path):
    """The fused backend's `move_slots` (every layer's move in one call of the extension) moves
    what plain PyTorch's indexing does."""
    from eagle.decoding import kv_cache

    g = torch.Generator().manual_seed(len(path))
    caches = [kv_cache.new_cache(max_len=64) for _ in range(2)]
    for layer in range(3):  # 10 committed entries, then a tree of 7
        k, v = (
            torch.randn(2, 3, 17, 8, generator=g).to(dtype),
            torch.randn(2, 3, 17, 8, generator=g).to(dtype),
        )
        for cache in caches:
            cache.update(k, v, layer)
    moves = []
    kv_cache.keep_path(caches[0], 10, path, PLAIN)  # PyTorch's indexing
    real = fused.load().move_slots
    monkeypatch.setattr(fused.load(), "move_slots", lambda *args: moves.append(1) or real(*args))
    kv_cache.keep_path(caches[1], 10, path, BACKENDS["fused"])
    assert moves == [1], "one call for every layer"
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert (
            a.keys.shape[-2] == 10 + len(path)
            and torch.equal(a.keys, b.keys)
            and torch.equal(a.values, b.values)
        )


def test_one_call_tells_whether_any_parameter_changed():
    ext = fused.load()
    lin, unbiased = nn.Linear(4, 4), nn.Linear(4, 4, bias=False)
    with torch.inference_mode():
        frozen = nn.Linear(4, 4)  # inference tensors keep no version counter

    def check(tensors, keys=None):
        owners = [lin._parameters, lin._parameters, unbiased._parameters, frozen._parameters]
        names = ["weight", "bias", "bias", "weight"]
        if keys is None:
            keys = torch.tensor(
                [k for t in tensors for k in ((0, 0) if t is None else fused._key([t])[0])]
            )
        return ext.unchanged(owners, names, tensors, keys), keys

    tensors = [lin.weight, lin.bias, None, frozen.weight]
    same, keys = check(tensors)
    assert same
    with torch.no_grad():
        lin.bias.add_(1)  # in place: its version moves
    assert not check(tensors, keys)[0]
    same, keys = check(tensors)  # the new versions recorded
    assert same
    lin.weight = nn.Parameter(lin.weight.detach().clone())  # replaced: another object
    assert not check(tensors, keys)[0]
    del lin._parameters["weight"]  # gone
    assert not check(tensors, keys)[0]


def test_training_and_other_dtypes_take_the_layers_own_forward():
    model = use_kernels(make_tiny_model("llama"), "fused")
    layer = model.model.layers[0]
    calls = []
    original = layer.forward.original
    layer.forward.original = lambda *a, **k: calls.append(1) or original(*a, **k)
    ids = torch.randint(3, model.config.vocab_size, (1, 6))
    model.train()
    model(ids).logits.sum().backward()  # training: gradients flow through the model's own layer
    assert calls and model.model.layers[0].self_attn.q_proj.weight.grad is not None
    calls.clear()
    model.eval().to(torch.bfloat16)
    with torch.inference_mode():
        model(ids)
    assert calls, "bf16 runs the model's own layer"


def test_software_prefetch_gives_the_same_bits_and_a_switch_reaches_every_part():
    """kernels=fused_prefetch runs the same products, asking for the weights ahead in software: the
    logits of fused, bitwise (a lone linear, the layers with a Hugging Face cache, the backbone's
    loop over the engine's cache). A switch between the two keeps the packed weights and reaches
    each linear, each layer and the backbone, whose loop is built again with the setting."""
    model = make_tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    linear = nn.Linear(96, 200)
    x = torch.randn(7, 96)

    def run(kernels):
        use_kernels(model, kernels, release=False)
        use_kernels(linear, kernels)
        with torch.inference_mode():
            cache = DynamicCache()
            hf = [model(ids[:, :6], cache=cache).logits, model(ids[:, 6:], cache=cache).logits]
            engine = SpeculativeDecoder(model).generate(ids[0].tolist(), 6).tokens
            return hf, engine, linear(x)

    plain = run("fused")
    packed, loop = (
        [layer.forward._packed for layer in model.model.layers],
        model.model.forward._loop,
    )
    ahead = run("fused_prefetch")
    assert kernels_of(model) == kernels_of(linear) == "fused_prefetch"
    assert all(
        layer.forward.prefetch and layer.forward._packed is p
        for layer, p in zip(model.model.layers, packed)
    )
    assert (
        model.model.forward.prefetch
        and loop is not None
        and model.model.forward._loop not in (None, loop)
    )
    assert all(m._prefetch for m in model.modules() if isinstance(m, fused.FusedLinear))
    assert all(torch.equal(a, b) for a, b in zip(plain[0], ahead[0], strict=True))
    assert plain[1] == ahead[1] and torch.equal(plain[2], ahead[2])
    use_kernels(model, "fused")
    assert kernels_of(model) == "fused" and not model.model.forward.prefetch
    assert not any(layer.forward.prefetch for layer in model.model.layers)


def test_switching_back_restores_the_layers_and_frees_the_packed_weights():
    model = make_tiny_model("llama", tie_word_embeddings=True)
    keys = list(model.state_dict())
    use_kernels(model, "fused")
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    assert (
        model.lm_head.weight is model.model.embed_tokens.weight and list(model.state_dict()) == keys
    )
    kept = model.model.layers[0].forward
    use_kernels(model, "default", release=False)  # timing settings in turn keeps them
    assert "forward" not in model.model.layers[0].__dict__ and kernels_of(model) == "default"
    assert "forward" not in model.model.__dict__ and "forward" not in model.model.norm.__dict__
    assert use_kernels(model, "fused").model.layers[0].forward is kept and kept._packed is not None
    assert isinstance(model.model.forward, fused.FusedBackbone) and isinstance(
        model.model.norm.forward, fused.FusedNorm
    )
    use_kernels(model, "onednn")
    assert "forward" not in model.model.layers[0].__dict__ and kernels_of(model) == "onednn"
    assert kept._packed is None and not hasattr(model.lm_head, "_fused")
    use_kernels(model, "default")
    assert not any(
        hasattr(m, a) for m in model.modules() for a in ("_fused", "_packed", "_eagle_fused")
    )
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_build_that_fails_says_why(monkeypatch):
    """No compiler (or no AVX2): kernels=fused is a clear error, and auto leaves it out."""
    from eagle.kernels import backends as kernels_module

    def no_compiler(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    fused.load.cache_clear()
    fused.available.cache_clear()
    try:
        assert not fused.available() and "fused" not in kernels_module.available_kernels("cpu")
        with pytest.raises(fused.FusedUnavailable, match="needs a C\\+\\+ compiler"):
            kernels_module.check_kernels("fused")
    finally:
        fused.load.cache_clear()
        fused.available.cache_clear()


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="2 MB pages are asked for on Linux only"
)
def test_packed_weights_start_on_a_2mb_page_and_are_zero_padded():
    ext = fused.load()
    big = ext.huge_zeros([3 * 2**20 // 4 + 5])  # 3 MB and a bit: the last part stays in 4 KB pages
    small = ext.huge_zeros([7, 3])  # under 2 MB: an ordinary tensor
    assert big.data_ptr() % 2**21 == 0 and not big.any() and big.shape == (3 * 2**20 // 4 + 5,)
    assert small.shape == (7, 3) and not small.any()
    weight = torch.randn(
        3 * ext.panel_width() * 40 + 3, 576
    )  # ~11 MB, the last panel 3 real outputs
    packed = ext.pack(weight)
    assert packed.data_ptr() % 2**21 == 0
    width = packed.shape[-1]
    assert torch.equal(packed[0, :, :width], weight[:width].T)
    assert torch.equal(packed[-1, :, :3], weight[-3:].T) and not packed[-1, :, 3:].any()


def _pair(family: str, **config):
    """Two copies of one tiny model: on PyTorch's kernels and on the fused ones."""
    plain = make_tiny_model(family, **config)
    other = make_tiny_model(family, **config)
    other.load_state_dict(plain.state_dict())
    return plain.eval(), use_kernels(other, "fused").eval()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_generate_with_hugging_faces_static_cache_on_the_fused_kernels(family):
    # Qwen2's and Qwen3's `generate` prepares a dict of masks per layer type for a static cache;
    # the backbone's loop must hand that to the model's own forward, not take it for a tensor
    plain, fast = _pair(family)
    ids = torch.randint(3, plain.config.vocab_size, (2, 9))
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    kwargs = dict(
        attention_mask=padding,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
    )
    with torch.inference_mode():
        assert torch.equal(fast.generate(ids, **kwargs), plain.generate(ids, **kwargs))


@pytest.mark.parametrize("train_head", [False, True])
def test_trainable_parameters_inside_a_frozen_model_get_their_gradients(train_head):
    # the kernels run outside autograd: a layer with one trainable weight takes its own forward,
    # however the input and q_proj are frozen
    grads = {}
    for model in _pair("llama"):
        model.requires_grad_(False)
        for layer in model.model.layers:
            layer.mlp.requires_grad_(True)
        model.lm_head.requires_grad_(train_head)
        torch.manual_seed(0)
        model(torch.randint(3, model.config.vocab_size, (1, 6))).logits.logsumexp(
            -1
        ).mean().backward()
        grads[kernels_of(model)] = [layer.mlp.down_proj.weight.grad for layer in model.model.layers]
    assert all(g is not None for g in grads["fused"])
    for fast, plain in zip(grads["fused"], grads["default"], strict=True):
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-5)


def test_a_linears_trainable_bias_gets_its_gradient():
    linear = use_kernels(nn.Linear(8, 16), "fused")
    linear.weight.requires_grad_(False)
    linear(torch.randn(3, 8)).sum().backward()
    torch.testing.assert_close(linear.bias.grad, torch.full((16,), 3.0))


def test_masks_per_head_or_broadcast_over_tokens_take_the_models_own_attention():
    # the kernels read one mask row per token, shared by every head: a (B, heads, n, L) mask or a
    # (B, 1, 1, L) one must give what the model computes, not head 0's mask or an error
    plain, fast = _pair("llama")
    heads, n = plain.config.num_attention_heads, 6
    ids = torch.randint(3, plain.config.vocab_size, (1, n))
    per_head = torch.zeros(1, heads, n, n)
    per_head[:, :, :, :] = torch.triu(torch.full((n, n), float("-inf")), 1)
    per_head[:, 1:, :, 0] = float(
        "-inf"
    )  # heads 1.. do not see slot 0 (row 0 keeps it: a softmax needs one)
    per_head[:, 1:, 0, 0] = 0.0
    broadcast = torch.zeros(1, 1, 1, n)
    broadcast[..., 2] = float("-inf")
    with torch.inference_mode():
        for mask in (per_head, broadcast):
            expected = plain(ids, attention_mask=mask).logits
            torch.testing.assert_close(
                fast(ids, attention_mask=mask).logits, expected, rtol=1e-4, atol=1e-4
            )


def test_strided_biases_and_norm_weights_are_read_as_the_model_reads_them():
    # a bias or norm weight that is a view with a stride (or an expanded one) is read as its values,
    # not as the floats after its first in memory
    plain, fast = _pair("llama")
    for model in (plain, fast):
        torch.manual_seed(1)
        layer = model.model.layers[0]
        d = model.config.hidden_size
        layer.input_layernorm.weight = nn.Parameter(torch.randn(2 * d)[::2])
        layer.post_attention_layernorm.weight = nn.Parameter(torch.randn(1).expand(d))
        proj = layer.mlp.down_proj
        proj.bias = nn.Parameter(torch.randn(2 * proj.out_features)[::2])
    ids = torch.randint(3, plain.config.vocab_size, (1, 7))
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="contiguous float32 vector of 8"):
        fused.load().linear(
            torch.randn(2, 4), fused.load().pack(torch.randn(8, 4)), 8, torch.randn(16)[::2], False
        )


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
@pytest.mark.parametrize("loop", [True, False])  # the backbone's loop, or only the layers fused
def test_outputs_asked_for_in_the_config_are_returned(flag, loop):
    plain, fast = _pair(
        "llama", attn_implementation="eager"
    )  # (attentions are returned by eager only)
    if not loop:
        del fast.model.forward
    for model in (plain, fast):
        setattr(model.config, flag, True)
    ids = torch.randint(3, plain.config.vocab_size, (1, 5))
    with torch.inference_mode():
        expected, got = (
            getattr(plain(ids), flag.removeprefix("output_")),
            getattr(fast(ids), flag.removeprefix("output_")),
        )
    assert expected is not None and got is not None and len(got) == len(expected) > 0
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
