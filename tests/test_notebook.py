"""notebooks/feature_error.ipynb runs end to end on a tiny random run laid out like `make demo`'s."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest

from data_gen.__main__ import generate
from helpers.configs import compose_config, compose_train
from helpers.models import ROOT, save_tiny_target, small_tokenizer
from train import train

NOTEBOOK = ROOT / "notebooks" / "feature_error.ipynb"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """target_tiny/model, its features, drafter_tiny, the two ablation drafters and a benchmark,
    all tiny (random target, a few drafter steps), at the paths the notebook reads by default."""
    runs = tmp_path_factory.mktemp("runs")
    target = save_tiny_target(runs / "target_tiny" / "model", small_tokenizer())
    generate(compose_config("data_gen", [
        f"target_path={target}", f"out_dir={runs / 'data/features/target_tiny-python_stdlib'}",
        "target_dtype=float32", "device=cpu", "max_len=32", "shard_size=8", "batch_size=4", "progress=false",
        "source.max_files=24", "source.val_fraction=0.25", "source.max_samples=16", "source.max_val_samples=4"]))
    for task, noise in (("drafter_tiny", 0.1), ("drafter_ablation_noise0.1", 0.1), ("drafter_ablation_noise0.0", 0.0)):
        train(compose_train([
            "experiment=drafter_test", f"paths.runs_dir={runs}", f"task_name={task}",
            f"model.target_path={target}", f"model.noise={noise}", "logger=csv", "trainer.max_steps=2",
            f"data.datamodule.features_dir={runs / 'data/features/target_tiny-python_stdlib'}"]))
    prompts = runs / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("def f(x):", "class A:")))
    from decode import decode

    decode(compose_config("decode", [
        f"target={target}", f"eagle.drafter={runs / 'drafter_tiny/drafter'}", f"paths.runs_dir={runs}",
        "max_new_tokens=12", "mode=benchmark", f"benchmark.eval_sets=[{prompts}]",
        "benchmark.methods=[vanilla,eagle]", f"benchmark.out_dir={runs / 'bench/run1'}"]))
    return runs


def test_feature_error_notebook_runs_end_to_end(tiny_run, tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "notebooks"))
    from execute import execute

    figures = tmp_path / "figures"
    monkeypatch.setenv("FEATURE_ERROR_RUNS", str(tiny_run))
    monkeypatch.setenv("FEATURE_ERROR_MAX_SAMPLES", "8")
    monkeypatch.setenv("FEATURE_ERROR_FIGURES", str(figures))
    out = execute(NOTEBOOK, tmp_path / "executed.ipynb", timeout=300)

    nb = nbformat.read(out, as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert text.count("Conclusion") == 6  # sections 1, 2, 4, 5 and section 3 for T=0 and T=1
    assert "nan" not in text.lower()
    for png in ("feature_error_by_depth.png", "agreement_by_depth.png", "acceptance_by_tree_position.png",
                "train_vs_validation.png", "noise_ablation.png"):
        assert (figures / png).stat().st_size > 5000, png


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert "parameters" in nb.cells[1].metadata.get("tags", [])


def test_ablation_preset_differs_from_drafter_tiny_only_in_length_and_noise():
    from omegaconf import OmegaConf

    def cfg(*overrides):
        return OmegaConf.to_container(compose_train([*overrides, "paths.root_dir=/nowhere"]), resolve=True)

    tiny = cfg("experiment=drafter_tiny")
    for noise in (0.1, 0.0):
        abl = cfg("experiment=drafter_ablation", f"model.noise={noise}")
        assert abl["task_name"] == f"drafter_ablation_noise{noise}"
        assert abl["model"] == {**tiny["model"], "noise": noise}
        assert abl["data"] == tiny["data"] and abl["seed"] == tiny["seed"]
        assert abl["trainer"]["max_steps"] == 250 < tiny["trainer"]["max_steps"]
