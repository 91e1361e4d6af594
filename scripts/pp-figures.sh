#!/usr/bin/env bash
# Pipeline parallelism on CPU ranks, for docs/distributed.md: prefill and
# decode tokens/s of each model on 1 rank, on 2 pipeline stages with 1, 2
# (the default) and 4 micro-batches, and (for reference) on 2 tensor-
# parallel ranks, every rank with one thread (`-t 1`) under
# `mpirun --oversubscribe`. Prints one table: tokens/s, the ratio to 1 rank,
# rank 0's communication share of a step (time inside send/recv, all-reduces
# and command broadcasts; on stage 0 that is mostly waiting for stage 1),
# the bytes rank 0 sent per token beside the formula (4 × hidden), and what
# the bubble formula predicts for prefill:
#
#   balanced:    P × M / (M + P − 1)     (bubble (P − 1) / (M + P − 1))
#   this split:  1 / (1/M + (M − 1)/M × f)   (2 stages; f = the larger
#                stage's share of the layers: prefill computes the head for
#                one row only, so stage 0's head weighs nothing there)
#
#   scripts/pp-figures.sh [-m "MODEL ..."] [-p PROMPT] [-n GEN] [-r REPS] [-S SETS] [-q QUIET_S] [-o DIR]
#
# MODELS default to SmolLM2-135M Q4_1 and Qwen2.5-Coder-0.5B Q4_K_M in
# ~/.cache/tandem. With SETS > 1 every configuration runs SETS times
# (interleaved) and the table shows the median (min–max). Before each run
# the script waits until no compiler (rustc, cc1, ld) nor other tandem or
# mpirun has been seen for QUIET_S seconds (at most 10 minutes; 0: do not
# wait), and the table gives the 1-minute load average each run started
# at. Each run's JSON is kept in DIR (default a temporary directory). Set TANDEM to use a built
# binary; otherwise `cargo build -p tandem --features mpi` (dev profile).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.."
models="$HOME/.cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf $HOME/.cache/tandem/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"
prompt=256 gen=32 reps=2 sets=1 quiet=20 out=""
while getopts "m:p:n:r:S:q:o:" opt; do
  case "$opt" in
    m) models=$OPTARG ;;
    p) prompt=$OPTARG ;;
    n) gen=$OPTARG ;;
    r) reps=$OPTARG ;;
    S) sets=$OPTARG ;;
    q) quiet=$OPTARG ;;
    o) out=$OPTARG ;;
    *) echo "usage: $0 [-m \"MODEL ...\"] [-p PROMPT] [-n GEN] [-r REPS] [-S SETS] [-q QUIET_S] [-o DIR]" >&2; exit 2 ;;
  esac
done

if [ -z "${TANDEM:-}" ]; then
  (cd "$root" && cargo build -q -p tandem --features mpi)
  TANDEM="${CARGO_TARGET_DIR:-$root/target}/debug/tandem"
fi
command -v mpirun >/dev/null || { echo "mpirun not found (OpenMPI)" >&2; exit 1; }
[ -n "$out" ] || out="$(mktemp -d -t pp-figures.XXXXXX)"
mkdir -p "$out"

# name|ranks|flags
configs=(
  "1 rank|1|"
  "pp2, 1 micro-batch|2|--pp 2 --micro-batches 1"
  "pp2, 2 micro-batches|2|--pp 2"
  "pp2, 4 micro-batches|2|--pp 2 --micro-batches 4"
  "tp2|2|--tp 2"
)

# Waits until no compiler nor tandem has run for $quiet seconds (10 minutes at most).
wait_quiet() {
  [ "$quiet" -gt 0 ] || return 0
  local calm=0 waited=0
  while [ "$calm" -lt "$quiet" ] && [ "$waited" -lt 600 ]; do
    local busy=0 name
    for name in rustc cc1 cc1plus ld tandem mpirun orted; do
      if pgrep -x "$name" >/dev/null; then busy=1; fi
    done
    if [ "$busy" = 1 ]; then calm=0; else calm=$((calm + 1)); fi
    sleep 1
    waited=$((waited + 1))
  done
}

