"""eagle.pipeline: recipes load and compose, stages are reused only when their command, inputs
and output are as recorded, and a failing stage stops the recipe with its name."""

from __future__ import annotations

import io
import re
import sys
import textwrap
from pathlib import Path

import pytest

from eagle.pipeline import Pipeline, RecipeError, StageFailed, load_recipe, main
from helpers.commands import entry_commands, first_job
from helpers.configs import compose_config
from helpers.models import ROOT

RECIPES = sorted(p.stem for p in (ROOT / "configs" / "recipe").glob("*.yaml"))
# a stage's command: writes its second argument into the file of its first, and counts its runs
WRITE = "${python} write.py"
WRITER = """import pathlib, sys
path = pathlib.Path(sys.argv[1])
path.write_text(sys.argv[2])
count = pathlib.Path(sys.argv[1] + ".runs")
count.write_text((count.read_text() if count.exists() else "") + "x")
pathlib.Path(sys.argv[1] + ".exe").write_text(sys.executable)
"""


def recipe(root: Path, name: str, body: str) -> None:
    (root / "configs" / "recipe").mkdir(parents=True, exist_ok=True)
    (root / "configs" / "recipe" / f"{name}.yaml").write_text(textwrap.dedent(body))
    (root / "write.py").write_text(WRITER)


def runs(root: Path, name: str) -> int:
    path = root / f"{name}.runs"
    return len(path.read_text()) if path.exists() else 0


def run(root: Path, name: str = "r", **overrides: str) -> str:
    out = io.StringIO()
    Pipeline(load_recipe(name, overrides, root=root), root=root, out=out).run()
    return out.getvalue()


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """a -> b -> report (always), with a variable that reaches a's output."""
    recipe(tmp_path, "r", f"""
        vars:
          value: one  # what stage a writes
        stages:
          - {{name: a, run: '{WRITE} a.txt ${{value}}', out: [a.txt]}}
          - {{name: b, after: [a], run: '{WRITE} b.txt b', out: [b.txt]}}
          - {{name: report, after: [b], always: true, run: '{WRITE} report.txt r'}}
        """)
    return tmp_path


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_loads_and_its_commands_compose(name):
    """Each recipe validates (stages, `after`, variables), and every entry-point command it
    runs composes with the real configs: a renamed setting fails here, not an hour in."""
    stages = load_recipe(name, root=ROOT).stages
    assert stages
    for stage in stages:
        for config, overrides in entry_commands(stage.run):
            compose_config(config, first_job(overrides))


def references(stages) -> dict[str, set[str]]:
    """What names a stage's output in another's command: its folder, where no other stage
    writes into it, else the file without its sidecar suffix (`x.jsonl` for `x.jsonl.json`)."""
    owners: dict[str, set[str]] = {}
    for stage in stages:
        for out in stage.out:
            owners.setdefault(str(Path(out).parent), set()).add(stage.name)
    return {s.name: {str(Path(o).parent) if len(owners[str(Path(o).parent)]) == 1
                     else str(Path(o).with_suffix("")) for o in s.out} for s in stages}


@pytest.mark.parametrize("name", RECIPES)
def test_a_stage_names_every_stage_whose_output_it_reads(name):
    """A stage whose command names another stage's output builds on that stage (`after`,
    directly or through others): a rebuilt input then rebuilds what reads it."""
    stages = load_recipe(name, root=ROOT).stages
    refs, closure = references(stages), {}
    for stage in stages:
        closure[stage.name] = set(stage.after).union(*(closure[a] for a in stage.after))
        for other in stages:
            if other is not stage and any(re.search(rf"{re.escape(r)}(/|\s|$|%|,|\])", stage.run)
                                          for r in refs[other.name]):
                assert other.name in closure[stage.name], (name, stage.name, other.name)


def test_the_demo_searches_its_tree_again_for_another_vocabulary_or_sizes():
    """The tree's record holds the search's command: another drafting vocabulary or other
    candidate sizes search again, and so does a retrained drafter (an input); the lookup tree and
    the search's record (machine.json, written last) are outputs that must all be there."""
    def tree(**settings: str):
        return {s.name: s for s in load_recipe("demo", settings, root=ROOT).stages}["tree"]

    base = tree()
    assert "drafter" in base.after and "eagle.draft_vocab=4096" in base.run
    assert "eagle.draft_vocab=1024" in tree(vocab="1024").run
    assert "tree_search.sizes=[3,4]" in tree(tree_sizes="[3, 4]").run  # a list, as in the YAML
    outputs = [Path(o).name for o in base.out]
    assert outputs == ["machine.yaml", "machine_lookup.yaml", "machine.json"]


