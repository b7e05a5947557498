#!/usr/bin/env bash
# An emulated cluster on this machine: N network namespaces as nodes, each with the hostname node<i>, the
# address 10.231.0.<i+1> on its eth0 and a private /etc/hosts that names every node, joined through a
# bridge in a switch namespace. Each node's link to the switch is shaped in both directions with tbf
# (RATE, default 1gbit); the loopback inside a node stays fast. With a DELAY (this kernel has no netem)
# the nodes are joined by a user-space switch instead (tests/multinode/link.cpp, TRAINSCOPE_LINK: its
# binary, default build/tests/trainscope_link): a TUN eth0 per node, each packet serialised at RATE and
# held DELAY. Nothing under /etc is written and no traffic can leave 10.231.0.0/24.
#
#   cluster.sh check                 exit 0 if namespaces can be made here, else says why (exit 77)
#   cluster.sh up NAME N [RATE] [DELAY]  creates the nodes (DELAY: 100us, 2ms, ...); the state folder is
#                                    /tmp/trainscope-cluster-NAME
#                                    (LOOPBACK_NODE=i: node<i>'s own name resolves to 127.0.1.1)
#   cluster.sh exec NAME I CMD...    runs CMD on node I: its network, hostname and hosts file
#   cluster.sh down NAME             kills every process on the nodes and removes them (safe to repeat)
#
# NAME: letters and digits, at most 8. Needs root, ip (iproute2), nsenter and unshare (util-linux).
set -uo pipefail

die() { echo "cluster: $*" >&2; exit "${2:-1}"; }
state() { echo "/tmp/trainscope-cluster-$1"; }
ns() { echo "tsc-$1-$2"; }  # ns NAME n<i> | sw

check() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)" 77
  for c in ip nsenter unshare tc; do command -v "$c" > /dev/null || die "'$c' is not installed" 77; done
  local probe="tsc-probe-$$"
  ip netns add "$probe" 2> /tmp/trainscope-cluster-check.err || die "cannot create a network namespace: $(tail -n1 /tmp/trainscope-cluster-check.err)" 77
  ip netns del "$probe"
}

# tc's rate units as bits per second: 500mbit -> 500000000.
bits_per_s() {
  local v=$1
  case "$v" in
    *gbit) echo $(( ${v%gbit} * 1000000000 )) ;; *mbit) echo $(( ${v%mbit} * 1000000 )) ;;
    *kbit) echo $(( ${v%kbit} * 1000 )) ;; *bit) echo "${v%bit}" ;; *) return 1 ;;
  esac
}

# 100us, 2ms, 1s -> microseconds.
microseconds() {
  local v=$1
  case "$v" in
    *us) echo "${v%us}" ;; *ms) echo $(( ${v%ms} * 1000 )) ;; *s) echo $(( ${v%s} * 1000000 )) ;; *) return 1 ;;
  esac
}

# The nodes joined by the user-space switch: it makes each node's eth0; then addresses as on a bridge.
up_delayed() {
  local name=$1 n=$2 rate=$3 delay=$4 dir i bits us link paths=()
  dir=$(state "$name")
  bits=$(bits_per_s "$rate" 2> /dev/null) && [[ "$bits" =~ ^[0-9]+$ ]] || die "RATE must be like 500mbit or 1gbit, not '$rate'" 2
  us=$(microseconds "$delay" 2> /dev/null) && [[ "$us" =~ ^[0-9]+$ ]] || die "DELAY must be like 100us or 2ms, not '$delay'" 2
  link=${TRAINSCOPE_LINK:-build/tests/trainscope_link}
  [ -x "$link" ] || die "no link binary at $link (make build, or TRAINSCOPE_LINK=...)" 2
  for ((i = 0; i < n; i++)); do
    ip netns add "$(ns "$name" "n$i")" || die "cannot create namespace $(ns "$name" "n$i")"
    paths+=("/var/run/netns/$(ns "$name" "n$i")")
  done
  "$link" "$bits" "$us" "${paths[@]}" > "$dir/link.out" 2>&1 &
  echo $! > "$dir/link.pid"
  for _ in $(seq 100); do grep -q ready "$dir/link.out" 2> /dev/null && break; sleep 0.05; done
  grep -q ready "$dir/link.out" || die "the link did not start: $(tail -n1 "$dir/link.out")"
  for ((i = 0; i < n; i++)); do
    local node
    node=$(ns "$name" "n$i")
    ip -n "$node" addr add "10.231.0.$((i + 1))/24" dev eth0
    ip -n "$node" link set lo up
    # Large frames: fewer packets through user space (the notes' measurement used 65000 as well).
    ip -n "$node" link set eth0 mtu 65000 up
  done
  echo "$delay" > "$dir/delay"
}

