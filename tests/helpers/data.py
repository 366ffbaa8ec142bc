"""Small data files in the formats the data stages read."""

from __future__ import annotations

import json

PROMPTS = ["def add(a, b):", "import os", "class Point:", "for i in range(3):", "print('hello')"]


def sharegpt_file(path, n=5):
    """A ShareGPT JSON file of `n` two-turn conversations whose first human turn is one of PROMPTS."""
    turns = [("human", None), ("gpt", "an answer written by someone else"), ("human", "and then?"), ("gpt", "more")]
    records = [{"id": f"c{i}", "conversations": [{"from": who, "value": text or PROMPTS[i % len(PROMPTS)]}
                                                 for who, text in turns]} for i in range(n)]
    path.write_text(json.dumps(records))
    return path
