#!/usr/bin/env bash
# Makes a folder of the header-only and small dependencies (plus Fashion-MNIST) from Debian's
# packages, for a GPU node that has no network: download and unpack, no install, no root needed.
#
#   scripts/bundle-deps.sh [DEPS_DIR]      # default ./deps; then copy it to the GPU node
#   DEPS_DIR=/path/to/deps scripts/gpu-check.sh
set -euo pipefail

deps_dir=$(realpath -m "${1:-${DEPS_DIR:-deps}}")
packages=(nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libtomlplusplus3 zlib1g-dev zlib1g libgloo-dev
          dataset-fashion-mnist)

mkdir -p "$deps_dir/debs"
cd "$deps_dir/debs"
if ! apt-get download "${packages[@]}" 2>/tmp/bundle-deps.err; then
  echo "bundle-deps: apt-get download failed ($(tail -n1 /tmp/bundle-deps.err)); run 'apt-get update' first" >&2
  exit 1
fi
for deb in ./*.deb; do dpkg-deb -x "$deb" "$deps_dir"; done
cd "$deps_dir"
rm -rf debs
# zlib's runtime sits in /lib/<arch> and its development symlink in /usr/lib/<arch>: put them together.
for so in lib/*/libz.so.*; do
  [ -e "$so" ] && mv "$so" "usr/$so"
done
for so in usr/lib/*/libz.so; do
  [ -L "$so" ] && ln -sf "$(basename "$(readlink "$so")")" "$so"
done
echo "bundle-deps: ${#packages[@]} packages unpacked into $deps_dir ($(du -sh "$deps_dir" | cut -f1))"
