"""Drafter training through train.py: configs, alignment, offline and online fast_dev_runs,
resuming from last.ckpt, and the exported drafter."""

from __future__ import annotations

import csv
import logging
import math
import types
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from data_gen.__main__ import generate
from eagle.data.batches import collate, shift_batch
from eagle.data.features import FeatureShards, read_metadata
from eagle.data.vocab import count_tokens, load_counts
from eagle.models.checkpoint import load_drafter
from eagle.target import TargetMismatchError, lm_head_fingerprint, load_target
from eagle.training import metrics
from eagle.training.datamodules import FeatureDataModule
from eagle.training.drafter import EagleDrafterModule
from eagle.training.module import StageError
from eagle.training.optim import adamw, lr_schedule
from eagle.training.progress import quiet_lightning
from helpers.configs import compose_config, compose_train
from helpers.data import conversations
from helpers.models import make_tiny_model
from train import train


def drafter_cfg(tmp_path: Path, target_dir: Path, features_dir: Path | None, *overrides: str):
    """drafter_test on the tiny target; offline from `features_dir`, or online when None."""
    data = [f"data.datamodule.features_dir={features_dir}"] if features_dir else []
    return compose_train(["experiment=drafter_test", f"paths.runs_dir={tmp_path}",
                          f"model.target_path={target_dir}", *data, *overrides])


# --------------------------------------------------------------------------- pieces


def test_drafter_configs_compose():
    for name in ("drafter_smollm2", "drafter_smollm2_long", "drafter_test"):
        cfg = compose_train([f"experiment={name}", "paths.root_dir=/nowhere"])
        OmegaConf.resolve(cfg)
        assert cfg.task_name == name != "train"
        d = cfg.model
        assert d._target_ == "eagle.training.drafter.EagleDrafterModule"
        # EAGLE-1's recipe
        assert (d.w_feat, d.w_tok, d.noise, list(d.optim.betas)) == (1.0, 0.1, 0.1, [0.9, 0.95])
        assert (
            cfg.trainer.gradient_clip_val == 0.5 and cfg.trainer.gradient_clip_algorithm == "value"
        )
        assert cfg.trainer.precision == "auto"
        assert cfg.data.datamodule._target_ == "eagle.training.datamodules.FeatureDataModule"
    # data_gen's default dump is what drafter_smollm2 reads, on the default target
    smol = compose_train(["experiment=drafter_smollm2", "paths.root_dir=/nowhere"])
    default_dump = compose_config("data_gen", ["paths.root_dir=/nowhere"])
    assert default_dump.out_dir == smol.data.datamodule.features_dir
    assert default_dump.target_path == smol.model.target_path == "/nowhere/runs/smollm2/model"
    # drafter_test by hand: the small dump its header's data_gen command names, on SmolLM2
    test = compose_train(["experiment=drafter_test", "paths.root_dir=/nowhere"])
    small_dump = compose_config(
        "data_gen", ["paths.root_dir=/nowhere", "name=smollm2-sharegpt-test"]
    )
    assert small_dump.out_dir == test.data.datamodule.features_dir
    assert test.model.target_path == smol.model.target_path
    online = compose_train(
        [
            "experiment=drafter_test",
            "data=online",
            "data_gen@_global_=text",
            "source.path=/data/notes.jsonl",
        ]
    )
    assert online.data.datamodule._target_ == "eagle.training.datamodules.OnlineDataModule"
    assert online.data.datamodule.source._target_ == "data_gen.conversations.text_samples"
    assert online.data.datamodule.source.max_samples == 16  # the preset's caps reach the source
    sharegpt = compose_train(
        [
            "experiment=drafter_7b",
            "data=online",
            "data_gen@_global_=sharegpt",
            "source.path=/data/c.json",
        ]
    )
    assert sharegpt.data.datamodule.source._target_ == "data_gen.conversations.sharegpt_samples"
    assert (
        sharegpt.data.datamodule.max_len == 2048
    )  # EAGLE-1's sequence length, from the sharegpt source
    assert online.data.datamodule.tokenizer_path == online.model.target_path


def test_online_data_needs_a_named_source(tmp_path, target_dir):
    # data=online alone used to train on a built-in corpus with the user's tokenizer
    cfg = compose_train(
        [
            "experiment=drafter_test",
            "data=online",
            f"paths.runs_dir={tmp_path}",
            f"model.target_path={target_dir}",
        ]
    )
    with pytest.raises(
        Exception, match="data=online needs a sample source: add data_gen@_global_=sharegpt"
    ):
        train(cfg)


