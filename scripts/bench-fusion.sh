#!/usr/bin/env bash
# The fused layers against the unfused kernels (`tandem bench --unfused`),
# interleaved in one run on each backend asked for: median prefill and
# decode tokens/s over the rounds, their ratios, and the kernel launches
# per decoded token and per layer that the backend counted (the CPU counts
# none: a fused call there saves parallel regions, not launches).
#
#   scripts/bench-fusion.sh [-b BACKENDS] [-m MODEL] [-t THREADS] [-R ROUNDS] [-p PROMPT] [-n GEN]
#
# BACKENDS is a comma-separated list (default cpu,wgpu; cuda on a GPU).
# Set TANDEM to use an already built binary (the GPU check does).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.."
backends=cpu,wgpu model=default threads=2 rounds=3 prompt=128 gen=64
while getopts "b:m:t:R:p:n:" opt; do
  case "$opt" in
    b) backends=$OPTARG ;;
    m) model=$OPTARG ;;
    t) threads=$OPTARG ;;
    R) rounds=$OPTARG ;;
    p) prompt=$OPTARG ;;
    n) gen=$OPTARG ;;
    *) echo "usage: $0 [-b BACKENDS] [-m MODEL] [-t THREADS] [-R ROUNDS] [-p PROMPT] [-n GEN]" >&2; exit 2 ;;
  esac
done

if [ -z "${TANDEM:-}" ]; then
  (cd "$root" && cargo build --release -q -p tandem)
  TANDEM="$root/target/release/tandem"
fi
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for backend in ${backends//,/ }; do
  for round in $(seq "$rounds"); do
    for mode in fused unfused; do
      flag=()
      [ "$mode" = unfused ] && flag=(--unfused)
      json=$("$TANDEM" bench --backend "$backend" -m "$model" -t "$threads" \
        -p "$prompt" -n "$gen" -r 1 --json "${flag[@]}")
      echo "$backend $mode $json" >>"$results"
    done
  done
done

python3 - "$results" "$model" "$threads" "$prompt" "$gen" "$rounds" <<'PY'
import json, statistics, sys
path, model, threads, prompt, gen, rounds = sys.argv[1:7]
runs = {}
for line in open(path):
    backend, mode, text = line.split(" ", 2)
    runs.setdefault(backend, {}).setdefault(mode, []).append(json.loads(text))
print(f"{model}, pp{prompt} / tg{gen}, {threads} CPU threads, median of {rounds} interleaved rounds")
print("| backend | kernels | prefill tok/s | decode tok/s | launches per token | launches per layer |")
print("|---|---|---|---|---|---|")
def median(rs, key):
    values = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(values) if values else None
def fmt(v, digits=1):
    return "n/a" if v is None else f"{v:.{digits}f}"
for backend, modes in runs.items():
    for mode in ("unfused", "fused"):
        rs = modes[mode]
        print(f"| {backend} | {mode} | {fmt(median(rs, 'prefill_tokens_per_s'))} | "
              f"{fmt(median(rs, 'decode_tokens_per_s'))} | {fmt(median(rs, 'launches_per_token'))} | "
              f"{fmt(median(rs, 'launches_per_layer'))} |")
for backend, modes in runs.items():
    f, u = modes["fused"], modes["unfused"]
    ratio = lambda key: median(f, key) / median(u, key)
    print(f"{backend}: fused / unfused: prefill {ratio('prefill_tokens_per_s'):.2f}x, "
          f"decode {ratio('decode_tokens_per_s'):.2f}x")
PY
