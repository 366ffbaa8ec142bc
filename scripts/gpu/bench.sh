#!/usr/bin/env bash
# The GPU benchmark of the default target, SmolLM2-135M-Instruct, made to fit one lease of the
# device tool: 15 minutes of device time in all (the machine's start included), commands of at
# most 10 minutes that each carry at most 64 MiB with the repository, no package index there.
# One lease brings back:
#   (a) SmolLM2's EAGLE drafter, trained on ShareGPT features dumped on the GPU, for the
#       minutes the other stages leave (configs/experiment/drafter_smollm2_gpu.yaml);
#   (b) EAGLE against compiled vanilla (static caches, torch.compile with CUDA graphs) on
#       MT-bench at T=0 and T=1 with that drafter: tau, tokens/s, speedup (results.json/.md);
#   (c) vanilla's and EAGLE's rounds timed at Llama-7B shape with random weights, and the 7B
#       ms/token projected with (b)'s tau (decode.py mode=timing; labelled a projection).
#
# The lease. Here first: `bash scripts/gpu/carry.sh` packs .carry/1 and .carry/2 and prints the
# calls. Then two calls, back to back on one machine (it goes back after 30 s idle, and call 2
# needs what call 1 left in /tmp/eagle):
#   call 1  carry [".carry/1"] (~62 MiB: the wheels and the payload's first piece)
#           bash scripts/gpu/bench.sh timing   stash, install the wheels, time (c).
#           TOTAL 240 s; with the machine's start (budget 60 s), ~5 minutes of the lease
#   call 2  carry [".carry/2"] (~60 MiB: the payload's rest)
#           bash scripts/gpu/bench.sh run      stash, check the manifest, unpack, convert the
#           target, dump the features, train (a), benchmark (b), project (c). TOTAL 510 s
# About 14 minutes in all, with the transfers. Where status's budget_left_s before call 2 is
# under 570, run `TOTAL=<budget_left_s - 60> bash scripts/gpu/bench.sh run`: the drafter's
# training shrinks. A payload of three folders (a larger repository) adds a `stash` call
# between them, of seconds.
# Each call writes into OUT (the device tool's $OUT; at most 8 files come back): call 1
# pipeline.log, timing.json, timing.md; call 2 pipeline.log, results.json, results.md (the
# benchmark's tables, then the timing's with the projection), timing.json and the drafter's
# run folder as drafter.tar.NN (15 MiB pieces; here: `cat drafter.tar.* | tar -C runs -xf -`).
#
# Budgets. Each stage has a time cap, no stage runs past its call's TOTAL, and a stage that
# fails stops only what needs its output (the log says what and why). The caps come from the
# first runs of the GPU pipeline on an H200 (docs/results.md, "GPU: the first runs"; LOG.md,
# 2026-12-04): the wheels' install, compiling the 7B shape's static passes, compiled decoding of
# 128 tokens; the SmolLM2 stages are not yet measured there. The drafter fits for what the
# other stages leave: Lightning's max_time stops it in good order (it validates and exports),
# where a cap would kill it and lose the run.
#
#   bash scripts/gpu/bench.sh local  # a GPU machine with the packages installed: (a)-(c) in one
#                                    # go, no payload (TOTAL 900 s: the drafter takes the rest)
#   bash scripts/gpu/bench.sh smoke  # the calls on this CPU, tiny sizes: every stage runs
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)  # the budget counts the unpacking too (common.sh keeps this START)
MODE=${1:-}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

