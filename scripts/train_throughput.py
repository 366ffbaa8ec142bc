"""Target training throughput on this machine: tokens/s of the real target_tiny model and optimiser
for a few steps, per precision and thread count, optionally beside CPU-bound competitor processes.

    .venv/bin/python scripts/train_throughput.py --precision 32-true bf16-mixed --threads 1 2 \
        --competitors 0 1 3 --steps 20
    .venv/bin/python scripts/train_throughput.py --threads auto --competitors 0 1 3   # train.py's choice

Each case runs in a fresh process (thread pools and OMP settings are fixed at start-up); the
competitors are busy loops (`python -c "while True: pass"`) started before and killed after it.
Prints one JSON line per case; `--json FILE` also appends them to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASE = r"""
import json, sys, time, torch
sys.path.insert(0, {root!r})
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from eagle.training.lm import build_causal_lm
from eagle.hardware import set_threads
set_threads({threads!r})  # "auto": the cores idle now (what train.py does with threads=auto)
with initialize_config_dir({configs!r}, version_base="1.3"):
    cfg = compose("train", overrides=["experiment=target_tiny"])
model_config = OmegaConf.to_container(cfg.model.model_config, resolve=True)
model_config.update(vocab_size=8192)
torch.manual_seed(0)
model = build_causal_lm(model_config).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
b, t = cfg.data.datamodule.batch_size, cfg.data.datamodule.block_size
x = torch.randint(0, 8192, (b, t + 1))
bf16 = {precision!r} == "bf16-mixed"
def step():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
step()  # warm-up
start = time.perf_counter()
for _ in range({steps}):
    step()
sec = time.perf_counter() - start
print(json.dumps({{"tokens_per_s": round({steps} * b * t / sec, 1), "s_per_step": round(sec / {steps}, 3),
                  "threads": torch.get_num_threads()}}))
"""


def run_case(precision: str, threads: int | str, competitors: int, steps: int, env_extra: dict) -> dict:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(competitors)]
    try:
        time.sleep(1.0 if busy else 0.0)
        code = CASE.format(root=str(ROOT), configs=str(ROOT / "configs"), threads=threads or None, precision=precision,
                           steps=steps)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, **env_extra}, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return {"precision": precision, "threads_asked": threads, "competitors": competitors, **env_extra, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", nargs="+", default=["32-true"])
    ap.add_argument("--threads", nargs="+", type=lambda v: v if v == "auto" else int(v), default=[0],
                    help="0 = torch's default; auto = the idle cores (eagle.hardware.auto_threads)")
    ap.add_argument("--competitors", nargs="+", type=int, default=[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--omp-wait-policy", nargs="+", default=[""], help="'' (unset), PASSIVE or ACTIVE")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    for precision in args.precision:
        for policy in args.omp_wait_policy:
            for threads in args.threads:
                for competitors in args.competitors:
                    env = {"OMP_WAIT_POLICY": policy} if policy else {}
                    row = run_case(precision, threads, competitors, args.steps, env)
                    print(json.dumps(row), flush=True)
                    if args.json:
                        with args.json.open("a") as f:
                            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
