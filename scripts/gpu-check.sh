#!/usr/bin/env bash
# The GPU check: the one script to run on a lent NVIDIA machine (an H200),
# from the repository root, in under 8 minutes. There is no Rust there, so
# the binaries are built here and carried:
#
#   here:   scripts/gpu-check.sh --stage      # release build, copies into target/gpu-bin
#   there:  scripts/gpu-check.sh              # carry: ["target/gpu-bin"]
#
# It runs the CUDA kernel conformance and end-to-end test binaries (with
# TANDEM_REQUIRE_CUDA=1, so a missing device fails), then `tandem bench
# --backend cuda` for SmolLM2-135M and for a Llama-3-8B-shaped model with
# random weights in F16 and Q4_1, and prints decode tokens/s at batch 1 with
# the fraction of the H200's 4.8 TB/s that the weight reads reach, and the
# speedup of CUDA-graph decode over launching every kernel. Each
# step's failure is recorded and the others still run; the exit status is
# non-zero when any step failed. Everything is written under $OUT (default
# target/gpu-check): summary.txt and one log per step.
#
#   --dry-run     find the binaries and libraries, print the steps, run nothing
#   --self-test   check the result parsing and arithmetic on canned output
#   --stage       build the release binaries here and copy them to target/gpu-bin
set -euo pipefail

mode=run
case "${1:-}" in
  "") ;;
  --dry-run) mode=dry-run ;;
  --self-test) mode=self-test ;;
  --stage) mode=stage ;;
  *) echo "usage: $0 [--dry-run | --self-test | --stage]" >&2; exit 2 ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
stage_dir="${TANDEM_GPU_BIN:-$root/target/gpu-bin}"
out="${OUT:-$root/target/gpu-check}"
summary="$out/summary.txt"
# The H200's memory bandwidth (vendor datasheet), bytes per second.
peak_bytes_per_s=4.8e12
# All steps end within this many seconds of the start (the lease allows 8 minutes).
deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-450}))
# Test binaries: the kernel suite, then the end-to-end tests (whichever exist).
test_names=(kernels_cuda end_to_end end_to_end_cuda)
failures=()

log() { echo "[gpu-check] $*" | tee -a "$summary"; }

# ---- results: bench JSON to figures ----

# The number after "FIELD": in the last JSON line of FILE that has it.
json_number() {
  sed -n "s/.*\"$2\":\([-0-9.eE+]*\).*/\1/p" "$1" | tail -n 1
}

# Prints the decode figures of one bench run. Weights read per decode token
# are the model's weight bytes less an untied embedding table, of which a
# step reads one row (a tied table is read whole, as the LM head). Where the
# bench compared CUDA-graph replay with launching every kernel, the speedup
# follows.
#   report_bench LABEL LOG EMBEDDING_BYTES
report_bench() {
  local label=$1 file=$2 embedding=$3 tg wb eager
  tg=$(json_number "$file" decode_tokens_per_s)
  wb=$(json_number "$file" weight_bytes)
  eager=$(json_number "$file" decode_eager_tokens_per_s)
  if [ -z "$tg" ] || [ -z "$wb" ]; then
    echo "$label: no decode figures in $(basename "$file")"
    return 1
  fi
  awk -v label="$label" -v tg="$tg" -v wb="$wb" -v emb="$embedding" -v peak="$peak_bytes_per_s" -v eager="${eager:-0}" 'BEGIN {
    bytes = wb - emb
    printf "%s: decode %.1f tokens/s at batch 1, %.3f GB of weights per token, %.1f%% of 4.8 TB/s",
      label, tg, bytes / 1e9, 100 * tg * bytes / peak
    if (eager > 0) printf "; CUDA graphs %.2fx over launching every kernel (%.1f tokens/s)", tg / eager, eager
    printf "\n"
  }'
}

# The fused layers against --unfused on one model: decode tokens/s and
# launches per decoded token of each, and the ratio.
#   report_fusion LABEL FUSED_LOG UNFUSED_LOG
report_fusion() {
  local label=$1 tf tu lf lu
  tf=$(json_number "$2" decode_tokens_per_s)
  tu=$(json_number "$3" decode_tokens_per_s)
  lf=$(json_number "$2" launches_per_token)
  lu=$(json_number "$3" launches_per_token)
  if [ -z "$tf" ] || [ -z "$tu" ]; then
    echo "$label: no fusion figures"
    return 1
  fi
  awk -v label="$label" -v tf="$tf" -v tu="$tu" -v lf="${lf:-0}" -v lu="${lu:-0}" 'BEGIN {
    printf "%s: fused decode %.1f tokens/s (%.1f launches per token), unfused %.1f (%.1f): %.2fx\n",
      label, tf, lf, tu, lu, tf / tu
  }'
}

