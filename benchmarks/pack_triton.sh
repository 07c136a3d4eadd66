#!/usr/bin/env bash
# Packs Triton 3.7.1 for a GPU machine without network access whose Triton is older: fla-core refuses the
# GDN backward on Hopper with Triton 3.4-3.7.0 (fla issue 640, wrong gradients). Run it on a machine with
# network, then copy .triton/ along with the repository. The 198 MB wheel is cut to what compiles and
# launches CUDA kernels (debug info stripped; no CUPTI, proton profiler or Blackwell ptxas): about 45 MB
# as .triton/triton-3.7.1-stripped.tar.xz. benchmarks/gpu_suite.sh's gdn and labels:gdn steps unpack it
# into a temporary folder and put it first on PYTHONPATH for those steps only.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$work" triton==3.7.1
(cd "$work" && unzip -q triton-3.7.1-*.whl 'triton/*' && cd triton \
  && rm -rf backends/nvidia/lib/cupti backends/nvidia/bin/ptxas-blackwell instrumentation plugins FileCheck \
            _C/libproton.so \
  && strip --strip-unneeded _C/libtriton.so)
mkdir -p .triton && grep -qx '/.triton/' .git/info/exclude 2>/dev/null || echo /.triton/ >>.git/info/exclude
tar -C "$work" -cf - triton | xz -9e -T0 >.triton/triton-3.7.1-stripped.tar.xz
ls -la .triton/
