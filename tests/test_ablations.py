"""eagle.bench.ablations: the table of EAGLE-1's ablations, its intervals and its ordering."""

from __future__ import annotations

import json
import os

import pytest

from eagle.bench import ablations as abl


def per_prompt(tokens, committed, forwards, seconds):
    return {"tokens": tokens, "committed": committed, "forwards": forwards, "seconds": seconds}


def test_binomial_margin():
    assert abl.binomial_margin(0.5, 10_000) == pytest.approx(0.0098, abs=1e-4)
    assert abl.binomial_margin(1.0, 100) == 0.0


def write_variant(root, name, inputs, noise, data, top1, loss_vocab=4096, **model):
    d = root / name / "drafter"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"inputs": inputs}))
    metrics = {f"val/top1_d{i + 1}": a for i, a in enumerate(top1)}
    metrics.update(
        {
            "val/tokens_d1": 4000,
            "steps": 250,
            "config": {
                "model": {"noise": noise, "loss_vocab": loss_vocab, **model},
                "data": {"name": data},
            },
        }
    )
    (d / "train_metrics.json").write_text(json.dumps(metrics))


def bench(speed: dict[str, list[float]]) -> dict:
    """A benchmark report at T=0 and T=1 where method m's per-prompt seconds are `speed[m]`."""
    vanilla = per_prompt([10, 10], [10, 10], [10, 10], [1.0, 1.0])
    runs = []
    for t in (0.0, 1.0):
        methods = {"vanilla": {"tau": 1.0, "speedup": 1.0, "per_prompt": vanilla}}
        for m, secs in speed.items():
            methods[m] = {
                "tau": 3.0,
                "speedup": 20 / sum(secs) / 10,
                "per_prompt": per_prompt([10, 10], [9, 9], [3, 3], secs),
            }
        runs.append(
            {"eval_set": "humaneval", "temperature": t, "num_prompts": 2, "methods": methods}
        )
    return {"runs": runs}


def test_report_orders_variants_and_compares_the_input_ordering_with_the_paper(tmp_path):
    write_variant(tmp_path, "token_only", "token", 0.1, "corpus", [0.5, 0.4])
    write_variant(tmp_path, "eagle1", "shifted", 0.1, "corpus", [0.8, 0.7])
    write_variant(tmp_path, "feature_only", "feature", 0.1, "corpus", [0.7, 0.5])
    write_variant(tmp_path, "no_noise", "shifted", 0.0, "corpus", [0.8, 0.69])
    # a data option: EAGLE-1's inputs on other data, left out of the input ordering
    write_variant(tmp_path, "sharegpt_replies", "shifted", 0.1, "same-prompts", [0.6, 0.5])
    # a loss option: EAGLE-1's inputs and data with another loss, left out of the input ordering too
    write_variant(
        tmp_path, "whole_vocab_loss", "shifted", 0.1, "corpus", [0.9, 0.8], loss_vocab=None
    )
    write_variant(
        tmp_path, "unrolled", "shifted", 0.1, "corpus", [0.9, 0.85], train_depth=2, depth_decay=0.8
    )
    write_variant(
        tmp_path, "token_weight", "shifted", 0.1, "corpus", [0.9, 0.8], w_feat=1.0, w_tok=1.0
    )
    variants = abl.find_variants(tmp_path)
    assert [v.name for v in variants] == [
        "eagle1",
        "feature_only",
        "token_only",
        "no_noise",
        "whole_vocab_loss",
        "token_weight",
        "unrolled",
        "sharegpt_replies",
    ]
    assert [v.loss for v in variants[3:7]] == [
        "4,096 rows",
        "whole vocabulary",
        "4,096 rows, weights 1 feature / 1 token",
        "4,096 rows, depths 1-2 (decay 0.8)",
    ]
    assert variants[0].agreement == [0.8, 0.7] and variants[0].positions == 4000
    labels = {v.name: f"eagle[{v.name}]" for v in variants}
    # feature alone faster than feature + shifted token: not the paper's order
    report = abl.ablation_report(
        variants,
        bench(
            {
                "eagle[eagle1]": [0.5, 0.5],
                "eagle[feature_only]": [0.4, 0.4],
                "eagle[token_only]": [0.8, 0.8],
                "eagle[no_noise]": [0.5, 0.5],
                "eagle[whole_vocab_loss]": [0.1, 0.1],
                "eagle[unrolled]": [0.1, 0.1],
                "eagle[token_weight]": [0.1, 0.1],
                "eagle[sharegpt_replies]": [0.1, 0.1],
            }
        ),
        labels,
    )
    o = report["ordering"]["humaneval"]
    assert o["ours"] == ["feature", "shifted", "token"] and o["paper"] == [
        "shifted",
        "feature",
        "token",
    ]
    assert not o["agrees"]
    row = report["variants"][0]
    assert row["runs"][0]["speedup"] == pytest.approx(2.0) and row["runs"][0]["tau"] == 3.0
    assert row["runs"][0]["speedup_ci"] == pytest.approx((2.0, 2.0))
    report = abl.ablation_report(
        variants,
        bench(
            {
                "eagle[eagle1]": [0.3, 0.3],
                "eagle[feature_only]": [0.4, 0.4],
                "eagle[token_only]": [0.8, 0.8],
                "eagle[no_noise]": [0.5, 0.5],
                "eagle[whole_vocab_loss]": [0.9, 0.9],
                "eagle[unrolled]": [0.9, 0.9],
                "eagle[token_weight]": [0.9, 0.9],
                "eagle[sharegpt_replies]": [0.9, 0.9],
            }
        ),
        labels,
    )
    assert report["ordering"]["humaneval"]["agrees"]
    out = abl.write(report, tmp_path / "report")
    text = (out / "ablations.md").read_text()
    assert (
        "| eagle1 | shifted | 0.1 | corpus | 4,096 rows | 3.00 [3.00, 3.00] | 3.33x [3.33, 3.33]"
        in text
    )
    assert "| whole_vocab_loss | shifted | 0.1 | corpus | whole vocabulary |" in text
    assert "| unrolled | shifted | 0.1 | corpus | 4,096 rows, depths 1-2 (decay 0.8) |" in text
    assert (
        "| token_weight | shifted | 0.1 | corpus | 4,096 rows, weights 1 feature / 1 token |"
        in text
    )
    assert "the same order" in text
    assert (out / "ablations.png").stat().st_size > 5000


