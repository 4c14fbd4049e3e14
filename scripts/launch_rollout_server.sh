#!/usr/bin/env bash
# One rollout server (a vLLM HTTP server with the RL routes) for a run on another host, in the
# foreground: the same flags `train.py` gives the servers it starts itself (pace/rollout/server.py).
#
#   bash scripts/launch_rollout_server.sh PORT [ENGINE] [hydra overrides of the run ...]
#   bash scripts/launch_rollout_server.sh 8100 0 +exp=async_qwen3_8b      # GPU: CUDA_VISIBLE_DEVICES picks its GPUs
#
# ENGINE (default 0) sets its seed (seed + ENGINE). Give it the run's overrides, so that its model,
# dtype, lengths and weight transfer are the run's. Ready when `curl http://HOST:PORT/health` answers.
#
# Joining a running job (docs/gpu.md "A fleet that heals and grows"): with JOIN=<control URL> (or
# JOIN_RUN_DIR=<run dir>, whose fleet.json names it, on a shared file system) the server starts in the
# background, and once /health answers it is registered with `python -m pace.rollout.fleetctl join`
# as http://ADVERTISE_HOST:PORT; this script then waits on it and passes SIGTERM/SIGINT on to it.
# ADVERTISE_HOST: the name the trainer reaches this host by (default: HOST if it is not 0.0.0.0, else
# `hostname -f`, else the first address of `hostname -I`). JOIN_TIMEOUT_S (900): how long /health may take.
# PACE_ROLLOUT_SERVER (pace.rollout.server): with JOIN, the server's module (tests give a stand-in).
set -euo pipefail
cd "$(dirname "$0")/.."
port="${1:?usage: launch_rollout_server.sh PORT [ENGINE] [overrides ...]}"; shift
engine=0
if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then engine="$1"; shift; fi
if [[ -z "${JOIN:-}${JOIN_RUN_DIR:-}" ]]; then
  exec python -m pace.rollout.server --host "${HOST:-0.0.0.0}" --port "$port" --engine "$engine" "$@"
fi

host="${HOST:-0.0.0.0}"
where=(--control "${JOIN:-}")
[[ -n "${JOIN:-}" ]] || where=(--run-dir "$JOIN_RUN_DIR")
advertise="${ADVERTISE_HOST:-}"
[[ -n "$advertise" || "$host" == "0.0.0.0" ]] || advertise="$host"
[[ -n "$advertise" ]] || advertise="$(hostname -f 2>/dev/null || true)"
[[ -n "$advertise" ]] || advertise="$(hostname -I 2>/dev/null | awk '{print $1}')"
[[ -n "$advertise" ]] || { echo "launch_rollout_server.sh: set ADVERTISE_HOST (this host's name as the trainer reaches it)" >&2; exit 2; }
probe="$host"; [[ "$host" == "0.0.0.0" ]] && probe=127.0.0.1

python -m "${PACE_ROLLOUT_SERVER:-pace.rollout.server}" --host "$host" --port "$port" --engine "$engine" "$@" &
server=$!
# A background job of a script ignores SIGINT: SIGTERM stops it either way.
trap 'kill -TERM "$server" 2>/dev/null || true' TERM INT
stop() { kill -TERM "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; }

deadline=$((SECONDS + ${JOIN_TIMEOUT_S:-900}))
until curl -sf --noproxy '*' "http://$probe:$port/health" > /dev/null; do
  if ! kill -0 "$server" 2>/dev/null; then
    set +e; wait "$server"; rc=$?
    echo "launch_rollout_server.sh: the server exited (code $rc) before answering /health" >&2; exit $((rc ? rc : 1))
  fi
  if (( SECONDS > deadline )); then
    echo "launch_rollout_server.sh: no /health on port $port in ${JOIN_TIMEOUT_S:-900} s (JOIN_TIMEOUT_S)" >&2; stop; exit 1
  fi
  sleep 1
done
python -m pace.rollout.fleetctl join "http://$advertise:$port" "${where[@]}" \
  || { rc=$?; stop; exit "$rc"; }  # not taken by the job: not left running (fleetctl said why)

set +e
wait "$server"; rc=$?
while kill -0 "$server" 2>/dev/null; do wait "$server"; rc=$?; done  # a trap ended the first wait
exit "$rc"
