#!/usr/bin/env bash
# ctest multinode_torchrun: torchrun across 2 namespace nodes x 2 ranks.
#  - the report names the launcher and the nodes (node0: ranks 0, 1; node1: ranks 2, 3), report.md too;
#  - DDP and ZeRO-3 reach the same losses, bit for bit, as the same cells on 4 local ranks (Gloo's ring
#    visits the ranks in the same order whatever host they are on);
#  - the shaped link shows: a 4 MiB all-reduce between the nodes (one rank each) takes at least the time
#    the link's rate allows (4 MiB each way at RATE: 67 ms at 500 Mbit/s; 10% margin for the rate's
#    rounding in tbf) and at least 3x the same all-reduce between 2 ranks of one node (loopback, ~6-12 ms
#    on 2 busy cores).
# Exit 77 (skipped) where this machine cannot make network namespaces.
set -uo pipefail
cd "$(dirname "$0")/../.."
ts=$(realpath "${1:-build/trainscope}")
tmp=$(mktemp -d /tmp/trainscope-mn-test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
tests/multinode/cluster.sh check || exit $?
fail() { echo "FAIL: $*"; exit 1; }
export TRAINSCOPE="$ts" LIMIT_S=240 RATE=500mbit
cells='mlp/ddp/ws4|gpt-tiny/zero3/ws4'

OUT="$tmp/nodes" FILTER="$cells" tests/multinode/run.sh torchrun --set steps=8 > "$tmp/nodes.log" 2>&1 ||
  { cat "$tmp/nodes.log"; fail "the 2-node torchrun launch failed"; }
timeout -k 5 240 "$ts" run --suite parallel --filter "$cells" --nproc 4 --threads 1 --set steps=8 --out "$tmp/local" \
  > "$tmp/local.log" 2>&1 || { cat "$tmp/local.log"; fail "the same cells on 4 local ranks failed"; }
OUT="$tmp/inter" SUITE=hardware FILTER=collectives PER_NODE=1 tests/multinode/run.sh torchrun > "$tmp/inter.log" 2>&1 ||
  { cat "$tmp/inter.log"; fail "the collectives between the nodes failed"; }
timeout -k 5 240 "$ts" run --suite hardware --filter collectives --nproc 2 --out "$tmp/intra" > "$tmp/intra.log" 2>&1 ||
  { cat "$tmp/intra.log"; fail "the collectives on one node failed"; }

/usr/bin/python3 - "$tmp" <<'EOF' || exit 1
import json, sys
tmp = sys.argv[1]
nodes = json.load(open(f"{tmp}/nodes/report.json"))
local = json.load(open(f"{tmp}/local/report.json"))
errors = []
launch = nodes["env"].get("launch", {})
if launch.get("source") != "torchrun" or launch.get("world_size") != 4:
    errors.append(f"env.launch: {launch}")
expected = [{"node": 0, "host": "node0", "ranks": [0, 1]}, {"node": 1, "host": "node1", "ranks": [2, 3]}]
by_name = {c["name"]: c for c in local["cells"]}
for c in nodes["cells"]:
    if c["status"] != "ok":
        errors.append(f"{c['name']}: {c['status']} {c.get('reason')}")
        continue
    if c.get("nodes") != expected:
        errors.append(f"{c['name']}: nodes {c.get('nodes')}")
    mine, theirs = c["metrics"]["quality"]["step_losses"], by_name[c["name"]]["metrics"]["quality"]["step_losses"]
    if mine != theirs:
        errors.append(f"{c['name']}: losses on 2 nodes {mine[-3:]} != on 4 local ranks {theirs[-3:]}")
line = "Ranks on 2 nodes (torchrun): node0 (ranks 0, 1), node1 (ranks 2, 3)."
if line not in open(f"{tmp}/nodes/report.md").read():
    errors.append(f"report.md does not say '{line}'")
if len(nodes["cells"]) != 2:
    errors.append(f"{len(nodes['cells'])} cells, not 2")

def allreduce_s(path, size):
    for c in json.load(open(path))["cells"]:
        for x in c.get("metrics", {}).get("comm", {}).get("collectives", []):
            if x["op"] == "all-reduce" and x["bytes"] == size:
                return x["time_s"]
    raise SystemExit(f"FAIL: no {size}-byte all-reduce in {path}")
size = 4 << 20
inter, intra = allreduce_s(f"{tmp}/inter/report.json", size), allreduce_s(f"{tmp}/intra/report.json", size)
floor = size * 8 / 500e6 * 0.9
print(f"4 MiB all-reduce: between the nodes {inter * 1e3:.1f} ms, within a node {intra * 1e3:.1f} ms (link floor {floor * 1e3:.1f} ms)")
if inter < floor:
    errors.append(f"the inter-node all-reduce ({inter * 1e3:.1f} ms) beats the shaped link's floor ({floor * 1e3:.1f} ms)")
if inter < 3 * intra:
    errors.append(f"inter-node {inter * 1e3:.1f} ms is not 3x intra-node {intra * 1e3:.1f} ms")
for e in errors:
    print("FAIL:", e)
sys.exit(1 if errors else 0)
EOF
echo "multinode torchrun: ok"