# ------------------------------------------------------------------- smoke, on the CPU
# The calls as on the device, on this machine's CPU: a payload of 80 conversations cut into 3
# calls (timing, stash, run; no wheels: this machine has the packages), a few samples of 128
# tokens, 8 training steps, 2 prompts of 16 tokens, a tiny timing shape. TARGET may name a
# converted folder to reuse (by default runs/smollm2/model, `make demo`'s; converted there when
# missing). The benchmark is not compiled here (COMPILE=true does it, minutes on a CPU): the
# timing compiles both static methods. It comes before the calls' defaults, which it sets.
smoke() {
  local dir=${SMOKE_DIR:-runs/gpu_smoke}
  rm -rf "$dir" && mkdir -p "$dir" || exit 1
  export PY DEVICE=cpu COMPILE=${COMPILE:-false} STASH=$dir/stash PAYLOAD=$dir/payload \
    RUNS=$dir/runs SITE=$dir/site-packages TARGET=${TARGET:-runs/smollm2/model}
  CARRY=$dir/carry DOWNLOAD=0 CONVERSATIONS=80 ROOM_KIB=48 bash scripts/gpu/carry.sh || exit 1
  export TIMING_ARGS="timing.methods=[vanilla:static,eagle:static] timing.shape_name=tiny \
timing.shape.hidden_size=64 timing.shape.intermediate_size=128 timing.shape.num_hidden_layers=2 \
timing.shape.num_attention_heads=4 timing.shape.num_key_value_heads=2 timing.shape.vocab_size=512 \
timing.new_tokens=16 timing.prompt_len=16 timing.repeats=1 timing.bandwidth_gb_s=50 threads=1"
  export FEATURE_ARGS="max_len=128 source.max_samples=24 source.val_fraction=0.2 \
source.max_val_samples=8 batch_size=8"
  export DRAFTER_ARGS="experiment=drafter_smollm2_gpu trainer=cpu trainer.max_steps=8 \
trainer.val_check_interval=4 trainer.limit_val_batches=1 \
callbacks.model_checkpoint.every_n_train_steps=4 data.datamodule.batch_size=2 check_baseline=false"
  export BENCH_ARGS="benchmark.num_prompts=2 max_new_tokens=16 kernels=default threads=1"
  export CAP_TARGET=${CAP_TARGET:-180} CAP_FEATURES=${CAP_FEATURES:-180}
  export CAP_BENCH=${CAP_BENCH:-240} CAP_TIMING=${CAP_TIMING:-240} SLACK=${SLACK:-120}
  # each call sees its own folder alone, as on the device
  local rc=0 calls call mode compile
  calls=$(cd "$dir/carry" && ls -d [0-9]* | sort -n)
  for call in $calls; do
    mkdir -p "$dir/call$call" && mv "$dir/carry/$call" "$dir/call$call/"
    mode=stash compile=$COMPILE
    [ "$call" = 1 ] && mode=timing compile=true  # the tiny timing shape compiles in a minute
    [ "$call" = "$(echo "$calls" | tail -1)" ] && mode=run
    echo "smoke: call $call: bench.sh $mode"
    OUT=$dir/out$call CARRY=$dir/call$call COMPILE=$compile TOTAL=${TOTAL:-570} \
      bash scripts/gpu/bench.sh $mode || rc=1
    [ "$(ls "$dir/out$call" 2>/dev/null | wc -l)" -le 8 ] || { echo "over 8 files"; rc=1; }
  done
  echo "smoke: exit $rc in $(( $(date +%s) - START ))s (the results: $dir/out*)"
  exit $rc
}
[ "$MODE" = smoke ] && smoke

# ------------------------------------------------------------------------------ settings
OUT=${OUT:-runs/gpu_bench}
if [ "$MODE" = local ]; then
  RUNS=${RUNS:-runs/gpu}  # target, features, runs
  TARGET=${TARGET:-runs/smollm2/model}  # the demo's converted target (reused when there)
else
  RUNS=${RUNS:-/tmp/eagle/runs}  # kept between the calls of one lease
  TARGET=${TARGET:-$RUNS/smollm2/model}
fi
DEVICE=${DEVICE:-cuda}
COMPILE=${COMPILE:-true}
RUN=$RUNS/drafter_smollm2_gpu  # the drafter's run folder (train.py's paths.run_dir)
source scripts/gpu/transport.sh  # CARRY, STASH, PAYLOAD; stash, verify, unpack

