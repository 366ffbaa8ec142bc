"""scripts/gpu/slim_wheel.py: a carried wheel loses what nothing here imports."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "slim_wheel.py"


def test_the_named_members_and_their_record_rows_go_and_the_rest_is_kept(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    kept = {"pkg/__init__.py": b"x = 1\n", "pkg/lib.so": b"\0" * 4096}
    gone = {"pkg/include/a.h": b"int a;", "pkg/libflight.so": b"\1" * 4096,
            "pkg/tests/test_a.py": b"pass"}
    record = "".join(f"{name},sha256=,{len(data)}\n"
                     for name, data in {**kept, **gone}.items())
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in {**kept, **gone}.items():
            zf.writestr(name, data)
        zf.writestr("pkg-1.0.dist-info/RECORD", record + "pkg-1.0.dist-info/RECORD,,\n")
    patterns = ["pkg/include/*", "pkg/tests/*", "*flight*"]
    out = subprocess.run([sys.executable, str(SCRIPT), str(wheel), *patterns],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert names == {*kept, "pkg-1.0.dist-info/RECORD"}
        assert all(zf.read(name) == data for name, data in kept.items())
        rows = [r.split(",")[0] for r in zf.read("pkg-1.0.dist-info/RECORD").decode().splitlines()]
    assert sorted(rows) == sorted([*kept, "pkg-1.0.dist-info/RECORD"])


def test_without_patterns_it_prints_its_usage_and_fails(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "slim_wheel.py" in out.stderr