def test_the_7b_preset_is_eagle1s_recipe():
    cfg = compose_train(["experiment=drafter_7b", "model.target_path=/m", "data.name=d"])
    OmegaConf.resolve(cfg)
    assert (cfg.model.optim.lr, list(cfg.model.optim.betas), cfg.model.optim.warmup_steps) == (
        3e-5,
        [0.9, 0.95],
        2000,
    )
    assert (cfg.trainer.gradient_clip_val, cfg.trainer.gradient_clip_algorithm) == (0.5, "value")
    assert cfg.trainer.max_epochs == 20 and cfg.data.datamodule.batch_size == 4
    assert (
        cfg.trainer.strategy._target_.endswith("DDPStrategy") and cfg.trainer.accelerator == "gpu"
    )
    assert (
        cfg.model.target_dtype == "bfloat16" and cfg.trainer.precision == "auto"
    )  # bf16-mixed on a GPU
    sharegpt = compose_config("data_gen", ["data_gen=sharegpt", "source.path=/c.json"])
    assert sharegpt.max_len == 2048
    # the target and the dump must be named
    unnamed = compose_train(["experiment=drafter_7b"])
    assert OmegaConf.is_missing(unnamed.model, "target_path") and OmegaConf.is_missing(
        unnamed.data, "name"
    )


def test_shift_batch_alignment():
    """Input at t is (f_{t-1}, x_t); target f_t; weight = mask of x_{t+1}; last weight 0."""
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    feats = torch.arange(5.0).reshape(1, 5, 1)  # f_t = t
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    v = shift_batch(ids, feats, mask)
    assert v["features_in"].flatten().tolist() == [0, 1, 2, 3]  # f_{t-1}, t = 1..4
    assert v["input_ids"].tolist() == [[11, 12, 13, 14]]  # x_t
    assert v["target"].flatten().tolist() == [1, 2, 3, 4]  # f_t
    # m_{t+1} = m_2, m_3, m_4, then nothing: t = 1 is trained (it predicts x_2, the first
    # assistant token), t = 3 is not (x_4 is not the target's)
    assert v["weight"].tolist() == [[1, 1, 0, 0]]


