#!/usr/bin/env bash
# The small-scale study on a CPU, then every figure, table and the report into reports/tiny/.
#
#   bash scripts/reproduce_tiny.sh                  # the whole study: 12 methods × 5 seeds, 100 steps (~4 h on 2 cores)
#   STEPS=20 SEEDS="0" OUT=/tmp/s REPORT=/tmp/r bash scripts/reproduce_tiny.sh   # a quick dry run
#   ONLY="sync async" bash scripts/reproduce_tiny.sh   # some methods only (the report is built from every finished run)
#
# Runs, one after another (2 cores hold one run at a time), each `python train.py` with its own
# run directory under $OUT, offline wandb logging and in-training validation (the tiny `eval=`
# schedule: mean@4 every 20 steps), for every seed in $SEEDS (seed by seed, so that a study
# stopped part-way has whole seeds):
#   Sync, Async, PACE (effective, γ = 1), PACE (raw), PACE (gen), PACE γ = 2 and 4, M2PO,
#   Stale-k with k = 1, 2, 4, 8
# and, only when $ONLY names them, Async and PACE with rollout.kv_on_update=recompute (async_recompute,
# pace_recompute: the KV study, scripts/kv_study.sh).
# A run that already finished (summary.json says so) is skipped, so an interrupted study resumes
# where it stopped. Extra arguments are Hydra overrides for every run.
#
# $OUT/runs.tsv gets one line per run made: when, at which commit, its wall time, and the CPU time
# the rest of the machine used meanwhile (/proc/stat minus the run's own): a run during which other
# work took more than 0.15 of a core is marked not comparable. setup.md lists them.
#
# Each finished run's records (metrics.jsonl, summary.json, its Hydra config, the per-group Parquet:
# what analysis/ reads, ~0.6 MB) are copied to $RECORDS (default $REPORT/runs, kept in git), with
# runs.tsv; a run found there and not in $OUT is copied back first, so a study carried on on a fresh
# machine skips what is already done, and `python -m analysis.build reports/tiny/runs` rebuilds the
# report from the repository alone.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/tiny_study}
REPORT=${REPORT:-reports/tiny}
STEPS=${STEPS:-100}
SEEDS=${SEEDS:-"0 1 2 3 4"}  # 5: what the methods claims need at the spread 3 seeds showed (reports/tiny)
ONLY=${ONLY:-}
TITLE=${TITLE:-"PACE at small scale: a CPU reproduction"}
RECORDS=${RECORDS:-$REPORT/runs}
EXTRA=("$@")

declare -A METHOD=(
  [sync]="+exp=sync_tiny" [async]="+exp=async_tiny" [pace]="+exp=pace_tiny" [pace_raw]="+exp=pace_raw_tiny"
  [pace_gen]="+exp=pace_gen_tiny" [pace_gamma2]="+exp=pace_tiny pace.gamma=2" [pace_gamma4]="+exp=pace_tiny pace.gamma=4"
  [m2po]="+exp=m2po_tiny" [stalek1]="+exp=stalek_tiny pool.max_lag=1" [stalek2]="+exp=stalek_tiny pool.max_lag=2"
  [stalek4]="+exp=stalek_tiny pool.max_lag=4" [stalek8]="+exp=stalek_tiny pool.max_lag=8"
  [async_recompute]="+exp=async_tiny rollout.kv_on_update=recompute"
  [pace_recompute]="+exp=pace_tiny rollout.kv_on_update=recompute"
)
ORDER=(sync async pace pace_raw pace_gen pace_gamma2 pace_gamma4 m2po stalek1 stalek2 stalek4 stalek8)
[[ -z "$ONLY" ]] || ORDER+=(async_recompute pace_recompute)  # not in the default study: named in $ONLY
for m in $ONLY; do [[ -n "${METHOD[$m]:-}" ]] || { echo "error: ONLY: no method '$m' (${!METHOD[*]})" >&2; exit 2; }; done
runs=()
for seed in $SEEDS; do
  for m in "${ORDER[@]}"; do
    [[ -z "$ONLY" || " $ONLY " == *" $m "* ]] && runs+=("${m}_s${seed} ${METHOD[$m]} seed=${seed}")
  done
done

finished() { [[ -f "$1/summary.json" ]] && grep -q '"status": "finished"' "$1/summary.json"; }
busy_jiffies() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9; exit}' /proc/stat; }  # all cores, 1/100 s

