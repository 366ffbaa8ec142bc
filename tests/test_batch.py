"""Batches of sequences decoded at once: what the batched conformance checks
(tests/test_conformance.py) would miss if the batch machinery were wrong, shown by planting the
wrong thing; the bookkeeping of rows that finish early; requests a batch refuses. Then the
batch-size benchmark (eagle/bench/batch.py, decode.py mode=batch): every method at several
batch sizes against vanilla at the same size."""

from __future__ import annotations

import json

import pytest
import torch

from eagle.bench.methods import MethodError
from eagle.decoding import SpeculativeDecoder, make_runner, runners
from eagle.decoding import kv_cache as kv
from eagle.decoding.engine import Proposer
from eagle.decoding.static_cache import StaticKVCache
from eagle.kernels import available_kernels, use_kernels
from eagle.proposers import DraftLM, TemplateProposer
from eagle.tree import TreeTemplate
from helpers.configs import decode_cfg
from helpers.decoding import batch_case, run_batched_greedy, tree
from helpers.models import TREES, make_tiny_model


def _oracle(target, runner: str):
    proposer = TemplateProposer(DraftLM(target, cache=runner), tree("eagle_default"))
    return proposer, make_runner(runner, target, tree_size=proposer.max_nodes)


def test_a_row_that_sees_another_rows_padding_fails_the_batched_check(monkeypatch):
    """In the growing cache the rows share slots: a shorter row's slots between its end and the
    tree hold the longer rows' padding and stale entries. A mask that forgets each row's own
    length lets it attend to them; the batched check catches that."""
    target = make_tiny_model("llama")
    case = batch_case(target)
    run_batched_greedy(target, *_oracle(target, "dynamic"), case, "the real mask")
    real = runners.tree_attention_mask
    monkeypatch.setattr(runners, "tree_attention_mask",
                        lambda prefix, visible, dtype, committed=None: real(prefix, visible, dtype))
    with pytest.raises(AssertionError, match="row"):
        run_batched_greedy(target, *_oracle(target, "dynamic"), case, "rows see the padding")


def test_rows_that_share_their_writes_fail_the_batched_check(monkeypatch):
    """In the static cache each row writes its tree after its own committed prefix. Written at
    the longest row's end instead (one start for all), a shorter row's tree sits at the wrong
    positions of its cache and sees stale slots."""
    target = make_tiny_model("llama")
    case = batch_case(target)
    run_batched_greedy(target, *_oracle(target, "static"), case, "per-row slots")
    real = StaticKVCache.prepare

    def shared(self, start, visible, write_at=None):
        if isinstance(start, torch.Tensor) and start.dim() == 1:
            start = start.max().expand_as(start)
        return real(self, start, visible, write_at)

    monkeypatch.setattr(StaticKVCache, "prepare", shared)
    with pytest.raises(AssertionError, match="row"):
        run_batched_greedy(target, *_oracle(target, "static"), case, "one start for every row")


def test_a_row_that_keeps_another_rows_path_fails_the_batched_check(monkeypatch):
    """After verification each row keeps the KV of its own accepted path; taking the next row's
    (a batch index off by one in the compaction) leaks one sequence into another."""
    target = make_tiny_model("llama")
    case = batch_case(target)
    real = kv.keep_paths

    def swapped(cache, prefix_len, lengths, paths):
        real(cache, prefix_len, lengths, paths)
        for layer in cache.layers:  # every row's committed entries from its neighbour
            layer.keys.copy_(layer.keys.roll(1, 0))
            layer.values.copy_(layer.values.roll(1, 0))

    monkeypatch.setattr(runners, "keep_paths", swapped)
    with pytest.raises(AssertionError, match="row"):
        run_batched_greedy(target, *_oracle(target, "dynamic"), case, "rows swap their caches")


@pytest.mark.parametrize("runner", ["dynamic", "static"])
def test_rows_leave_the_batch_when_they_finish(runner):
    """A row ends at its own EOS or budget: its rounds stop there, its time is the time until
    then, and the others go on (the growing cache drops its row, the static one parks it)."""
    target = make_tiny_model("llama")
    proposer, kept = _oracle(target, runner)
    results = run_batched_greedy(target, proposer, kept, batch_case(target), runner)
    budgets = [len(r.tokens) for r in results]
    assert budgets[1] == 1 and not results[1].stats.rounds  # one token: the prefill's
    assert results[1].stats.total_s < results[0].stats.total_s
    forwards = [r.stats.forwards for r in results]
    assert max(forwards) > min(f for f in forwards if f) > 0
    assert all(r.stats.tau == r.stats.committed / max(r.stats.forwards, 1) for r in results)