# Bytes of an untied embedding table: VOCAB HIDDEN FORMAT.
embedding_bytes() {
  awk -v v="$1" -v h="$2" -v f="$3" 'BEGIN {
    bpp = (f == "f16" || f == "bf16") ? 2 : (f == "q4_1") ? 20 / 32 : (f == "q4_0") ? 18 / 32 : (f == "q8_0") ? 34 / 32 : 4
    printf "%.0f\n", v * h * bpp
  }'
}

self_test() {
  local dir expected got status=0
  dir=$(mktemp -d)
  echo 'noise before the JSON' >"$dir/bench.log"
  echo '{"backend":"cuda","decode_tokens_per_s":100.0,"weight_bytes":17000000000,"prefill_tokens_per_s":1e4}' >>"$dir/bench.log"
  expected='8b: decode 100.0 tokens/s at batch 1, 16.000 GB of weights per token, 33.3% of 4.8 TB/s'
  got=$(report_bench 8b "$dir/bench.log" 1000000000)
  if [ "$got" != "$expected" ]; then
    echo "self-test: got '$got', expected '$expected'" >&2
    status=1
  fi
  if [ "$(embedding_bytes 128256 4096 f16)" != 1050673152 ] || [ "$(embedding_bytes 32 32 q4_1)" != 640 ]; then
    echo "self-test: wrong embedding table sizes" >&2
    status=1
  fi
  echo '{"decode_tokens_per_s":2400.0,"weight_bytes":98000000,"decode_eager_tokens_per_s":800.0}' >"$dir/graphs.log"
  expected='s: decode 2400.0 tokens/s at batch 1, 0.098 GB of weights per token, 4.9% of 4.8 TB/s; CUDA graphs 3.00x over launching every kernel (800.0 tokens/s)'
  got=$(report_bench s "$dir/graphs.log" 0)
  if [ "$got" != "$expected" ]; then
    echo "self-test: got '$got', expected '$expected'" >&2
    status=1
  fi
  echo '{"decode_tokens_per_s":1500.0,"launches_per_token":244.0}' >"$dir/fused.log"
  echo '{"decode_tokens_per_s":1000.0,"launches_per_token":425.0}' >"$dir/unfused.log"
  expected='m: fused decode 1500.0 tokens/s (244.0 launches per token), unfused 1000.0 (425.0): 1.50x'
  got=$(report_fusion m "$dir/fused.log" "$dir/unfused.log")
  if [ "$got" != "$expected" ]; then
    echo "self-test: got '$got', expected '$expected'" >&2
    status=1
  fi
  echo '{"backend":"cuda"}' >"$dir/empty.log"
  if report_bench x "$dir/empty.log" 0 >/dev/null; then
    echo "self-test: a log without figures was accepted" >&2
    status=1
  fi
  rm -rf "$dir"
  [ "$status" -eq 0 ] && echo "gpu-check self-test: ok"
  return "$status"
}

# ---- building here ----

stage() {
  cd "$root"
  cargo build --release -p tandem
  cargo test --release -p tandem-tests --no-run
  rm -rf "$stage_dir"
  mkdir -p "$stage_dir"
  cp target/release/tandem "$stage_dir/tandem"
  local name bin
  for name in "${test_names[@]}"; do
    bin=$(newest_binary "$root/target/release/deps" "$name")
    if [ -n "$bin" ]; then cp "$bin" "$stage_dir/$name"; fi
  done
  if command -v strip >/dev/null; then strip "$stage_dir"/* || true; fi
  du -sh "$stage_dir"
  echo "staged in $stage_dir: carry [\"target/gpu-bin\"] and run scripts/gpu-check.sh there"
}

# ---- finding things on the GPU machine ----

# The newest executable DIR/NAME-<hash> that cargo built for test NAME.
newest_binary() {
  find "$1" -maxdepth 1 -type f -name "$2-*" ! -name '*.d' -perm -u+x -printf '%T@ %p\n' 2>/dev/null |
    sort -nr | head -n 1 | cut -d' ' -f2- || true
}

# A staged binary, else the newest one under target/release.
find_binary() {
  if [ -x "$stage_dir/$1" ]; then
    echo "$stage_dir/$1"
  elif [ "$1" = tandem ]; then
    if [ -x "$root/target/release/tandem" ]; then echo "$root/target/release/tandem"; fi
  else
    newest_binary "$root/target/release/deps" "$1"
  fi
}

# Folders holding NVRTC and cuBLAS: the CUDA toolkit, then NVIDIA's Python
# wheels. The backend opens them by name, so they go on LD_LIBRARY_PATH.
cuda_library_dirs() {
  local d
  for d in "${CUDA_HOME:-/nonexistent}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if [ -d "$d" ]; then echo "$d"; fi
  done
  if command -v python3 >/dev/null; then
    python3 -c 'import glob, site
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for d in sorted(glob.glob(base + "/nvidia/*/lib")): print(d)' 2>/dev/null || true
  fi
}

