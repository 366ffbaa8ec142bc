"""scripts/gpu_long.sh's transport: a payload too big for one 64 MiB copy comes in chunks, each
stashed by its own command and checked against the manifest before anything runs."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_long.sh"


def run(mode: str, carry: Path, stash: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CARRY": str(carry), "STASH": str(stash), "PAYLOAD": str(tmp / "payload"),
           "OUT": str(tmp / "out"), "RUNS": str(tmp / "runs"), "DEVICE": "cpu"}
    return subprocess.run(["bash", str(SCRIPT), mode], capture_output=True, text=True, timeout=60, env=env)


def chunks(tmp: Path, parts: dict[str, bytes]) -> Path:
    """A carry folder holding `parts` and the manifest of them all."""
    carry = tmp / "carry"
    carry.mkdir(exist_ok=True)
    for name, data in parts.items():
        (carry / name).write_bytes(data)
    (carry / "manifest").write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in parts.items()))
    return carry


def test_the_scripts_parse():
    for script in ("gpu_long.sh", "gpu_bench.sh", "gpu_common.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)]).returncode == 0, script


def test_a_call_without_a_chunk_or_a_mode_says_what_to_do(tmp_path):
    out = run("stash", tmp_path / "nothing", tmp_path / "stash", tmp_path)
    assert out.returncode == 1 and "make gpu-long-carry" in out.stdout
    out = run("train", tmp_path / "nothing", tmp_path / "stash", tmp_path)
    assert out.returncode == 2 and "usage" in out.stdout


def test_run_stops_before_any_stage_when_a_chunk_is_missing_or_corrupt(tmp_path):
    carry = chunks(tmp_path, {"chunk.00": b"a" * 100, "chunk.01": b"b" * 100})
    (carry / "chunk.00").unlink()  # an earlier call's chunk that never came
    out = run("run", carry, tmp_path / "stash", tmp_path)
    assert out.returncode == 1 and "missing or corrupt chunks" in out.stdout
    assert not (tmp_path / "runs").exists(), "nothing may run on a partial payload"

    (tmp_path / "stash" / "chunk.00").write_bytes(b"a" * 99)  # came, but cut short
    out = run("run", carry, tmp_path / "stash", tmp_path)
    assert out.returncode == 1 and "missing or corrupt chunks" in out.stdout


def test_chunks_stashed_call_by_call_are_all_there_for_the_last_call(tmp_path):
    carry = chunks(tmp_path, {"chunk.00": b"a", "chunk.01": b"b"})
    first = tmp_path / "first"
    first.mkdir()
    (first / "chunk.00").write_bytes(b"a")
    (first / "manifest").write_bytes((carry / "manifest").read_bytes())
    (carry / "chunk.00").unlink()
    assert run("stash", first, tmp_path / "stash", tmp_path).returncode == 0
    out = run("run", carry, tmp_path / "stash", tmp_path)  # both chunks check, then the payload (not a tar) fails
    assert "missing or corrupt" not in out.stdout and "unpacking the payload failed" in out.stdout
    assert sorted(p.name for p in (tmp_path / "stash").glob("chunk.*")) == ["chunk.00", "chunk.01"]
