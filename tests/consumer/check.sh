#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, builds tests/consumer against it with
# find_package(kiln), and runs it.
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/tests/consumer" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
out=$(LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" "$work/build/consumer")
if [ "$out" != "8" ]; then
  echo "consumer printed '$out', expected 8"
  exit 1
fi
echo "find_package(kiln) consumer built and ran"
