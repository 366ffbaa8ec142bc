"""The package's layers import one way, the runtime stays light, the EAGLE core reads without
the optional kernels, and the test modules share helpers instead of importing each other."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.models import ROOT

# Lowest first: a module may import its own layer and the layers before it, never one after.
# The kernels sit above the decoding runtime, which talks to them only through the backend
# object a switched model carries (eagle.decoding.backend).
LAYERS = ["vocabulary", "decoding", "kernels", "models", "proposers", "data", "training", "bench"]
# the EAGLE core: the loop and every drafting method, which load no kernel module at all
CORE = ["eagle.decoding.engine", "eagle.proposers"]
PACKAGE = ROOT / "eagle"


def layer_of(module: str) -> str:
    """`eagle.x.y` -> its layer: the subpackage, or "vocabulary" for the top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in LAYERS else "vocabulary"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, the ones inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def library_modules() -> list[tuple[str, Path]]:
    mods = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods.append((".".join(parts), path))
    return mods


def test_every_subpackage_is_a_known_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYERS) - {"vocabulary"}


@pytest.mark.parametrize("module,path", library_modules(), ids=[m for m, _ in library_modules()])
def test_imports_point_down_the_layers(module, path):
    if module == "eagle":  # the public API: its names are imported lazily, on first use
        return
    mine = LAYERS.index(layer_of(module))
    for line, name in imports(path):
        top = name.split(".")[0]
        assert top not in ("hydra", "omegaconf"), (
            f"{path}:{line}: the library never imports hydra ({name})"
        )
        assert top != "data_gen", (
            f"{path}:{line}: eagle imports nothing from data_gen (it imports eagle)"
        )
        if top == "eagle" and name != "eagle":
            theirs = LAYERS.index(layer_of(name))
            assert theirs <= mine, (
                f"{path}:{line}: {module} ({layer_of(module)}) imports {name} "
                f"({layer_of(name)}), a layer above it"
            )


def loaded_after(statement: str) -> set[str]:
    """Top-level package names in sys.modules after running `statement` in a fresh interpreter."""
    tops = "sorted({m.split('.')[0] for m in sys.modules})"
    code = f"{statement}\nimport sys\nprint(' '.join({tops}))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return set(out.stdout.split())


def test_the_decoding_runtime_loads_no_training_or_plotting_stack():
    loaded = loaded_after(
        "import eagle.decoding, eagle.proposers, eagle.models.checkpoint, eagle.models.export, "
        "eagle.bench.methods"
    )
    assert not loaded & {"lightning", "pytorch_lightning", "hydra", "omegaconf", "matplotlib"}, (
        loaded
    )


def module_path(module: str) -> Path | None:
    """The file of an eagle module or package, None if `module` is neither (a name in one)."""
    base = ROOT.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def eagle_imports(module: str) -> set[str]:
    """The eagle modules and packages `module` imports anywhere in its file, functions included,
    with the packages each runs on the way (`from eagle.x import y`: eagle.x, and eagle.x.y
    where that is a module)."""
    names = set()
    for node in ast.walk(ast.parse(module_path(module).read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    found = set()
    for name in names:
        parts = name.split(".")
        found |= {".".join(parts[:i]) for i in range(2, len(parts) + 1) if parts[0] == "eagle"}
    return {m for m in found if module_path(m)}


def reached_from(roots: list[str]) -> dict[str, str]:
    """Every eagle module that importing `roots` can run (each module of a root package too),
    directly or through others, with the module that imports it."""
    todo = []
    for root in roots:
        path = module_path(root)
        todo.append(root)
        if path.name == "__init__.py":
            todo += [
                f"{root}.{p.stem}" for p in sorted(path.parent.glob("*.py")) if p.stem != "__init__"
            ]
    seen = dict.fromkeys(todo, "")
    while todo:
        module = todo.pop()
        for name in eagle_imports(module) - set(seen):
            seen[name] = module
            todo.append(name)
    return seen


def test_the_engine_and_the_proposers_import_no_kernel_module():
    """The EAGLE core (the loop, every proposer, and what they import: the drafter, the runners,
    the caches) reads without the optional kernels: no import of eagle.kernels, at the top or
    inside a function, anywhere it reaches; and a fresh interpreter that imports it holds none."""
    reached = reached_from(CORE)
    assert "eagle.models.drafter" in reached and "eagle.decoding.runners" in reached
    kernels = {m: by for m, by in reached.items() if m.split(".")[:2] == ["eagle", "kernels"]}
    assert not kernels, f"the core reaches the kernels: {kernels} (module: imported by)"
    code = (
        f"import {', '.join(CORE)}\nimport sys\n"
        "print(' '.join(m for m in sys.modules if m.startswith('eagle.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    loaded = set(out.stdout.split())
    assert "eagle.proposers.eagle" in loaded, loaded
    assert not any(m.startswith("eagle.kernels") for m in loaded), loaded


def test_the_analysis_loads_no_lightning():
    """The notebook reads features and runs the drafter with `eagle.bench.analysis`."""
    loaded = loaded_after("import eagle.bench.analysis, eagle.data.features")
    assert not loaded & {"lightning", "pytorch_lightning", "hydra"}, loaded


def test_the_public_api_resolves():
    import eagle

    for name in eagle.__all__:
        assert getattr(eagle, name) is not None, name
    assert (
        loaded_after("import eagle") & {"torch", "transformers"} == set()
    )  # importing eagle is free


def test_test_modules_never_import_each_other():
    tests = ROOT / "tests"
    for path in tests.glob("*.py"):
        for line, name in imports(path):
            assert not name.startswith(("test_", "conftest")), (
                f"{path.name}:{line} imports {name}: use tests/helpers"
            )
