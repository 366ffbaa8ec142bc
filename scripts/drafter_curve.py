"""How a drafter's acceptance grows with training: greedy tau on MT-bench of every checkpoint a
training run kept, beside the run's validation top-1, the training tokens and the minutes of
training behind each checkpoint.

    python train.py experiment=drafter_smollm2_long callbacks.model_checkpoint.save_top_k=-1  #
    keeps step=N.ckpt .venv/bin/python scripts/drafter_curve.py --run runs/drafter_smollm2_long \
        --trees eagle_default runs/tree_search/demo_smollm2/machine.yaml%4096 --prompts 10

Decoding is in float32, greedy by default, so every text is vanilla's and tau depends on the
drafter alone, not on the machine's load (it can run beside other work), and the linears run the
fastest kernels that build here (`--kernels`: fused, else the default); `--temperatures 0 1` adds
sampled tau (each prompt seeded, the same draws for every checkpoint). Tokens and minutes per
checkpoint are the run's totals (train_metrics.json) times step / steps. Writes curve.json (with
every prompt's committed tokens and forwards), curve.md and curve.png into --out (default:
<run>/curve).

The report fits tau = a + b log2(training tokens) over the run's checkpoints and says how many
tokens the line needs to reach --goal-greedy / --goal-sampled (3.0 / 2.5), with 90% intervals
from resampling the prompts (`fit`): with few prompts, which ones were chosen moves that figure
more than anything else. `--refit curve.json` writes the report again without decoding.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle.artifacts import write_json  # noqa: E402
from eagle.bench.benchmark import encode_prompt  # noqa: E402
from eagle.bench.evalsets import load_eval_set  # noqa: E402
from eagle.bench.methods import MethodContext, build_method  # noqa: E402
from eagle.hardware import set_threads  # noqa: E402
from eagle.kernels import available_kernels, use_kernels  # noqa: E402
from eagle.models.checkpoint import load_drafter, save_drafter  # noqa: E402
from eagle.progress import progress  # noqa: E402
from eagle.sampling import SamplingPolicy  # noqa: E402
from eagle.target import load_target  # noqa: E402
from eagle.training.module import submodule_state  # noqa: E402


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, file) of every `step=N.ckpt` the run kept, by step."""
    found = []
    for path in (run / "checkpoints").glob("step=*.ckpt"):
        match = re.fullmatch(r"step=(\d+)\.ckpt", path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def validation_top1(run: Path) -> dict[int, dict[str, float]]:
    """Validation agreement by depth at each logged step (the CSV logger's metrics.csv files)."""
    out: dict[int, dict[str, float]] = {}
    for path in sorted((run / "csv").glob("version_*/metrics.csv")):
        for row in csv.DictReader(path.open()):
            if row.get("val/top1_d1"):
                out[int(row["step"]) + 1] = {
                    k: float(v) for k, v in row.items() if k.startswith("val/top") and v
                }
    return out


def split(tree: str) -> tuple[str, int | None]:
    name, pct, vocab = tree.partition("%")
    return name, int(vocab) if pct else None


def pooled_tau(pairs: list[list[int]]) -> float:
    """Tokens committed per target forward over all the prompts (the benchmark's tau)."""
    return sum(c for c, _ in pairs) / max(sum(f for _, f in pairs), 1)


def column_name(spec: str, temperature: float) -> str:
    return spec if temperature == 0 else f"{spec} T={temperature:g}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run", type=Path, default=None, help="a drafter run folder (runs/<task_name>)"
    )
    parser.add_argument("--target", type=Path, default=ROOT / "runs" / "smollm2" / "model")
    parser.add_argument(
        "--trees",
        nargs="+",
        default=["eagle_default"],
        help="TREE or TREE%%K (a drafting vocabulary)",
    )
    parser.add_argument("--prompts", type=int, default=10, help="MT-bench first turns")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0], help="0 is greedy")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--extra", nargs="*", default=[], help="more drafter folders (LABEL=DIR) on the same curve"
    )
    parser.add_argument(
        "--threads", default="auto", help="torch threads: auto (the idle cores) or a number"
    )
    parser.add_argument(
        "--kernels",
        default=None,
        help="the linears' kernels (eagle.kernels): default, "
        "onednn, fused or fused_prefetch; by default fused where it builds (a float32 step 2-3x "
        "faster on a CPU than "
        "F.linear: the curve's many decodes take a fraction of the time)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--goal-greedy", type=float, default=3.0, help="the tau at T=0 the fit extrapolates to"
    )
    parser.add_argument(
        "--goal-sampled", type=float, default=2.5, help="the tau at T>0 the fit extrapolates to"
    )
    parser.add_argument(
        "--refit",
        type=Path,
        default=None,
        help="a curve.json: write its table, fit and plot again (into its folder, or --out)",
    )
    return parser.parse_args()


