"""train.py end to end on a causal LM (SpecInfer's SSMs, experiment=ssm_test): composition,
training, the exported model and its sidecar, loggers, resuming, the time limit, the baseline,
progress lines, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle.target import load_target
from eagle.training.datamodules import unigram_cross_entropy
from eagle.training.draft_lm import truncated_copy
from eagle.training.lm import CausalLMModule
from eagle.training.module import StageError, TrainableModule
from helpers.configs import compose_train
from helpers.models import ROOT
from train import train

LM_EXPERIMENTS = ["ssm_boost", "ssm_test"]  # fine-tune a causal LM (eagle.training.lm)


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory, target_dir) -> Path:
    """A draft LM to start from, as SpecInfer's SSMs start: the target's first layer, its
    embeddings and its head."""
    target, tokenizer = load_target(target_dir, dtype=torch.float32)
    out = tmp_path_factory.mktemp("draft_lm")
    truncated_copy(target, 1).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def lm_args(tmp_path: Path, distilled_dir: Path, target_dir: Path, init_dir: Path) -> list[str]:
    """ssm_test on the tiny target's distilled rows, from `init_dir`."""
    return ["experiment=ssm_test", f"paths.runs_dir={tmp_path}",
            f"data.datamodule.distill_dir={distilled_dir}",
            f"data.datamodule.tokenizer_path={target_dir}", f"model.init_from={init_dir}"]


def lm_cfg(tmp_path: Path, distilled_dir: Path, target_dir: Path, init_dir: Path, *overrides: str):
    return compose_train([*lm_args(tmp_path, distilled_dir, target_dir, init_dir), *overrides])


def test_preset_configs_compose():
    for name in LM_EXPERIMENTS:
        cfg = compose_train([f"experiment={name}", "paths.root_dir=/nowhere"])
        OmegaConf.resolve(cfg)  # every interpolation resolves
        assert cfg.task_name == name or name == "ssm_boost" and cfg.task_name == "ssm_boost_1"
        assert cfg.paths.run_dir == f"/nowhere/runs/{cfg.task_name}"
        assert cfg.paths.model_dir == f"/nowhere/runs/{cfg.task_name}/model"
        assert cfg.model._target_ == "eagle.training.lm.CausalLMModule"
        assert cfg.data.datamodule._target_ == "eagle.training.datamodules.DistilledDataModule"
        # SpecInfer's SSMs start from the demo's draft LM, on the default target's own text
        assert cfg.model.init_from == "/nowhere/runs/draft_lm_smollm2/model"
        assert cfg.data.datamodule.tokenizer_path == "/nowhere/runs/smollm2/model"
        assert cfg.model.model_config is None  # the draft LM's own config
    boost, test = (compose_train([f"experiment={n}"]) for n in LM_EXPERIMENTS)
    assert boost.trainer.max_time is not None and boost.trainer.precision == "auto"
    assert test.trainer.max_steps < boost.trainer.max_steps
    assert test.data.datamodule.threshold == boost.data.datamodule.threshold


def test_fast_dev_run(tmp_path, distilled_dir, target_dir, init_dir):
    metrics = train(lm_cfg(tmp_path, distilled_dir, target_dir, init_dir, "debug=fdr"))
    assert metrics["steps"] == 1
    assert math.isfinite(metrics["val/loss"]) and math.isfinite(metrics["val/unigram_loss"])
    run_dir = tmp_path / "debug" / "ssm_test"  # kept apart from the real run's folder
    assert metrics["model_dir"] == str(run_dir / "model")
    assert (run_dir / "model" / "eagle_target.json").exists()
    assert not list(tmp_path.rglob("*.ckpt"))
    assert not (tmp_path / "ssm_test").exists()


def fake_clock(start: float, then: float):
    """A training clock that reads `start` once (when training starts) and `then` ever after."""
    ticks = iter([start])
    return staticmethod(lambda: next(ticks, then))


