#!/usr/bin/env bash
# One rollout server (a vLLM HTTP server with the RL routes) for a run on another host, in the
# foreground: the same flags `train.py` gives the servers it starts itself (pace/rollout/server.py).
#
#   bash scripts/launch_rollout_server.sh PORT [ENGINE] [hydra overrides of the run ...]
#   bash scripts/launch_rollout_server.sh 8100 0 +exp=async_qwen3_8b      # GPU: CUDA_VISIBLE_DEVICES picks its GPUs
#
# ENGINE (default 0) sets its seed (seed + ENGINE). Give it the run's overrides, so that its model,
# dtype, lengths and weight transfer are the run's. Ready when `curl http://HOST:PORT/health` answers.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${1:?usage: launch_rollout_server.sh PORT [ENGINE] [overrides ...]}"; shift
engine=0
if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then engine="$1"; shift; fi
exec python -m pace.rollout.server --host "${HOST:-0.0.0.0}" --port "$port" --engine "$engine" "$@"
