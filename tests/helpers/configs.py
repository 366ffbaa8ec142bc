"""The repository's real configs, composed as the entry points compose them."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from helpers.models import CONFIG_DIR


def compose_config(name: str, overrides: list[str]):
    """`configs/<name>.yaml` with `overrides`, as `python <entry point> <overrides>` sees it.
    Tests run on one thread (tiny models gain nothing from more, and a shared CPU slows them)."""
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose(name, overrides=["threads=1", *overrides])


def compose_train(overrides: list[str]):
    return compose_config("train", overrides)


def decode_cfg(models: Path, tmp_path: Path, *overrides: str):
    """decode.py's config on the `models` fixture's target and draft LM, with random drafters
    and heads, outputs under `tmp_path` and 12 new tokens."""
    return compose_config("decode", [
        f"target={models / 'target'}", f"draft.model={models / 'draft'}", "eagle.random=true",
        f"specinfer.models=[{models / 'draft'},{models / 'target'}]",
        "medusa.random=true", f"paths.runs_dir={tmp_path}", "max_new_tokens=12", *overrides])
