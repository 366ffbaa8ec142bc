"""Where EAGLE's round goes (eagle/bench/profile.py, decode.py mode=profile)."""

from __future__ import annotations

import json

import pytest

from helpers.configs import decode_cfg


def test_profile_splits_the_round(models, tmp_path):
    """mode=profile: the parts add up to the round, EAGLE's default tree takes 5 drafter passes
    per round (catch-up + depths 1-4), and every timed function is restored afterwards."""
    import eagle.decoding.engine as engine
    from decode import decode
    from eagle.sampling import SamplingPolicy

    probs, greedy = SamplingPolicy.probs, engine.verify_tree_greedy
    out = tmp_path / "profile"
    decode(decode_cfg(models, tmp_path, "mode=profile",
                      f"profile.eval_set={models / 'prompts.jsonl'}",
                      "profile.num_prompts=2", "profile.new_tokens=16", "profile.dtype=float32",
                      f"profile.out_dir={out}"))
    report = json.loads((out / "profile.json").read_text())
    b = report["eagle"]
    assert b["drafter_passes_per_round"] == 5
    assert b["calls"]["drafter: LM head"] == b["calls"]["drafter: FC + decoder layer"]
    assert b["calls"]["target: tree forward"] == b["rounds"] == b["calls"]["acceptance"]
    assert "target: logits processing" not in b["calls"]  # greedy; the drafter's are not counted
    assert sum(b["parts_ms"].values()) == pytest.approx(b["round_ms"])
    assert all(ms >= 0 for ms in b["parts_ms"].values())
    assert report["speedup"] > 0 and report["vanilla"]["step_ms"] > 0
    # the speedup is the untimed decode's (the timers' synchronisations would bias it on a GPU)
    step_ms = report["vanilla"]["step_ms"]
    assert report["speedup"] == pytest.approx(step_ms * b["tau"] / b["untimed_round_ms"])
    assert report["fastest_vanilla"] == "float32"
    assert report["speedup_vs_fastest"] == pytest.approx(report["speedup"])
    assert "target layers" in (out / "profile.md").read_text()
    assert SamplingPolicy.probs is probs and engine.verify_tree_greedy is greedy
    # EAGLE in bf16 on a CPU: vanilla in both dtypes, the speedup also against the faster one
    out = tmp_path / "profile_bf16"
    decode(decode_cfg(models, tmp_path, "mode=profile",
                      f"profile.eval_set={models / 'prompts.jsonl'}",
                      "profile.num_prompts=1", "profile.new_tokens=8", "profile.dtype=bfloat16",
                      f"profile.out_dir={out}"))
    report = json.loads((out / "profile.json").read_text())
    steps = {d: v["step_ms"] for d, v in report["vanilla_by_dtype"].items()}
    assert set(steps) == {"bfloat16", "float32"}
    assert report["vanilla"]["step_ms"] == steps["bfloat16"]
    assert report["fastest_vanilla"] == min(steps, key=steps.get)
    faster = min(steps.values()) / steps["bfloat16"]
    assert report["speedup_vs_fastest"] == pytest.approx(report["speedup"] * faster)
    assert "against the faster vanilla" in (out / "profile.md").read_text()
