#!/usr/bin/env bash
# DenseNet-121 on this machine's CPU, the native build (build/, -march=native) beside a build for
# any x86-64 with AVX2 (build-avx2/, -DKILN_CPU_ARCH=x86-64-v3, run with oneDNN and OpenBLAS held
# to AVX2): what a machine without AVX-512 runs. Eager, default compile() and max_autotune, for
# inference and the Adam step, each build from an empty kernel cache. Prints both JSON objects'
# file names; docs/benchmarks.md records a run.
#   bench/cpu_avx2_vs_native.sh [extra `kiln bench` options, e.g. --iters 7]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x build/bin/kiln ] || scripts/build
if [ ! -f build-avx2/build.ninja ]; then
  cmake -S . -B build-avx2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=OFF -DKILN_CPU_ARCH=x86-64-v3 \
    -DKILN_BUILD_TESTS=OFF -DKILN_BUILD_BENCHMARKS=OFF > /dev/null
fi
cmake --build build-avx2 --target kiln_cli > /dev/null
args=(densenet121 --device cpu --batch 16 --size 128 --train --modes eager,kiln,kiln-at --iters 5 --warmup 2 --json "$@")
out="${OUT:-/tmp}"
native_cache=$(mktemp -d) avx2_cache=$(mktemp -d)
trap 'rm -rf "$native_cache" "$avx2_cache"' EXIT
KILN_CACHE_DIR="$native_cache" build/bin/kiln bench "${args[@]}" > "$out/bench-native.json"
KILN_CACHE_DIR="$avx2_cache" ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell \
  build-avx2/bin/kiln bench "${args[@]}" > "$out/bench-avx2.json"
echo "$out/bench-native.json $out/bench-avx2.json"
