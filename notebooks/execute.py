"""Execute a notebook headless and save it with its outputs (used by `make analysis` and the tests).

    python notebooks/execute.py notebooks/feature_error.ipynb runs/analysis/feature_error.ipynb

The kernel runs in the notebook's folder with this process's environment, so parameters
given as environment variables (e.g. FEATURE_ERROR_RUNS) reach it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def execute(src: str | Path, dst: str | Path | None = None, timeout: int = 1200) -> Path | None:
    """Run every cell of `src` in a fresh python3 kernel; write the executed notebook to `dst`.

    Raises nbclient's CellExecutionError (naming the failing cell and its traceback) on error."""
    import nbformat
    from nbclient import NotebookClient

    src = Path(src).resolve()
    nb = nbformat.read(src, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(src.parent)}}).execute()
    if dst is not None:
        dst = Path(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, dst)
    return dst


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("out", nargs="?", help="where to save the executed notebook")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = execute(args.notebook, args.out, args.timeout)
    print(
        f"executed {args.notebook} in {time.perf_counter() - start:.0f}s"
        + (f" -> {out}" if out else "")
    )


if __name__ == "__main__":
    main(sys.argv[1:])
