"""train.py end to end on the test preset: composition, training, saved artifacts, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle.data.tokens import fixed_block_offsets, unigram_cross_entropy
from eagle.training.lm import CausalLMModule, repeats_ngram, repetition_rate
from eagle.training.module import StageError, TrainableModule
from helpers.configs import compose_train
from helpers.models import ROOT
from train import train

LM_EXPERIMENTS = ["target_tiny", "target_long", "draft_lm_tiny", "target_gpu", "draft_lm_gpu", "target_test"]  # train an LM


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Shared by the tests of this module: the test corpus, tokenizer and tokens, built once."""
    return tmp_path_factory.mktemp("data")


def test_preset_configs_compose():
    for name in LM_EXPERIMENTS:
        cfg = compose_train([f"experiment={name}", "paths.root_dir=/nowhere"])
        OmegaConf.resolve(cfg)  # every interpolation resolves
        assert cfg.task_name == name
        assert cfg.paths.run_dir == f"/nowhere/runs/{name}"
        assert cfg.paths.model_dir == f"/nowhere/runs/{name}/model"
    gpu = compose_train(["experiment=target_gpu"])
    assert gpu.trainer.accelerator == "gpu" and gpu.trainer.precision == "auto"
    assert gpu.model.model_config.num_hidden_layers == 16
    tiny, draft = compose_train(["experiment=target_tiny"]), compose_train(["experiment=draft_lm_tiny"])
    assert tiny.model.model_config.num_hidden_layers == 12  # >= 12: one drafter layer stays small beside it
    long = compose_train(["experiment=target_long"])
    assert long.model == tiny.model and long.trainer.max_steps == 6 * tiny.trainer.max_steps
    assert tiny.trainer.max_time is not None and tiny.trainer.precision == "auto"
    # The draft LM reuses the target's tokenizer: same data folder, same tokenizer recipe.
    assert draft.data.dir == tiny.data.dir and draft.data.datamodule.tokenizer == tiny.data.datamodule.tokenizer
    assert draft.model.model_config.num_hidden_layers < tiny.model.model_config.num_hidden_layers
    gpu_draft = compose_train(["experiment=draft_lm_gpu"])  # built on target_gpu: same data, tokenizer, width
    assert gpu_draft.task_name == "draft_lm_gpu" and gpu_draft.trainer.accelerator == "gpu"
    assert gpu_draft.data == gpu.data and gpu_draft.model.model_config.hidden_size == gpu.model.model_config.hidden_size
    assert gpu_draft.model.model_config.num_hidden_layers < gpu.model.model_config.num_hidden_layers


def test_fast_dev_run(tmp_path, data_dir):
    cfg = compose_train([
        "experiment=target_test", "debug=fdr",
        f"paths.runs_dir={tmp_path}", f"paths.data_dir={data_dir}",
    ])
    metrics = train(cfg)
    assert metrics["steps"] == 1
    assert math.isfinite(metrics["val/loss"]) and math.isfinite(metrics["val/unigram_loss"])
    run_dir = tmp_path / "debug" / "target_test"  # kept apart from the real run's folder
    assert metrics["model_dir"] == str(run_dir / "model")
    assert (run_dir / "model" / "eagle_target.json").exists()
    assert not list(tmp_path.rglob("*.ckpt"))
    assert not (tmp_path / "target_test").exists()


def fake_clock(start: float, then: float):
    """A training clock that reads `start` once (when training starts) and `then` ever after."""
    ticks = iter([start])
    return staticmethod(lambda: next(ticks, then))


