"""The benchmark (eagle/bench/benchmark.py, decode.py mode=benchmark): every method's report
(lossy methods labelled), its references and intervals, what it refuses before decoding, and a
stopped run that resumes only with the same settings and inputs."""

from __future__ import annotations

import json

import pytest
import torch

from eagle.bench.benchmark import tau_by_category
from eagle.bench.evalsets import load_eval_set
from eagle.bench.methods import MethodError
from eagle.decoding import ContextOverflowError
from eagle.decoding.stats import DecodeResult, DecodeStats, RoundStats
from eagle.kernels import available_kernels
from helpers.configs import decode_cfg
from helpers.decoding import EVERY
from helpers.models import save_tiny_target, small_tokenizer


def test_benchmark_every_method_writes_report(models, tmp_path):
    from decode import decode

    out = tmp_path / "bench"
    cfg = decode_cfg(models, tmp_path, "mode=benchmark",
                     f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                     f"benchmark.out_dir={out}",
                     "benchmark.dtypes={eagle:float32,medusa:float32,medusa_typical:float32}",
                     f"benchmark.methods=[{','.join(EVERY)}]")
    decode(cfg)
    report = json.loads((out / "results.json").read_text())
    runs = [(r["eval_set"], r["temperature"]) for r in report["runs"]]
    assert runs == [("prompts", 0.0), ("prompts", 1.0)]
    for run in report["runs"]:
        assert isinstance(run["target"], str)
        assert set(run["methods"]) == set(EVERY)
        for name, m in run["methods"].items():
            assert isinstance(m["tau"], float) and m["tau"] >= 1.0 - 1e-9, name
            assert m["tokens_per_s"] > 0 and isinstance(m["speedup"], float)
            lossy = name.startswith("medusa_typical")  # typical acceptance
            assert m["lossless"] is (not lossy), name
            assert m["ms_per_round"] > 0 and m["accepted_hist"], name  # the same for every method
        assert run["methods"]["vanilla"]["speedup"] == pytest.approx(1.0)
        fastest = run["fastest_vanilla"]  # speedups against the fastest plain decoding of the run
        assert fastest in ("vanilla", "vanilla:static", "hf_generate")
        assert run["methods"][fastest]["speedup_vs_fastest"] == pytest.approx(1.0)
        for plain in ("vanilla", "vanilla:static", "hf_generate"):
            assert run["methods"][plain]["speedup_vs_fastest"] <= 1.0 + 1e-9
        assert run["methods"]["vanilla:static"]["speedup_vs_static"] == pytest.approx(1.0)
        eagle_static = run["methods"]["eagle:static"]
        assert eagle_static["speedup_vs_static"] > 0 and eagle_static["ms_per_round"] > 0
        parts = eagle_static["draft_ms_per_round"] + eagle_static["verify_ms_per_round"]
        assert parts <= eagle_static["ms_per_round"]
    assert report["status"] == "complete"
    prompts = load_eval_set(str(models / "prompts.jsonl"))
    assert report["runs"][0]["prompts"] == [p.id for p in prompts]  # in the texts' order
    texts = report["runs"][0]["texts"]  # the greedy texts that were compared, kept in the report
    assert set(texts) == set(EVERY)
    assert all(len(t) == report["runs"][0]["num_prompts"] for t in texts.values())
    assert texts["eagle"] == texts["vanilla"] and all(isinstance(t, str) for t in texts["vanilla"])
    greedy = report["runs"][0]["methods"]
    assert greedy["vanilla"]["reference"] is None  # the fp32 vanilla is the reference
    for name in EVERY:  # all fp32 here: every method must reproduce the reference text
        if name != "vanilla":
            same = greedy[name]["identical_to_reference"], greedy[name]["identical_to_fp32"]
            assert same == (1.0, 1.0), name
    assert greedy["eagle"]["reference"] == "vanilla (float32)"
    assert greedy["eagle:static"]["reference"] == "vanilla:static (float32)"
    eagle = greedy["eagle"]
    parents, by_node = eagle["tree_parents"], eagle["acceptance_by_node"]
    assert len(by_node) == len(parents) and by_node[0] == 1.0
    assert all(by_node[i] <= by_node[p] + 1e-12 for i, p in enumerate(parents) if p >= 0)
    assert greedy["vanilla"]["acceptance_by_node"] is None
    table = (out / "results.md").read_text()
    assert "| eagle |" in table and "| eagle:static |" in table and "speedup vs static" in table
    assert "### Summary" in table
    assert "| prompts T=0: tau | speedup | prompts T=1: tau | speedup |" in table
    runs_part, summary = table.split("### Summary")
    assert [ln for ln in runs_part.splitlines() if "NO (lossy)" in ln] == \
        [ln for ln in runs_part.splitlines() if ln.startswith("| medusa_typical")]
    assert [ln for ln in summary.splitlines() if "(LOSSY)" in ln] == \
        [ln for ln in summary.splitlines() if ln.startswith("| medusa_typical")]
    for png in ("speedup.png", "tau.png", "acceptance.png", "speedup_vs_static.png"):
        assert (out / png).stat().st_size > 1000
    measured = report["machine"]["kernels"]["float32"]  # kernels=auto: timed on the target at load
    # default, onednn, and fused (with and without prefetch) where it builds here
    candidates = set(available_kernels("cpu"))
    assert measured["kernels"] in candidates and set(measured["ms"]) == candidates


