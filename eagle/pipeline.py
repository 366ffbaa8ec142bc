"""Recipes: a run's stages as data (configs/recipe/*.yaml), run in order by one pipeline.

    python -m eagle.pipeline demo                # configs/recipe/demo.yaml, from the repo root
    python -m eagle.pipeline demo --dry-run      # its stages, and which are done
    python -m eagle.pipeline demo convs=2000     # a recipe variable set for this run

A recipe holds `vars` (its numbers, each commented) and `stages`. A stage is a shell command
that builds an artifact from the artifacts of the stages it names in `after`; `out` names the
sidecar files the command writes last. Each stage runs as its own process, the way a user runs
it by hand: its output is what the user would see, and no state leaks between stages.

A stage is reused when the pipeline's record of it (a sidecar written through
`eagle.artifacts`) holds the same command, the same inputs (the contents of the `after`
stages' sidecars) and an output still as recorded. So another setting, an input built again
(a drafter retrained, a dump of another target) or an output deleted or rebuilt by hand runs
the stage again; and the command itself refuses a folder built with other settings where
reusing it would be wrong. No file times, no parsing of other stages' reports.

`always: true` marks a measurement (a benchmark): it runs every time and builds on nothing that
skips it. `extends: demo` runs the demo's stages first, without its measurements. Stages that
share a `together` group run side by side, each line prefixed with the stage's name; each runs
to its end whatever the other does. A stage that fails (a time limit hit, a drafter no better
than its baseline, a bad setting) stops the recipe with its name and what to do.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eagle.artifacts import Artifact
from eagle.progress import clock

RECIPES = Path("configs") / "recipe"
RECORDS = Path("runs") / ".pipeline"  # the stage records (git-ignored with runs/)
VAR = re.compile(r"\$\{(\w+)\}")
PYTHON_WORD = re.compile(r"(^|[;&|]\s*)python(?=\s)")  # `python` where a command starts
# filled in when a stage runs, never recorded: the same recipe on another machine or clone is
# the same stage
BUILTINS = ("python", "half_cores", "root")
STAGE_KEYS = {"name", "about", "run", "out", "after", "always", "together", "env", "timeout"}


class RecipeError(ValueError):
    """A recipe that cannot run as written: a missing key, an unknown variable or stage."""


class StageFailed(RuntimeError):
    """A stage's command exited non-zero or passed its time limit."""


@dataclass
class Stage:
    name: str
    about: str
    run: str  # the command, recipe variables filled in (builtins still ${...})
    out: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    always: bool = False
    together: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None  # seconds; past it the command is stopped and the recipe too


@dataclass
class Recipe:
    name: str
    about: str
    stages: list[Stage]
    requires: list[dict[str, str]] = field(default_factory=list)  # {path, hint}: checked first


def fill(text: str, values: Mapping[str, str], keep: Sequence[str] = ()) -> str:
    """`text` with each `${name}` replaced by its value (values may name other values);
    the names in `keep` are left as they are."""
    def one(match: re.Match) -> str:
        name = match.group(1)
        if name in keep:
            return match.group(0)
        if name not in values:
            raise RecipeError(f"unknown variable ${{{name}}} (known: {', '.join(sorted(values))})")
        return fill(str(values[name]), values, keep)

    return VAR.sub(one, text)


def recipe_path(name: str, root: Path = Path(".")) -> Path:
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    path = root / RECIPES / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (root / RECIPES).glob("*.yaml"))
        raise RecipeError(
            f"no recipe {name!r} in {root / RECIPES} (known: {', '.join(known) or 'none'}"
            "; run from the repository root)"
        )
    return path


