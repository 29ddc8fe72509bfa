#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, builds tests/consumer against it with
# find_package(kiln), moves the prefix elsewhere, and runs the consumer from there with a fresh
# kernel cache: an installed Kiln is relocatable and never reads its source or build tree.
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/tests/consumer" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null

lib=$(find "$work/prefix" -name 'libkiln.so.*.*' | head -n 1)
for tree in "$src" "$build"; do
  if grep -qF "$(realpath "$tree")" "$lib"; then
    echo "the installed library names $(realpath "$tree"); it must not depend on the source or build tree"
    exit 1
  fi
done

mv "$work/prefix" "$work/moved"
mkdir -m 700 "$work/cache"
out=$(KILN_CACHE_DIR="$work/cache" LD_LIBRARY_PATH="$work/moved/lib:${LD_LIBRARY_PATH:-}" "$work/build/consumer")
expected=$'8\n12 generated'
if [ "$out" != "$expected" ]; then
  echo "consumer printed '$out', expected '$expected'"
  exit 1
fi
echo "find_package(kiln) consumer built, and ran from a moved prefix with generated kernels"