def test_packed_kernels_apply_to_every_method_and_keep_greedy_texts(models, tmp_path):
    """kernels=onednn: the target, the drafter, the draft LM and HF's peers all run packed
    products, and every method's greedy text is vanilla's (on the same kernels)."""
    from decode import decode

    names = ["vanilla", "eagle", "eagle:static", "draft", "medusa", "hf_generate", "hf_assisted"]
    out = tmp_path / "bench"
    decode(decode_cfg(models, tmp_path, "mode=benchmark", "kernels=onednn",
                      "benchmark.temperatures=[0.0]",
                      f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                      f"benchmark.out_dir={out}",
                      "benchmark.dtypes={eagle:float32,medusa:float32}",
                      f"benchmark.methods=[{','.join(names)}]"))
    report = json.loads((out / "results.json").read_text())
    assert report["machine"]["kernels"] == {"float32": "onednn"}
    table = (out / "results.md").read_text()
    assert "Linear kernels (eagle/kernels): float32 onednn" in table
    greedy = report["runs"][0]["methods"]
    for name in names[1:]:
        assert greedy[name]["identical_to_reference"] == 1.0, name
    with pytest.raises(ValueError, match="unknown kernels"):  # before anything is loaded
        decode(decode_cfg(models, tmp_path, "mode=benchmark", "kernels=fast"))


def test_a_benchmark_run_again_into_its_folder_keeps_the_report_before(models, tmp_path):
    from decode import decode

    out = tmp_path / "bench"
    args = ["mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
            f"benchmark.out_dir={out}", "benchmark.methods=[vanilla]", "benchmark.num_prompts=1",
            "max_new_tokens=4"]
    decode(decode_cfg(models, tmp_path, *args, "benchmark.temperatures=[0.0]"))
    first = (out / "results.json").read_bytes()
    decode(decode_cfg(models, tmp_path, *args, "benchmark.temperatures=[1.0]"))
    (kept,) = (out / "previous").iterdir()
    assert (kept / "results.json").read_bytes() == first and (kept / "results.md").exists()
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["temperature"] for r in runs] == [1.0]


def test_a_bf16_method_is_compared_with_bf16_and_fp32_vanilla(models, tmp_path):
    """EAGLE in bf16: its text is compared with vanilla decoding in bf16 (run untimed when the
    benchmark has none) and with fp32 vanilla, each named, with the share that matched."""
    from decode import decode

    out = tmp_path / "bench"
    decode(decode_cfg(models, tmp_path, "mode=benchmark",
                      f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                      f"benchmark.out_dir={out}", "benchmark.dtypes={eagle:bfloat16}",
                      "benchmark.methods=[vanilla,eagle]",
                      "benchmark.temperatures=[0.0]"))
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    eagle = run["methods"]["eagle"]
    assert eagle["dtype"] == "bfloat16" and eagle["reference"] == "vanilla (bfloat16)"
    assert 0.0 <= eagle["identical_to_reference"] <= 1.0
    assert 0.0 <= eagle["identical_to_fp32"] <= 1.0
    assert set(run["methods"]) == {"vanilla", "eagle"}  # the bf16 reference is not a timed method
    assert "of vanilla (bfloat16)" in (out / "results.md").read_text()


