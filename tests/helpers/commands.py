"""Entry-point commands found in text (documents, recipes), as the config and overrides they
compose: a command a reader copies, or a recipe runs, must not fail on a renamed setting."""

from __future__ import annotations

import re
import shlex

# entry point -> the config it composes (None: it takes no overrides)
ENTRY_POINTS = {"decode.py": "decode", "train.py": "train", "data_gen": "data_gen",
                "data_gen.regenerate": "regenerate", "data_gen.distill": "distill",
                "data_gen.target": None}


def entry_commands(text: str) -> list[tuple[str, list[str]]]:
    """(config name, overrides) of each entry-point command in shell `text`, continuation lines
    joined, comments dropped, `&&`-chained commands split. Shell variables ($T) stay as values."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|;", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # an unbalanced quote across a split: not a command line
                continue
            for i, word in enumerate(words):
                module = words[i + 1] if word == "-m" and i + 1 < len(words) else None
                entry = word if word in ("decode.py", "train.py") else module
                if entry in ENTRY_POINTS:
                    if ENTRY_POINTS[entry] is not None:
                        start = i + 1 + (word == "-m")
                        rest = [w for w in words[start:] if w != "-m"]  # train.py -m: a sweep
                        commands.append((ENTRY_POINTS[entry], rest))
                    break
    return commands


def first_job(overrides: list[str]) -> list[str]:
    """A sweep's overrides (`ablation=a,b,c`) as its first job's: one value per key."""
    return [re.sub(r"^([\w.@/]+)=([^\[{'\"][^,]*),.*$", r"\1=\2", o)
            if "," in o and "[" not in o else o for o in overrides]