def test_train_save_load_and_resume(tmp_path, data_dir, monkeypatch):
    overrides = ["experiment=target_test", f"paths.runs_dir={tmp_path}", f"paths.data_dir={data_dir}"]
    cfg = compose_train(overrides)
    monkeypatch.setattr(TrainableModule, "clock", fake_clock(0.0, 42.0))  # 42 s of training
    metrics = train(cfg)
    model_dir = tmp_path / "target_test" / "model"
    assert metrics["model_dir"] == str(model_dir)
    assert metrics["steps"] == cfg.trainer.max_steps
    # It learned something: better than the unigram model on the same validation tokens.
    assert metrics["val/loss"] < metrics["val/unigram_loss"] - 0.2

    # The saved HF model and tokenizer load with the Auto classes and match the trained weights.
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ckpt = tmp_path / "target_test" / "checkpoints" / "last.ckpt"
    trained = CausalLMModule.load_from_checkpoint(ckpt, map_location="cpu").model.eval()
    ids = tok("def f(x):\n    return x", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trained(ids).logits, rtol=0, atol=0)
    assert model.config.vocab_size == len(tok) == 512
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert model.config.num_hidden_layers == cfg.model.model_config.num_hidden_layers

    side = json.loads((model_dir / "eagle_target.json").read_text())
    assert side["corpus"].startswith("python-stdlib-") and side["python_version"] == ".".join(
        map(str, sys.version_info[:3])
    )
    assert side["n_files"]["train"] + side["n_files"]["validation"] == 48
    assert side["n_tokens"]["train"] > 0 and side["n_tokens"]["validation"] > 0
    assert side["steps"] == cfg.trainer.max_steps
    assert side["tokens_seen"] == side["steps"] * 4 * 64
    assert side["val/loss"] == pytest.approx(metrics["val/loss"])
    assert side["val/unigram_loss"] == pytest.approx(metrics["val/unigram_loss"])
    assert side["train_time_s"] == 42.0 and side["n_params"] > 0
    assert side["status"] == "complete" and side["params"]["tokenizer_hash"]
    assert list(side["samples"]) == list(cfg.model.samples)
    assert all(side["samples"][p].startswith(p) for p in side["samples"])
    assert side["config"]["task_name"] == "target_test"
    rep = side["repetition"]  # greedy loops on held-out prompts, recorded with the model
    assert rep["n"] == 8 and rep["prompts"] >= 1 and 0 <= rep["repeated_ngrams"] <= rep["rate"] <= 1
    assert side["config"]["model"]["model_config"]["hidden_size"] == 64
    for logger_dir in ("csv", "tensorboard"):
        assert (tmp_path / "target_test" / logger_dir).is_dir()
    metrics_csv = next((tmp_path / "target_test" / "csv").rglob("metrics.csv")).read_text()
    assert "train/loss" in metrics_csv and "val/ppl" in metrics_csv

    # Resume: the same run with more steps continues from last.ckpt; times add up.
    monkeypatch.setattr(TrainableModule, "clock", fake_clock(100.0, 107.5))  # 7.5 s more
    more = train(compose_train([*overrides, "trainer.max_steps=110", "model.sample_tokens=8"]))  # (export only)
    assert more["steps"] == 110
    resumed = json.loads((model_dir / "eagle_target.json").read_text())
    assert resumed["resumed_from_step"] == cfg.trainer.max_steps
    assert resumed["tokens_seen"] == 110 * 4 * 64  # counted across the two invocations
    assert resumed["train_time_s"] == 42.0 + 7.5
    assert resumed["fit_time_s"] > 0  # the real clock around trainer.fit
    # blocks cut otherwise would resume at the old place in another stream of batches: refused
    for cut in ("data.datamodule.block_size=32", "data.datamodule.train_samples_per_epoch=7"):
        with pytest.raises(StageError, match="data sampling") as err:
            train(compose_train([*overrides, "trainer.max_steps=112", cut]))
        assert cut.split(".")[-1].split("=")[0] in str(err.value)


def test_a_run_stopped_by_its_time_limit_fails_and_resumes(tmp_path, data_dir):
    """max_time reached well before max_steps: StageError, nothing exported (the demo's stage
    check sees no sidecar), the resume point saved; a rerun gets a fresh time budget and
    continues from it instead of stopping at once."""
    overrides = ["experiment=target_test", f"paths.runs_dir={tmp_path}", f"paths.data_dir={data_dir}",
                 "trainer.max_steps=100000", "trainer.max_time=00:00:00:02", "trainer.val_check_interval=100000"]
    last = tmp_path / "target_test" / "checkpoints" / "last.ckpt"
    with pytest.raises(StageError, match=r"stopped after \d+ of 100000 steps .*Rerun the same command"):
        train(compose_train(overrides))
    assert not (tmp_path / "target_test" / "model").exists()
    first = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 0 < first < 100000
    with pytest.raises(StageError):
        train(compose_train(overrides))
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] > first


def test_a_model_no_better_than_unigram_is_not_saved(tmp_path, data_dir):
    overrides = ["experiment=target_test", f"paths.runs_dir={tmp_path}", f"paths.data_dir={data_dir}",
                 "model.optim.lr=0", "trainer.max_steps=2"]
    with pytest.raises(StageError, match=r"val/loss .* is no better than its baseline \(val/unigram_loss"):
        train(compose_train(overrides))
    assert not (tmp_path / "target_test" / "model" / "eagle_target.json").exists()


