#!/usr/bin/env bash
# The parallel suite's 4-rank cells on an emulated cluster of 2 nodes x 2 ranks, started by a real
# launcher with the command line a user types on each node; prints the report folder. SUITE, FILTER
# and PER_NODE run other cells: SUITE=hardware FILTER='^collectives$' with --set world_size=4 measures both
# levels (within a node, across nodes), with PER_NODE=1 the link between the nodes alone.
#
#   tests/multinode/run.sh torchrun|mpirun|slurm|sbatch [RUN ARGS...]     e.g. --set steps=5
#
# slurm starts the ranks with `srun -N 2 --ntasks-per-node 2`, sbatch submits a batch script that
# does (`sbatch --wait`), as most SLURM jobs are run.
#   TRAINSCOPE  the binary (default build/trainscope)   OUT     report folder (default results/multinode-LAUNCHER)
#   RATE        the inter-node link (default 1gbit)     LIMIT_S the whole launch's time limit (default 600)
#   DELAY       the inter-node link's one-way delay (default none; e.g. 500us: the user-space switch)
#   SUITE       default parallel       FILTER  the cells (default '/ws4$': the suite's 4-rank cells)
#   PER_NODE    ranks per node (default 2)
#   RDZV        torchrun's rendezvous: static (default; --node-rank, --master-addr) or c10d (elastic)
#   MAX_RESTARTS  torchrun --max-restarts (default 0; with RDZV=c10d: an elastic restart after a failure)
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
case "$launcher" in
  torchrun | mpirun | slurm | sbatch) ;;
  *) echo "run.sh: unknown launcher '$launcher' (torchrun, mpirun, slurm, sbatch)" >&2; exit 2 ;;
esac
[ -x "$ts" ] || { echo "run.sh: no trainscope binary at $ts (make build, or TRAINSCOPE=...)" >&2; exit 2; }
"$here/cluster.sh" check || exit $?
cleanup() { "$here/cluster.sh" down "$name"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
"$here/cluster.sh" up "$name" 2 "${RATE:-1gbit}" "${DELAY:-}" > /dev/null || exit 1
rm -rf "$out"
mkdir -p "$out"

# One command per node, as on a real cluster, each under the launch's time limit (setsid: a whole
# process group to kill, agents and their workers alike, if it runs over).
pids=()
case "$launcher" in
  torchrun)
    venv=$(scripts/torch-venv.sh)
    [ -x "$venv/bin/torchrun" ] || { echo "run.sh: no torchrun in $venv (scripts/install-deps.sh)" >&2; exit 2; }
    case "${RDZV:-static}" in
      static) rdzv=(--master-addr node0 --master-port 29400) ;;
      # c10d: the agents meet at node0's endpoint and agree on the node ranks themselves (node1's agent
      # may get ranks 0 and 1); what an elastic restart needs.
      c10d) rdzv=(--rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id "$name" --monitor-interval 1) ;;
      *) echo "run.sh: RDZV must be static or c10d, not '$RDZV'" >&2; exit 2 ;;
    esac
    for node in 0 1; do
      node_rank=()
      [ "${RDZV:-static}" = static ] && node_rank=(--node-rank "$node")
      setsid timeout -k 5 "${LIMIT_S:-600}" "$here/cluster.sh" exec "$name" "$node" \
        env OMP_NUM_THREADS=1 "$venv/bin/torchrun" --nnodes 2 --nproc-per-node "${PER_NODE:-2}" "${node_rank[@]}" \
        "${rdzv[@]}" --max-restarts "${MAX_RESTARTS:-0}" --no-python \
        "$ts" run --suite "${SUITE:-parallel}" --filter "${FILTER:-/ws4\$}" --threads 1 --out "$out" "$@" > "$out/node$node.log" 2>&1 &
      pids+=($!)
    done
    ;;
  mpirun)
    # mpirun on node0 reaches node1 through rsh.sh (no ssh here); MASTER_ADDR is ours to give.
    per=${PER_NODE:-2}
    setsid timeout -k 5 "${LIMIT_S:-600}" "$here/cluster.sh" exec "$name" 0 \
      env TRAINSCOPE_CLUSTER="$name" mpirun --allow-run-as-root --mca plm_rsh_agent "$PWD/$here/rsh.sh" \
      --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0 -np $((2 * per)) --host "node0:$per,node1:$per" \
      -x MASTER_ADDR=node0 -x MASTER_PORT=29400 -x OMP_NUM_THREADS=1 \
      "$ts" run --suite "${SUITE:-parallel}" --filter "${FILTER:-/ws4\$}" --threads 1 --out "$out" "$@" > "$out/node0.log" 2>&1 &
    pids+=($!)
    ;;
  slurm | sbatch)
    # Debian's slurm-wlm: munged, slurmctld on node0 and one slurmd per node, all in the foreground
    # inside the nodes (the cluster's removal stops them), configured from the cluster's state folder.
    for c in munged slurmctld slurmd srun sbatch sinfo; do
      command -v "$c" > /dev/null || { echo "run.sh: '$c' is not installed (apt-get install slurmd slurmctld slurm-client munge)" >&2; exit 2; }
    done
    per=${PER_NODE:-2}
    d="/tmp/trainscope-cluster-$name/slurm"
    mkdir -p "$d/munge" "$d/state" "$d/log" "$d/spool/node0" "$d/spool/node1"
    chmod 700 "$d/munge"
    head -c 1024 /dev/urandom > "$d/munge/munge.key"
    chmod 400 "$d/munge/munge.key"
    cat > "$d/slurm.conf" <<CONF
