"""Draft trees: the structure of a tree (`Tree`) and static tree templates (`TreeTemplate`).

`Tree` is the one place a tree's structure is derived from its parent list (node 0 is the
root, `parents[i] < i`, siblings in index order): children, depths, ancestors, leaves. The
acceptance rules, the target runners, the proposers and the analysis all read it from here.

A template is a list of child-rank paths: ``[0]`` is the root's top-1 child, ``[0, 1]``
the second-ranked child of ``[0]``. Materialised, the tree has nodes ``0..N``: node 0
is the root (the last committed token, not a draft) and nodes ``1..N`` are the paths
sorted by ``(depth, path)``, so parents precede children and siblings come in rank order.

Templates are data: EAGLE-1's default tree, SpecInfer's static expansion ``<k1,...,kd>``
and a chain of length gamma are all config files under ``configs/tree`` validated on
load. The empty tree (root only, i.e. vanilla decoding through the same loop) is only
reachable through an explicit ``kind: none``, so a typo can never silently disable drafting.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import torch
import yaml

RankPath = tuple[int, ...]  # child ranks from the root, e.g. (0, 2)
# a probe tree larger than this takes minutes to build and cannot be verified
MAX_BUDGET_NODES = 20_000


class TreeError(ValueError):
    """An invalid tree template or tree config; the message names the path or file."""


def _fmt(path: Sequence[int]) -> str:
    """``[0,1]`` notation (as in docs/design.md); the empty prefix is the root."""
    return "[" + ",".join(str(r) for r in path) + "]" if path else "root"


class Tree:
    """The structure of a draft tree, from its parent list; build it with `Tree.of(parents)`.

    Node 0 is the root (the last committed token, not a draft); `parents[0] == -1` and
    `0 <= parents[i] < i`, so every node comes after its parent; siblings are ordered by index.
    Instances are immutable and cached per parent list: the decoding loop asks for the same
    tree every round.
    """

    def __init__(self, parents: tuple[int, ...]):
        if not parents or parents[0] != -1:
            raise TreeError(f"parents[0] must be -1 (node 0 is the root), got {list(parents[:1])}")
        for i in range(1, len(parents)):
            if not 0 <= parents[i] < i:
                raise TreeError(f"parents[{i}] = {parents[i]} must satisfy 0 <= parents[i] < {i}")
        self.parents = parents

    @staticmethod
    def of(parents: Sequence[int] | torch.Tensor) -> Tree:
        """The (cached) tree of a parent list, validated."""
        return _tree(
            tuple(
                parents.tolist() if isinstance(parents, torch.Tensor) else (int(p) for p in parents)
            )
        )

    def __len__(self) -> int:
        """Nodes, the root included."""
        return len(self.parents)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each node's children in sibling (index) order (tuples: index tensors with `list(...)`).
        """
        out: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            out[self.parents[i]].append(i)
        return tuple(tuple(c) for c in out)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth (the root: 0); a node's position id is the committed length + its
        depth."""
        out = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            out[i] = out[self.parents[i]] + 1
        return tuple(out)

    @cached_property
    def depth(self) -> int:
        return max(self.depths)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        """Nodes without children; the root-only tree's only leaf is the root."""
        return tuple(i for i, c in enumerate(self.children) if not c)

    @cached_property
    def is_chain(self) -> bool:
        """Every node's parent is the node before it: causal attention is the tree's."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def _ancestors(self) -> torch.Tensor:
        n = len(self.parents)
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            anc[i] |= anc[self.parents[i]]  # parents precede children: row p is already final
        return anc

    def ancestors(
        self, width: int | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """(width, width) bool: node i sees node j iff j is i or an ancestor of i. Padded to
        `width` nodes (default: the tree's own size): a padding node sees only itself and no
        real node sees it."""
        n = len(self.parents)
        width = n if width is None else width
        if width < n:
            raise TreeError(f"a tree of {n} nodes does not fit in {width}")
        out = torch.eye(width, dtype=torch.bool)
        out[:n, :n] = self._ancestors
        return out.to(device)

    def depth_offsets(
        self, width: int | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """(width,) long: each node's depth, padding nodes at depth 0."""
        n = len(self.parents)
        width = n if width is None else width
        return torch.tensor(list(self.depths) + [0] * (width - n), dtype=torch.long, device=device)

    def retrieve_indices(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(L, depth+1) long: one row per leaf, its root-to-leaf node indices, -1 padded."""
        rows = []
        for leaf in self.leaves:
            row, node = [], leaf
            while node >= 0:
                row.append(node)
                node = self.parents[node]
            rows.append(row[::-1] + [-1] * (self.depth + 1 - len(row)))
        return torch.tensor(rows, dtype=torch.long, device=device)


@lru_cache(maxsize=256)
def _tree(parents: tuple[int, ...]) -> Tree:
    return Tree(parents)


def _normalise(paths: Iterable) -> tuple[RankPath, ...]:
    """Validate raw paths and return them sorted by (depth, path).

    Checks run on the sorted list so the reported error is the shallowest one, which
    is usually the root cause (a missing ancestor explains its whole subtree).
    """
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Iterable):
        raise TreeError(f"paths must be a list of rank lists, got {paths!r}")
    out: list[RankPath] = []
    for raw in paths:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
            raise TreeError(f"path {raw!r} is not a list of ranks")
        if len(raw) == 0:
            raise TreeError("empty path [] (the root is implicit, do not list it)")
        for r in raw:
            # bool is an int subclass; True as a rank is certainly a typo.
            if isinstance(r, bool) or not isinstance(r, int):
                raise TreeError(f"path {list(raw)!r} has non-integer rank {r!r}")
            if r < 0:
                raise TreeError(f"path {_fmt(raw)} has negative rank {r}")
        out.append(tuple(raw))
    out.sort(key=lambda p: (len(p), p))
    seen: set[RankPath] = set()
    for p in out:
        if p in seen:
            raise TreeError(f"duplicate path {_fmt(p)}")
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeError(f"path {_fmt(p)} has missing ancestor {_fmt(p[:-1])}")
        # Rank r is "the r-th best child", so it only makes sense if ranks 0..r-1 exist.
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise TreeError(
                f"path {_fmt(p)}: rank {p[-1]} under {_fmt(p[:-1])} without rank {p[-1] - 1}"
            )
        seen.add(p)
    return tuple(out)


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TreeError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class TreeBuffers:
    """Tensors for one verification pass over the root plus N draft nodes."""

    attn_mask: torch.Tensor  # (N+1, N+1) bool: i sees j iff j is i or an ancestor of i
    position_offsets: torch.Tensor  # (N+1,) long: depth; position id = committed len + depth
    retrieve_indices: torch.Tensor  # (L, depth+1) long: root-to-leaf node indices, -1 padded
    parents: torch.Tensor  # (N+1,) long, parents[0] = -1


@dataclass(frozen=True)
class TreeTemplate:
    """A validated static draft tree; build it with the classmethods, not directly.

    Direct construction still validates and sorts the paths, but allows the empty
    tree; the public constructors refuse it unless asked (only ``kind: none`` asks).
    """

    paths: tuple[RankPath, ...]  # sorted (depth, path); node i is paths[i-1]
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", _normalise(self.paths))

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def from_paths(
        cls, paths: Iterable[Sequence[int]], name: str = "custom", *, allow_empty: bool = False
    ) -> TreeTemplate:
        """Validate child-rank paths (any order) into a template."""
        tree = cls(paths=paths, name=name)
        if not tree.paths and not allow_empty:
            raise TreeError(
                f"tree '{name}' is empty (only an explicit kind 'none' may have no draft nodes)"
            )
        return tree

    @classmethod
    def chain(cls, gamma: int, name: str | None = None) -> TreeTemplate:
        """A single chain of gamma top-1 drafts: [0], [0,0], ... (classic speculative decoding)."""
        gamma = _positive_int(gamma, "chain length gamma")
        return cls.from_paths([(0,) * d for d in range(1, gamma + 1)], name or f"chain{gamma}")

    @classmethod
    def static_expansion(cls, ks: Sequence[int], name: str | None = None) -> TreeTemplate:
        """SpecInfer's <k1,...,kd>: every node at depth i-1 gets k_i children."""
        if isinstance(ks, (str, bytes)) or not isinstance(ks, Sequence) or not ks:
            raise TreeError(f"expansion must be a non-empty list of positive integers, got {ks!r}")
        ks = [_positive_int(k, "every expansion factor") for k in ks]
        paths: list[RankPath] = []
        frontier: list[RankPath] = [()]
        for k in ks:
            frontier = [p + (r,) for p in frontier for r in range(k)]
            paths += frontier
        return cls.from_paths(paths, name or "static<" + ",".join(map(str, ks)) + ">")

    @classmethod
    def rank_budget(
        cls, max_depth: int, max_rank_sum: int, name: str | None = None
    ) -> TreeTemplate:
        """Every path of depth <= max_depth whose ranks sum to <= max_rank_sum: the nodes a
        decent drafter is most likely to get accepted. Large, so meant as a probe: measure
        each node's acceptance once, then keep the best subtree (`eagle.tree_search`)."""
        max_depth = _positive_int(max_depth, "max_depth")
        if isinstance(max_rank_sum, bool) or not isinstance(max_rank_sum, int) or max_rank_sum < 0:
            raise TreeError(f"max_rank_sum must be an integer >= 0, got {max_rank_sum!r}")
        # paths of depth d with ranks summing to <= s: C(s + d, d); count before building them
        nodes = sum(math.comb(max_rank_sum + d, d) for d in range(1, max_depth + 1))
        if nodes > MAX_BUDGET_NODES:
            raise TreeError(
                f"a budget tree of max_depth {max_depth} and max_rank_sum {max_rank_sum} has "
                f"{nodes:,} "
                f"nodes (at most {MAX_BUDGET_NODES:,}): lower max_depth or max_rank_sum"
            )
        paths: list[RankPath] = []
        frontier: list[RankPath] = [()]
        for _ in range(max_depth):
            frontier = [p + (r,) for p in frontier for r in range(max_rank_sum - sum(p) + 1)]
            paths += frontier
        return cls.from_paths(paths, name or f"budget<depth {max_depth}, rank sum {max_rank_sum}>")

    @classmethod
    def empty(cls, name: str = "vanilla") -> TreeTemplate:
        """Root only: vanilla decoding (one token per target pass) through the tree loop."""
        return cls.from_paths((), name, allow_empty=True)

    @classmethod
    def from_config(cls, cfg: Mapping, name: str = "custom") -> TreeTemplate:
        """Build from a mapping with ``kind`` in paths | chain | static | budget | none.

        ``{"kind": "paths", "paths": [[0], ...]}``, ``{"kind": "chain", "gamma": 5}``,
        ``{"kind": "static", "expansion": [1, 1, 3, 1, 1]}``,
        ``{"kind": "budget", "max_depth": 8, "max_rank_sum": 2}``, ``{"kind": "none"}``.
        An optional ``name`` key overrides the argument. Stray keys are errors: a
        ``paths`` list next to ``kind: chain`` is a contradiction, not a comment.
        """
        if not isinstance(cfg, Mapping):
            raise TreeError(f"tree config must be a mapping, got {type(cfg).__name__}")
        kinds = {
            "paths": ("paths",),
            "chain": ("gamma",),
            "static": ("expansion",),
            "budget": ("max_depth", "max_rank_sum"),
            "none": (),
        }
        if "kind" not in cfg:
            raise TreeError(f"tree config is missing key 'kind' (one of {sorted(kinds)})")
        kind = cfg["kind"]
        if not isinstance(kind, str) or kind not in kinds:
            raise TreeError(f"unknown tree kind {kind!r} (expected one of {sorted(kinds)})")
        for key in kinds[kind]:
            if key not in cfg:
                raise TreeError(f"tree config of kind '{kind}' is missing key '{key}'")
        stray = sorted(set(cfg) - {"kind", "name", *kinds[kind]})
        if stray:
            raise TreeError(f"unexpected key(s) {stray} in tree config of kind '{kind}'")
        name = str(cfg["name"]) if cfg.get("name") is not None else name
        if kind == "paths":
            return cls.from_paths(cfg["paths"], name)
        if kind == "chain":
            return cls.chain(cfg["gamma"], name)
        if kind == "static":
            return cls.static_expansion(cfg["expansion"], name)
        if kind == "budget":
            return cls.rank_budget(cfg["max_depth"], cfg["max_rank_sum"], name)
        return cls.empty(name)

    @classmethod
    def from_file(cls, path: str | Path) -> TreeTemplate:
        """Load a YAML tree config; the template is named after the file's stem."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise TreeError(f"tree file not found: {path}") from None
        except OSError as e:
            raise TreeError(f"cannot read tree file {path}: {e}") from e
        except UnicodeDecodeError:
            raise TreeError(f"tree file {path} is not UTF-8 text (a YAML tree config)") from None
        try:
            cfg = yaml.safe_load(text)
        except yaml.YAMLError as e:
            # YAML errors span several lines; keep ours to one.
            raise TreeError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from e
        if not isinstance(cfg, Mapping):
            raise TreeError(f"{path}: expected a mapping, got {type(cfg).__name__}")
        try:
            return cls.from_config(cfg, name=path.stem)
        except TreeError as e:
            raise TreeError(f"{path}: {e}") from e

    # ---- derived structure (node 0 = root) ---------------------------------------

    @cached_property
    def num_nodes(self) -> int:
        """N: draft nodes, root excluded."""
        return len(self.paths)

    @cached_property
    def depth(self) -> int:
        return len(self.paths[-1]) if self.paths else 0

    @cached_property
    def _index(self) -> dict[RankPath, int]:
        return {(): 0, **{p: i for i, p in enumerate(self.paths, start=1)}}

    @cached_property
    def parents(self) -> list[int]:
        """len N+1; parents[0] = -1."""
        return [-1] + [self._index[p[:-1]] for p in self.paths]

    @cached_property
    def structure(self) -> Tree:
        """The tree's structure (children, depths, ancestors) for its parent list."""
        return Tree.of(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        """len N+1; the root has depth 0."""
        return self.structure.depths

    @property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """len N+1; each in rank order (guaranteed by the (depth, path) sort)."""
        return self.structure.children

    @property
    def leaves(self) -> tuple[int, ...]:
        """Nodes without children; the empty tree's only leaf is the root."""
        return self.structure.leaves

    @cached_property
    def ranks(self) -> list[int]:
        """len N+1: which of its parent's top-k tokens a node takes; -1 for the root."""
        return [-1] + [p[-1] for p in self.paths]

    @cached_property
    def nodes_per_depth(self) -> list[int]:
        """len depth: draft nodes at depths 1..depth (what each drafter pass expands into)."""
        counts = [0] * self.depth
        for p in self.paths:
            counts[len(p) - 1] += 1
        return counts

    @cached_property
    def max_rank(self) -> int:
        """The top-k the drafter must produce to fill the tree (max rank + 1; 0 if empty)."""
        return max((p[-1] for p in self.paths), default=-1) + 1

    # ---- verification buffers -----------------------------------------------------

    def buffers(self, device: torch.device | str | None = None) -> TreeBuffers:
        """Mask, position offsets, retrieve indices and parents for tree verification."""
        tree = self.structure
        return TreeBuffers(
            attn_mask=tree.ancestors(device=device),
            position_offsets=tree.depth_offsets(device=device),
            retrieve_indices=tree.retrieve_indices(device),
            parents=torch.tensor(self.parents, dtype=torch.long, device=device),
        )

    # ---- display ---------------------------------------------------------------------

    def summary(self) -> str:
        if not self.paths:
            return f"{self.name}: root only (no draft nodes)"
        return (
            f"{self.name}: {self.num_nodes} nodes, depth {self.depth}, "
            f"per depth {self.nodes_per_depth}, {len(self.leaves)} "
            + ("leaf" if len(self.leaves) == 1 else "leaves")
        )

    def __str__(self) -> str:
        return self.summary()


def resolve_tree(name_or_path: str | Path, search_dirs: Iterable[str | Path] = ()) -> TreeTemplate:
    """A template from a YAML file path, or from ``<dir>/<name>.yaml`` in the first search dir
    that has it. The library takes the dirs as an argument so it never assumes a repo layout."""
    path = Path(name_or_path)
    # Anything spelled like a path is one: a missing file should say so, not list names.
    if path.is_file() or path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        return TreeTemplate.from_file(path)
    dirs = [Path(d) for d in search_dirs]
    for d in dirs:
        candidate = d / f"{name_or_path}.yaml"
        if candidate.is_file():
            return TreeTemplate.from_file(candidate)
    available = sorted({f.stem for d in dirs if d.is_dir() for f in d.glob("*.yaml")})
    raise TreeError(
        f"tree '{name_or_path}' is neither a file nor a name in {[str(d) for d in dirs]}; "
        f"available: {available}"
    )