def test_lr_schedules_come_from_transformers():
    """Linear warmup from 0, then EAGLE-1's linear decay to 0, or cosine to a floor, or flat."""

    def lrs(schedule: str, min_lr_ratio: float = 0.0) -> list[float]:
        opt = adamw(torch.nn.Linear(2, 2), lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        sched = lr_schedule(
            opt, schedule, warmup_steps=10, total_steps=110, min_lr_ratio=min_lr_ratio
        )
        out = []
        for _ in range(111):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    linear, cosine, constant = lrs("linear"), lrs("cosine", 0.1), lrs("constant")
    assert linear[0] == 0.0 and linear[5] == pytest.approx(0.5) and linear[10] == pytest.approx(1.0)
    assert linear[60] == pytest.approx(0.5) and linear[110] == pytest.approx(0.0)
    assert cosine[60] == pytest.approx(0.55) and cosine[110] == pytest.approx(0.1)
    assert constant[10:] == [1.0] * 101
    opt = adamw(torch.nn.Linear(2, 2), lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_schedule(opt, "step", 10, 110)
    with pytest.raises(ValueError, match="decays to 0"):
        lr_schedule(opt, "linear", 10, 110, min_lr_ratio=0.1)


# -------------------------------------------------------------------------- training


def check_drafter_dir(drafter_dir: Path, target_dir: Path) -> None:
    assert (drafter_dir / "config.json").exists() and (drafter_dir / "model.safetensors").exists()
    model, tokenizer = load_target(target_dir)
    drafter = load_drafter(drafter_dir, model, tokenizer)  # checked against the target
    assert drafter.config.hidden_size == model.config.hidden_size
    # the LM head it was trained against, so that a load against another one warns
    assert drafter.config.target["lm_head_sha256"] == lm_head_fingerprint(model)


def test_fast_dev_run_offline(tmp_path, target_dir, features_dir, capsys):
    metrics = train(drafter_cfg(tmp_path, target_dir, features_dir, "debug=fdr"))
    assert metrics["steps"] == 1
    for key in (
        "val/loss",
        "val/feat_loss",
        "val/tok_loss",
        "val/top1_d1",
        "val/top4_d1",
        "val/top1_d3",
    ):
        assert math.isfinite(metrics[key]), key
    assert 0.0 <= metrics["val/top1_d1"] <= metrics["val/top4_d1"] <= 1.0
    run_dir = tmp_path / "debug" / "drafter_test"
    check_drafter_dir(run_dir / "drafter", target_dir)
    assert not list(tmp_path.rglob("*.ckpt"))
    # the token counts of the training split, for a reduced drafting vocabulary (eagle.data.vocab)
    counts = load_counts(run_dir / "drafter")
    want = count_tokens(FeatureShards(features_dir, "train").token_rows(), counts.numel())
    assert (
        torch.equal(counts, want)
        and int(counts.sum()) == read_metadata(features_dir)["splits"]["train"]["loss_tokens"]
    )
    assert "val/top1_d1" in capsys.readouterr().out  # the final metrics are printed


def test_fast_dev_run_online(tmp_path, target_dir):
    cfg = drafter_cfg(
        tmp_path,
        target_dir,
        None,
        "debug=fdr",
        "data=online",
        *conversations("data.datamodule.max_len=32", group="data_gen@_global_"),
    )
    metrics = train(cfg)
    assert metrics["steps"] == 1 and math.isfinite(metrics["val/loss"])
    assert not list(tmp_path.rglob("*.arrow"))  # nothing dumped
    check_drafter_dir(tmp_path / "debug" / "drafter_test" / "drafter", target_dir)
    assert load_counts(tmp_path / "debug" / "drafter_test" / "drafter").sum() > 0


def test_train_resume_and_logs(tmp_path, target_dir, features_dir):
    first = train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=2"))
    run_dir = tmp_path / "drafter_test"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert first["steps"] == 2 and last.exists()
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2
    assert all(k.startswith("drafter.") for k in ckpt["state_dict"])  # never the target
    assert not any("embed_tokens" in k or "lm_head" in k for k in ckpt["state_dict"])

    second = train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=4"))
    assert second["resumed_from_step"] == 2 and second["steps"] == 4
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 4
    check_drafter_dir(run_dir / "drafter", target_dir)

    # a finished run resumed again trains nothing but still validates and exports
    (run_dir / "drafter" / "model.safetensors").unlink()
    third = train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=4"))
    assert third["resumed_from_step"] == 4 and third["steps"] == 4
    assert (run_dir / "drafter" / "model.safetensors").exists()

    rows = []
    for path in sorted((run_dir / "csv").rglob("metrics.csv")):
        with open(path) as f:
            rows += list(csv.DictReader(f))
    logged = {k for row in rows for k, v in row.items() if v not in ("", None)}
    assert {
        "train/loss",
        "train/feat_loss",
        "train/tok_loss",
        "val/loss",
        "val/feat_loss",
        "val/tok_loss",
        "val/top1_d1",
        "val/top4_d1",
        "val/top1_d3",
    } <= logged
    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))


def test_a_run_resumed_with_other_settings_is_refused_and_its_checkpoint_kept(
    tmp_path, target_dir, features_dir
):
    """Lightning would restore the optimizer, schedule and data position under new settings (the
    old learning rate, another batch order) or fail on weights of another shape deep in
    load_state_dict: the run says which settings differ and how to go on, before loading anything.
    """
    train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=2"))
    last = tmp_path / "drafter_test" / "checkpoints" / "last.ckpt"
    saved = last.read_bytes()
    for override, named in [
        ("model.optim.lr=0.5", "optim.lr: 0.001 -> 0.5"),
        ("+model.drafter_config.intermediate_size=48", "drafter_config.intermediate_size"),
        ("data.datamodule.batch_size=2", "data batch_size"),
        ("data.datamodule.seed=7", "data seed"),
    ]:
        with pytest.raises(
            StageError, match="differ from those its checkpoint was trained with"
        ) as err:
            train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=4", override))
        assert (
            named in str(err.value)
            and str(last) in str(err.value)
            and "ckpt_path=null" in str(err.value)
        )
        assert last.read_bytes() == saved
        assert str(err.value).index("ckpt_path=null") < 200  # the way out survives a one-line print
    # what validation measures may change; the run goes on from its step
    resumed = train(
        drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=4", "model.val_depth=2")
    )
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 4
    # a checkpoint written before a setting existed holds it at its default: it resumes
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    del ckpt["hyper_parameters"]["train_depth"], ckpt["hyper_parameters"]["depth_decay"]
    torch.save(ckpt, last)
    resumed = train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=6"))
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 6


