"""Validation loss against CPU minutes for candidate shapes of the embedded target.

    .venv/bin/python scripts/target_sweep.py --minutes 5
    .venv/bin/python scripts/target_sweep.py --minutes 10 --shapes 256x16:4 128x12:8 --lr 2e-3 3e-3
    .venv/bin/python scripts/target_sweep.py --shapes 128x12:8 128x12:8@4e-3   # one candidate's own lr

A candidate is `HIDDENxLAYERS:BATCH[@LR]` (blocks of 256 tokens per step); heads are of width 64
(at least one), half as many KV heads (one when the heads are odd), a SwiGLU of ~8/3 x hidden.
For each candidate (and learning rate) the script

1. measures its training throughput on this machine: a few steps of the real model on random
   tokens, in a fresh process with train.py's threads, before any run starts (kept in
   `throughput.json`: a rerun reuses them, so runs resumed on a busier machine keep their budget);
2. gives it `minutes x throughput` tokens: `trainer.max_steps` is fixed before training, so a
   loaded machine makes the sweep slower, not different (the cosine schedule ends at the budget);
3. trains it: `train.py experiment=target_tiny` with the shape overrides, into
   `runs/target_sweep/<candidate>/` (an interrupted sweep resumes each run from its last.ckpt;
   finished runs are reused), validating 5 times along the way;
4. reads each run's validation curve and greedy repetition (`eagle_target.json`).

Writes `sweep.json`, `sweep.md` and `sweep.png` (validation loss against idle-equivalent CPU
minutes: steps x tokens per step / measured throughput) into `runs/target_sweep/`.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 256  # data.datamodule.block_size of experiment=target_tiny

THROUGHPUT = r"""
import json, sys, time, torch
sys.path.insert(0, {root!r})
from eagle.hardware import set_threads
from eagle.training.lm import build_causal_lm
set_threads("auto")
torch.manual_seed(0)
model = build_causal_lm(dict(model_type="llama", vocab_size=8192, **{shape!r})).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 8192, ({batch}, {block} + 1))
def step():
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
step()  # warm-up
start = time.perf_counter()
for _ in range({steps}):
    step()
