"""notebooks/feature_error.ipynb runs end to end on a tiny random run: its target, features and
drafter named through the notebook's parameters, its ablations and benchmarks where `make
ablations` and `make demo` put theirs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest

from data_gen.__main__ import generate
from helpers.configs import compose_config, compose_train
from helpers.data import conversations
from helpers.models import ROOT, save_tiny_target, small_tokenizer
from train import train

NOTEBOOK = ROOT / "notebooks" / "feature_error.ipynb"
# the run's folders under RUNS, given to the notebook as FEATURE_ERROR_<key> (its defaults: the
# demo's)
RUN = {"TARGET": "target/model", "FEATURES": "data/features/target-conversations",
       "DRAFTER": "drafter/drafter"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A target, its features, a drafter (at RUN's paths), three ablation drafters and two
    benchmarks, all tiny (random target, a few drafter steps)."""
    runs = tmp_path_factory.mktemp("runs")
    target = save_tiny_target(runs / RUN["TARGET"], small_tokenizer())
    features = runs / RUN["FEATURES"]
    generate(compose_config("data_gen", conversations(
        f"target_path={target}", f"out_dir={features}", "target_dtype=float32", "device=cpu",
        "max_len=32", "shard_size=8", "batch_size=4", "progress=false", "source.max_samples=16",
        "source.max_val_samples=4")))
    for task, inputs, noise in (
        ("drafter", "shifted", 0.1),
        ("ablations/eagle1", "shifted", 0.1),
        ("ablations/no_noise", "shifted", 0.0),
        ("ablations/token_only", "token", 0.1),
    ):
        train(
            compose_train(
                [
                    "experiment=drafter_test",
                    f"paths.runs_dir={runs}",
                    f"task_name={task}",
                    f"model.inputs={inputs}",
                    f"model.target_path={target}",
                    f"model.noise={noise}",
                    "logger=csv",
                    "trainer.max_steps=2",
                    f"data.datamodule.features_dir={features}",
                ]
            )
        )
    prompts = runs / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("def f(x):", "class A:")))
    from decode import decode

    decode(
        compose_config(
            "decode",
            [
                f"target={target}",
                f"eagle.drafter={runs / RUN['DRAFTER']}",
                f"paths.runs_dir={runs}",
                "max_new_tokens=12",
                "mode=benchmark",
                f"benchmark.eval_sets=[{prompts}]",
                "benchmark.methods=[vanilla,eagle]",
                f"benchmark.out_dir={runs / 'bench/run1'}",
            ],
        )
    )
    decode(
        compose_config(
            "decode",
            [
                f"target={target}",
                f"paths.runs_dir={runs}",
                "max_new_tokens=12",
                "mode=ablations",
                f"ablations.eval_sets=[{prompts}]",
                "ablations.num_prompts=2",
            ],
        )
    )
    return runs


def test_feature_error_notebook_runs_end_to_end(tiny_run, tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "notebooks"))
    from execute import execute

    figures = tmp_path / "figures"
    monkeypatch.setenv("FEATURE_ERROR_RUNS", str(tiny_run))
    for key, sub in RUN.items():
        monkeypatch.setenv(f"FEATURE_ERROR_{key}", sub)
    monkeypatch.setenv("FEATURE_ERROR_MAX_SAMPLES", "8")
    monkeypatch.setenv("FEATURE_ERROR_FIGURES", str(figures))
    out = execute(NOTEBOOK, tmp_path / "executed.ipynb", timeout=300)

    nb = nbformat.read(out, as_version=4)
    text = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert text.count("Conclusion") == 7  # sections 1, 2, 4, 5, 6 and section 3 for T=0 and T=1
    assert "nan" not in text.lower()
    for png in (
        "feature_error_by_depth.png",
        "agreement_by_depth.png",
        "acceptance_by_tree_position.png",
        "train_vs_validation.png",
        "noise_ablation.png",
        "ablations.png",
    ):
        assert (figures / png).stat().st_size > 5000, png


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert "parameters" in nb.cells[1].metadata.get("tags", [])