up() {
  local name=$1 n=$2 rate=${3:-1gbit} delay=${4:-} dir i
  [[ "$name" =~ ^[a-zA-Z0-9]{1,8}$ ]] || die "NAME must be 1-8 letters or digits, not '$name'" 2
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] && [ "$n" -le 64 ] || die "N must be 2..64, not '$n'" 2
  check
  down "$name"
  dir=$(state "$name")
  mkdir -p "$dir"
  # LOOPBACK_NODE=i maps node<i>'s name to 127.0.1.1 first, as Debian's installer maps a host's own name:
  # the misconfiguration that makes Gloo offer other hosts a loopback address.
  { echo "127.0.0.1 localhost"; [ -n "${LOOPBACK_NODE:-}" ] && echo "127.0.1.1 node$LOOPBACK_NODE"
    for ((i = 0; i < n; i++)); do echo "10.231.0.$((i + 1)) node$i"; done; } > "$dir/hosts"
  echo "$n" > "$dir/nodes"
  if [ -n "$delay" ]; then
    up_delayed "$name" "$n" "$rate" "$delay"
    echo "$rate" > "$dir/rate"
    echo "$dir"
    return
  fi
  ip netns add "$(ns "$name" sw)" || die "cannot create the switch namespace"
  ip -n "$(ns "$name" sw)" link add br0 type bridge
  ip -n "$(ns "$name" sw)" link set br0 up
  for ((i = 0; i < n; i++)); do
    local node a b
    node=$(ns "$name" "n$i")
    a="tsc$$a$i"; b="tsc$$b$i"
    ip netns add "$node" || die "cannot create namespace $node"
    ip link add "$a" type veth peer name "$b" || die "cannot create a veth pair"
    ip link set "$a" netns "$node"
    ip link set "$b" netns "$(ns "$name" sw)"
    ip -n "$node" link set "$a" name eth0
    ip -n "$node" addr add "10.231.0.$((i + 1))/24" dev eth0
    ip -n "$node" link set lo up
    ip -n "$node" link set eth0 up
    ip -n "$(ns "$name" sw)" link set "$b" name "p$i"
    ip -n "$(ns "$name" sw)" link set "p$i" master br0 up
    # Shaped both ways: the node's egress and the switch port's egress towards the node.
    ip netns exec "$node" tc qdisc replace dev eth0 root tbf rate "$rate" burst 64kb latency 20ms ||
      die "tc tbf failed on node $i"
    ip netns exec "$(ns "$name" sw)" tc qdisc replace dev "p$i" root tbf rate "$rate" burst 64kb latency 20ms
  done
  echo "$rate" > "$dir/rate"
  echo "$dir"
}

exec_on() {
  local name=$1 i=$2 dir
  shift 2
  dir=$(state "$name")
  [ -f "$dir/hosts" ] || die "no cluster '$name' (cluster.sh up $name N first)" 2
  [ -e "/var/run/netns/$(ns "$name" "n$i")" ] || die "cluster '$name' has no node $i" 2
  # A mount namespace of its own for the hosts file, a UTS namespace for the hostname: the node's
  # processes see node<i> and resolve every node's name, the machine's own files are untouched.
  exec nsenter --net="/var/run/netns/$(ns "$name" "n$i")" unshare --uts --mount \
    sh -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' "$dir/hosts" "node$i" "$@"
}

down() {
  local name=$1 n pid
  pid=$(cat "$(state "$name")/link.pid" 2> /dev/null) && kill -9 "$pid" 2> /dev/null
  for n in $(ip netns list 2> /dev/null | awk '{print $1}' | grep -E "^tsc-$name-(n[0-9]+|sw)$"); do
    # Every process whose network is the node's, then the namespace (which takes its links with it).
    ip netns pids "$n" 2> /dev/null | xargs -r kill -9 2> /dev/null
    ip netns del "$n" 2> /dev/null
  done
  rm -rf "$(state "$name")"
}

case "${1:-}" in
  check) check ;;
  up) [ $# -ge 3 ] || die "usage: cluster.sh up NAME N [RATE] [DELAY]" 2; up "$2" "$3" "${4:-}" "${5:-}" ;;
  exec) [ $# -ge 4 ] || die "usage: cluster.sh exec NAME I CMD..." 2; shift; exec_on "$@" ;;
  down) [ $# -eq 2 ] || die "usage: cluster.sh down NAME" 2; down "$2" ;;
  *) die "usage: cluster.sh check | up NAME N [RATE] [DELAY] | exec NAME I CMD... | down NAME" 2 ;;
esac