def test_a_resume_onto_another_target_of_the_same_shapes_is_refused(
    tmp_path, target_dir, features_dir
):
    """The same samples dumped again by a retrained target (same shapes and tokenizer, other
    weights) have the same token fingerprint, and `target_path` may change on a resume (folders
    move): the target's LM head fingerprint tells the runs apart, before anything is loaded."""
    from transformers import AutoTokenizer

    from helpers.models import save_tiny_target

    train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=2"))
    other = save_tiny_target(
        tmp_path / "retrained", AutoTokenizer.from_pretrained(target_dir), seed=1
    )
    train_fingerprint = read_metadata(features_dir)["params"]["splits"]["train"]["fingerprint"]
    redumped = tmp_path / "redumped"
    generate(
        compose_config(
            "data_gen",
            conversations(
                f"target_path={other}",
                f"out_dir={redumped}",
                "target_dtype=float32",
                "device=cpu",
                "max_len=32",
                "shard_size=8",
                "batch_size=4",
                "progress=false",
                "source.max_samples=16",
                "source.max_val_samples=4",
            ),
        )
    )
    assert (
        read_metadata(redumped)["params"]["splits"]["train"]["fingerprint"] == train_fingerprint
    )  # only the target differs
    last = tmp_path / "drafter_test" / "checkpoints" / "last.ckpt"
    saved = last.read_bytes()
    with pytest.raises(
        StageError, match="differ from those its checkpoint was trained with"
    ) as err:
        train(drafter_cfg(tmp_path, other, redumped, "trainer.max_steps=4"))
    assert "data target" in str(err.value) and "lm_head_sha256" in str(err.value)
    assert last.read_bytes() == saved
    # the same target from another folder resumes
    moved = tmp_path / "moved"
    moved.symlink_to(target_dir)
    assert (
        train(drafter_cfg(tmp_path, moved, features_dir, "trainer.max_steps=4"))[
            "resumed_from_step"
        ]
        == 2
    )


def test_an_export_killed_midway_leaves_no_artifact_a_later_stage_would_take(
    tmp_path, target_dir, features_dir, monkeypatch
):
    """The Makefile skips a stage whose drafter/config.json exists: a kill after the weights and
    config but before the token counts and the report must not leave one."""
    import eagle.training.drafter as drafter_module

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(drafter_module, "save_counts", killed)
    with pytest.raises(KeyboardInterrupt):
        train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=2"))
    out = tmp_path / "drafter_test" / "drafter"
    assert not out.exists()
    monkeypatch.undo()
    first = train(
        drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=2")
    )  # resumes, exports
    assert first["resumed_from_step"] == 2 and {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "token_counts.safetensors",
        "train_metrics.json",
    }
    # a second export replaces the first whole, and leaves nothing beside it
    train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=2"))
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []


def test_the_data_modules_know_their_training_samples(features_dir, target_dir):
    # what a resumed run checks it trains on (`TrainableModule.data_identity`)
    from eagle.data.features import samples_fingerprint
    from eagle.training.datamodules import OnlineDataModule

    dm = FeatureDataModule(features_dir, batch_size=2)
    dm.setup("fit")
    assert dm.fingerprint == read_metadata(features_dir)["params"]["splits"]["train"]["fingerprint"]

    def source(tokenizer, max_len, first=3):
        rows = [
            {
                "id": str(i),
                "input_ids": np.arange(first + i, first + i + 5),
                "loss_mask": np.ones(5),
            }
            for i in range(4)
        ]
        return {"train": rows[:3], "validation": rows[3:]}

    online = OnlineDataModule(source, target_dir, batch_size=2)
    online.setup("fit")
    assert online.fingerprint == samples_fingerprint(source(None, 0)["train"])
    other = OnlineDataModule(partial(source, first=4), target_dir, batch_size=2)
    other.setup("fit")
    assert other.fingerprint != online.fingerprint


def test_online_samples_past_the_targets_embedding_are_refused_by_name(target_dir):
    """Token samples the target embeds on the fly (data=online): an id with no embedding row (a
    tokenizer with added tokens, the model not resized) is named before training, not an
    IndexError inside the embedding."""
    from eagle.training.datamodules import OnlineDataModule

    module = EagleDrafterModule(str(target_dir), noise=0.0)
    rows = module.target.get_input_embeddings().weight.shape[0]

    def source(tokenizer, max_len, top):
        ids = [np.array([1, 2, top]), np.array([3, 4, 5])]
        return {
            "train": [{"id": "0", "input_ids": ids[0], "loss_mask": np.ones(3)}],
            "validation": [{"id": "1", "input_ids": ids[1], "loss_mask": np.ones(3)}],
        }

    for top, fits in ((rows - 1, True), (rows, False)):
        dm = OnlineDataModule(partial(source, top=top), target_dir, batch_size=1)
        dm.setup("fit")
        assert dm.top_token_id() == top
        module._trainer = types.SimpleNamespace(
            datamodule=dm, strategy=types.SimpleNamespace(root_device="cpu")
        )
        if fits:
            module.setup("fit")  # loads the whole target: the samples carry no features
        else:
            with pytest.raises(
                TargetMismatchError,
                match=f"token id {top}, past the target's {rows} embedding rows",
            ):
                module.setup("fit")


