"""scripts/gpu/bench.sh smoke: every stage of the GPU lease's calls runs on the CPU at tiny sizes,
and each call brings back what the lease holder reads (at most 8 files a call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~3 minutes on 2 cores: SmolLM2 converted (or reused), trained, benchmarked
def test_the_smoke_run_brings_back_the_drafter_the_benchmark_and_the_projection(tmp_path):
    converted = ROOT / "runs" / "smollm2" / "model"  # make demo's, reused when there
    target = converted if (converted / "eagle_target.json").exists() else tmp_path / "smollm2"
    env = {**os.environ, "PY": sys.executable, "SMOKE_DIR": str(tmp_path / "smoke"),
           "TARGET": str(target)}
    out = subprocess.run(["bash", "scripts/gpu/bench.sh", "smoke"], capture_output=True,
                         text=True, timeout=1200, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    outs = sorted((tmp_path / "smoke").glob("out*"))
    assert len(outs) == 2, "the timing call and the run call bring results (a stash call none)"
    first, last = outs[0], outs[-1]
    assert {p.name for p in first.iterdir()} == {"pipeline.log", "timing.json", "timing.md"}
    timed = json.loads((first / "timing.json").read_text())["methods"]
    assert set(timed) == {"vanilla:static", "eagle:static"}
    names = {p.name for p in last.iterdir()}
    assert {"pipeline.log", "results.json", "results.md", "timing.json"} <= names
    assert len(names) <= 8
    runs = json.loads((last / "results.json").read_text())["runs"]
    assert {(r["eval_set"], r["temperature"]) for r in runs} == {("mtbench", 0.0), ("mtbench", 1.0)}
    assert all({"vanilla:static", "eagle:static"} <= set(r["methods"]) for r in runs)
    projection = json.loads((last / "timing.json").read_text())["projection"]
    assert len(projection) == 2 and "Projection" in (last / "results.md").read_text()
    pieces = sorted(last.glob("drafter.tar.*"))
    (tmp_path / "drafter.tar").write_bytes(b"".join(p.read_bytes() for p in pieces))
    with tarfile.open(tmp_path / "drafter.tar") as tar:
        assert "drafter_smollm2_gpu/drafter/config.json" in tar.getnames()
    assert "failed stages: none" in (last / "pipeline.log").read_text()
