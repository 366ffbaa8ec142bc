"""scripts/drafter_curve.py: tau of every checkpoint a drafter run kept, greedy and sampled."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from helpers.configs import compose_train
from train import train

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location(
        "drafter_curve", ROOT / "scripts" / "drafter_curve.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_curve_over_the_checkpoints_of_a_run(tmp_path, target_dir, features_dir, monkeypatch):
    train(
        compose_train(
            [
                "experiment=drafter_test",
                f"paths.runs_dir={tmp_path}",
                f"model.target_path={target_dir}",
                f"data.datamodule.features_dir={features_dir}",
                "callbacks.model_checkpoint.save_top_k=-1",
            ]
        )
    )
    run = tmp_path / "drafter_test"
    curve = load_script()
    assert [step for step, _ in curve.checkpoints(run)] == [
        2,
        4,
    ]  # every kept step=N.ckpt, last.ckpt aside
    assert sorted(curve.validation_top1(run)) == [2, 4]

    out = tmp_path / "curve"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "drafter_curve.py",
            "--run",
            str(run),
            "--target",
            str(target_dir),
            "--trees",
            "chain5",
            "specinfer_221%64",
            "--temperatures",
            "0",
            "1",
            "--prompts",
            "2",
            "--new-tokens",
            "12",
            "--threads",
            "1",
            "--out",
            str(out),
            "--extra",
            f"final={run / 'drafter'}",
        ],
    )
    chosen = []  # the kernels the target's linears were switched to: the fastest that build here
    real = curve.use_kernels
    monkeypatch.setattr(
        curve, "use_kernels", lambda model, kernels: chosen.append(kernels) or real(model, kernels)
    )
    curve.main()
    assert chosen == ["fused" if "fused" in curve.available_kernels() else "default"]
    report = json.loads((out / "curve.json").read_text())
    assert not (
        out / "curve.partial.json"
    ).exists()  # curve.json, the marker, comes with the report
    columns = ["chain5", "chain5 T=1", "specinfer_221%64", "specinfer_221%64 T=1"]
    assert [(r["label"], r["step"]) for r in report["rows"]] == [
        ("drafter_test", 2),
        ("drafter_test", 4),
        ("final", 4),
    ]
    for row in report["rows"]:
        assert sorted(row["tau"]) == sorted(columns)
        assert all(
            1.0 <= tau <= 6.0 for tau in row["tau"].values()
        )  # a round commits 1 to depth + 1 tokens
    last, final = report["rows"][1], report["rows"][2]
    # the last checkpoint holds the exported drafter's weights, and sampled rounds are seeded per
    # prompt
    assert last["tau"] == pytest.approx(final["tau"])
    assert (
        last["tokens"] == pytest.approx(final["tokens"])
        and last["val"]["val/top1_d1"] == final["val"]["val/top1_d1"]
    )
    for row in report["rows"]:  # every prompt's (committed, forwards), pooled into the column's tau
        assert all(len(row["per_prompt"][c]) == 2 for c in columns)
        assert all(
            row["tau"][c] == pytest.approx(curve.pooled_tau(row["per_prompt"][c])) for c in columns
        )
    assert len(report["prompt_ids"]) == 2 and report["run"] == "drafter_test"
    table = (out / "curve.md").read_text()
    assert all(f"tau {c}" in table for c in columns) and (out / "curve.png").stat().st_size > 0
    assert "training tokens for the goal" in table and "resamples of the 2 prompts" in table

    # the same report again from curve.json alone
    refit = tmp_path / "refit"  # (made by the script)
    monkeypatch.setattr(
        sys, "argv", ["drafter_curve.py", "--refit", str(out / "curve.json"), "--out", str(refit)]
    )
    curve.main()
    assert (refit / "curve.md").read_text() == table


def synthetic_curve(per_prompt_tau: list[list[float]], tokens: list[float]) -> dict:
    """A curve.json's data: checkpoint i's prompt j commits per_prompt_tau[i][j] x 100 tokens in 100
    forwards."""
    rows = [
        {
            "label": "run",
            "step": i,
            "tokens": t,
            "cpu_minutes": i,
            "val": {},
            "tau": {"chain5": sum(taus) / len(taus)},
            "per_prompt": {"chain5": [[round(100 * tau), 100] for tau in taus]},
        }
        for i, (taus, t) in enumerate(zip(per_prompt_tau, tokens))
    ]
    return {"trees": ["chain5"], "temperatures": [0.0], "run": "run", "rows": rows}


def test_the_fit_finds_a_log_linear_law_and_its_goal():
    curve = load_script()
    tokens = [1e6, 2e6, 4e6, 8e6]
    # tau = 1.5 + 0.25 log2(tokens / 1M) on every prompt: 3.0 is reached after 6 doublings, at 64M
    data = synthetic_curve([[1.5 + 0.25 * i] * 3 for i in range(4)], tokens)
    found = curve.fit(data, (3.0, 2.5))["chain5"]
    assert found["per_doubling"] == pytest.approx(0.25) and found[
        "later_per_doubling"
    ] == pytest.approx(0.25)
    assert found["tokens_for_goal"] == pytest.approx(64e6)
    # identical prompts: every resample is the same curve, so the interval collapses onto the fit
    assert found["tokens_for_goal_90"] == pytest.approx([64e6, 64e6])
    assert found["per_doubling_90"] == pytest.approx([0.25, 0.25])


def test_the_fit_interval_shows_how_much_the_prompts_move_it():
    curve = load_script()
    tokens = [1e6, 2e6, 4e6, 8e6]
    # one prompt grows 0.4 per doubling, one not at all: the pooled fit says 0.2, a resample of the
    # first alone 0.4 and of the second alone never reaches the goal
    data = synthetic_curve([[1.5 + 0.4 * i, 1.5] for i in range(4)], tokens)
    found = curve.fit(data, (3.0, 2.5))["chain5"]
    assert found["per_doubling"] == pytest.approx(0.2)
    low, high = found["per_doubling_90"]
    assert low == pytest.approx(0.0) and high == pytest.approx(0.4)
    assert found["tokens_for_goal_90"][0] < found["tokens_for_goal"] and found[
        "tokens_for_goal_90"
    ][1] == float("inf")
    assert curve.human(found["tokens_for_goal_90"][1]) == "never"


def test_a_falling_curve_never_reaches_its_goal():
    curve = load_script()
    data = synthetic_curve([[2.0 - 0.1 * i] * 2 for i in range(3)], [1e6, 2e6, 4e6])
    found = curve.fit(data, (3.0, 2.5))["chain5"]
    assert found["per_doubling"] < 0 and found["tokens_for_goal"] == float("inf")
