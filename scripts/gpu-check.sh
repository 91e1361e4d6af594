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
# speedup of CUDA-graph decode over launching every kernel. Decode at
# batch 1 has targets (SmolLM2 >= 2000 tokens/s, 8B F16 >= 85% and 8B Q4_1
# >= 70% of 4.8 TB/s): a missed or unmeasured target is a failure like a
# failed step. Each step's failure is recorded and the others still run;
# the run ends with one summary table (step or target, result, seconds or
# figure, then the verdict) and its exit status is non-zero when any step
# failed or any target was missed. Everything is written under $OUT
# (default target/gpu-check): summary.txt and one log per step. The whole
# run stays within GPU_CHECK_BUDGET_S (default 450, at most 570) seconds.
#
#   --dry-run     find the binaries and libraries, print the steps, run nothing
#   --self-test   check the result parsing, arithmetic, targets and table on canned output
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
# All steps end within this many seconds of the start (the lease allows 8
# minutes; never more than 570 s, so a run with its summary stays under 10).
budget=${GPU_CHECK_BUDGET_S:-450}
if [ "$budget" -gt 570 ]; then budget=570; fi
deadline=$((SECONDS + budget))
# Test binaries: the kernel suite, then the end-to-end tests (whichever exist).
test_names=(kernels_cuda end_to_end end_to_end_cuda)
# Decode at batch 1 must reach these, one per bench step:
#   STEP|LABEL|UNTIED EMBEDDING (VOCAB HIDDEN FORMAT, or -)|MEASURE|MINIMUM
# MEASURE is tokens (decode tokens/s) or bandwidth (% of 4.8 TB/s).
targets=(
  "bench-smollm2-135m|SmolLM2-135M|-|tokens|2000"
  "bench-llama3-8b-f16|Llama-3-8B F16|128256 4096 f16|bandwidth|85"
  "bench-llama3-8b-q4_1|Llama-3-8B Q4_1|128256 4096 q4_1|bandwidth|70"
)
failures=()
# The summary table's rows: NAME|RESULT|SECONDS OR FIGURE.
rows=()

log() { echo "[gpu-check] $*" | tee -a "$summary"; }

record() { rows+=("$1|$2|$3"); }

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

# Judges one target on a bench log: prints the figure against the target
# and returns 0 when met, 1 when missed, 2 when the log has no figures. The
# figure is judged as printed (one decimal), bandwidth as report_bench
# computes it.
#   check_target LOG EMBEDDING_BYTES tokens|bandwidth MINIMUM
check_target() {
  local file=$1 embedding=$2 measure=$3 min=$4 tg wb
  tg=$(json_number "$file" decode_tokens_per_s 2>/dev/null || true)
  wb=$(json_number "$file" weight_bytes 2>/dev/null || true)
  if [ -z "$tg" ] || { [ "$measure" != tokens ] && [ -z "$wb" ]; }; then
    echo "no decode figures"
    return 2
  fi
  awk -v tg="$tg" -v wb="${wb:-0}" -v emb="$embedding" -v peak="$peak_bytes_per_s" -v m="$measure" -v min="$min" 'BEGIN {
    if (m == "tokens") {
      shown = sprintf("%.1f", tg)
      printf "%s tokens/s (target >= %s)\n", shown, min
    } else {
      shown = sprintf("%.1f", 100 * tg * (wb - emb) / peak)
      printf "%s%% of 4.8 TB/s (target >= %s%%)\n", shown, min
    }
    exit !(shown + 0 >= min + 0)
  }'
}

# Judges every target on its bench log in $out; a missed or unmeasured
# target is a failure.
check_targets() {
  local spec step label emb_spec measure min vocab hidden format emb figure rc
  for spec in "${targets[@]}"; do
    IFS='|' read -r step label emb_spec measure min <<<"$spec"
    if [ "$mode" = dry-run ]; then
      record "target $label" planned "$measure >= $min from $step"
      continue
    fi
    emb=0
    if [ "$emb_spec" != - ]; then
      read -r vocab hidden format <<<"$emb_spec"
      emb=$(embedding_bytes "$vocab" "$hidden" "$format")
    fi
    rc=0
    figure=$(check_target "$out/$step.log" "$emb" "$measure" "$min") || rc=$?
    case "$rc" in
      0) record "target $label" met "$figure" ;;
      1)
        record "target $label" MISSED "$figure"
        failures+=("target $label: $figure")
        ;;
      *)
        record "target $label" "NO FIGURES" "see $step.log"
        failures+=("target $label: not measured")
        ;;
    esac
  done
}

