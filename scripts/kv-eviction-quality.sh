#!/usr/bin/env bash
# KV eviction's quality figure: perplexity on ../shared/eval/opticks-part1.txt
# with the cache filled token by token (--batch 1, so eviction happens after
# every token), at 50%, 25% and 12.5% of the window as the KV budget, for
# h2o, snapkv and streaming, against the full cache. Windows of CTX tokens
# (llama.cpp's method: the second half of each window is scored; SnapKV
# selects once the first half is computed). Prints one markdown table row
# per budget and policy, with the change against the full cache.
#
#   scripts/kv-eviction-quality.sh [-m MODEL] [-c CTX] [-n WINDOWS] [-t THREADS]
#
# MODEL is a name of scripts/models.tsv (default smollm2-135m); CTX defaults
# to 4096; WINDOWS (0: every window of the text) to 0; THREADS to 2.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.."
model=smollm2-135m ctx=4096 windows=0 threads=2
while getopts "m:c:n:t:" opt; do
  case "$opt" in
    m) model=$OPTARG ;;
    c) ctx=$OPTARG ;;
    n) windows=$OPTARG ;;
    t) threads=$OPTARG ;;
    *) echo "usage: $0 [-m MODEL] [-c CTX] [-n WINDOWS] [-t THREADS]" >&2; exit 2 ;;
  esac
done

text="$root/../shared/eval/opticks-part1.txt"
[ -f "$text" ] || { echo "missing $text" >&2; exit 1; }
(cd "$root" && cargo build --release -q -p tandem)
tandem="$root/target/release/tandem"
path=$("$here/fetch-model.sh" "$model")

ppl() {
  "$tandem" perplexity --backend cpu -t "$threads" --model "$path" --file "$text" \
    --ctx "$ctx" --chunks "$windows" --batch 1 "$@" 2>/dev/null |
    sed -n 's/^PPL = \([0-9.]*\).*/\1/p'
}

echo "model $model, windows of $ctx tokens ($windows windows; 0: all), filled token by token"
echo
echo "| budget | policy | PPL | vs full cache | seconds |"
echo "|---|---|---|---|---|"
start=$(date +%s)
full=$(ppl)
echo "| 100% | full cache | $full | | $(($(date +%s) - start)) |"
for budget in 50% 25% 12.5%; do
  for policy in h2o snapkv streaming; do
    start=$(date +%s)
    got=$(ppl --kv-budget "$budget" --kv-evict "$policy")
    change=$(python3 -c "print(f'{($got - $full) / $full:+.2%}')")
    echo "| $budget | $policy | $got | $change | $(($(date +%s) - start)) |"
  done
done
