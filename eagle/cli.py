"""Running an entry point (train.py, decode.py, python -m data_gen): errors as one line.

A user's mistake (a bad override, a missing file, a target that does not match) is printed as
one line and exit status 1; other errors say how to see their traceback. `HYDRA_FULL_ERROR=1`
shows the full traceback. The entry points are Hydra apps; this module only catches what they
raise, so it needs no Hydra import (the library never imports it).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

USER_ERRORS = (ValueError, FileNotFoundError, RuntimeError)  # the configuration or the files it names


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
        print(f"error: {one_line(exc)}{hint}", file=sys.stderr)
        sys.exit(1)
