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
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from eagle.progress import quiet_library_bars

USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    RuntimeError,
)  # the configuration or the files it names
# messages of other libraries that do not say what to change here
HINTS = {
    "No supported gpu backend found": "this machine has no GPU: use trainer=cpu, or a CPU preset"
}


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


def added_settings(
    base: Collection[str], overrides: Sequence[str], groups: Collection[str]
) -> list[str]:
    """The top-level settings that `+key=value` overrides add to a config that has no such key.

    Hydra refuses `key=value` for a key its config lacks and suggests `+key=value`, which adds it;
    no entry point reads a setting its config does not have, so following that advice for a
    misspelt name (`+maxlen=256`) would run with the default silently. `+section.key=...` inside
    an existing section (a model config's free-form overrides, a Trainer argument), `+group=option`
    (a config group, `groups`), `++key` (Hydra never suggests it), a section deleted first
    (`~logger +logger.csv...`) and a helper that another override interpolates (`+root=/x
    paths.runs_dir=${root}/runs`) are not refused.

    Args:
        base: the top-level keys of the config composed without the `+key` overrides (a key set
            to null counts: Hydra takes `+key` for it).
        overrides: the command line's overrides (Hydra's `overrides.task`).
        groups: the names of the config groups (Hydra's `runtime.choices`).
    """
    deleted = {o[1:].split("=", 1)[0] for o in overrides if o.startswith("~")}
    added = []
    for override in overrides:
        if not appended(override, groups):
            continue
        top = override[1:].split("=", 1)[0].split("@")[0].split(".")[0]
        if top in base or top in deleted:
            continue
        if any("${" + top in other for other in overrides):  # read through an interpolation
            continue
        added.append(top)
    return list(dict.fromkeys(added))


def appended(override: str, groups: Collection[str]) -> bool:
    """Whether an override is a `+key=value` that `added_settings` looks at (not `++`, not a group).
    """
    key = override[1:].split("=", 1)[0]
    return (
        override.startswith("+")
        and not override.startswith("++")
        and key.split("@")[0].split(".")[0] not in groups
        and "/" not in key
    )


def refuse_added_settings(hydra_config: Any, compose: Callable[..., Mapping]) -> None:
    """Stop an entry point whose command line added a top-level setting (`added_settings`),
    naming the settings it may have meant. `hydra_config` is Hydra's own (`HydraConfig.get()`),
    `compose` Hydra's compose API (the config is composed again without the `+key` overrides)."""
    overrides, groups = list(hydra_config.overrides.task), set(hydra_config.runtime.choices)
    if not any(appended(o, groups) for o in overrides):
        return
    name = hydra_config.job.config_name
    base = compose(config_name=name, overrides=[o for o in overrides if not appended(o, groups)])
    new = added_settings(set(base), overrides, groups)
    if new:
        hints = [
            f"{key!r} (did you mean {', '.join(map(repr, close))}?)"
            if (close := difflib.get_close_matches(key, list(base), n=2, cutoff=0.6))
            else repr(key)
            for key in new
        ]
        raise ValueError(
            f"unknown setting {', '.join(hints)}: a '+' override adds a key that nothing reads "
            f"(Hydra suggests '+' for a name its config lacks); drop the '+' and use a setting of "
            f"{name}.yaml"
        )


def run_cli(main: Callable[[], Any], root: str | Path) -> None:
    """Run a `@hydra.main` entry point of the repository at `root` (runs/ goes under it, whatever
    the working directory); any error is one line and exit status 1."""
    os.environ.setdefault("PROJECT_ROOT", str(root))
    quiet_library_bars()
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own report
    try:
        main()
    except Exception as exc:
        if full_error:
            raise
        cause = (
            exc.__cause__
            if type(exc).__name__ == "InstantiationException" and exc.__cause__
            else exc
        )
        user = isinstance(cause, USER_ERRORS) or _from_config_system(cause)
        hint = "" if user else " (HYDRA_FULL_ERROR=1 shows the traceback)"
        line = one_line(exc)
        hint += "".join(f" ({advice})" for text, advice in HINTS.items() if text in line)
        print(f"error: {line}{hint}", file=sys.stderr)
        sys.exit(1)