def test_a_fresh_run_prints_its_own_lines_not_lightnings_noise(
    tmp_path, target_dir, features_dir, capfd
):
    """Resuming is on by default (ckpt_path=last): a fresh run finds nothing to resume without a
    warning, and none of the messages `quiet_lightning` drops reaches the output."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(drafter_cfg(tmp_path, target_dir, features_dir, "trainer.max_steps=2"))
    out = capfd.readouterr()
    text = out.out + out.err + "\n".join(str(w.message) for w in caught)
    assert "[train] drafter_test" in text and "saved the drafter" in text  # the run's own lines
    for noise in (
        "no last checkpoint available",
        "Tip: For seamless cloud logging",
        "`weights_only` was not set",
        "LeafSpec",
        "not supported by the model summary",
    ):
        assert noise not in text, noise


def test_quiet_lightning_drops_only_its_messages():
    from lightning_utilities.core.rank_zero import log, rank_zero_info

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_lightning():
                warnings.warn(
                    "Precision bf16-mixed is not supported by the model summary.  Estimated ...",
                    UserWarning,
                    stacklevel=1,
                )
                warnings.warn("another warning", UserWarning, stacklevel=1)
                warnings.warn(
                    "You're resuming from a checkpoint that ended before the epoch ended and your "
                    "dataloader is not resumable.",
                    UserWarning,
                    stacklevel=1,
                )
                rank_zero_info("\N{ELECTRIC LIGHT BULB} Tip: For seamless cloud logging, try ...")
                rank_zero_info("GPU available: False")
            warnings.warn(
                "Precision bf16-mixed is not supported by the model summary.",
                UserWarning,
                stacklevel=1,
            )  # outside
            rank_zero_info("\N{ELECTRIC LIGHT BULB} Tip: For seamless cloud logging, again")
    finally:
        log.removeHandler(handler)
    assert [str(w.message)[:15] for w in caught] == ["another warning", "Precision bf16-"]
    assert [r.getMessage()[:15] for r in records] == [
        "GPU available: ",
        "\N{ELECTRIC LIGHT BULB} Tip: For seam",
    ]


def test_features_of_another_target_are_refused(tmp_path, target_dir, features_dir):
    other = tmp_path / "other"
    model, tokenizer = load_target(target_dir)
    make_tiny_model("llama", seed=7, vocab_size=len(tokenizer)).save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(TargetMismatchError, match="made for another target: lm_head_sha256"):
        train(drafter_cfg(tmp_path, other, features_dir, "debug=fdr"))


def test_drafter_overfits_one_batch(target_dir, features_dir):
    """Gradients reach the drafter through both loss terms: on one fixed batch the feature
    error goes to ~0 and the soft cross-entropy down to its floor, the target's entropy."""
    module = EagleDrafterModule(str(target_dir), noise=0.0)
    shards = FeatureShards(features_dir, "train")
    batch = collate([shards[i] for i in range(4)])
    opt = torch.optim.AdamW(module.drafter.parameters(), lr=1e-2)
    first = module.model_step(batch, train=True)
    for _ in range(80):
        out = module.model_step(batch, train=True)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    out = module.model_step(batch, train=False)
    assert out["feat_loss"].item() < 0.05 * first["feat_loss"].item()
    entropy = metrics.token_loss(out["target_logits"], out["target_logits"], out["weight"]).item()
    assert entropy <= out["tok_loss"].item() < entropy + 0.1 < first["tok_loss"].item()
    assert module.target_identity.lm_head_sha256  # what the feature dump is checked against
    assert not any(k.startswith("target") for k in module.state_dict())


