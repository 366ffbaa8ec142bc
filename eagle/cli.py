"""Running an entry point (train.py, decode.py, python -m data_gen): errors as one line.

A user's mistake (a bad override, a missing file, a target that does not match) is printed as
one line and exit status 1; other errors say how to see their traceback. `HYDRA_FULL_ERROR=1`
shows the full traceback. The entry points are Hydra apps; this module only catches what they
raise, so it needs no Hydra import (the library never imports it).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

USER_ERRORS = (ValueError, FileNotFoundError, RuntimeError)  # the configuration or the files it names
# messages of other libraries that do not say what to change here
HINTS = {"No supported gpu backend found": "this machine has no GPU: use trainer=cpu, or a CPU preset"}


def _from_config_system(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] in ("hydra", "omegaconf")


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception as one line: its type and message, line breaks folded, long ones cut. A
    failed instantiation shows its cause and the config key; a missing config its options."""
    if type(exc).__name__ == "InstantiationException" and exc.__cause__ is not None:
        where = re.search(r"full_key: (\S+)", str(exc))
        inner = one_line(exc.__cause__, limit)
        return f"{inner} (building {where.group(1)})" if where else inner
    options = getattr(exc, "options", None)
    if type(exc).__name__ == "MissingConfigException" and options:
        first = str(exc).strip().splitlines()[0]
        return f"{first} (available: {', '.join(sorted(options))})"
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def _leaves(node: Any, key: str) -> Iterator[str]:
    """The dotted keys of a config node's leaves (the node's own key for a value or an empty section)."""
    if isinstance(node, Mapping) and node:
        for k, v in node.items():
            yield from _leaves(v, f"{key}.{k}")
    else:
        yield key


def added_settings(config: Mapping, overrides: Sequence[str], groups: Collection[str]) -> list[str]:
    """The top-level settings that `+key=value` overrides added to a config that had no such key.

    Hydra refuses `key=value` for a key its config lacks and suggests `+key=value`, which adds it;
    no entry point reads a setting its config does not have, so following that advice for a
    misspelt name (`+maxlen=256`) would run with the default silently. A top-level name is added
    when every leaf under it comes from `+` overrides; `+section.key=...` inside an existing
    section (a model config's free-form overrides, a Trainer argument) is left to the code that
    reads the section, and `+group=option` appends a config group (`groups`, Hydra's choices),
    whose section exists.

    Args:
        config: the composed config (a DictConfig or a plain mapping).
        overrides: the command line's overrides (Hydra's `overrides.task`).
        groups: the names of the config groups.
    """
    added: dict[str, set[str]] = {}
    for override in overrides:
        if not override.startswith("+"):
            continue
        key = override.lstrip("+").split("=", 1)[0]
        if key.split("@")[0].split(".")[0] in groups or "/" in key:  # a config group's option or section
            continue
        added.setdefault(key.split(".")[0], set()).add(key)
    return [top for top, keys in added.items()
            if all(any(leaf == k or leaf.startswith(k + ".") for k in keys) for leaf in _leaves(config.get(top), top))]


def refuse_added_settings(config: Mapping, hydra_config: Any) -> None:
    """Stop an entry point whose command line added a top-level setting (`added_settings`),
    naming the settings it may have meant. `hydra_config` is Hydra's own (`HydraConfig.get()`)."""
    groups = set(hydra_config.runtime.choices)
    new = added_settings(config, list(hydra_config.overrides.task), groups)
    if new:
        known = [k for k in config if k not in new]
        hints = [f"{name!r} (did you mean {', '.join(map(repr, close))}?)" if (
            close := difflib.get_close_matches(name, known, n=2, cutoff=0.6)) else repr(name) for name in new]
        raise ValueError(f"unknown setting {', '.join(hints)}: a '+' override adds a key that nothing reads "
                         f"(Hydra suggests '+' for a name its config lacks); drop the '+' and use a setting of "
                         f"{hydra_config.job.config_name}.yaml")


def run_cli(main: Callable[[], Any], root: str | Path) -> None:
    """Run a `@hydra.main` entry point of the repository at `root` (runs/ goes under it, whatever
    the working directory); any error is one line and exit status 1."""
    os.environ.setdefault("PROJECT_ROOT", str(root))
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own report
    try:
        main()
    except Exception as exc:
        if full_error:
            raise
        cause = exc.__cause__ if type(exc).__name__ == "InstantiationException" and exc.__cause__ else exc
        user = isinstance(cause, USER_ERRORS) or _from_config_system(cause)
        hint = "" if user else " (HYDRA_FULL_ERROR=1 shows the traceback)"
        line = one_line(exc)
        hint += "".join(f" ({advice})" for text, advice in HINTS.items() if text in line)
        print(f"error: {line}{hint}", file=sys.stderr)
        sys.exit(1)
