"""scripts/side_by_side.py: the demo's drafter and draft LM train side by side."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "side_by_side.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_each_line_is_prefixed_and_a_failure_neither_stops_the_other_nor_passes(tmp_path):
    done = tmp_path / "done"
    out = run("fails", "echo start; exit 3",
              "slow", f"printf 'a\\rb\\n'; echo to stderr >&2; sleep 1; echo end; touch {done}")
    assert out.returncode == 3
    lines = out.stdout.splitlines()
    assert "[fails] start" in lines and "[slow] end" in lines and "[slow] to stderr" in lines
    assert lines.index("[slow] a") < lines.index("[slow] b")  # a progress bar's carriage returns end lines
    assert done.exists()  # the failure did not cut the other command short
    assert "[fails] failed with exit status 3" in out.stderr


def test_success_and_usage():
    assert run("a", "true", "b", "echo ok").returncode == 0
    assert run("odd").returncode == 2