def test_acceptance_by_node_counts_full_tree_rounds():
    from eagle.bench.benchmark import acceptance_by_node

    def result(*rounds: tuple[tuple[int, ...], int]) -> DecodeResult:
        stats = DecodeStats(rounds=[RoundStats(accepted=len(p) - 1, committed=len(p),
                                               tree_size=size, path=p) for p, size in rounds])
        return DecodeResult(tokens=[0] * (1 + stats.committed), stats=stats)

    parents = [-1, 0, 0, 1]  # root; two children; a grandchild under node 1
    a = result(((0, 1, 3), 3), ((0, 2), 3), ((0,), 3))
    b = result(((0, 1), 3), ((0, 2), 1))  # the 2nd round: a cut tree
    assert acceptance_by_node(parents, [a, b]) == [1.0, 0.5, 0.25, 0.25]


def test_tau_by_category_sums_each_categorys_prompts():
    """tau over a category is its prompts' committed tokens over their forwards, not a mean of
    per-prompt taus; plain decoding and runs of one category get no table."""
    per = {"committed": [10, 30, 8, 12], "forwards": [10, 10, 8, 4]}
    run = {"categories": ["math", "writing", "math", "writing"],
           "methods": {"vanilla": {"method": "vanilla", "per_prompt": per},
                       "eagle": {"method": "eagle", "per_prompt": per}}}
    lines = tau_by_category(run)
    assert lines[0] == "tau by category (prompts): math (2), writing (2)"
    assert "| eagle | 1.00 | 3.00 |" in lines
    assert not any(ln.startswith("| vanilla") for ln in lines)
    assert tau_by_category({**run, "categories": ["math"] * 4}) == []
    assert tau_by_category({**run, "categories": [""] * 4}) == []
    assert tau_by_category({"methods": {}}) == []


def test_the_median_speedup_pairs_each_prompt_with_itself():
    """Vanilla at 10/20/30 tokens/s and a method at 60/25/32 on the same three prompts: the
    per-prompt speedups are 6, 1.25 and 1.07, whose median is 1.25; a ratio of the two medians
    (32 / 20 = 1.6x) pairs different prompts."""
    from eagle.bench.benchmark import MethodResult, _speedups

    def result(name, rates):
        return MethodResult(method=name, dtype="float32", lossless=True, tau=1.0,
                            tokens_per_s=sum(rates) / 3, tokens_per_s_median=sorted(rates)[1],
                            per_prompt={"tokens": [r * 2 for r in rates], "seconds": [2.0] * 3})

    results = {"vanilla": result("vanilla", [10, 20, 30]), "eagle": result("eagle", [60, 25, 32])}
    _speedups(results)
    assert results["eagle"].speedup_median == pytest.approx(1.25)
    assert results["eagle"].speedup == pytest.approx(117 / 60)
    assert results["vanilla"].speedup_median == 1.0


def test_a_benchmark_builds_every_method_before_running_any(models, tmp_path):
    """A missing or mismatched checkpoint fails the run at once, naming every such method, not
    after the other methods' warm-ups ("model path 'None' does not exist")."""
    from decode import decode

    other = save_tiny_target(tmp_path / "other", small_tokenizer(), vocab_size=320,
                             num_hidden_layers=1)
    cfg = decode_cfg(models, tmp_path, "mode=benchmark",
                     f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                     "benchmark.methods=[vanilla,eagle,draft,medusa]", "eagle.random=false",
                     f"eagle.drafter={tmp_path / 'nowhere'}", f"draft.model={other}")
    with pytest.raises(MethodError, match=r"2 of 4 methods cannot be built .*eagle: .*nowhere.*; "
                                          r"draft: the draft LM .* has a vocabulary of 320"):
        decode(cfg)


def test_a_benchmark_names_a_prompt_past_the_context_before_decoding_any(models, tmp_path,
                                                                         monkeypatch):
    import eagle.bench.benchmark as benchmark_module
    from decode import decode

    prompts = tmp_path / "long.jsonl"
    lines = [json.dumps({"prompt": "fine"}), json.dumps({"prompt": "word " * 600})]
    prompts.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(benchmark_module, "warm_up",
                        lambda *a, **k: pytest.fail("a method decoded first"))
    cfg = decode_cfg(models, tmp_path, "mode=benchmark", f"benchmark.eval_sets=[{prompts}]",
                     "benchmark.methods=[vanilla,eagle]",
                     f"benchmark.out_dir={tmp_path / 'bench'}")
    with pytest.raises(ContextOverflowError,
                       match=r"long prompt '\S+': prompt \(\d+\) \+ max_new_tokens \(12\) "
                             r"\+ 1 = \d+ tokens exceed the target's context of 512 \(lower"):
        decode(cfg)


