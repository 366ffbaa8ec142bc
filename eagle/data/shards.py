"""Resumable sharded Arrow storage: what the feature dump (`eagle.data.features`) and the
distilled data (`eagle.data.distill`) share.

A dataset folder holds its `metadata.json` (an `eagle.artifacts.Artifact` sidecar: the plan
as its params, `"status": "incomplete"` until the last shard is in) and, per split, shard
folders `<split>/<name>/`, each with

    data.arrow    an Arrow stream file: `datasets.Dataset.from_file` memory-maps it
    shard.json    its rows, bytes and sha256, the fingerprint of the inputs it was made
                  from, and whatever else the writer counted (tokens, ...)

A shard is written into `<name>.tmp/` and renamed once complete, so a shard folder is either
absent or whole; a rerun keeps every complete shard made from the same inputs and redoes the
rest. Reading checks each shard against the metadata and fails with one clear line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from eagle.artifacts import Artifact, read_json

log = logging.getLogger(__name__)

SHARD_META = "shard.json"
DATA_FILE = "data.arrow"
VERIFY = ("checksum", "size", "none")

Batch = tuple[
    dict[str, list], dict[str, int]
]  # (columns: name -> values, counts summed into shard.json)


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def shard_ranges(n: int, shard_size: int) -> list[tuple[int, int]]:
    """Row index ranges of the shards: row i is in shard i // shard_size."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return [(a, min(a + shard_size, n)) for a in range(0, n, shard_size)]