ABLATION_FACTORS = {
    "eagle1": ("shifted", 0.1, None),
    "unshifted": ("unshifted", 0.1, None),
    "feature_only": ("feature", 0.1, None),
    "token_only": ("token", 0.1, None),
    "no_noise": ("shifted", 0.0, None),
    "self_distilled": ("shifted", 0.1, "self_distilled"),
    "self_distilled_greedy": ("shifted", 0.1, "self_distilled_greedy"),
    "sharegpt_replies": ("shifted", 0.1, "sharegpt_replies"),
    "whole_vocab_loss": ("shifted", 0.1, None),
    "token_weight": ("shifted", 0.1, None),
    "unrolled": ("shifted", 0.1, None),
}
# options that change the loss: the model key and its value (loss_vocab None: the whole vocabulary)
LOSS_FACTORS = {
    "whole_vocab_loss": ("loss_vocab", None),
    "token_weight": ("w_tok", 1.0),
    "unrolled": ("train_depth", 2),
}
# experiment -> (its base recipe, steps, run folder, data of the base, the data options' dumps)
ABLATION_RUNS = {
    "eagle_ablation": (
        "drafter_smollm2",
        300,
        "ablations",
        "smollm2-sharegpt",
        {
            "self_distilled": "smollm2-sharegpt-selfdistilled-t1",
            "self_distilled_greedy": "smollm2-sharegpt-selfdistilled",
            "sharegpt_replies": "smollm2-sharegpt-source",
        },
    ),
}


@pytest.mark.parametrize("experiment", list(ABLATION_RUNS))
@pytest.mark.parametrize("name", list(ABLATION_FACTORS))
def test_each_ablation_differs_from_eagle1_in_one_factor_only(experiment, name):
    """Every option of configs/ablation/ is the base drafter's recipe (SmolLM2's demo drafter),
    shortened alike, with exactly the factor it names changed (same seed, steps and everything
    else), in runs/<ablations>/<name>."""
    from omegaconf import OmegaConf

    def cfg(*overrides):
        c = OmegaConf.to_container(
            compose_train([*overrides, "paths.root_dir=/nowhere"]), resolve=True
        )
        for key in ("task_name", "ablation", "ablation_data", "paths", "callbacks"):
            c.pop(key, None)
        return c

    base_name, steps, folder, base_data, dumps = ABLATION_RUNS[experiment]
    base = cfg(f"experiment={base_name}")
    if name in LOSS_FACTORS and base["model"].get(LOSS_FACTORS[name][0]) == LOSS_FACTORS[name][1]:
        pytest.skip(f"{base_name} already trains with this loss")
    run = compose_train([f"experiment={experiment}", f"ablation={name}", "paths.root_dir=/nowhere"])
    assert run.paths.run_dir == f"/nowhere/runs/{folder}/{name}" and run.ablation.name == name
    got = cfg(f"experiment={experiment}", f"ablation={name}")
    inputs, noise, data = ABLATION_FACTORS[name]
    assert (got["model"]["inputs"], got["model"]["noise"]) == (inputs, noise)
    assert got["data"]["name"] == (dumps[data] if data else base_data)
    assert got["trainer"]["max_steps"] == steps < base["trainer"]["max_steps"]
    for key in ("inputs", "noise"):
        got["model"].pop(key), base["model"].pop(key, None)
    if name in LOSS_FACTORS:
        key, value = LOSS_FACTORS[name]
        assert got["model"].pop(key) == value != base["model"].pop(key)
    assert got["model"] == base["model"] and got["seed"] == base["seed"]
    if not data:
        assert got["data"] == base["data"]
    for key in (
        "max_steps",
        "val_check_interval",
        "default_root_dir",
    ):  # the run folder differs by design
        got["trainer"].pop(key), base["trainer"].pop(key)
    # the whole validation set: the report's agreement margins are binomial in its positions
    assert got["trainer"].pop("limit_val_batches", 1.0) == 1.0
    base["trainer"].pop("limit_val_batches", None)
    assert got["trainer"] == base["trainer"]


def test_an_ablation_run_records_its_drafters_and_rebuilds_its_table(tiny_run, capsys):
    """mode=ablations writes which drafter files its benchmark decoded; a rebuild of its table from
    that benchmark checks them and gives the same taus, decoding nothing."""
    from decode import decode

    report_dir = tiny_run / "ablations" / "report"
    recorded = json.loads((report_dir / "bench" / "drafters.json").read_text())
    assert set(recorded["drafters"]) == {"eagle[eagle1]", "eagle[no_noise]", "eagle[token_only]"}
    before = json.loads((report_dir / "ablations.json").read_text())
    decode(
        compose_config(
            "decode",
            [
                f"paths.runs_dir={tiny_run}",
                "mode=ablations",
                "ablations.rebuild=true",
                "target=/nonexistent",
            ],
        )
    )
    assert "cannot be checked" not in capsys.readouterr().out
    after = json.loads((report_dir / "ablations.json").read_text())
    assert [[run["tau"] for run in v["runs"]] for v in after["variants"]] == [
        [run["tau"] for run in v["runs"]] for v in before["variants"]
    ]
