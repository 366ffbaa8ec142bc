"""The sharded Arrow storage both dumps share (eagle/data/shards.py): atomic writes, reuse by
fingerprint, and one clear error for every way a folder can be damaged."""

from __future__ import annotations

import json

import pytest

from eagle.artifacts import Artifact
from eagle.data import shards


class Broken(ValueError):
    pass


def schema():
    import datasets

    return datasets.Features({"x": datasets.List(datasets.Value("int32"))}).arrow_schema


def batches(crash_after: int | None = None):
    for i in range(3):
        if crash_after is not None and i == crash_after:
            raise RuntimeError("simulated crash")
        yield {"x": [[i, i], [i]]}, {"tokens": 3}


def test_a_shard_round_trips_with_its_counts_and_fingerprint(tmp_path):
    info = shards.write_shard(tmp_path / "s0", schema(), batches(), {"fp": "abc"})
    assert (
        info["rows"] == 6 and info["tokens"] == 9 and info["fp"] == "abc" and info["name"] == "s0"
    )
    assert json.loads((tmp_path / "s0" / shards.SHARD_META).read_text()) == info
    ds = shards.open_shard(tmp_path / "s0", info, Broken, "")
    assert ds["x"] == [[0, 0], [0], [1, 1], [1], [2, 2], [2]]


def test_a_crash_leaves_no_shard_and_the_rerun_writes_it(tmp_path):
    with pytest.raises(RuntimeError, match="simulated crash"):
        shards.write_shard(tmp_path / "s0", schema(), batches(crash_after=2), {"fp": "abc"})
    assert not (tmp_path / "s0").exists() and (tmp_path / "s0.tmp").is_dir()
    assert shards.complete_shard(tmp_path / "s0", {"fp": "abc"}) is None
    written = []
    info, kept = shards.reuse_or_write(
        tmp_path / "s0",
        {"fp": "abc"},
        lambda: (
            written.append(1)
            or shards.write_shard(tmp_path / "s0", schema(), batches(), {"fp": "abc"})
        ),
    )
    assert not kept and written and not (tmp_path / "s0.tmp").exists()
    again, kept = shards.reuse_or_write(
        tmp_path / "s0", {"fp": "abc"}, lambda: pytest.fail("rewritten")
    )
    assert kept and again == info


def test_a_shard_of_other_inputs_is_redone(tmp_path):
    shards.write_shard(tmp_path / "s0", schema(), batches(), {"fp": "abc"})
    assert shards.complete_shard(tmp_path / "s0", {"fp": "other"}) is None
    info, kept = shards.reuse_or_write(
        tmp_path / "s0",
        {"fp": "other"},
        lambda: shards.write_shard(tmp_path / "s0", schema(), batches(), {"fp": "other"}),
    )
    assert not kept and info["fp"] == "other"


def test_damaged_shards_fail_with_one_clear_line(tmp_path):
    info = shards.write_shard(tmp_path / "s0", schema(), batches(), {"fp": "abc"})
    data = tmp_path / "s0" / shards.DATA_FILE
    with pytest.raises(Broken, match="holds 6 rows, metadata says 7; redo"):
        shards.open_shard(tmp_path / "s0", {**info, "rows": 7}, Broken, "; redo")
    blob = data.read_bytes()
    data.write_bytes(b"\0" * len(blob))  # same size, other bytes
    with pytest.raises(Broken, match="sha256 differs"):
        shards.open_shard(tmp_path / "s0", info, Broken, "")
    with pytest.raises(Broken, match="cannot be read .*corrupt"):
        shards.open_shard(tmp_path / "s0", info, Broken, "", verify="size")
    data.write_bytes(blob[:-8])
    assert (
        shards.complete_shard(tmp_path / "s0", {"fp": "abc"}) is None
    )  # a partial file is not complete
    with pytest.raises(Broken, match="corrupt or partial"):
        shards.open_shard(tmp_path / "s0", info, Broken, "")
    data.unlink()
    with pytest.raises(Broken, match="is missing"):
        shards.open_shard(tmp_path / "s0", info, Broken, "", verify="none")


def test_metadata_is_read_only_when_complete(tmp_path):
    def read():
        return shards.read_complete(
            tmp_path, "metadata.json", "fmt/1", Broken, "test data", "make it"
        )

    with pytest.raises(
        Broken, match=r"no test data in .*metadata.json missing\): run `make it` first"
    ):
        read()
    (tmp_path / "metadata.json").write_text("{not json")
    with pytest.raises(Broken, match="not valid JSON: corrupt test data"):
        read()
    (tmp_path / "metadata.json").write_text(json.dumps({"format": "fmt/0", "status": "complete"}))
    with pytest.raises(Broken, match="unknown test data format 'fmt/0'"):
        read()
    (tmp_path / "metadata.json").write_text(json.dumps({"format": "fmt/1", "status": "incomplete"}))
    with pytest.raises(Broken, match="incomplete .*rerun `make it` with the same settings"):
        read()
    (tmp_path / "metadata.json").write_text(
        json.dumps({"format": "fmt/1", "status": "complete", "n": 1})
    )
    assert read()["n"] == 1


def test_a_folder_of_another_plan_is_kept_unless_overwrite(tmp_path):
    Artifact(tmp_path, "metadata.json", {"seed": 1}, "test data").write(status="complete")
    (tmp_path / "keep").write_text("x")
    other = Artifact(tmp_path, "metadata.json", {"seed": 2}, "test data")
    with pytest.raises(
        Broken, match=r"made with other settings \(differs in \['seed'\]\); pass overwrite=true"
    ):
        shards.start(other, overwrite=False, error=Broken)
    with pytest.raises(Broken, match="refused with several processes"):
        shards.start(other, overwrite=True, error=Broken, several_processes=True)
    assert (tmp_path / "keep").exists()
    shards.start(other, overwrite=True, error=Broken)
    assert not tmp_path.exists()
    same = Artifact(tmp_path, "metadata.json", {"seed": 2}, "test data")
    shards.start(same, overwrite=False, error=Broken)  # absent: nothing to refuse