def test_offline_training_reads_only_the_targets_head(target_dir, features_dir):
    """Dumped features need only E and the LM head; online batches get the whole target, once,
    and the drafter then drafts on that target's E and head."""
    from eagle.target import embeddings, is_head_only, lm_head

    module = EagleDrafterModule(str(target_dir), noise=0.0)
    assert is_head_only(module.target)
    batch = collate([FeatureShards(features_dir, "train")[i] for i in range(2)])
    offline = module.model_step(batch, train=False)
    with pytest.raises(ValueError, match="only the target's embeddings and LM head"):
        module.model_step({k: v for k, v in batch.items() if k != "features"}, train=False)
    module.load_full_target()
    assert not is_head_only(module.target)
    assert module.drafter.embed_tokens is embeddings(
        module.target
    ) and module.drafter.lm_head is lm_head(module.target)
    online = module.model_step({k: v for k, v in batch.items() if k != "features"}, train=False)
    torch.testing.assert_close(
        online["loss"], offline["loss"], rtol=1e-3, atol=1e-3
    )  # bf16-stored features


@pytest.mark.slow
def test_end_to_end_features_drafter(tmp_path):
    """The whole chain on the test preset: dump a target's features of conversations, train a
    drafter on them; it ends up agreeing with the target far more than an untrained one. The
    target is random, its weights drawn at a smaller scale than the other tests' (0.05): their
    peaked logits ride on features too erratic for a 1-layer drafter to follow far."""
    from helpers.models import save_tiny_target, small_tokenizer

    target = save_tiny_target(tmp_path / "target", small_tokenizer(), initializer_range=0.05)
    features = tmp_path / "features"
    generate(
        compose_config(
            "data_gen",
            conversations(
                f"target_path={target}",
                f"out_dir={features}",
                "target_dtype=float32",
                "device=cpu",
                "max_len=64",
                "source.max_samples=512",
                "source.max_val_samples=16",
                "progress=false",
            ),
        )
    )
    common = [
        "experiment=drafter_test",
        f"model.target_path={target}",
        "model.optim.lr=3e-3",
        "model.optim.warmup_steps=10",
        "data.datamodule.batch_size=8",
        f"data.datamodule.features_dir={features}",
    ]
    before = train(compose_train([*common, f"paths.runs_dir={tmp_path}/a", "debug=fdr"]))
    after = train(
        compose_train(
            [
                *common,
                f"paths.runs_dir={tmp_path}/b",
                "trainer.max_steps=400",
                "trainer.val_check_interval=200",
            ]
        )
    )
    assert after["val/feat_loss"] < 0.5 * before["val/feat_loss"]
    assert after["val/top1_d1"] > max(0.5, before["val/top1_d1"] + 0.3)
    assert after["val/top1_d3"] > 0.4  # still agrees when fed its own features


def test_a_resumed_run_trains_on_the_samples_an_uninterrupted_one_would(
    tmp_path, target_dir, features_dir, monkeypatch
):
    """16 samples in batches of 4: 4 steps an epoch. Stopped after step 6 (mid-epoch 1) and
    resumed to step 10, the run sees the batches an uninterrupted 10-step run sees, step for
    step (a DataLoader generator seeded once replayed epoch 0's first batches after the resume,
    then epoch 1's order in epoch 2)."""
    seen = []
    step = EagleDrafterModule.training_step

    def record(self, batch, i):
        seen.append(tuple(batch["input_ids"].sum(-1).tolist()))
        return step(self, batch, i)

    monkeypatch.setattr(EagleDrafterModule, "training_step", record)
    quick = ("trainer.val_check_interval=100", "model.val_depth=1")
    train(drafter_cfg(tmp_path / "whole", target_dir, features_dir, "trainer.max_steps=10", *quick))
    whole = seen[:]
    seen.clear()
    train(drafter_cfg(tmp_path / "cut", target_dir, features_dir, "trainer.max_steps=6", *quick))
    assert len(seen) == 6
    resumed = train(
        drafter_cfg(tmp_path / "cut", target_dir, features_dir, "trainer.max_steps=10", *quick)
    )
    assert resumed["resumed_from_step"] == 6
    assert len(whole) == 10 and seen == whole
    assert len(set(whole[:4])) == 4 and whole[4:8] != whole[:4]  # each epoch its own order

    # a crash in step 8: the resume point is the checkpoint of step 6 (every 2 steps)
    seen.clear()

    def crash_in_step_8(self, batch, i):
        if len(seen) == 7:
            raise RuntimeError("simulated crash")
        return record(self, batch, i)

    every_2 = "callbacks.model_checkpoint.every_n_train_steps=2"
    monkeypatch.setattr(EagleDrafterModule, "training_step", crash_in_step_8)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(
            drafter_cfg(
                tmp_path / "crash",
                target_dir,
                features_dir,
                "trainer.max_steps=10",
                every_2,
                *quick,
            )
        )
    monkeypatch.setattr(EagleDrafterModule, "training_step", record)
    seen.clear()
    resumed = train(
        drafter_cfg(
            tmp_path / "crash", target_dir, features_dir, "trainer.max_steps=10", every_2, *quick
        )
    )
    assert resumed["resumed_from_step"] == 6 and seen == whole[6:]


