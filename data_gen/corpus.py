"""The built-in text corpus: the Python standard library source of the running interpreter.

Every Python install carries it (about 1,800 `.py` files, 31 MB for 3.11), so the default
target can be trained with no download. The split is by file and depends only on each
file's relative path, never on the order the filesystem lists them in.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path

from datasets import Dataset, DatasetDict, DatasetInfo, load_from_disk

from eagle.artifacts import SPLITS, Artifact
from eagle.data.tokens import corpus_fingerprint

CORPUS_NAME = "python-stdlib"
EXCLUDED_DIRS = ("site-packages", "dist-packages")  # third-party code, not the stdlib
META_FILE = "corpus_meta.json"


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def corpus_id() -> str:
    """Name of the corpus this interpreter yields, e.g. `python-stdlib-3.11.7`."""
    return f"{CORPUS_NAME}-{python_version()}"


def list_python_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the `.py` files under `root` (the stdlib by default), sorted."""
    root = Path(root) if root is not None else stdlib_dir()
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts) or not path.is_file():
            continue
        paths.append(rel.as_posix())
    if not paths:
        raise FileNotFoundError(f"no .py files found under {root}")
    return sorted(paths)


def stable_unit(text: str, salt: str) -> float:
    """A number in [0, 1) that depends only on `salt` and `text` (not on PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"{salt}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(rel_path: str, val_fraction: float) -> str:
    """`"validation"` for about `val_fraction` of the files, chosen by path hash; else `"train"`."""
    return "validation" if stable_unit(rel_path, "split") < val_fraction else "train"


def select_files(paths: list[str], max_files: int | None) -> list[str]:
    """A deterministic pseudo-random subset of `max_files` paths (all when None), sorted."""
    if max_files is None or max_files >= len(paths):
        return sorted(paths)
    if max_files < 1:
        raise ValueError(f"max_files must be >= 1 or null, got {max_files}")
    # A salt different from the split's, so a subset keeps about the same val fraction.
    return sorted(sorted(paths, key=lambda p: stable_unit(p, "subset"))[:max_files])


def build_python_corpus(
    val_fraction: float = 0.05,
    max_files: int | None = None,
    cache_dir: str | Path | None = None,
    root: str | Path | None = None,
) -> DatasetDict:
    """The stdlib `.py` files as a `DatasetDict` with `train` and `validation` splits.

    Args:
        val_fraction: expected share of files in `validation` (the split is by path hash).
        max_files: keep only this many files (a deterministic subset), for tests; None = all.
        cache_dir: if given, the dataset is saved there and reloaded on the next call with
            the same arguments (a folder built with other arguments is an error).
        root: folder to read instead of the running interpreter's stdlib.
    Returns:
        DatasetDict with columns `path` (relative, POSIX) and `text`, rows sorted by path.
        Files are decoded as UTF-8 with `errors="replace"` (four stdlib test files are
        not UTF-8); line endings are kept as they are on disk.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    root = Path(root) if root is not None else stdlib_dir()
    params = {
        "corpus": corpus_id() if root == stdlib_dir() else f"python-files:{root}",
        "val_fraction": val_fraction,
        "max_files": max_files,
    }
    cache = Artifact(cache_dir, META_FILE, params, "corpus cache") if cache_dir is not None else None
    if cache is not None and cache.reusable():  # a cache built with other arguments is an error
        return load_from_disk(str(cache_dir))

    paths = select_files(list_python_files(root), max_files)
    rows: dict[str, dict[str, list[str]]] = {s: {"path": [], "text": []} for s in SPLITS}
    for rel in paths:
        text = (root / rel).read_bytes().decode("utf-8", errors="replace")  # keeps \r\n as is
        split = split_of(rel, val_fraction)
        rows[split]["path"].append(rel)
        rows[split]["text"].append(text)
    for split in SPLITS:
        if not rows[split]["path"]:
            raise ValueError(
                f"the {split} split is empty ({len(paths)} files, val_fraction={val_fraction}): "
                "use more files or another val_fraction"
            )
    info = DatasetInfo(description=params["corpus"])  # what a model trained on it records
    corpus = DatasetDict({s: Dataset.from_dict(rows[s], info=info) for s in SPLITS})

    if cache is not None:
        corpus.save_to_disk(str(cache_dir))
        cache.write(python_version=python_version(), n_files={s: len(rows[s]["path"]) for s in SPLITS},
                    n_chars={s: sum(map(len, rows[s]["text"])) for s in SPLITS},
                    fingerprint=corpus_fingerprint(corpus))
    return corpus