# The verdict, then the summary table, the run's last lines; returns
# non-zero when anything failed (not in a dry run).
finish() {
  local status=0 row name result detail format='%-40s %-11s %s'
  if [ "${#failures[@]}" -gt 0 ]; then
    log "$([ "$mode" = dry-run ] && echo MISSING || echo FAILED): $(printf '%s; ' "${failures[@]}" | sed 's/; $//')"
    if [ "$mode" = dry-run ]; then
      record verdict "DRY RUN" "${#failures[@]} missing"
    else
      record verdict FAIL "${#failures[@]} failed"
      status=1
    fi
  else
    log "all steps passed and all targets met"
    record verdict "$([ "$mode" = dry-run ] && echo "DRY RUN" || echo PASS)" "0 failed"
  fi
  log "---- summary ----"
  log "$(printf "$format" step result 'seconds / figure')"
  for row in "${rows[@]}"; do
    IFS='|' read -r name result detail <<<"$row"
    log "$(printf "$format" "$name" "$result" "$detail")"
  done
  return "$status"
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

  # Targets: met, missed, met exactly, no figures.
  local rc
  check_case() {
    local want_rc=$1 want=$2 rc=0 got
    shift 2
    got=$(check_target "$@") || rc=$?
    if [ "$rc" != "$want_rc" ] || [ "$got" != "$want" ]; then
      echo "self-test: check_target $*: got '$got' (status $rc), expected '$want' (status $want_rc)" >&2
      status=1
    fi
  }
  check_case 0 '2400.0 tokens/s (target >= 2000)' "$dir/graphs.log" 0 tokens 2000
  check_case 1 '1500.0 tokens/s (target >= 2000)' "$dir/fused.log" 0 tokens 2000
  # 100 tokens/s of 16 GB: 33.3% of 4.8 TB/s.
  check_case 1 '33.3% of 4.8 TB/s (target >= 70%)' "$dir/bench.log" 1000000000 bandwidth 70
  echo '{"decode_tokens_per_s":255.0,"weight_bytes":17000000000}' >"$dir/exact.log"
  check_case 0 '85.0% of 4.8 TB/s (target >= 85%)' "$dir/exact.log" 1000000000 bandwidth 85
  check_case 2 'no decode figures' "$dir/empty.log" 0 tokens 2000
  check_case 2 'no decode figures' "$dir/absent.log" 0 tokens 2000

  # A run with one target missed and one step failed: the table, then the
  # exit status.
  local table
  rc=0
  table=$(
    out=$dir mode=run summary=$dir/summary.txt rows=() failures=()
    targets=("smol|SmolLM2-135M|-|tokens|2000" "big|Big F16|32 32 f16|bandwidth|1")
    cp "$dir/fused.log" "$dir/smol.log"
    cp "$dir/bench.log" "$dir/big.log"
    record test-kernels_cuda ok "41 s"
    failures+=("bench-x (exit 1)")
    record bench-x FAILED "exit 1 after 3 s"
    check_targets
    finish >/dev/null
  ) || rc=$?
  table=$(sed -n '/---- summary ----/,$p' "$dir/summary.txt" | sed 's/^\[gpu-check\] //')
  expected="---- summary ----
step                                     result      seconds / figure
test-kernels_cuda                        ok          41 s
bench-x                                  FAILED      exit 1 after 3 s
target SmolLM2-135M                      MISSED      1500.0 tokens/s (target >= 2000)
target Big F16                           met         35.4% of 4.8 TB/s (target >= 1%)
verdict                                  FAIL        2 failed"
  if [ "$rc" -ne 1 ] || [ "$table" != "$expected" ]; then
    echo "self-test: the summary (status $rc, expected 1):" >&2
    echo "$table" >&2
    echo "expected:" >&2
    echo "$expected" >&2
    status=1
  fi
  if ! grep -qxF '[gpu-check] FAILED: bench-x (exit 1); target SmolLM2-135M: 1500.0 tokens/s (target >= 2000)' "$dir/summary.txt"; then
    echo "self-test: the failures are not listed before the table" >&2
    status=1
  fi
  # All met: status 0 and a PASS verdict last.
  rc=0
  (
    out=$dir mode=run summary=$dir/pass.txt rows=() failures=()
    targets=("smol|SmolLM2-135M|-|tokens|2000")
    cp "$dir/graphs.log" "$dir/smol.log"
    check_targets
    finish >/dev/null
  ) || rc=$?
  if [ "$rc" -ne 0 ] || [ "$(tail -n 1 "$dir/pass.txt")" != "[gpu-check] verdict                                  PASS        0 failed" ]; then
    echo "self-test: a run with every target met did not pass (status $rc)" >&2
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
    record "$name" planned "limit ${limit} s"
    return 0
  fi
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 10 ]; then
    failures+=("$name (not run: time budget spent)")
    log "SKIPPED $name: the time budget is spent"
    record "$name" SKIPPED "time budget spent"
    return 0
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  log "running $name (limit ${limit}s): $*"
  start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    log "ok $name ($((SECONDS - start)) s)"
    record "$name" ok "$((SECONDS - start)) s"
  else
    failures+=("$name (exit $rc)")
    log "FAILED $name (exit $rc after $((SECONDS - start)) s); last lines:"
    tail -n 25 "$out/$name.log" | tee -a "$summary"
    record "$name" FAILED "exit $rc after $((SECONDS - start)) s"
  fi
}

