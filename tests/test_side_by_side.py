"""scripts/side_by_side.py: the demo's drafter and draft LM train side by side; the Makefile's stages
that run them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_makefiles_stages_say_how_long_they_took():
    """The demo's stages print their time (`took`), skipped ones say why, and a failing one stops
    the demo; also when a stage runs side by side with another."""
    recipe = "\n\t".join([
        "probe:",
        "$(call stage,a stage,false,true)",
        "$(call stage,a finished stage,true,false)",
        "@$(call timed_sh,a command,echo hi)",
        "@$(PYTHON) $(SCRIPT) one '$(call stage_sh,side one,false,true)' two '$(call stage_sh,side two,false,true)'",
        "@$(call timed_sh,a failing command,false)",
        "@echo not reached",
    ])
    out = subprocess.run(["make", "-s", "-C", str(ROOT), "--eval", recipe, "probe", f"PYTHON={sys.executable}",
                          f"SCRIPT={SCRIPT}"], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    took = re.compile(r"done in \d+ min \d+ s$")  # any time: the machine may be busy

    def timed(prefix: str) -> bool:
        return any(line.startswith(prefix + ": ") and took.search(line) for line in lines)

    assert out.returncode != 0 and "not reached" not in lines
    assert timed("[probe] a stage") and timed("[probe] a command") and lines[lines.index("[probe] a command") + 1] == "hi"
    assert "[probe] a finished stage: already done, reusing it (true)" in lines
    assert timed("[one] [probe] side one") and timed("[two] [probe] side two")
    assert "[probe] a failing command" in lines and not timed("[probe] a failing command")


def make_check(check: str, **variables: str) -> bool:
    """Whether a stage check of the Makefile (a shell condition built from its macros) holds."""
    recipe = f"probe:\n\t@{check} && echo yes || echo no"
    out = subprocess.run(["make", "-s", "-C", str(ROOT), "--eval", recipe, "probe",
                          *(f"{k}={v}" for k, v in variables.items())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "yes"


def test_a_tree_is_reused_only_for_its_drafter_vocabulary_and_sizes(tmp_path):
    """The Makefile's tree_done: a tree chosen after its drafter's export, by a search with the
    drafting vocabulary (and candidate sizes) asked for, as machine.json records them."""
    drafter, search = tmp_path / "drafter", tmp_path / "search"
    drafter.mkdir(), search.mkdir()
    (drafter / "train_metrics.json").write_text("{}")
    os.utime(drafter / "train_metrics.json", (1_000_000, 1_000_000))
    (search / "machine.yaml").write_text("paths: []\n")
    (search / "machine.json").write_text('{\n  "searched_with": "draft_vocab=4096 sizes=[3,4,6]",\n  "chosen": "best3"\n}')

    def done(vocab: str, sizes: str = "") -> bool:  # passed as variables, as the Makefile passes its lists
        return make_check(f"$(call tree_done,{search / 'machine.yaml'},{drafter},$(V),$(S))", V=vocab, S=sizes)

    assert done("4096", "[3,4,6]") and done("4096")
    assert not done("4096", "[3,4,6,10]") and not done("1024", "[3,4,6]") and not done("409")
    (drafter / "train_metrics.json").touch()  # the drafter exported again: its tree is chosen again
    assert not done("4096", "[3,4,6]")


def test_the_lookup_tree_is_reused_only_with_its_record(tmp_path):
    """The Makefile's lookup_done: machine_lookup.yaml and the search's record (machine.json, written
    last) both made after the drafter's export, the record naming the lookup tree's dtype; a search
    stopped between the two files, or a record from before the lookup tree, runs the search again."""
    drafter, search = tmp_path / "drafter", tmp_path / "search"
    drafter.mkdir(), search.mkdir()
    (drafter / "train_metrics.json").write_text("{}")
    os.utime(drafter / "train_metrics.json", (1_000_000, 1_000_000))
    (search / "machine_lookup.yaml").write_text("paths: []\n")
    (search / "machine.json").write_text('{"dtypes": {"machine": "float32"}}')  # a record from before

    def done() -> bool:
        return make_check(f"$(call lookup_done,{search / 'machine.yaml'},{drafter})")

    assert not done()
    (search / "machine.json").write_text('{"dtypes": {"machine": "float32", "machine_lookup": "float32"}}')
    assert done()
    os.utime(search / "machine.json", (500_000, 500_000))  # the record older than the drafter
    assert not done()
    (search / "machine.json").touch()
    (search / "machine_lookup.yaml").unlink()
    assert not done()