def test_benchmark_chat_renders_every_prompt_with_the_template(models, tmp_path, monkeypatch):
    import decode as decode_module
    from eagle.bench import benchmark

    seen = {}

    def fake_run(eval_sets, *args, **kwargs):
        seen.update({k: [p.chat for p in v] for k, v in eval_sets.items()})
        raise StopIteration  # nothing to time

    monkeypatch.setattr(benchmark, "run_benchmark", fake_run)
    for chat, expected in (("true", True), ("false", False), ("null", False)):  # null: the set's
        cfg = decode_cfg(models, tmp_path, "mode=benchmark",
                         f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                         "benchmark.methods=[vanilla]", f"benchmark.chat={chat}")
        with pytest.raises(StopIteration):
            decode_module.decode(cfg)
        assert seen["prompts"] == [expected] * 3, chat
    with pytest.raises(StopIteration):  # the top-level chat=true reaches the benchmark too
        decode_module.decode(decode_cfg(models, tmp_path, "mode=benchmark", "chat=true",
                                        f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]"))
    assert seen["prompts"] == [True] * 3


def test_dtypes_as_label_strings_reach_labels_hydra_cannot_spell_as_keys(models, tmp_path):
    """benchmark.dtypes as LABEL=DTYPE strings: one method in two dtypes in one run (`vanilla`
    and `vanilla:dynamic`), which the mapping form cannot key; a malformed item fails."""
    from decode import decode
    from eagle.bench.methods import dtype_overrides

    out = tmp_path / "bench"
    decode(decode_cfg(models, tmp_path, "mode=benchmark",
                      f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                      "benchmark.num_prompts=1",
                      "benchmark.methods=[vanilla,vanilla:dynamic,eagle@chain5]",
                      'benchmark.dtypes=["vanilla:dynamic=bfloat16","eagle@chain5=float32"]',
                      "benchmark.temperatures=[0.0]", f"benchmark.out_dir={out}"))
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert {k: v["dtype"] for k, v in run["methods"].items()} == {
        "vanilla": "float32", "vanilla:dynamic": "bfloat16", "eagle@chain5": "float32"}
    assert dtype_overrides({"eagle": "float32"}) == {"eagle": "float32"}
    assert dtype_overrides(None) == {}
    with pytest.raises(ValueError, match="LABEL=DTYPE"):
        dtype_overrides(["eagle"])


def stop_on_the_second(real, calls: list):
    """`benchmark.summarise` that stops the run at its second call, as a ^C would."""
    def summarise(method, dtype, results):
        calls.append(method)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(method, dtype, results)
    return summarise


def test_a_stopped_benchmark_keeps_the_runs_it_finished(models, tmp_path, monkeypatch):
    """results.json is written after every (eval set, temperature): a run stopped in the second
    keeps the first, marked incomplete."""
    from decode import decode
    from eagle.bench import benchmark

    out, calls = tmp_path / "bench", []
    monkeypatch.setattr(benchmark, "summarise", stop_on_the_second(benchmark.summarise, calls))
    cfg = decode_cfg(models, tmp_path, "mode=benchmark",
                     f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                     f"benchmark.out_dir={out}", "benchmark.methods=[vanilla]")
    with pytest.raises(KeyboardInterrupt):
        decode(cfg)
    report = json.loads((out / "results.json").read_text())
    assert report["status"] == "incomplete" and [r["temperature"] for r in report["runs"]] == [0.0]
    assert (out / "results.md").exists()


def test_a_stopped_benchmark_resumes_only_with_the_same_settings_and_inputs(models, tmp_path,
                                                                            monkeypatch):
    """Rerun into the same folder, a stopped benchmark keeps its finished (eval set, temperature)
    runs and runs the rest; other settings, another prompt, a model saved again or a finished
    report start over (the report before kept in previous/)."""
    import os

    from decode import decode
    from eagle.bench import benchmark

    out, calls = tmp_path / "bench", []
    real = benchmark.summarise
    stop_on_the_second_run = stop_on_the_second(real, calls)

    def counted(method, dtype, results):
        calls.append(method)
        return real(method, dtype, results)

    args = ["mode=benchmark", f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
            f"benchmark.out_dir={out}", "benchmark.methods=[vanilla]"]

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
    assert report["status"] == "complete"
    assert [r["temperature"] for r in report["runs"]] == [0.0, 1.0]
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
    later = weights.stat().st_mtime_ns + 10**9
    assert started_over(change=lambda: os.utime(weights, ns=(later, later)))
    assert started_over("benchmark.resume=false")
    calls.clear()
    kept_before = len(list((out / "previous").iterdir()))  # each start over kept the one before
    decode(decode_cfg(models, tmp_path, *args))  # a finished report rerun: measured anew
    assert len(calls) == 2 and len(list((out / "previous").iterdir())) == kept_before + 1


def test_the_resume_key_changes_with_what_a_resumed_run_would_mix(models, tmp_path):
    """Whatever decides a measurement is in the key: a tree file rewritten (named by path, by
    eagle.tree, or in the tree search's folder), the chat rendering, the threads."""
    from decode import methods_of, run_settings
    from eagle.bench.benchmark import resume_key

    prompts = {"prompts": load_eval_set(str(models / "prompts.jsonl"))}
    trees = tmp_path / "trees"
    trees.mkdir()
    (trees / "mine.yaml").write_text("kind: paths\npaths:\n- [0]\n- [1]\n")

    def key(names, *overrides, tree_dirs=(str(trees),)):
        cfg = decode_cfg(models, tmp_path, "mode=benchmark", *overrides)
        return resume_key(run_settings(cfg, "benchmark"), names, [0.0], {},
                          methods_of(cfg).tree_dirs(tree_dirs), prompts)

    def keys() -> list[dict]:  # the tree named by name, by path, and by eagle.tree
        return [key(["eagle@mine"]), key([f"eagle@{trees / 'mine.yaml'}"]),
                key(["eagle"], f"eagle.tree={trees / 'mine.yaml'}")]

    before = keys()
    assert before == keys()  # nothing in it moves by itself
    (trees / "mine.yaml").write_text("kind: paths\npaths:\n- [0]\n- [0, 0]\n")
    after = keys()
    assert all(a != b for a, b in zip(before, after))
    assert key(["vanilla"], "chat=true") != key(["vanilla"], "chat=false")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = key(["vanilla"])
    finally:
        torch.set_num_threads(threads)
    assert other != key(["vanilla"])


def test_the_timings_are_on_disk_before_the_reference_texts_are_decoded(models, tmp_path,
                                                                        monkeypatch):
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
    cfg = decode_cfg(models, tmp_path, "mode=benchmark",
                     f"benchmark.eval_sets=[{models / 'prompts.jsonl'}]",
                     f"benchmark.out_dir={out}", "benchmark.methods=[vanilla,prompt_lookup]",
                     "benchmark.temperatures=[0.0]")
    with pytest.raises(MemoryError):
        decode(cfg)
    report = json.loads((out / "results.json").read_text())
    assert report["status"] == "incomplete" and len(report["runs"]) == 1
    methods = report["runs"][0]["methods"]
    lookup = methods["prompt_lookup"]
    assert lookup["tokens_per_s"] > 0 and lookup["identical_to_reference"] is None
    assert all(m["peak_memory_mb"] is None for m in methods.values())
    assert report["machine"]["peak_rss_mb"] > 0


def test_references_are_decoded_only_for_what_the_run_did_not_time():
    """A GPU run times vanilla:static and eagle:static in bf16: eagle:static's reference is
    vanilla:static, so no eager vanilla is decoded (slow there, and untimed); an eager method of
    another dtype still gets its own reference, and float32 one only on a CPU."""
    from types import SimpleNamespace

    from eagle.bench.benchmark import _reference_texts

    class Bar:
        def set_postfix_str(self, text):
            pass

    decoded = []

    def reference(dtype):
        decoded.append(dtype)
        return SimpleNamespace(generate=lambda ids, n, policy: SimpleNamespace(tokens=[1]))

    static = {"vanilla:static": SimpleNamespace(dtype="bfloat16"),
              "eagle:static": SimpleNamespace(dtype="bfloat16")}
    outputs = {name: [[1]] for name in static}
    texts = _reference_texts(static, outputs, [[5]], 4, reference, Bar(), float32=False)
    assert decoded == [] and list(texts) == ["vanilla:static (bfloat16)"]
    mixed = {**static, "draft": SimpleNamespace(dtype="float16")}
    _reference_texts(mixed, {**outputs, "draft": [[1]]}, [[5]], 4, reference, Bar(), float32=True)
    assert decoded == ["float16", "float32"]
