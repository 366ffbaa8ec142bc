"""How a drafter's acceptance grows with training: greedy tau on MT-bench of every checkpoint a
training run kept, beside the run's validation top-1, the training tokens and the minutes of training
behind each checkpoint.

    python train.py experiment=drafter_smollm2_long callbacks.model_checkpoint.save_top_k=-1  # keeps step=N.ckpt
    .venv/bin/python scripts/drafter_curve.py --run runs/drafter_smollm2_long \
        --trees eagle_default runs/tree_search/demo_smollm2/machine.yaml%4096 --prompts 10

Decoding is in float32, greedy by default, so every text is vanilla's and tau depends on the
drafter alone, not on the machine's load (it can run beside other work), and the linears run the
fastest kernels that build here (`--kernels`: fused, else the default); `--temperatures 0 1` adds
sampled tau (each prompt seeded, the same draws for every checkpoint). Tokens and minutes per checkpoint are
the run's totals (train_metrics.json) times step / steps. Writes curve.json, curve.md and
curve.png into --out (default: <run>/curve).
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle.bench.benchmark import encode_prompt  # noqa: E402
from eagle.bench.evalsets import load_eval_set  # noqa: E402
from eagle.bench.methods import MethodContext, build_method  # noqa: E402
from eagle.decoding.kernels import available_kernels, use_kernels  # noqa: E402
from eagle.hardware import set_threads  # noqa: E402
from eagle.models.checkpoint import load_drafter, save_drafter  # noqa: E402
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
                out[int(row["step"]) + 1] = {k: float(v) for k, v in row.items() if k.startswith("val/top") and v}
    return out


def split(tree: str) -> tuple[str, int | None]:
    name, pct, vocab = tree.partition("%")
    return name, int(vocab) if pct else None


def column_name(spec: str, temperature: float) -> str:
    return spec if temperature == 0 else f"{spec} T={temperature:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a drafter run folder (runs/<task_name>)")
    parser.add_argument("--target", type=Path, default=ROOT / "runs" / "smollm2" / "model")
    parser.add_argument("--trees", nargs="+", default=["eagle_default"], help="TREE or TREE%%K (a drafting vocabulary)")
    parser.add_argument("--prompts", type=int, default=10, help="MT-bench first turns")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0], help="0 is greedy")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--extra", nargs="*", default=[], help="more drafter folders (LABEL=DIR) on the same curve")
    parser.add_argument("--threads", default="auto", help="torch threads: auto (the idle cores) or a number")
    parser.add_argument("--kernels", default=None, help="the linears' kernels (eagle.decoding.kernels): default, "
                        "onednn or fused; by default fused where it builds (a float32 step 2-3x faster on a CPU than "
                        "F.linear: the curve's many decodes take a fraction of the time)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or args.run / "curve"
    out.mkdir(parents=True, exist_ok=True)
    set_threads(args.threads)

    target, tokenizer = load_target(args.target)
    use_kernels(target, args.kernels or ("fused" if "fused" in available_kernels() else "default"))
    final = args.run / "drafter"
    report = json.loads((final / "train_metrics.json").read_text())
    steps, tokens, seconds = report["steps"], report["tokens_seen"], report["train_time_s"]
    val = validation_top1(args.run)
    prompts = [encode_prompt(tokenizer, p) for p in load_eval_set("mtbench", args.prompts)]
    ctx = MethodContext(target=target, tokenizer=tokenizer, target_path=str(args.target),
                        tree_dirs=(str(ROOT / "configs" / "tree"),))
    names = [column_name(spec, t) for spec in args.trees for t in args.temperatures]

    def taus(drafter_dir: Path) -> dict[str, float]:
        result = {}
        for spec in args.trees:
            tree, vocab = split(spec)
            method = build_method("eagle", ctx, {"eagle": {"drafter": str(drafter_dir), "tree": tree,
                                                           "draft_vocab": vocab}})  # the drafter loaded once per tree
            for temperature in args.temperatures:
                policy = SamplingPolicy(temperature=temperature)
                stats = [method.generate(p, args.new_tokens, policy, torch.Generator().manual_seed(i)).stats
                         for i, p in enumerate(prompts)]
                result[column_name(spec, temperature)] = (sum(s.committed for s in stats)
                                                          / max(sum(s.forwards for s in stats), 1))
        return result

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = load_drafter(final, target, tokenizer, str(args.target))  # the run's drafter: its config
        for step, path in checkpoints(args.run):
            state = submodule_state(torch.load(path, map_location="cpu", weights_only=False)["state_dict"], "drafter")
            folder = Path(tmp) / f"step{step}"
            save_drafter(base, folder, state=state)  # that checkpoint's weights
            shutil.copy(final / "token_counts.safetensors", folder)  # the training data's counts
            row = {"label": args.run.name, "step": step, "tokens": tokens * step / steps,
                   "cpu_minutes": seconds * step / steps / 60, "tau": taus(folder),
                   "val": val.get(step, {})}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for item in args.extra:
        label, _, folder = item.partition("=")
        meta = json.loads((Path(folder) / "train_metrics.json").read_text())
        row = {"label": label, "step": meta["steps"], "tokens": meta["tokens_seen"],
               "cpu_minutes": meta["train_time_s"] / 60, "tau": taus(Path(folder)),
               "val": {k: v for k, v in meta.items() if k.startswith("val/top")}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "curve.json").write_text(json.dumps({"prompts": args.prompts, "new_tokens": args.new_tokens,
                                                "trees": args.trees, "temperatures": args.temperatures,
                                                "rows": rows}, indent=2))
    lines = ["| drafter | step | training tokens | training minutes | val top-1 (depth 1 / 2) | "
             + " | ".join(f"tau {n}" for n in names) + " |", "|---|---:|---:|---:|---|" + "---:|" * len(names)]
    for r in rows:
        v = r["val"]
        top = f"{v['val/top1_d1']:.3f} / {v['val/top1_d2']:.3f}" if "val/top1_d1" in v else "-"
        lines.append(f"| {r['label']} | {r['step']} | {r['tokens'] / 1e6:.2f}M | {r['cpu_minutes']:.1f} | {top} | "
                     + " | ".join(f"{r['tau'][n]:.2f}" for n in names) + " |")
    (out / "curve.md").write_text("\n".join(lines) + "\n")
    plot(rows, names, out / "curve.png")
    print("\n".join(lines))
    print(out.resolve())


def plot(rows: list[dict], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = list(dict.fromkeys(r["label"] for r in rows))  # one line per run; an --extra drafter is a lone point
    for i, label in enumerate(labels):
        mine = [r for r in rows if r["label"] == label]
        for j, name in enumerate(names):
            left.plot([r["tokens"] / 1e6 for r in mine], [r["tau"][name] for r in mine], marker="os^v"[i % 4],
                      color=f"C{j}", ls="-" if i == 0 else "none", label=f"tau, {name} ({label})")
        with_val = [r for r in mine if "val/top1_d1" in r["val"]]
        for depth in (1, 2, 3):
            key = f"val/top1_d{depth}"
            right.plot([r["cpu_minutes"] for r in with_val], [r["val"][key] for r in with_val], marker="os^v"[i % 4],
                       color=f"C{depth - 1}", ls="-" if i == 0 else "none",
                       label=f"validation top-1, depth {depth} ({label})")
    left.set_xlabel("training tokens (M)")
    left.set_ylabel("tau (MT-bench)")
    left.legend(fontsize=7)
    right.set_xlabel("minutes of training (the run's machine)")
    right.set_ylabel("agreement with the target")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