def _raw(name: str, root: Path, seen: tuple[str, ...] = ()) -> tuple[dict, list[dict], dict]:
    """A recipe's variables and stage entries, those of the recipes it extends first (without
    their `always` stages; a stage two of them share is kept once), and its own YAML."""
    if name in seen:
        raise RecipeError(f"recipes extend each other in a circle: {' -> '.join((*seen, name))}")
    data = yaml.safe_load(recipe_path(name, root).read_text()) or {}
    unknown = set(data) - {"about", "extends", "vars", "stages", "requires"}
    if unknown:
        raise RecipeError(f"recipe {name}: unknown key(s) {sorted(unknown)}")
    variables: dict = {}
    stages: dict[str, dict] = {}
    parents = data.get("extends") or []
    for parent in [parents] if isinstance(parents, str) else parents:
        parent, _, last = parent.partition(":")  # "demo:features": what the features need
        their_vars, their_stages, _ = _raw(parent, root, (*seen, name))
        variables.update(their_vars)
        if last:
            their_stages = needed_for(last, their_stages, parent)
        for entry in their_stages:
            if entry.get("always"):
                continue
            if stages.setdefault(entry["name"], entry) != entry:
                raise RecipeError(
                    f"recipe {name}: the recipes it extends define stage "
                    f"{entry['name']!r} differently"
                )
    variables.update(data.get("vars") or {})
    return variables, list(stages.values()) + list(data.get("stages") or []), data


def needed_for(last: str, entries: list[dict], recipe: str) -> list[dict]:
    """The stage `last` of `entries` and every stage it builds on, in order."""
    by_name = {e["name"]: e for e in entries}
    if last not in by_name:
        raise RecipeError(
            f"recipe {recipe} has no stage {last!r} (its stages: {', '.join(by_name)})"
        )
    keep, todo = set(), [last]
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo += by_name[name].get("after", [])
    return [e for e in entries if e["name"] in keep]


def load_recipe(name: str, overrides: Mapping[str, str] = (), root: Path = Path(".")) -> Recipe:
    """The recipe `name` (configs/recipe/<name>.yaml or a path) with `overrides` of its
    variables, validated: every stage named once, every `after` an earlier stage, every
    variable known."""
    variables, entries, data = _raw(name, root)
    overrides = dict(overrides)
    unknown = set(overrides) - set(variables)
    if unknown:
        raise RecipeError(
            f"recipe {name} has no variable {', '.join(sorted(unknown))} "
            f"(its variables: {', '.join(sorted(variables))})"
        )
    # a value given on the command line reads as the recipe's own would (YAML): `sizes=[3,4]` is a
    # list; a list is a comma list, as Hydra's overrides write one
    given = {k: yaml.safe_load(v) if isinstance(v, str) and v else v for k, v in overrides.items()}
    variables = {
        k: ",".join(map(str, v)) if isinstance(v, list) else str(v)
        for k, v in {**variables, **given}.items()
    }
    clash = set(variables) & set(BUILTINS)
    if clash:
        raise RecipeError(f"recipe {name}: {sorted(clash)} are filled in by the pipeline")
    stages: list[Stage] = []
    for entry in entries:
        stages.append(_stage(entry, variables, [s.name for s in stages], name))
    requires = [
        {"path": fill(r["path"], variables), "hint": fill(r.get("hint", ""), variables)}
        for r in data.get("requires") or []
    ]
    return Recipe(Path(name).stem, fill(data.get("about", ""), variables), stages, requires)


def _stage(entry: dict, variables: Mapping[str, str], before: list[str], recipe: str) -> Stage:
    """One stage entry of `recipe`, validated; `before` names the stages before it."""
    if not isinstance(entry, dict) or not {"name", "run"} <= set(entry):
        raise RecipeError(f"recipe {recipe}: a stage needs a name and a command (run): {entry!r}")
    where = f"recipe {recipe}, stage {entry['name']}"
    if set(entry) - STAGE_KEYS:
        raise RecipeError(f"{where}: unknown key(s) {sorted(set(entry) - STAGE_KEYS)}")
    if entry["name"] in before:
        raise RecipeError(f"recipe {recipe}: two stages are named {entry['name']!r}")
    missing = [a for a in entry.get("after", []) if a not in before]
    if missing:
        raise RecipeError(f"{where}: 'after' names {missing}, which no earlier stage is")
    env = entry.get("env") or {}
    stage = Stage(
        name=entry["name"],
        about=fill(entry.get("about", entry["name"]), variables),
        run=fill(" ".join(str(entry["run"]).split()), variables, keep=BUILTINS),
        out=[fill(o, variables) for o in entry.get("out", [])],
        after=list(entry.get("after", [])),
        always=bool(entry.get("always", False)),
        together=entry.get("together"),
        env={k: fill(str(v), variables, keep=BUILTINS) for k, v in env.items()},
        timeout=entry.get("timeout"),
    )
    if not stage.out and not stage.always:
        raise RecipeError(f"{where}: a stage that is not `always` needs `out` (the sidecars it "
                          "writes), to know when it is done")
    return stage