print(json.dumps({steps} * {batch} * {block} / (time.perf_counter() - start)))
"""


def shape_of(spec: str) -> tuple[dict, int]:
    """`256x16:4` -> (model_config overrides, batch size)."""
    try:
        dims, batch = spec.split(":")
        hidden, layers = (int(v) for v in dims.split("x"))
        batch = int(batch)
    except ValueError:
        raise SystemExit(f"--shapes: {spec!r} is not HIDDENxLAYERS:BATCH (e.g. 256x16:4)") from None
    heads = max(1, hidden // 64)
    kv = heads // 2 if heads % 2 == 0 else 1
    ffn = round(8 * hidden / 3 / 16) * 16
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=ffn), batch


def throughput(shape: dict, batch: int, steps: int) -> float:
    """Training tokens per second of `shape` at `batch`, measured in a fresh process."""
    code = THROUGHPUT.format(root=str(ROOT), shape=shape, batch=batch, block=BLOCK, steps=steps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, val/loss) of every validation of a run, over all its resumed invocations."""
    points = {}
    for path in sorted((run_dir / "csv").glob("version_*/metrics.csv")):
        for row in csv.DictReader(path.open()):
            if row.get("val/loss"):
                points[int(row["step"])] = float(row["val/loss"])
    return sorted(points.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="idle-equivalent CPU minutes per candidate")
    parser.add_argument("--shapes", nargs="+", default=["256x16:4", "256x12:8", "192x12:8", "128x12:8", "128x16:8"])
    parser.add_argument("--lr", nargs="+", type=float, default=[2e-3], help="peak learning rates to try")
    parser.add_argument("--throughput-steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "target_sweep")
    parser.add_argument("train_overrides", nargs="*", help="more train.py overrides for every run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    candidates = []
    known_path = args.out / "throughput.json"
    known = json.loads(known_path.read_text()) if known_path.exists() else {}
    for item in args.shapes:  # every throughput first, while the machine is as idle as it gets
        spec, _, own_lr = item.partition("@")  # a candidate may carry its own learning rate
        if own_lr and not own_lr.replace(".", "", 1).replace("e-", "", 1).isdigit():
            raise SystemExit(f"--shapes: {item!r}: {own_lr!r} is not a learning rate (e.g. 128x12:8@4e-3)")
        shape, batch = shape_of(spec)
        if spec not in known:
            known[spec] = throughput(shape, batch, args.throughput_steps)
            known_path.write_text(json.dumps(known, indent=2))
        tps = known[spec]
        print(f"[sweep] {spec}: {tps:.0f} training tokens/s", flush=True)
        lrs, named = ([float(own_lr)], True) if own_lr else (args.lr, len(args.lr) > 1)
        candidates += [dict(spec=spec, shape=shape, batch=batch, lr=lr, tokens_per_s=tps,
                            name=spec.replace(":", "_b") + (f"_lr{lr:g}" if named else "")) for lr in lrs]

    for c in candidates:
        c["steps"] = max(5, int(args.minutes * 60 * c["tokens_per_s"] / (c["batch"] * BLOCK)))
        run_dir = args.out / c["name"]
        overrides = [f"model.model_config.{k}={v}" for k, v in c["shape"].items()] + [
            "experiment=target_tiny", f"task_name=target_sweep/{c['name']}", f"paths.run_dir={run_dir}",
            f"data.datamodule.batch_size={c['batch']}", f"model.optim.lr={c['lr']}",
            f"trainer.max_steps={c['steps']}", f"trainer.val_check_interval={max(1, c['steps'] // 5)}",
            f"callbacks.model_checkpoint.every_n_train_steps={max(1, c['steps'] // 5)}",
            "trainer.max_time=null", "check_baseline=false", *args.train_overrides]
        if not (run_dir / "model" / "eagle_target.json").exists():
            print(f"[sweep] {c['name']}: {c['steps']} steps x {c['batch'] * BLOCK} tokens", flush=True)
            subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], check=True, cwd=ROOT)
        sidecar = json.loads((run_dir / "model" / "eagle_target.json").read_text())
        c["n_params"] = sidecar["n_params"]
        c["val_loss"] = sidecar["val/loss"]
        c["repetition"] = sidecar.get("repetition", {}).get("rate")
        c["repeated_ngrams"] = sidecar.get("repetition", {}).get("repeated_ngrams")
        c["curve"] = [(s, loss, (s + 1) * c["batch"] * BLOCK / c["tokens_per_s"] / 60) for s, loss in val_curve(run_dir)]

    (args.out / "sweep.json").write_text(json.dumps({"minutes": args.minutes, "candidates": candidates}, indent=2))
    lines = [f"Target shapes, {args.minutes:g} idle-equivalent CPU minutes each (scripts/target_sweep.py)", "",
             "| candidate | lr | params | tokens/s | steps | tokens | val loss | greedy texts with a repeated"
             " 8-gram | repeated 8-grams |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in sorted(candidates, key=lambda c: c["val_loss"]):
        rep = " | ".join("-" if c[k] is None else f"{c[k]:.0%}" for k in ("repetition", "repeated_ngrams"))
        lines.append(f"| {c['spec']} | {c['lr']:g} | {c['n_params'] / 1e6:.1f}M | {c['tokens_per_s']:.0f} | {c['steps']} | "
                     f"{c['steps'] * c['batch'] * BLOCK / 1e6:.2f}M | {c['val_loss']:.3f} | {rep} |")
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in candidates:
        xs, ys = [m for _, _, m in c["curve"]], [loss for _, loss, _ in c["curve"]]
        ax.plot(xs, ys, marker="o", label=f"{c['name']} ({c['n_params'] / 1e6:.1f}M)")
    ax.set_xlabel("idle-equivalent CPU minutes (steps x tokens/step / measured tokens/s)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Embedded target: validation loss against training compute")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "sweep.png", dpi=120)
    print(f"[sweep] wrote {args.out}/sweep.json, sweep.md, sweep.png")


if __name__ == "__main__":
    main()
