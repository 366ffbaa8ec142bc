"""Benchmark: every method on the same target and prompts, in one run.

Speedup = a method's tokens/s divided by vanilla decoding's tokens/s measured in the same
run (same target, same prompts, same machine state), after a warm-up. Methods take turns
prompt by prompt, so load drift on a shared machine hits them alike. We report the
aggregate (total tokens / total time) and the median of the per-prompt speedups. tau =
tokens committed per target forward after the prefill, bonus token included
(`eagle.decoding.stats.tau`).
When the run also has `vanilla:static` (static cache, compiled when the run compiles),
`speedup_vs_static` is the same ratio against it: the fastest plain decoding is the baseline
a user compares with.
Peak memory: CUDA's peak allocation per method (`peak_memory_mb`); on a CPU the process's
peak RSS, once for the run (`machine.peak_rss_mb`): every method's models live in the one
process, so no figure per method would mean anything.

Output (in `out_dir`): results.json, results.md, speedup.png, tau.png, acceptance.png, and
speedup_vs_static.png when the run has vanilla:static.
"""

from __future__ import annotations

import hashlib
import math
import platform
import resource
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle.artifacts import files_stamp, keep_previous, stopped_report, write_json
from eagle.bench.evalsets import Prompt, load_eval_set
from eagle.bench.intervals import (
    RESAMPLES,
    error_bars,
    lead_share,
    resamplable,
    speedup_interval,
    tau_interval,
)
from eagle.bench.methods import Method, MethodError, MethodSpec, short
from eagle.decoding.engine import check_fits
from eagle.decoding.runners import ContextOverflowError
from eagle.decoding.stats import DecodeResult, accepted_histogram, tau
from eagle.progress import progress
from eagle.sampling import SamplingPolicy, seeded_generator
from eagle.target import TargetError, context_length
from eagle.tree import Tree, TreeError, resolve_tree

if TYPE_CHECKING:
    from eagle.bench.builder import Methods


@dataclass
class BenchmarkConfig:
    methods: Sequence[str] = ("vanilla", "eagle")
    temperatures: Sequence[float] = (0.0, 1.0)
    max_new_tokens: int = 128
    warmup: int = 1           # prompts decoded before timing each method (not recorded)
    warmup_tokens: int | None = None  # new tokens per warm-up decode (None: max_new_tokens); static
                                      # runners always warm up for max_new_tokens (`warm_up`)
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class MethodResult:
    method: str
    dtype: str
    lossless: bool
    tau: float
    tokens_per_s: float
    tokens_per_s_median: float
    speedup: float = float("nan")  # over vanilla (eager, growing cache)
    speedup_median: float = float("nan")
    speedup_vs_static: float = float("nan")  # over vanilla:static, when the run has it
    speedup_vs_static_median: float = float("nan")
    # over the fastest plain decoding of the run (`fastest_vanilla`)
    speedup_vs_fastest: float = float("nan")
    # 95% bootstrap intervals over the run's prompts (eagle.bench.intervals; None with one prompt,
    # and the speedup's also without a plain decoding in the run)
    tau_ci: tuple[float, float] | None = None
    speedup_vs_fastest_ci: tuple[float, float] | None = None
    new_tokens: int = 0
    seconds: float = 0.0
    draft_frac: float = 0.0
    verify_frac: float = 0.0
    other_frac: float = 0.0
    ms_per_token: float = 0.0
    # per target forward after the prefill, prefill time excluded (HF methods: included)
    ms_per_round: float = 0.0
    draft_ms_per_round: float = 0.0
    verify_ms_per_round: float = 0.0
    accepted_hist: list[int] = field(default_factory=list)
    acceptance_by_depth: list[float] = field(default_factory=list)  # P(accepted >= d), d = 1..
    # the fixed draft tree (node 0 = root), if the method has one
    tree_parents: list[int] | None = None
    # P(node i on the accepted path), i = 0..N, full-tree rounds
    acceptance_by_node: list[float] | None = None
    peak_memory_mb: float | None = None  # CUDA only: the peak allocation while it decoded
    # greedy runs: which decode the text was compared with (vanilla decoding in the method's own
    # dtype, and runner when in the run), and the share of prompts with the same text
    reference: str | None = None
    identical_to_reference: float | None = None
    identical_to_fp32: float | None = None  # against float32 vanilla: what the model itself says
    # per prompt, in prompt order: tokens, committed, forwards, seconds (error bars by resampling
    # prompts)
    per_prompt: dict[str, list[float]] = field(default_factory=dict)


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    if not prompt.text.strip():
        raise ValueError(f"prompt {prompt.id!r} is empty")
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return list(ids)
    ids = tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + list(ids)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )  # process peak RSS (KB on Linux)