missing() {
  failures+=("$1")
  log "MISSING $1"
  record "$1" MISSING "-"
}

# SmolLM2's greedy token ids on one GPU and split over two (NCCL) agree.
#   tp2_greedy TANDEM MODEL
tp2_greedy() {
  local run=(run --backend cuda --model "$2" -n 24 --token-ids "The capital of France is") one two
  one=$("$1" "${run[@]}" 2>&1 | grep '^token ids:')
  two=$(mpirun --allow-run-as-root -np 2 "$1" "${run[@]}" --tp 2 2>&1 | grep '^token ids:')
  echo "one GPU:  $one"
  echo "two GPUs: $two"
  [ -n "$one" ] && [ "$one" = "$two" ]
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

  # The GGUF (98 MB) is over the carry limit; without it the SmolLM2 tests
  # that need its tokenizer are skipped and its bench uses random weights.
  local smollm="${TANDEM_CACHE}/SmolLM2-135M-Instruct.Q4_1.gguf"
  # The gpu_check_script tests check this script with stand-ins, not the GPU.
  local skips=(--skip gpu_check_script)
  if [ ! -f "$smollm" ]; then
    skips+=(--skip smollm2_greedy)
    log "SmolLM2 GGUF not in $TANDEM_CACHE: its greedy-tokens test is not run"
  fi

  local name bin tandem found_e2e=no
  for name in "${test_names[@]}"; do
    bin=$(find_binary "$name")
    if [ -z "$bin" ]; then
      if [ "$name" = kernels_cuda ]; then missing "test binary kernels_cuda"; fi
      continue
    fi
    case "$name" in end_to_end*) found_e2e=yes ;; esac
    step "test-$name" 120 "$bin" --nocapture "${skips[@]}"
  done
  if [ "$found_e2e" = no ]; then missing "an end-to-end test binary (end_to_end*)"; fi

  tandem=$(find_binary tandem)
  if [ -z "$tandem" ]; then
    missing "the tandem binary"
  else
    step inspect-devices 20 "$tandem" inspect --devices
    local bench=(bench --backend cuda --json --prompt-tokens 512 --gen-tokens 128 --repetitions 3)
    local smollm_model=(--random-weights smollm2-135m --weight-format q4_1)
    if [ -f "$smollm" ]; then smollm_model=(--model "$smollm"); fi
    step bench-smollm2-135m 60 "$tandem" "${bench[@]}" "${smollm_model[@]}"
    step bench-smollm2-135m-unfused 60 "$tandem" "${bench[@]}" "${smollm_model[@]}" --unfused
    step bench-llama3-8b-f16 120 "$tandem" "${bench[@]}" --random-weights llama3-8b --weight-format f16
    step bench-llama3-8b-q4_1 120 "$tandem" "${bench[@]}" --random-weights llama3-8b --weight-format q4_1
    # Tensor parallelism over two GPUs through NCCL (NCCL refuses two ranks
    # on one GPU): SmolLM2's greedy tokens split over two ranks, against one.
    # The one-rank NCCL all-reduce runs in the end-to-end tests above.
    local gpus
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${gpus:-0}" -ge 2 ] && [ -f "$smollm" ] && command -v mpirun >/dev/null; then
      # `timeout` runs programs, not functions: through bash.
      export -f tp2_greedy
      step tp2-greedy 120 bash -c 'tp2_greedy "$@"' tp2 "$tandem" "$smollm"
    else
      log "TP=2 over NCCL not run: it needs 2 GPUs (found ${gpus:-0}), mpirun and the SmolLM2 GGUF"
    fi
  fi

  if [ "$mode" = run ]; then
    log "---- decode at batch 1 (targets: SmolLM2 >= 2000 tokens/s, 8B F16 >= 85%, 8B Q4_1 >= 70%) ----"
    local line spec label emb emb_spec measure min vocab hidden format
    for spec in "${targets[@]}"; do
      IFS='|' read -r name label emb_spec measure min <<<"$spec"
      emb=0
      if [ "$emb_spec" != - ]; then
        read -r vocab hidden format <<<"$emb_spec"
        emb=$(embedding_bytes "$vocab" "$hidden" "$format")
      fi
      if [ -f "$out/$name.log" ] && line=$(report_bench "$label" "$out/$name.log" "$emb"); then
        log "$line"
      else
        log "$label: no figures (see $name.log)"
      fi
    done
    if line=$(report_fusion SmolLM2-135M "$out/bench-smollm2-135m.log" "$out/bench-smollm2-135m-unfused.log" 2>/dev/null); then
      log "$line"
    else
      log "SmolLM2-135M: no fusion figures (see bench-smollm2-135m-unfused.log)"
    fi
  fi

  check_targets
  finish
}

case "$mode" in
  self-test) self_test ;;
  stage) stage ;;
  *) main ;;
esac
