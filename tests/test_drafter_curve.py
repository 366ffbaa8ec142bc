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
    spec = importlib.util.spec_from_file_location("drafter_curve", ROOT / "scripts" / "drafter_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_curve_over_the_checkpoints_of_a_run(tmp_path, target_dir, features_dir, monkeypatch):
    train(compose_train(["experiment=drafter_test", f"paths.runs_dir={tmp_path}", f"model.target_path={target_dir}",
                         f"data.datamodule.features_dir={features_dir}", "callbacks.model_checkpoint.save_top_k=-1"]))
    run = tmp_path / "drafter_test"
    curve = load_script()
    assert [step for step, _ in curve.checkpoints(run)] == [2, 4]  # every kept step=N.ckpt, last.ckpt aside
    assert sorted(curve.validation_top1(run)) == [2, 4]

    out = tmp_path / "curve"
    monkeypatch.setattr(sys, "argv", [
        "drafter_curve.py", "--run", str(run), "--target", str(target_dir), "--trees", "chain5", "specinfer_221%64",
        "--temperatures", "0", "1", "--prompts", "2", "--new-tokens", "12", "--threads", "1", "--out", str(out),
        "--extra", f"final={run / 'drafter'}"])
    chosen = []  # the kernels the target's linears were switched to: the fastest that build here
    real = curve.use_kernels
    monkeypatch.setattr(curve, "use_kernels", lambda model, kernels: chosen.append(kernels) or real(model, kernels))
    curve.main()
    assert chosen == ["fused" if "fused" in curve.available_kernels() else "default"]
    report = json.loads((out / "curve.json").read_text())
    columns = ["chain5", "chain5 T=1", "specinfer_221%64", "specinfer_221%64 T=1"]
    assert [(r["label"], r["step"]) for r in report["rows"]] == [("drafter_test", 2), ("drafter_test", 4), ("final", 4)]
    for row in report["rows"]:
        assert sorted(row["tau"]) == sorted(columns)
        assert all(1.0 <= tau <= 6.0 for tau in row["tau"].values())  # a round commits 1 to depth + 1 tokens
    last, final = report["rows"][1], report["rows"][2]
    # the last checkpoint holds the exported drafter's weights, and sampled rounds are seeded per prompt
    assert last["tau"] == pytest.approx(final["tau"])
    assert last["tokens"] == pytest.approx(final["tokens"]) and last["val"]["val/top1_d1"] == final["val"]["val/top1_d1"]
    table = (out / "curve.md").read_text()
    assert all(f"tau {c}" in table for c in columns) and (out / "curve.png").stat().st_size > 0