def plan_hash(plan: dict) -> str:
    """A short hash of a dataset's whole plan. It goes into every shard's fingerprint, so a
    shard is reused only under the plan it was made with, also where the folder's metadata is
    lost (a crash, a deleted file) or a process was started with other settings."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- writing


def start(
    art: Artifact, overwrite: bool, error: type[Exception], several_processes: bool = False
) -> None:
    """Open a dataset folder for writing: one made with the same plan is resumed; one made with
    another plan is `error` unless `overwrite` (refused with several processes: one would delete
    the others' shards), then deleted. A folder holding another kind of dataset (its format's
    name differs) is never deleted."""
    if art.state() != "stale":
        return
    kind = str(art.params.get("format", "")).split("/")[0]
    found = str((art.meta() or {}).get("params", {}).get("format", "")).split("/")[0]
    if found != kind:
        raise error(
            f"{art.folder} holds another kind of dataset ({found or 'unknown'}), not a {art.what} "
            f"({kind}); "
            "choose another out_dir (overwrite=true never deletes another kind)"
        )
    diff = art.differences()
    stale = f"the {art.what} in {art.folder} was made with other settings (differs in {diff})"
    if not overwrite:
        raise error(f"{stale}; pass overwrite=true or choose another out_dir")
    if several_processes:
        raise error(
            f"{stale}; overwrite=true is refused with several processes: delete it, or run one"
        )
    log.warning("overwriting the %s in %s (settings differ in %s)", art.what, art.folder, diff)
    shutil.rmtree(art.folder)


def write_shard(
    shard_dir: Path,
    schema,
    batches: Iterable[Batch],
    fingerprint: dict[str, str],
    on_batch: Callable[[int], None] | None = None,
) -> dict:
    """Write `batches` as one shard, atomically: into `<shard_dir>.tmp`, then a rename.

    Args:
        shard_dir: the shard's folder (its name is the shard's name).
        schema: the Arrow schema of the rows.
        batches: (columns, counts) per batch, computed lazily: a crash mid-shard leaves only
            the `.tmp` folder, which the next run deletes.
        fingerprint: what identifies the inputs (e.g. {"samples_fingerprint": sha256}), kept
            in shard.json and compared by `complete_shard`.
        on_batch: called with n after each batch of n rows is on disk (progress bars; the
            tests' simulated crash).
    Returns:
        The shard's info (also `shard.json`): name, rows, the summed counts, bytes, sha256 and
        the fingerprint.
    """
    import pyarrow as pa

    tmp = shard_dir.with_name(shard_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a partial shard from an interrupted run
    tmp.mkdir(parents=True)
    rows, counts = 0, {}
    with pa.OSFile(str(tmp / DATA_FILE), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for columns, batch_counts in batches:
            writer.write_batch(pa.RecordBatch.from_pydict(columns, schema=schema))
            sink.flush()
            n = len(next(iter(columns.values())))
            rows += n
            for key, value in batch_counts.items():
                counts[key] = counts.get(key, 0) + value
            if on_batch is not None:
                on_batch(n)
    info = {
        "name": shard_dir.name,
        "rows": rows,
        **counts,
        "bytes": (tmp / DATA_FILE).stat().st_size,
        "sha256": file_sha256(tmp / DATA_FILE),
        **fingerprint,
    }
    (tmp / SHARD_META).write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, shard_dir)  # atomic on POSIX: the shard is either absent or complete
    return info


def complete_shard(shard_dir: Path, fingerprint: dict[str, str]) -> dict | None:
    """The info of a finished shard made from these inputs, or None (absent, partial, other inputs).
    """
    info = read_json(shard_dir / SHARD_META) if shard_dir.exists() else None
    data = shard_dir / DATA_FILE
    if (
        info is not None
        and all(info.get(k) == v for k, v in fingerprint.items())
        and data.exists()
        and data.stat().st_size == info.get("bytes")
    ):
        return info
    return None


def reuse_or_write(
    shard_dir: Path, fingerprint: dict[str, str], write: Callable[[], dict]
) -> tuple[dict, bool]:
    """A complete shard of these inputs is kept; otherwise whatever is there (damaged, or made from
    other inputs) is deleted and `write()` makes it. Returns (info, kept)."""
    info = complete_shard(shard_dir, fingerprint)
    if info is not None:
        return info, True
    if shard_dir.exists():
        log.warning("recomputing %s (incomplete or made from other inputs)", shard_dir)
        shutil.rmtree(shard_dir)
    return write(), False


# ----------------------------------------------------------------------------- reading


def read_complete(
    folder: Path, name: str, fmt: str, error: type[Exception], what: str, run: str
) -> dict:
    """The sidecar of a complete dataset folder; `error` with the fix otherwise (`run`: the
    command that makes it)."""
    path = folder / name
    if not path.exists():
        raise error(f"no {what} in {folder} ({name} missing): run `{run}` first")
    meta = read_json(path)
    if meta is None:
        raise error(f"{path} is not valid JSON: corrupt {what}")
    if meta.get("format") != fmt:
        raise error(f"{folder}: unknown {what} format {meta.get('format')!r} (want {fmt})")
    if meta.get("status") != "complete":
        raise error(
            f"the {what} in {folder} is incomplete (status {meta.get('status')!r}: an interrupted "
            f"run): rerun `{run}` with the same settings to finish it"
        )
    return meta


def verify_shard(
    shard_dir: Path, info: dict, error: type[Exception], redo: str, verify: str = "checksum"
) -> None:
    """Check one shard against its info: present, of the recorded size, and (checksum) sha256."""
    if verify not in VERIFY:
        raise ValueError(f"verify must be one of {VERIFY}, got {verify!r}")
    data = shard_dir / DATA_FILE
    if not data.exists():
        raise error(f"shard {shard_dir} is missing ({DATA_FILE} not found){redo}")
    if verify == "none":
        return
    size = data.stat().st_size
    if size != info["bytes"]:
        raise error(
            f"shard {shard_dir} is corrupt or partial: {size} bytes, metadata says "
            f"{info['bytes']}{redo}"
        )
    if verify == "checksum" and file_sha256(data) != info["sha256"]:
        raise error(f"shard {shard_dir} is corrupt: sha256 differs from the metadata{redo}")


def open_shard(
    shard_dir: Path, info: dict, error: type[Exception], redo: str, verify: str = "checksum"
) -> Any:
    """`verify_shard`, then the shard as a memory-mapped `datasets.Dataset` holding the recorded
    rows."""
    import datasets

    verify_shard(shard_dir, info, error, redo, verify)
    try:
        ds = datasets.Dataset.from_file(str(shard_dir / DATA_FILE))
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for bad files
        first = str(err).splitlines()[0] if str(err) else ""
        raise error(
            f"shard {shard_dir} cannot be read ({type(err).__name__}: {first}): corrupt{redo}"
        ) from err
    if len(ds) != info["rows"]:
        raise error(f"shard {shard_dir} holds {len(ds)} rows, metadata says {info['rows']}{redo}")
    return ds
