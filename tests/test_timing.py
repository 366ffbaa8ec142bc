"""Round timing at a model shape with random weights (eagle/bench/timing.py, decode.py
mode=timing), and its projection through a trained target's tau."""

from __future__ import annotations

import json

import pytest

from eagle.bench.methods import MethodError
from helpers.configs import decode_cfg


def test_timing_mode_times_rounds_and_labels_the_projection(models, tmp_path):
    """mode=timing: random weights at a (here tiny) shape, no checkpoint; the projection divides
    the timed eagle:static round by a benchmark's tau and says it is a projection."""
    from decode import decode

    results = tmp_path / "results.json"

    def runs(*rows: tuple[str, float, dict]) -> str:  # a benchmark report's runs, target "t"
        return json.dumps({"runs": [{"eval_set": name, "temperature": t, "target": "t",
                                     "methods": methods} for name, t, methods in rows]})

    results.write_text(runs(("humaneval", 0.0, {"eagle:static": {"tau": 4.0}}),
                            ("humaneval", 1.0, {"vanilla": {"tau": 1.0}})))
    shape = [f"timing.shape.{k}={v}" for k, v in (
        ("hidden_size", 32), ("intermediate_size", 64), ("num_hidden_layers", 2),
        ("num_attention_heads", 4), ("num_key_value_heads", 2), ("vocab_size", 96))]
    out = tmp_path / "timing"
    cfg = decode_cfg(models, tmp_path, "mode=timing", *shape, "timing.shape_name=tiny",
                     "timing.new_tokens=10", "timing.prompt_len=5", "timing.repeats=1",
                     "timing.max_len=64", f"timing.tau_from={results}", f"timing.out_dir={out}")
    with pytest.raises(ValueError, match="no nominal memory bandwidth is known for 'cpu': give "
                                         "timing.bandwidth_gb_s"):
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
    round_ms = report["methods"]["eagle:static"]["ms_per_round"]
    assert row["projected_ms_per_token"] == pytest.approx(round_ms / 4)
    assert "Projection** (not a measurement)" in (out / "timing.md").read_text()
    # timing.measured: no timing again, only the projection from another benchmark
    results.write_text(runs(("mtbench", 0.0, {"eagle": {"tau": 2.0}})))
    again = tmp_path / "again"
    measured = f"timing.measured={out / 'timing.json'}"
    decode(decode_cfg(models, tmp_path, "mode=timing", measured, f"timing.tau_from={results}",
                      f"timing.out_dir={again}"))
    (row,) = json.loads((again / "timing.json").read_text())["projection"]
    assert row["eval_set"] == "mtbench" and row["tau_method"] == "eagle"
    assert row["round_ms"] == round_ms
    # a tau measured on another tree than the timed one projects nothing: refused
    timed_tree = report["methods"]["eagle:static"]["tree_parents"]
    assert len(timed_tree) == 26  # EAGLE-1's default tree, root included
    other_tree = {"eagle": {"tau": 2.0, "tree_parents": [-1, 0, 0, 1]}}
    results.write_text(runs(("mtbench", 0.0, other_tree)))
    with pytest.raises(ValueError,
                       match="measured on a tree of 4 nodes, the timed round verifies one of 26"):
        decode(decode_cfg(models, tmp_path, "mode=timing", measured, f"timing.tau_from={results}",
                          f"timing.out_dir={again}"))
    with pytest.raises(MethodError, match="timing runs"):
        decode(decode_cfg(models, tmp_path, "mode=timing", *shape, "timing.methods=[draft]"))
