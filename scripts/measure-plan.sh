#!/usr/bin/env bash
# The planner against every ok training cell of the built-in suites on this machine (docs/plan.md,
# "How close it is"): runs the hardware cells the planner calibrates from, then the suites quick,
# precision, checkpointing, llama and pitfalls on 2 local ranks and parallel on 4, then
# `plan --check` on each, and prints the error distribution per quantity over all of them.
#
#   scripts/measure-plan.sh [OUT]     (default results/measure-plan-<UTC time>; about 6 minutes on 2 cores)
#
#   TRAINSCOPE  the binary (default build/trainscope)
set -euo pipefail
cd "$(dirname "$0")/.."
ts=$(realpath "${TRAINSCOPE:-build/trainscope}")
out=$(realpath -m "${1:-results/measure-plan-$(date -u +%Y%m%dT%H%M%SZ)}")
[ -x "$ts" ] || { echo "measure-plan: no trainscope binary at $ts (make build, or TRAINSCOPE=...)" >&2; exit 2; }
mkdir -p "$out"
echo "measure-plan: $out"
"$ts" run --suite hardware --filter 'gemm-peak|memory-bandwidth|copy-bandwidth|collectives|calibration' --nproc 4 --out "$out/hardware" \
  > "$out/hardware.log" 2>&1 ||
  { tail -n 5 "$out/hardware.log"; echo "measure-plan: the hardware cells failed" >&2; exit 1; }
for suite in quick precision checkpointing llama pitfalls parallel; do
  nproc=2
  [ "$suite" = parallel ] && nproc=4
  start=$(date +%s)
  # A suite whose expected failures (pitfalls, stress cells) end the run non-zero still has its ok cells.
  "$ts" run --suite "$suite" --nproc "$nproc" --out "$out/$suite" > "$out/$suite.log" 2>&1 || true
  [ -f "$out/$suite/report.json" ] || { tail -n 5 "$out/$suite.log"; echo "measure-plan: no report from $suite" >&2; exit 1; }
  "$ts" plan --check "$out/$suite" --hardware "$out/hardware" --format json > "$out/$suite.plan.json"
  echo "$suite: $(( $(date +%s) - start )) s"
done
/usr/bin/python3 - "$out" <<'EOF'
import json, statistics, sys, glob
out = sys.argv[1]
errors = {"model state": [], "peak memory (MLP, GPT, Llama)": [], "peak memory (CNN)": [], "step time (>= 10 ms)": [],
          "communication per step": []}
worst = {k: ("", 0.0) for k in errors}
for path in sorted(glob.glob(f"{out}/*.plan.json")):
    suite = path.split("/")[-1].split(".")[0]
    for c in json.load(open(path))["cells"]:
        if "skipped" in c:
            continue
        name = f"{suite}/{c['cell']}"
        cnn = "cnn" in c["cell"] or "resnet" in c["cell"]
        for key, field in (("model state", "model_state_error"),
                           ("peak memory (CNN)" if cnn else "peak memory (MLP, GPT, Llama)", "peak_error"),
                           ("step time (>= 10 ms)", "step_error"), ("communication per step", "comm_error")):
            if field in c:
                e = abs(c[field])
                errors[key].append(e)
                if e >= worst[key][1]:
                    worst[key] = (name, e)
print(f"{'quantity':32} {'cells':>5} {'median':>8} {'worst':>8}  worst cell")
for key, v in errors.items():
    if v:
        print(f"{key:32} {len(v):5d} {statistics.median(v) * 100:7.2f}% {max(v) * 100:7.2f}%  {worst[key][0]}")
EOF