def test_recipes_that_build_the_same_output_build_it_the_same_way():
    """Two stages writing one sidecar share one record only when they are the same stage (name,
    command, inputs); otherwise each recipe would rebuild what the other built."""
    seen: dict[str, tuple] = {}
    for name in RECIPES:
        for stage in load_recipe(name, root=ROOT).stages:
            for out in stage.out:
                same = (stage.name, stage.run, tuple(stage.out), tuple(stage.after))
                assert seen.setdefault(out, same) == same, (name, stage.name, out)


def test_stages_run_once_and_are_reused_until_something_they_read_changes(chain):
    first = run(chain)
    assert (runs(chain, "a.txt"), runs(chain, "b.txt"), runs(chain, "report.txt")) == (1, 1, 1)
    assert re.search(r"\[r\] a: done in \d+m\d\ds", first)
    second = run(chain)
    assert "1/3 a: already done, reusing it (a.txt)" in second
    assert (runs(chain, "a.txt"), runs(chain, "b.txt"), runs(chain, "report.txt")) == (1, 1, 2)

    third = run(chain, value="two")  # another setting: a again, and b, which reads a's output
    assert "1/3 a: a (its settings or inputs changed)" in third
    assert (runs(chain, "a.txt"), runs(chain, "b.txt")) == (2, 2)

    run(chain, value="two")
    assert (runs(chain, "a.txt"), runs(chain, "b.txt")) == (2, 2)
    (chain / "b.txt").write_text("edited by hand")  # an output not as recorded: built again
    run(chain, value="two")
    assert (runs(chain, "a.txt"), runs(chain, "b.txt")) == (2, 3)
    (chain / "a.txt").unlink()  # deleted: built again; the same content leaves b reused
    run(chain, value="two")
    assert (runs(chain, "a.txt"), runs(chain, "b.txt")) == (3, 3)


def test_python_is_the_interpreter_that_runs_the_pipeline(tmp_path):
    """A recipe says `python`, as a user types it; the stage runs this interpreter (a fresh
    clone's .venv), not whatever `python` the PATH holds."""
    recipe(tmp_path, "r", """
        stages:
          - {name: a, always: true, run: python write.py a.txt a}
          - {name: b, always: true, run: true && python write.py b.txt b}
        """)
    run(tmp_path)
    for name in ("a.txt", "b.txt"):
        assert (tmp_path / f"{name}.exe").read_text() == sys.executable


def test_the_record_holds_no_machine_or_interpreter(chain):
    run(chain)
    records = list((chain / "runs" / ".pipeline").glob("a-*.json"))
    assert len(records) == 1 and "${python}" in records[0].read_text()
    assert sys.executable not in records[0].read_text()


def test_a_failing_stage_stops_the_recipe_and_is_not_recorded(tmp_path):
    recipe(tmp_path, "r", f"""
        stages:
          - {{name: a, run: 'echo trained; exit 3', out: [a.txt]}}
          - {{name: b, after: [a], run: '{WRITE} b.txt b', out: [b.txt]}}
        """)
    with pytest.raises(
        StageFailed,
        match=r"stage a failed \(exit status 3\) after .*finished stages "
        "are reused",
    ):
        run(tmp_path)
    assert runs(tmp_path, "b.txt") == 0 and not (tmp_path / "runs" / ".pipeline").exists()


def test_a_stage_that_writes_nothing_or_runs_too_long_stops_the_recipe(tmp_path):
    recipe(
        tmp_path,
        "r",
        """
        stages:
          - {name: quiet, run: 'true', out: [never.json]}
        """,
    )
    with pytest.raises(StageFailed, match="stage quiet ended without writing never.json"):
        run(tmp_path)
    recipe(
        tmp_path,
        "slow",
        """
        stages:
          - {name: slow, run: 'sleep 30', timeout: 0.5, out: [never.json]}
        """,
    )
    with pytest.raises(StageFailed, match="stage slow passed its time limit of 0.5 s"):
        run(tmp_path, "slow")


def test_a_time_limit_stops_the_commands_children_too(tmp_path):
    """A compound command's shell and what it started: nothing of a stopped stage runs on."""
    recipe(tmp_path, "r", """
        stages:
          - name: slow
            timeout: 1
            out: [never.json]
            run: "sleep 60 & echo $! > pid; wait; echo after"
        """)
    with pytest.raises(StageFailed, match="passed its time limit of 1 s"):
        run(tmp_path)
    status = Path(f"/proc/{(tmp_path / 'pid').read_text().strip()}/status")
    assert not status.exists() or "zombie" in status.read_text()


