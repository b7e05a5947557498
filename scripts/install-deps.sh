#!/usr/bin/env bash
# Installs the Debian 12 packages trainscope needs, only those missing. Idempotent; runs as root or
# through sudo. The CUDA toolkit is optional and never installed here.
set -euo pipefail

packages=(
  build-essential cmake git pkg-config
  libtorch-dev libgloo-dev        # LibTorch 1.13 (CPU) with c10d + Gloo headers
  libopenblas0-openmp             # fp32 GEMM ~30x faster than the reference BLAS torch finds otherwise
  nlohmann-json3-dev libcli11-dev libtomlplusplus-dev zlib1g-dev
  libgtest-dev libbenchmark-dev
  dataset-fashion-mnist           # real data, read offline from /usr/share/datasets/fashion-mnist
  python3-jsonschema              # the schema test validates real reports with it
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo=(sudo)
else
  echo "install-deps: missing packages: ${missing[*]}" >&2
  echo "install-deps: run as root or with passwordless sudo, or install them yourself: apt-get install ${missing[*]}" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# libopenblas0-openmp registers itself as libblas.so.3; make sure it wins over the reference BLAS.
blas=$(ls /usr/lib/*/openblas-openmp/libblas.so.3 2>/dev/null | head -n1 || true)
if [ -n "$blas" ]; then
  "${sudo[@]}" update-alternatives --set "libblas.so.3-$(dpkg-architecture -qDEB_HOST_MULTIARCH)" "$blas" >/dev/null || true
fi
echo "install-deps: done"
