"""The tree for this machine: the tree search run end to end.

The search itself is `eagle.bench.tree_search` (the probe tree's paths from every position, the
best subtree of each size, the cost model). `search_tree` runs it: it decodes the probe on
prompts the benchmark holds out, writes the candidates, times rounds of chains and candidates in
turns for the cost model (`measure_round_cost`), ranks the candidates for the machine (per batch
size too, by decoding at a temperature: `rank_sampled`, and for `eagle_lookup` with prompt lookup's
chain merged in: `choose_for_lookup`), writes machine.yaml (machine_lookup.yaml, ...) and
machine.json, and benchmarks the candidates against vanilla and the default tree.
`decode.py mode=tree_search` runs it on its config.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from eagle.bench.batch import summarise
from eagle.bench.benchmark import encode_prompt, warm_up, warmup_budget
from eagle.bench.builder import Methods
from eagle.bench.evalsets import load_eval_set, select
from eagle.bench.methods import MethodSpec, method_settings
from eagle.bench.precision import preferred
from eagle.bench.tree_search import (
    Candidate,
    MachineCost,
    candidates,
    chain_hits,
    choose_for_machine,
    choose_merged,
    position_paths,
    write_tree,
)
from eagle.hardware import auto_dtype
from eagle.progress import progress
from eagle.sampling import SamplingPolicy, seeded_generator
from eagle.tree import TreeTemplate, resolve_tree


@dataclass(frozen=True)
class TreeSearchConfig:
    """The search's settings: the `tree_search` section of configs/decode.yaml (whose comments give
    each one's reason), then what it reads of the run's other settings."""

    probe: str  # the probe tree: a name in the named trees or a YAML path
    num_prompts: int  # searched prompts of each eval set, held out from the benchmark's
    sizes: Sequence[int]  # draft nodes of the candidate trees
    temperatures: Sequence[float]  # of the comparison run
    cost_chains: Sequence[int]  # chains timed with the candidates for the cost model
    cost_prompts: int  # decodes per tree for the cost model
    cost_tokens: int  # ...this many tokens each
    dtype_margin: float  # bf16 kept only where its rounds are this much faster than float32's
    compare: bool  # benchmark the candidates afterwards
    batch_sizes: Sequence[int]  # also a tree per batch size
    sampled_temperature: float | None  # also rank the candidates decoding at this temperature
    sampled_prompts: int  # ...on this many prompts of each eval set
    out_dir: str
    eval_sets: Sequence[str]  # benchmark.eval_sets
    benchmark_prompts: int  # benchmark.num_prompts: the prompts the search leaves to the benchmark
    dtypes: Mapping[str, str]  # benchmark.dtypes: method label or base name -> dtype
    max_new_tokens: int
    warmup_tokens: int | None  # benchmark.warmup_tokens
    seed: int

    @classmethod
    def from_section(cls, section: Mapping[str, Any], **run: Any) -> TreeSearchConfig:
        """The `tree_search` section with what the search reads of the run's other settings
        (`run`). A typo or a setting taken out of the section is named before anything loads."""
        own = [f.name for f in fields(cls) if f.name not in run]  # the section's settings
        if unknown := sorted(set(section) - set(own)):
            raise ValueError(f"tree_search: unknown setting(s) {', '.join(unknown)} "
                             f"(it has {', '.join(own)})")
        if missing := [k for k in own if k not in section]:
            raise ValueError(f"tree_search: {', '.join(missing)} missing "
                             "(configs/decode.yaml's section sets each one)")
        return cls(**section, **run)


def search_tree(
    methods: Methods, ts: TreeSearchConfig, compare: Callable[..., Path] | None = None
) -> Path:
    """Run the probe tree from every position of each prompt's greedy text, keep the best
    subtree of each size (eagle.bench.tree_search), choose the one for this machine, then, with
    `ts.compare`, benchmark them against vanilla and the default tree (`compare`: the benchmark,
    called with names, temperatures, out_dir, tree_dirs and dtypes); the predicted and measured
    taus are written side by side. Returns the output folder."""
    if ts.compare and compare is None:
        raise ValueError(
            "search_tree: ts.compare is set, but no benchmark was given to compare the candidates"
        )
    out = Path(ts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    overrides = dict(ts.dtypes)
    # the probe's texts in float32 on a CPU, unless a dtype is asked for: every tree decodes the
    # same text there, so the predicted taus are exact, and a bf16 probe timed faster at EAGLE-1's
    # width made the search follow the machine's load (two runs on an AMX Xeon chose different
    # trees, LOG.md)
    dtype = "float32" if methods.probed("eagle", overrides) else methods.dtype("eagle", overrides)
    probe = resolve_tree(ts.probe, methods.tree_dirs())
    method = methods.build(f"eagle@{ts.probe}", dtype)
    _, tokenizer = methods.target(dtype)
    sets = [load_eval_set(name) for name in ts.eval_sets]  # each read once
    # the search tunes on prompts the benchmark (and the comparison below) does not take, from the
    # same categories
    searched = [
        p
        for every in sets
        for p in select(every, ts.num_prompts, held_out_from=ts.benchmark_prompts)
    ]
    prompts = [encode_prompt(tokenizer, p) for p in searched]
    benchmarked = {p.id for every in sets for p in select(every, ts.benchmark_prompts)}
    if seen := [p.id for p in searched if p.id in benchmarked]:
        print(
            f"[tree search] note: {len(seen)} of the searched prompts are among the benchmark's "
            "first "
            f"{ts.benchmark_prompts} of each set (a set too short for both): its figures there are "
            "not held out"
        )
    greedy = SamplingPolicy()

    def first_round(ids: list[int], max_new: int) -> tuple[int, ...]:
        rounds = method.generate(ids, max_new, greedy).stats.rounds
        return rounds[0].path if rounds else (0,)

    paths, texts = [], []
    probing = f"probe {probe.num_nodes} nodes, every position"
    for ids in progress(prompts, desc=probing, unit="prompt"):
        texts.append(method.generate(ids, ts.max_new_tokens, greedy).tokens)
        paths.append(position_paths(first_round, probe, ids, texts[-1]))
    (out / "probe_paths.json").write_text(json.dumps({"probe": probe.name, "paths": paths}))
    found = candidates(probe, paths, list(ts.sizes), ts.max_new_tokens)
    for c in found:
        write_tree(
            c, out / f"{c.tree.name}.yaml", source=f"{probe.name} over {len(prompts)} prompts"
        )
        print(f"[tree search] {c.tree.summary()}: predicted tau {c.predicted_tau:.2f}")
    cost, plain_ms, dtypes = measure_round_cost(methods, ts, prompts, found, out)
    vanilla_ms = min(plain_ms.values())  # the fastest plain decoding: the benchmark's "vs fastest"
    print(
        "[tree search] plain decoding: "
        + ", ".join(f"{d} {ms:.1f} ms" for d, ms in plain_ms.items())
    )
    ranking = choose_for_machine(found, cost, vanilla_ms)
    for r in ranking:
        r["dtype"] = dtypes[r["tree"]]
        print(
            f"[tree search] {r['tree']}: predicted round {r['predicted_round_ms']:.1f} ms in "
            f"{r['dtype']}, "
            f"speedup {r['predicted_speedup']:.2f}x (tau {r['predicted_tau']:.2f})"
        )
    chosen = next(c for c in found if c.tree.name == ranking[0]["tree"])
    write_tree(
        chosen,
        out / "machine.yaml",
        source=f"{chosen.tree.name}, chosen by the cost model of this machine",
    )
    # the search's record: what it was asked, in one line (a tree searched with another drafting
    # vocabulary or among other sizes is not the one asked for), and the dtype of every tree the
    # cost model measured and of each machine*.yaml written
    sizes = ",".join(str(int(s)) for s in ts.sizes)
    eagle = methods.sections["eagle"]
    machine = {
        "searched_with": f"draft_vocab={eagle['draft_vocab']} sizes=[{sizes}]",
        "drafter": str(eagle["drafter"]),
        "chosen": chosen.tree.name,
        "searched_prompts": [p.id for p in searched],
        "vanilla_ms": vanilla_ms,
        "vanilla_ms_by_dtype": plain_ms,
        "cost_model": cost.to_dict(),
        "ranking": ranking,
        "dtypes": {**dtypes, "machine": dtypes[chosen.tree.name]},
    }
    print(
        f"[tree search] the tree for this machine: {chosen.tree.summary()} -> "
        f"{out / 'machine.yaml'}"
    )
    machine["lookup"] = choose_for_lookup(
        methods, found, paths, prompts, texts, cost, vanilla_ms, dtypes, ts, out
    )
    machine["dtypes"]["machine_lookup"] = dtypes[machine["lookup"]["chosen"]]
    if (
        ranking[0]["predicted_speedup"] < 1.0
    ):  # said, not silent: the benchmark will show EAGLE behind plain decoding
        print(
            "[tree search] WARNING: no candidate is predicted faster than plain decoding on this "
            "machine "
            f"(best: {chosen.tree.name}, {ranking[0]['predicted_speedup']:.2f}x at tau "
            f"{ranking[0]['predicted_tau']:.2f}, "
            f"a round {ranking[0]['predicted_round_ms']:.1f} ms against {vanilla_ms:.1f} ms a "
            "token): the drafter "
            "accepts too little for what a round costs here; train it longer (make demo-long) or "
            "on data "
            "closer to the target's (make selfdistill)"
        )
    if ts.batch_sizes:  # the tree per batch size: a busier target wants a smaller one
        machine["batch"] = {}
        for size in sorted({int(b) for b in ts.batch_sizes}):
            cost_b, plain_b, dtypes_b = (
                (cost, plain_ms, dtypes)
                if size == 1
                else measure_round_cost(methods, ts, prompts, found, out, size=size)
            )
            vanilla_b = min(plain_b.values())
            ranked = choose_for_machine(found, cost_b, vanilla_b)
            pick = next(c for c in found if c.tree.name == ranked[0]["tree"])
            write_tree(
                pick,
                out / f"machine_b{size}.yaml",
                source=f"{pick.tree.name}, chosen by the cost model of batches of {size} "
                "on this machine",
            )
            for r in ranked:
                r["dtype"] = dtypes_b[r["tree"]]
            machine["batch"][str(size)] = {
                "chosen": pick.tree.name,
                "vanilla_ms": vanilla_b,
                "cost_model": cost_b.to_dict(),
                "ranking": ranked,
                "dtypes": dtypes_b,
            }
            machine["dtypes"][f"machine_b{size}"] = dtypes_b[pick.tree.name]
            print(
                f"[tree search] batches of {size}: {pick.tree.summary()} (predicted "
                f"{ranked[0]['predicted_speedup']:.2f}x "
                f"over vanilla batches of {size}) -> {out / f'machine_b{size}.yaml'}"
            )
    if ts.sampled_temperature:
        sample_prompts = [
            encode_prompt(tokenizer, p)
            for every in sets
            for p in select(every, ts.sampled_prompts, held_out_from=ts.benchmark_prompts)
        ]
        sampled = rank_sampled(
            methods, ts, sample_prompts, found, out, float(ts.sampled_temperature), dtypes
        )
        best = next(c for c in found if c.tree.name == sampled["ranking"][0]["tree"])
        name = f"machine_t{sampled['temperature']:g}.yaml"
        write_tree(
            best,
            out / name,
            source=f"{best.tree.name}, the fastest decoded at T={sampled['temperature']:g}",
        )
        machine["sampled"] = {**sampled, "chosen": best.tree.name}
        machine["dtypes"][Path(name).stem] = dtypes[best.tree.name]
        print(
            f"[tree search] at T={sampled['temperature']:g}: {best.tree.summary()} -> {out / name}"
        )
    (out / "machine.json").write_text(json.dumps(machine, indent=2))
    if not ts.compare or compare is None:
        return out
    names = ["vanilla", "eagle"] + [f"eagle@{c.tree.name}" for c in found]
    # vanilla in the dtype the cost model timed fastest: the predictions are against it, so are the
    # measurements
    fastest = min(plain_ms, key=plain_ms.get)
    compared = compare(
        names=names,
        temperatures=list(ts.temperatures),
        out_dir=out / "compare",
        tree_dirs=(str(out),),
        dtypes={"vanilla": fastest, **{f"eagle@{c.tree.name}": dtypes[c.tree.name] for c in found}},
    )
    summary = []

    def per_token_ms(m: dict) -> float:  # the rounds only, as the prediction (prefill excluded)
        return m["ms_per_round"] / m["tau"]

    for run in json.loads((compared / "results.json").read_text())["runs"]:
        ms = run["methods"]
        rows = [
            {
                "eval_set": run["eval_set"],
                "temperature": run["temperature"],
                "tree": c.tree.name,
                "nodes": c.tree.num_nodes,
                "depth": c.tree.depth,
                "predicted_tau": c.predicted_tau,
                "tau": ms[f"eagle@{c.tree.name}"]["tau"],
                "speedup": ms[f"eagle@{c.tree.name}"]["speedup"],  # tokens/s, prefill included
                "rounds_speedup": per_token_ms(ms["vanilla"])
                / per_token_ms(ms[f"eagle@{c.tree.name}"]),
            }
            for c in found
        ]
        summary += rows
        default, best = run["methods"]["eagle"], max(rows, key=lambda r: r["speedup"])
        print(
            f"[tree search] {run['eval_set']} T={run['temperature']:g}: default tree "
            f"{default['speedup']:.2f}x "
            f"(tau {default['tau']:.2f}); best candidate {best['tree']} {best['speedup']:.2f}x "
            f"(tau {best['tau']:.2f}, predicted {best['predicted_tau']:.2f}): "
            f"eagle.tree={out / best['tree']}.yaml"
        )
    predicted = {r["tree"]: r for r in ranking}
    for (
        row
    ) in summary:  # predicted_speedup compares with rounds_speedup: both leave the prefill out
        row |= {k: predicted[row["tree"]][k] for k in ("predicted_round_ms", "predicted_speedup")}
        row["machine_choice"] = row["tree"] == chosen.tree.name
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return out


def choose_for_lookup(
    methods: Methods,
    found: list[Candidate],
    paths: list,
    prompts: list[list[int]],
    texts: list[list[int]],
    cost: MachineCost,
    vanilla_ms: float,
    dtypes: dict[str, str],
    ts: TreeSearchConfig,
    out: Path,
) -> dict:
    """The tree for `eagle_lookup` (EAGLE's tree merged with prompt lookup's chain each round):
    the candidates ranked again with the chain that the method's settings draft at every probed
    position (`chain_hits`, `choose_merged`), written as machine_lookup.yaml. Where the text
    repeats itself the chain adds accepted tokens and verified ones alike, so the merge may want
    a smaller tree than EAGLE alone."""
    from eagle.proposers import PromptLookupProposer

    settings = method_settings(MethodSpec.parse("eagle_lookup"), methods.sections)
    eagle = method_settings(MethodSpec.parse("eagle"), methods.sections)
    if (settings.drafter, settings.random, settings.draft_vocab) != (
        eagle.drafter,
        eagle.random,
        eagle.draft_vocab,
    ):
        print(
            "[tree search] WARNING: eagle_lookup's drafter or drafting vocabulary differs from "
            "eagle's: its tree is "
            "ranked with eagle's probe, i.e. for eagle's drafter (eagle.drafter / "
            "eagle.draft_vocab)"
        )
    lookup = PromptLookupProposer(
        settings.num_tokens, settings.max_ngram, settings.min_ngram
    ).lookup
    chains = [chain_hits(lookup, ids, text) for ids, text in zip(prompts, texts, strict=True)]
    ranking = choose_merged(found, paths, chains, cost, vanilla_ms, ts.max_new_tokens)
    for r in ranking:
        r["dtype"] = dtypes[r["tree"]]
        print(
            f"[tree search] eagle_lookup on {r['tree']}: predicted round "
            f"{r['predicted_round_ms']:.1f} ms "
            f"({r['predicted_verified']:.1f} tokens verified), speedup "
            f"{r['predicted_speedup']:.2f}x "
            f"(tau {r['predicted_tau']:.2f})"
        )
    best = next(c for c in found if c.tree.name == ranking[0]["tree"])
    write_tree(
        Candidate(best.tree, ranking[0]["predicted_tau"]),
        out / "machine_lookup.yaml",
        source=f"{best.tree.name}, chosen by the cost model of this machine for eagle_lookup "
        "(merged with prompt lookup's chain)",
    )
    print(
        f"[tree search] the tree for eagle_lookup: {best.tree.summary()} -> "
        f"{out / 'machine_lookup.yaml'}"
    )
    return {
        "chosen": best.tree.name,
        "ranking": ranking,
        "settings": {
            "num_tokens": settings.num_tokens,
            "max_ngram": settings.max_ngram,
            "min_ngram": settings.min_ngram,
        },
    }


def bench_dtype(methods: Methods, ts: TreeSearchConfig, out: Path, label: str) -> str:
    """The dtype `Methods.dtype` gives `label` (`vanilla`, or `eagle@<tree of out>`): on a CPU with
    bf16, for a tree the faster one at its width in one timed forward (a small tree may verify
    faster in float32 than EAGLE-1's 26 tokens do). The cost model starts from it and decides
    between it and float32 by the trees' rounds (`measure_round_cost`)."""
    return methods.dtype(label, dict(ts.dtypes), tree_dirs=(str(out),))


def rotated(names: list[str], i: int) -> list[str]:
    """`names` starting at its i-th (mod its length): the order methods take turn i in, so that
    none is always first after the others have warmed the caches or met a busier machine."""
    return names[i % len(names) :] + names[: i % len(names)]


def plain_dtypes(methods: Methods, ts: TreeSearchConfig, out: Path) -> list[str]:
    """The dtypes plain decoding is timed in beside the trees: vanilla's own and, where bf16 is
    fast, bf16 too; the fastest of them is the benchmark's "vs fastest" baseline."""
    return list(
        dict.fromkeys(
            [bench_dtype(methods, ts, out, "vanilla"), auto_dtype(methods.device, wide=True)]
        )
    )


def measure_round_cost(
    methods: Methods,
    ts: TreeSearchConfig,
    prompts: list[list[int]],
    found: list,
    out: Path,
    size: int = 1,
) -> tuple[MachineCost, dict[str, float], dict[str, str]]:
    """Rounds measured on chains and on the candidate trees (short greedy decodes of a few
    batches of `size` prompts), fitted per dtype into a `MachineCost`; the round of plain decoding
    on the same batches in each dtype a benchmark compares (vanilla's own and, where bf16 is fast,
    bf16: the fastest is the "vs fastest" baseline); and the dtype of each tree. A batch round
    drafts every sequence's tree and verifies them all in one forward.

    On a CPU, a tree whose width the dtype probe (`bench_dtype`) timed faster in bf16 decodes here
    in both dtypes (unless `ts.dtypes` names its dtype), and keeps float32 unless its bf16
    rounds are faster by more than `ts.dtype_margin`: one verification forward timed
    alone chose bf16 where the benchmark's 7-token bf16 rounds then cost more than float32's
    (LOG.md). The cost model prices each tree in the dtype kept, from a fit of the rounds timed in
    that dtype only (`MachineCost`).

    The methods take turns batch by batch, in an order rotated at each batch: on a shared
    machine the same forward can cost much more a few minutes later (LOG.md), and timing one
    tree after another let that drift rank the trees."""
    greedy = SamplingPolicy()
    trees = [TreeTemplate.chain(k, name=f"chain{k}") for k in ts.cost_chains] + [
        c.tree for c in found
    ]
    for tree in trees[: len(ts.cost_chains)]:
        write_tree(Candidate(tree, 0.0), out / f"{tree.name}.yaml", source="cost model calibration")
    groups = [
        [prompts[(i + j) % len(prompts)] for j in range(size)] for i in range(ts.cost_prompts)
    ]
    longest = sorted(prompts, key=len, reverse=True)[:size]
    plain = plain_dtypes(methods, ts, out)
    overrides = dict(ts.dtypes)

    def tried_dtypes(tree: TreeTemplate) -> list[str]:
        """The probe's dtype for the tree and, where the probe chose another than float32, float32
        too: the rounds in turn below decide. A dtype asked for, or a GPU's, is kept as is."""
        label = f"eagle@{tree.name}"
        dtype = bench_dtype(methods, ts, out, label)
        return (
            [dtype, "float32"]
            if dtype != "float32" and methods.probed(label, overrides)
            else [dtype]
        )

    tried = {tree.name: tried_dtypes(tree) for tree in trees}
    runs = {f"vanilla {d}": methods.build("vanilla", d) for d in plain} | {
        f"{tree.name} {d}": methods.build(f"eagle@{tree.name}", d, tree_dirs=(str(out),))
        for tree in trees
        for d in tried[tree.name]
    }
    for (
        method
    ) in runs.values():  # untimed: kernels warm (and a static runner's buffers at their largest)
        method.generate_batch(
            longest, warmup_budget(method, ts.cost_tokens, ts.warmup_tokens), greedy
        )
    timed: dict[str, list] = {name: [] for name in runs}
    names = list(runs)
    turns = f"cost model: {len(names)} methods in turn"
    for i, group in enumerate(progress(groups, desc=turns, unit="batch")):
        for name in rotated(names, i):
            timed[name].append((runs[name].generate_batch(group, ts.cost_tokens, greedy), 0.0))
    per_round = {name: summarise(name, size, rows) for name, rows in timed.items()}
    round_ms = {name: r.draft_ms_per_round + r.verify_ms_per_round for name, r in per_round.items()}
    dtypes = {
        tree.name: preferred(
            {d: round_ms[f"{tree.name} {d}"] for d in tried[tree.name]},
            "float32",
            float(ts.dtype_margin),
        )
        for tree in trees
    }  # float32 unless another wins clearly
    for tree in trees:
        if len(tried[tree.name]) > 1:
            print(
                f"[tree search] {tree.name}: {dtypes[tree.name]} (rounds in turn: "
                + ", ".join(f"{d} {round_ms[f'{tree.name} {d}']:.1f} ms" for d in tried[tree.name])
                + ")"
            )
    # every round timed, in each dtype: one fit per dtype (a bf16 tree is not priced by float32's
    # curve)
    measured = [
        (
            tree,
            d,
            per_round[f"{tree.name} {d}"].draft_ms_per_round,
            per_round[f"{tree.name} {d}"].verify_ms_per_round,
        )
        for tree in trees
        for d in tried[tree.name]
    ]
    plain_ms = {d: round_ms[f"vanilla {d}"] for d in plain}
    return MachineCost.fit(measured, dtypes), plain_ms, dtypes


def rank_sampled(
    methods: Methods,
    ts: TreeSearchConfig,
    prompts: list[list[int]],
    found: list,
    out: Path,
    temperature: float,
    dtypes: dict[str, str],
) -> dict:
    """The candidates decoded at `temperature`, fastest first: the greedy search cannot see how
    siblings share a sampled round's residual, so this ranking is measured, not predicted.
    Each tree (in `dtypes`, the cost model's) and plain decoding (in each of `plain_dtypes`)
    decode every prompt for `max_new_tokens`, interleaved prompt by prompt in an order rotated at
    each prompt, so that the machine's drift reaches every tree alike; ms per token of the rounds
    (prefill excluded), and speedups against the fastest plain decoding, as the benchmark reports
    them. Sampled tau varies from prompt to prompt: more prompts, a steadier rank."""
    policy = SamplingPolicy(temperature=temperature)
    plain = {f"vanilla {d}": d for d in plain_dtypes(methods, ts, out)}
    runs = {name: methods.build("vanilla", d) for name, d in plain.items()} | {
        c.tree.name: methods.build(
            f"eagle@{c.tree.name}", dtypes[c.tree.name], tree_dirs=(str(out),)
        )
        for c in found
    }
    seconds, committed, rounds = (
        dict.fromkeys(runs, 0.0),
        dict.fromkeys(runs, 0),
        dict.fromkeys(runs, 0),
    )
    for method in runs.values():
        warm_up(
            method, prompts, ts.max_new_tokens, policy, seeded_generator(ts.seed, methods.device)
        )
    names = list(runs)
    bar = progress(prompts, desc=f"candidates at T={temperature:g}", unit="prompt")
    for i, p in enumerate(bar):
        for name in rotated(names, i):
            stats = (
                runs[name]
                .generate(
                    p, ts.max_new_tokens, policy, seeded_generator(ts.seed + i, methods.device)
                )
                .stats
            )
            seconds[name] += stats.draft_s + stats.verify_s
            committed[name] += stats.committed
            rounds[name] += stats.forwards
    ms = {name: 1000 * seconds[name] / max(committed[name], 1) for name in runs}
    fastest = min(plain, key=ms.get)
    ranking = sorted(
        (
            {
                "tree": c.tree.name,
                "nodes": c.tree.num_nodes,
                "tau": committed[c.tree.name] / max(rounds[c.tree.name], 1),
                "ms_per_token": ms[c.tree.name],
                "speedup": ms[fastest] / ms[c.tree.name],
            }
            for c in found
        ),
        key=lambda r: r["ms_per_token"],
    )
    print(
        f"[tree search] T={temperature:g} plain decoding: "
        + ", ".join(f"{d} {ms[name]:.2f} ms/token" for name, d in plain.items())
    )
    for r in ranking:
        print(
            f"[tree search] T={temperature:g} {r['tree']}: tau {r['tau']:.2f}, "
            f"{r['ms_per_token']:.2f} ms/token, "
            f"{r['speedup']:.2f}x the fastest plain decoding ({plain[fastest]})"
        )
    return {
        "temperature": temperature,
        "prompts": len(prompts),
        "tokens": int(ts.max_new_tokens),
        "vanilla_ms_per_token": ms[fastest],
        "vanilla_dtype": plain[fastest],
        "vanilla_ms_per_token_by_dtype": {d: ms[name] for name, d in plain.items()},
        "ranking": ranking,
    }
