#!/usr/bin/env bash
# A run on plain hosts (ssh between them): rollout servers on ROLLOUT_HOSTS, the trainer here.
#
#   ROLLOUT_HOSTS="node1 node2" bash scripts/launch_hosts.sh +exp=async_qwen3_8b [overrides ...]
#
# Order of start-up: (1) on every rollout host one server per GPU group, ports BASE_PORT,
# BASE_PORT+1, ... (ENGINES_PER_HOST of them, TP GPUs each); (2) wait until every /health answers;
# (3) the trainer on this host: `accelerate launch` of train.py with rollout.engine_process=server and
# rollout.servers=[every http://host:port]. The servers reach trainer rank 0 for the weight broadcast
# at this host's address (rollout.transfer_address, found from the route to the first server; set
# TRANSFER_ADDRESS to choose it) on a free port. Needs: this repository at the same path on every
# host (REPO), its environment set up there, the model path readable there.
# The run directory is trainer rank 0's (runs/<exp_name>/<time> by its clock, or hydra.run.dir=...):
# every rank writes there (pace/rundir.py).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="${REPO:-$PWD}"
BASE_PORT="${BASE_PORT:-8100}"
ENGINES_PER_HOST="${ENGINES_PER_HOST:-1}"
TP="${TP:-1}"
ACCELERATE_CONFIG="${ACCELERATE_CONFIG:-conf/accelerate/fsdp.yaml}"
: "${ROLLOUT_HOSTS:?set ROLLOUT_HOSTS to the rollout hosts, e.g. \"node1 node2\"}"
servers=()
engine=0
for host in $ROLLOUT_HOSTS; do
  for ((i = 0; i < ENGINES_PER_HOST; i++)); do
    port=$((BASE_PORT + i))
    gpus=$(seq -s, $((i * TP)) $((i * TP + TP - 1)))
    ssh "$host" "cd '$REPO' && CUDA_VISIBLE_DEVICES=$gpus nohup bash scripts/launch_rollout_server.sh $port $engine $* \
      rollout.tensor_parallel_size=$TP > rollout-server-$port.log 2>&1 &"
    servers+=("http://$host:$port")
    engine=$((engine + 1))
  done
done
for url in "${servers[@]}"; do
  echo "waiting for $url/health"
  until curl -sf "$url/health" > /dev/null; do sleep 5; done
done
list=$(IFS=,; echo "${servers[*]}")
extra=()
[[ -n "${TRANSFER_ADDRESS:-}" ]] && extra+=("rollout.transfer_address=$TRANSFER_ADDRESS")
exec accelerate launch --config_file "$ACCELERATE_CONFIG" train.py "$@" rollout.engine_process=server \
  "rollout.servers=[$list]" "rollout.engines=${#servers[@]}" rollout.tensor_parallel_size="$TP" "${extra[@]}"
