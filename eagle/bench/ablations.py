"""EAGLE-1's ablations: drafters that differ from EAGLE-1 in one factor, side by side.

`make ablations` trains one drafter per option of `configs/ablation/` (a Hydra multirun of
`train.py experiment=eagle_ablation`, each into `runs/ablations/<name>/`), then
`decode.py mode=ablations` benchmarks them against vanilla decoding in one run and writes the
table this module builds:

    name            inputs                     noise      data
    eagle1          f_{t-1} + shifted token    U(-.1,.1)  corpus features (EAGLE-1 as published)
    unshifted       f_{t-1} + unshifted token  U(-.1,.1)  corpus features
    feature_only    f_{t-1}                    U(-.1,.1)  corpus features
    token_only      E(x_t)                     U(-.1,.1)  corpus features (a 1-layer draft LM on E)
    no_noise        f_{t-1} + shifted token    none       corpus features
    self_distilled  f_{t-1} + shifted token    U(-.1,.1)  the target's own continuations (T=1)
    self_distilled_greedy  (the same)          U(-.1,.1)  the target's greedy continuations (T=0)
    sharegpt_replies       (the same)          U(-.1,.1)  the fixed data's own replies to the
                                                          prompts the self-distilled options
                                                          answer (their control)

Three options change the loss rather than the drafter's inputs or data (the "loss" column):
`whole_vocab_loss` scores EAGLE-1's token loss over the whole LM head where the recipe uses the
data's most frequent tokens, `token_weight` weights the token loss 1.0 against the feature loss
(EAGLE-1: 0.1), and `unrolled` adds the loss of a second pass fed the drafter's own features
(`model.train_depth=2`, EAGLE-3's training-time test in its simplest form).

Error margins: tau and speedup get 95% bootstrap intervals over prompts (`eagle.bench.intervals`:
each resample keeps a prompt's vanilla and drafter runs together, so the speedup's interval includes
the timing noise of both); agreement by depth gets a binomial 95% interval over the validation
positions, which is optimistic (positions of one sequence are correlated) and says only how
precisely the number was measured, not how much another seed would move it. Each drafter's agreement
is on its own validation split (corpus or self-distilled features): it compares inputs and noise,
not data."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle.artifacts import files_stamp, keep_previous
from eagle.bench.benchmark import BenchmarkConfig, run_benchmark
from eagle.bench.evalsets import load_eval_set
from eagle.bench.intervals import bootstrap_interval, error_bars, lead_share, tau_difference
from eagle.bench.methods import build_method

if TYPE_CHECKING:
    from eagle.bench.builder import Methods

# EAGLE-1 (Li et al., 2024), ablation of the drafter's inputs on Vicuna-7B, MT-bench, T=0: speedup
PAPER_SPEEDUP = {"shifted": 2.8, "feature": 1.9, "token": 1.5}
# the variant each one is measured against on the same prompts (eagle1 where none is named): the
# self-distilled data against ShareGPT's own replies to the same prompts, cut at the same length
CONTROLS = {"self_distilled": "sharegpt_replies", "self_distilled_greedy": "sharegpt_replies"}
ORDER = (
    "eagle1",
    "unshifted",
    "feature_only",
    "token_only",
    "no_noise",
    "whole_vocab_loss",
    "token_weight",
    "unrolled",
    "sharegpt_replies",
    "self_distilled",
    "self_distilled_greedy",
)


@dataclass
class Variant:
    """One trained ablation drafter."""

    name: str
    drafter: Path  # its checkpoint folder
    inputs: str
    noise: float
    data: str  # the feature dump it trained on (data.name)
    steps: int
    agreement: list[float] = field(default_factory=list)  # validation top-1 agreement, depth 1..
    positions: int = 0  # validation positions behind each agreement (depth 1)
    # the token loss's rows (model.loss_vocab); None: the whole vocabulary
    loss_vocab: int | None = None
    train_depth: int = 1  # depths the loss unrolls the drafter to (model.train_depth; 1 = EAGLE-1)
    depth_decay: float = 0.8  # their weights' base (model.depth_decay)
    w_feat: float = 1.0  # the feature loss's weight (model.w_feat; EAGLE-1 1.0)
    w_tok: float = 0.1  # the token loss's weight (model.w_tok; EAGLE-1 0.1)

    @property
    def loss(self) -> str:
        parts = ["whole vocabulary" if self.loss_vocab is None else f"{self.loss_vocab:,} rows"]
        if (self.w_feat, self.w_tok) != (1.0, 0.1):
            parts.append(f"weights {self.w_feat:g} feature / {self.w_tok:g} token")
        if self.train_depth > 1:
            parts.append(f"depths 1-{self.train_depth} (decay {self.depth_decay:g})")
        return ", ".join(parts)


def find_variants(root: str | Path) -> list[Variant]:
    """Every finished ablation drafter under `root` (`<root>/<name>/drafter/` with its
    `train_metrics.json`), EAGLE-1 first, then the order of `ORDER`, then by name."""
    root = Path(root)
    variants = []
    for metrics_path in sorted(root.glob("*/drafter/train_metrics.json")):
        metrics = json.loads(metrics_path.read_text())
        config = json.loads((metrics_path.parent / "config.json").read_text())
        model_cfg = metrics.get("config", {}).get("model", {})
        depths = sorted(int(k.rsplit("_d", 1)[1]) for k in metrics if k.startswith("val/top1_d"))
        variants.append(
            Variant(
                name=metrics_path.parent.parent.name,
                drafter=metrics_path.parent,
                inputs=config.get("inputs", "shifted"),
                noise=float(model_cfg.get("noise", float("nan"))),
                data=str(metrics.get("config", {}).get("data", {}).get("name", "?")),
                steps=int(metrics.get("steps", 0)),
                agreement=[metrics[f"val/top1_d{d}"] for d in depths],
                positions=int(metrics.get("val/tokens_d1", 0)),
                loss_vocab=model_cfg.get("loss_vocab"),
                train_depth=int(model_cfg.get("train_depth", 1)),
                depth_decay=float(model_cfg.get("depth_decay", 0.8)),
                w_feat=float(model_cfg.get("w_feat", 1.0)),
                w_tok=float(model_cfg.get("w_tok", 0.1)),
            )
        )
    if not variants:
        raise FileNotFoundError(
            f"no trained ablation drafters under {root} (make ablations trains them)"
        )
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(variants, key=lambda v: (rank.get(v.name, len(ORDER)), v.name))


# beside an ablation benchmark's results.json: the drafters it decoded
DRAFTERS_FILE = "drafters.json"


def record_drafters(bench_dir: Path, drafters: Mapping[str, str]) -> None:
    """Write which drafter files (label -> path) the benchmark in `bench_dir` decodes, with their
    stamps (`eagle.artifacts.files_stamp`): a rebuilt table must not pair a drafter trained again
    since with that benchmark's taus."""
    bench_dir.mkdir(parents=True, exist_ok=True)
    (bench_dir / DRAFTERS_FILE).write_text(
        json.dumps(
            {"drafters": dict(drafters), "stamps": files_stamp(list(drafters.values()))}, indent=2
        )
        + "\n"
    )


