#!/usr/bin/env bash
# Measures `trainscope compare` as a gate on this machine: the false-alarm rate of A/A pairs (the same
# build twice) and the detection rate of injected slowdowns (inject = slow:<pct>), with the gate suite
# of tests/data/compare/gate.toml (5 repetitions per cell).
#
#   scripts/measure-gate.sh [PAIRS] [BUILD]     # default 10 pairs, build folder "build"
# Writes runs and a summary under results/gate-<UTC time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-10}
ts=${2:-build}/trainscope
suite=tests/data/compare/gate.toml
out=results/gate-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
run() { "$ts" run --suite "$suite" --out "$out/$1" "${@:2}" > "$out/$1.log" 2>&1; }
# compare BASE NEW: prints "regression" when compare exits 1, "clean" when 0, and stops on anything else.
judge() {
  local rc=0
  "$ts" compare "$out/$1" "$out/$2" --no-color > "$out/$1-vs-$2.txt" 2>&1 || rc=$?
  case $rc in 0) echo clean ;; 1) echo regression ;; *) echo "compare failed: $(cat "$out/$1-vs-$2.txt")" >&2; exit 1 ;; esac
}
false_alarms=0 detected10=0 detected25=0
for i in $(seq 1 "$pairs"); do
  # Interleaved, so that a drift of the machine during the measurement hits every kind alike.
  run "a$i"
  run "b$i"
  run "s10-$i" --set inject=slow:10
  run "s25-$i" --set inject=slow:25
  [ "$(judge "a$i" "b$i")" = regression ] && false_alarms=$((false_alarms + 1))
  [ "$(judge "a$i" "s10-$i")" = regression ] && detected10=$((detected10 + 1))
  [ "$(judge "a$i" "s25-$i")" = regression ] && detected25=$((detected25 + 1))
  echo "pair $i: false alarms $false_alarms, slow:10 caught $detected10, slow:25 caught $detected25"
done | tee "$out/summary.txt"
