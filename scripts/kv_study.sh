#!/usr/bin/env bash
# The KV-cache study on a CPU: claim (i) (the KV cache kept across a weight update, the default, vs
# recomputed at each update) and claim (e) (PACE peaks earlier in wall time than Sync and Async),
# decided by the rules in analysis/claims.py committed before its runs; its report in reports/tiny_kv/.
#
#   bash scripts/kv_study.sh                              # seeds 0-4: 5 methods x 5 seeds, 100 steps (~2 h on 2 cores)
#   STEPS=6 SEEDS=0 OUT=/tmp/kvs REPORT=/tmp/kvr bash scripts/kv_study.sh   # a quick dry run
#   ONLY="sync async pace" SEEDS="5 6 7" bash scripts/kv_study.sh          # more seeds for (e) (below)
#
# It is scripts/reproduce_tiny.sh with
#   ONLY="sync async pace async_recompute pace_recompute"   (seed by seed in that order, so that a
#                  study stopped part-way has whole seeds; async_recompute / pace_recompute are
#                  +exp=async_tiny / pace_tiny with rollout.kv_on_update=recompute)
#   eval.every=10  (validation every 10 steps, not 20: a run's time to its peak takes one of 11
#                  values, not 6; (e)'s rule is unchanged, the report says the interval used)
#   rollout.kv_probe=0.25  (a quarter of the responses an update landed in while they generated are
#                  rescored on the engine right after they finish: (i)'s stale-context error,
#                  mismatch/kv_abs_logp_diff; a quarter keeps the probe's engine time, which Sync runs
#                  do not pay, small in (e)'s wall times)
#   OUT=runs/kv_study, REPORT=reports/tiny_kv (the records kept in reports/tiny_kv/runs), and
#   logger.group=kv_study; extra arguments are more Hydra overrides for every run. Like
#   reproduce_tiny.sh it skips finished runs, so it resumes where it stopped and takes more seeds.
#
# Seeds: 0-4 first. Claim (e) was inconclusive on the first study's 5 seeds (validation every 20
# steps); at that spread it needed about 8 seeds against Sync and about 6 against Async (reports/tiny).
# If the report still says (e), or (i), is inconclusive, it says how many seeds the spread observed
# would need: add them with SEEDS (e.g. SEEDS="5 6 7"; ONLY="sync async pace" for (e) alone), and
# the report is rebuilt from every finished run. Add whole seeds, and make every run with nothing
# else on the machine (runs.tsv marks one that was not; (e) and (i)'s cost leave it out).
set -euo pipefail
cd "$(dirname "$0")/.."

OVERRIDES=(eval.every=10 rollout.kv_probe=0.25 logger.group=kv_study "$@")
# the KV probe and kv_on_update must be config keys at this commit: fail here, not in the first run
python train.py +exp=pace_tiny rollout.kv_on_update=recompute "${OVERRIDES[@]}" --cfg job >/dev/null 2>&1 ||
  { echo "error: the study's overrides do not compose (rollout.kv_probe, rollout.kv_on_update on this commit?):" \
      "python train.py +exp=pace_tiny rollout.kv_on_update=recompute ${OVERRIDES[*]} --cfg job" >&2; exit 2; }
export ONLY=${ONLY:-"sync async pace async_recompute pace_recompute"}
export OUT=${OUT:-runs/kv_study} REPORT=${REPORT:-reports/tiny_kv}
export TITLE=${TITLE:-"The KV cache at a weight update: kept or recomputed (CPU lab)"}
exec bash scripts/reproduce_tiny.sh "${OVERRIDES[@]}"
