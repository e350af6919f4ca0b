#!/usr/bin/env bash
# Start one prefill (P) and one decode (D) vLLM server with KVPushConnector (or, for comparisons,
# vLLM's own NixlConnector / NixlPushConnector: SYSTEM), and kv-push-router in front of them; wait
# until all three are healthy; print the router URL.
#
#   examples/serve_pd.sh              # CPU: tiny local model, P on core 0, D on core 1
#   curl -s "$(cat /tmp/kv-push-pd/router.url)/v1/completions" -H 'Content-Type: application/json' \
#        -d '{"model":"tiny","prompt":"the quick brown fox","max_tokens":16}'
#   examples/cleanup.sh               # stops everything this script started
#
# Every setting is an environment variable (defaults in brackets):
#   SYSTEM           push: KVPushConnector, router --mode push;
#                    pull: vLLM NixlConnector, router --mode pull (P first, then D reads);
#                    upstream-push: vLLM NixlPushConnector, router --mode upstream-push with P's
#                    engine id fixed (UPSTREAM_ENGINE_ID) [push]
#   MODEL            model dir or hub id [unset: build the tiny random model, CPU only]
#   SERVED_NAME      --served-model-name [tiny]
#   PYTHON           interpreter with vLLM and kv_push installed [.venv/bin/python]
#   P_PYTHON D_PYTHON  P's and D's own interpreters, e.g. another vLLM version on one side as
#                    in a rolling upgrade (P_PYTHON=.venv-vllm029/bin/python) [PYTHON]
#   RUN_DIR          PID files, logs, router.url [/tmp/kv-push-pd]
#   HOST             listen address of P and D's HTTP servers [127.0.0.1]
#   ROUTER_HOST      listen address of the router [127.0.0.1]
#   KV_HOST          address P's side channel listens on and the router tells D [127.0.0.1]
#   P_PORT D_PORT ROUTER_PORT   HTTP ports [8100 8200 8000]
#   P_KV_PORT D_KV_PORT         side-channel ports (P: D's handshakes go here) [5600 5610]
#   P_CPUS D_CPUS    cores for P and D (VLLM_CPU_OMP_THREADS_BIND on CPU, e.g. 0 or 0-7) [0 1]
#   KV_PUSH_BACKEND  memory backend: host | cuda | neuron [host]
#   NIXL_BACKENDS    NIXL backends, comma-separated: UCX and/or LIBFABRIC [empty: the memory
#                    backend's choice: UCX for host/cuda, LIBFABRIC for neuron]
#   MAX_MODEL_LEN    [1024]
#   DTYPE            --dtype of both servers [the model's; KV_PUSH_BACKEND=host on a CPU with AMX:
#                    float16, since vLLM's bf16 CPU attention dies with SIGILL there]
#   EXTRA_VLLM_ARGS  more `vllm serve` arguments for both servers [--enforce-eager on CPU]
#   ROUTER_ARGS      more kv-push-router arguments, e.g. "--first-token-from-prefill auto" []
#   HEALTH_TIMEOUT   seconds to wait for each server [300]
#
# CPU (this machine): KV_PUSH_BACKEND=host, UCX over loopback, each server pinned to its own core
# (sharing cores made TTFT 4x worse; see shared/notes/vllm-on-cpu.md).
#
# p5en (H200, CUDA, KV over EFA with LIBFABRIC) -- one P and one D on the same node, 4 GPUs each:
#   MODEL=meta-llama/Llama-3.1-8B-Instruct SERVED_NAME=llama KV_PUSH_BACKEND=cuda \
#   NIXL_BACKENDS=LIBFABRIC P_GPUS=0,1,2,3 D_GPUS=4,5,6,7 EXTRA_VLLM_ARGS="--tensor-parallel-size 4" \
#   HOST=0.0.0.0 KV_HOST=<this node's IP on the EFA subnet> examples/serve_pd.sh
#   (P_CPUS/D_CPUS are not used with CUDA; P_GPUS/D_GPUS become CUDA_VISIBLE_DEVICES. Across two
#   nodes run P on one and D on the other with the same script pieces, and give the router
#   --prefill http://P_NODE:8100,kv=P_NODE:5600 --decode http://D_NODE:8200.)
#
# Trainium (Trn2/Trn3, KV_PUSH_BACKEND=neuron, LIBFABRIC over EFA) -- see docs/neuron.md for the
# required environment (NEURON_RT_MAP_HBM=1, FI_EFA_ENABLE_SHM_TRANSFER=0 when co-located,
# LD_LIBRARY_PATH with /opt/aws/neuron/lib and /opt/amazon/efa/lib64) and the vllm-neuron venv:
#   PYTHON=/opt/aws_neuronx_venv_pytorch_inference_vllm_0_24_0_1_1_0/bin/python \
#   MODEL=<model> KV_PUSH_BACKEND=neuron NIXL_BACKENDS=LIBFABRIC \
#   P_NEURON_DEVICES=0-3 D_NEURON_DEVICES=4-7 EXTRA_VLLM_ARGS="--tensor-parallel-size 4" \
#   examples/serve_pd.sh
#   (P_NEURON_DEVICES/D_NEURON_DEVICES become NEURON_VISIBLE_DEVICES; vllm-neuron refuses
#   NEURON_RT_VISIBLE_CORES in a multi-process server.)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
RUN_DIR=${RUN_DIR:-/tmp/kv-push-pd}
HOST=${HOST:-127.0.0.1}
ROUTER_HOST=${ROUTER_HOST:-127.0.0.1}
KV_HOST=${KV_HOST:-127.0.0.1}
P_PORT=${P_PORT:-8100}
D_PORT=${D_PORT:-8200}
ROUTER_PORT=${ROUTER_PORT:-8000}
P_KV_PORT=${P_KV_PORT:-5600}
D_KV_PORT=${D_KV_PORT:-5610}
P_CPUS=${P_CPUS:-0}
D_CPUS=${D_CPUS:-1}
KV_PUSH_BACKEND=${KV_PUSH_BACKEND:-host}
SYSTEM=${SYSTEM:-push}
UPSTREAM_ENGINE_ID=${UPSTREAM_ENGINE_ID:-kv-push-upstream-p-$P_KV_PORT}
case "$SYSTEM" in
  push|pull|upstream-push) ;;
  *) echo "serve_pd.sh: SYSTEM must be push, pull or upstream-push, got '$SYSTEM'" >&2; exit 2 ;;