def test_a_finished_row_parked_near_the_static_caches_end_stays_inside_it():
    """A row that ends inside an accepted path is parked while the others go on, and still
    verifies a lone root each round: parked at its committed length, which ends within a
    tree's width of a cache sized exactly to the request, its writes ran past the cache
    ("index 51 is out of bounds"). The batch must decode as each sequence alone."""
    target = make_tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (40, 5)]
    budgets, chain = [5, 40], TreeTemplate.chain(5)
    # 51: the row of 40 + 5
    need = max(len(p) + b for p, b in zip(prompts, budgets)) + chain.num_nodes + 1
    runner = runners.StaticRunner(target, tree_size=chain.num_nodes, max_len=need)
    decoder = SpeculativeDecoder(
        target,
        TemplateProposer(DraftLM(target, cache="static"), chain),
        eos_token_id=[],
        runner=runner,
    )
    together = decoder.generate_batch(prompts, budgets)
    assert (
        together[0].stats.rounds[0].accepted == 5 and len(together[0].tokens) == 5
    )  # cut inside its path
    for prompt, budget, row in zip(prompts, budgets, together):
        assert decoder.generate(prompt, budget).tokens == row.tokens


@pytest.mark.parametrize(
    "kernels,runner", [("default", "dynamic"), ("fused", "dynamic"), ("fused", "static")]
)
def test_a_batch_decodes_as_each_sequence_alone(kernels, runner):
    """One prompt through `generate` and through `generate_batch` beside others: the same text
    and the same rounds (greedy: the same accepted paths); on the fused kernels too, whose rows
    are computed alike at any batch size (with the static cache, each row writes its own slots)."""
    if kernels not in available_kernels("cpu"):
        pytest.skip(f"kernels={kernels} do not run here")
    target = use_kernels(make_tiny_model("llama"), kernels)
    proposer, kept = _oracle(target, runner)
    batch, budgets, eos, _ = batch_case(target)
    decoder = SpeculativeDecoder(target, proposer, eos_token_id=eos, runner=kept)
    together = decoder.generate_batch(batch, budgets)
    for row in (0, 2, 3):
        alone = decoder.generate(batch[row], budgets[row])
        assert alone.tokens == together[row].tokens
        assert [r.path for r in alone.stats.rounds] == [r.path for r in together[row].stats.rounds]


def test_streaming_names_the_row_of_each_block():
    target = make_tiny_model("llama")
    proposer, kept = _oracle(target, "dynamic")
    batch, budgets, eos, refs = batch_case(target, n=3)
    blocks: dict[int, list[int]] = {}
    SpeculativeDecoder(target, proposer, eos_token_id=eos, runner=kept).generate_batch(
        batch, budgets, on_commit=lambda row, block: blocks.setdefault(row, []).extend(block)
    )
    assert [blocks[row] for row in range(3)] == refs


def test_batch_requests_are_checked_before_decoding():
    target = make_tiny_model("llama", max_position_embeddings=64)
    decoder = SpeculativeDecoder(target)
    with pytest.raises(ValueError, match="one max_new_tokens for all or one each"):
        decoder.generate_batch([[1, 2], [3]], [4, 4, 4])
    with pytest.raises(ValueError, match="generate_batch needs prompts"):
        decoder.generate_batch([], 4)
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate_batch([[1, 2], []], 4)
    with pytest.raises(ValueError, match="exceed the target's context of 64"):
        decoder.generate_batch([[1, 2], list(range(3, 63))], 8)
    with pytest.raises(ValueError, match="generate_batch decodes several"):
        decoder.generate(torch.tensor([[1, 2], [3, 4]]), 4)
    for bad in (96, -1):  # the tiny model's vocabulary: 96 ids
        with pytest.raises(
            ValueError,
            match=rf"prompt 1 holds token ids outside the target's vocabulary of 96: \[{bad}\]",
        ):
            decoder.generate_batch([[1, 2], [3, bad]], 4)


def test_a_proposer_without_fork_says_it_cannot_batch():
    class Single(Proposer):
        name = "single"

    assert Single().for_batch(1)[0].name == "single"  # one sequence needs no fork
    with pytest.raises(
        NotImplementedError, match="single cannot draft for several sequences at once"
    ):
        Single().for_batch(2)


def test_forks_share_the_model_and_keep_their_own_cache():
    target = make_tiny_model("llama")
    proposer = TemplateProposer(DraftLM(target), tree("chain5"))
    rows = proposer.for_batch(3)
    assert rows[0] is proposer and len({id(p) for p in rows}) == 3
    assert all(p.model.model is target for p in rows)
    assert len({id(p.model.cache) for p in rows}) == 3
    assert proposer.for_batch(2)[1] is rows[1]  # kept for the next batch


