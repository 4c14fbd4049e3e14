#!/usr/bin/env bash
# The simulator (pace/sim) against real runs of the CPU study: fit a scenario on one run, simulate
# it and runs it was not fitted on with their own settings, compare (reports/sim/calibration.*).
#
#   bash scripts/calibrate_sim.sh                    # needs runs/tiny_study (scripts/reproduce_tiny.sh)
#   FIT="async_s0 sync_s0" HELD="pace_s0 stalek4_s0" bash scripts/calibrate_sim.sh   # fit on two runs at once
#
# The fitted scenario is written to conf/sim/tiny_cpu.yaml (`+sim=tiny_cpu`). Each simulation takes
# the real run's own overrides (.hydra/overrides.yaml: its +exp preset, seed, steps), so a pair
# differs only in what the simulator models.
set -euo pipefail
cd "$(dirname "$0")/.."

REAL=${REAL:-runs/tiny_study}
OUT=${OUT:-runs/sim_calib}
REPORT=${REPORT:-reports/sim}
FIT=${FIT:-async_s0}
HELD=${HELD:-"sync_s0 pace_s0 stalek4_s0 async_s1"}
SCENARIO=${SCENARIO:-tiny_cpu}

fit_dirs=()
for name in $FIT; do fit_dirs+=("$REAL/$name"); done
python -m pace.sim.fit "${fit_dirs[@]}" --name "$SCENARIO" --out "conf/sim/$SCENARIO.yaml"
pairs=()
for name in $FIT $HELD; do
  [[ -f "$REAL/$name/summary.json" ]] || { echo "$REAL/$name: no finished run, skipped"; continue; }
  mapfile -t overrides < <(python -c "import sys, yaml; print('\n'.join(o for o in yaml.safe_load(open(sys.argv[1])) \
    if not o.startswith(('logger.', 'hydra.'))))" "$REAL/$name/.hydra/overrides.yaml")
  rm -rf "$OUT/$name"  # a run directory is appended to (metrics.jsonl): start clean
  python simulate.py "${overrides[@]}" "+sim=$SCENARIO" logger.progress=false hydra.run.dir="$OUT/$name"
  kind=$([[ " $FIT " == *" $name "* ]] && echo fitted || echo held-out)
  pairs+=(--pair "$REAL/$name" "$OUT/$name" "$kind")
done
python -m analysis.calibration "${pairs[@]}" --out "$REPORT"
echo "report: $REPORT/calibration.md"
