"""Eval prompts (eagle/bench/evalsets.py): the sets that ship with packages, and a bad line of a
prompt file named."""

from __future__ import annotations

import pytest

from eagle.bench.evalsets import EvalSetError, load_eval_set, spread


@pytest.mark.parametrize("line, message", [
    ("def f(x):", "prompts.jsonl:2: not JSON"),
    ('"just a string"', "prompts.jsonl:2: a str, not a JSON object"),
    ('{"prompt": 12345}', "prompts.jsonl:2: the prompt is a int"),
    ('{"turns": "hello"}', "prompts.jsonl:2: 'turns' must be a list of texts"),  # not "h"
    ("{}", "prompts.jsonl:2: no non-empty"),
])
def test_a_bad_line_of_a_prompt_file_is_named(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(EvalSetError, match=message):
        load_eval_set(str(path))


def test_eval_sets_ship_with_packages():
    assert len(load_eval_set("humaneval")) == 164
    assert len(load_eval_set("mtbench", limit=5)) == 5
    # MT-bench is ordered by category (10 questions each): a sample takes every category's first
    every, bench = load_eval_set("mtbench"), load_eval_set("mtbench", limit=8)
    assert [p.id for p in bench] == [p.id for p in every[::10]] and len(every) == 80
    assert len({p.category for p in every}) == 8 and every[0].category == "writing"
    # the tree search tunes on prompts held out from the benchmark's, spread the same way
    held = load_eval_set("mtbench", limit=8, held_out_from=8)
    assert [p.id for p in held] == [p.id for p in every[1::10]]
    held = load_eval_set("mtbench", 5, held_out_from=20)
    assert not {p.id for p in held} & {p.id for p in load_eval_set("mtbench", 20)}
    # a set too short for both: the held-out prompts overlap the benchmark's
    held = load_eval_set("mtbench", 50, held_out_from=40)
    assert [p.id for p in held] == [p.id for p in spread(every, 50)]
