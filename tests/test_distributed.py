"""Several processes: DDP training (gloo, on the CPU) equal to one process, one writer of every
artifact, feature dumps split over processes equal to one process's, and Hydra sweeps whose
jobs keep their own folders. The entry points run as subprocesses, as a user runs them
(Lightning relaunches the command for its extra processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_gen.__main__ import generate
from eagle.data.features import METADATA, FeatureShards, read_metadata
from helpers.configs import compose_config, compose_train
from helpers.data import conversations
from helpers.models import ROOT
from train import train

VAL_KEYS = (
    "val/loss",
    "val/feat_loss",
    "val/tok_loss",
    "val/top1_d1",
    "val/top4_d1",
    "val/top1_d2",
    "val/top1_copy",
)


def run(*args: str, cwd: Path = ROOT, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python <args>` in a fresh process, one torch thread per process; fails the test on a
    non-zero exit with the command's output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def drafter_run(runs: Path, target_dir: Path, features_dir: Path, *extra: str) -> tuple[dict, str]:
    """drafter_test with lr 0 (the weights stay at their init, so any two runs must agree on
    validation), through train.py; returns its train_metrics.json and its stdout."""
    proc = run(
        "train.py",
        "experiment=drafter_test",
        f"paths.runs_dir={runs}",
        f"model.target_path={target_dir}",
        f"data.datamodule.features_dir={features_dir}",
        "model.optim.lr=0",
        "trainer.max_steps=4",
        "threads=1",
        "trainer.enable_progress_bar=false",
        "logger=csv",
        *extra,
    )
    return json.loads(
        (runs / "drafter_test" / "drafter" / "train_metrics.json").read_text()
    ), proc.stdout


def test_ddp_drafter_training_equals_one_process(tmp_path, target_dir):
    # 5 validation samples: 3 + 2 over two ranks (a sampler that evens the ranks out with a
    # repeated sample would bias the metrics)
    features_dir = tmp_path / "features"
    generate(
        compose_config(
            "data_gen", [*dump_overrides(target_dir, features_dir), "source.max_val_samples=5"]
        )
    )
    assert len(FeatureShards(features_dir, "validation")) == 5
    one, _ = drafter_run(tmp_path / "one", target_dir, features_dir)
    two, out = drafter_run(tmp_path / "two", target_dir, features_dir, "trainer=cpu_ddp")
    assert (one["processes"], two["processes"]) == (1, 2)
    # validation sums over both ranks, each validation sample once: the one-process metrics
    for key in VAL_KEYS:
        assert two[key] == pytest.approx(one[key], rel=1e-6, abs=1e-7), key
    # every rank's training tokens (4 steps x 4 samples x 32 tokens per process)
    assert one["tokens_seen"] == 4 * 4 * 32 and two["tokens_seen"] == 2 * one["tokens_seen"]
    # one writer: one report, one export, no temporary file of a racing writer left behind
    assert out.count("--- saved the drafter") == 1
    assert not [p for p in (tmp_path / "two").rglob("*") if ".tmp" in p.name]
    weights = [
        load_file(tmp_path / run / "drafter_test" / "drafter" / "model.safetensors")
        for run in ("one", "two")
    ]
    for key in weights[0]:  # lr 0: both exports are the initial drafter
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=0, atol=0)


def test_a_corrupt_shard_stops_every_process_of_a_ddp_run(tmp_path, target_dir):
    """Under DDP each process hashes its share of the shards (once, not once per process), and a
    shard that fails its checksum in one process stops them all before any trains."""
    features_dir = tmp_path / "features"
    generate(compose_config("data_gen", dump_overrides(target_dir, features_dir)))
    shard = (
        sorted((features_dir / "train").iterdir())[1] / "data.arrow"
    )  # rank 1's (every 2nd shard from 1)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size, another sha256
    shard.write_bytes(bytes(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "experiment=drafter_test",
            f"paths.runs_dir={tmp_path / 'runs'}",
            f"model.target_path={target_dir}",
            f"data.datamodule.features_dir={features_dir}",
            "trainer.max_steps=2",
            "threads=1",
            "trainer.enable_progress_bar=false",
            "logger=csv",
            "trainer=cpu_ddp",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"shard {shard.parent} is corrupt: sha256 differs" in out
    assert "failed its checksum in another process" in out  # rank 0, which hashed the good shards
    assert not (tmp_path / "runs" / "drafter_test" / "drafter").exists()


@pytest.mark.slow  # ~30 s: two ssm_test runs, one of two processes
def test_ddp_lm_training_equals_one_process(tmp_path, target_dir, distilled_dir):
    """A causal LM (SpecInfer's SSM) fine-tuned under DDP: the same validation, twice the tokens,
    one export."""
    common = (
        "train.py",
        "experiment=ssm_test",
        f"data.datamodule.distill_dir={distilled_dir}",
        f"data.datamodule.tokenizer_path={target_dir}",
        f"model.init_from={target_dir}",
        "model.optim.lr=0",
        "trainer.max_steps=4",
        "threads=1",
        "trainer.enable_progress_bar=false",
        "logger=csv",
    )
    run(*common, f"paths.runs_dir={tmp_path / 'one'}")
    out = run(*common, f"paths.runs_dir={tmp_path / 'two'}", "trainer=cpu_ddp").stdout
    one, two = (
        json.loads((tmp_path / r / "ssm_test" / "model" / "eagle_target.json").read_text())
        for r in ("one", "two")
    )
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6)
    assert two["tokens_seen"] == 2 * one["tokens_seen"] and two["processes"] == 2
    assert out.count("--- saved the model") == 1


def test_the_export_takes_the_strategys_gathered_weights(
    tmp_path, target_dir, features_dir, monkeypatch
):
    """Under FSDP only `strategy.lightning_module_state_dict()` holds whole tensors (gathered on
    rank 0); the export must write those, not the module's own (sharded) ones. Lightning runs
    FSDP on GPUs only, so the strategy's gather is stood in for here."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from eagle.models.checkpoint import load_drafter
    from eagle.target import load_target

    gathered = SingleDeviceStrategy.lightning_module_state_dict

    def marked(self):
        state = gathered(self)
        return {
            k: torch.full_like(v, 0.25) if k == "drafter.fc.weight" else v for k, v in state.items()
        }

    monkeypatch.setattr(SingleDeviceStrategy, "lightning_module_state_dict", marked)
    metrics = train(
        compose_train(
            [
                "experiment=drafter_test",
                f"paths.runs_dir={tmp_path}",
                f"model.target_path={target_dir}",
                f"data.datamodule.features_dir={features_dir}",
                "trainer.max_steps=2",
                "trainer.enable_progress_bar=false",
                "logger=csv",
            ]
        )
    )
    target, tokenizer = load_target(target_dir)
    drafter = load_drafter(metrics["drafter_dir"], target, tokenizer)
    assert torch.all(drafter.fc.weight == 0.25)


# ------------------------------------------------------------------------- feature dumps


def dump_overrides(target_dir: Path, out: Path) -> list[str]:
    return conversations(
        f"target_path={target_dir}",
        f"out_dir={out}",
        "target_dtype=float32",
        "device=cpu",
        "threads=1",
        "max_len=32",
        "shard_size=4",
        "batch_size=2",
        "progress=false",
        "source.max_samples=16",
        "source.max_val_samples=8",
    )


def assert_same_dump(a: Path, b: Path) -> None:
    """Equal metadata (but the run's own timing) and equal shard files, byte for byte."""
    meta_a, meta_b = read_metadata(a), read_metadata(b)
    for meta in (meta_a, meta_b):
        meta.pop("seconds_this_run")
    assert meta_a == meta_b
    for split, info in meta_a["splits"].items():
        assert len(FeatureShards(a, split)) == len(FeatureShards(b, split)) == info["samples"] > 0
        for shard in info["shards"]:
            assert (a / split / shard["name"] / "data.arrow").read_bytes() == (
                b / split / shard["name"] / "data.arrow"
            ).read_bytes()


def test_a_dump_split_over_ranks_equals_one_process(tmp_path, target_dir):
    generate(compose_config("data_gen", dump_overrides(target_dir, tmp_path / "one")))
    split = tmp_path / "split"
    first = generate(
        compose_config("data_gen", [*dump_overrides(target_dir, split), "rank=1", "world_size=2"])
    )
    assert first["status"] == "incomplete"  # rank 0's shards are missing: nobody may train on it
    shards = sorted(p.name for p in split.glob("*/shard_*"))
    assert shards and len(shards) < len(list((tmp_path / "one").glob("*/shard_*")))  # rank 1's only
    with pytest.raises(ValueError, match="incomplete"):
        read_metadata(split)
    # rank 1 again: its shards are done, nothing is recomputed; then rank 0 completes the dump
    again = generate(
        compose_config("data_gen", [*dump_overrides(target_dir, split), "rank=1", "world_size=2"])
    )
    assert again["status"] == "incomplete"
    done = generate(
        compose_config("data_gen", [*dump_overrides(target_dir, split), "rank=0", "world_size=2"])
    )
    assert done["status"] == "complete"
    assert_same_dump(tmp_path / "one", split)
    with pytest.raises(ValueError, match="overwrite=true is refused with several processes"):
        generate(
            compose_config(
                "data_gen",
                [
                    *dump_overrides(target_dir, split),
                    "rank=0",
                    "world_size=2",
                    "max_len=24",
                    "overwrite=true",
                ],
            )
        )


def test_two_concurrent_processes_write_one_dump(tmp_path, target_dir):
    """Two `python -m data_gen` at once on one folder (the race that lost shard_00010.tmp)."""
    generate(compose_config("data_gen", dump_overrides(target_dir, tmp_path / "one")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "data_gen", *dump_overrides(target_dir, tmp_path / "two")],
            cwd=ROOT,
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert json.loads((tmp_path / "two" / METADATA).read_text())["status"] == "complete"
    assert_same_dump(tmp_path / "one", tmp_path / "two")


# -------------------------------------------------------------------------------- sweeps


def test_each_job_of_a_sweep_trains_in_its_own_folder(tmp_path, target_dir, features_dir):
    """`-m model.optim.lr=a,b`: two runs, neither resuming the other (once, job 2 resumed job 1's
    last.ckpt, trained 0 steps and exported job 1's weights as its own)."""
    sweep = tmp_path / "sweep"
    run(
        "train.py",
        "-m",
        "experiment=drafter_test",
        f"paths.runs_dir={tmp_path}",
        f"model.target_path={target_dir}",
        f"data.datamodule.features_dir={features_dir}",
        "model.optim.lr=1e-3,1e-2",
        "trainer.max_steps=3",
        "threads=1",
        "trainer.enable_progress_bar=false",
        "logger=csv",
        f"hydra.sweep.dir={sweep}",
    )
    reports = [
        json.loads((sweep / str(job) / "drafter" / "train_metrics.json").read_text())
        for job in (0, 1)
    ]
    assert [r["config"]["model"]["optim"]["lr"] for r in reports] == [1e-3, 1e-2]
    assert [(r["steps"], r["resumed_from_step"]) for r in reports] == [(3, 0), (3, 0)]
    assert [r["config"]["paths"]["run_dir"] for r in reports] == [
        str(sweep / "0"),
        str(sweep / "1"),
    ]
    weights = [load_file(sweep / str(job) / "drafter" / "model.safetensors") for job in (0, 1)]
    assert not torch.equal(weights[0]["fc.weight"], weights[1]["fc.weight"])
    assert not (tmp_path / "drafter_test").exists()  # the non-sweep run folder is untouched


def test_sharded_validation_needs_as_many_batches_on_every_process():
    """Under FSDP every forward gathers weights from every process: a process with one more
    validation batch would gather alone and hang the run. 10 samples over 4 processes in
    batches of 2 give 2 batches to some and 1 to others: refused with sizes that work. DDP
    (no gathers in the forward) runs it; 8 samples split evenly."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from eagle.training.datamodules import SampleDataModule, eval_sampler

    def sampler(strategy, n):
        dm = SampleDataModule(batch_size=2)
        dm.trainer = SimpleNamespace(world_size=4, global_rank=0, strategy=strategy)
        return eval_sampler(dm, list(range(n)))

    with pytest.raises(
        ValueError, match="give some processes 2 batches and others 1; .* use 8 or 16 validation"
    ):
        sampler(FSDPStrategy(), 10)
    assert len(sampler(DDPStrategy(), 10)["sampler"]) in (2, 3)
    assert len(sampler(FSDPStrategy(), 8)["sampler"]) == 2
