#!/usr/bin/env bash
# The parallel suite's 4-rank cells on an emulated cluster of 2 nodes x 2 ranks, started by a real
# launcher with the command line a user types on each node; prints the report folder. SUITE, FILTER
# and PER_NODE run other cells: SUITE=hardware FILTER=collectives PER_NODE=1 measures the inter-node
# link alone.
#
#   tests/multinode/run.sh torchrun [RUN ARGS...]     e.g. --set steps=5
#
#   TRAINSCOPE  the binary (default build/trainscope)   OUT     report folder (default results/multinode-LAUNCHER)
#   RATE        the inter-node link (default 1gbit)     LIMIT_S the whole launch's time limit (default 600)
#   SUITE       default parallel       FILTER  the cells (default '/ws4$': the suite's 4-rank cells)
#   PER_NODE    ranks per node (default 2)
# The cluster is removed on exit, also after a failure, a timeout or Ctrl-C. Exit: the launch's
# (0: every cell ok), 77 where this machine cannot make namespaces (said on one line).
set -uo pipefail
cd "$(dirname "$0")/../.."
launcher=${1:-}
shift || true
here=tests/multinode
ts=$(realpath "${TRAINSCOPE:-build/trainscope}")
out=$(realpath -m "${OUT:-results/multinode-$launcher}")
name="mn$$"
[ -x "$ts" ] || { echo "run.sh: no trainscope binary at $ts (make build, or TRAINSCOPE=...)" >&2; exit 2; }
"$here/cluster.sh" check || exit $?
cleanup() { "$here/cluster.sh" down "$name"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
"$here/cluster.sh" up "$name" 2 "${RATE:-1gbit}" > /dev/null || exit 1
rm -rf "$out"
mkdir -p "$out"

# One command per node, as on a real cluster, each under the launch's time limit (setsid: a whole
# process group to kill, agents and their workers alike, if it runs over).
pids=()
case "$launcher" in
  torchrun)
    venv=$(scripts/torch-venv.sh)
    [ -x "$venv/bin/torchrun" ] || { echo "run.sh: no torchrun in $venv (scripts/install-deps.sh)" >&2; exit 2; }
    for node in 0 1; do
      setsid timeout -k 5 "${LIMIT_S:-600}" "$here/cluster.sh" exec "$name" "$node" \
        env OMP_NUM_THREADS=1 "$venv/bin/torchrun" --nnodes 2 --nproc-per-node "${PER_NODE:-2}" --node-rank "$node" \
        --master-addr node0 --master-port 29400 --no-python \
        "$ts" run --suite "${SUITE:-parallel}" --filter "${FILTER:-/ws4\$}" --threads 1 --out "$out" "$@" > "$out/node$node.log" 2>&1 &
      pids+=($!)
    done
    ;;
  *)
    echo "run.sh: unknown launcher '$launcher' (torchrun)" >&2
    exit 2
    ;;
esac
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for node in 0 1; do tail -n 3 "$out/node$node.log" | sed "s/^/node$node: /"; done
echo "$out"
exit "$rc"