def test_progress_goes_to_a_log_file_as_lines(tmp_path, data_dir, capsys):
    """stderr is not a terminal under pytest: progress comes as whole lines with the step
    count; without a progress bar the run works too."""
    train(compose_train(["experiment=target_test", f"paths.runs_dir={tmp_path}", f"paths.data_dir={data_dir}",
                         "trainer.max_steps=6", "trainer.val_check_interval=3", "callbacks.progress_bar.every_s=0",
                         "check_baseline=false"]))
    err = capsys.readouterr().err
    assert "[train] (start) step 0/6" in err and "step 6/6" in err and "(validated)" in err
    train(compose_train(["experiment=target_test", f"paths.runs_dir={tmp_path / 'quiet'}",
                         f"paths.data_dir={data_dir}", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
                         "check_baseline=false"]))


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
        assert "target_tiny" in err  # lists what exists
    assert not any(tmp_path.iterdir())  # nothing was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU preset trains where there is a GPU")
def test_a_gpu_preset_without_a_gpu_says_which_preset_to_use(tmp_path):
    """Lightning's own message names no way out; the last line adds it."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "trainer=gpu", f"paths.runs_dir={tmp_path}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "No supported gpu backend found" in last and "use trainer=cpu" in last, proc.stderr


def test_target_gpu_size():
    cfg = compose_train(["experiment=target_gpu"])
    model_config = {**OmegaConf.to_container(cfg.model.model_config), "vocab_size": 8192}
    with torch.device("meta"):
        module = instantiate(cfg.model, _convert_="all", model_config=model_config)
    n = sum(p.numel() for p in module.parameters())
    assert 80e6 < n < 160e6  # ~5 min at ~200k tokens/s on one H200 (see the experiment file)


def test_blocks_and_unigram():
    # Validation blocks: non-overlapping, evenly thinned, each with its next-token target.
    assert fixed_block_offsets(41, 10, None).tolist() == [0, 10, 20, 30]
    assert fixed_block_offsets(1001, 10, 3).tolist() == [0, 500, 990]
    # Add-one unigram: counts (2+1, 0+1, 1+1) / 6.
    ce = unigram_cross_entropy(np.array([0, 0, 2]), np.array([0, 1]), vocab_size=3)
    assert ce == pytest.approx(-(np.log(3 / 6) + np.log(1 / 6)) / 2)


def test_residual_init_changes_only_residual_projections():
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
              "num_attention_heads": 2, "vocab_size": 300}  # complete: the module builds its model at once
    models = {}
    for mode in (None, "gpt2", "zero"):
        torch.manual_seed(0)
        models[mode] = CausalLMModule(config, residual_init=mode).model.model.layers[3]
    plain, gpt2, zero = models[None], models["gpt2"], models["zero"]
    # gpt2: divided by sqrt(2 L) = 4; zero: zero; everything else untouched.
    torch.testing.assert_close(gpt2.self_attn.o_proj.weight, plain.self_attn.o_proj.weight / 4.0)
    torch.testing.assert_close(gpt2.mlp.down_proj.weight, plain.mlp.down_proj.weight / 4.0)
    assert not zero.self_attn.o_proj.weight.any() and not zero.mlp.down_proj.weight.any()
    for layer in (gpt2, zero):
        torch.testing.assert_close(layer.self_attn.q_proj.weight, plain.self_attn.q_proj.weight)
        torch.testing.assert_close(layer.mlp.up_proj.weight, plain.mlp.up_proj.weight)
    with pytest.raises(ValueError, match="residual_init"):
        CausalLMModule(config, residual_init="xavier")


def test_repetition_known_answers():
    assert repeats_ngram([1, 2, 3, 1, 2, 3], 3) and not repeats_ngram([1, 2, 3, 1, 2, 4], 3)
    assert repeats_ngram([5, 5, 5, 5], 3)  # overlapping occurrences count
    assert not repeats_ngram([1, 2], 3)

    class Scripted(torch.nn.Module):
        """`generate` appends a fixed continuation to each prompt (what repetition_rate reads)."""

        config = type("C", (), {"pad_token_id": 0})()
        device = torch.device("cpu")

        def generate(self, input_ids, attention_mask, max_new_tokens, min_new_tokens, **kw):
            assert max_new_tokens == min_new_tokens == 6
            tails = torch.tensor([[7, 8, 7, 8, 7, 8], [1, 2, 3, 4, 5, 6]])
            return torch.cat([input_ids, tails], 1)

    out = repetition_rate(Scripted(), torch.zeros(2, 3, dtype=torch.long), new_tokens=6, n=2)
    # row 0: 2-grams 78 87 78 87 78 -> 3 of 5 repeat an earlier one; row 1: none repeat
    assert out == {"rate": 0.5, "repeated_ngrams": 3 / 10, "prompts": 2, "new_tokens": 6, "n": 2}