def test_methods_decode_batches_through_the_registry():
    """Engine methods batch through the one loop; Hugging Face's `generate` batches with left
    padding (its texts equal one sequence's at a time here, in float32); assisted generation
    and prompt lookup refuse batches, as Hugging Face does."""
    from eagle.bench.methods import METHODS, MethodContext, MethodError, build_method
    from eagle.sampling import SamplingPolicy

    target = make_tiny_model("llama")
    batch, budgets, eos, refs = batch_case(target, n=4)
    budget = max(budgets)
    ctx = MethodContext(target=target, draft_lm=lambda path: target, tree_dirs=(str(TREES),))
    for name in ("vanilla", "prompt_lookup", "eagle:static", "hf_generate"):
        sections = {"eagle": {"random": True}}
        method = build_method(name, ctx, sections)
        method.eos_token_id = eos
        assert method.batches
        assert method.static == name.endswith(":static")  # what the benchmark's warm-up reads
        got = [r.tokens for r in method.generate_batch(batch, budget, SamplingPolicy())]
        assert got == [method.generate(p, budget, SamplingPolicy()).tokens for p in batch], name
    for name in ("hf_assisted", "hf_prompt_lookup"):
        method = build_method(name, ctx, {"draft": {"model": "self"}})
        assert not method.batches and not METHODS[name].engine and not method.static
        with pytest.raises(MethodError, match="decode one sequence at a time"):
            method.generate_batch(batch[:2], 4, SamplingPolicy())
        assert (
            len(method.generate_batch(batch[:1], 4, SamplingPolicy())) == 1
        )  # a batch of one is one sequence


@pytest.mark.parametrize("runner", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["eagle", "draft_lm"])
def test_one_pass_and_forked_drafting_give_the_same_trees(kind, runner, monkeypatch):
    """EAGLE's drafter and a draft LM draft a batch in one pass per depth (rows of one cache);
    every other proposer, and EAGLE under compile, gives each sequence its own fork. Both are
    exact and accept the same paths, greedy."""
    from eagle.models.drafter import EagleDrafter
    from eagle.proposers import EagleDraftModel, eagle_proposer

    target = make_tiny_model("mistral")  # a sliding window crossed by the longer prompts

    def build():
        if kind == "eagle":
            return eagle_proposer(
                EagleDrafter.random(target, seed=1), tree("eagle_default"), cache=runner
            )
        return TemplateProposer(
            DraftLM(make_tiny_model("mistral", seed=1, num_hidden_layers=1), cache=runner),
            tree("eagle_default"),
        )

    case = batch_case(target)
    proposer = build()
    one_pass = run_batched_greedy(
        target,
        proposer,
        make_runner(runner, target, tree_size=proposer.max_nodes),
        case,
        "one pass",
    )
    assert proposer._one_pass
    monkeypatch.setattr(EagleDraftModel if kind == "eagle" else DraftLM, "batches_rows", False)
    proposer = build()
    forked = run_batched_greedy(
        target, proposer, make_runner(runner, target, tree_size=proposer.max_nodes), case, "forks"
    )
    assert not proposer._one_pass and proposer._forks
    assert [[r.path for r in res.stats.rounds] for res in one_pass] == [
        [r.path for r in res.stats.rounds] for res in forked
    ]


BATCHED = [
    "vanilla",
    "eagle",
    "draft",
    "prompt_lookup",
    "medusa",
    "specinfer_merge",
    "hf_generate",
    "eagle:static",
    "draft:static",
]


def test_a_stopped_batch_run_keeps_the_sizes_it_finished(models, tmp_path, monkeypatch):
    """batch.json is written after every batch size, smallest first whatever the order given
    (speedups "vs vanilla at the smallest size" need it first): a run stopped in its second size
    keeps the first. Greedy texts are compared with vanilla only in vanilla's dtype."""
    from decode import decode
    from eagle.bench import batch

    out, calls = tmp_path / "batch", []
    real = batch.summarise

    def stop_on_the_second_size(label, size, runs):
        calls.append(size)
        if len(set(calls)) > 1:
            raise KeyboardInterrupt
        return real(label, size, runs)

    monkeypatch.setattr(batch, "summarise", stop_on_the_second_size)
    cfg = decode_cfg(
        models,
        tmp_path,
        "mode=batch",
        f"batch.eval_sets=[{models / 'prompts.jsonl'}]",
        f"batch.out_dir={out}",
        "batch.sizes=[2,1]",
        "batch.num_prompts=2",
        "batch.methods=[vanilla,eagle]",
        "batch.dtypes={vanilla:float32,eagle:bfloat16}",
    )
    with pytest.raises(KeyboardInterrupt):
        decode(cfg)
    report = json.loads((out / "batch.json").read_text())
    assert report["status"] == "incomplete" and list(report["runs"][0]["sizes"]) == ["1"]
    one = report["runs"][0]["sizes"]["1"]
    assert one["vanilla"]["vs_vanilla_b1"] == pytest.approx(1.0)
    assert one["vanilla"]["identical_to_vanilla"] == 1.0
    assert one["eagle"]["identical_to_vanilla"] is None  # bf16 against float32: not exactness
    assert "B=1" in (out / "batch.md").read_text()
    # rerun as it was: the finished size is kept, only the second one runs
    calls.clear()
    monkeypatch.setattr(
        batch, "summarise", lambda label, size, runs: calls.append(size) or real(label, size, runs)
    )
    decode(cfg)
    resumed = json.loads((out / "batch.json").read_text())
    run = resumed["runs"][0]
    assert resumed["status"] == "complete" and calls == [2, 2] and list(run["sizes"]) == ["1", "2"]
    assert run["sizes"]["1"] == one and run["kept_from"] == {"1": report["date"]}
    assert "Timed by a stopped run that this one resumed: B=1" in (out / "batch.md").read_text()
    assert not (out / "previous").exists()
    calls.clear()
    decode(cfg)  # a finished report rerun: measured anew, the one before kept
    assert sorted(calls) == [1, 1, 2, 2] and len(list((out / "previous").iterdir())) == 1