for set in $(seq 1 "$sets"); do
  for model in $models; do
    name="$(basename "$model" .gguf)"
    layers="$("$TANDEM" inspect "$model" 2>/dev/null | awk '/^layers:/ {print $2; exit}')"
    for config in "${configs[@]}"; do
      IFS='|' read -r label ranks flags <<<"$config"
      wait_quiet
      load="$(cut -d' ' -f1 /proc/loadavg)"
      args=(bench --model "$model" --backend cpu -t 1 -p "$prompt" -n "$gen" -r "$reps" --json)
      # shellcheck disable=SC2206
      args+=($flags)
      if [ "$ranks" = 1 ]; then
        cmd=("$TANDEM" "${args[@]}")
      else
        cmd=(mpirun --allow-run-as-root --oversubscribe -np "$ranks" "$TANDEM" "${args[@]}")
      fi
      echo "set $set: $name, $label (load $load): ${cmd[*]}" >&2
      json="$(TANDEM_OFFLINE=1 "${cmd[@]}" 2>/dev/null | grep '^{' | tail -1)"
      file="$out/$name.$(echo "$label" | tr -c 'a-z0-9' '_').$set.json"
      python3 - "$json" "$name" "$label" "$set" "$load" "$layers" >"$file" <<'EOF'
import json, sys
obj = json.loads(sys.argv[1])
obj["figures"] = dict(zip(["model", "config", "set", "load", "layers"], sys.argv[2:]))
print(json.dumps(obj))
EOF
    done
  done
done

python3 - "$out" "$prompt" "$gen" "$reps" "${configs[@]}" <<'EOF'
import glob, json, os, statistics, sys

out, prompt, gen, reps = sys.argv[1:5]
order = [c.split("|")[0] for c in sys.argv[5:]]
runs = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "*.json")))]
models = []
for r in runs:
    if r["figures"]["model"] not in models:
        models.append(r["figures"]["model"])


def stat(xs, fmt):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    med = statistics.median(xs)
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return fmt.format(med) if lo == hi else f"{fmt.format(med)} ({lo}–{hi})"


print(f"pp{prompt} / tg{gen}, -r {reps}, -t 1 per rank, {len(runs)} runs in {out}\n")
header = [
    "model", "configuration", f"pp{prompt} tokens/s", "× 1 rank", f"tg{gen} tokens/s", "× 1 rank",
    "prefill comm share", "decode comm share", "send B/token (formula)",
    "predicted prefill × (balanced, this split)", "load at start",
]
rows = []
for m in models:
    mine = [r for r in runs if r["figures"]["model"] == m]
    base = {}
    for r in mine:
        if r["figures"]["config"] == "1 rank":
            base[r["figures"]["set"]] = r
    for label in order:
        rs = [r for r in mine if r["figures"]["config"] == label]
        if not rs:
            continue
        ratio = lambda r, k: r[k] / base[r["figures"]["set"]][k] if r["figures"]["set"] in base else None
        par = [r.get("parallel") for r in rs]
        share = lambda phase: [p[phase]["comm_share"] * 100 if p else None for p in par]
        send = "–"
        pred = "–"
        p0 = par[0]
        if p0 and p0["pp"] > 1:
            send = f"{stat([p['prefill']['send_bytes_per_token'] for p in par], '{:.0f}')} ({p0['prefill']['expected_send_bytes_per_token']})"
            P, M = p0["pp"], min(p0["micro_batches"], int(prompt))
            layers = int(rs[0]["figures"]["layers"] or 0)
            if P == 2 and layers:
                f = max(p0["stage_layers"], layers - p0["stage_layers"]) / layers
                split = 1 / (1 / M + (M - 1) / M * f)
                pred = f"{P * M / (M + P - 1):.2f}, {split:.2f} ({p0['stage_layers']}+{layers - p0['stage_layers']} layers)"
        rows.append([
            m, label,
            stat([r["prefill_tokens_per_s"] for r in rs], "{:.1f}"),
            stat([ratio(r, "prefill_tokens_per_s") for r in rs], "{:.2f}"),
            stat([r["decode_tokens_per_s"] for r in rs], "{:.1f}"),
            stat([ratio(r, "decode_tokens_per_s") for r in rs], "{:.2f}"),
            stat(share("prefill"), "{:.0f}%"),
            stat(share("decode"), "{:.0f}%"),
            send, pred,
            stat([float(r["figures"]["load"]) for r in rs], "{:.1f}"),
        ])
widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
print(line(header))
print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
for r in rows:
    print(line(r))
EOF
