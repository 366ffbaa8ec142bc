"""Artifacts that later stages reuse: a folder plus a JSON sidecar saying what built it.

Every stage of the data flow (corpus -> tokenizer -> target -> features -> drafter) writes a
folder that the next stage reads instead of rebuilding it. One helper decides whether such a
folder can be reused: its sidecar holds the `params` that produced it and a `status`, and

- no sidecar (or an unreadable one): absent, build it;
- other params: stale, an error naming the difference (or, for a pure cache, rebuild it);
- `status` "incomplete": an interrupted build with the same params, to be resumed;
- `status` "complete" with the same params: reuse it.

The sidecar is written atomically, so an interrupted write never leaves a half file.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

SPLITS = ("train", "validation")  # the splits of every corpus, sample set and feature dump


class ArtifactError(ValueError):
    """A folder that exists but was built from other parameters."""


def read_json(path: str | Path) -> dict | None:
    """The JSON object in `path`, or None when the file is absent or not a JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: str | Path, data: dict) -> None:
    """Write `data` as JSON through a temporary file and a rename (atomic on POSIX). The
    temporary name is the writer's own (a random suffix: processes on several machines may
    share a pid and write the same file)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def write_report(out_dir: str | Path, name: str, report: dict, markdown: str) -> Path:
    """`<name>.json` and `<name>.md` in `out_dir`, the Markdown printed too: the report a
    measurement leaves (the floor, the profile, the coverage). Returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{name}.json", report)
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
    return out


def files_stamp(paths: list[str]) -> dict[str, int]:
    """For each of `paths` that exists, the newest modification time (ns) of the file, or of the
    files directly in the folder: a model or drafter saved again there has a new stamp (a run
    that resumes must not mix the measurements of two of them)."""
    stamps = {}
    for name in dict.fromkeys(paths):
        path = Path(name)
        if path.is_file():
            stamps[name] = path.stat().st_mtime_ns
        elif path.is_dir():
            stamps[name] = max(
                (f.stat().st_mtime_ns for f in path.iterdir() if f.is_file()), default=0
            )
    return stamps


def replace_folder(src: str | Path, dst: str | Path) -> None:
    """Put the finished folder `src` in place of `dst` (which may exist) by renames: `dst` is
    either the old folder or the new one whole, never a half-written mix (a process killed between
    the two renames leaves `dst` absent, and the old one beside it as `.<name>.old`)."""
    src, dst = Path(src), Path(dst)
    old = dst.with_name(f".{dst.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if dst.exists():
        dst.rename(old)
    src.rename(dst)
    if old.exists():
        shutil.rmtree(old)


class Artifact:
    """A folder built from `params`, described by the sidecar `folder / sidecar`.

    Args:
        folder: where the artifact lives.
        sidecar: the JSON file's name inside it.
        params: what decides the content (JSON-serialisable); compared on reuse.
        what: the artifact's name in messages ("corpus cache", "feature dump", ...).
    """

    def __init__(self, folder: str | Path, sidecar: str, params: dict[str, Any], what: str):
        self.folder, self.sidecar, self.params, self.what = Path(folder), sidecar, params, what

    @property
    def path(self) -> Path:
        return self.folder / self.sidecar

    def meta(self) -> dict | None:
        return read_json(self.path)

    def differences(self, meta: dict | None = None) -> list[str]:
        """The params keys whose values differ from the recorded ones."""
        meta = self.meta() if meta is None else meta
        old = (meta or {}).get("params", {})
        return sorted(k for k in set(old) | set(self.params) if old.get(k) != self.params.get(k))

    def state(self) -> str:
        """One of "absent", "stale", "incomplete" and "complete"."""
        meta = self.meta()
        if meta is None:
            return "absent"
        if self.differences(meta):
            return "stale"
        return "complete" if meta.get("status", "complete") == "complete" else "incomplete"

    def reusable(self, on_stale: str = "error") -> bool:
        """True when the folder holds a complete artifact built from these params.

        A stale one raises `ArtifactError` (`on_stale="error"`) or counts as absent
        (`on_stale="rebuild"`, for caches that are cheap to rebuild)."""
        state = self.state()
        if state == "stale" and on_stale == "error":
            old = self.meta().get("params", {})
            diff = {k: (old.get(k), self.params.get(k)) for k in self.differences()}
            raise ArtifactError(
                f"{self.what} in {self.folder} was built with other settings "
                f"({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in diff.items())}): "
                f"delete it or point elsewhere"
            )
        return state == "complete"

    def write(self, status: str = "complete", **info: Any) -> dict:
        """Record the params, `status` and `info` (top-level keys) in the sidecar."""
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = {"params": self.params, "status": status, **info}
        write_json(self.path, meta)
        return meta


def stopped_report(path: str | Path, key: Any) -> dict | None:
    """The JSON report at `path` if the run that wrote it stopped before the end (`status`
    "incomplete") and was made with `key` (compared as JSON holds it): a rerun with the same key
    resumes from it. None for no key, no report, a finished one or another key."""
    report = read_json(path) if key is not None else None
    if (
        not report
        or report.get("status") != "incomplete"
        or report.get("resume_key") != json.loads(json.dumps(key))
    ):
        return None
    return report


def keep_previous(out_dir: str | Path, names: tuple[str, ...]) -> Path | None:
    """Move the report files (`names`) a run before this one left in `out_dir` (a fixed output
    folder run again) into `out_dir/previous/<their time>/`, so that no measured run is
    overwritten; returns that folder, or None when there was nothing to keep."""
    out_dir = Path(out_dir)
    found = [out_dir / name for name in names if (out_dir / name).exists()]
    if not found:
        return None
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(found[0].stat().st_mtime))
    dest, n = out_dir / "previous" / stamp, 1
    while dest.exists():
        n += 1
        dest = out_dir / "previous" / f"{stamp}_{n}"
    dest.mkdir(parents=True)
    for path in found:
        path.rename(dest / path.name)
    print(f"the report already in {out_dir} is kept in {dest}")
    return dest
