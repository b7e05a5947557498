#!/usr/bin/env bash
# The GPU check, for a machine with one NVIDIA GPU or more (201 s on one H200 with SUSTAIN_S=60, once built):
# the project's one CMake build against the machine's CUDA torch, then
#   versions and `trainscope env`; the quick suite on cuda; the precision suite's GPU cells (tf32,
#   bf16-mixed, real 16-mixed); a checkpointing pair with the caching allocator's statistics; NCCL
#   with one rank (and the parallel suite over NCCL with two GPUs or more); `trainscope peak`, the
#   hardware suite, a cell with the CUPTI timeline, llama3-1b in bf16 on SDPA and eager attention, and
#   llama3-1b in bf16-master beside bf16-mixed, with and without selective-op checkpointing.
# Every output goes under one folder, OUT (default results/gpu-check-<UTC time>), with summary.txt
# listing each step's exit code and time. A failing step is recorded and the next one runs.
#
#   Torch_DIR  folder with TorchConfig.cmake; default: the project's virtual environment when it
#              exists (scripts/install-deps.sh), else the torch of the python3 on PATH
#   DEPS_DIR   folder made by scripts/bundle-deps.sh (header-only deps, Fashion-MNIST) for a node
#              without Debian's packages; default ./deps when it exists
#   BUILD      build folder (default build-gpu); an existing build there is reused unless REBUILD=1
#   SUSTAIN_S  seconds of the hardware suite's sustained training cell (default 120)
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-results/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
BUILD=${BUILD:-build-gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
summary="$OUT/summary.txt"
: > "$summary"
say() { echo "gpu-check: $*" | tee -a "$summary"; }
# step NAME CMD...: runs CMD with its output in OUT/NAME.log, records exit code and time, shows the tail.
step() {
  local name=$1 start rc
  shift
  start=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  say "$name: exit $rc in $(( $(date +%s) - start )) s ($*)"
  tail -n 30 "$OUT/$name.log"
  return $rc
}

venv=$(scripts/torch-venv.sh)
if [ -z "${Torch_DIR:-}" ]; then
  if [ -x "$venv/bin/python" ]; then py="$venv/bin/python"; else py=python3; fi
  Torch_DIR=$("$py" -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))') || {
    say "no Torch_DIR and no torch package for $py"
    exit 1
  }
fi
DEPS_DIR=${DEPS_DIR:-$([ -d deps ] && echo "$PWD/deps" || true)}

step versions bash -c "python3 -c 'import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
  \"cxx11 abi\", torch._C._GLIBCXX_USE_CXX11_ABI, \"gpus\", torch.cuda.device_count())' 2>&1;
  nvidia-smi 2>&1 | head -n 20; command -v nvcc && nvcc --version | tail -n 2; cmake --version | head -n 1; g++ --version | head -n 1"

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$Torch_DIR" -DTRAINSCOPE_TESTS=OFF)
if [ -n "$DEPS_DIR" ]; then
  arch=$(ls "$DEPS_DIR/usr/lib" | grep -m1 -- -linux-gnu || true)
  cmake_args+=("-DCMAKE_PREFIX_PATH=$DEPS_DIR/usr;$DEPS_DIR/usr/share/cmake;$DEPS_DIR/usr/lib/$arch/cmake"
               "-DCMAKE_CXX_FLAGS=-isystem $DEPS_DIR/usr/include" "-DZLIB_ROOT=$DEPS_DIR/usr")
  export LD_LIBRARY_PATH="$DEPS_DIR/usr/lib/$arch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -d "$DEPS_DIR/usr/share/datasets/fashion-mnist" ] &&
    export TRAINSCOPE_FASHION_MNIST="$DEPS_DIR/usr/share/datasets/fashion-mnist"
fi
if [ ! -x "$BUILD/trainscope" ] || [ "${REBUILD:-0}" = 1 ]; then
  step configure cmake -S . -B "$BUILD" "${cmake_args[@]}" || { say "configure failed: see $OUT/configure.log"; exit 1; }
  step build cmake --build "$BUILD" -j"$(nproc)" || { say "build failed: see $OUT/build.log"; exit 1; }
else
  say "reusing the build in $BUILD (REBUILD=1 rebuilds)"
fi
ts="$BUILD/trainscope"
ldd "$ts" > "$OUT/ldd.txt" 2>&1

step env "$ts" env
"$ts" env > "$OUT/env.json" 2>/dev/null
step quick "$ts" run --suite quick --device cuda --out "$OUT/quick"
# The modes a GPU runs for real: TF32 tensor cores, bf16 autocast, fp16 autocast with the scaler
# (never emulated on CUDA), and the stress cells; fp32 is their reference.
step precision "$ts" run --suite precision --device cuda --filter '32-true|tf32|bf16-mixed|16-mixed' \
  --out "$OUT/precision"
