#!/usr/bin/env bash
# Prints the folder of the virtual environment that holds the pinned torch wheel (see install-deps.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
echo "${TRAINSCOPE_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/trainscope/torch-$(cat "$here/torch.pin")}"
