#!/usr/bin/env bash
# Tandem's perplexity on the whole of ../shared/eval/opticks-part1.txt (ctx
# 512, llama.cpp's method) against the independent NumPy reference's figure
# for the same file, model and method (tests/fixtures/NAME_perplexity_reference.json,
# from tests/reference/perplexity_reference.py). Prints one table row per
# model and exits non-zero when a model is off by more than 1%.
#
#   scripts/perplexity-vs-reference.sh [-t THREADS] [MODEL ...]
#
# MODEL is a name of scripts/models.tsv with a reference fixture; default:
# smollm2-135m qwen2.5-0.5b qwen2.5-1.5b gemma-3-270m.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.."
threads=0
while getopts "t:" opt; do
  case "$opt" in
    t) threads=$OPTARG ;;
    *) echo "usage: $0 [-t THREADS] [MODEL ...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m qwen2.5-0.5b qwen2.5-1.5b gemma-3-270m)

text="$root/../shared/eval/opticks-part1.txt"
[ -f "$text" ] || { echo "missing $text" >&2; exit 1; }
(cd "$root" && cargo build --release -q -p tandem)
tandem="$root/target/release/tandem"

echo "| model | Tandem PPL | reference PPL | difference | seconds |"
echo "|---|---|---|---|---|"
status=0
for m in "${models[@]}"; do
  # SmolLM2's fixture predates the per-model names.
  fixture="$root/tests/fixtures/${m}_perplexity_reference.json"
  [ "$m" = smollm2-135m ] && fixture="$root/tests/fixtures/smollm2_perplexity_reference.json"
  [ -f "$fixture" ] || { echo "no reference fixture for $m ($fixture)" >&2; exit 1; }
  path=$("$here/fetch-model.sh" "$m")
  start=$(date +%s)
  out=$("$tandem" perplexity --backend cpu -t "$threads" --model "$path" --file "$text" --ctx 512 2>/dev/null)
  seconds=$(($(date +%s) - start))
  python3 - "$m" "$fixture" "$out" "$seconds" <<'PY' || status=1
import json, re, sys
name, fixture, out, seconds = sys.argv[1:]
ours = float(re.search(r"PPL = ([0-9.]+)", out).group(1))
ref = json.load(open(fixture))["ppl"]
diff = (ours - ref) / ref
print(f"| {name} | {ours:.4f} | {ref:.4f} | {diff:+.2%} | {seconds} |")
sys.exit(0 if abs(diff) <= 0.01 else 1)
PY
done
exit "$status"