def acceptance_by_node(parents: Sequence[int], results: list[DecodeResult]) -> list[float]:
    """Share of rounds in which each node of a fixed tree lies on the accepted path (the root:
    1.0). Only rounds that scored the whole tree count (the last round may draft fewer)."""
    n = len(Tree.of(parents))
    hits, rounds = [0] * n, 0
    for r in (r for res in results for r in res.stats.rounds):
        if r.tree_size != n - 1:
            continue
        rounds += 1
        for i in r.path:
            hits[i] += 1
    return [h / max(rounds, 1) for h in hits]


def summarise(method: Method, dtype: str, results: list[DecodeResult]) -> MethodResult:
    """Aggregate statistics of one method over prompts (one `DecodeResult` each)."""
    stats = [res.stats for res in results]
    tokens = sum(len(res.tokens) for res in results)
    seconds = sum(s.total_s for s in stats)
    forwards = sum(s.forwards for s in stats)
    accepted = [r.accepted for s in stats for r in s.rounds]
    hist = accepted_histogram(accepted)
    depth = len(hist) - 1
    draft, verify = sum(s.draft_s for s in stats), sum(s.verify_s for s in stats)
    rounds_s = seconds - sum(s.prefill_s for s in stats)
    return MethodResult(
        method=method.name,
        dtype=dtype,
        lossless=method.lossless,
        tau=tau(sum(s.committed for s in stats), forwards),
        tokens_per_s=tokens / seconds if seconds else 0.0,
        tokens_per_s_median=statistics.median(len(res.tokens) / res.seconds for res in results),
        new_tokens=tokens,
        seconds=seconds,
        draft_frac=draft / seconds if seconds else 0.0,
        verify_frac=verify / seconds if seconds else 0.0,
        other_frac=max(0.0, 1 - (draft + verify) / seconds)
        if seconds and (draft or verify)
        else 0.0,
        ms_per_token=1000 * seconds / max(tokens, 1),
        ms_per_round=1000 * rounds_s / max(forwards, 1),
        draft_ms_per_round=1000 * draft / max(forwards, 1),
        verify_ms_per_round=1000 * verify / max(forwards, 1),
        accepted_hist=hist,
        acceptance_by_depth=[sum(hist[d:]) / max(len(accepted), 1) for d in range(1, depth + 1)],
        tree_parents=list(method.tree_parents) if method.tree_parents else None,
        acceptance_by_node=acceptance_by_node(method.tree_parents, results)
        if method.tree_parents
        else None,
        per_prompt={
            "tokens": [len(res.tokens) for res in results],
            "committed": [s.committed for s in stats],
            "forwards": [s.forwards for s in stats],
            "seconds": [s.total_s for s in stats],
        },
    )


def warm_up(
    method: Method,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    policy: SamplingPolicy,
    generator: torch.Generator | None = None,
    count: int = 1,
    tokens: int | None = None,
) -> None:
    """Decode the `count` longest prompts, untimed, for `tokens` new tokens (None: all
    `max_new_tokens`).

    A method on a static runner always decodes the full `max_new_tokens`: its buffers reach the
    size of the largest timed request, and under compile the graphs the timed decodes need are
    built first (a static cache's size is part of its graph, and a compiled `StaticRunner` keeps
    its largest cache: LOG.md, a shorter warm-up compiled inside the timed region). Growing
    caches run eagerly and are warm after a few dozen tokens (kernels chosen for every row
    count a round verifies); the rest of a full-length warm-up is time the run spends untimed.
    """
    new = warmup_budget(method, max_new_tokens, tokens)
    for ids in sorted(prompts, key=len, reverse=True)[:count]:
        method.generate(ids, new, policy, generator)


@contextmanager
def _named(set_name: str, prompt: Prompt, method: str) -> Iterator[None]:
    """A request past a context, named by its eval set, prompt and method (the engine's message
    gives only lengths)."""
    try:
        yield
    except ContextOverflowError as err:
        raise ContextOverflowError(
            f"{set_name} prompt {prompt.id!r}{f', {method}' if method else ''}: {err} "
            f"(lower max_new_tokens, or leave the prompt out)"
        ) from err


def warmup_budget(method: Method, max_new_tokens: int, tokens: int | None) -> int:
    """New tokens of a warm-up decode before timed ones of `max_new_tokens` (`warm_up`)."""
    return max_new_tokens if tokens is None or method.static else min(tokens, max_new_tokens)


