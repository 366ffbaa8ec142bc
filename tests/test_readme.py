"""The README's commands compose: every override of every `python decode.py`, `python train.py`
and `python -m data_gen...` line in its code blocks names a key the configs have (Hydra
refuses an unknown key), so a command a reader copies does not fail on a renamed setting."""

from __future__ import annotations

import re
import shlex

import pytest

from helpers.configs import compose_config
from helpers.models import ROOT

ENTRY_POINTS = {"decode.py": "decode", "train.py": "train", "data_gen": "data_gen",
                "data_gen.regenerate": "regenerate", "data_gen.distill": "distill", "data_gen.target": None}


def readme_commands() -> list[tuple[str, list[str]]]:
    """(config name, overrides) of each entry-point command in the README's bash blocks, with
    continuation lines joined, comments dropped and shell variables ($T, $D) left as values."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i, word in enumerate(words):
                entry = word if word in ("decode.py", "train.py") else (
                    words[i + 1] if word == "-m" and i + 1 < len(words) else None)
                if entry in ENTRY_POINTS:
                    if ENTRY_POINTS[entry] is not None:
                        rest = [w for w in words[i + 1 + (word == "-m"):] if w != "-m"]  # -m: a sweep
                        commands.append((ENTRY_POINTS[entry], rest))
                    break
    return commands


def test_the_readme_has_commands_to_check():
    names = [name for name, _ in readme_commands()]
    assert names.count("decode") >= 5 and names.count("train") >= 3 and names.count("data_gen") >= 2


@pytest.mark.parametrize("name,overrides", readme_commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60])
def test_each_readme_command_composes(name, overrides):
    # a sweep's comma lists are one value per job: its first job stands for them
    overrides = [re.sub(r"^([\w.@/]+)=([^\[{'\"][^,]*),.*$", r"\1=\2", o) if "," in o and "[" not in o else o
                 for o in overrides]
    compose_config(name, overrides)


def test_the_readme_python_block_runs(tmp_path, capsys):
    """The README's "From Python" block, on a tiny random target and drafter in place of the
    demo's: the library builds the methods from plain settings and EAGLE's greedy text is vanilla's."""
    from eagle.models.checkpoint import save_drafter
    from eagle.models.drafter import EagleDrafter
    from eagle.target import load_target
    from helpers.models import save_tiny_target, small_tokenizer

    text = (ROOT / "README.md").read_text()
    section = text[text.index("### From Python"):]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    target_dir = save_tiny_target(tmp_path / "target", small_tokenizer(), num_hidden_layers=2)
    target, tokenizer = load_target(target_dir)
    drafter = save_drafter(EagleDrafter.random(target, tokenizer, str(target_dir)), tmp_path / "drafter")
    paths = {'"runs/drafter_smollm2/drafter"': repr(str(drafter)), '"runs/smollm2/model"': repr(str(target_dir)),
             '"configs/tree"': repr(str(ROOT / "configs" / "tree"))}
    for path, tiny in paths.items():
        assert path in block, path
        block = block.replace(path, tiny)
    exec(compile(block, "README.md (From Python)", "exec"), {})
    assert "tau " in capsys.readouterr().out