def test_a_run_sized_in_epochs_resumes_after_a_time_limit_to_its_planned_steps(
    tmp_path, target_dir, features_dir, monkeypatch
):
    """max_epochs=3 (4 steps an epoch: 12 planned), stopped after step 6 the way max_time stops a
    run (`should_stop`, mid-epoch 1). Lightning counts the cut epoch as finished, so a run
    planned in epochs ended a part-epoch short on every resume and never reached its plan;
    planned in steps, the rerun trains steps 7-12 on the batches an uninterrupted run sees."""
    seen, stop_at = [], [None]
    step = EagleDrafterModule.training_step

    def record(self, batch, i):
        seen.append(tuple(batch["input_ids"].sum(-1).tolist()))
        if len(seen) == stop_at[0]:
            self.trainer.should_stop = True  # what Lightning's Timer does when max_time runs out
        return step(self, batch, i)

    monkeypatch.setattr(EagleDrafterModule, "training_step", record)
    epochs = (
        "trainer.max_steps=-1",
        "trainer.max_epochs=3",
        "trainer.val_check_interval=100",
        "model.val_depth=1",
    )
    whole = train(drafter_cfg(tmp_path / "whole", target_dir, features_dir, *epochs))
    assert whole["steps"] == whole["planned_steps"] == 12
    uninterrupted = seen[:]
    seen.clear()
    stop_at[0] = 6
    with pytest.raises(StageError, match="stopped after 6 of 12 steps"):
        train(drafter_cfg(tmp_path / "cut", target_dir, features_dir, *epochs))
    stop_at[0] = None
    resumed = train(drafter_cfg(tmp_path / "cut", target_dir, features_dir, *epochs))
    assert resumed["resumed_from_step"] == 6 and resumed["steps"] == resumed["planned_steps"] == 12
    assert seen == uninterrupted


def test_the_token_loss_over_a_reduced_vocabulary(tmp_path, target_dir, features_dir, capsys):
    """loss_vocab=K: the training step's token loss is the soft cross-entropy over the K most
    frequent tokens of the training split, both distributions renormalised over them; the
    feature loss and validation (whole vocabulary) are what they are without it."""
    from eagle.data.vocab import draft_vocabulary

    k = 16
    cfg = drafter_cfg(tmp_path, target_dir, features_dir, "debug=fdr", f"+model.loss_vocab={k}")
    metrics_k = train(cfg)
    assert f"token loss over the {k} most frequent" in capsys.readouterr().out
    assert math.isfinite(metrics_k["val/tok_loss"])

    module = EagleDrafterModule(str(target_dir), noise=0.0, loss_vocab=k)
    datamodule = FeatureDataModule(features_dir, batch_size=4)
    datamodule.setup("fit")
    module._trainer = types.SimpleNamespace(
        datamodule=datamodule
    )  # setup() reads the data's token counts
    module.setup("fit")
    want_ids, _ = draft_vocabulary(datamodule.token_counts(module.drafter.config.vocab_size), k)
    assert torch.equal(module.loss_ids, want_ids)
    batch = collate([FeatureShards(features_dir, "train")[i] for i in range(4)])
    train_out, val_out = module.model_step(batch, train=True), module.model_step(batch, train=False)
    assert train_out["draft_logits"].shape[-1] == k and val_out["draft_logits"].shape[-1] == len(
        module.tokenizer
    )
    # the restricted logits are the whole head's columns at the K ids
    torch.testing.assert_close(train_out["target_logits"], val_out["target_logits"][..., want_ids])
    torch.testing.assert_close(train_out["draft_logits"], val_out["draft_logits"][..., want_ids])
    torch.testing.assert_close(train_out["feat_loss"], val_out["feat_loss"])
    expected = metrics.token_loss(
        val_out["draft_logits"][..., want_ids],
        val_out["target_logits"][..., want_ids],
        val_out["weight"],
    )
    torch.testing.assert_close(train_out["tok_loss"], expected)
    assert not torch.allclose(train_out["tok_loss"], val_out["tok_loss"])  # it is another loss
    with pytest.raises(ValueError, match="loss_vocab must be"):
        EagleDrafterModule(str(target_dir), loss_vocab=0)


