#!/usr/bin/env bash
# Builds trainscope against a CUDA LibTorch 2.x and runs the quick suite on the GPU.
#
#   TORCH_DIR   folder with TorchConfig.cmake; default: the torch package of the python3 on PATH
#   DEPS_DIR    folder made by scripts/bundle-deps.sh (offline header-only deps and Fashion-MNIST);
#               default ./deps when it exists, else the system's packages
#   BUILD       build folder (default build-cuda); extra arguments go to `trainscope run`
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${TORCH_DIR:-}" ]; then
  TORCH_DIR=$(python3 -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))') || {
    echo "build-cuda: no TORCH_DIR and no torch package for $(command -v python3)" >&2
    exit 1
  }
fi
DEPS_DIR=${DEPS_DIR:-$([ -d deps ] && echo "$PWD/deps" || true)}
BUILD=${BUILD:-build-cuda}

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$TORCH_DIR" -DTRAINSCOPE_TESTS=OFF -DTRAINSCOPE_BENCH=OFF)
command -v ninja >/dev/null && cmake_args+=(-G Ninja)
if [ -n "$DEPS_DIR" ]; then
  arch=$(ls "$DEPS_DIR/usr/lib" | grep -m1 -- -linux-gnu || true)
  cmake_args+=("-DCMAKE_PREFIX_PATH=$DEPS_DIR/usr;$DEPS_DIR/usr/share/cmake;$DEPS_DIR/usr/lib/$arch/cmake"
               "-DZLIB_ROOT=$DEPS_DIR/usr")
  export LD_LIBRARY_PATH="$DEPS_DIR/usr/lib/$arch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -d "$DEPS_DIR/usr/share/datasets/fashion-mnist" ] &&
    export TRAINSCOPE_FASHION_MNIST="$DEPS_DIR/usr/share/datasets/fashion-mnist"
fi

echo "build-cuda: torch from $TORCH_DIR; deps from ${DEPS_DIR:-the system}"
start=$(date +%s)
cmake -S . -B "$BUILD" "${cmake_args[@]}"
cmake --build "$BUILD" -j"$(nproc)"
echo "build-cuda: built in $(( $(date +%s) - start )) s"

"$BUILD/trainscope" env | head -c 4000
echo
"$BUILD/trainscope" run --suite quick --device cuda --out "${OUT_DIR:-results/cuda-quick}" "$@"
# With two GPUs or more, the parallel suite over NCCL (one local rank per GPU).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -ge 2 ]; then
  "$BUILD/trainscope" run --suite parallel --device cuda --nproc "$gpus" --out "${OUT_DIR:-results/cuda}-parallel"
fi