def test_batch_mode_measures_every_method_at_each_size(models, tmp_path):
    """mode=batch: the same prompts at batch sizes 1, 2 and 3, every method against vanilla at its
    size, with tau per sequence, the round's split and greedy texts compared; a label with {B}
    names a tree per size; the report, its table (with EAGLE-1's Table 7) and the plot."""
    from decode import decode

    trees = tmp_path / "trees"
    trees.mkdir()
    for b, paths in ((1, "[[0], [1]]"), (2, "[[0]]"), (3, "[[0], [0, 0]]")):
        (trees / f"machine_b{b}.yaml").write_text(f"kind: paths\npaths: {paths}\n")
    out = tmp_path / "batch"
    per_size = f"eagle@{trees}/machine_b{{B}}.yaml"
    cfg = decode_cfg(
        models,
        tmp_path,
        "mode=batch",
        f"batch.eval_sets=[{models / 'prompts.jsonl'}]",
        f"batch.out_dir={out}",
        "batch.sizes=[1,2,3]",
        "batch.num_prompts=3",
        f"batch.methods=[{','.join(BATCHED)},'{per_size}']",
        "batch.dtypes={eagle:float32}",
    )
    decode(cfg)
    report = json.loads((out / "batch.json").read_text())
    assert report["status"] == "complete" and report["eagle1_table7"]["Vicuna-7B"]["1"] == 2.90
    (run,) = report["runs"]
    assert list(run["sizes"]) == ["1", "2", "3"]
    for b, results in run["sizes"].items():
        assert set(results) == {*BATCHED, per_size}
        assert results["vanilla"]["speedup"] == pytest.approx(1.0)
        plain = [results[name]["speedup_vs_fastest"] for name in ("vanilla", "hf_generate")]
        assert max(plain) == pytest.approx(1.0) and min(plain) <= 1.0  # against the fastest
        assert results[per_size]["method"] == f"eagle@{trees}/machine_b{b}.yaml"
        for name, r in results.items():
            assert r["new_tokens"] == 3 * 12 or r["tau"] >= 1.0, name  # 12 tokens each, or an EOS
            assert len(r["tau_per_sequence"]) == 3 and r["tokens_per_s"] > 0 and r["rounds"] > 0
            if name != "hf_generate":  # our engine: fp32 greedy texts are vanilla's, batched
                assert r["identical_to_vanilla"] == 1.0, (b, name)
    assert run["sizes"]["1"]["vanilla"]["vs_vanilla_b1"] == pytest.approx(1.0)
    table = (out / "batch.md").read_text()
    assert "EAGLE-1 paper, Vicuna-7B" in table and "B=3" in table
    assert "Against the fastest plain decoding" in table
    assert "| eagle@machine_b{B} |" in table  # a tree file's path cut to its name in the tables
    assert (out / "batch.png").stat().st_size > 0


def test_batch_mode_refuses_methods_that_decode_one_sequence(models, tmp_path):
    from decode import decode

    cfg = decode_cfg(
        models,
        tmp_path,
        "mode=batch",
        f"batch.eval_sets=[{models / 'prompts.jsonl'}]",
        "batch.sizes=[1,2]",
        "batch.methods=[vanilla,hf_assisted]",
    )
    with pytest.raises(MethodError, match="'hf_assisted' decodes one sequence at a time"):
        decode(cfg)
    cfg = decode_cfg(models, tmp_path, "mode=batch", "batch.methods=[eagle]")
    with pytest.raises(ValueError, match="put vanilla in its methods"):
        decode(cfg)
