"""The entry points' command lines (eagle/cli.py): one line for an error, and a setting added
by `+name=value` (Hydra's advice for a misspelt name) refused, naming what was meant."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.models import ROOT


def test_cli_unknown_method_is_one_line(models, tmp_path):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([sys.executable, str(ROOT / "decode.py"), f"target={models / 'target'}",
                           f"paths.runs_dir={tmp_path}", "method=nope"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error:") and "unknown method 'nope'" in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_added_settings_are_the_new_top_level_names():
    from eagle.cli import added_settings

    # static_max_len: null there
    base = {"max_len", "source", "model", "trainer", "static_max_len", "paths"}
    overrides = ["max_len=512", "+maxlen=256", "+model.drafter_config.intermediate_size=48",
                 "+new.a=1", "+new.b={c: 2}", "++forced=3", "+experiment=drafter_test",
                 "+trainer/profiler=simple", "+trainer.profiler.x=1", "+static_max_len=256",
                 "++max_len=128"]
    assert added_settings(base, overrides, groups={"experiment", "trainer"}) == ["maxlen", "new"]
    none = set()
    assert added_settings(base, ["+source.max_samples=3"], groups=none) == []  # in a section
    # deleted, then written anew
    assert added_settings(base, ["~logger", "+logger.csv.x=1"], groups=none) == []
    # interpolated
    assert added_settings(base, ["+root=/x", "paths.runs_dir=${root}/runs"], groups=none) == []


@pytest.mark.parametrize("entry,override,meant", [
    (["decode.py"], "+max_new_token=2", "max_new_tokens"),
    (["train.py"], "+task_nam=x", "task_name"),
    (["-m", "data_gen"], "+maxlen=256", "max_len"),
    (["-m", "data_gen.regenerate"], "+max_new_token=2", None),
    (["-m", "data_gen.distill"], "+sead=1", "seed"),
    (["-m", "data_gen.target"], "+outdir=x", "out_dir")])
def test_every_entry_point_refuses_a_setting_added_by_plus(tmp_path, entry, override, meant):
    """Hydra's advice for a misspelt name (`+name=value`) adds a key nothing reads: the run
    would go on with the default; every entry point stops first, naming what was meant."""
    script = [str(ROOT / entry[0])] if entry[0].endswith(".py") else entry
    proc = subprocess.run([sys.executable, *script, override], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "HYDRA_FULL_ERROR": "0"}, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr
    assert last.startswith("error: ValueError: unknown setting"), proc.stderr
    assert override.strip("+").split("=")[0] in last
    assert meant is None or f"did you mean '{meant}'" in last
