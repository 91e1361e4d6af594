#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine with Rust.
# Each step is skipped when its result is already present.
set -euo pipefail
command -v python3 >/dev/null || { echo "python3 is required" >&2; exit 1; }