def fingerprint(paths: Sequence[str], root: Path) -> dict[str, str] | None:
    """The sha256 of each file of `paths`, or None when one is missing."""
    out = {}
    for name in paths:
        path = root / name
        if not path.is_file():
            return None
        out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


class Pipeline:
    """Runs a recipe's stages in order from `root` (the repository), recording finished ones
    under `records` (relative to `root`)."""

    def __init__(self, recipe: Recipe, root: Path = Path("."), records: Path = RECORDS,
                 python: str = sys.executable, out=None):
        self.recipe, self.python = recipe, python
        self.root, self.records = Path(root), Path(records)
        self.stdout = out or sys.stdout
        self.lock = threading.Lock()

    def say(self, text: str) -> None:
        with self.lock:
            self.stdout.write(f"[{self.recipe.name}] {text}\n")
            self.stdout.flush()

    def record(self, stage: Stage) -> Artifact:
        """The stage's record: its command and the sidecars of its inputs. Keyed by its
        outputs, so recipes that build the same artifact share one record."""
        inputs = {}
        for name in stage.after:
            before = next(s for s in self.recipe.stages if s.name == name)
            inputs[name] = fingerprint(before.out, self.root) if before.out else None
        key = hashlib.sha1("\n".join(stage.out).encode()).hexdigest()[:12]
        params = {"command": stage.run, "inputs": inputs}
        return Artifact(self.root / self.records, f"{stage.name}-{key}.json", params,
                        f"stage {stage.name}")

    def state(self, stage: Stage) -> str:
        """One of "always", "done", "changed" (its record holds other settings or inputs) and
        "to run"."""
        if stage.always:
            return "always"
        record = self.record(stage)
        state = record.state()
        if state == "stale":
            return "changed"
        out = fingerprint(stage.out, self.root)
        if state == "complete" and out is not None and record.meta().get("output") == out:
            return "done"
        return "to run"

    def builtins(self) -> dict[str, str]:
        return {
            "python": shlex.quote(self.python),
            "root": str(self.root.resolve()),
            "half_cores": str(max(1, usable_cores() // 2)),
        }

    def command(self, stage: Stage) -> str:
        """The stage's shell command, builtins filled in; a command word `python` is this
        interpreter (the recipes say `python`, as a user would type it)."""
        python = self.builtins()["python"]
        return PYTHON_WORD.sub(lambda m: m.group(1) + python, fill(stage.run, self.builtins()))

    def check_requires(self) -> None:
        for req in self.recipe.requires:
            if not (self.root / req["path"]).exists():
                raise StageFailed(f"{req['path']} is missing: {req['hint']}")

    def dry_run(self) -> None:
        self.say(f"{self.recipe.about.strip()}" if self.recipe.about else "stages:")
        for i, stage in enumerate(self.recipe.stages, 1):
            self.say(
                f"{i}/{len(self.recipe.stages)} {stage.name} [{self.state(stage)}]: {stage.about}"
            )
            self.say(f"    {self.command(stage)}")

    def run(self) -> None:
        """Every stage in order; raises `StageFailed` naming the first that failed."""
        start = time.monotonic()
        self.check_requires()
        first = 1
        # consecutive stages of one `together` group run side by side, any other alone
        for _, group in itertools.groupby(self.recipe.stages, key=lambda s: s.together or id(s)):
            group = list(group)
            self.run_group(group, first)
            first += len(group)
        self.say(f"finished in {clock(time.monotonic() - start)}")

    def run_group(self, group: list[Stage], first: int) -> None:
        todo = []
        for n, stage in enumerate(group, first):
            state = self.state(stage)
            where = f"{n}/{len(self.recipe.stages)} {stage.name}"
            if state == "done":
                self.say(f"{where}: already done, reusing it ({', '.join(stage.out)})")
                continue
            why = " (its settings or inputs changed)" if state == "changed" else ""
            self.say(f"{where}: {stage.about}{why}")
            todo.append(stage)
        if len(todo) == 1:
            self.run_stage(todo[0], prefix=None)
        elif todo:
            errors: list[StageFailed] = []
            threads = [threading.Thread(target=self._run_collecting, args=(s, errors))
                       for s in todo]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]

    def _run_collecting(self, stage: Stage, errors: list) -> None:
        try:
            self.run_stage(stage, prefix=stage.name)
        except StageFailed as err:
            errors.append(err)

    def run_stage(self, stage: Stage, prefix: str | None) -> None:
        """Run one stage's command (its lines prefixed when `prefix` is given, since it runs
        beside another), then record it."""
        record = self.record(stage)  # inputs as they were when the stage started
        command = self.command(stage)
        self.say(f"  $ {command}")
        env = {**os.environ, **{k: fill(v, self.builtins()) for k, v in stage.env.items()}}
        start = time.monotonic()
        pipe = subprocess.PIPE if prefix else None  # else the stage writes to our output
        # a session of its own: a time limit then stops the command's children too
        proc = subprocess.Popen(command, shell=True, cwd=self.root, env=env, stdout=pipe,
                                stderr=subprocess.STDOUT if prefix else None,
                                start_new_session=True)
        relay = None
        if prefix:
            relay = threading.Thread(target=self._relay, args=(prefix, proc.stdout))
            relay.start()
        try:
            code = proc.wait(timeout=stage.timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            code = None
        except BaseException:  # Ctrl-C reaches only us now: the command stops as it would have
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait()
            raise
        if relay:
            relay.join()
        took = clock(time.monotonic() - start)
        if code != 0:
            what = (f"failed (exit status {code})" if code is not None
                    else f"passed its time limit of {stage.timeout:g} s")
            raise StageFailed(f"stage {stage.name} {what} after {took}; the stages after it did "
                              "not run. Fix what it printed above and run the recipe again: "
                              "finished stages are reused")
        if not stage.always:
            out = fingerprint(stage.out, self.root)
            if out is None:
                missing = [o for o in stage.out if not (self.root / o).is_file()]
                raise StageFailed(f"stage {stage.name} ended without writing {', '.join(missing)}")
            record.write(output=out, seconds=round(time.monotonic() - start, 1))
        self.say(f"{stage.name}: done in {took}")

    def _relay(self, name: str, stream) -> None:
        """Copy a stage's output line by line with its name in front; the carriage returns of a
        progress bar end a line too, so its updates stay readable."""
        buf = b""
        while chunk := stream.read1(4096):
            buf += chunk
            *lines, buf = buf.replace(b"\r", b"\n").split(b"\n")
            for line in lines:
                if line.strip():
                    self.say(f"[{name}] {line.decode(errors='replace')}")
        if buf.strip():
            self.say(f"[{name}] {buf.decode(errors='replace')}")


def stop_group(proc: subprocess.Popen, patience_s: float = 10.0) -> None:
    """Kill a command's whole process group and wait until none of it runs (a kill lands a
    moment after it is sent; a process that outlives the stage would go on writing)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def usable_cores() -> int:
    """The cores this process may run on (a container or `taskset` may allow fewer than exist)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    dry = "--dry-run" in argv
    args = [a for a in argv if a != "--dry-run"]
    if not args or args[0].startswith("-") or any("=" not in a for a in args[1:]):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(args[0], dict(a.split("=", 1) for a in args[1:]))
        pipeline = Pipeline(recipe)
        pipeline.dry_run() if dry else pipeline.run()
    except (RecipeError, StageFailed) as err:
        print(f"[{Path(args[0]).stem}] error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