def test_the_loss_unrolled_over_the_drafters_own_features(tmp_path, target_dir, features_dir):
    """train_depth=2: the training loss adds, weighted by depth_decay, the loss of a second pass
    that reads the first pass's predictions (shifted one position, as drafting feeds them) at
    the positions with a predicted step behind them; depth 1 stays EAGLE-1's loss, gradients
    reach the first pass through the second, validation is unchanged, and train.py takes it."""
    batch = collate([FeatureShards(features_dir, "train")[i] for i in range(3)])
    one = EagleDrafterModule(str(target_dir), noise=0.0, seed=3)
    two = EagleDrafterModule(str(target_dir), noise=0.0, seed=3, train_depth=2, depth_decay=0.5)
    out1, out2 = one.model_step(batch, train=True), two.model_step(batch, train=True)
    torch.testing.assert_close(
        out2["feat_loss"], out1["feat_loss"]
    )  # depth 1's terms are EAGLE-1's
    torch.testing.assert_close(out2["tok_loss"], out1["tok_loss"])

    # the second pass, by hand: position t reads the first pass's prediction at t-1
    v = shift_batch(batch["input_ids"], batch["features"].float(), batch["loss_mask"])
    drafter = two.drafter
    f1 = drafter(v["features_in"], v["input_ids"], prev_ids=v["prev_ids"])
    fed = torch.cat([v["features_in"][:, :1], f1[:, :-1]], dim=1)
    f2 = drafter(fed, v["input_ids"], prev_ids=v["prev_ids"])
    m = v["weight"].clone()
    m[:, 0] = 0  # position 0 has no predicted step behind it
    with torch.no_grad():
        target_logits = two.head(v["target"])

    def loss(f, mask):
        return metrics.masked_mean(
            metrics.feature_error(f, v["target"]), mask
        ) + 0.1 * metrics.masked_mean(metrics.soft_cross_entropy(two.head(f), target_logits), mask)

    by_hand = loss(f1, v["weight"]) + 0.5 * loss(f2, m)
    torch.testing.assert_close(out2["loss"], by_hand, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out2["loss"] - out1["loss"], 0.5 * loss(f2, m), rtol=1e-4, atol=1e-5)

    # the second pass's loss trains the first pass too (no stop-gradient between them)
    w = drafter.fc.weight
    grad = torch.autograd.grad(out2["loss"], w)[0]
    torch.testing.assert_close(
        grad, torch.autograd.grad(by_hand, w, retain_graph=True)[0], rtol=1e-4, atol=1e-6
    )
    f2_stopped = drafter(
        torch.cat([v["features_in"][:, :1], f1[:, :-1].detach()], dim=1),
        v["input_ids"],
        prev_ids=v["prev_ids"],
    )
    assert not torch.allclose(
        grad,
        torch.autograd.grad(loss(f1, v["weight"]) + 0.5 * loss(f2_stopped, m), w)[0],
        rtol=1e-4,
        atol=1e-6,
    )
    torch.testing.assert_close(
        two.model_step(batch, train=False)["loss"], one.model_step(batch, train=False)["loss"]
    )

    assert math.isfinite(
        train(drafter_cfg(tmp_path, target_dir, features_dir, "debug=fdr", "model.train_depth=2"))[
            "val/loss"
        ]
    )
    for bad in (
        {"train_depth": 0},
        {"train_depth": 1.5},
        {"depth_decay": 0.0},
        {"depth_decay": 1.5},
    ):
        with pytest.raises(ValueError, match="train_depth must be|depth_decay must be"):
            EagleDrafterModule(str(target_dir), **bad)


def test_a_run_that_ends_on_a_validation_is_not_validated_again(
    tmp_path, target_dir, features_dir, monkeypatch
):
    """fit() validated the final step: its metrics are the report's, no second pass over the
    validation data (minutes on a real target); a run that ends between validations runs one."""
    import lightning as L

    calls = []
    real = L.Trainer.validate

    def counted(self, *args, **kwargs):
        calls.append(self.global_step)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "validate", counted)
    ended_on_one = train(
        drafter_cfg(
            tmp_path / "a",
            target_dir,
            features_dir,
            "trainer.max_steps=4",
            "trainer.val_check_interval=2",
        )
    )
    assert calls == [] and math.isfinite(ended_on_one["val/loss"]) and ended_on_one["steps"] == 4
    between = train(
        drafter_cfg(
            tmp_path / "b",
            target_dir,
            features_dir,
            "trainer.max_steps=3",
            "trainer.val_check_interval=2",
        )
    )
    assert calls == [3] and math.isfinite(between["val/loss"])
    assert set(ended_on_one) == set(between)  # the same report either way