# Where NAME (e.g. libnvrtc.so.13) is found on the library path, or "missing".
locate_library() {
  local d
  for d in ${LD_LIBRARY_PATH//:/ }; do
    if [ -e "$d/$1" ]; then echo "$d/$1"; return; fi
  done
  if ldconfig -p 2>/dev/null | grep -q "$1"; then echo "$1 (system)"; else echo missing; fi
}

# ---- running ----

# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, output to
# $out/NAME.log; a failure is recorded and the script goes on.
step() {
  local name=$1 limit=$2 start rc=0
  shift 2
  if [ "$mode" = dry-run ]; then
    log "would run $name (limit ${limit}s): $*"
    return 0
  fi
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 10 ]; then
    failures+=("$name (not run: time budget spent)")
    log "SKIPPED $name: the time budget is spent"
    return 0
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  log "running $name (limit ${limit}s): $*"
  start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    log "ok $name ($((SECONDS - start)) s)"
  else
    failures+=("$name (exit $rc)")
    log "FAILED $name (exit $rc after $((SECONDS - start)) s); last lines:"
    tail -n 25 "$out/$name.log" | tee -a "$summary"
  fi
}

missing() {
  failures+=("$1")
  log "MISSING $1"
}

main() {
  mkdir -p "$out"
  : >"$summary"
  log "mode $mode, output in $out"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$summary" || true
  else
    log "nvidia-smi not found"
  fi

  local d dirs=""
  while read -r d; do dirs="$dirs:$d"; done < <(cuda_library_dirs)
  export LD_LIBRARY_PATH="${dirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "NVRTC: $(locate_library libnvrtc.so.13); cuBLAS: $(locate_library libcublas.so.13)"
  export TANDEM_REQUIRE_CUDA=1
  # Kernels compile once into this cache; later steps reuse them.
  export TANDEM_CACHE="${TANDEM_CACHE:-$out/cache}"

  local name bin tandem found_e2e=no
  for name in "${test_names[@]}"; do
    bin=$(find_binary "$name")
    if [ -z "$bin" ]; then
      if [ "$name" = kernels_cuda ]; then missing "test binary kernels_cuda"; fi
      continue
    fi
    case "$name" in end_to_end*) found_e2e=yes ;; esac
    step "test-$name" 120 "$bin" --nocapture
  done
  if [ "$found_e2e" = no ]; then missing "an end-to-end test binary (end_to_end*)"; fi

  tandem=$(find_binary tandem)
  if [ -z "$tandem" ]; then
    missing "the tandem binary"
  else
    step inspect-devices 20 "$tandem" inspect --devices
    local bench=(bench --backend cuda --json --prompt-tokens 512 --gen-tokens 128 --repetitions 3)
    local smollm="${TANDEM_CACHE}/SmolLM2-135M-Instruct.Q4_1.gguf"
    # The GGUF (98 MB) is over the carry limit: else the same shapes, random Q4_1 weights.
    local smollm_model=(--random-weights smollm2-135m --weight-format q4_1)
    if [ -f "$smollm" ]; then smollm_model=(--model "$smollm"); fi
    step bench-smollm2-135m 60 "$tandem" "${bench[@]}" "${smollm_model[@]}"
    step bench-smollm2-135m-unfused 60 "$tandem" "${bench[@]}" "${smollm_model[@]}" --unfused
    step bench-llama3-8b-f16 120 "$tandem" "${bench[@]}" --random-weights llama3-8b --weight-format f16
    step bench-llama3-8b-q4_1 120 "$tandem" "${bench[@]}" --random-weights llama3-8b --weight-format q4_1
  fi

  if [ "$mode" = run ]; then
    log "---- decode at batch 1 (targets: SmolLM2 >= 2000 tokens/s, 8B F16 >= 85%, 8B Q4_1 >= 70%) ----"
    local line
    for spec in "smollm2-135m:SmolLM2-135M:0" \
      "llama3-8b-f16:Llama-3-8B F16:$(embedding_bytes 128256 4096 f16)" \
      "llama3-8b-q4_1:Llama-3-8B Q4_1:$(embedding_bytes 128256 4096 q4_1)"; do
      IFS=: read -r name label emb <<<"$spec"
      if [ -f "$out/bench-$name.log" ] && line=$(report_bench "$label" "$out/bench-$name.log" "$emb"); then
        log "$line"
      else
        log "$label: no figures (see bench-$name.log)"
      fi
    done
    if line=$(report_fusion SmolLM2-135M "$out/bench-smollm2-135m.log" "$out/bench-smollm2-135m-unfused.log" 2>/dev/null); then
      log "$line"
    else
      log "SmolLM2-135M: no fusion figures (see bench-smollm2-135m-unfused.log)"
    fi
  fi

  if [ "${#failures[@]}" -gt 0 ]; then
    log "FAILED steps: ${failures[*]}"
    [ "$mode" = dry-run ] || return 1
  else
    log "all steps passed"
  fi
}

case "$mode" in
  self-test) self_test ;;
  stage) stage ;;
  *) main ;;
esac
