"""eagle.bench.intervals, and the benchmark's report of them: intervals over prompts, paired
resamples, and the lead of the fastest method that drafts."""

from __future__ import annotations

import pytest

from eagle.bench.benchmark import MethodResult, _speedups, markdown_table
from eagle.bench.intervals import bootstrap_interval, error_bars, lead_share


def per_prompt(tokens, committed, forwards, seconds):
    return {"tokens": tokens, "committed": committed, "forwards": forwards, "seconds": seconds}


def test_bootstrap_interval_is_a_point_when_every_prompt_agrees_and_widens_with_spread():
    same = per_prompt([10] * 8, [10] * 8, [4] * 8, [1.0] * 8)
    vanilla = per_prompt([10] * 8, [10] * 8, [10] * 8, [2.0] * 8)
    ci = bootstrap_interval(same, vanilla)
    assert ci["tau"] == pytest.approx((2.5, 2.5)) and ci["speedup"] == pytest.approx((2.0, 2.0))
    spread = per_prompt([10] * 8, [10] * 8, [2, 8] * 4, [0.5, 1.5] * 4)
    ci = bootstrap_interval(spread, vanilla)
    lo, hi = ci["tau"]
    assert lo < 2.0 < hi  # the pooled tau is 80 / 40 = 2.0
    lo, hi = ci["speedup"]
    assert lo < 2.0 < hi  # 80 tokens in 8 s against 80 in 16 s


# prompts whose speed differs 8x (a copying prompt and slow ones): a method 10% faster than its
# rival on every prompt, both timed on the same prompts
SECONDS = [1.0, 8.0, 2.0, 6.0, 1.0, 4.0]
RIVAL = per_prompt([100] * 6, [100] * 6, [100] * 6, SECONDS)
LEADER = per_prompt([110] * 6, [110] * 6, [100] * 6, SECONDS)


def test_a_speedup_the_same_on_every_prompt_is_a_point():
    """Paired, a method 1.155x vanilla's speed on each prompt is 1.155x in every resample; drawing
    the two methods' prompts apart would spread it over [~0.5, ~2.5]."""
    vanilla = per_prompt([100] * 6, [100] * 6, [100] * 6, [t * 1.05 for t in SECONDS])
    assert bootstrap_interval(LEADER, vanilla)["speedup"] == pytest.approx((1.155, 1.155))


def test_error_bars_are_never_negative():
    """A percentile interval need not hold its point (rounding alone, where every resample agrees):
    matplotlib refuses a negative error bar, which would stop a benchmark's report."""
    assert error_bars([1.7, 2.0, 1.0], [(1.7000000000000002, 1.8), None, (0.9, 0.99)]) == \
        [[0.0, 0.0, pytest.approx(0.1)], [pytest.approx(0.1), 0.0, 0.0]]


def test_a_lead_on_every_prompt_holds_in_every_paired_resample():
    """Resampled with the same draws, a method faster on each prompt is faster in every resample,
    though its interval overlaps its rival's: drawing each method's prompts on its own (unpaired)
    would put it behind in ~40% of them (42% with seeds 0 and 1)."""
    assert lead_share(LEADER, RIVAL) == 1.0 and lead_share(RIVAL, LEADER) == 0.0
    assert lead_share(LEADER, LEADER, what="tau") == 0.5  # a tie counts half
    vanilla = per_prompt([100] * 6, [100] * 6, [100] * 6, [2.0] * 6)
    lead, rival = (
        bootstrap_interval(LEADER, vanilla)["speedup"],
        bootstrap_interval(RIVAL, vanilla)["speedup"],
    )
    assert lead[0] < rival[1]  # the intervals overlap


def result(name, p, lossless=True):
    rate = sum(p["tokens"]) / sum(p["seconds"])
    return MethodResult(
        method=name,
        dtype="float32",
        lossless=lossless,
        tau=sum(p["committed"]) / sum(p["forwards"]),
        tokens_per_s=rate,
        tokens_per_s_median=rate,
        per_prompt=p,
    )


def run_of(results, n):
    from dataclasses import asdict

    _speedups(results)
    return {
        "eval_set": "mtbench",
        "temperature": 0.0,
        "target": "t",
        "num_prompts": n,
        "max_new_tokens": 100,
        "fastest_vanilla": "vanilla",
        "methods": {k: asdict(v) for k, v in results.items()},
    }


