"""Hydra entry point of the feature dump: `python -m data_gen [overrides]`.

    python -m data_gen                                 # SmolLM2 on ShareGPT (configs/data_gen.yaml)
    python -m data_gen data_gen=sharegpt source.path=conv.json target_path=/models/llama \
        name=llama-sharegpt device=cuda
    python -m data_gen source.max_samples=64 name=quick   # any key of the config
    torchrun --nproc_per_node 8 -m data_gen data_gen=sharegpt ...   # 8 GPUs, one dump

Loads the target (`target_path`), builds the token samples of the chosen source
(`configs/data_gen/`: sharegpt, text, distilled), and writes the features with
`eagle.data.features.dump_features` to `out_dir`. Rerunning an interrupted command resumes it.
Tests call `generate(cfg)` with a composed config.
"""

from __future__ import annotations

import os
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from data_gen.conversations import count_tokens
from eagle.cli import refuse_added_settings, run_cli
from eagle.data.features import dump_features
from eagle.hardware import check_device, resolve_dtype_name, set_threads
from eagle.target import load_target

ROOT = Path(__file__).resolve().parents[1]


def pick_device(name: str, local_rank: int = 0, world_size: int = 1) -> str:
    """auto: this process's GPU (LOCAL_RANK under torchrun) when there is one, else the CPU.
    A plain `cuda` of several processes is this process's GPU too: every rank on `cuda`
    would load its copy of the target onto GPU 0."""
    if name == "auto":
        return (
            f"cuda:{local_rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
        )
    check_device(name)
    if name == "cuda" and world_size > 1:
        return f"cuda:{local_rank % max(torch.cuda.device_count(), 1)}"
    return name


def check_splits(samples: dict, cfg: DictConfig) -> None:
    """Both splits must hold samples: a dump without validation samples trains a drafter that
    cannot be checked (and fails at the start of training, far from the cause)."""
    for split, hint in (
        ("train", "source.max_samples or the data"),
        ("validation", "source.val_fraction or source.max_val_samples"),
    ):
        if not samples.get(split):
            raise ValueError(
                f"the source made no {split} samples ({len(samples.get('train', []))} train, "
                f"{len(samples.get('validation', []))} validation): raise {hint}"
            )


def generate(cfg: DictConfig) -> dict:
    """Build the samples and dump the target's features as configured; returns the metadata."""
    set_threads(cfg.get("threads"))
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # `???` in the config: e.g. the sharegpt source's path
        raise ValueError(
            f"missing config value(s): {', '.join(missing)} (set them on the command line)"
        )
    rank, world_size = int(cfg.rank), int(cfg.world_size)
    device = pick_device(cfg.device, int(os.environ.get("LOCAL_RANK", rank)), world_size)
    model, tokenizer = load_target(
        cfg.target_path, dtype=resolve_dtype_name(cfg.target_dtype, device), device=device
    )
    samples = instantiate(cfg.source)(tokenizer=tokenizer, max_len=cfg.max_len)
    check_splits(samples, cfg)
    counts = count_tokens(samples)
    print(
        f"samples: {len(samples['train'])} train ({counts['train']:,} tokens), "
        f"{len(samples['validation'])} validation ({counts['validation']:,} tokens)"
    )
    meta = dump_features(
        model,
        tokenizer,
        samples,
        cfg.out_dir,
        target_path=str(cfg.target_path),
        source=OmegaConf.to_container(cfg.source, resolve=True),
        max_len=cfg.max_len,
        shard_size=cfg.shard_size,
        batch_size=cfg.batch_size,
        dtype=cfg.dtype,
        overwrite=cfg.overwrite,
        progress=cfg.progress,
        rank=rank,
        world_size=world_size,
    )
    if meta["status"] != "complete":
        print(
            f"rank {rank} of {world_size}: its shards are written; the dump in {cfg.out_dir} is "
            "complete when "
            f"every rank has finished"
        )
        return meta
    c = meta["counts"]
    print(
        f"features: {c['samples']} samples, {c['tokens']:,} tokens, {c['shards']} shards, "
        f"{c['bytes'] / 2**20:.1f} MiB ({c['bytes_per_token']} B/token) in {cfg.out_dir}"
    )
    return meta


@hydra.main(config_path="../configs", config_name="data_gen", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_added_settings(HydraConfig.get(), hydra.compose)
    generate(cfg)


if __name__ == "__main__":
    run_cli(main, ROOT)