esac
NIXL_BACKENDS=${NIXL_BACKENDS:-}
SERVED_NAME=${SERVED_NAME:-tiny}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-1024}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-300}
DTYPE=${DTYPE:-}
if [ "$KV_PUSH_BACKEND" = host ]; then
  EXTRA_VLLM_ARGS=${EXTRA_VLLM_ARGS:---enforce-eager}
  KV_BUFFER_DEVICE=cpu
  if [ -z "$DTYPE" ] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    DTYPE=float16
    echo "serve_pd.sh: this CPU has AMX: --dtype float16 (vLLM's bf16 CPU attention dies with" \
         "SIGILL here; README, Known issues; DTYPE=... overrides)"
  fi
else
  EXTRA_VLLM_ARGS=${EXTRA_VLLM_ARGS:-}
  KV_BUFFER_DEVICE=${KV_BUFFER_DEVICE:-cuda}
fi

mkdir -p "$RUN_DIR"
for f in "$RUN_DIR"/*.pid; do
  [ -e "$f" ] || continue
  if kill -0 "$(cat "$f")" 2>/dev/null; then
    echo "serve_pd.sh: $f is running; run examples/cleanup.sh first (RUN_DIR=$RUN_DIR)" >&2
    exit 1
  fi
done

if [ -z "${MODEL:-}" ]; then
  if [ "$KV_PUSH_BACKEND" != host ]; then
    echo "serve_pd.sh: set MODEL (the tiny model is only for CPU)" >&2
    exit 2
  fi
  MODEL=${TINY_MODEL_DIR:-$REPO/.work/tiny-model}
  "$PYTHON" "$REPO/examples/make_tiny_model.py" "$MODEL"
fi

# --kv-transfer-config of one server. push: our connector, its side channel (and nixl_backends
# when given) in kv_connector_extra_config; pull / upstream-push: vLLM's connector, whose side
# channel is set by VLLM_NIXL_SIDE_CHANNEL_HOST/PORT (see serve), P's engine id fixed for
# upstream-push so that the router can be told it.
kv_config() {  # $1 role, $2 side-channel port
  if [ "$SYSTEM" != push ]; then
    local connector=NixlConnector engine=""
    if [ "$SYSTEM" = upstream-push ]; then
      connector=NixlPushConnector
      if [ "$1" = kv_producer ]; then engine=", \"engine_id\": \"$UPSTREAM_ENGINE_ID\""; fi
    fi
    printf '{"kv_connector": "%s", "kv_role": "%s", "kv_buffer_device": "%s"%s}' \
      "$connector" "$1" "$KV_BUFFER_DEVICE" "$engine"
    return
  fi
  local extra="\"side_channel_host\": \"$KV_HOST\", \"side_channel_port\": $2"
  if [ -n "$NIXL_BACKENDS" ]; then
    extra="$extra, \"nixl_backends\": \"$NIXL_BACKENDS\""
  fi
  printf '{"kv_connector": "KVPushConnector", "kv_connector_module_path": "kv_push.common.connector", "kv_role": "%s", "kv_buffer_device": "%s", "kv_connector_extra_config": {%s}}' \
    "$1" "$KV_BUFFER_DEVICE" "$extra"
}

# start NAME CMD...: own process group (so cleanup.sh can stop the whole group), log, PID file.
# Not an own session (setsid, as before 2026-12-04): with the kernel's autogroup scheduling (on
# by default on many distributions) every session is a scheduling group of its own, and a woken
# API server then waited 50-350 ms for a core held by another server's busy worker (measured on
# a 2-core box: README, "TTFT breakdown"). `set -m` gives each background job its own process
# group in this session; nohup keeps the servers up when the terminal goes away.
start() {
  local name=$1
  shift
  set -m
  nohup bash -c 'echo $$ > "$0"; exec "$@"' "$RUN_DIR/$name.pid" "$@" \
    > "$RUN_DIR/$name.log" 2>&1 < /dev/null &
  set +m
  for _ in $(seq 50); do [ -s "$RUN_DIR/$name.pid" ] && break; sleep 0.1; done
  echo "started $name (pid/pgid $(cat "$RUN_DIR/$name.pid"), log $RUN_DIR/$name.log)"
}

# device placement for one server: $1 = P or D
placement_env() {
  case "$KV_PUSH_BACKEND" in
    host)
      local cpus_var="${1}_CPUS"
      echo "VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}" \
           "VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND=${!cpus_var}" ;;
    cuda)
      local gpus_var="${1}_GPUS"
      if [ -n "${!gpus_var:-}" ]; then echo "CUDA_VISIBLE_DEVICES=${!gpus_var}"; fi ;;
    neuron)
      local nd_var="${1}_NEURON_DEVICES"
      echo "NEURON_RT_MAP_HBM=1"
      if [ -n "${!nd_var:-}" ]; then echo "NEURON_VISIBLE_DEVICES=${!nd_var}"; fi ;;
  esac
}

serve() {  # $1 name, $2 P|D, $3 port, $4 role, $5 side-channel port
  local py_var="${2}_PYTHON"
  # shellcheck disable=SC2046,SC2086
  start "$1" env $(placement_env "$2") KV_PUSH_BACKEND="$KV_PUSH_BACKEND" PYTHONUNBUFFERED=1 \
    VLLM_NIXL_SIDE_CHANNEL_HOST="$KV_HOST" VLLM_NIXL_SIDE_CHANNEL_PORT="$5" \
    "${!py_var:-$PYTHON}" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name "$SERVED_NAME" --host "$HOST" --port "$3" \
    --max-model-len "$MAX_MODEL_LEN" ${DTYPE:+--dtype "$DTYPE"} $EXTRA_VLLM_ARGS \
    --kv-transfer-config "$(kv_config "$4" "$5")"
}

wait_healthy() {  # $1 name, $2 url
  local deadline=$((SECONDS + HEALTH_TIMEOUT))
  while [ $SECONDS -lt $deadline ]; do
    if ! kill -0 "$(cat "$RUN_DIR/$1.pid")" 2>/dev/null; then
      echo "serve_pd.sh: $1 exited; last lines of $RUN_DIR/$1.log:" >&2
      tail -n 40 "$RUN_DIR/$1.log" >&2
      return 1
    fi
    if curl -sf -o /dev/null --max-time 2 "$2/health"; then
      echo "$1 healthy ($2)"
      return 0
    fi
    sleep 1
  done
  echo "serve_pd.sh: $1 not healthy after ${HEALTH_TIMEOUT}s; see $RUN_DIR/$1.log" >&2
  return 1
}

# a client-side address for a listen address (0.0.0.0 / :: -> loopback)
reach() { case "$1" in 0.0.0.0|::) echo 127.0.0.1 ;; *) echo "$1" ;; esac; }

fail() { echo "serve_pd.sh: failed; stopping what was started" >&2; RUN_DIR=$RUN_DIR "$REPO/examples/cleanup.sh" >&2 || true; exit 1; }
trap fail ERR INT TERM

serve prefill P "$P_PORT" kv_producer "$P_KV_PORT"
serve decode D "$D_PORT" kv_consumer "$D_KV_PORT"
P_URL="http://$(reach "$HOST"):$P_PORT"
D_URL="http://$(reach "$HOST"):$D_PORT"
wait_healthy prefill "$P_URL"
wait_healthy decode "$D_URL"

P_SPEC="$P_URL,kv=$KV_HOST:$P_KV_PORT"
if [ "$SYSTEM" = upstream-push ]; then P_SPEC="$P_SPEC,engine_id=$UPSTREAM_ENGINE_ID"; fi
# shellcheck disable=SC2086  # ROUTER_ARGS: several words
start router env PYTHONUNBUFFERED=1 "$PYTHON" -m kv_push.common.router --mode "$SYSTEM" \
  --host "$ROUTER_HOST" --port "$ROUTER_PORT" --prefill "$P_SPEC" --decode "$D_URL" ${ROUTER_ARGS:-}
ROUTER_URL="http://$(reach "$ROUTER_HOST"):$ROUTER_PORT"
wait_healthy router "$ROUTER_URL"
trap - ERR INT TERM

echo "$ROUTER_URL" > "$RUN_DIR/router.url"
echo "router: $ROUTER_URL   (system $SYSTEM; model name: $SERVED_NAME; stop with RUN_DIR=$RUN_DIR examples/cleanup.sh)"
