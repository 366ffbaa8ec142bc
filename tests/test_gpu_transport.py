"""scripts/gpu/'s transport: what a GPU machine without a package index lacks comes in one folder
per device call (each under 64 MiB with the repository), stashed call by call and checked
against the manifest before anything runs; the carried wheels install once per machine."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"


def bench(mode: str, carry: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CARRY": str(carry), "STASH": str(tmp / "stash"), "PY": sys.executable,
           "PAYLOAD": str(tmp / "payload"), "OUT": str(tmp / "out"), "RUNS": str(tmp / "runs"),
           "SITE": str(tmp / "site-packages"), "DEVICE": "cpu"}
    return subprocess.run(["bash", str(GPU / "bench.sh"), mode], capture_output=True, text=True,
                          timeout=60, env=env)


def calls(tmp: Path, files: dict[str, dict[str, bytes]]) -> dict[str, Path]:
    """One carry folder per call, `{call: {name: data}}`, each call's folder alone in its own
    CARRY (as on the device), with the manifest of every file in each."""
    manifest = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n"
                       for named in files.values() for n, d in named.items())
    carries = {}
    for call, named in files.items():
        folder = tmp / f"carry{call}" / call
        folder.mkdir(parents=True)
        for name, data in named.items():
            (folder / name).write_bytes(data)
        (folder / "manifest").write_text(manifest)
        carries[call] = folder.parent
    return carries


def empty_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w"):
        pass
    return buf.getvalue()


def test_the_scripts_parse():
    for script in sorted(GPU.glob("*.sh")):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script.name


def test_a_call_without_its_folder_or_a_mode_says_what_to_do(tmp_path):
    out = bench("stash", tmp_path / "nothing", tmp_path)
    assert out.returncode == 1 and "carry.sh" in out.stdout
    out = bench("train", tmp_path / "nothing", tmp_path)
    assert out.returncode == 2 and "usage" in out.stdout


def test_the_timing_call_needs_call_1s_wheels(tmp_path):
    carries = calls(tmp_path, {"1": {"chunk.00": b"a"}})
    out = bench("timing", carries["1"], tmp_path)
    assert out.returncode == 1 and "no wheels.tar" in out.stdout
    assert not (tmp_path / "runs").exists(), "nothing may run without the wheels"


def test_run_stops_before_any_stage_when_a_chunk_is_missing_or_corrupt(tmp_path):
    carries = calls(tmp_path, {"1": {"wheels.tar": empty_tar(), "chunk.00": b"a" * 100},
                               "2": {"chunk.01": b"b" * 100}})
    out = bench("run", carries["2"], tmp_path)  # call 1 never came
    assert out.returncode == 1 and "missing or corrupt chunks" in out.stdout
    assert not (tmp_path / "runs").exists(), "nothing may run on a partial payload"

    assert bench("stash", carries["1"], tmp_path).returncode == 0
    (tmp_path / "stash" / "chunk.00").write_bytes(b"a" * 99)  # came, but cut short
    out = bench("run", carries["2"], tmp_path)
    assert out.returncode == 1 and "missing or corrupt chunks" in out.stdout


def test_chunks_stashed_call_by_call_are_all_there_for_the_last_call(tmp_path):
    carries = calls(tmp_path, {"1": {"wheels.tar": empty_tar(), "chunk.00": b"a"},
                               "2": {"chunk.01": b"b"}})
    assert bench("stash", carries["1"], tmp_path).returncode == 0
    out = bench("run", carries["2"], tmp_path)  # every file checks, then the payload (no tar) fails
    assert "missing or corrupt" not in out.stdout and "unpacking the payload failed" in out.stdout
    stashed = sorted(p.name for p in (tmp_path / "stash").iterdir())
    assert stashed == ["chunk.00", "chunk.01", "manifest", "wheels.tar"]


def test_carry_cuts_the_payload_into_calls_that_each_fit_their_room(tmp_path):
    carry = tmp_path / "carry"
    env = {**os.environ, "PY": sys.executable, "CARRY": str(carry), "DOWNLOAD": "0",
           "CONVERSATIONS": "20", "ROOM_KIB": "16"}
    out = subprocess.run(["bash", str(GPU / "carry.sh")], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    folders = sorted(carry.iterdir(), key=lambda p: int(p.name))
    assert [p.name for p in folders] == [str(i) for i in range(1, len(folders) + 1)]
    assert len(folders) >= 3, "a payload of ~25 KiB in rooms of 16 KiB"
    lines = [line for line in out.stdout.splitlines() if line.strip().startswith("call ")]
    middle = ["stash"] * (len(folders) - 2)
    assert [line.split()[-1] for line in lines] == ["timing", *middle, "run"]
    manifests = {(f / "manifest").read_text() for f in folders}
    assert len(manifests) == 1, "every call carries the same manifest"
    for folder in folders:
        assert sum(p.stat().st_size for p in folder.iterdir() if p.name != "manifest") <= 16 * 1024
    assert (folders[0] / "wheels.tar").exists()
    pieces = sorted(p for f in folders for p in f.glob("chunk.*"))
    payload = tmp_path / "payload.tar"
    payload.write_bytes(b"".join(p.read_bytes() for p in pieces))
    with tarfile.open(payload) as tar:
        conversations = json.loads(lzma.decompress(tar.extractfile("./sharegpt.json.xz").read()))
    assert len(conversations) == 20 and all("messages" in c for c in conversations)


def test_the_carried_wheels_install_once_per_machine(tmp_path):
    wheel = tmp_path / "wheels" / "tinypkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("tinypkg/__init__.py", "VALUE = 7\n")
        info = "tinypkg-1.0.dist-info/"
        zf.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        zf.writestr(info + "WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        zf.writestr(info + "RECORD", "")
    script = (f"OUT={tmp_path} PY={sys.executable} TOTAL=60; collect() {{ :; }}; "
              f"source {GPU / 'common.sh'}; "
              f"install_wheels {wheel}; install_wheels {wheel}; "
              f"{sys.executable} -c 'import tinypkg; print(tinypkg.VALUE)'")
    env = {**os.environ, "SITE": str(tmp_path / "site-packages")}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "installing carried wheels: tinypkg-1.0-py3-none-any.whl" in out.stdout
    assert "no wheels to install" in out.stdout, "the second call installs nothing again"
    assert out.stdout.strip().endswith("7"), "the stages import what was installed"