# (c) the compiled methods only: eager decoding is overhead-bound on a GPU (LOG.md)
TIMING_ARGS=${TIMING_ARGS:-timing.methods=[vanilla:static,eagle:static] timing.repeats=1}
# 10,000 conversations cut at 1,024 tokens (2.5x the CPU's long preset); the target computes in
# bf16 on the GPU (data_gen's auto), as the benchmark decodes it there
FEATURE_ARGS=${FEATURE_ARGS:-max_len=1024 source.max_samples=10000 \
source.max_val_samples=64 batch_size=32}
# verify=size: the dump was hashed minutes before, in the same call (hashing gigabytes again
# would come out of the fitting time)
DRAFTER_ARGS=${DRAFTER_ARGS:-experiment=drafter_smollm2_gpu data.datamodule.verify=size}
# 8 MT-bench prompts (one per category), 128 new tokens; 768 static slots hold every MT-bench
# prompt + 128 + the tree, so that each pass compiles once
BENCH_ARGS=${BENCH_ARGS:-benchmark.num_prompts=8 max_new_tokens=128 static_max_len=768}
CAP_TIMING=${CAP_TIMING:-200} CAP_TARGET=${CAP_TARGET:-90} CAP_FEATURES=${CAP_FEATURES:-240}
CAP_BENCH=${CAP_BENCH:-170} CAP_PROJECT=${CAP_PROJECT:-20}
SLACK=${SLACK:-60}  # of the drafter's stage, for what max_time does not count: start-up,
                    # loading the dump, the last validation and checkpoint, the export

# collect: what exists into OUT (after every stage, so that a killed call still brings results)
collect_timing() {
  cp -f "$RUNS"/timing/timing.json "$RUNS"/timing/timing.md "$OUT"/ 2>/dev/null
}
collect_run() {
  cp -f "$RUNS"/bench/results.json "$RUNS"/timing/timing.json "$OUT"/ 2>/dev/null
  cat "$RUNS"/bench/results.md "$RUNS"/timing/timing.md 2>/dev/null >"$OUT/results.md"
  [ -d "$RUN/drafter" ] || return 0
  local parts=(drafter) runs
  [ -d "$RUN/csv" ] && parts+=(csv)
  runs=$(cd "$RUNS" && pwd)
  rm -f "$OUT"/drafter.tar.*
  tar -C "$runs" -cf - "${parts[@]/#/drafter_smollm2_gpu/}" \
    | split -b 15m -d - "$OUT/drafter.tar." || say "packing the drafter into $OUT failed"
}

# (c): vanilla's and EAGLE's static rounds at Llama-7B shape
time_7b() {
  rm -rf "$RUNS/timing"
  stage timing "$CAP_TIMING" $PY decode.py mode=timing device=$DEVICE compile=$COMPILE \
    $TIMING_ARGS timing.out_dir=$RUNS/timing paths.runs_dir=$RUNS
}

# (a), (b) and (c)'s projection; SHAREGPT: the conversations (null: the installed package's)
train_and_benchmark() {
  local rc dump_rc=1 fit
  stage target "$CAP_TARGET" $PY -m data_gen.target out_dir=$TARGET paths.runs_dir=$RUNS
  rc=$?
  if needs features $rc "no converted target"; then
    stage features "$CAP_FEATURES" $PY -m data_gen $FEATURE_ARGS target_path=$TARGET \
      source.path=$SHAREGPT name=smollm2-sharegpt-gpu device=$DEVICE paths.runs_dir=$RUNS \
      progress=false
    dump_rc=$?
  fi
  if needs drafter $dump_rc "no complete feature dump"; then
    fit=$(( START + TOTAL - $(date +%s) - CAP_BENCH - CAP_PROJECT - SLACK - 10 ))
    [ $fit -lt 10 ] && fit=10  # the stage then says the budget is spent
    stage_once "$RUN/drafter/config.json" drafter $(( fit + SLACK )) $PY train.py \
      $DRAFTER_ARGS model.target_path=$TARGET paths.runs_dir=$RUNS require_planned_steps=false \
      trainer.max_time=$(printf '00:%02d:%02d:%02d' $(( fit / 3600 )) $(( fit / 60 % 60 )) \
      $(( fit % 60 )))
  fi
  [ -f "$RUN/drafter/config.json" ] && rc=0 || rc=1  # exported: trained, or reused
  if needs benchmark $rc "no trained drafter"; then
    stage benchmark "$CAP_BENCH" $PY decode.py mode=benchmark device=$DEVICE compile=$COMPILE \
      target=$TARGET eagle.drafter=$RUN/drafter "benchmark.methods=[vanilla:static,eagle:static]" \
      benchmark.eval_sets=[mtbench] $BENCH_ARGS benchmark.out_dir=$RUNS/bench paths.runs_dir=$RUNS
  fi
  # a benchmark stopped by its cap keeps its finished (eval set, temperature) runs: they project
  [ -f "$RUNS/bench/results.json" ] && rc=0 || rc=1
  if needs project $rc "no benchmark results"; then
    grep -qs '"eagle:static"' "$RUNS/timing/timing.json" && rc=0 || rc=1
    if needs project $rc "no timed eagle:static round (bench.sh timing, call 1)"; then
      stage project "$CAP_PROJECT" $PY decode.py mode=timing \
        timing.measured=$RUNS/timing/timing.json timing.tau_from=$RUNS/bench/results.json \
        timing.out_dir=$RUNS/timing paths.runs_dir=$RUNS
    fi
  fi
  if [ -f "$RUN/drafter/train_metrics.json" ]; then
    $PY -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d.get(k) for k in \
('steps', 'planned_steps', 'tokens_per_s', 'train_time_s', 'val/top1_d1'))}" \
      "$RUN/drafter/train_metrics.json" | tee -a "$LOG"
  fi
}