def finished_bench(
    bench_dir: Path, variants: Sequence[Variant], labels: Mapping[str, str]
) -> tuple[dict, list[Variant]]:
    """The finished benchmark report in `bench_dir` (an ablation run's bench/), and the variants
    it decoded in every run: what `ablations.rebuild` writes the table from. Variants it lacks are
    named and left out; none at all, or a drafter saved again since the benchmark, is an error."""
    path = bench_dir / "results.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"ablations.rebuild: no benchmark at {path} (run mode=ablations without rebuild first)"
        )
    bench = json.loads(path.read_text())
    if bench.get("status") != "complete":
        raise ValueError(
            f"ablations.rebuild: the benchmark at {path} did not finish (status "
            f"{bench.get('status')!r}): run mode=ablations to finish it"
        )
    if any("vanilla" not in run["methods"] for run in bench["runs"]):
        raise ValueError(
            f"ablations.rebuild: the benchmark at {path} has no vanilla decoding to measure against"
        )
    have = [v for v in variants if all(labels[v.name] in run["methods"] for run in bench["runs"])]
    if not have:
        raise ValueError(
            f"ablations.rebuild: the benchmark at {path} decoded none of the drafters under the "
            "ablation "
            f"folder ({', '.join(v.name for v in variants)})"
        )
    if lacking := [v.name for v in variants if v not in have]:
        print(
            f"[ablations] {', '.join(lacking)}: not in the benchmark at {path}, left out of the "
            "table; "
            "mode=ablations without rebuild decodes every drafter"
        )
    record = bench_dir / DRAFTERS_FILE
    if not record.is_file():
        print(
            f"[ablations] no {record}: the benchmark (from before drafters were recorded) cannot "
            "be checked "
            "against the drafters' files; the table pairs their agreement now with its taus"
        )
        return bench, have
    recorded = json.loads(record.read_text())
    paths = [recorded["drafters"].get(labels[v.name], str(v.drafter)) for v in have]
    now = files_stamp(paths)
    if changed := [
        v.name
        for v, p in zip(have, paths)
        if p != str(v.drafter) or now.get(p) != recorded["stamps"].get(p)
    ]:
        raise ValueError(
            f"ablations.rebuild: {', '.join(changed)} changed since the benchmark at {path} "
            "decoded "
            "them (trained again, or another folder): run mode=ablations without rebuild"
        )
    return bench, have


