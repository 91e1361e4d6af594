#!/usr/bin/env bash
# Perplexity of one model on ../shared/eval/opticks-part1.txt (ctx 512) with
# its KV cache at each uniform dtype and at `--kv-dtype auto:BITS` plans
# (calibrated on the built-in passage of opticks-part2), one table row per
# setting: bits per element, bytes per token, perplexity and its change
# against f16. The plan of every auto row is printed under the table.
#
#   scripts/kv-precision-quality.sh [-t THREADS] [-m MODEL] [-n CALIBRATION_TOKENS]
#                                   [-b BLOCK_TOKENS] [SETTING ...]
#
# BLOCK_TOKENS is `--kv-block-size` (default 16): INT4 and INT2 keys keep
# a scale and minimum per channel per block, so their bits depend on it.
# SETTING: anything --kv-dtype takes; default: f16 int8 int4 int2 auto:7
# auto:6 auto:5.5 auto:5 auto:4.5 auto:3.5.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.."
threads=2
model=smollm2-135m
calibration=128
block=16
while getopts "t:m:n:b:" opt; do
  case "$opt" in
    t) threads=$OPTARG ;;
    m) model=$OPTARG ;;
    n) calibration=$OPTARG ;;
    b) block=$OPTARG ;;
    *) echo "usage: $0 [-t THREADS] [-m MODEL] [-n TOKENS] [-b BLOCK_TOKENS] [SETTING ...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=(f16 int8 int4 int2 auto:7 auto:6 auto:5.5 auto:5 auto:4.5 auto:3.5)

text="$root/../shared/eval/opticks-part1.txt"
[ -f "$text" ] || { echo "missing $text" >&2; exit 1; }
(cd "$root" && cargo build --release -q -p tandem)
tandem="$root/target/release/tandem"
log=$(mktemp)
trap 'rm -f "$log"' EXIT

echo "| KV (\`--kv-dtype\`) | bits per element | bytes per token | perplexity | vs f16 |"
echo "|---|---|---|---|---|"
base=""
plans=()
for s in "${settings[@]}"; do
  "$tandem" perplexity --backend cpu -t "$threads" -m "$model" --file "$text" --ctx 512 \
    --kv-dtype "$s" --kv-calibration-tokens "$calibration" --kv-block-size "$block" >"$log" 2>&1
  ppl=$(sed -n 's/^PPL = \([0-9.]*\).*/\1/p' "$log")
  kv=$(grep -o 'KV plan:[^ ]* ([0-9]* bytes per token, [0-9.]* bits per element)' "$log" | head -1)
  bytes=$(sed -n 's/.*(\([0-9]*\) bytes per token.*/\1/p' <<<"$kv")
  bits=$(sed -n 's/.*, \([0-9.]*\) bits per element.*/\1/p' <<<"$kv")
  [ -n "$base" ] || base=$ppl
  delta=$(awk -v p="$ppl" -v b="$base" 'BEGIN { printf "%+.2f%%", 100 * (p / b - 1) }')
  echo "| $s | $bits | $bytes | $ppl | $delta |"
  case "$s" in auto*) plans+=("$s: $(sed -n 's/^KV \(plan:[^ ]*\) .*/\1/p' <<<"$kv")") ;; esac
done
echo
echo "model $model, ctx 512, calibration $calibration tokens; vs the first row"
for p in "${plans[@]}"; do echo "- $p"; done
