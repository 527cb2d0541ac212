#!/usr/bin/env bash
# On a GPU machine: probe every submission of benchmarks/sol087 against its definition, then soak them all under
# AdamW at the problem's shapes (hidden 4096, vocabulary 65,536), and compare with the README's expected verdicts.
#
#   OUT=/some/folder bash benchmarks/sol087/run_gpu.sh      (from anywhere inside the repository)
#
# Writes to $OUT (default results/sol087-<time>): probe.tsv (one row per submission: expected verdict, exit code,
# whether it matches, wall seconds, the probe's verdict line), probe-<name>.log and probe/<name>/probe.json,
# sol087-soak.yaml, soak.log, soak.csv, soak-table.txt (the printed table), soak-wall.txt, summary.txt, and
# gpu-memory.csv (the GPU's memory in use each second, from nvidia-smi, where it exists).
# Environment: PYTHON (default .venv/bin/python where it exists, else python), PROBE_TIMEOUT (seconds per probe,
# default 1800), SOAK_WORKERS (the cap on arms at once, default auto: as many as fit in the GPU's free memory),
# PROBES=0 to skip the probes, SOAK=0 to skip the soak, SOAK_FILE to soak that file instead of every submission. A failing or hung probe is recorded and the rest go on.
# Exit status: 0 when every probe gave its expected exit code, 1 otherwise (the soak's own code is in summary.txt).
set -u
set -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd) || exit 2
cd "$ROOT" || exit 2
HERE=benchmarks/sol087
DEF=$HERE/definition.json
OUT=${OUT:-results/sol087-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd) || exit 2
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
PROBE_TIMEOUT=${PROBE_TIMEOUT:-1800}
SOAK_WORKERS=${SOAK_WORKERS:-auto}
SOAK=${SOAK:-1}
PROBES=${PROBES:-1}

expected() {  # the expected verdict of submission $1: the last cell of its row in the README's table
  awk -F'|' -v name="\`$1\`" '
    { c = $2; gsub(/ /, "", c) }
    c == name { v = $(NF - 1); gsub(/ /, "", v); print v; exit }' "$HERE/README.md"
}

exit_for() {  # the probe's exit code for an expected verdict
  case "$1" in
    PASS) echo 0 ;;
    WRONG | OVERWRITTEN) echo 1 ;;
    *) echo "?" ;;
  esac
}

echo "sol087: $PYTHON, results in $OUT"
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>&1 | tee "$OUT/device.txt"

if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,memory.used,memory.total --format=csv,noheader -l 1 > "$OUT/gpu-memory.csv" &
  smi=$!
  trap 'kill $smi 2> /dev/null' EXIT
fi

# ------------------------------------------------------------------------------------------ (1) one probe each
printf 'submission\texpected\texit_code\tas_expected\twall_s\tverdict_line\n' > "$OUT/probe.tsv"
n=0
matched=0
for sol in $([ "$PROBES" != 0 ] && echo "$HERE"/*/solution.json); do
  name=$(basename "$(dirname "$sol")")
  exp=$(expected "$name")
  exp=${exp:-unknown}
  log="$OUT/probe-$name.log"
  echo "== probe $name (expected $exp)"
  t0=$(date +%s.%N)
  timeout --kill-after=30 "$PROBE_TIMEOUT" "$PYTHON" -m divergence.cli probe --candidate "$sol" \
    --definition "$DEF" --out "$OUT/probe/$name" > "$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  line=$(grep -E '^(PASS|FAIL|NEEDS-SHAPES)' "$log" | tail -n 1)
  [ -n "$line" ] || line=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1)
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then line="timed out after $PROBE_TIMEOUT s"; fi
  line=$(printf '%s' "$line" | tr '\t' ' ' | cut -c1-300)
  ok=no
  if [ "$rc" = "$(exit_for "$exp")" ]; then ok=yes; matched=$((matched + 1)); fi
  n=$((n + 1))
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$exp" "$rc" "$ok" "$wall" "$line" >> "$OUT/probe.tsv"
  echo "   exit $rc in $wall s, as expected: $ok -- $line"
done

# ------------------------------------------------------------------------------------------------- (2) the soak
soak_rc=skipped
soak_wall=-
if [ "$SOAK" != 0 ]; then
  yaml="$OUT/sol087-soak.yaml"
  cat > "$yaml" <<EOF
# Every submission of $HERE, one A/B each under AdamW, at the problem's shapes.
name: sol087
recipe: h200-shapes  # the GPU recipe for declared production shapes (2 layers, 200 steps)
definitions: $HERE  # the problem's definition.json, found by each solution's definition name
overrides:
  ab: {workers: $SOAK_WORKERS}  # the cap on arms at once on the GPU (shapes: each solution's definition)
optimizers: [adamw]
seeds: [0]
candidates:
  - {glob: "$HERE/*/solution.json"}
EOF
  run_soak() {  # $1: soak file, $2: its results folder; sets soak_rc and soak_wall
    local TIMEFORMAT='%R'
    { time "$PYTHON" -m divergence.cli soak "$1" --out "$2" --no-wandb 2>&1 | tee "$OUT/soak.log"; } \
      2> "$OUT/soak-wall.txt"
    soak_rc=$?
    soak_wall=$(tail -n 1 "$OUT/soak-wall.txt")
  }
  yaml=${SOAK_FILE:-$yaml}
  echo "== soak ($yaml)"
  run_soak "$yaml" "$OUT/soak"
  cp "$OUT/soak/soak.csv" "$OUT/soak.csv" 2>/dev/null
  awk '/^ *rank +name +kernel/ { p = 1 } p' "$OUT/soak.log" > "$OUT/soak-table.txt"
fi

# ----------------------------------------------------------------------------------------------------- summary
{
  echo
  echo "probes: $matched of $n as expected"
  column -t -s "$(printf '\t')" "$OUT/probe.tsv" 2>/dev/null || cat "$OUT/probe.tsv"
  echo
  echo "soak: exit $soak_rc, wall $soak_wall s"
  if [ -s "$OUT/soak.csv" ]; then
    "$PYTHON" - "$OUT/soak.csv" "$HERE/README.md" <<'EOF'
import csv
import re
import sys
from pathlib import Path

rows = list(csv.DictReader(open(sys.argv[1])))
want = {}
for line in Path(sys.argv[2]).read_text().splitlines():
    m = re.match(r"\|\s*`([^`]+)`\s*\|.*\|\s*([A-Z]+)\s*\|\s*$", line)
    if m:
        want[m.group(1)] = m.group(2)
ok = {"PASS": {"PASS"}, "WRONG": {"WRONG", "DIVERGED"}, "OVERWRITTEN": {"WRONG", "DIVERGED"}}
good = 0
for r in rows:
    name = Path(r["candidate"]).parent.name
    exp = want.get(name, "unknown")
    hit = r["verdict"] in ok.get(exp, set())
    good += hit
    print(f"  {name:<26} expected {exp:<12} soak {r['verdict']:<12} {r['case']:<17} exit {r['exit_code']}"
          f"  {'as expected' if hit else 'NOT as expected'}")
print(f"soak: {good} of {len(rows)} as expected")
EOF
  elif [ "$soak_rc" != skipped ]; then
    echo "soak: no soak.csv (see $OUT/soak.log)"
    tail -n 5 "$OUT/soak.log"
  fi
} | tee "$OUT/summary.txt"

[ "$PROBES" = 0 ] || { [ "$n" -gt 0 ] && [ "$matched" = "$n" ]; }