def test_stages_together_run_side_by_side_and_a_failure_stops_after_both(tmp_path):
    recipe(
        tmp_path,
        "r",
        f"""
        stages:
          - {{name: fails, together: t, run: 'echo start; exit 3', out: [f.txt]}}
          - name: slow
            together: t
            run: printf 'a\\rb\\n'; echo to stderr >&2; sleep 1; {WRITE} s.txt s
            out: [s.txt]
          - {{name: after, after: [slow], run: '{WRITE} x.txt x', out: [x.txt]}}
        """,
    )
    out = io.StringIO()
    with pytest.raises(StageFailed, match="stage fails failed"):
        Pipeline(load_recipe("r", root=tmp_path), root=tmp_path, out=out).run()
    lines = out.getvalue().splitlines()
    assert "[r] [fails] start" in lines and "[r] [slow] to stderr" in lines
    assert lines.index("[r] [slow] a") < lines.index("[r] [slow] b")  # a bar's \r ends a line
    assert runs(tmp_path, "s.txt") == 1 and runs(tmp_path, "x.txt") == 0  # not cut short


def test_extends_takes_the_stages_a_recipe_needs_without_its_measurements(chain):
    recipe(
        chain,
        "child",
        f"""
        extends: r:a
        stages:
          - {{name: c, after: [a], run: '{WRITE} c.txt ${{value}}', out: [c.txt]}}
        """,
    )
    assert [s.name for s in load_recipe("child", root=chain).stages] == ["a", "c"]
    recipe(chain, "whole", "extends: r\n")
    assert [s.name for s in load_recipe("whole", root=chain).stages] == ["a", "b"]
    run(chain, "child")
    assert (runs(chain, "a.txt"), runs(chain, "c.txt")) == (1, 1)
    run(chain)  # the parent reuses the stage the child built: one record per output
    assert runs(chain, "a.txt") == 1


@pytest.mark.parametrize(
    "body,message",
    [
        (
            "vars: {v: 1}\nstages:\n  - {name: a, run: 'echo ${w}', out: [a]}\n",
            r"unknown variable \$\{w\}",
        ),
        ("stages:\n  - {name: a, run: x, out: [a], after: [b]}\n", "'after' names \\['b'\\]"),
        ("stages:\n  - {name: a, run: x}\n", "needs `out`"),
        (
            "stages:\n  - {name: a, run: x, out: [a], colour: red}\n",
            r"unknown key\(s\) \['colour'\]",
        ),
        (
            "stages:\n  - {name: a, run: x, out: [a]}\n  - {name: a, run: y, out: [b]}\n",
            "two stages",
        ),
        ("extends: r\n", "in a circle"),
    ],
)
def test_a_recipe_written_wrong_is_named(tmp_path, body, message):
    recipe(tmp_path, "r", body)
    with pytest.raises(RecipeError, match=message):
        load_recipe("r", root=tmp_path)


def test_unknown_recipes_and_variables_are_named(chain):
    with pytest.raises(RecipeError, match=r"no recipe 'nope' .*known: r\b"):
        load_recipe("nope", root=chain)
    with pytest.raises(RecipeError, match="has no variable vlaue .*its variables: value"):
        load_recipe("r", {"vlaue": "x"}, root=chain)


def test_a_missing_requirement_stops_before_any_stage(tmp_path):
    recipe(
        tmp_path,
        "r",
        f"""
        requires:
          - {{path: runs/drafter/config.json, hint: "run 'make demo' first"}}
        stages:
          - {{name: a, always: true, run: '{WRITE} a.txt a'}}
        """,
    )
    with pytest.raises(
        StageFailed, match="runs/drafter/config.json is missing: run 'make demo' first"
    ):
        run(tmp_path)
    assert runs(tmp_path, "a.txt") == 0


def test_the_command_line(chain, monkeypatch, capsys):
    monkeypatch.chdir(chain)
    assert main(["r", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1/3 a [to run]" in out and "3/3 report [always]" in out
    assert (
        main(["r", "vlaue=x"]) == 1 and "error: recipe r has no variable" in capsys.readouterr().err
    )
    assert main([]) == 2 and main(["r", "novalue"]) == 2
    assert main(["r"]) == 0 and main(["r", "--dry-run"]) == 0
    assert "1/3 a [done]" in capsys.readouterr().out
