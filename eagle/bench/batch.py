"""The batch-size benchmark: every method at batch sizes 1, 2, 4, 8, ... against vanilla
decoding at the same batch size, beside EAGLE-1's Table 7.

At batch size B the same P prompts are decoded in batches of B consecutive prompts (the last
one smaller when B does not divide P), every method on the same batches, taking turns batch
by batch (load drift on a shared machine hits them alike), after one untimed batch each.

- throughput: new tokens of every sequence / wall time of the batches;
- speedup at B: a method's throughput over vanilla's at the same B (Table 7's columns), and over
  the fastest plain decoding at that B (vanilla in another dtype or runner, `hf_generate`);
- vs vanilla at B = 1: over one sequence at a time, what batching alone buys;
- tau: per sequence, as alone: tokens committed per verification forward it took part in;
- ms per batch round, split into drafting (every sequence's proposer, one after another) and
  the one verification forward of every sequence's tree, and that forward per token verified:
  how verification grows with batch size x tree size on this machine.

A method label may hold `{B}`, filled in with the batch size:
`eagle@runs/tree_search/X/machine_b{B}.yaml` runs, at each size, the tree the tree search chose for
it (`tree_search.batch_sizes`). Output (in `out_dir`): batch.json, batch.md, batch.png."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle.artifacts import keep_previous, stopped_report, write_json
from eagle.bench.benchmark import RunSettings, encode_prompt, is_plain_decoding, resume_key
from eagle.bench.evalsets import load_eval_set
from eagle.bench.methods import Method, MethodError, MethodSpec, short
from eagle.decoding.stats import DecodeResult, tau
from eagle.progress import progress
from eagle.sampling import SamplingPolicy, seeded_generator

if TYPE_CHECKING:
    from eagle.bench.builder import Methods

# EAGLE-1 (Li et al., 2024), Table 7: speedup over vanilla decoding at batch sizes 1-4 on MT-bench,
# T=0, and the throughput gain at the largest batch that fits in memory
TABLE7 = {
    "Vicuna-7B": {1: 2.90, 2: 2.87, 3: 2.65, 4: 2.76, "throughput": 1.97},
    "LLaMA2-Chat 70B": {1: 3.01, 2: 2.81, 3: 2.50, 4: 2.40, "throughput": 1.99},
}


@dataclass
class BatchConfig:
    sizes: Sequence[int] = (1, 2, 4, 8)
    methods: Sequence[str] = ("vanilla", "eagle")
    temperatures: Sequence[float] = (0.0,)
    max_new_tokens: int = 128
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.sizes or any(int(b) < 1 for b in self.sizes):
            raise ValueError(f"batch sizes must be positive integers, got {list(self.sizes)}")
        if "vanilla" not in self.methods:
            raise ValueError(
                "the batch benchmark measures every method against vanilla decoding: "
                "put vanilla in its methods"
            )


@dataclass
class SizeResult:
    method: str  # the label, `{B}` filled in
    size: int
    tokens_per_s: float
    tau: float  # per sequence: committed / its forwards, over every sequence
    new_tokens: int
    seconds: float
    speedup: float = float("nan")  # over vanilla at this batch size
    speedup_vs_fastest: float = float("nan")  # over the fastest plain decoding at this batch size
    vs_vanilla_b1: float = float("nan")  # over vanilla at the smallest batch size measured
    rounds: int = 0  # batch rounds (verification forwards)
    draft_ms_per_round: float = 0.0
    verify_ms_per_round: float = 0.0
    verify_ms_per_token: float = 0.0  # per token verified (every sequence's root and tree)
    # greedy, in vanilla's dtype: share of sequences with its text
    identical_to_vanilla: float | None = None
    tau_per_sequence: list[float] = field(default_factory=list)


def batches(prompts: Sequence[list[int]], size: int) -> list[list[list[int]]]:
    """The prompts in batches of `size` consecutive prompts (the last one smaller)."""
    return [list(prompts[i : i + size]) for i in range(0, len(prompts), size)]


def summarise(label: str, size: int, runs: list[tuple[list[DecodeResult], float]]) -> SizeResult:
    """One method at one size: `runs` holds each batch's results and wall seconds."""
    results = [r for rows, _ in runs for r in rows]
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(s for _, s in runs)
    # a batch round is one verification forward: the longest-running sequence of each batch took
    # part in all of them; its verify time is the forward's, every sequence's drafting adds up
    rounds = sum(max(r.stats.forwards for r in rows) for rows, _ in runs)
    verify = sum(max(rows, key=lambda r: r.stats.forwards).stats.verify_s for rows, _ in runs)
    draft = sum(r.stats.draft_s for r in results)
    verified = sum(
        r.tree_size + 1 for res in results for r in res.stats.rounds
    )  # tokens through the forwards
    return SizeResult(
        method=label,
        size=size,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        tau=tau(sum(r.stats.committed for r in results), sum(r.stats.forwards for r in results)),
        new_tokens=tokens,
        seconds=seconds,
        rounds=rounds,
        draft_ms_per_round=1000 * draft / max(rounds, 1),
        verify_ms_per_round=1000 * verify / max(rounds, 1),
        verify_ms_per_token=1000 * verify / max(verified, 1),
        tau_per_sequence=[r.tau for r in results],
    )


