#!/usr/bin/env bash
# Measures `trainscope ab` as a gate on this machine: how often an A/A execution (the same build on
# both sides) ends `regression` (false alarms), and how often an injected slowdown on the new side
# (`--new-set inject=slow:<pct>`) is caught, over repeated gate executions interleaved in rounds so that
# a drift of the machine during the measurement hits every kind alike. Each round runs
#   A/A, slow:10, A/A, and every other round slow:5 or slow:25 (alternating).
#
#   scripts/measure-gate.sh [ROUNDS] [BUILD] [FILTER]   # default 30 rounds (60 A/A, 30 slow:10, 8 slow:5,
#                                                       # 7 slow:25), build folder "build", cell ^mlp$
#   scripts/measure-gate.sh --summarize DIR             # the summary of a measurement (also a partial one)
# Writes every execution (its slots' reports, ab.json) and executions.tsv, summary.txt under
# results/gate-<UTC time>/. Any other gate option goes in GATE_ARGS (e.g. GATE_ARGS="--blocks 8").
set -euo pipefail
cd "$(dirname "$0")/.."

summarize() {
  python3 - "$1" <<'EOF'
import json, math, sys, statistics
from pathlib import Path
out = Path(sys.argv[1])
rows = [l.split("\t") for l in (out / "executions.tsv").read_text().splitlines()[1:] if l.strip()]
def upper95(k, n):
    # Clopper-Pearson one-sided 95% upper bound on a rate, by bisection on the binomial tail.
    if k >= n: return 1.0
    def tail(p): return sum(math.comb(n, i) * p**i * (1 - p)**(n - i) for i in range(k + 1))
    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        (lo, hi) = (mid, hi) if tail(mid) > 0.05 else (lo, mid)
    return hi
kinds = {}
for kind, verdict, code, blocks, seconds, execution in rows:
    kinds.setdefault(kind, []).append((verdict, int(blocks), float(seconds), execution))
lines = []
for kind in sorted(kinds, key=lambda k: (k != "aa", int(k[4:]) if k.startswith("slow") else 0)):
    runs = kinds[kind]
    n = len(runs)
    counts = {v: sum(r[0] == v for r in runs) for v in ("regression", "pass", "inconclusive", "error")}
    k = counts["regression"]
    what = "false alarms" if kind == "aa" else "caught"
    lines.append(f"{kind:8s} {n:3d} executions: {what} {k}/{n} = {100 * k / n:.1f}% (95% upper bound {100 * upper95(k, n):.1f}%, "
                 f"lower bound {100 * (1 - upper95(n - k, n)):.1f}%); pass {counts['pass']}, inconclusive {counts['inconclusive']}, "
                 f"error {counts['error']}; blocks median {statistics.median(r[1] for r in runs):.0f}, "
                 f"seconds median {statistics.median(r[2] for r in runs):.0f} max {max(r[2] for r in runs):.0f}")
# The per-block log-ratio spread of the A/A executions (no effect): its robust sigma (1.4826 x MAD)
# and the blocks a one-sided test at 5% needs to see a 10% slowdown with 90% power under a normal
# approximation, n = ((z_0.95 + z_0.90) sigma / ln 1.1)^2; for the gate's statistic (the fastest step)
# and for the step-time median kept beside it.
for key, what in (("log_ratios", "fastest step"), ("p50_log_ratios", "step-time median")):
    ratios = []
    for _, _, _, _, _, execution in (r for r in rows if r[0] == "aa"):
        ab = json.loads((Path(execution) / "ab.json").read_text())
        for c in ab.get("cells", []):
            ratios += c.get(key, [])
    if len(ratios) >= 3:
        med = statistics.median(ratios)
        sigma = 1.4826 * statistics.median(abs(x - med) for x in ratios)
        need = ((1.645 + 1.282) * sigma / math.log(1.1)) ** 2
        lines.append(f"A/A per-block log ratio of the {what} over {len(ratios)} blocks: median {med:+.4f}, robust sigma "
                     f"{sigma:.4f} ({100 * sigma:.1f}%), min {min(ratios):+.4f}, max {max(ratios):+.4f}; "
                     f"blocks for 90% power on a 10% slowdown (normal approximation): {math.ceil(need)}")
text = "\n".join(lines) + "\n"
(out / "summary.txt").write_text(text)
print(text, end="")
EOF
}

if [ "${1:-}" = --summarize ]; then summarize "$2"; exit; fi
rounds=${1:-30}
ts=$(realpath "${2:-build}/trainscope")
filter=${3:-^mlp\$}
out=results/gate-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
printf 'kind\tverdict\texit\tblocks\tseconds\texecution\n' > "$out/executions.tsv"
n=0
gate() {  # gate KIND [ab options...]
  local dir="$out/$((++n))-$1" rc=0
  "$ts" ab --base "$ts" --new "$ts" --suite gate --filter "$filter" --out "$dir" --format json ${GATE_ARGS:-} "${@:2}" \
    > "$dir.log" 2>&1 || rc=$?
  if [ ! -f "$dir/ab.json" ]; then echo "gate $n ($1) wrote no ab.json (exit $rc): $(head -1 "$dir.log")" >&2; exit 1; fi
  python3 -c 'import json,sys; a=json.load(open(sys.argv[1])); print("\t".join(map(str, [sys.argv[2], a["verdict"], sys.argv[3], a.get("blocks", a.get("blocks_started")), round(a.get("seconds", 0), 1), sys.argv[4]])))' \
    "$dir/ab.json" "$1" "$rc" "$dir" >> "$out/executions.tsv"
}
for r in $(seq 1 "$rounds"); do
  gate aa
  gate slow10 --new-set inject=slow:10
  gate aa
  if [ $((r % 4)) = 1 ]; then gate slow5 --new-set inject=slow:5; fi
  if [ $((r % 4)) = 3 ]; then gate slow25 --new-set inject=slow:25; fi
  echo "round $r/$rounds:"; summarize "$out" | sed 's/^/  /'
done
echo "measurement in $out"