# begin COLLECT: OUT and RUNS made, no earlier result left in OUT to pass for this call's, and
# COLLECT the function that each stage calls after it
begin() {
  mkdir -p "$OUT" "$RUNS"
  rm -f "$OUT"/{pipeline.log,results.json,results.md,timing.json,timing.md} "$OUT"/drafter.tar.*
  COLLECT=$1
  collect() { $COLLECT; }
  source scripts/gpu/common.sh  # LOG, say, stage (which collects), install_wheels, versions
}

finish() {
  say "done in $(( $(date +%s) - START ))s; failed stages: ${FAILED[*]:-none}"
  ls -la "$OUT"
  cat "$OUT"/*.md 2>/dev/null
  [ ${#FAILED[@]} -eq 0 ]
  exit $?
}

case $MODE in
  timing)  # call 1
    TOTAL=${TOTAL:-240}
    stash || exit 1
    if ! verify wheels.tar; then
      echo "no wheels.tar in $STASH, or a corrupt one: call 1 carries .carry/1"
      exit 1
    fi
    unpack_wheels || { echo "unpacking the wheels failed"; exit 1; }
    begin collect_timing
    install_wheels "$PAYLOAD"/wheels/*.whl
    versions
    time_7b
    finish ;;
  stash)  # a middle call, where the payload needs more than two
    stash; exit $? ;;
  run)  # the last call
    TOTAL=${TOTAL:-510}
    # it may carry nothing new where the earlier calls brought every chunk
    if compgen -G "$CARRY/*/manifest" >/dev/null || [ ! -f "$STASH/manifest" ]; then
      stash || exit 1
    fi
    if ! verify; then
      echo "missing or corrupt chunks in $STASH: each .carry/N must come in its own call first" \
           "(bash scripts/gpu/bench.sh timing, then stash), while the machine stays warm"
      exit 1
    fi
    unpack || exit 1
    rm -rf "$RUNS/bench"  # the target, the dump and the drafter may be reused, never a result
    begin collect_run
    install_wheels "$PAYLOAD"/wheels/*.whl "$PAYLOAD"/*.whl
    versions
    SHAREGPT=$PAYLOAD/sharegpt.json
    train_and_benchmark
    finish ;;
  local)  # a GPU machine with this repository's packages installed (pip install -e .)
    TOTAL=${TOTAL:-900}
    rm -rf "$RUNS/bench"
    begin collect_run
    versions
    SHAREGPT=null
    time_7b
    train_and_benchmark
    finish ;;
  *)
    echo "usage: bash scripts/gpu/bench.sh timing|stash|run|local|smoke (see its header)"
    exit 2 ;;
esac
