"""The methods a run compares, built from their settings, with the target loaded once per dtype.

`Methods` builds any method of `eagle.bench.methods` (`eagle`, `draft`, `prompt_lookup`, ...) from
the settings of their sections, loading the target and each draft LM once per dtype. It decides
two things a run would otherwise assume: the linear kernels every model of a dtype runs
(`kernels=auto`: timed once per dtype, `choose_kernels`), and, where a CPU would run a wide
method in bf16, whether bf16 is faster there at the method's tree width (timed once per width).
A tree the tree search chose keeps the dtype it was timed in (`searched_dtype`).

`decode.py` builds one from its config (`methods_of`); a notebook or a script can build one
from plain settings.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from eagle.bench.methods import (
    SECTIONS,
    MethodContext,
    MethodSpec,
    build_method,
    method_dtype,
    method_settings,
)
from eagle.bench.precision import DtypeChoice, KernelChoice, faster_dtype, faster_kernels
from eagle.kernels import (
    PACKED_DTYPES,
    available_kernels,
    check_kernels,
    free_memory_bytes,
    packed_bytes,
    use_kernels,
)
from eagle.target import load_target, resolve_dtype
from eagle.tree import resolve_tree


def choose_kernels(model: torch.nn.Module, kernels: str, device, name: str) -> KernelChoice | str:
    """The linear kernels for `model` (the target in one dtype, `name`): `kernels` as named, or
    with auto the setting measured faster on it (eagle.bench.precision.faster_kernels), unless
    there is nothing to choose or a packed copy may not fit. Decoding and the floor's `+auto` both
    choose here, so the floor times what decoding runs."""
    choices = available_kernels(device)
    if kernels != "auto":
        return check_kernels(kernels, device)
    if len(choices) == 1 or resolve_dtype(name) not in PACKED_DTYPES:
        return "default"  # nothing to choose: no packed products for this device or dtype
    # a 7B target in float32, say: a packed copy of its linears would not fit beside it
    if (free := free_memory_bytes()) is not None and (extra := packed_bytes(model)) > free / 2:
        print(
            f"[kernels] {name}: default (packing the linears would take {extra / 1e9:.1f} GB "
            f"of the {free / 1e9:.1f} GB free; kernels=onednn forces it)",
            file=sys.stderr,
            flush=True,
        )  # target
        return "default"
    choice = faster_kernels(model, kernels=choices)
    print(f"[kernels] {name}: {choice.describe()}", file=sys.stderr, flush=True)  # not in the text
    return choice


class Methods:
    """Builds methods from their sections' settings; targets and draft LMs are loaded once per
    dtype. `sections`: names of `eagle.bench.methods.SECTIONS`, each a plain mapping of its
    settings (a section or setting left out takes its settings class's default). `target` is the
    target's folder; `kernels` the linears' setting (a name of `eagle.kernels.KERNELS`,
    or auto: timed); `runner`, `static_max_len` and `compile_mode` the engine methods' runner
    without a `:RUNNER` suffix, its cache slots and its torch.compile mode (None: eager).
    `tree_dir` holds the named trees (the repository's configs/tree): a tree name is looked up
    in the folders a caller adds (a tree search's output), then there."""

    def __init__(
        self,
        sections: Mapping[str, Mapping],
        *,
        target: str | Path,
        device: str,
        tree_dir: str | Path,
        kernels: str = "auto",
        runner: str = "dynamic",
        static_max_len: int | None = None,
        compile_mode: str | None = None,
    ):
        if unknown := sorted(set(sections) - set(SECTIONS)):
            raise ValueError(
                f"Methods: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}"
            )
        self.sections = {name: dict(sections.get(name) or {}) for name in SECTIONS}
        self.target_path, self.device, self.tree_dir = str(target), str(device), str(tree_dir)
        self.kernel_setting, self.runner, self.static_max_len = kernels, runner, static_max_len
        self.compile_mode = compile_mode
        self._targets: dict[torch.dtype, tuple] = {}
        self._drafts: dict[tuple[str, torch.dtype], torch.nn.Module] = {}
        self.measured: dict[int, DtypeChoice] = {}  # tree width -> the dtype measured faster
        self.kernels: dict[
            str, KernelChoice | str
        ] = {}  # dtype -> the linear kernels of its models
        if kernels != "auto":  # a typo fails before anything is loaded
            check_kernels(kernels, device)

    def tree_dirs(self, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
        """Where a tree name is looked up: `extra` first, then the named trees."""
        return (*extra, self.tree_dir)

    def probed(self, spec: str, overrides: dict[str, str] | None = None) -> bool:
        """Whether `dtype` measures `spec`'s dtype rather than taking its override or the machine's
        choice (`method_dtype`): where that choice is bf16 for a wide method on a CPU."""
        spec, overrides = MethodSpec.parse(spec), overrides or {}
        explicit = overrides.get(str(spec)) or overrides.get(spec.base)
        return (
            method_dtype(spec, self.device, overrides) == "bfloat16"
            and torch.device(self.device).type == "cpu"
            and explicit in (None, "auto")
        )

    def dtype(
        self, spec: str, overrides: dict[str, str] | None = None, tree_dirs: tuple[str, ...] = ()
    ) -> str:
        """The dtype `spec` runs in: its override, else the machine's choice (`method_dtype`),
        except that where that choice is bf16 for a wide method on a CPU (`probed`), the faster
        dtype is measured on the target instead of assumed (eagle.bench.precision), once per tree
        width."""
        if not self.probed(spec, overrides):
            return method_dtype(MethodSpec.parse(spec), self.device, overrides or {})
        spec = MethodSpec.parse(spec)
        tree = (
            getattr(method_settings(spec, self.sections), "tree", None)
            or method_settings(MethodSpec.parse("eagle"), self.sections).tree
        )
        if searched := searched_dtype(tree):
            print(f"[dtype] {spec}: {searched}, as the tree search that chose {tree} measured it")
            return searched
        width = resolve_tree(tree, self.tree_dirs(tree_dirs)).num_nodes + 1  # the root and the tree
        if width not in self.measured:
            choice = faster_dtype(
                {name: self.target(name)[0] for name in ("float32", "bfloat16")}, width
            )
            if choice.dtype == "float32":  # the bf16 copy was loaded only to be timed
                self._targets.pop(torch.bfloat16, None)
            print(f"[dtype] {spec}: {choice.describe()}")
            self.measured[width] = choice
        return self.measured[width].dtype

    def target(self, dtype: str):
        key = resolve_dtype(dtype)
        if key not in self._targets:
            self._targets[key] = load_target(self.target_path, dtype=key, device=self.device)
            self._use_kernels(self._targets[key][0], dtype)
        return self._targets[key]

    def _use_kernels(self, model: torch.nn.Module, dtype: str) -> None:
        """The kernel setting on a model of `dtype`: the setting named, or with auto the one
        measured faster on the target in that dtype (eagle.bench.precision.faster_kernels); every
        model of a dtype (target, draft LMs, drafters) then runs the same kernels."""
        name = str(resolve_dtype(dtype)).removeprefix("torch.")
        if name not in self.kernels:
            self.kernels[name] = choose_kernels(model, self.kernel_setting, self.device, name)
        choice = self.kernels[name]
        use_kernels(model, choice if isinstance(choice, str) else choice.kernels)

    def _draft_lm(self, dtype: str):
        def load(path: str) -> torch.nn.Module:
            key = (str(path), resolve_dtype(dtype))
            if key not in self._drafts:
                self._drafts[key], _ = load_target(
                    path, dtype=key[1], device=self.device, with_tokenizer=False
                )
                self._use_kernels(self._drafts[key], dtype)
            return self._drafts[key]

        return load

    def context(self, dtype: str, tree_dirs: tuple[str, ...] = (), target=None) -> MethodContext:
        target, tokenizer = (target, None) if target is not None else self.target(dtype)
        return MethodContext(
            target=target,
            tokenizer=tokenizer,
            target_path=self.target_path,
            tree_dirs=self.tree_dirs(tree_dirs),
            draft_lm=self._draft_lm(dtype),
            runner=self.runner,
            static_max_len=self.static_max_len,
            compile_mode=self.compile_mode,
        )

    def build(self, name: str, dtype: str, tree_dirs: tuple[str, ...] = ()):
        return build_method(name, self.context(dtype, tree_dirs), self.sections)


def searched_dtype(tree: str) -> str | None:
    """The dtype the tree search timed `tree` in, where `tree` is the path of a file it wrote
    (machine.yaml, or a candidate beside it, with their machine.json): the tree was chosen for
    its round in that dtype, and timing the dtypes again minutes later on a shared machine can
    decide otherwise (LOG.md). None for any other tree."""
    path = Path(str(tree))
    record = path.parent / "machine.json"
    if path.suffix not in (".yaml", ".yml") or not path.is_file() or not record.is_file():
        return None
    try:
        machine = json.loads(record.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{record}, the tree search's record beside {path}, is not valid JSON ({err}): "
            "rerun the tree search, or delete it to time the dtypes here"
        ) from err
    dtypes = machine.get("dtypes", {})
    if (
        path.stem == "machine" and "machine" not in dtypes
    ):  # a record written before machine*.yaml had entries
        return dtypes.get(machine.get("chosen"))
    return dtypes.get(path.stem)
