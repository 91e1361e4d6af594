#!/usr/bin/env bash
# Installs NVRTC 13.0 (with its builtins library) and the CUDA headers from
# NVIDIA's PyPI wheels into .tools/cuda (ignored by git), so that
# tests/tests/nvrtc_compile.rs can compile kernels/*.cu for sm_90 on machines
# without CUDA. About 92 MB downloaded. Does nothing when already installed.
#
# The pin: cuda-toolkit 13.0.2 is the meta-package whose `nvrtc` and `cudart`
# extras resolve to nvidia-cuda-nvrtc 13.0.88 and nvidia-cuda-runtime 13.0.96;
# their files land in .tools/cuda/nvidia/cu13/{lib,include}.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
target="$root/.tools/cuda"
nvrtc="$target/nvidia/cu13/lib/libnvrtc.so.13"
spec='cuda-toolkit[nvrtc,cudart]==13.0.2'

if [ -f "$nvrtc" ]; then
  exit 0
fi
command -v python3 >/dev/null || { echo "install-nvrtc: python3 is required" >&2; exit 1; }

# Install beside the target and move it into place, so an interrupted run
# never leaves a half-installed folder that a later run would take as done.
staging="$target.partial.$$"
trap 'rm -rf "$staging"' EXIT
echo "install-nvrtc: pip install $spec into $target" >&2
python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
  --target "$staging" "$spec"
if [ ! -f "$staging/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  echo "install-nvrtc: $spec did not provide nvidia/cu13/lib/libnvrtc.so.13" >&2
  exit 1
fi
rm -rf "$target"
mkdir -p "$(dirname "$target")"
mv "$staging" "$target"
echo "install-nvrtc: NVRTC ready in $target/nvidia/cu13/lib" >&2
