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
#   scripts/measure-gate.sh --simulate DIR              # other designs replayed on its A/A processes
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

# What other designs (processes per side, blocks) would have decided on this machine: blocks rebuilt
# from the measured A/A processes (2k consecutive slots of one execution, so that a block keeps the
# machine's state of those seconds; sides alternate), a slowdown added to the new side's steps, and
# ab's decision rule replayed (exact signed-rank test, Hodges-Lehmann effect and bound, alpha split over
# the looks, one cell). A prediction from this measurement's noise, not a measurement of the design.
simulate() {
  python3 - "$1" <<'EOF'
import json, math, random, statistics, sys
from functools import lru_cache
from pathlib import Path
out = Path(sys.argv[1])
rows = [l.split("\t") for l in (out / "executions.tsv").read_text().splitlines()[1:] if l.strip()]
executions = []
for kind, _, _, _, _, execution in rows:
    if kind != "aa":
        continue
    steps = []
    for slot in sorted((Path(execution) / "slots").iterdir(), key=lambda p: int(p.name.split("-")[0])):
        try:
            steps.append(json.loads((slot / "report.json").read_text())["cells"][0]["metrics"]["timing"]["step_time_s"]["min"])
        except (OSError, KeyError, IndexError, ValueError):
            pass
    if len(steps) >= 8:
        executions.append([math.log(x) for x in steps])
if not executions:
    sys.exit("no A/A execution with slots to replay in " + str(out))

@lru_cache(None)
def counts(n):  # the null distribution of W+ over ranks 1..n, as counts
    c = [1] + [0] * (n * (n + 1) // 2)
    for i in range(1, n + 1):
        for s in range(len(c) - 1, i - 1, -1):
            c[s] += c[s - i]
    return c

def tail(n, w):  # P(W+ >= w)
    return sum(counts(n)[max(w, 0):]) / 2 ** n

def decide(x, alpha_look, min_effect):
    n = len(x)
    order = sorted(range(n), key=lambda i: abs(x[i]))
    p = tail(n, sum(r + 1 for r, i in enumerate(order) if x[i] > 0))
    walsh = sorted((x[i] + x[j]) / 2 for i in range(n) for j in range(i, n))
    m = len(walsh)
    effect = math.exp((walsh[m // 2] + walsh[(m - 1) // 2]) / 2) - 1
    c = 0
    while c < m and tail(n, m - c) <= alpha_look:
        c += 1
    upper = math.exp(walsh[m - c]) - 1 if c else math.inf
    if effect > min_effect and p <= alpha_look:
        return "regression"
    return "pass" if upper < 2 * min_effect else "inconclusive"

def design(blocks, max_blocks, alpha=0.05):  # ab's first decision and looks for one cell
    looks, start = 1, blocks
    for _ in range(8):
        need = math.ceil(math.log2(looks / alpha))
        start = max(blocks, need + need % 2)
        nxt = 1 + (max(max_blocks, start) - start + 1) // 2
        if nxt <= looks:
            break
        looks = nxt
    return start, max(max_blocks, start), alpha / looks

rng = random.Random(0)
def gate(k, blocks, max_blocks, shift):
    start, top, alpha_look = design(blocks, max_blocks)
    ex = rng.choice([e for e in executions if len(e) >= 2 * k])
    def block():
        i = rng.randrange(0, len(ex) - 2 * k + 1)
        w = ex[i:i + 2 * k]
        return min(w[1::2]) + shift - min(w[0::2])
    x = [block() for _ in range(start)]
    while True:
        v = decide(x, alpha_look, 0.05)
        if v != "inconclusive" or len(x) >= top:
            return v, len(x)
        x += [block(), block()]

draws = 2000
print(f"replayed on {len(executions)} A/A executions ({sum(map(len, executions))} processes), {draws} gates per design and kind")
print("per side  blocks  slots (mean)  A/A regression  A/A inconclusive  slow:10 regression  slow:10 inconclusive")
for k, blocks, max_blocks in ((1, 6, 10), (2, 6, 10), (2, 8, 16), (3, 6, 10), (3, 8, 14), (4, 6, 10)):
    res = {}
    for kind, shift in (("aa", 0.0), ("slow10", math.log(1.1))):
        r = [gate(k, blocks, max_blocks, shift) for _ in range(draws)]
        res[kind] = ({v: sum(x[0] == v for x in r) / draws for v in ("regression", "inconclusive")}, statistics.mean(x[1] for x in r))
    slots = 2 * k * (res["aa"][1] + res["slow10"][1]) / 2
    print(f"{k:8d}  {blocks:2d}..{max_blocks:<2d}  {slots:12.0f}  {100 * res['aa'][0]['regression']:13.1f}%  "
          f"{100 * res['aa'][0]['inconclusive']:15.1f}%  {100 * res['slow10'][0]['regression']:17.1f}%  "
          f"{100 * res['slow10'][0]['inconclusive']:19.1f}%")
EOF
}

if [ "${1:-}" = --summarize ]; then summarize "$2"; exit; fi
if [ "${1:-}" = --simulate ]; then simulate "$2"; exit; fi
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
