#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine with Rust.
# Each step is skipped when its result is already present.
set -euo pipefail
command -v python3 >/dev/null || { echo "python3 is required" >&2; exit 1; }
here="$(cd "$(dirname "$0")" && pwd)"

# The browser target: core and the wgpu backend must keep compiling for it.
if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
    rustup target add wasm32-unknown-unknown
fi

# Mesa's software Vulkan driver (lavapipe): the wgpu tests run on it where there is no GPU.
if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq mesa-vulkan-drivers >/dev/null
fi

# OpenMPI for tensor parallelism (`--tp` under mpirun, the `mpi` feature
# `make test` builds): the library and mpirun, and libclang for the bindings
# the `mpi` crate generates against mpi.h.
if ! command -v mpirun >/dev/null || [ ! -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
    || ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq libopenmpi-dev openmpi-bin libclang-dev >/dev/null
fi

# NVRTC and the CUDA headers (PyPI wheels), so every kernels/*.cu is compiled in the tests.
"$here/install-nvrtc.sh"

# cargo-fuzz, for the fuzz smoke of `make test`: libFuzzer needs a nightly
# toolchain, so only where one is installed (elsewhere the smoke says it skipped).
if command -v rustup >/dev/null && rustup toolchain list | grep -q '^nightly' \
    && ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo install --locked cargo-fuzz
fi

# rust-src for the threaded browser build (`make web` rebuilds std with wasm
# atomics, `-Z build-std`), only where a nightly toolchain is installed; where
# it cannot be added, `make web` says the threaded build was skipped.
if command -v rustup >/dev/null && rustup toolchain list | grep -q '^nightly' \
    && ! rustup +nightly component list --installed 2>/dev/null | grep -qx rust-src; then
    rustup component add rust-src --toolchain nightly \
        || echo "install-test-deps: rust-src could not be added to nightly: no threaded browser build" >&2
fi

# In a virtual environment kept out of git (.tools/ is ignored): the official
# OpenAI Python client, for the serving tests (tests/tests/serving_http.rs);
# jsonschema, which validates structured output (tests/tests/structured_http.rs);
# NumPy and gguf, for the independent MoE reference (tests/reference/moe_reference.py).
VENV="$here/../.tools/venv"
if ! "$VENV/bin/python" -c "import openai, jsonschema, numpy, gguf" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "openai>=1.40,<3" \
        "jsonschema>=4.18,<5" "numpy>=1.26,<3" "gguf>=0.17,<1"
fi

# The browser tests (make test-web): Debian's Chromium (WebGPU through
# SwiftShader), Node with the npm packages of tests/web (playwright-core),
# the wasm-bindgen CLI of Cargo.lock's version and wasm-pack, from crates.io.
# Only what is missing: a machine whose Node.js comes from NodeSource has npm
# inside its nodejs package, and Debian's npm conflicts with it.
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi
root="$here/.."
if [ ! -d "$root/tests/web/node_modules/playwright-core" ]; then
    (cd "$root/tests/web" && npm ci --no-audit --no-fund)
fi
wasm_bindgen=$(sed -n '/^name = "wasm-bindgen"$/{n;s/version = "\(.*\)"/\1/p}' "$root/Cargo.lock")
if ! wasm-bindgen --version 2>/dev/null | grep -qx "wasm-bindgen $wasm_bindgen"; then
    cargo install --locked wasm-bindgen-cli --version "$wasm_bindgen" \
        || cargo install wasm-bindgen-cli --version "$wasm_bindgen"
fi
command -v wasm-pack >/dev/null || cargo install --locked wasm-pack || cargo install wasm-pack
