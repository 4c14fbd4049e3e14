#!/usr/bin/env bash
# The small-scale study on a CPU, then every figure, table and the report into reports/tiny/.
#
#   bash scripts/reproduce_tiny.sh                  # the whole study (~1.4 h on 2 cores; STEPS=150 for longer runs)
#   STEPS=20 SEEDS="0" OUT=/tmp/s REPORT=/tmp/r bash scripts/reproduce_tiny.sh   # a quick dry run
#
# Runs, one after another (2 cores hold one run at a time), each `python train.py` with its own
# run directory under $OUT, offline wandb logging and in-training validation (the tiny `eval=`
# schedule: mean@4 every 20 steps):
#   Sync, Async, PACE (effective, γ = 1)  × seeds $SEEDS
#   PACE (raw), PACE γ = 2 and 4, M2PO, Stale-k with k = 1, 2, 4, 8   × seed 0
# A run that already finished (summary.json says so) is skipped, so an interrupted study resumes
# where it stopped. Extra arguments are Hydra overrides for every run.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/tiny_study}
REPORT=${REPORT:-reports/tiny}
STEPS=${STEPS:-90}
SEEDS=${SEEDS:-"0 1 2"}
EXTRA=("$@")

runs=()
for seed in $SEEDS; do
  for m in sync async pace; do runs+=("${m}_s${seed} +exp=${m}_tiny seed=${seed}"); done
done
runs+=("pace_raw_s0 +exp=pace_raw_tiny seed=0")
for g in 2 4; do runs+=("pace_gamma${g}_s0 +exp=pace_tiny pace.gamma=${g} seed=0"); done
runs+=("m2po_s0 +exp=m2po_tiny seed=0")
for k in 1 2 4 8; do runs+=("stalek${k}_s0 +exp=stalek_tiny pool.max_lag=${k} seed=0"); done

finished() { [[ -f "$1/summary.json" ]] && grep -q '"status": "finished"' "$1/summary.json"; }

mkdir -p "$OUT/logs"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)  # the code the runs are made with
start=$(date +%s)
i=0
for spec in "${runs[@]}"; do
  i=$((i + 1))
  read -r name args <<<"$spec"
  dir="$OUT/$name"
  if finished "$dir"; then
    echo "[$i/${#runs[@]}] $name: finished before, skipped"
    continue
  fi
  rm -rf "$dir"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  python train.py $args trainer.steps="$STEPS" logger.mode=offline logger.progress=false \
    logger.group=tiny_study hydra.run.dir="$dir" "${EXTRA[@]}" >"$OUT/logs/$name.log" 2>&1 \
    || { echo "[$i/${#runs[@]}] $name FAILED: see $OUT/logs/$name.log"; tail -5 "$OUT/logs/$name.log"; exit 1; }
  echo "[$i/${#runs[@]}] $name: $(( $(date +%s) - t0 )) s"
done
elapsed=$(( $(date +%s) - start ))

mkdir -p "$REPORT"
cat >"$REPORT/setup.md" <<EOF
- Machine: $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | xargs || echo unknown)), no GPU.
- Code: commit ${commit} (runs; the report is built by the analysis at the same checkout); command: \`bash scripts/reproduce_tiny.sh ${EXTRA[*]:-}\` with STEPS=${STEPS}, SEEDS="${SEEDS}".
- Study wall time: $((elapsed / 60)) min $((elapsed % 60)) s for the runs not already finished (${#runs[@]} runs in all).
EOF
python -m analysis.build "$OUT" --out "$REPORT" --report --title "PACE at small scale: a CPU reproduction"
echo "study: ${elapsed} s; report: $REPORT/report.md"