def test_the_benchmark_reports_intervals_and_the_leaders_paired_lead():
    vanilla = per_prompt([100] * 6, [100] * 6, [100] * 6, [1.2, 8.0, 2.5, 6.0, 1.1, 4.5])
    results = {
        "vanilla": result("vanilla", vanilla),
        "prompt_lookup": result("prompt_lookup", RIVAL),
        "eagle": result("eagle", LEADER),
        "medusa_typical": result(
            "medusa_typical", per_prompt([100] * 6, [100] * 6, [10] * 6, [0.1] * 6), lossless=False
        ),
    }
    run = run_of(results, 6)
    eagle = run["methods"]["eagle"]
    lo, hi = eagle["speedup_vs_fastest_ci"]
    assert lo < eagle["speedup_vs_fastest"] - 0.05 and eagle["speedup_vs_fastest"] + 0.05 < hi
    assert eagle["tau_ci"] == pytest.approx((1.1, 1.1))
    assert run["methods"]["vanilla"]["speedup_vs_fastest_ci"] == pytest.approx((1.0, 1.0))
    table = markdown_table({"runs": [run]})
    row = next(line for line in table.splitlines() if line.startswith("| eagle |"))
    assert (
        f"{eagle['speedup_vs_fastest']:.2f}x [{lo:.2f}, {hi:.2f}]" in row and "1.10 |" in row
    )  # a point: no interval
    vanilla_row = next(line for line in table.splitlines() if line.startswith("| vanilla |"))
    assert (
        "[" not in vanilla_row
    )  # the baseline against itself, and plain decoding's tau, are no intervals
    # the lossy method is faster, but the lead is the fastest lossless method's that drafts
    lead = next(
        line
        for line in table.splitlines()
        if line.startswith("Fastest lossless method that drafts")
    )
    assert "`eagle`" in lead and "`prompt_lookup` in 100%" in lead and "`vanilla` in 100%" in lead
    assert "medusa_typical" not in lead and "of the 6 prompts" in lead


def test_the_summary_puts_every_run_side_by_side_and_marks_lossy_methods():
    """The table printed last: one row a method (tree files cut to their names), tau and the
    speedup over the fastest plain decoding with its interval in each run; a method missing from a
    run is a dash. A report of one run has none."""
    vanilla = per_prompt([100] * 6, [100] * 6, [100] * 6, [1.2, 8.0, 2.5, 6.0, 1.1, 4.5])
    first = run_of(
        {
            "vanilla": result("vanilla", vanilla),
            "eagle@runs/t/machine.yaml%4096": result("eagle@runs/t/machine.yaml%4096", LEADER),
            "medusa_typical": result("medusa_typical", RIVAL, lossless=False),
        },
        6,
    )
    second = run_of(
        {
            "vanilla": result("vanilla", vanilla),
            "eagle@runs/t/machine.yaml%4096": result("eagle@runs/t/machine.yaml%4096", LEADER),
        },
        6,
    )
    second["temperature"] = 1.0
    table = markdown_table({"runs": [first, second]})
    summary = table[table.index("### Summary") :].splitlines()
    assert summary[2] == "| method | mtbench T=0: tau | speedup | mtbench T=1: tau | speedup |"
    eagle = first["methods"]["eagle@runs/t/machine.yaml%4096"]
    lo, hi = eagle["speedup_vs_fastest_ci"]
    row = f"{eagle['tau']:.2f} | {eagle['speedup_vs_fastest']:.2f}x [{lo:.2f}, {hi:.2f}]"
    assert f"| eagle@machine%4096 | {row} | {row} |" in summary
    assert any(
        line.startswith("| medusa_typical (LOSSY) |") and line.endswith("| - | - |")
        for line in summary
    )
    # and each run's lead, one line a run: the lossy method is faster, but no leader
    assert "- mtbench T=0: eagle@machine%4096, faster than vanilla in 100%" in summary
    assert "- mtbench T=1: eagle@machine%4096, faster than vanilla in 100%" in summary
    assert "### Summary" not in markdown_table({"runs": [first]})


def test_a_run_without_plain_decoding_or_from_an_older_report_still_renders():
    """No plain decoding in the run: tau still has its interval, the speedup none. A run kept from
    a report made before the intervals (no `*_ci`, no per-prompt lists, no speedup_vs_fastest):
    the table and the lead line render what there is."""
    results = {"eagle": result("eagle", LEADER), "prompt_lookup": result("prompt_lookup", RIVAL)}
    run = run_of(results, 6) | {"fastest_vanilla": None}
    assert (
        run["methods"]["eagle"]["tau_ci"] is not None
        and run["methods"]["eagle"]["speedup_vs_fastest_ci"] is None
    )
    lead = next(
        line for line in markdown_table({"runs": [run]}).splitlines() if line.startswith("Fastest")
    )
    assert "`prompt_lookup` in 100%" in lead and "fastest plain decoding)" not in lead
    old = {
        k: {
            f: v
            for f, v in m.items()
            if not f.endswith("_ci") and f not in ("per_prompt", "speedup_vs_fastest")
        }
        for k, m in run["methods"].items()
    }
    table = markdown_table({"runs": [run | {"methods": old}]})
    assert "| eagle |" in table and "[" not in table and "Fastest lossless" not in table


def test_one_prompt_has_no_interval_and_no_lead():
    one = {
        name: result(name, per_prompt([100], [100], [f], [s]))
        for name, f, s in (("vanilla", 100, 1.0), ("eagle", 50, 0.6))
    }
    run = run_of(one, 1)
    assert (
        run["methods"]["eagle"]["speedup_vs_fastest_ci"] is None
        and run["methods"]["eagle"]["tau_ci"] is None
    )
    table = markdown_table({"runs": [run]})
    assert "[" not in table and "Fastest lossless" not in table
