#!/usr/bin/env bash
# Tandem's CPU backend in wasm beside wllama (llama.cpp compiled to wasm, npm
# @wllama/wllama, installed into the ignored .tools/wllama) on the same GGUF
# file, side by side in one headless Chromium run (tests/web/bench.mjs): load
# time, first-token latency, prefill and decode tokens/s; both on one
# thread, and on all cores on a cross-origin isolated page (Tandem's threaded
# package, which `make web` builds where a nightly toolchain is); Tandem's
# WebGPU on SwiftShader for what it is (BENCH_WEBGPU=0 leaves it out).
#
#   scripts/bench-web.sh [MODEL_URL] [TOKENS]
#
# MODEL_URL is relative to the demo site (default: SmolLM2-135M Q4_1).
# WEB_SITE and WEB_PKG (as `make web` takes them) build the site elsewhere.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
wllama_version=3.8.1
wllama="$root/.tools/wllama"

site="${WEB_SITE:-target/web-site}"

cd "$root"
make web WEB_SITE="$site" ${WEB_PKG:+WEB_PKG="$WEB_PKG"}
test -d tests/web/node_modules/playwright-core || (cd tests/web && npm ci --no-audit --no-fund)
installed=$(node -p "require('$wllama/node_modules/@wllama/wllama/package.json').version" 2>/dev/null || true)
if [ "$installed" != "$wllama_version" ]; then
  mkdir -p "$wllama"
  npm install --no-audit --no-fund --prefix "$wllama" "@wllama/wllama@$wllama_version"
fi
node tests/web/bench.mjs "$site" "$wllama/node_modules/@wllama/wllama/esm" "$@"
