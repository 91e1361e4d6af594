#!/usr/bin/env bash
# Where the GPU time of a `tandem bench --backend cuda` run goes: Nsight
# Compute times every kernel (one metric, gpu__time_duration, clocks left
# alone) and the table sums them per kernel, largest first, with launches
# and mean microseconds. For a lent NVIDIA machine with `ncu` on the PATH;
# the binary is the one scripts/gpu-check.sh --stage carries.
#
#   scripts/gpu-profile.sh LABEL BENCH-ARGS...
#   e.g. scripts/gpu-profile.sh smollm2 --random-weights smollm2-135m -p 16 -n 32 -r 1
#
# Writes $OUT/profile-LABEL.csv (ncu's raw CSV) and prints the table. At most
# GPU_PROFILE_KERNELS (default 6000) launches are timed.
set -euo pipefail

if [ "$#" -lt 2 ]; then
  echo "usage: $0 LABEL BENCH-ARGS..." >&2
  exit 2
fi
label=$1
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out="${OUT:-$root/target/gpu-check}"
tandem="${TANDEM_GPU_BIN:-$root/target/gpu-bin}/tandem"
csv="$out/profile-$label.csv"
mkdir -p "$out"

ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  --launch-count "${GPU_PROFILE_KERNELS:-6000}" --log-file "$csv" \
  "$tandem" bench --backend cuda --json "$@" >"$out/profile-$label.log" 2>&1

# ncu's log has its own lines before the CSV header ("ID", ...).
python3 - "$csv" "$label" <<'EOF'
import csv, sys
from collections import defaultdict
with open(sys.argv[1]) as f:
    lines = f.read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is None:
    sys.exit(f"{sys.argv[1]}: no CSV from ncu")
total, count = defaultdict(float), defaultdict(int)
for r in csv.DictReader(lines[start:]):
    try:
        ns = float(r["Metric Value"].replace(",", ""))
    except (KeyError, ValueError):
        continue
    name = r["Kernel Name"].split("(")[0]
    total[name] += ns
    count[name] += 1
whole = sum(total.values()) or 1.0
print(f"{sys.argv[2]}: {sum(count.values())} launches, {whole / 1e6:.2f} ms of kernels")
print(f"{'kernel':<48} {'launches':>8} {'ms':>9} {'share':>6} {'mean us':>8}")
for name in sorted(total, key=total.get, reverse=True)[:25]:
    t, n = total[name], count[name]
    print(f"{name:<48} {n:>8} {t / 1e6:>9.3f} {100 * t / whole:>5.1f}% {t / n / 1e3:>8.1f}")
EOF