def measure(args: argparse.Namespace, out: Path) -> dict:
    """Decode the prompts with every checkpoint (and --extra drafter): curve.json's data (also
    written as curve.partial.json at once)."""
    set_threads(args.threads)

    target, tokenizer = load_target(args.target)
    use_kernels(target, args.kernels or ("fused" if "fused" in available_kernels() else "default"))
    final = args.run / "drafter"
    report = json.loads((final / "train_metrics.json").read_text())
    steps, tokens, seconds = report["steps"], report["tokens_seen"], report["train_time_s"]
    val = validation_top1(args.run)
    chosen = load_eval_set("mtbench", args.prompts)  # spread over MT-bench's categories
    prompts = [encode_prompt(tokenizer, p) for p in chosen]
    ctx = MethodContext(
        target=target,
        tokenizer=tokenizer,
        target_path=str(args.target),
        tree_dirs=(str(ROOT / "configs" / "tree"),),
    )

    def taus(drafter_dir: Path) -> dict[str, list[list[int]]]:
        """(committed tokens, target forwards) of every prompt, per column: the prompts' tau and
        what a bootstrap over the prompts resamples (`fit`)."""
        result = {}
        for spec in args.trees:
            tree, vocab = split(spec)
            method = build_method(
                "eagle",
                ctx,
                {"eagle": {"drafter": str(drafter_dir), "tree": tree, "draft_vocab": vocab}},
            )  # the drafter loaded once per tree
            for temperature in args.temperatures:
                policy = SamplingPolicy(temperature=temperature)
                stats = []
                for i, p in enumerate(prompts):
                    stats.append(
                        method.generate(
                            p, args.new_tokens, policy, torch.Generator().manual_seed(i)
                        ).stats
                    )
                    bar.update()
                result[column_name(spec, temperature)] = [[s.committed, s.forwards] for s in stats]
        return result

    def row(
        label: str, step: int, tokens_seen: float, minutes: float, drafter_dir: Path, val: dict
    ) -> dict:
        per_prompt = taus(drafter_dir)
        found = {
            "label": label,
            "step": step,
            "tokens": tokens_seen,
            "cpu_minutes": minutes,
            "tau": {name: pooled_tau(pairs) for name, pairs in per_prompt.items()},
            "val": val,
            "per_prompt": per_prompt,
        }
        bar.write(json.dumps({k: v for k, v in found.items() if k != "per_prompt"}))
        return found

    kept = checkpoints(args.run)
    decodes = len(args.trees) * len(args.temperatures) * len(prompts)  # per drafter
    bar = progress(total=(len(kept) + len(args.extra)) * decodes, desc="curve", unit="decode")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = load_drafter(
            final, target, tokenizer, str(args.target)
        )  # the run's drafter: its config
        for step, path in kept:
            state = submodule_state(
                torch.load(path, map_location="cpu", weights_only=False)["state_dict"], "drafter"
            )
            folder = Path(tmp) / f"step{step}"
            save_drafter(base, folder, state=state)  # that checkpoint's weights
            shutil.copy(final / "token_counts.safetensors", folder)  # the training data's counts
            rows.append(
                row(
                    args.run.name,
                    step,
                    tokens * step / steps,
                    seconds * step / steps / 60,
                    folder,
                    val.get(step, {}),
                )
            )
    for item in args.extra:
        label, _, folder = item.partition("=")
        meta = json.loads((Path(folder) / "train_metrics.json").read_text())
        rows.append(
            row(
                label,
                meta["steps"],
                meta["tokens_seen"],
                meta["train_time_s"] / 60,
                Path(folder),
                {k: v for k, v in meta.items() if k.startswith("val/top")},
            )
        )
    bar.close()
    data = {
        "prompts": args.prompts,
        "prompt_ids": [p.id for p in chosen],
        "categories": [p.category for p in chosen],
        "new_tokens": args.new_tokens,
        "trees": args.trees,
        "temperatures": args.temperatures,
        "run": args.run.name,
        "rows": rows,
    }
    # kept under another name until the report is written: curve.json (a Makefile stage's marker)
    # exists only beside a finished report, and a report that fails can be redone with --refit
    (out / "curve.partial.json").write_text(json.dumps(data, indent=2))
    return data


def columns(data: dict) -> list[tuple[str, float]]:
    """(column name, temperature) of every tree x temperature a curve measured."""
    return [(column_name(spec, t), t) for spec in data["trees"] for t in data["temperatures"]]


def slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slope of y (checkpoints, ...) on x (checkpoints,), for every trailing column.
    """
    xc = x - x.mean()
    return np.tensordot(xc, y - y.mean(0), axes=(0, 0)) / (xc @ xc)


def tokens_at(goal: float, x: np.ndarray, y: np.ndarray, slope: np.ndarray) -> np.ndarray:
    """The training tokens at which the fitted line reaches `goal` (inf where it does not rise)."""
    with np.errstate(divide="ignore", over="ignore"):
        log2_tokens = x.mean() + (goal - y.mean(0)) / slope
    return np.where(slope > 0, np.exp2(log2_tokens), np.inf)


def fit(
    data: dict, goals: tuple[float, float], resamples: int = 2000, seed: int = 0
) -> dict[str, dict]:
    """tau = a + b log2(training tokens) fitted over the run's checkpoints (the --extra drafters
    aside), per column: b (tau per doubling), b over the later half of the checkpoints (a bend
    shows there first) and the tokens at which the line reaches the goal (greedy, sampled), with
    90% intervals from resampling the prompts with replacement: the same resampled prompts for
    every checkpoint, so the interval says how much the prompts chosen move the extrapolation.
    A log-linear law is an assumption read off the measured range, not a promise beyond it."""
    mine = [r for r in data["rows"] if r["label"] == data.get("run", data["rows"][0]["label"])]
    if len(mine) < 2:
        return {}
    x = np.log2([r["tokens"] for r in mine])
    later = slice(len(mine) // 2, None) if len(mine) >= 4 else slice(None)
    result = {}
    for name, temperature in columns(data):
        goal = goals[0] if temperature == 0 else goals[1]
        y = np.array([r["tau"][name] for r in mine])
        slope = slopes(x, y)
        found = {
            "goal": goal,
            "checkpoints": len(mine),
            "per_doubling": float(slope),
            "center": [float(x.mean()), float(y.mean())],  # the fitted line passes through it
            "later_per_doubling": float(slopes(x[later], y[later])),
            "tokens_for_goal": float(tokens_at(goal, x, y, slope)),
            "run_tokens": float(2 ** x.max()),
        }
        if all(name in r.get("per_prompt", {}) for r in mine):
            pairs = np.array(
                [r["per_prompt"][name] for r in mine], dtype=np.float64
            )  # (checkpoints, prompts, 2)
            pick = np.random.default_rng(seed).integers(
                0, pairs.shape[1], (resamples, pairs.shape[1])
            )
            sums = pairs[:, pick].sum(2)  # (checkpoints, resamples, 2)
            yb = sums[..., 0] / sums[..., 1]  # (checkpoints, resamples): each resample's pooled tau
            sb = slopes(x, yb)
            tb = tokens_at(goal, x, yb, sb)
            # quantiles without interpolation: a resample whose line does not rise gives inf
            found["per_doubling_90"] = [
                float(q) for q in np.quantile(sb, [0.05, 0.95], method="inverted_cdf")
            ]
            found["tokens_for_goal_90"] = [
                float(q) for q in np.quantile(tb, [0.05, 0.95], method="inverted_cdf")
            ]
            found["resamples"], found["prompts"] = resamples, pairs.shape[1]
        result[name] = found
    return result


def human(tokens: float) -> str:
    if not np.isfinite(tokens):
        return "never"
    return f"{tokens / 1e9:.2f}B" if tokens >= 1e9 else f"{tokens / 1e6:.1f}M"


def write_report(data: dict, out: Path, goals: tuple[float, float]) -> None:
    """curve.md (the table, then the fit) and curve.png from a curve's data."""
    names = [name for name, _ in columns(data)]
    rows = data["rows"]
    lines = [
        "| drafter | step | training tokens | training minutes | val top-1 (depth 1 / 2) | "
        + " | ".join(f"tau {n}" for n in names)
        + " |",
        "|---|---:|---:|---:|---|" + "---:|" * len(names),
    ]
    for r in rows:
        v = r["val"]
        top = f"{v['val/top1_d1']:.3f} / {v['val/top1_d2']:.3f}" if "val/top1_d1" in v else "-"
        lines.append(
            f"| {r['label']} | {r['step']} | {r['tokens'] / 1e6:.2f}M | {r['cpu_minutes']:.1f} | "
            f"{top} | "
            + " | ".join(f"{r['tau'][n]:.2f}" for n in names)
            + " |"
        )
    fits = fit(data, goals)
    if fits:
        first = next(iter(fits.values()))
        lines += [
            "",
            f"tau = a + b log2(training tokens), fitted over the run's {first['checkpoints']} "
            "checkpoints "
            "(a law read off the measured range, not a promise beyond it)"
            + (
                f"; 90% intervals from {first['resamples']} resamples of the {first['prompts']} "
                "prompts with "
                "replacement"
                if "resamples" in first
                else ""
            )
            + ".",
            "",
            "| column | tau per doubling | the later half's | goal | training tokens for the goal "
            "| x the run |",
            "|---|---|---:|---:|---|---:|",
        ]
        for name, f in fits.items():
            b90, t90 = f.get("per_doubling_90"), f.get("tokens_for_goal_90")
            per = f"{f['per_doubling']:.3f}" + (f" [{b90[0]:.3f}, {b90[1]:.3f}]" if b90 else "")
            need = human(f["tokens_for_goal"]) + (
                f" [{human(t90[0])}, {human(t90[1])}]" if t90 else ""
            )
            ratio = f["tokens_for_goal"] / f["run_tokens"]
            times = "-" if not np.isfinite(ratio) else "reached" if ratio <= 1 else f"{ratio:.0f}x"
            lines.append(
                f"| {name} | {per} | {f['later_per_doubling']:.3f} | {f['goal']:g} | {need} | "
                f"{times} |"
            )
    (out / "curve.md").write_text("\n".join(lines) + "\n")
    plot(rows, names, fits, out / "curve.png")
    print("\n".join(lines))
    print(out.resolve())