cat > "$OUT/checkpointing.toml" <<'EOF'
name = "gpu-checkpointing"
description = "gpt-small, no checkpointing against full: the caching allocator's peaks and the recompute cost"
[base]
model = "gpt-small"
batch_size = 32
warmup_steps = 3
steps = 20
eval = false
overflow_every = 0
precision = "bf16-mixed"
[axes]
checkpoint = ["none", "full"]
EOF
step checkpointing "$ts" run --suite "$OUT/checkpointing.toml" --device cuda --out "$OUT/checkpointing"
step nccl "$BUILD/bench/trainscope_collectives" --nproc 1 --backend nccl --min-bytes 1MiB --max-bytes 256MiB
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
# Qualification: the GEMM peak per dtype (fp8 through _scaled_mm on sm89+) against the datasheet, the
# hardware suite (memory and copy bandwidth, a 2-minute sustained cell), and the CUPTI timeline on a
# bf16 training cell (kernels, compute/communication overlap, idle time).
step peak "$ts" peak --device cuda --out "$OUT/peak.json"
# The calibration cells are the CPU planner's (a GPU's kernels are timed on the device): left out, and
# so kept from --set model=gpt-125m, which is meant for the sustained cell.
step hardware "$ts" run --suite hardware --device cuda --nproc "$(( gpus > 1 ? 2 : 1 ))" --filter '^(kind=|collectives|sustained)' \
  --set time_budget_s="${SUSTAIN_S:-120}" --set model=gpt-125m \
  --set batch_size=8 --out "$OUT/hardware"
cat > "$OUT/timeline.toml" <<'EOF'
name = "gpu-timeline"
description = "gpt-small in bf16 with the CUPTI timeline"
[base]
model = "gpt-small"
batch_size = 16
warmup_steps = 3
steps = 20
eval = false
timeline = true
[axes]
precision = ["bf16-mixed"]
EOF
step timeline "$ts" run --suite "$OUT/timeline.toml" --device cuda --out "$OUT/timeline"
# Llama 3.2 1B in bf16 autocast, SDPA (the cell reports which kernel ran: flash, efficient or cudnn)
# against eager attention: step time, MFU on both FLOP conventions, the caching allocator's peak.
cat > "$OUT/llama.toml" <<'EOF'
name = "gpu-llama"
description = "llama3-1b, bf16-mixed, SDPA against eager attention, seq 2048"
[base]
model = "llama3-1b"
seq_len = 2048
data = "synthetic-tokens"
precision = "bf16-mixed"
batch_size = 2
warmup_steps = 3
steps = 10
eval = false
overflow_every = 0
time_budget_s = 60
[axes]
attention = ["sdpa", "eager"]
EOF
step llama "$ts" run --suite "$OUT/llama.toml" --device cuda --out "$OUT/llama"
# The way large models are trained: bf16 weights cast from fp32 masters (FSDP2's MixedPrecisionPolicy)
# beside autocast over fp32 weights, without and with torchtitan's op-level selective checkpointing.
cat > "$OUT/master.toml" <<'EOF'
name = "gpu-master"
description = "llama3-1b on SDPA, seq 2048: bf16-mixed against bf16-master, none and selective-op"
[base]
model = "llama3-1b"
seq_len = 2048
data = "synthetic-tokens"
attention = "sdpa"
batch_size = 2
warmup_steps = 3
steps = 10
eval = false
overflow_every = 0
time_budget_s = 60
[axes]
precision = ["bf16-mixed", "bf16-master"]
checkpoint = ["none", "selective-op"]
EOF
step master "$ts" run --suite "$OUT/master.toml" --device cuda --out "$OUT/master"
# The planner beside the measurements it was not fitted to: every cell predicted from its configuration
# and this GPU's hardware report (gpt-125m: the hardware suite's sustained cell; llama3-1b; gpt-small).
for r in llama master hardware checkpointing; do
  step "plan-$r" "$ts" plan --check "$OUT/$r" --hardware "$OUT/hardware"
done
if [ "${gpus:-0}" -ge 2 ]; then
  step nccl-ranks "$BUILD/bench/trainscope_collectives" --nproc "$gpus" --backend nccl --max-bytes 256MiB
  step parallel "$ts" run --suite parallel --device cuda --nproc "$gpus" --out "$OUT/parallel"
fi
say "done: everything is under $OUT"
