#!/usr/bin/env bash
# CPU speed side by side: llama.cpp's `llama-bench` and `tandem bench` on the
# same GGUF files with the same threads, interleaved round by round, then the
# medians and the ratios (Tandem / llama.cpp; above 1 means Tandem is faster),
# and each bench process's peak resident memory. With -b, batched decode
# instead: `llama-batched-bench` against `tandem bench --batch`.
#
# llama.cpp is built outside the repository, under the ignored .tools/, from
# the copy inside PyPI's llama-cpp-python source distribution: its version
# pins the llama.cpp commit, printed with the table.
#
#   scripts/bench-vs-llamacpp.sh [-t THREADS] [-r ROUNDS] [-p PROMPT] [-n GEN] [-k KV]
#                                [-i ISA] [-d DEPTH | -b N,N,...] [MODEL ...]
#
# MODEL is a name of scripts/models.tsv (fetched when missing) or a path;
# default: smollm2-135m qwen2.5-0.5b gemma-3-270m. KV is the KV cache type of
# both engines: Tandem's `--kv-dtype` (f32, f16, int8, int4; default f32)
# and llama.cpp's nearest cache type (f16 for f32, which llama-bench does
# not offer; f16, q8_0, q4_0, with flash attention on, which llama.cpp
# needs for a quantized V cache). DEPTH runs both tests after that many
# tokens of context (llama-bench's -d). -b runs N sequences at once for
# each N, each with a PROMPT-token prompt generating GEN tokens (default
# -p 128 -n 128 there, as llama-batched-bench's example). ISA is `best`
# (default: llama.cpp built for this CPU, `tandem --cpu-isa best`) or
# `avx2`: both engines held to AVX2 + FMA + F16C (a second llama.cpp build
# without AVX-512, `tandem --cpu-isa avx2`), the path of CPUs without
# AVX-512, measured on one that has it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.."
threads=2 rounds=3 prompt= gen= kv=f32 depth=0 batches= isa=best
usage="usage: $0 [-t THREADS] [-r ROUNDS] [-p PROMPT] [-n GEN] [-k KV] [-i ISA] [-d DEPTH | -b N,N,...] [MODEL ...]"
while getopts "t:r:p:n:k:i:d:b:" opt; do
  case "$opt" in
    t) threads=$OPTARG ;;
    r) rounds=$OPTARG ;;
    p) prompt=$OPTARG ;;
    n) gen=$OPTARG ;;
    k) kv=$OPTARG ;;
    i) isa=$OPTARG ;;
    d) depth=$OPTARG ;;
    b) batches=$OPTARG ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [ -n "$batches" ] && [ "$depth" != 0 ]; then
  echo "-d and -b do not go together (llama-batched-bench has no depth)" >&2
  exit 2
fi
if [ -n "$batches" ]; then
  prompt=${prompt:-128} gen=${gen:-128}
else
  prompt=${prompt:-512} gen=${gen:-128}
fi
case "$kv" in
  f32 | f16) llama_kv=(-ctk f16 -ctv f16) ;;
  int8) llama_kv=(-ctk q8_0 -ctv q8_0 -fa 1) ;;
  int4) llama_kv=(-ctk q4_0 -ctv q4_0 -fa 1) ;;
  *) echo "-k: unknown KV type '$kv' (f32, f16, int8 or int4)" >&2; exit 2 ;;
esac
case "$isa" in
  best) llama_build=build llama_isa=(-DGGML_NATIVE=ON) ;;
  avx2) llama_build=build-avx2 llama_isa=(-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON) ;;
  *) echo "-i: unknown instruction set '$isa' (best or avx2)" >&2; exit 2 ;;
esac
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m qwen2.5-0.5b gemma-3-270m)

LLAMA_CPP_PYTHON=0.3.36
sdist="$root/.tools/llama_cpp_python-$LLAMA_CPP_PYTHON"
src="$sdist/vendor/llama.cpp"
llama_bench="$src/$llama_build/bin/llama-bench"
llama_batched_bench="$src/$llama_build/bin/llama-batched-bench"
if [ ! -d "$src" ]; then
  tmp=$(mktemp -d)
  echo "fetching llama-cpp-python $LLAMA_CPP_PYTHON's sources into $sdist" >&2
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python --dest "$tmp" "llama-cpp-python==$LLAMA_CPP_PYTHON"
  mkdir -p "$root/.tools"
  rm -rf "$sdist"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$root/.tools"
  rm -rf "$tmp"
