#!/usr/bin/env bash
# A Hydra multirun sweep of the simulator and its trade-off figure: PACE's target pool n*
# × the number of rollout engines, and Async at the same engine counts, on the 8B scenario where the
# paper's Figure 8 lands (conf/sim/qwen3_8b_fig8.yaml) → reports/sim/sweep/tradeoff.{md,png,json}.
#
#   bash scripts/sim_sweep.sh                 # ~15 s on one core
#   STEPS=200 OUT=/tmp/sweep bash scripts/sim_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs/sim_sweep}
OUT=${OUT:-reports/sim/sweep}
STEPS=${STEPS:-60}
SCENARIO=${SCENARIO:-qwen3_8b_fig8}

rm -rf "$RUNS"  # run directories are appended to: start clean
common=("+sim=$SCENARIO" "trainer.steps=$STEPS" eval.every=0 logger.progress=false)
python simulate.py -m +exp=pace_qwen3_8b "${common[@]}" pace.target_pool=32,64,128 rollout.engines=4,8,12 \
  hydra.sweep.dir="$RUNS/pace" 2> >(grep -v "^\[" >&2)
python simulate.py -m +exp=async_qwen3_8b "${common[@]}" rollout.engines=4,8,12 hydra.sweep.dir="$RUNS/async" \
  2> >(grep -v "^\[" >&2)
python -m analysis.tradeoff "$RUNS" --out "$OUT"
echo "trade-off: $OUT/tradeoff.md"