def binomial_margin(p: float, n: int) -> float:
    """Half-width of the normal 95% interval of a share p measured on n positions (nan if n = 0)."""
    return 1.96 * math.sqrt(p * (1 - p) / n) if n else float("nan")


def ablation_report(
    variants: Sequence[Variant], bench: Mapping[str, Any], labels: Mapping[str, str]
) -> dict:
    """The ablation table: per variant, tau and speedup (with intervals) at every temperature of
    `bench` (a benchmark report whose methods include vanilla and, for each variant, the method
    named `labels[variant.name]`), and its validation agreement by depth (with margins)."""
    rows = []
    names = {v.name for v in variants}
    for v in variants:
        # its tau against its control's on the same prompts (paired): the factor's own effect
        control = next((c for c in (CONTROLS.get(v.name), "eagle1") if c in names), None)
        control = None if control == v.name else control
        row = {
            "name": v.name,
            "inputs": v.inputs,
            "noise": v.noise,
            "data": v.data,
            "loss": v.loss,
            "steps": v.steps,
            "agreement": v.agreement,
            "agreement_margin": [binomial_margin(p, v.positions) for p in v.agreement],
            "positions": v.positions,
            "control": control,
            "runs": [],
        }
        for run in bench["runs"]:
            method, vanilla = run["methods"][labels[v.name]], run["methods"]["vanilla"]
            ci = bootstrap_interval(method["per_prompt"], vanilla["per_prompt"])
            paired = {}
            if control is not None:
                ref = run["methods"][labels[control]]
                paired = {
                    "dtau": method["tau"] - ref["tau"],
                    "dtau_ci": tau_difference(method["per_prompt"], ref["per_prompt"]),
                    "tau_above_control": lead_share(
                        method["per_prompt"], ref["per_prompt"], what="tau"
                    ),
                }
            row["runs"].append(
                {
                    "eval_set": run["eval_set"],
                    "temperature": run["temperature"],
                    "tau": method["tau"],
                    "tau_ci": ci["tau"],
                    "speedup": method["speedup"],
                    "speedup_ci": ci["speedup"],
                    "num_prompts": run["num_prompts"],
                    **paired,
                }
            )
        rows.append(row)
    return {"variants": rows, "paper_speedup": PAPER_SPEEDUP, "ordering": ordering(rows)}


