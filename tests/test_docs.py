"""Every command the README and the pages of docs/ show runs here, so that a command a reader
copies does not fail on a renamed setting, recipe, target or file:

- each `python decode.py`, `python train.py` and `python -m data_gen...` line composes with the
  real configs (Hydra refuses an unknown key);
- each ```python block executes, on a tiny random target and drafter in place of the demo's;
- each `python -m eagle.pipeline NAME` names a recipe of configs/recipe/, each `make X` a target of
  the Makefile, each other `python -m M` a module and each `python FILE.py` a file with its flags.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess

import pytest

from eagle.pipeline import load_recipe
from helpers.commands import ENTRY_POINTS, first_job
from helpers.configs import compose_config
from helpers.models import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIG_OF = {entry: config for entry, config in ENTRY_POINTS.items() if config}
RECIPES = ROOT / "configs" / "recipe"
# Paths the ```python blocks may name, and what stands for each in the tests.
DEMO_PATHS = ("runs/smollm2/model", "runs/drafter_smollm2/drafter", "configs/tree")


def blocks(lang: str) -> list[tuple[str, str]]:
    """(page name, text) of every fenced block of `lang` in the README and docs/."""
    return [(page.name, block) for page in PAGES
            for block in re.findall(rf"```{lang}\n(.*?)```", page.read_text(), flags=re.S)]


def parse(line: str) -> tuple[str, str, list[str]] | None:
    """(kind, name, arguments) of one shell line, or None for a line that runs nothing we check.
    Kinds: config (an entry point and its overrides), recipe, make, module, script."""
    words = shlex.split(line, comments=True)
    while words and re.match(r"^\w+=", words[0]):  # T=... or FEATURE_ERROR_X=... before a command
        words = words[1:]
    if not words:
        return None
    if words[0] == "make":
        return "make", "", [w for w in words[1:] if "=" not in w and not w.startswith("-")]
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words):  # python -m M, torchrun ... -m M
            module, rest = words[i + 1], words[i + 2:]
            if module == "eagle.pipeline":
                return "recipe", rest[0], rest[1:]
            if module in CONFIG_OF:
                return "config", CONFIG_OF[module], rest
            return "module", module, rest
        if word.endswith(".py"):
            rest = [w for w in words[i + 1:] if w != "-m"]  # train.py -m: a sweep
            if word in CONFIG_OF:
                return "config", CONFIG_OF[word], rest
            return "script", word, rest
    return None


def shell_lines() -> list[tuple[str, str]]:
    """(page, line) of every line of the pages' bash blocks, continuation lines joined, and of every
    `make X` or `python -m eagle.pipeline X` the prose names."""
    lines = [(page, line) for page, block in blocks("bash")
             for line in block.replace("\\\n", " ").splitlines()]
    for page in PAGES:
        spans = re.findall(r"`((?:make|python -m eagle\.pipeline) [a-z][^`]*)`", page.read_text())
        lines += [(page.name, span) for span in spans]
    return lines


def commands(kind: str) -> list[tuple[str, str, list[str]]]:
    """(page, name, arguments) of every command of `kind` the pages show."""
    parsed = [(page, parse(line)) for page, line in shell_lines()]
    return [(page, *p[1:]) for page, p in parsed if p is not None and p[0] == kind]


MAKE_TARGETS = [(page, target) for page, _, targets in commands("make") for target in targets]


def label(value) -> str:
    return value if isinstance(value, str) else " ".join(value)[:60]


def test_the_pages_have_commands_to_check():
    configs = [name for _, name, _ in commands("config")]
    assert configs.count("decode") >= 10 and configs.count("train") >= 4
    assert configs.count("data_gen") >= 2
    assert commands("make") and commands("recipe") and commands("script")
    assert len(blocks("python")) >= 2


@pytest.mark.parametrize("page,name,overrides", commands("config"), ids=label)
def test_each_entry_point_command_composes(page, name, overrides):
    compose_config(name, first_job(overrides))  # a sweep: its first job stands for the others


@pytest.mark.parametrize("page,name,args", commands("recipe"), ids=label)
def test_each_recipe_exists(page, name, args):
    known = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    assert name in known, f"{page}: recipe {name!r} is not in configs/recipe/ ({known})"
    settings = dict(a.split("=", 1) for a in args if "=" in a)
    load_recipe(name, settings, root=ROOT)  # its variables are the recipe's


@pytest.mark.parametrize("page,target", MAKE_TARGETS, ids=label)
def test_each_make_target_exists(page, target):
    # make itself says (targets may come from variables); -n runs nothing
    out = subprocess.run(["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True)
    assert out.returncode == 0, f"{page}: make {target} is not a target of the Makefile"


@pytest.mark.parametrize("page,name,args", commands("module"), ids=label)
def test_each_module_exists(page, name, args):
    assert importlib.util.find_spec(name) is not None, f"{page}: no module {name}"


@pytest.mark.parametrize("page,name,args", commands("script"), ids=label)
def test_each_script_exists_with_its_flags(page, name, args):
    script = ROOT / name
    assert script.is_file(), f"{page}: no file {name}"
    source = script.read_text()
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert f'"{flag}"' in source, f"{page}: {name} has no option {flag}"


@pytest.fixture(scope="module")
def demo_paths(tmp_path_factory) -> dict[str, str]:
    """A tiny random target and drafter, standing for the demo's in the pages' Python blocks."""
    from eagle.models.checkpoint import save_drafter
    from eagle.models.drafter import EagleDrafter
    from eagle.target import load_target
    from helpers.models import save_tiny_target, small_tokenizer

    tmp = tmp_path_factory.mktemp("docs")
    target_dir = save_tiny_target(tmp / "target", small_tokenizer(), num_hidden_layers=2)
    target, tokenizer = load_target(target_dir)
    drafter = save_drafter(EagleDrafter.random(target, tokenizer, str(target_dir)), tmp / "drafter")
    return dict(zip(DEMO_PATHS, (str(target_dir), str(drafter), str(ROOT / "configs" / "tree"))))


@pytest.mark.parametrize("page,block", blocks("python"), ids=lambda x: x[:20].splitlines()[0])
def test_each_python_block_runs(page, block, demo_paths):
    for path, tiny in demo_paths.items():
        block = block.replace(f'"{path}"', repr(tiny))
    unknown = re.findall(r"[\"'](runs/[^\"']*)", block)
    assert not unknown, f"{page}: a Python block names {unknown}; the test has no stand-in for it"
    exec(compile(block, f"{page} (a Python block)", "exec"), {})


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", [*PAGES, ROOT / "LOG.md"], ids=lambda p: p.name)
def test_each_link_leads_somewhere(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"^\w+:", target):
            continue  # a web address
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: the link {target} leads nowhere"
        if fragment and file.suffix == ".md" and file.exists():
            headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
            assert fragment in {anchor(h) for h in headings}, f"{page.name}: no section #{fragment}"


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: p.name)
def test_each_docs_page_opens_with_its_question(page):
    assert any(line.rstrip().endswith("?") for line in page.read_text().splitlines()[:3]), page.name


def test_the_readme_fits_in_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