ClusterName=trainscope
SlurmctldHost=node0(10.231.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
AuthInfo=socket=$d/munge/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool/%n
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd-%n.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Job records are never purged: sbatch --wait then polls every 2 s (it lengthens its sleep to 8 and 32 s
# only while that stays under a third of MinJobAge), so the launch ends when the job does.
MinJobAge=0
SlurmdParameters=config_overrides
NodeName=node0 NodeAddr=10.231.0.1 CPUs=$per State=UNKNOWN
NodeName=node1 NodeAddr=10.231.0.2 CPUs=$per State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    export SLURM_CONF="$d/slurm.conf"
    # Each daemon from a subshell: not this script's job, so its end at the cluster's removal is silent.
    ("$here/cluster.sh" exec "$name" 0 munged -F --force --key-file="$d/munge/munge.key" --socket="$d/munge/munge.sock" \
      --pid-file="$d/munge/munged.pid" --log-file="$d/munge/munged.log" --seed-file="$d/munge/munged.seed" > "$d/log/munged.out" 2>&1 &)
    for _ in $(seq 50); do [ -S "$d/munge/munge.sock" ] && break; sleep 0.1; done
    ("$here/cluster.sh" exec "$name" 0 slurmctld -D -i -f "$SLURM_CONF" > "$d/log/slurmctld.out" 2>&1 &)
    for node in 0 1; do ("$here/cluster.sh" exec "$name" "$node" slurmd -D -f "$SLURM_CONF" > "$d/log/slurmd$node.out" 2>&1 &); done
    idle=0
    for _ in $(seq 100); do
      [ "$("$here/cluster.sh" exec "$name" 0 sinfo -h -o %t 2> /dev/null | sort -u)" = idle ] && { idle=1; break; }
      sleep 0.1
    done
    [ "$idle" = 1 ] || { echo "run.sh: the SLURM cluster did not come up (logs in $d/log)" >&2; tail -n 5 "$d"/log/*.log >&2; exit 1; }
    # -K1: a task that fails ends the step (the others would wait for it until their collective timeout).
    step=(srun -K1 -N 2 --ntasks-per-node "$per" "$ts" run --suite "${SUITE:-parallel}" --filter "${FILTER:-/ws4\$}"
          --threads 1 --out "$out" "$@")
    if [ "$launcher" = slurm ]; then
      setsid timeout -k 5 "${LIMIT_S:-600}" "$here/cluster.sh" exec "$name" 0 \
        env OMP_NUM_THREADS=1 "${step[@]}" > "$out/node0.log" 2>&1 &
    else
      # A batch script holding the srun line, as a user's job script does; --wait: sbatch returns when
      # the job ends, with its exit code. The job's output goes to the report folder's node0.log.
      { echo '#!/bin/sh'; printf '%q ' exec "${step[@]}"; echo; } > "$out/job.sh"
      setsid timeout -k 5 "${LIMIT_S:-600}" "$here/cluster.sh" exec "$name" 0 \
        env OMP_NUM_THREADS=1 sbatch --wait -N 2 --ntasks-per-node "$per" --output "$out/node0.log" "$out/job.sh" \
        > "$out/sbatch.log" 2>&1 &
    fi
    pids+=($!)
    ;;
esac
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for node in 0 1; do [ -f "$out/node$node.log" ] && tail -n 3 "$out/node$node.log" | sed "s/^/node$node: /"; done
echo "$out"
exit "$rc"