def ordering(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The input ablation's order at T=0 next to the paper's (shifted > feature > token), among the
    drafters trained on EAGLE-1's data with its loss (the data and loss options' drafters share its
    inputs)."""
    ref = next((r for r in rows if r["name"] == "eagle1"), rows[0] if rows else None)
    by_inputs = {
        r["inputs"]: r
        for r in rows
        if r["noise"] > 0 and r["data"] == ref["data"] and r.get("loss") == ref.get("loss")
    }
    out = {}
    for run_i, run in enumerate(rows[0]["runs"] if rows else []):
        if run["temperature"] != 0:
            continue
        speed = {k: r["runs"][run_i]["speedup"] for k, r in by_inputs.items()}
        if (
            len(speed) < 2
        ):  # no input ablation in this table (e.g. make ablations-loss): no order to compare
            continue
        ours = sorted((k for k in PAPER_SPEEDUP if k in speed), key=lambda k: -speed[k])
        out[run["eval_set"]] = {
            "ours": ours,
            "paper": sorted(PAPER_SPEEDUP, key=lambda k: -PAPER_SPEEDUP[k]),
            "agrees": ours == sorted(ours, key=lambda k: -PAPER_SPEEDUP[k]),
        }
    return out


def markdown(report: Mapping[str, Any]) -> str:
    rows = report["variants"]
    if not rows:
        return ""
    runs = rows[0]["runs"]
    paired = any(r.get("control") for r in rows)
    head = (
        "| variant | inputs | noise | data | loss | "
        + " | ".join(
            f"tau T={r['temperature']:g} | speedup T={r['temperature']:g}"
            + (f" | tau - control's T={r['temperature']:g}" if paired else "")
            for r in runs
        )
        + " | top-1 agreement d1..d5 |"
    )
    lines = [
        f"EAGLE-1 ablations ({runs[0]['eval_set']}, {runs[0]['num_prompts']} prompts; 95% "
        "intervals: "
        "bootstrap over prompts for tau and speedup, binomial over validation positions for "
        "agreement)",
        "",
        "Agreement is on each drafter's own validation split (corpus or self-distilled features): "
        "comparable across inputs and noise, not across data.",
        "",
    ]
    if paired:
        controls = ", ".join(
            f"{c} for {', '.join(r['name'] for r in rows if r.get('control') == c)}"
            for c in dict.fromkeys(r["control"] for r in rows if r.get("control"))
        )
        lines += [
            "tau - control's: the difference from the control's tau on the same prompts (the "
            f"control: {controls}), its 95% "
            "interval from paired resamples of the prompts, and the share of those resamples in "
            "which the "
            "variant's tau is the higher (eagle.bench.intervals): sharper than the two intervals "
            "side by "
            "side, since both drafters decode the same prompts.",
            "",
        ]
    lines += [
        head,
        "|---|---|---:|---|---|"
        + ("---:|---:|---:|" if paired else "---:|---:|") * len(runs)
        + "---|",
    ]
    for r in rows:
        cells = []
        for run in r["runs"]:
            (tl, th), (sl, sh) = run["tau_ci"], run["speedup_ci"]
            cell = (f"{run['tau']:.2f} [{tl:.2f}, {th:.2f}] | "
                    f"{run['speedup']:.2f}x [{sl:.2f}, {sh:.2f}]")
            if paired:
                cell += (
                    f" | {run['dtau']:+.2f} [{run['dtau_ci'][0]:+.2f}, {run['dtau_ci'][1]:+.2f}], "
                    f"higher in {run['tau_above_control']:.0%}"
                    if "dtau" in run
                    else " | -"
                )
            cells.append(cell)
        agree = " / ".join(f"{a:.3f}" for a in r["agreement"])
        margin = max(r["agreement_margin"], default=float("nan"))
        lines.append(
            f"| {r['name']} | {r['inputs']} | {r['noise']:g} | {r['data']} | {r.get('loss', '?')} "
            "| " + " | ".join(cells) + f" | {agree} (±{margin:.3f}) |"
        )
    for eval_set, o in report["ordering"].items():
        lines += [
            "",
            f"Input ablation at T=0 on {eval_set}: ours {' > '.join(o['ours'])}; EAGLE-1 on "
            "Vicuna-7B "
            f"{' > '.join(o['paper'])} "
            f"({', '.join(f'{k} {v}x' for k, v in report['paper_speedup'].items())}): "
            + ("the same order." if o["agrees"] else "a different order."),
        ]
    return "\n".join(lines) + "\n"


def plot(report: Mapping[str, Any], out: Path) -> None:
    """Speedup and tau with intervals per variant and temperature, and agreement by depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["variants"]
    names = [r["name"] for r in rows]
    temps = [run["temperature"] for run in rows[0]["runs"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / max(len(temps), 1)
    for key, ax in zip(("speedup", "tau"), axes[:2]):
        for j, t in enumerate(temps):
            vals = [r["runs"][j][key] for r in rows]
            ax.bar(
                [i + j * width for i in range(len(rows))],
                vals,
                width,
                yerr=error_bars(vals, [r["runs"][j][f"{key}_ci"] for r in rows]),
                capsize=3,
                label=f"T={t:g}",
            )
        ax.set_xticks(
            [i + width * (len(temps) - 1) / 2 for i in range(len(rows))],
            names,
            rotation=25,
            ha="right",
        )
        ax.set_ylabel(
            key + (" over vanilla" if key == "speedup" else " (tokens per target forward)")
        )
        ax.legend()
    if "speedup" in axes[0].get_ylabel():
        axes[0].axhline(1.0, color="gray", lw=0.8)
    ax = axes[2]
    for r in rows:
        depths = range(1, len(r["agreement"]) + 1)
        ax.errorbar(
            depths,
            r["agreement"],
            yerr=r["agreement_margin"],
            marker="o",
            capsize=2,
            label=r["name"],
        )
    ax.set(
        xlabel="draft depth (drafter fed its own features)",
        ylabel="top-1 agreement (validation)",
        ylim=(0, 1),
        xticks=range(1, max(len(r["agreement"]) for r in rows) + 1),
    )
    ax.legend(fontsize=7)
    fig.suptitle("EAGLE-1 ablations: one factor changed per drafter")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def write(report: Mapping[str, Any], out_dir: str | Path) -> Path:
    """ablations.json, ablations.md and ablations.png in `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ablations.json").write_text(json.dumps(report, indent=2))
    (out_dir / "ablations.md").write_text(markdown(report))
    plot(report, out_dir / "ablations.png")
    return out_dir


@dataclass(frozen=True)
class AblationsConfig:
    """configs/decode.yaml's `ablations` section."""

    dir: str | Path  # runs/ablations: <name>/drafter for each trained option
    eval_sets: Sequence[str]
    num_prompts: int
    temperatures: Sequence[float]
    dtype: str | None  # None: the machine's choice for eagle, vanilla in the same
    out_dir: str | Path  # ablations.json/.md/.png and the benchmark's own bench/
    rebuild: bool  # the table again from out_dir's finished bench/, decoding nothing


def run_ablations(methods: Methods, ac: AblationsConfig, bench: BenchmarkConfig) -> Path:
    """Benchmark every ablation drafter under `ac.dir` against vanilla in one run (`bench`: the
    run's tokens, warm-up, sampling and seed), then write the ablation table beside the
    benchmark's own report. With `ac.rebuild`, the table again from that finished benchmark,
    decoding nothing. Returns the table's folder."""
    variants = find_variants(ac.dir)
    labels = {v.name: f"eagle[{v.name}]" for v in variants}
    out_dir = Path(ac.out_dir)
    if ac.rebuild:
        report, variants = finished_bench(out_dir / "bench", variants, labels)
    else:
        drafters = {labels[v.name]: str(v.drafter) for v in variants}
        report = benchmark_drafters(methods, ac, bench, drafters, out_dir / "bench")
    table = ablation_report(variants, report, labels)
    keep_previous(out_dir, ("ablations.json", "ablations.md", "ablations.png"))  # the run before's
    write(table, out_dir)
    print((out_dir / "ablations.md").read_text())
    return out_dir


def benchmark_drafters(
    methods: Methods,
    ac: AblationsConfig,
    bench: BenchmarkConfig,
    drafters: Mapping[str, str],
    out_dir: Path,
) -> dict:
    """Vanilla and EAGLE with each drafter of `drafters` (label -> path), in one benchmark run."""
    dtype = methods.dtype("eagle", {"eagle": ac.dtype} if ac.dtype else {})

    def build(label: str):
        if label == "vanilla":
            return methods.build("vanilla", dtype), dtype
        eagle = {**methods.sections["eagle"], "drafter": drafters[label]}
        sections = {**methods.sections, "eagle": eagle}
        method = build_method("eagle", methods.context(dtype), sections)
        method.name = label
        return method, dtype

    eval_sets = {Path(name).stem: load_eval_set(name, ac.num_prompts) for name in ac.eval_sets}
    _, tokenizer = methods.target(dtype)
    record_drafters(out_dir, drafters)  # what a rebuild checks the drafters against
    config = replace(bench, methods=("vanilla", *drafters), temperatures=tuple(ac.temperatures))
    return run_benchmark(
        eval_sets,
        tokenizer,
        build,
        config,
        target_name=methods.target_path,
        out_dir=out_dir,
        device=methods.device,
        reference=lambda d: methods.build("vanilla", d),
    )