fi
if [ ! -x "$llama_bench" ] || [ ! -x "$llama_batched_bench" ]; then
  command -v cmake >/dev/null || {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq cmake >/dev/null
  }
  echo "building llama-bench and llama-batched-bench in $src/$llama_build (compiler output in build.log there)" >&2
  mkdir -p "$src/$llama_build"
  cmake -S "$src" -B "$src/$llama_build" -DCMAKE_BUILD_TYPE=Release "${llama_isa[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF >"$src/$llama_build/build.log" 2>&1
  cmake --build "$src/$llama_build" --target llama-bench llama-batched-bench -j "$(nproc)" >>"$src/$llama_build/build.log" 2>&1 || {
    echo "building llama.cpp failed; see $src/$llama_build/build.log" >&2
    exit 1
  }
fi
# The source distribution carries llama.cpp's git metadata.
commit=$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)

(cd "$root" && cargo build --release -q -p tandem)
tandem="${CARGO_TARGET_DIR:-$root/target}/release/tandem"

paths=()
for m in "${models[@]}"; do
  if [ -f "$m" ]; then paths+=("$m"); else paths+=("$("$here/fetch-model.sh" "$m")"); fi
done

results=$(mktemp) rss=$(mktemp) runs=$(mktemp)
trap 'rm -f "$results" "$rss" "$runs"' EXIT
# The peak resident memory of the run just timed (GNU time's %M, in KiB),
# a result line of its own.
rss_line() {
  python3 -c 'import json,sys; print(json.dumps({"engine":sys.argv[1],"model":sys.argv[2],"test":"rss","tps":int(open(sys.argv[3]).read().split()[-1]) / 1024}))' "$1" "$2" "$rss" >>"$results"
}
# One engine's run on one model, timed by GNU time for its peak memory, as result lines: {engine, model, test, tps},
# the test being pp or tg (with -b: pp@N and tg@N for N sequences).
llama_run() {
  # AMX repacking faults on VMs that report AMX without granting its tiles.
  if [ -n "$batches" ]; then
    # Each sequence gets an equal share of the context.
    local most=$(tr , '\n' <<<"$batches" | sort -n | tail -1)
    /usr/bin/time -f %M -o "$rss" "$llama_batched_bench" -m "$1" -t "$threads" -c $(((prompt + gen) * most)) -npp "$prompt" -ntg "$gen" -npl "$batches" \
      -nr "${llama_kv[@]}" --output-format jsonl 2>/dev/null |
      python3 -c 'import json,sys; [print(json.dumps({"engine":"llama.cpp","model":sys.argv[1],"test":f"{t}@{r['"'"'pl'"'"']}","tps":r[k]})) for l in sys.stdin if l.startswith("{") for r in [json.loads(l)] for t, k in (("pp","speed_pp"),("tg","speed_tg"))]' "$1"
  else
    /usr/bin/time -f %M -o "$rss" "$llama_bench" -m "$1" -t "$threads" -p "$prompt" -n "$gen" -d "$depth" -r 1 --repack 0 "${llama_kv[@]}" -o json 2>/dev/null |
      python3 -c 'import json,sys; [print(json.dumps({"engine":"llama.cpp","model":sys.argv[1],"test":"pp" if r["n_prompt"] else "tg","tps":r["avg_ts"]})) for r in json.load(sys.stdin)]' "$1"
  fi
}
tandem_run() {
  if [ -n "$batches" ]; then
    /usr/bin/time -f %M -o "$rss" "$tandem" bench --backend cpu --cpu-isa "$isa" -t "$threads" -p "$prompt" -n "$gen" -r 1 --kv-dtype "$kv" --batch "$batches" --json --model "$1" 2>/dev/null |
      python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); [print(json.dumps({"engine":"tandem","model":sys.argv[1],"test":f"{t}@{b['"'"'sequences'"'"']}","tps":b[k]})) for b in r["batches"] for t, k in (("pp","prompt_tokens_per_s"),("tg","decode_tokens_per_s"))]' "$1"
  else
    /usr/bin/time -f %M -o "$rss" "$tandem" bench --backend cpu --cpu-isa "$isa" -t "$threads" -p "$prompt" -n "$gen" -d "$depth" -r 1 --kv-dtype "$kv" --json --model "$1" 2>/dev/null |
      python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); m=sys.argv[1]; print(json.dumps({"engine":"tandem","model":m,"test":"pp","tps":r["prefill_tokens_per_s"]})); print(json.dumps({"engine":"tandem","model":m,"test":"tg","tps":r["decode_tokens_per_s"]}))' "$1"
  fi
}
for round in $(seq 1 "$rounds"); do
  for path in "${paths[@]}"; do
    echo "round $round/$rounds: $(basename "$path")" >&2
    llama_run "$path" >"$runs"
    [ -s "$runs" ] || { echo "llama.cpp gave no result on $path" >&2; exit 1; }
    cat "$runs" >>"$results"
    rss_line llama.cpp "$path"
    tandem_run "$path" >"$runs"
    [ -s "$runs" ] || { echo "tandem bench gave no result on $path" >&2; exit 1; }
    cat "$runs" >>"$results"
    rss_line tandem "$path"
  done