def build_all(
    build: Callable[[str], tuple[Method, str]], names: Sequence[str]
) -> dict[str, tuple[Method, str]]:
    """Every method of the run, built up front; the ones that cannot be built are named together."""
    methods, errors = {}, []
    for name in names:
        try:
            methods[name] = build(name)
        except (
            ValueError,
            OSError,
            TargetError,
        ) as err:  # a missing or mismatched checkpoint, a bad setting
            errors.append(f"{name}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    if errors:
        raise MethodError(
            f"{len(errors)} of {len(names)} methods cannot be built (drop them from "
            f"benchmark.methods or fix their settings): " + "; ".join(errors)
        )
    return methods


def run_benchmark(
    eval_sets: dict[str, list[Prompt]],
    tokenizer,
    build: Callable[[str], tuple[Method, str]],
    cfg: BenchmarkConfig,
    target_name: str,
    out_dir: str | Path,
    device=None,
    reference: Callable[[str], Method] | None = None,
    dtype_choices: Mapping | None = None,
    kernels: Mapping | None = None,
    resume_key: Mapping | None = None,
) -> dict:
    """Run every method on every eval set and temperature; write results into `out_dir`.

    Args:
        eval_sets: name -> prompts.
        build: method name -> (method, dtype name); every method is built before any is run, so
            a method that cannot be built (a missing checkpoint) stops the run at once.
        reference: dtype name -> vanilla decoding in that dtype. Greedy texts are compared with
            vanilla in each method's own dtype and, on a CPU, with float32 vanilla; the
            references the run does not time are decoded (untimed) with this. On a GPU float32
            is a reference only when a method runs in it: a float32 copy of a bf16 7B-70B target
            takes 28-280 GB more.
        dtype_choices: tree width -> the `eagle.bench.precision.DtypeChoice` measured while
            `build` ran (read after building), stored under machine.dtype_measured.
        kernels: dtype -> the linear kernels its models ran (a name, or the
            `eagle.bench.precision.KernelChoice` measured), read after building; machine.kernels.
        resume_key: everything else that decides the measurements (JSON: the caller's settings,
            its inputs' stamps). A stopped report in `out_dir` with the same key resumes: its
            finished (eval set, temperature) runs are kept, each still timed within one process,
            and the others are run. None: never resume.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = _finished_runs(out_dir, resume_key)
    if kept:
        print(
            f"[benchmark] resuming the stopped run in {out_dir}: {len(kept)} (eval set, "
            "temperature) runs kept "
            f"({', '.join(f'{s} T={t:g}' for s, t in kept)}), made with the same settings and "
            "inputs"
        )
    else:
        keep_previous(out_dir, REPORT_FILES)  # a fixed out_dir run again: the last report is kept
    device = torch.device(device or "cpu")
    if not cfg.methods:
        raise MethodError("benchmark.methods is empty: name at least one method")
    methods = build_all(build, cfg.methods)
    runs = []
    total = sum(len(p) for p in eval_sets.values()) * len(cfg.temperatures) * len(cfg.methods)
    bar = progress(total=total, desc="benchmark", unit="prompt")
    context = context_length(
        next(iter(methods.values()))[0].target
    )  # every method decodes the same target
    for set_name, prompts in eval_sets.items():
        encoded = [encode_prompt(tokenizer, p) for p in prompts]
        for prompt, ids in zip(
            prompts, encoded
        ):  # before any is decoded: which prompt, not minutes later
            with _named(set_name, prompt, ""):
                check_fits(len(ids), cfg.max_new_tokens, 0, context)
        for temperature in cfg.temperatures:
            if (set_name, float(temperature)) in kept:
                runs.append(kept[set_name, float(temperature)])
                bar.update(len(prompts) * len(cfg.methods))
                continue
            policy = SamplingPolicy(
                temperature=temperature,
                top_k=cfg.top_k if temperature else 0,
                top_p=cfg.top_p if temperature else 1.0,
            )
            results: dict[str, MethodResult] = {}
            outputs: dict[str, list[list[int]]] = {}
            for name in cfg.methods:
                bar.set_postfix_str(f"{set_name} T={temperature} {name} warm-up")
                warm_up(
                    methods[name][0],
                    encoded,
                    cfg.max_new_tokens,
                    policy,
                    seeded_generator(cfg.seed, device),
                    count=cfg.warmup,
                    tokens=cfg.warmup_tokens,
                )
            # Methods take turns prompt by prompt (in a rotating order), so a drift in the load
            # of a shared machine falls on every method alike rather than on whichever ran
            # during it. Each method keeps its own generator: its samples do not depend on the
            # others.
            generators = {name: seeded_generator(cfg.seed, device) for name in cfg.methods}
            outcomes: dict[str, list[DecodeResult]] = {name: [] for name in cfg.methods}
            peaks: dict[str, float | None] = dict.fromkeys(
                cfg.methods, 0.0 if device.type == "cuda" else None
            )
            for i, ids in enumerate(encoded):
                shift = i % len(cfg.methods)
                for name in list(cfg.methods[shift:]) + list(cfg.methods[:shift]):
                    bar.set_postfix_str(f"{set_name} T={temperature} {name}")
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                        torch.cuda.reset_peak_memory_stats(device)
                    with _named(set_name, prompts[i], name):
                        outcomes[name].append(
                            methods[name][0].generate(
                                ids, cfg.max_new_tokens, policy, generators[name]
                            )
                        )
                    if device.type == "cuda":
                        peaks[name] = max(peaks[name], peak_memory_mb(device))
                    bar.update(1)
            for name in cfg.methods:
                method, dtype = methods[name]
                result = summarise(method, dtype, outcomes[name])
                result.peak_memory_mb = peaks[name]
                results[name], outputs[name] = result, [o.tokens for o in outcomes[name]]
            _speedups(results)
            runs.append(
                {
                    "eval_set": set_name,
                    "temperature": float(temperature),
                    "target": target_name,
                    "num_prompts": len(prompts),
                    "max_new_tokens": cfg.max_new_tokens,
                    "prompts": [p.id for p in prompts],
                    "categories": [p.category for p in prompts],
                    "fastest_vanilla": fastest_vanilla(results),
                    # what timed it (the report's machine is the last process's: a resumed run's
                    # kept runs were timed by another)
                    "threads": torch.get_num_threads(),
                    "kernels": {
                        d: k if isinstance(k, str) else k.kernels
                        for d, k in (kernels or {}).items()
                    },
                    "methods": {k: asdict(v) for k, v in results.items()},
                    # what was decoded (and, greedy, compared): every method's new text per prompt
                    "texts": {k: [tokenizer.decode(t) for t in v] for k, v in outputs.items()},
                }
            )
            # each finished (eval set, temperature) is on disk at once: a stopped run keeps it, also
            # when decoding the references below fails (a float32 copy of a large target: memory)
            write_report(
                _report(runs, cfg, device, dtype_choices, kernels, resume_key, complete=False),
                out_dir,
            )
            if policy.greedy:
                texts = _reference_texts(
                    results,
                    outputs,
                    encoded,
                    cfg.max_new_tokens,
                    reference,
                    bar,
                    float32=device.type == "cpu",
                )
                _compare_texts(results, outputs, texts)
                runs[-1]["methods"] = {k: asdict(v) for k, v in results.items()}
            runs[-1]["finished"] = True  # a resumed run keeps it (`_finished_runs`)
            write_report(
                _report(runs, cfg, device, dtype_choices, kernels, resume_key, complete=False),
                out_dir,
            )
    bar.close()
    report = _report(runs, cfg, device, dtype_choices, kernels, resume_key, complete=True)
    write_report(report, out_dir)
    return report


@dataclass(frozen=True)
class RunSettings:
    """What a caller's settings add to a run's resume key (`resume_key`): the settings its
    measurements depend on (the method sections included), its own section, and the files
    its models and prompts are read from."""

    settings: Mapping[str, Any]
    section: Mapping[str, Any]
    files: Sequence[str]


def resume_key(
    run: RunSettings,
    names: Sequence[str],
    temperatures: Sequence[float],
    dtypes: Mapping[str, str],
    tree_dirs: Sequence[str],
    eval_sets: Mapping[str, Sequence[Prompt]],
) -> dict:
    """What decides a benchmark's measurements: the settings, the methods, their trees and the
    prompts, the threads and libraries timing them, and the stamps of the files they read (a
    drafter retrained in the same folder is another drafter). A stopped run resumes only when
    nothing of it changed (`run_benchmark`; `eagle.bench.batch.run_batch_benchmark` with
    `names` holding each batch size's tree). `tree_dirs`: where tree names are looked up."""
    # the output folder is a time stamp by default, and it is where the stopped report is found
    section = {k: v for k, v in run.section.items() if k != "out_dir"}
    trees = {}  # each method's tree as drafted: a file may hold another tree than when the
    for name in names:  # stopped run read it
        spec = MethodSpec.parse(name)
        tree = spec.tree or (run.settings.get(spec.info.section) or {}).get("tree")
        try:
            trees[name] = list(resolve_tree(tree, tree_dirs).parents) if tree else None
        except (TreeError, OSError):
            trees[name] = None  # building the method says what is wrong with it
    prompts = {
        k: [[p.id, p.chat, hashlib.sha256(p.text.encode()).hexdigest()[:16]] for p in v]
        for k, v in eval_sets.items()
    }
    return {
        "settings": dict(run.settings),
        "benchmark": section,
        "methods": list(names),
        "trees": trees,
        "temperatures": [float(t) for t in temperatures],
        "dtypes": dict(dtypes),
        "tree_dirs": list(tree_dirs),
        "prompts": prompts,
        "inputs": files_stamp(list(run.files)),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


@dataclass(frozen=True)
class BenchmarkPlan:
    """A benchmark as configs/decode.yaml's `benchmark` section gives it: the methods,
    temperatures and sampling (`config`), `num_prompts` of each of `eval_sets`, their rendering
    (`chat`: True or False for every prompt, None for each set's own), the dtypes asked for (by
    method label or base name), the output folder, and what the caller's settings add to the
    resume key (`resume`; None: never resume)."""

    config: BenchmarkConfig
    eval_sets: Sequence[str]
    num_prompts: int | None
    out_dir: str | Path
    chat: bool | None = None
    dtypes: Mapping[str, str] = field(default_factory=dict)
    resume: RunSettings | None = None


def benchmark(
    methods: Methods,
    plan: BenchmarkPlan,
    names: Sequence[str] | None = None,
    temperatures: Sequence[float] | None = None,
    out_dir: str | Path | None = None,
    tree_dirs: tuple[str, ...] = (),
    dtypes: Mapping[str, str] | None = None,
) -> Path:
    """Run `plan` with `methods` (`eagle.bench.builder.Methods`); the arguments override the
    plan's, and `dtypes` add to its. Prints the report and returns its folder. The tree search
    compares its candidates through it (`eagle.bench.machine_tree.search_tree`)."""
    names = list(names or plan.config.methods)
    dtypes = {**plan.dtypes, **(dtypes or {})}
    for name in names:
        MethodSpec.parse(name)  # unknown names fail before any model is loaded
    eval_sets = {Path(name).stem: load_eval_set(name, plan.num_prompts) for name in plan.eval_sets}
    _, tokenizer = methods.target(methods.dtype("vanilla", dtypes))
    if plan.chat is not None:  # one rendering for every prompt, instead of each set's own
        if plan.chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"benchmark.chat=true, but the target {methods.target_path}'s "
                "tokenizer has no chat template"
            )
        eval_sets = {k: [replace(p, chat=bool(plan.chat)) for p in v] for k, v in eval_sets.items()}

    def build(name: str):
        dtype = methods.dtype(name, dtypes, tree_dirs)
        return methods.build(name, dtype, tree_dirs), dtype

    config = replace(
        plan.config,
        methods=tuple(names),
        temperatures=tuple(temperatures or plan.config.temperatures),
    )
    out_dir = Path(out_dir or plan.out_dir)
    key = None
    if plan.resume is not None:
        key = resume_key(
            plan.resume, names, config.temperatures, dtypes, methods.tree_dirs(tree_dirs), eval_sets
        )
    run_benchmark(
        eval_sets,
        tokenizer,
        build,
        config,
        target_name=methods.target_path,
        out_dir=out_dir,
        device=methods.device,
        reference=lambda dtype: methods.build("vanilla", dtype),
        dtype_choices=methods.measured,
        kernels=methods.kernels,
        resume_key=key,
    )
    print((out_dir / "results.md").read_text())
    return out_dir


def _finished_runs(out_dir: Path, key: Any) -> dict[tuple[str, float], dict]:
    """The finished (eval set, temperature) runs of a stopped report in `out_dir` that was made
    with `key` (none for another key, a finished report, or none given), each marked with the
    date of the run that timed it (`kept_from`)."""
    report = stopped_report(out_dir / "results.json", key)
    if report is None:
        return {}
    return {
        (r["eval_set"], float(r["temperature"])): r
        | {"kept_from": r.get("kept_from", report.get("date"))}
        for r in report.get("runs", [])
        if r.get("finished")
    }


def _report(
    runs: list[dict],
    cfg: BenchmarkConfig,
    device: torch.device,
    dtype_choices: Mapping | None,
    kernels: Mapping | None,
    key: Any,
    complete: bool,
) -> dict:
    """The results.json of the runs so far; `status` says whether every one is in."""
    return {
        "status": "complete" if complete else "incomplete",
        "runs": runs,
        "resume_key": key,
        "config": asdict(cfg)
        | {"methods": list(cfg.methods), "temperatures": list(cfg.temperatures)},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": str(device),
            # on a CPU one figure for the whole run: every method's models share the process
            "peak_rss_mb": None if device.type == "cuda" else round(peak_memory_mb(device), 1),
            "dtype_measured": {str(w): asdict(c) for w, c in (dtype_choices or {}).items()},
            "kernels": {
                d: k if isinstance(k, str) else asdict(k) for d, k in (kernels or {}).items()
            },
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _speedups(results: dict[str, MethodResult]) -> None:
    """Speedups against vanilla (and vanilla:static) of the same run: the aggregate one (total
    tokens / total time, each), and the median over prompts of the per-prompt speedups (a prompt
    against itself: a ratio of two medians could pair different prompts); the speedup over the
    fastest plain decoding, and 95% intervals over the prompts of it and of tau, every method
    resampled on the same draws (eagle.bench.intervals)."""

    def rates(r: MethodResult) -> list[float]:
        p = r.per_prompt
        return [t / s if s else 0.0 for t, s in zip(p.get("tokens", []), p.get("seconds", []))]

    for base_name, key in (("vanilla", "speedup"), ("vanilla:static", "speedup_vs_static")):
        base = results.get(base_name)
        if base is None or not base.tokens_per_s:
            continue
        for r in results.values():
            setattr(r, key, r.tokens_per_s / base.tokens_per_s)
            pairs = [a / b for a, b in zip(rates(r), rates(base)) if b]
            setattr(r, key + "_median", statistics.median(pairs) if pairs else float("nan"))

    fastest = fastest_vanilla(results)
    for r in results.values():
        if resamplable(r.per_prompt):
            r.tau_ci = tau_interval(r.per_prompt)
        if fastest is not None:
            r.speedup_vs_fastest = r.tokens_per_s / results[fastest].tokens_per_s
            if resamplable(r.per_prompt) and resamplable(
                results[fastest].per_prompt
            ):  # the same draws: paired
                r.speedup_vs_fastest_ci = speedup_interval(
                    r.per_prompt, results[fastest].per_prompt
                )


def is_plain_decoding(name: str) -> bool:
    """Vanilla decoding in any runner or dtype (`vanilla`, `vanilla:static`, ...) or Hugging
    Face's own `generate`: the baselines a speedup may be taken against."""
    return name in ("vanilla", "hf_generate") or name.startswith(("vanilla:", "vanilla@"))


def fastest_vanilla(results: Mapping[str, MethodResult]) -> str | None:
    """The plain decoding with the most tokens/s in the run (None when there is none)."""
    plain = [name for name, r in results.items() if is_plain_decoding(name) and r.tokens_per_s]
    return max(plain, key=lambda name: results[name].tokens_per_s) if plain else None


def _reference_texts(
    results: dict[str, MethodResult],
    outputs: dict[str, list[list[int]]],
    prompts: list[list[int]],
    max_new_tokens: int,
    reference: Callable[[str], Method] | None,
    bar,
    float32: bool = True,
) -> dict[str, list[list[int]]]:
    """Greedy vanilla texts in every dtype the run uses (and in float32 with `float32`), label
    -> texts: the timed vanilla (and vanilla:static) ones, and untimed ones for the dtypes they
    lack. A static method's reference is vanilla:static where the run timed it in its dtype (a GPU
    run of static methods only: an eager vanilla decoded as well cost ~7 s a prompt there), so no
    eager one is decoded for it."""
    texts = {
        f"{name} ({r.dtype})": outputs[name]
        for name, r in results.items()
        if name in ("vanilla", "vanilla:static")
    }
    needed = {
        r.dtype
        for name, r in results.items()
        if name != "vanilla:static"
        and not (name.endswith(":static") and f"vanilla:static ({r.dtype})" in texts)
    }
    for dtype in sorted(needed | ({"float32"} if float32 else set())):
        if f"vanilla ({dtype})" not in texts and reference is not None:
            bar.set_postfix_str(f"reference: vanilla in {dtype}")
            method = reference(dtype)
            texts[f"vanilla ({dtype})"] = [
                method.generate(ids, max_new_tokens, SamplingPolicy()).tokens for ids in prompts
            ]
    return texts


def _compare_texts(
    results: dict[str, MethodResult],
    outputs: dict[str, list[list[int]]],
    texts: dict[str, list[list[int]]],
) -> None:
    """Each method's greedy texts against vanilla in its own dtype (its own runner when the run
    timed that one: a static method against vanilla:static) and against float32 vanilla."""

    def share(name: str, ref: list[list[int]]) -> float:
        return sum(a == b for a, b in zip(outputs[name], ref)) / max(len(outputs[name]), 1)

    fp32 = texts.get("vanilla (float32)")
    for name, r in results.items():
        runner = ":static" if name.endswith(":static") else ""
        own = f"{name} ({r.dtype})"  # a vanilla method is not its own reference
        label = next(
            (
                k
                for k in (f"vanilla{runner} ({r.dtype})", f"vanilla ({r.dtype})")
                if k in texts and k != own
            ),
            None,
        )
        if label is not None:
            r.reference, r.identical_to_reference = label, share(name, texts[label])
        if fp32 is not None and own != "vanilla (float32)":
            r.identical_to_fp32 = share(name, fp32)


def markdown_table(report: dict) -> str:
    kernels = report.get("machine", {}).get("kernels") or {}
    lines = (
        [
            (
                "Linear kernels (eagle/kernels): "
                + ", ".join(
                    f"{dtype} {k if isinstance(k, str) else k['kernels'] + ' (measured faster)'}"
                    for dtype, k in kernels.items()
                )
                + "\n"
            )
        ]
        if kernels
        else []
    )
    for run in report["runs"]:
        static = "vanilla:static" in run["methods"]  # the compiled/static baseline is in this run
        lines += [
            f"### {run['eval_set']}, temperature {run['temperature']:g} "
            f"({run['num_prompts']} prompts, {run['max_new_tokens']} new tokens, target "
            f"{run['target']})",
            "",
            f"speedup: over `vanilla`; vs fastest: over the fastest plain decoding of the run "
            f"(`{run.get('fastest_vanilla')}`)"
            + (
                f"; timed by a stopped run of {run['kept_from']} that this one resumed"
                if run.get("kept_from")
                else ""
            ),
            "",
            "| method | dtype | tau | tokens/s | ms/token | "
            + ("speedup vs static | " if static else "")
            + "speedup | median speedup | vs fastest | draft / verify / other | "
            "ms/round (draft + verify) | "
            "lossless | same text as (greedy) |",
            "|---|---|---:|---:|---:|"
            + ("---:|" if static else "")
            + "---:|---:|---:|---|---|---|---|",
        ]
        for m in run["methods"].values():
            split = (
                f"{m['draft_frac']:.0%} / {m['verify_frac']:.0%} / {m['other_frac']:.0%}"
                if m["draft_frac"] or m["verify_frac"]
                else "-"
            )
            per_round = (
                f"{m['ms_per_round']:.2f} ({m['draft_ms_per_round']:.2f} + "
                f"{m['verify_ms_per_round']:.2f})"
                if m["draft_frac"] or m["verify_frac"]
                else "-"
            )
            ident = same_text(m)
            speeds = (["speedup_vs_static"] if static else []) + [
                "speedup",
                "speedup_median",
                "speedup_vs_fastest",
            ]
            speed = " | ".join(
                "-" if math.isnan(m.get(k, math.nan)) else f"{m[k]:.2f}x" + with_interval(m, k)
                for k in speeds
            )
            lines.append(
                f"| {m['method']} | {m['dtype']} | {m['tau']:.2f}{with_interval(m, 'tau')} | "
                f"{m['tokens_per_s']:.1f} | {m['ms_per_token']:.2f} | {speed} | {split} | "
                f"{per_round} | "
                f"{'yes' if m['lossless'] else 'NO (lossy)'} | {ident} |"
            )
        lines.append("")
        lines += lead_lines(run)
        lines += tau_by_category(run)
    return "\n".join(lines + summary_table(report["runs"]))


def summary_table(runs: list[dict]) -> list[str]:
    """Markdown lines: every method's tau and speedup over the fastest plain decoding (with its
    95% interval) in each run side by side, one row a method (tree files cut to their names):
    the run at a glance, printed last. Nothing for a report of one run."""
    if len(runs) < 2:
        return []
    names = list(dict.fromkeys(name for run in runs for name in run["methods"]))
    lines = [
        "",
        "### Summary: tau and speedup over the fastest plain decoding (95% interval over the "
        "prompts)",
        "",
        "| method | "
        + " | ".join(f"{r['eval_set']} T={r['temperature']:g}: tau | speedup" for r in runs)
        + " |",
        "|---|" + "---:|---:|" * len(runs),
    ]
    for name in names:
        cells = []
        for run in runs:
            m = run["methods"].get(name)
            speed = m.get("speedup_vs_fastest", math.nan) if m else math.nan
            cells.append(
                "- | -"
                if m is None
                else f"{m['tau']:.2f} | "
                + (
                    "-"
                    if math.isnan(speed)
                    else f"{speed:.2f}x{with_interval(m, 'speedup_vs_fastest')}"
                )
            )
        lossy = any(not run["methods"][name]["lossless"] for run in runs if name in run["methods"])
        lines.append(f"| {short(name)}{' (LOSSY)' if lossy else ''} | " + " | ".join(cells) + " |")
    leads = [(run, found) for run in runs if (found := lead(run)) is not None]
    if leads:  # each run's lead, in one line a run
        lines += [
            "",
            f"Fastest lossless method that drafts, and the share of {RESAMPLES:,} resamples of the "
            "prompts "
            "in which it decodes faster than the next methods:",
            "",
        ]
        lines += [
            f"- {run['eval_set']} T={run['temperature']:g}: {short(leader['method'])}, faster than "
            + ", ".join(f"{short(m['method'])} in {share:.0%}" for m, share in rivals)
            for run, (leader, rivals) in leads
        ]
    return lines + [""]


def with_interval(m: dict, key: str) -> str:
    """The text " [lo, hi]": the 95% interval over prompts of `tau` or `speedup_vs_fastest`, where
    the run has one (eagle.bench.intervals); "" for other columns and for runs of one prompt."""
    ci = m.get(f"{key}_ci")
    if not ci:
        return ""
    lo, hi = (
        f"{ci[0]:.2f}",
        f"{ci[1]:.2f}",
    )  # a point (plain decoding's tau, the baseline against itself) is none
    return f" [{lo}, {hi}]" if lo != hi else ""


def lead(run: dict) -> tuple[dict, list[tuple[dict, float]]] | None:
    """The fastest lossless method that drafts, and the share of resamples of the prompts
    (eagle.bench.intervals) in which it decodes faster than each of the next two lossless methods
    by speed (plain decoding included) and than the fastest plain decoding: whether the prompts
    decoded, rather than the method, could have made the ranking. None for a run of one prompt or
    without a drafting method (a run kept from an older report: nothing it lacks)."""
    methods = run["methods"]
    ranked = sorted(
        (m for m in methods.values() if m.get("lossless") and resamplable(m.get("per_prompt"))),
        key=lambda m: -m["tokens_per_s"],
    )
    drafting = [m for m in ranked if not is_plain_decoding(m["method"])]
    if not drafting:
        return None
    leader = drafting[0]
    rivals = [m for m in ranked if m is not leader][:2]
    fastest = methods.get(run.get("fastest_vanilla") or "")
    if (
        fastest is not None
        and fastest is not leader
        and fastest in ranked
        and all(m is not fastest for m in rivals)
    ):
        rivals.append(fastest)
    if not rivals:
        return None
    return leader, [(m, lead_share(leader["per_prompt"], m["per_prompt"])) for m in rivals]


def lead_lines(run: dict) -> list[str]:
    """Markdown lines under a run's table: its `lead`."""
    found = lead(run)
    if found is None:
        return []
    leader, rivals = found
    shares = ", ".join(f"`{m['method']}` in {share:.0%}" for m, share in rivals)
    ratio = leader.get("speedup_vs_fastest", math.nan)
    speed = "" if math.isnan(ratio) else f" ({ratio:.2f}x the fastest plain decoding)"
    brackets = any(
        m.get("speedup_vs_fastest_ci") or m.get("tau_ci") for m in run["methods"].values()
    )
    return [
        f"Fastest lossless method that drafts: `{leader['method']}`{speed}; it decodes faster than "
        f"{shares} of "
        f"{RESAMPLES:,} resamples of the {run['num_prompts']} prompts"
        + (" (the 95% intervals in brackets come from the same resamples)." if brackets else "."),
        "",
    ]


def tau_by_category(run: dict) -> list[str]:
    """Markdown lines: tau of each drafting method over the prompts of each category (MT-bench's
    writing, math, ...), from the per-prompt counts; nothing when the run has fewer than two."""
    members: dict[str, list[int]] = {}  # category -> its prompts' positions in the run
    for i, c in enumerate(run.get("categories") or []):
        if c:
            members.setdefault(c, []).append(i)
    if len(members) < 2:
        return []
    lines = [
        "tau by category (prompts): "
        + ", ".join(f"{c} ({len(idx)})" for c, idx in members.items()),
        "",
        "| method | " + " | ".join(members) + " |",
        "|---|" + "---:|" * len(members),
    ]
    for m in run["methods"].values():
        if is_plain_decoding(m["method"]):  # one token a forward
            continue
        per = m["per_prompt"]
        total = {k: [sum(per[k][i] for i in idx) for idx in members.values()]
                 for k in ("committed", "forwards")}
        cells = [f"{tau(c, f):.2f}" for c, f in zip(total["committed"], total["forwards"])]
        lines.append(f"| {m['method']} | " + " | ".join(cells) + " |")
    return lines + [""]


def same_text(m: dict) -> str:
    """A text such as "92% of vanilla (bfloat16), 75% of vanilla (float32)": greedy prompts with the
    same text."""
    parts = []
    if m.get("identical_to_reference") is not None:
        parts.append(f"{m['identical_to_reference']:.0%} of {m['reference']}")
    if m.get("identical_to_fp32") is not None and m.get("reference") != "vanilla (float32)":
        parts.append(f"{m['identical_to_fp32']:.0%} of vanilla (float32)")
    return ", ".join(parts) or "-"


REPORT_FILES = (
    "results.json",
    "results.md",
    "speedup.png",
    "tau.png",
    "speedup_vs_static.png",
    "acceptance.png",
)


def write_report(report: dict, out_dir: Path) -> None:
    write_json(
        out_dir / "results.json", report
    )  # atomic: a run stopped mid-write keeps the last report
    (out_dir / "results.md").write_text(markdown_table(report))
    plot_report(report, out_dir)


def plot_report(report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    plots = [
        ("speedup_vs_fastest", "speedup.png", "speedup over the fastest plain decoding (x)"),
        ("tau", "tau.png", "tau (tokens per target forward)"),
    ]
    if any("vanilla:static" in r["methods"] for r in runs):
        plots.append(
            ("speedup_vs_static", "speedup_vs_static.png", "speedup over vanilla:static (x)")
        )
    for key, fname, label in plots:
        fig, ax = plt.subplots(figsize=(8, 4))
        names = list(dict.fromkeys(m for r in runs for m in r["methods"]))
        width = 0.8 / max(len(runs), 1)
        for i, run in enumerate(runs):
            values = [run["methods"].get(n, {}).get(key, float("nan")) for n in names]
            # 95% intervals over prompts where the run has them (eagle.bench.intervals)
            cis = [run["methods"].get(n, {}).get(f"{key}_ci") for n in names]
            err = error_bars(values, cis)
            ax.bar(
                [j + i * width for j in range(len(names))],
                values,
                width,
                yerr=err if any(cis) else None,
                capsize=2,
                label=f"{run['eval_set']} T={run['temperature']:g}",
            )
        ax.set_xticks(
            [j + width * (len(runs) - 1) / 2 for j in range(len(names))],
            [short(n) for n in names],
            rotation=25,
            ha="right",
        )
        ax.set_ylabel(label)
        if any(m.get(f"{key}_ci") for r in runs for m in r["methods"].values()):
            ax.set_title("error bars: 95% intervals over the prompts (bootstrap)", fontsize=9)
        if key.startswith("speedup"):
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=120)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        for name, m in run["methods"].items():
            if m["acceptance_by_depth"]:
                ax.plot(
                    range(1, len(m["acceptance_by_depth"]) + 1),
                    m["acceptance_by_depth"],
                    marker="o",
                    label=f"{name} {run['eval_set']} T={run['temperature']:g}",
                )
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("P(accepted length >= d)")
    ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:  # a run without tree methods has no curve to name
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance.png", dpi=120)
    plt.close(fig)
