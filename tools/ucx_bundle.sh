#!/usr/bin/env bash
# Packs ucxx and its libraries for a lent GPU machine (no network there), for
# tools/gpu_check.sh: one .whl/ucx-<cu>-py<ver>.tar.xz per CUDA major, each the installed
# tree (pip --target) of ucxx-<cu> and its dependencies without numpy (the machine has it),
# static libraries, perftest, headers and Cython sources, with the duplicate copies of each
# shared library turned back into the symlinks they are. ~13 MB each instead of ~67 MB of
# wheels, which would not fit what a device call can carry (64 MiB) next to .whl/.
#   tools/ucx_bundle.sh [python version, default 3.12] [cuda majors, default "12 13"]
set -euo pipefail
PYV=${1:-3.12}
CUDAS=${2:-12 13}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PIP="$ROOT/.venv/bin/pip"
mkdir -p "$ROOT/.whl"
for cu in $CUDAS; do
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  plat=(--only-binary=:all: --python-version "$PYV" --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
  echo "ucxx-cu$cu for Python $PYV: downloading"
  "$PIP" download -q "${plat[@]}" -d "$work/wheels" "ucxx-cu$cu==0.52.*"
  rm -f "$work"/wheels/numpy-*.whl
  "$PIP" install -q --no-deps --no-compile "${plat[@]}" --target "$work/site" \
    "$work"/wheels/*.whl
  cd "$work/site"
  find . \( -name '*.a' -o -name '*.la' -o -name '*.pyx' -o -name '*.pxd' -o -name '*.pyx.in' \
    -o -name '*.pxd.in' -o -name '*.cpp' \) -delete
  find . -name '*perftest*' -prune -exec rm -rf {} +
  find . -type d \( -name include -o -name bin \) -prune -exec rm -rf {} +
  find . -maxdepth 1 -name '*.py' -delete  # stray top-level modules (an example.py)
  # wheels store libX.so, libX.so.0 and libX.so.0.0.0 as three copies
  find . -name '*.so.*.*.*' | while read -r f; do
    d=$(dirname "$f"); full=$(basename "$f"); base=${full%%.so.*}.so
    for link in "$d/$base" "$d/${full%.*.*}"; do
      if [ -f "$link" ] && [ ! -L "$link" ] && cmp -s "$f" "$link"; then
        ln -sf "$full" "$link"
      fi
    done
  done
  out="$ROOT/.whl/ucx-cu$cu-py$PYV.tar.xz"
  tar -cJf "$out" .
  cd "$ROOT"
  rm -rf "$work"
  trap - EXIT
  ls -la "$out"
done