done

# Ratios differ between machines of one kind: the table names its CPU.
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)
python3 - "$results" "$threads" "$prompt" "$gen" "$rounds" "$commit" "$LLAMA_CPP_PYTHON" "$kv" "${llama_kv[*]}" "$depth" "$batches" "$isa" "${cpu:-unknown CPU}" <<'PY'
import collections, json, os, statistics, sys
path, threads, prompt, gen, rounds, commit, version, kv, llama_kv, depth, batches, isa, cpu = sys.argv[1:]
runs = collections.defaultdict(list)
for line in open(path):
    r = json.loads(line)
    runs[(os.path.basename(r["model"]), r["engine"], r["test"])].append(r["tps"])
models = sorted({m for m, _, _ in runs}, key=lambda m: [k[0] for k in runs].index(m))
shape = (f"{prompt}-token prompts, {gen} tokens generated per sequence" if batches
         else f"pp{prompt} / tg{gen}" + (f" at depth {depth}" if depth != "0" else ""))
print(f"{cpu}, {threads} threads, {shape}, median of {rounds} interleaved rounds; "
      f"llama.cpp {commit} (llama-cpp-python {version}), CPU backend; "
      + ("instruction sets: AVX2 + FMA + F16C in both; " if isa == "avx2" else "")
      + f"KV cache: Tandem {kv}, llama.cpp {llama_kv}")
med = lambda m, e, t: statistics.median(runs[(m, e, t)]) if runs[(m, e, t)] else float("nan")
if batches:
    print("| model | sequences | Tandem decode | llama.cpp decode | ratio | Tandem prompt | llama.cpp prompt | ratio | Tandem peak RSS | llama.cpp peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [(m, n) for m in models for n in batches.split(",")]
else:
    print("| model | Tandem decode | llama.cpp decode | ratio | Tandem prefill | llama.cpp prefill | ratio | Tandem peak RSS | llama.cpp peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [(m, None) for m in models]
for m, n in rows:
    at = f"@{n}" if n else ""
    td, ld = med(m, "tandem", "tg" + at), med(m, "llama.cpp", "tg" + at)
    tp, lp = med(m, "tandem", "pp" + at), med(m, "llama.cpp", "pp" + at)
    tr, lr = med(m, "tandem", "rss"), med(m, "llama.cpp", "rss")
    first = f"| {m} | {n} |" if n else f"| {m} |"
    print(f"{first} {td:.1f} | {ld:.1f} | {td / ld:.2f}x | {tp:.1f} | {lp:.1f} | {tp / lp:.2f}x | {tr:.0f} MiB | {lr:.0f} MiB |")
PY
