"""Hydra entry point of self-distillation: `python -m data_gen.distill [overrides]`.

    python -m data_gen.distill          # SmolLM2's replies to ShareGPT prompts (T=1)
    python -m data_gen.distill temperature=0 name=smollm2-sharegpt-greedy
    python -m data_gen.distill target_path=/models/llama name=llama-sharegpt-t1 device=cuda \\
        num_prompts.train=null new_tokens=256 batch_size=64
    # a text corpus: the target continues each text's start
    python -m data_gen.distill data_gen=text prompt_at=start source.path=/data/notes.jsonl

Loads the target (`target_path`), takes the first `prompt_len` tokens of each sample of the
chosen source (`configs/data_gen/`), or with `prompt_at=reply` the tokens that end each
conversation's first user turn (shorter samples are skipped), as prompts, and writes the target's
sampled continuations with `eagle.data.distill.generate_distilled` to `out_dir` (format:
eagle/data/distill.py).
Rerunning an interrupted command resumes it. Tests call `generate(cfg)` with a composed config.
"""

from __future__ import annotations

from pathlib import Path

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from data_gen.__main__ import pick_device
from eagle.cli import refuse_added_settings, run_cli
from eagle.data.distill import generate_distilled
from eagle.hardware import resolve_dtype_name, set_threads
from eagle.sampling import SamplingPolicy
from eagle.target import load_target

ROOT = Path(__file__).resolve().parents[1]


def prompts_of(
    samples: dict[str, list[dict]], prompt_len: int, at: str = "start"
) -> dict[str, list[list[int]]]:
    """Prompts of `prompt_len` tokens, one per sample that has them, per split.

    at="start": a sample's first `prompt_len` tokens (a corpus: the target continues the text).
    at="reply": the `prompt_len` tokens before a sample's first loss token (a chat conversation: the
    end of its first user turn and the assistant header, so that the target writes its own reply).
    Every prompt has the same length (the SSMs train on aligned rows); samples with fewer tokens
    there are skipped.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if at not in ("start", "reply"):
        raise ValueError(f"prompt_at must be 'start' or 'reply', got {at!r}")

    def prompt(s: dict) -> list[int] | None:
        ids = s["input_ids"]
        end = (
            len(ids)
            if at == "start"
            else int(np.argmax(s["loss_mask"]))
            if s["loss_mask"].any()
            else 0
        )
        if end < prompt_len:
            return None
        window = ids[:prompt_len] if at == "start" else ids[end - prompt_len : end]
        return [int(t) for t in window]

    return {
        split: [p for p in map(prompt, rows) if p is not None] for split, rows in samples.items()
    }


def policy_of(cfg: DictConfig) -> SamplingPolicy:
    return SamplingPolicy(
        temperature=float(cfg.temperature),
        top_k=int(cfg.top_k or 0),
        top_p=float(cfg.top_p if cfg.top_p is not None else 1.0),
    )


def generate(cfg: DictConfig) -> dict:
    """Build the prompts and write the target's continuations as configured; returns the metadata.
    """
    set_threads(cfg.get("threads"))
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(
            f"missing config value(s): {', '.join(missing)} (set them on the command line)"
        )
    policy = policy_of(cfg)  # a bad policy fails before the target loads
    device = pick_device(cfg.device)
    model, tokenizer = load_target(
        cfg.target_path, dtype=resolve_dtype_name(cfg.target_dtype, device), device=device
    )
    samples = instantiate(cfg.source)(tokenizer=tokenizer, max_len=cfg.max_len)
    prompts = prompts_of(samples, int(cfg.prompt_len), str(cfg.get("prompt_at", "start")))
    for split in ("train", "validation"):
        if not prompts.get(split):
            raise ValueError(
                f"no {split} prompts: the source made {len(samples.get(split, []))} {split} "
                "samples, "
                f"none with >= prompt_len={cfg.prompt_len} tokens (raise num_prompts or lower "
                "prompt_len)"
            )
    print(
        f"prompts: {len(prompts['train'])} train, {len(prompts['validation'])} validation, "
        f"{cfg.prompt_len} tokens each; sampling {cfg.new_tokens} tokens per prompt ({policy})"
    )
    meta = generate_distilled(
        model,
        tokenizer,
        prompts,
        cfg.out_dir,
        new_tokens=int(cfg.new_tokens),
        policy=policy,
        batch_size=int(cfg.batch_size),
        shard_size=int(cfg.shard_size),
        seed=int(cfg.seed),
        target_path=str(cfg.target_path),
        overwrite=bool(cfg.overwrite),
        progress=bool(cfg.progress),
    )
    s = meta["splits"]
    print(
        f"distilled: {s['train']['rows']} train rows, {s['validation']['rows']} validation rows "
        f"({meta['counts']['tokens']:,} tokens, {meta['counts']['shards']} shards) in {cfg.out_dir}"
    )
    return meta


@hydra.main(config_path="../configs", config_name="distill", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_added_settings(HydraConfig.get(), hydra.compose)
    generate(cfg)


if __name__ == "__main__":
    run_cli(main, ROOT)