keep_records() {  # run dir → its records under $RECORDS
  local src=$1 dst=$RECORDS/$(basename "$1")
  rm -rf "$dst" && mkdir -p "$dst/.hydra" "$dst/groups"
  cp "$src/metrics.jsonl" "$src/summary.json" "$dst/"
  cp "$src"/.hydra/{config,overrides}.yaml "$dst/.hydra/"
  cp "$src"/groups/*.parquet "$dst/groups/" 2>/dev/null || true
}

mkdir -p "$OUT/logs" "$RECORDS"
for rec in "$RECORDS"/*/; do  # runs of this study made on another machine (or before $OUT was removed)
  name=$(basename "$rec")
  if finished "$rec" && ! finished "$OUT/$name"; then rm -rf "${OUT:?}/$name" && cp -r "$rec" "$OUT/$name"; fi
done
[[ -f "$OUT/runs.tsv" || ! -f "$RECORDS/runs.tsv" ]] || cp "$RECORDS/runs.tsv" "$OUT/runs.tsv"
[[ -f "$OUT/runs.tsv" ]] || printf "run\tstarted (UTC)\tcommit\twall_s\trun_cpu_s\tother_cpu_s\tcomparable\n" >"$OUT/runs.tsv"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)  # the code the runs are made with
git diff --quiet HEAD -- . ':(exclude)reports' 2>/dev/null || commit="${commit}+dirty"  # code, not this script's own reports
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
  t0=$(date +%s.%N) j0=$(busy_jiffies) when=$(date -u +%FT%TZ)
  # shellcheck disable=SC2086
  /usr/bin/time -f "%U %S" -o "$OUT/logs/$name.cpu" python train.py $args trainer.steps="$STEPS" logger.mode=offline \
    logger.progress=false logger.group=tiny_study hydra.run.dir="$dir" "${EXTRA[@]}" >"$OUT/logs/$name.log" 2>&1 \
    || { echo "[$i/${#runs[@]}] $name FAILED: see $OUT/logs/$name.log"; tail -5 "$OUT/logs/$name.log"; exit 1; }
  read -r wall other own <<<"$(awk -v t0="$t0" -v t1="$(date +%s.%N)" -v j0="$j0" -v j1="$(busy_jiffies)" \
    '{own = $1 + $2; printf "%.1f %.1f %.1f", t1 - t0, (j1 - j0) / 100 - own, own}' "$OUT/logs/$name.cpu")"
  ok=$(awk -v o="$other" -v w="$wall" 'BEGIN {print (o / w <= 0.15) ? "yes" : "no"}')
  printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\n" "$name" "$when" "$commit" "$wall" "$own" "$other" "$ok" >>"$OUT/runs.tsv"
  keep_records "$dir" && cp "$OUT/runs.tsv" "$RECORDS/runs.tsv"
  echo "[$i/${#runs[@]}] $name: ${wall} s (other work on the machine: ${other} CPU s; comparable: $ok)"
done
elapsed=$(( $(date +%s) - start ))

mkdir -p "$REPORT"
rules=$(git log -1 --format="%h (%cs)" -- analysis/claims.py 2>/dev/null || echo unknown)
built=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)  # the analysis that builds the report (runs: their own column)
git diff --quiet HEAD -- analysis 2>/dev/null || built="${built}+dirty"
{
  echo "- Machine: $(nproc) CPU cores ($(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | xargs || echo unknown)), no GPU."
  echo "- Command: \`bash scripts/reproduce_tiny.sh ${EXTRA[*]:-}\` with STEPS=${STEPS}, SEEDS=\"${SEEDS}\"${ONLY:+, ONLY=\"${ONLY}\"} (each run's commit is in the table below); the report built by analysis/ at commit ${built}."
  echo "- Claim rules: analysis/claims.py as last changed in commit ${rules}, before the runs below."
  echo "- This invocation: $((elapsed / 60)) min $((elapsed % 60)) s for the runs not already finished (${#runs[@]} runs asked for);" \
    "all runs made so far: $(awk -F'\t' 'NR > 1 {n++; w += $4} END {printf "%d, %.0f min of wall time", n, w / 60}' "$OUT/runs.tsv")."
  echo "- Every run made, in order (wall time with the machine otherwise idle unless \"comparable\" says no):"
  echo
  awk -F'\t' 'NR == 1 {print "| " $1 " | " $2 " | " $3 " | wall (s) | other work (CPU s) | comparable |"; print "| --- | --- | --- | --- | --- | --- |"; next}
              {print "| " $1 " | " $2 " | " $3 " | " $4 " | " $6 " | " $7 " |"}' "$OUT/runs.tsv"
} >"$REPORT/setup.md"
prev=()  # the numbers of the study this one replaces, if kept: the report says how each verdict moved
[[ -f "$RECORDS/previous_numbers.json" ]] && prev=(--previous "$RECORDS/previous_numbers.json")
python -m analysis.build "$OUT" --out "$REPORT" --report --title "$TITLE" "${prev[@]}"
echo "study: ${elapsed} s; report: $REPORT/report.md"
