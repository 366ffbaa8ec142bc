"""Tree templates: shapes of the shipped configs, verification buffers, validation errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from eagle.tree import TreeError, TreeTemplate, resolve_tree

TREE_DIR = Path(__file__).resolve().parent.parent / "configs" / "tree"
TREE_FILES = sorted(TREE_DIR.glob("*.yaml"))


def default_tree() -> TreeTemplate:
    return TreeTemplate.from_file(TREE_DIR / "eagle_default.yaml")


def test_default_tree_shape():
    tree = default_tree()
    assert tree.num_nodes == 25
    assert tree.depth == 5
    assert tree.nodes_per_depth == [4, 8, 8, 3, 2]
    assert len(tree.leaves) == 15
    assert tree.max_rank == 4
    assert str(tree) == "eagle_default: 25 nodes, depth 5, per depth [4, 8, 8, 3, 2], 15 leaves"


def test_shipped_configs_present():
    names = {f.stem for f in TREE_FILES}
    assert {"eagle_default", "chain5", "specinfer_11311", "specinfer_221", "vanilla"} <= names


@pytest.mark.parametrize("path", TREE_FILES, ids=lambda p: p.stem)
def test_every_config_loads(path):
    tree = TreeTemplate.from_file(path)
    assert tree.name == path.stem
    assert resolve_tree(path.stem, [TREE_DIR]) == tree
    assert resolve_tree(str(path)) == tree


def test_chain_and_static_shapes():
    chain = TreeTemplate.from_file(TREE_DIR / "chain5.yaml")
    assert chain.paths == tuple((0,) * d for d in range(1, 6))
    assert chain.leaves == (5,) and chain.max_rank == 1
    assert str(chain) == "chain5: 5 nodes, depth 5, per depth [1, 1, 1, 1, 1], 1 leaf"

    s221 = TreeTemplate.static_expansion([2, 2, 1])
    assert s221.num_nodes == 2 + 4 + 4 and s221.nodes_per_depth == [2, 4, 4]
    assert TreeTemplate.from_file(TREE_DIR / "specinfer_221.yaml").paths == s221.paths
    s11311 = TreeTemplate.from_file(TREE_DIR / "specinfer_11311.yaml")
    assert s11311.nodes_per_depth == [1, 1, 3, 3, 3] and len(s11311.leaves) == 3


def test_vanilla_is_root_only():
    tree = TreeTemplate.from_file(TREE_DIR / "vanilla.yaml")
    assert tree.num_nodes == 0 and tree.depth == 0 and tree.leaves == (0,)
    buf = tree.buffers()
    assert buf.attn_mask.tolist() == [[True]]
    assert buf.retrieve_indices.tolist() == [[0]]
    assert buf.parents.tolist() == [-1]


def test_input_order_does_not_matter():
    tree = default_tree()
    shuffled = list(tree.paths)
    random.Random(0).shuffle(shuffled)
    assert TreeTemplate.from_paths(shuffled, "eagle_default") == tree


BUFFER_TREES = [
    default_tree(),
    TreeTemplate.chain(5),
    TreeTemplate.static_expansion([1, 1, 3, 1, 1]),
    TreeTemplate.static_expansion([2, 2, 1]),
    TreeTemplate.from_paths([[0], [1], [0, 0], [1, 0], [1, 1], [1, 1, 0]]),
]


@pytest.mark.parametrize("tree", BUFFER_TREES, ids=lambda t: t.name)
def test_buffers(tree):
    buf = tree.buffers()
    n = tree.num_nodes + 1
    parents = buf.parents.tolist()
    assert parents[0] == -1 and parents == tree.parents
    # Parents precede children and agree with the paths (parent path = path minus last rank).
    paths = [(), *tree.paths]
    for i in range(1, n):
        assert 0 <= parents[i] < i
        assert paths[parents[i]] == paths[i][:-1]

    # Ancestor-or-self, by walking parents independently of the implementation.
    expected = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            expected[i, j] = True
            j = parents[j]
    assert buf.attn_mask.dtype == torch.bool
    assert torch.equal(buf.attn_mask, expected)

    assert buf.position_offsets.dtype == torch.long
    assert buf.position_offsets.tolist() == [len(p) for p in paths] == list(tree.depths)

    ri = buf.retrieve_indices
    assert ri.shape == (len(tree.leaves), tree.depth + 1)
    leaves = set()
    for row in ri.tolist():
        nodes = [x for x in row if x >= 0]
        assert row == nodes + [-1] * (len(row) - len(nodes))  # padding only at the end
        assert nodes[0] == 0
        assert all(parents[b] == a for a, b in zip(nodes, nodes[1:]))
        assert not tree.children[nodes[-1]]
        leaves.add(nodes[-1])
    assert leaves == set(tree.leaves)


@pytest.mark.parametrize(
    "paths, match",
    [
        ([], "empty"),
        ([[0], [0, 0, 0]], r"missing ancestor \[0,0\]"),
        ([[0], [0, 0], [0, 2]], r"rank 2 under \[0\] without rank 1"),
        ([[0], [2]], "rank 2 under root without rank 1"),
        ([[0], [0, -1]], "negative rank -1"),
        ([[0], [1], [0]], r"duplicate path \[0\]"),
        ([[0], []], "empty path"),
        ([[0], [0.5]], "non-integer rank"),
    ],
)
def test_validation_errors(paths, match):
    with pytest.raises(TreeError, match=match):
        TreeTemplate.from_paths(paths)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"kind": "beam"}, "unknown tree kind 'beam'"),
        ({"gamma": 5}, "missing key 'kind'"),
        ({"kind": "chain"}, "missing key 'gamma'"),
        ({"kind": "chain", "gamma": 0}, "positive integer"),
        ({"kind": "static", "expansion": [2, 0]}, "positive integer"),
        ({"kind": "paths", "paths": []}, "empty"),
        ({"kind": "chain", "gamma": 3, "paths": [[0]]}, r"unexpected key\(s\) \['paths'\]"),
    ],
)
def test_config_errors(cfg, match):
    with pytest.raises(TreeError, match=match):
        TreeTemplate.from_config(cfg)


def test_file_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(TreeError, match="tree file not found: .*nope.yaml"):
        TreeTemplate.from_file(missing)

    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: paths\npaths: [[0], [1\n")
    with pytest.raises(TreeError, match="bad.yaml: invalid YAML") as info:
        TreeTemplate.from_file(bad)
    assert "\n" not in str(info.value)

    listy = tmp_path / "listy.yaml"
    listy.write_text("- [0]\n")
    with pytest.raises(TreeError, match="listy.yaml: expected a mapping"):
        TreeTemplate.from_file(listy)

    gap = tmp_path / "gap.yaml"
    gap.write_text("kind: paths\npaths: [[0], [0, 1]]\n")
    with pytest.raises(TreeError, match=r"gap.yaml: .*rank 1 under \[0\] without rank 0"):
        TreeTemplate.from_file(gap)


def test_resolve_unknown_name_lists_available():
    with pytest.raises(TreeError, match="available: .*eagle_default"):
        resolve_tree("no_such_tree", [TREE_DIR])
    with pytest.raises(TreeError, match="tree file not found"):
        resolve_tree(TREE_DIR / "no_such_tree.yaml", [TREE_DIR])


def test_tree_files_that_would_hang_or_crash_are_refused_clearly(tmp_path):
    """A budget of ~10M paths is counted and refused before it is built (it used to hang);
    a kind that is not a name, a file that is not text, and a null name get clear answers."""
    message = r"max_depth 20 and max_rank_sum 8 has [\d,]+ nodes \(at most 20,000\)"
    with pytest.raises(TreeError, match=message):
        TreeTemplate.from_config({"kind": "budget", "max_depth": 20, "max_rank_sum": 8})
    assert (
        TreeTemplate.from_config({"kind": "budget", "max_depth": 8, "max_rank_sum": 2}).num_nodes
        == 164
    )
    with pytest.raises(TreeError, match=r"unknown tree kind \['paths'\]"):
        TreeTemplate.from_config({"kind": ["paths"], "paths": [[0]]})
    binary = tmp_path / "tree.yaml"
    binary.write_bytes(b"\xff\xfe\x00kind")
    with pytest.raises(TreeError, match="is not UTF-8 text"):
        TreeTemplate.from_file(binary)
    assert (
        TreeTemplate.from_config({"kind": "chain", "gamma": 2, "name": None}, name="fallback").name
        == "fallback"
    )