REPORT_FILES = ("batch.json", "batch.md", "batch.png")


def run_batch_benchmark(
    prompts: Sequence[list[int]],
    build: Callable[[str], tuple[Method, str]],
    cfg: BatchConfig,
    target_name: str,
    out_dir: str | Path,
    device=None,
    resume_key: Mapping | None = None,
) -> dict:
    """Every method of `cfg` at every batch size and temperature on `prompts`; writes batch.json,
    batch.md and batch.png into `out_dir` after each batch size. `build` gives (method, dtype)
    for a label with `{B}` filled in; methods are built before anything runs. A stopped report in
    `out_dir` made with the same `resume_key` (JSON: what else decides the measurements) keeps
    its finished (temperature, batch size) parts, each timed whole, every method in turn, in the
    process that ran it; None: never resume (as `eagle.bench.benchmark.run_benchmark`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = _finished_sizes(out_dir, resume_key)
    if kept:
        print(
            f"[batch] resuming the stopped run in {out_dir}: "
            + ", ".join(f"T={t:g} B={b}" for t, b in kept)
            + " kept, made with the same settings and inputs"
        )
    else:
        keep_previous(out_dir, REPORT_FILES)  # a fixed out_dir run again
    device = torch.device(device or "cpu")
    labels = {(label, b): label.replace("{B}", str(b)) for label in cfg.methods for b in cfg.sizes}
    built: dict[str, tuple[Method, str]] = {}
    errors = []
    for name in dict.fromkeys(labels.values()):
        try:
            built[name] = build(name)
        except (ValueError, OSError) as err:
            errors.append(f"{name}: {str(err).splitlines()[0]}")
    if errors:
        raise MethodError(f"{len(errors)} methods cannot be built: " + "; ".join(errors))
    for name, (
        method,
        _,
    ) in built.items():  # a method that cannot batch says so before anything runs
        if max(cfg.sizes) > 1 and not method.batches:
            raise MethodError(
                f"method {name!r} decodes one sequence at a time: drop it from batch.methods"
            )
    runs = []
    bar = progress(
        total=len(cfg.temperatures) * len(cfg.sizes) * len(cfg.methods) * len(prompts),
        desc="batch sizes",
        unit="sequence",
    )
    for temperature in cfg.temperatures:
        policy = SamplingPolicy(
            temperature=temperature,
            top_k=cfg.top_k if temperature else 0,
            top_p=cfg.top_p if temperature else 1.0,
        )
        dtypes = {label: built[labels[(label, min(cfg.sizes))]][1] for label in cfg.methods}
        run = {
            "temperature": float(temperature),
            "num_prompts": len(prompts),
            "max_new_tokens": cfg.max_new_tokens,
            "target": target_name,
            "dtypes": dtypes,
            "sizes": {},
        }
        runs.append(run)
        smallest = None  # vanilla at the smallest size: the sizes run in ascending order
        for b in sorted(cfg.sizes):
            if (
                float(temperature),
                str(b),
            ) in kept:  # timed by the stopped run: every method, in turn
                run["sizes"][str(b)], run.setdefault("kept_from", {})[str(b)] = kept[
                    float(temperature), str(b)
                ]
                smallest = smallest or run["sizes"][str(b)]["vanilla"]["tokens_per_s"]
                bar.update(len(cfg.methods) * len(prompts))
                continue
            groups = batches(prompts, b)
            names = {label: labels[(label, b)] for label in cfg.methods}
            for label in cfg.methods:  # untimed: buffers sized, first-call costs paid
                built[names[label]][0].generate_batch(
                    groups[0], cfg.max_new_tokens, policy, seeded_generator(cfg.seed, device)
                )
            timed: dict[str, list[tuple[list[DecodeResult], float]]] = {
                label: [] for label in cfg.methods
            }
            generators = {label: seeded_generator(cfg.seed, device) for label in cfg.methods}
            for i, group in enumerate(groups):
                shift = i % len(cfg.methods)
                for label in list(cfg.methods[shift:]) + list(cfg.methods[:shift]):
                    bar.set_postfix_str(f"T={temperature:g} B={b} {label}")
                    _sync(device)
                    start = time.perf_counter()
                    rows = built[names[label]][0].generate_batch(
                        group, cfg.max_new_tokens, policy, generators[label]
                    )
                    _sync(device)
                    timed[label].append((rows, time.perf_counter() - start))
                    bar.update(len(group))
            results = {label: summarise(names[label], b, timed[label]) for label in cfg.methods}
            base = results["vanilla"]
            smallest = smallest or base.tokens_per_s
            fastest = max(
                (r for label, r in results.items() if is_plain_decoding(label)),
                key=lambda r: r.tokens_per_s,
            )
            for label, r in results.items():
                r.speedup = (
                    r.tokens_per_s / base.tokens_per_s if base.tokens_per_s else float("nan")
                )
                r.speedup_vs_fastest = (
                    r.tokens_per_s / fastest.tokens_per_s if fastest.tokens_per_s else float("nan")
                )
                r.vs_vanilla_b1 = r.tokens_per_s / smallest if smallest else float("nan")
                if (
                    policy.greedy and dtypes[label] == dtypes["vanilla"]
                ):  # another dtype rounds near-ties otherwise
                    mine = [row.tokens for rows, _ in timed[label] for row in rows]
                    ref = [row.tokens for rows, _ in timed["vanilla"] for row in rows]
                    r.identical_to_vanilla = sum(a == c for a, c in zip(mine, ref)) / max(
                        len(ref), 1
                    )
            run["sizes"][str(b)] = {label: asdict(r) for label, r in results.items()}
            write_report(
                _report(runs, cfg, resume_key, complete=False), out_dir
            )  # each size on disk as it ends
    bar.close()
    report = _report(runs, cfg, resume_key, complete=True)
    write_report(report, out_dir)
    return report


def run_batch(
    methods: Methods,
    config: BatchConfig,
    eval_sets: Sequence[str],
    num_prompts: int,
    out_dir: str | Path,
    dtypes: Mapping[str, str] | None = None,
    resume: RunSettings | None = None,
) -> Path:
    """Every method of `config` at each of its batch sizes against vanilla at the same size, on
    `num_prompts` prompts of each of `eval_sets`, built by `methods` in `dtypes` (by label or
    base name). `resume`: what the caller's settings add to the resume key (None: never
    resume). Prints batch.md; returns its folder."""
    for name in config.methods:
        MethodSpec.parse(name.replace("{B}", "1"))  # a typo fails before anything is loaded
    dtypes = dict(dtypes or {})
    _, tokenizer = methods.target(methods.dtype("vanilla", dtypes))
    sets = {name: load_eval_set(name, num_prompts) for name in eval_sets}
    prompts = [encode_prompt(tokenizer, p) for every in sets.values() for p in every]

    def build(name: str):
        dtype = methods.dtype(name, dtypes)
        return methods.build(name, dtype), dtype

    out_dir = Path(out_dir)
    labels = list(
        dict.fromkeys(m.replace("{B}", str(b)) for m in config.methods for b in config.sizes)
    )
    key = None
    if resume is not None:
        key = resume_key(resume, labels, config.temperatures, dtypes, methods.tree_dirs(), sets)
    run_batch_benchmark(
        prompts,
        build,
        config,
        target_name=methods.target_path,
        out_dir=out_dir,
        device=methods.device,
        resume_key=key,
    )
    print((out_dir / "batch.md").read_text())
    return out_dir


def _finished_sizes(out_dir: Path, key: Any) -> dict[tuple[float, str], tuple[dict, str]]:
    """(temperature, batch size) -> (its results, the date of the run that timed them), from a
    stopped report in `out_dir` made with `key` (none for another key, a finished report, or none
    given). A size is written only once every method has run it."""
    report = stopped_report(out_dir / "batch.json", key)
    if report is None:
        return {}
    return {
        (float(run["temperature"]), b): (
            results,
            run.get("kept_from", {}).get(b, report.get("date")),
        )
        for run in report.get("runs", [])
        for b, results in run.get("sizes", {}).items()
    }


def _report(runs: list[dict], cfg: BatchConfig, key: Any, complete: bool) -> dict:
    return {
        "status": "complete" if complete else "incomplete",
        "runs": runs,
        "resume_key": key,
        "config": asdict(cfg)
        | {
            "sizes": list(cfg.sizes),
            "methods": list(cfg.methods),
            "temperatures": list(cfg.temperatures),
        },
        "eagle1_table7": {k: {str(b): v for b, v in row.items()} for k, row in TABLE7.items()},
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def markdown(report: dict) -> str:
    lines = []
    for run in report["runs"]:
        sizes = list(run["sizes"])
        labels = list(run["sizes"][sizes[0]])
        largest = sizes[-1]
        lines += [
            f"### temperature {run['temperature']:g} ({run['num_prompts']} prompts, "
            f"{run['max_new_tokens']} "
            f"new tokens, target {run['target']})",
            "",
            "Speedup over vanilla decoding at the same batch size (EAGLE-1's Table 7), tau per "
            "sequence:",
            "",
            *(
                [
                    "Timed by a stopped run that this one resumed: "
                    + ", ".join(f"B={b} ({date})" for b, date in run["kept_from"].items())
                    + f" (their column against vanilla at B={sizes[0]} compares two runs).",
                    "",
                ]
                if run.get("kept_from")
                else []
            ),
            "| method | dtype | "
            + " | ".join(f"B={b}" for b in sizes)
            + f" | tokens/s at B={largest} | "
            f"vs vanilla at B={sizes[0]} |",
            "|---|---|" + "---:|" * (len(sizes) + 2),
        ]
        for label in labels:
            cells = [
                f"{run['sizes'][b][label]['speedup']:.2f}x (tau "
                f"{run['sizes'][b][label]['tau']:.2f})"
                for b in sizes
            ]
            top = run["sizes"][largest][label]
            lines.append(
                f"| {short(label)} | {run['dtypes'].get(label, '-')} | "
                + " | ".join(cells)
                + f" | {top['tokens_per_s']:.1f} | {top['vs_vanilla_b1']:.2f}x |"
            )
        if float(run["temperature"]) == 0.0:
            for name, row in TABLE7.items():
                cells = [f"{row[int(b)]:.2f}x" if int(b) in row else "-" for b in sizes]
                lines.append(
                    f"| EAGLE-1 paper, {name} (GPU, MT-bench) | fp16 | "
                    + " | ".join(cells)
                    + f" | throughput {row['throughput']:.2f}x at its largest batch | - |"
                )
        plain = [label for label in labels if is_plain_decoding(label)]
        if len(plain) > 1:
            lines += [
                "",
                "Against the fastest plain decoding at each batch size (" + ", ".join(plain) + "):",
                "",
                "| method | " + " | ".join(f"B={b}" for b in sizes) + " |",
                "|---|" + "---:|" * len(sizes),
            ]
            for label in labels:
                lines.append(
                    f"| {short(label)} | "
                    + " | ".join(
                        f"{run['sizes'][b][label]['speedup_vs_fastest']:.2f}x" for b in sizes
                    )
                    + " |"
                )
        lines += [
            "",
            "Where the round goes (ms per batch round: drafting of every sequence + the one "
            "verification forward; that forward per token verified):",
            "",
            "| method | " + " | ".join(f"B={b}" for b in sizes) + " |",
            "|---|" + "---|" * len(sizes),
        ]
        for label in labels:
            cells = []
            for b in sizes:
                r = run["sizes"][b][label]
                same = (
                    ""
                    if r["identical_to_vanilla"] is None
                    else f", {r['identical_to_vanilla']:.0%} same text"
                )
                cells.append(
                    f"{r['draft_ms_per_round']:.1f} + {r['verify_ms_per_round']:.1f} "
                    f"({r['verify_ms_per_token']:.2f}/token{same})"
                )
            lines.append(f"| {short(label)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> None:
    write_json(out_dir / "batch.json", report)
    (out_dir / "batch.md").write_text(markdown(report))
    plot(report, out_dir / "batch.png")


def plot(report: dict, path: Path) -> None:
    """Speedup over vanilla at the same batch size, by batch size (EAGLE-1's Table 7 dashed),
    and throughput by batch size, one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(2, len(runs), figsize=(9 * len(runs), 7), squeeze=False)
    for col, run in enumerate(runs):
        sizes = [int(b) for b in run["sizes"]]
        labels = list(run["sizes"][str(sizes[0])])
        top, bottom = axes[0][col], axes[1][col]
        for label in labels:
            dtype = run.get("dtypes", {}).get(label, "")
            name = f"{short(label)} ({dtype})" if dtype else short(label)
            top.plot(
                sizes,
                [run["sizes"][str(b)][label]["speedup"] for b in sizes],
                marker="o",
                label=name,
            )
            bottom.plot(
                sizes,
                [run["sizes"][str(b)][label]["tokens_per_s"] for b in sizes],
                marker="o",
                label=name,
            )
        if float(run["temperature"]) == 0.0:
            for (name, row), color in zip(TABLE7.items(), ("black", "gray")):
                bs = [1, 2, 3, 4]
                top.plot(
                    bs,
                    [row[b] for b in bs],
                    ls="--",
                    marker="x",
                    color=color,
                    label=f"EAGLE-1 paper: {name} (GPU)",
                )
        top.axhline(1.0, color="gray", lw=0.8, ls="--")
        top.set_title(f"T={run['temperature']:g}: speedup over vanilla at the same batch size")
        bottom.set_title("throughput")
        for ax, ylabel in ((top, "speedup (x)"), (bottom, "tokens/s (all sequences)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(set(sizes) | ({1, 2, 3, 4} if ax is top else set())))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_xlabel("batch size")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