def test_a_table_without_the_input_ablation_states_no_ordering(tmp_path):
    write_variant(tmp_path, "eagle1", "shifted", 0.1, "corpus", [0.8, 0.7])
    write_variant(
        tmp_path, "whole_vocab_loss", "shifted", 0.1, "corpus", [0.8, 0.7], loss_vocab=None
    )
    variants = abl.find_variants(tmp_path)
    report = abl.ablation_report(
        variants,
        bench({"eagle[eagle1]": [0.5, 0.5], "eagle[whole_vocab_loss]": [0.5, 0.5]}),
        {v.name: f"eagle[{v.name}]" for v in variants},
    )
    assert report["ordering"] == {} and "order" not in abl.markdown(report)


def test_no_variants_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="make ablations"):
        abl.find_variants(tmp_path)


def test_the_report_lands_beside_the_drafters_it_compares(tmp_path):
    """ablations.out_dir follows ablations.dir: a table of other drafters never overwrites the
    default one's report."""
    from helpers.configs import compose_config

    cfg = compose_config(
        "decode", [f"paths.runs_dir={tmp_path}", f"ablations.dir={tmp_path / 'capacity'}"]
    )
    assert cfg.ablations.out_dir == str(tmp_path / "capacity" / "report")
    assert compose_config("decode", [f"paths.runs_dir={tmp_path}"]).ablations.out_dir == str(
        tmp_path / "ablations" / "report"
    )


def tau_bench(committed: dict[str, list[int]], complete: bool = True) -> dict:
    """A finished benchmark at T=0 where method m commits `committed[m]` tokens in 10 forwards on
    each of its prompts (in 1 s each)."""
    n = len(next(iter(committed.values())))
    methods = {
        "vanilla": {
            "tau": 1.0,
            "speedup": 1.0,
            "per_prompt": per_prompt([10] * n, [10] * n, [10] * n, [1.0] * n),
        }
    }
    for m, c in committed.items():
        methods[m] = {
            "tau": sum(c) / (10 * n),
            "speedup": 1.0,
            "per_prompt": per_prompt([10] * n, c, [10] * n, [1.0] * n),
        }
    return {
        "status": "complete" if complete else "incomplete",
        "runs": [{"eval_set": "mtbench", "temperature": 0.0, "num_prompts": n, "methods": methods}],
    }


