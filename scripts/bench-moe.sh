#!/usr/bin/env bash
# MoE on the CPU, side by side in one run: a random MoE of OLMoE-1B-7B's
# shape cut to a few layers, a dense model with the same active parameters
# (`olmoe-1b-7b-dense`), and the MoE with its experts run one row at a time
# (`--ungrouped-experts`). Prints each one's prefill and decode tokens/s and
# the two ratios the MoE issue asks for: decode time per token of the MoE
# over the dense model's (goal: at most 1.3), and grouped over ungrouped
# prefill speed.
#
#   scripts/bench-moe.sh [-t THREADS] [-l LAYERS] [-r REPS] [-p PROMPT] [-n GEN]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.."
threads=2 layers=4 reps=3 prompt=256 gen=64
while getopts "t:l:r:p:n:" opt; do
  case "$opt" in
    t) threads=$OPTARG ;;
    l) layers=$OPTARG ;;
    r) reps=$OPTARG ;;
    p) prompt=$OPTARG ;;
    n) gen=$OPTARG ;;
    *) echo "usage: $0 [-t THREADS] [-l LAYERS] [-r REPS] [-p PROMPT] [-n GEN]" >&2; exit 2 ;;
  esac
done

(cd "$root" && cargo build --release -q -p tandem)
tandem="$root/target/release/tandem"
bench() {
  "$tandem" bench --backend cpu -t "$threads" --layers "$layers" --weight-format q4_0 \
    -p "$prompt" -n "$gen" -r "$reps" --json "$@"
}

moe=$(bench --random-weights olmoe-1b-7b)
dense=$(bench --random-weights olmoe-1b-7b-dense)
ungrouped=$(bench --random-weights olmoe-1b-7b --ungrouped-experts)

python3 - "$moe" "$dense" "$ungrouped" "$threads" "$layers" "$prompt" "$gen" "$reps" <<'PY'
import json, sys
moe, dense, ungrouped = (json.loads(a) for a in sys.argv[1:4])
threads, layers, prompt, gen, reps = sys.argv[4:9]
print(f"{threads} threads, {layers} layers, Q4_0, pp{prompt} / tg{gen}, {reps} repetitions")
print("| model | prefill tokens/s | decode tokens/s |")
print("|---|---|---|")
for name, r in [("MoE, rows grouped by expert", moe),
                ("dense, same active parameters", dense),
                ("MoE, one row per expert call", ungrouped)]:
    print(f"| {name} | {r['prefill_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} |")
print(f"decode time per token, MoE / dense: "
      f"{dense['decode_tokens_per_s'] / moe['decode_tokens_per_s']:.2f}x (goal: at most 1.3x)")
print(f"prefill, grouped / ungrouped: "
      f"{moe['prefill_tokens_per_s'] / ungrouped['prefill_tokens_per_s']:.2f}x")
PY
