#!/usr/bin/env bash
# Packs Triton 3.7.1 for the H200 machine, which has Triton 3.6 and no network: fla-core refuses the GDN
# backward on Hopper with Triton 3.4-3.7.0 (fla #640, wrong gradients). The wheel is 198 MB and a device
# call carries 64 MiB, so this keeps what compiles and launches CUDA kernels (debug info stripped; no
# CUPTI, proton profiler or Blackwell ptxas): about 45 MB as .triton/*.tar.xz.
# gpu_suite.sh's gdn step unpacks it into /tmp/triton-site, for the gdn step alone.
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
