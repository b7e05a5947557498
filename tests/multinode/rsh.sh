#!/usr/bin/env bash
# Open MPI's stand-in for ssh on the emulated cluster (mpirun --mca plm_rsh_agent): Open MPI calls it
# as `rsh.sh HOST orted ...`; it runs the command on node<i> of the cluster TRAINSCOPE_CLUSTER names.
host=$1
shift
case "$host" in
  node[0-9]*) exec "$(dirname "$0")/cluster.sh" exec "${TRAINSCOPE_CLUSTER:?rsh.sh: TRAINSCOPE_CLUSTER is not set}" "${host#node}" sh -c "$*" ;;
  *) echo "rsh.sh: '$host' is not a node of the emulated cluster (node0, node1, ...)" >&2; exit 255 ;;
esac