def test_each_variant_is_measured_against_its_control_on_the_same_prompts(tmp_path):
    """The paired difference: prompts of very different difficulty (tau 1.2 to 3.0) on which a
    variant is 0.1 below EAGLE-1 on every one: its own interval overlaps EAGLE-1's, the paired
    difference is -0.1 exactly. The self-distilled data are measured against ShareGPT's own
    replies to the same prompts, the other variants against EAGLE-1."""
    write_variant(tmp_path, "eagle1", "shifted", 0.1, "corpus", [0.8, 0.7])
    write_variant(tmp_path, "feature_only", "feature", 0.1, "corpus", [0.7, 0.5])
    write_variant(tmp_path, "sharegpt_replies", "shifted", 0.1, "same-prompts", [0.6, 0.5])
    write_variant(tmp_path, "self_distilled", "shifted", 0.1, "own-replies", [0.7, 0.6])
    variants = abl.find_variants(tmp_path)
    labels = {v.name: f"eagle[{v.name}]" for v in variants}
    eagle1 = [12, 30, 18, 25, 14, 22]
    report = abl.ablation_report(
        variants,
        tau_bench(
            {
                "eagle[eagle1]": eagle1,
                "eagle[feature_only]": [c - 1 for c in eagle1],
                "eagle[sharegpt_replies]": [c - 2 for c in eagle1],
                "eagle[self_distilled]": [c - 1 for c in eagle1],
            }
        ),
        labels,
    )
    rows = {r["name"]: r for r in report["variants"]}
    assert [
        rows[n]["control"] for n in ("eagle1", "feature_only", "sharegpt_replies", "self_distilled")
    ] == [None, "eagle1", "eagle1", "sharegpt_replies"]
    feature = rows["feature_only"]["runs"][0]
    assert feature["dtau"] == pytest.approx(-0.1) and feature["dtau_ci"] == pytest.approx(
        (-0.1, -0.1)
    )
    assert feature["tau_above_control"] == 0.0
    assert (
        feature["tau_ci"][1] > rows["eagle1"]["runs"][0]["tau_ci"][0]
    )  # the unpaired intervals overlap
    distilled = rows["self_distilled"]["runs"][0]  # above its control, below EAGLE-1
    assert distilled["dtau"] == pytest.approx(0.1) and distilled["tau_above_control"] == 1.0
    assert "dtau" not in rows["eagle1"]["runs"][0]
    table = abl.markdown(report)
    assert "| tau - control's T=0 |" in table
    assert (
        "(the control: eagle1 for feature_only, sharegpt_replies, sharegpt_replies for "
        "self_distilled)"
        in table
    )
    line = next(ln for ln in table.splitlines() if ln.startswith("| feature_only"))
    assert "-0.10 [-0.10, -0.10], higher in 0%" in line


def test_a_table_is_rebuilt_from_a_finished_benchmark_without_decoding(tmp_path, capsys):
    """`ablations.rebuild=true`: the table of the benchmark already in the report folder, leaving
    out (and naming) drafters it did not decode; no benchmark, an unfinished one, none of the
    drafters, or a drafter saved again since the benchmark is a clear error."""
    from decode import decode
    from helpers.configs import compose_config

    root = tmp_path / "ablations"
    for name, inputs in (
        ("eagle1", "shifted"),
        ("feature_only", "feature"),
        ("token_only", "token"),
    ):
        write_variant(root, name, inputs, 0.1, "corpus", [0.8, 0.7])
    cfg = compose_config(
        "decode",
        [
            "mode=ablations",
            "ablations.rebuild=true",
            f"ablations.dir={root}",
            "target=/nonexistent",
        ],
    )  # nothing is loaded
    with pytest.raises(FileNotFoundError, match="no benchmark at"):
        decode(cfg)
    bench_dir = root / "report" / "bench"
    bench_dir.mkdir(parents=True)
    results = bench_dir / "results.json"
    results.write_text(json.dumps(tau_bench({"eagle[eagle1]": [20, 30]}, complete=False)))
    with pytest.raises(ValueError, match="did not finish"):
        decode(cfg)
    results.write_text(json.dumps(tau_bench({"eagle[other]": [20, 30]})))
    with pytest.raises(ValueError, match="decoded none of the drafters"):
        decode(cfg)
    results.write_text(
        json.dumps(tau_bench({"eagle[eagle1]": [20, 30], "eagle[feature_only]": [18, 29]}))
    )
    decode(cfg)  # a benchmark from before the drafters were recorded: said, and rebuilt
    out = capsys.readouterr().out
    assert (
        "token_only: not in the benchmark" in out
        and "cannot be checked against the drafters' files" in out
    )
    report = json.loads((root / "report" / "ablations.json").read_text())
    assert [r["name"] for r in report["variants"]] == ["eagle1", "feature_only"]
    assert report["variants"][1]["runs"][0]["dtau"] == pytest.approx(-0.15)
    drafters = {
        f"eagle[{name}]": str(root / name / "drafter") for name in ("eagle1", "feature_only")
    }
    abl.record_drafters(bench_dir, drafters)  # what a benchmark run now writes beside its results
    decode(cfg)
    assert "cannot be checked" not in capsys.readouterr().out
    metrics = root / "feature_only" / "drafter" / "train_metrics.json"
    os.utime(
        metrics, ns=(metrics.stat().st_atime_ns, metrics.stat().st_mtime_ns + 10**9)
    )  # saved again
    table = (root / "report" / "ablations.md").read_text()
    with pytest.raises(ValueError, match="feature_only changed since the benchmark"):
        decode(cfg)
    assert (
        root / "report" / "ablations.md"
    ).read_text() == table  # a refused rebuild moves nothing aside