def plot(rows: list[dict], names: list[str], fits: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.5))
    labels = list(
        dict.fromkeys(r["label"] for r in rows)
    )  # one line per run; an --extra drafter is a lone point
    for i, label in enumerate(labels):
        mine = [r for r in rows if r["label"] == label]
        for j, name in enumerate(names):
            left.plot(
                [r["tokens"] for r in mine],
                [r["tau"][name] for r in mine],
                marker="os^v"[i % 4],
                color=f"C{j}",
                ls="-" if i == 0 else "none",
                label=f"tau, {name} ({label})",
            )
        with_val = [r for r in mine if "val/top1_d1" in r["val"]]
        for depth in (1, 2, 3):
            key = f"val/top1_d{depth}"
            right.plot(
                [r["cpu_minutes"] for r in with_val],
                [r["val"][key] for r in with_val],
                marker="os^v"[i % 4],
                color=f"C{depth - 1}",
                ls="-" if i == 0 else "none",
                label=f"validation top-1, depth {depth} ({label})",
            )
    low = min(r["tokens"] for r in rows if r["label"] == labels[0])
    for j, (name, f) in enumerate(fits.items()):
        # the fitted line out to its goal (drawn to at most 1,000x the run), the goal's interval as
        # a bar
        end = min(max(f["tokens_for_goal"], f["run_tokens"]), 1000 * f["run_tokens"])
        xs = np.geomspace(low, end, 50)
        (cx, cy) = f["center"]
        left.plot(
            xs,
            cy + f["per_doubling"] * (np.log2(xs) - cx),
            color=f"C{j}",
            ls="--",
            lw=1,
            label=f"log-linear fit, {name}: tau {f['goal']:g} at "
            f"{human(f['tokens_for_goal'])} tokens",
        )
        if "tokens_for_goal_90" in f and np.isfinite(f["tokens_for_goal"]):
            lo, hi = (min(t, 1000 * f["run_tokens"]) for t in f["tokens_for_goal_90"])
            left.plot(
                [lo, hi],
                [f["goal"], f["goal"]],
                color=f"C{j}",
                lw=3,
                alpha=0.4,
                label=f"90% interval of those tokens (the prompts resampled), {name}",
            )
    left.set_xscale("log")
    left.set_xlabel("training tokens")
    left.set_ylabel("tau (MT-bench)")
    left.legend(
        fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2
    )  # under the axes
    right.set_xlabel("minutes of training (the run's machine)")
    right.set_ylabel("agreement with the target")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    goals = (args.goal_greedy, args.goal_sampled)
    if args.refit:  # the table, fit and plot again from a curve.json, no decoding
        data = json.loads(args.refit.read_text())
        out = args.out or args.refit.parent
        out.mkdir(parents=True, exist_ok=True)
        write_report(data, out, goals)
        return
    if args.run is None:
        raise SystemExit(
            "drafter_curve.py: give --run (a drafter run folder) or --refit (a curve.json)"
        )
    out = args.out or args.run / "curve"
    out.mkdir(parents=True, exist_ok=True)
    data = measure(args, out)
    write_report(data, out, goals)
    write_json(out / "curve.json", data)
    (out / "curve.partial.json").unlink()


if __name__ == "__main__":
    main()
