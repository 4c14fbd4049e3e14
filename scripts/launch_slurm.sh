#!/usr/bin/env bash
# A run in a Slurm allocation: the first node trains, every other node serves rollouts.
#
#   sbatch --nodes=3 --gpus-per-node=8 scripts/launch_slurm.sh +exp=async_qwen3_8b [overrides ...]
#
# Each rollout node runs ENGINES_PER_NODE servers (default 8 / TP) on ports BASE_PORT...; the
# trainer waits for every /health (at most SERVER_START_TIMEOUT_S, 900 s as
# rollout.server_start_timeout_s, from their start; a server that does not answer by then, or whose
# srun step ended, fails the job in one line naming it and its log), then starts on the first node
# with the servers' URLs (rollout.engine_process=server). The servers reach trainer rank 0 for the
# weight broadcast at the first node's address on the route to the first rollout node (set
# TRANSFER_ADDRESS to choose it). The trainer node's GPUs train (conf/accelerate/fsdp.yaml: NUM_PROCESSES).
# The run directory is trainer rank 0's (runs/<exp_name>/<time> by its clock, or hydra.run.dir=...):
# every rank writes there (pace/rundir.py).
#SBATCH --job-name=pace
#SBATCH --ntasks-per-node=1
set -euo pipefail

# Until server $1 answers /health (asked every HEALTH_POLL_S, 5 s); fails in one line naming it and $4
# (where its log is) once $SECONDS reaches $2, or at once when process $3 (its srun step) has ended.
wait_healthy() {
  local url="$1" deadline="$2" pid="$3" log="$4"
  until curl -sf --noproxy '*' --max-time 10 "$url/health" > /dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "launch_slurm.sh: rollout server $url exited before answering /health ($log)" >&2; return 1
    fi
    if (( SECONDS >= deadline )); then
      echo "launch_slurm.sh: rollout server $url did not answer /health within ${SERVER_START_TIMEOUT_S:-900} s" \
        "(SERVER_START_TIMEOUT_S; $log)" >&2; return 1
    fi
    sleep "${HEALTH_POLL_S:-5}"
  done
}

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
BASE_PORT="${BASE_PORT:-8100}"
TP="${TP:-1}"
GPUS_PER_NODE="${SLURM_GPUS_ON_NODE:-8}"
ENGINES_PER_NODE="${ENGINES_PER_NODE:-$((GPUS_PER_NODE / TP))}"
servers=()
pids=()  # each server's srun step
logs=()
engine=0
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
trainer="${nodes[0]}"
rollout=("${nodes[@]:1}")
[[ ${#rollout[@]} -gt 0 ]] || { echo "launch_slurm.sh: needs at least 2 nodes (1 trainer + rollout nodes)" >&2; exit 2; }
deadline=$((SECONDS + ${SERVER_START_TIMEOUT_S:-900}))
for node in "${rollout[@]}"; do
  for ((i = 0; i < ENGINES_PER_NODE; i++)); do
    port=$((BASE_PORT + i))
    gpus=$(seq -s, $((i * TP)) $((i * TP + TP - 1)))
    log="rollout-server-$node-$port.log"
    srun --nodes=1 --ntasks=1 -w "$node" --overlap bash -c \
      "CUDA_VISIBLE_DEVICES=$gpus exec bash scripts/launch_rollout_server.sh $port $engine $* rollout.tensor_parallel_size=$TP" \
      > "$log" 2>&1 &
    servers+=("http://$node:$port")
    pids+=($!)
    logs+=("$log")
    engine=$((engine + 1))
  done
done
for i in "${!servers[@]}"; do
  wait_healthy "${servers[$i]}" "$deadline" "${pids[$i]}" "its log: ${logs[$i]}" || exit 1
done
address="${TRANSFER_ADDRESS:-}"
list=$(IFS=,; echo "${servers[*]}")
if [[ -z "$address" ]]; then  # the trainer node's address on the route to the first rollout node (pace/net.py
  # `source_address`: the kernel's choice for a socket connected there; `hostname -I` lists them in no stated order)
  address=$(srun --nodes=1 --ntasks=1 -w "$trainer" --overlap python -m pace.net "${rollout[0]}")
fi
srun --nodes=1 --ntasks=1 -w "$trainer" --overlap \
  accelerate launch --config_file "${ACCELERATE_CONFIG:-conf/accelerate/fsdp.yaml}" train.py "$@" \
  rollout.engine_process=server "rollout.servers=[$list]" "rollout.engines=${#servers[@]}" \
  rollout.tensor_parallel_size="$TP" "rollout.transfer_address=$address"
