#!/usr/bin/env bash
# Sets up a Debian 12 machine for trainscope, installing only what is missing (idempotent):
#   1. Debian packages (as root or through passwordless sudo);
#   2. LibTorch: the pinned `torch` wheel from PyPI (a CUDA build that also runs without a GPU) in a
#      virtual environment kept outside the checkout, so that every clone on the machine shares it.
# The environment's folder is printed on the last line (`Makefile` and CMake find it the same way):
#   $TRAINSCOPE_TORCH_VENV, else ${XDG_CACHE_HOME:-~/.cache}/trainscope/torch-<pin>.
# TRAINSCOPE_SKIP_TORCH=1 skips step 2 (for a user who points Torch_DIR at a LibTorch of their own).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

packages=(
  build-essential cmake git pkg-config
  python3 python3-venv            # the virtual environment that holds the torch wheel
  libgloo-dev                     # Gloo's headers: c10d's ProcessGroupGloo.hpp includes them, the wheel has none
  nlohmann-json3-dev libcli11-dev libtomlplusplus-dev zlib1g-dev
  libgtest-dev libbenchmark-dev
  dataset-fashion-mnist           # real data, read offline from /usr/share/datasets/fashion-mnist
  python3-jsonschema              # the schema test validates real reports with it
  openmpi-bin                     # `mpirun -np 2 trainscope run ...` is tested for real
  iproute2                        # `ss`: the test of what a local run listens on; ip, tc: the emulated cluster
  slurmd slurmctld slurm-client munge  # SLURM across the emulated cluster's nodes (tests/multinode)
  libjs-chart.js                  # Chart.js, inlined into report.html (read at render time)
  chromium                        # headless: the test that report.html draws its charts offline
  fortunes                        # English text (data = text): byte-level tokens for the language models
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} Debian packages present"
else
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
fi

[ "${TRAINSCOPE_SKIP_TORCH:-0}" = 1 ] && exit 0

pin=$(cat "$here/torch.pin")
venv=$("$here/torch-venv.sh")
# The marker is written last: an interrupted download is redone, a finished one never.
if [ -f "$venv/.trainscope-ok" ]; then
  echo "install-deps: torch $pin present in $venv"
else
  echo "install-deps: installing torch $pin from PyPI into $venv (about 4 GB downloaded, 4.7 GB on disk)"
  start=$(date +%s)
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "torch==$pin" numpy
  "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$pin', torch.__version__"
  touch "$venv/.trainscope-ok"
  echo "install-deps: torch $pin installed in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))"
fi

# 3. The Python reference packages of `trainscope parity` (scripts/reference-packages.txt), pinned, into
#    the same environment, with torch and numpy held where they are by a constraints file. Redone only
#    when the pins change (the marker holds the pins it installed).
pins="$here/reference-packages.txt"
marker="$venv/.trainscope-reference-packages"
if [ "${TRAINSCOPE_SKIP_REFERENCE_PACKAGES:-0}" = 1 ]; then
  echo "install-deps: reference packages skipped (TRAINSCOPE_SKIP_REFERENCE_PACKAGES=1)"
elif [ -f "$marker" ] && cmp -s "$marker" "$pins"; then
  echo "install-deps: reference packages present ($(grep -v '^#' "$pins" | tr '\n' ' '))"
else
  echo "install-deps: installing the reference packages: $(grep -v '^#' "$pins" | tr '\n' ' ')"
  constraints=$(mktemp)
  "$venv/bin/pip" freeze --disable-pip-version-check | grep -Ei '^(torch|numpy)==' > "$constraints"
  start=$(date +%s)
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir -c "$constraints" wheel==0.45.1
  DS_BUILD_OPS=0 "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir --no-build-isolation \
    -c "$constraints" -r "$pins"
  rm -f "$constraints"
  # DeepSpeed compiles a small CPU op (its shared-memory all-reduce) the first time a process group
  # starts, about a minute: build it once here, into the environment, so no test pays for it.
  if grep -q '^deepspeed==' "$pins"; then
    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$venv/torch-extensions" "$venv/bin/python" -c \
      'from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()' >/dev/null 2>&1 ||
      echo "install-deps: DeepSpeed's CPU op was not pre-built; its first parity row will build it (about a minute)"
  fi
  echo "install-deps: reference packages installed in $(( $(date +%s) - start )) s"
  "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$pin', torch.__version__"
  cp "$pins" "$marker"
fi
echo "$venv"