def test_train_save_load_and_resume(tmp_path, distilled_dir, target_dir, init_dir, monkeypatch):
    overrides = [*lm_args(tmp_path, distilled_dir, target_dir, init_dir), "trainer.max_steps=30",
                 "trainer.val_check_interval=15", "check_baseline=true"]
    cfg = compose_train(overrides)
    monkeypatch.setattr(TrainableModule, "clock", fake_clock(0.0, 42.0))  # 42 s of training
    metrics = train(cfg)
    model_dir = tmp_path / "ssm_test" / "model"
    assert metrics["model_dir"] == str(model_dir)
    assert metrics["steps"] == cfg.trainer.max_steps
    # It learned something: better than the unigram model on the same validation tokens.
    assert metrics["val/loss"] < metrics["val/unigram_loss"] - 0.2

    # The saved HF model and tokenizer load with the Auto classes and match the trained weights.
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ckpt = tmp_path / "ssm_test" / "checkpoints" / "last.ckpt"
    trained = CausalLMModule.load_from_checkpoint(ckpt, map_location="cpu").model.eval()
    ids = tok("def f(x):\n    return x", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trained(ids).logits, rtol=0, atol=0)
    assert model.config.vocab_size == len(tok) == 300
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.num_hidden_layers == 1  # init_from's own config

    side = json.loads((model_dir / "eagle_target.json").read_text())
    assert side["corpus"] == f"self-distilled:{distilled_dir.name}"
    assert side["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert side["train_rows"] == side["all_train_rows"] == 24 and side["covered_by"] == []
    assert side["n_tokens"] == 24 * 16 and side["val_tokens"] == 6 * 15
    assert side["steps"] == cfg.trainer.max_steps
    assert side["tokens_seen"] == side["steps"] * 4 * 15
    assert side["val/loss"] == pytest.approx(metrics["val/loss"])
    assert side["val/unigram_loss"] == pytest.approx(metrics["val/unigram_loss"])
    assert side["train_time_s"] == 42.0 and side["n_params"] > 0
    assert side["status"] == "complete" and side["params"]["tokenizer_hash"]
    assert side["config"]["task_name"] == "ssm_test"
    assert side["params"]["model_config"]["hidden_size"] == 32
    for logger_dir in ("csv", "tensorboard"):
        assert (tmp_path / "ssm_test" / logger_dir).is_dir()
    metrics_csv = next((tmp_path / "ssm_test" / "csv").rglob("metrics.csv")).read_text()
    assert "train/loss" in metrics_csv and "val/ppl" in metrics_csv

    # Resume: the same run with more steps continues from last.ckpt; times add up.
    monkeypatch.setattr(TrainableModule, "clock", fake_clock(100.0, 107.5))  # 7.5 s more
    more = train(compose_train([*overrides, "trainer.max_steps=36"]))
    assert more["steps"] == 36
    resumed = json.loads((model_dir / "eagle_target.json").read_text())
    assert resumed["resumed_from_step"] == cfg.trainer.max_steps
    assert resumed["tokens_seen"] == 36 * 4 * 15  # counted across the two invocations
    assert resumed["train_time_s"] == 42.0 + 7.5
    assert resumed["fit_time_s"] > 0  # the real clock around trainer.fit
    # rows dealt out otherwise would resume at the old place in another stream of batches: refused
    for other, named in (("data.datamodule.seed=7", "data seed"), ("data.datamodule.batch_size=2",
                                                                  "data batch_size")):
        with pytest.raises(StageError, match="differ from those its checkpoint") as err:
            train(compose_train([*overrides, "trainer.max_steps=40", other]))
        assert named in str(err.value)


def test_a_run_stopped_by_its_time_limit_fails_and_resumes(tmp_path, distilled_dir, target_dir,
                                                           init_dir):
    """max_time reached well before max_steps: StageError, nothing exported (the recipe's stage
    check sees no sidecar), the resume point saved; a rerun gets a fresh time budget and
    continues from it instead of stopping at once."""
    overrides = [*lm_args(tmp_path, distilled_dir, target_dir, init_dir),
                 "trainer.max_steps=100000", "trainer.max_time=00:00:00:02",
                 "trainer.val_check_interval=100000"]
    last = tmp_path / "ssm_test" / "checkpoints" / "last.ckpt"
    with pytest.raises(StageError, match=r"stopped after \d+ of 100000 steps .*Rerun the same"):
        train(compose_train(overrides))
    assert not (tmp_path / "ssm_test" / "model").exists()
    first = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 0 < first < 100000
    with pytest.raises(StageError):
        train(compose_train(overrides))
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] > first


def test_a_model_no_better_than_unigram_is_not_saved(tmp_path, distilled_dir, target_dir):
    """A random LM of the target's shape, never trained (lr 0), against the unigram model."""
    from helpers.models import save_tiny_target

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    random_lm = save_tiny_target(tmp_path / "random", tokenizer, seed=7)
    overrides = [*lm_args(tmp_path, distilled_dir, target_dir, random_lm), "model.optim.lr=0",
                 "trainer.max_steps=2", "check_baseline=true"]
    with pytest.raises(StageError, match=r"val/loss .* no better than its baseline \(val/unigram"):
        train(compose_train(overrides))
    assert not (tmp_path / "ssm_test" / "model" / "eagle_target.json").exists()


def test_progress_goes_to_a_log_file_as_lines(tmp_path, distilled_dir, target_dir, init_dir,
                                              capsys):
    """stderr is not a terminal under pytest: progress comes as whole lines with the step
    count; without a progress bar the run works too."""
    train(lm_cfg(tmp_path, distilled_dir, target_dir, init_dir, "trainer.max_steps=6",
                 "trainer.val_check_interval=3", "callbacks.progress_bar.every_s=0"))
    err = capsys.readouterr().err
    assert "[train] (start) step 0/6" in err and "step 6/6" in err and "(validated)" in err
    train(lm_cfg(tmp_path / "quiet", distilled_dir, target_dir, init_dir, "trainer.max_steps=2",
                 "trainer.enable_progress_bar=false"))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("experiment=no_such_experiment", "experiment/no_such_experiment"),
        ("trainer.max_stepz=3", "max_stepz"),
    ],
)
def test_bad_input_is_one_line(override, expected, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), override, f"paths.runs_dir={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and expected in err
    assert "Traceback" not in proc.stderr + proc.stdout
    if override.startswith("experiment="):
        assert "drafter_test" in err  # lists what exists
    assert not any(tmp_path.iterdir())  # nothing was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU preset trains where there is a GPU")
def test_a_gpu_preset_without_a_gpu_says_which_preset_to_use(tmp_path):
    """Lightning's own message names no way out; the last line adds it. (ssm_test: a preset whose
    model and data read no file before the trainer is built.)"""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "experiment=ssm_test",
                           "trainer=gpu", f"paths.runs_dir={tmp_path}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr
    assert "No supported gpu backend found" in last and "use trainer=cpu" in last, proc.stderr


def test_unigram_baseline():
    # Add-one unigram: counts (2+1, 0+1, 1+1) / 6.
    ce = unigram_cross_entropy(np.array([0, 0, 2]), np.array([0, 1]), vocab_size=3)
    assert ce == pytest.approx(-(np.log(3 / 6) + np.log(1 / 6)) / 2)
