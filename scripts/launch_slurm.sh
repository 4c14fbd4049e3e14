#!/usr/bin/env bash
# A run in a Slurm allocation: the first node trains, every other node serves rollouts.
#
#   sbatch --nodes=3 --gpus-per-node=8 scripts/launch_slurm.sh +exp=async_qwen3_8b [overrides ...]
#
# Each rollout node runs ENGINES_PER_NODE servers (default 8 / TP) on ports BASE_PORT...; the
# trainer waits for every /health, then starts on the first node with the servers' URLs
# (rollout.engine_process=server). The servers reach trainer rank 0 for the weight broadcast at the
# first node's address. The trainer node's GPUs train (conf/accelerate/fsdp.yaml: NUM_PROCESSES).
# The run directory is trainer rank 0's (runs/<exp_name>/<time> by its clock, or hydra.run.dir=...):
# every rank writes there (pace/rundir.py).
#SBATCH --job-name=pace
#SBATCH --ntasks-per-node=1
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
BASE_PORT="${BASE_PORT:-8100}"
TP="${TP:-1}"
GPUS_PER_NODE="${SLURM_GPUS_ON_NODE:-8}"
ENGINES_PER_NODE="${ENGINES_PER_NODE:-$((GPUS_PER_NODE / TP))}"
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
trainer="${nodes[0]}"
rollout=("${nodes[@]:1}")
[[ ${#rollout[@]} -gt 0 ]] || { echo "launch_slurm.sh: needs at least 2 nodes (1 trainer + rollout nodes)" >&2; exit 2; }
servers=()
engine=0
for node in "${rollout[@]}"; do
  for ((i = 0; i < ENGINES_PER_NODE; i++)); do
    port=$((BASE_PORT + i))
    gpus=$(seq -s, $((i * TP)) $((i * TP + TP - 1)))
    srun --nodes=1 --ntasks=1 -w "$node" --overlap bash -c \
      "CUDA_VISIBLE_DEVICES=$gpus exec bash scripts/launch_rollout_server.sh $port $engine $* rollout.tensor_parallel_size=$TP" \
      > "rollout-server-$node-$port.log" 2>&1 &
    servers+=("http://$node:$port")
    engine=$((engine + 1))
  done
done
for url in "${servers[@]}"; do
  until curl -sf "$url/health" > /dev/null; do sleep 5; done
done
list=$(IFS=,; echo "${servers[*]}")
address=$(srun --nodes=1 --ntasks=1 -w "$trainer" --overlap hostname -I | awk '{print $1}')
srun --nodes=1 --ntasks=1 -w "$trainer" --overlap \
  accelerate launch --config_file "${ACCELERATE_CONFIG:-conf/accelerate/fsdp.yaml}" train.py "$@" \
  rollout.engine_process=server "rollout.servers=[$list]" "rollout.engines=${#servers[@]}" \
  rollout.tensor_parallel_size="$TP" "rollout.transfer_address=$address"
