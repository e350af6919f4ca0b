#!/usr/bin/env bash
# Stop everything examples/serve_pd.sh started in RUN_DIR (default /tmp/kv-push-pd): each PID
# file names a session/process-group leader; the whole group gets SIGTERM, then SIGKILL after
# STOP_TIMEOUT seconds (default 30). Idempotent: missing or stale PID files are fine.
set -uo pipefail
RUN_DIR=${RUN_DIR:-/tmp/kv-push-pd}
STOP_TIMEOUT=${STOP_TIMEOUT:-30}

# live members of process group $1 (the leader may be gone while its children, e.g. vLLM's
# engine core, still run; zombies waiting for init to reap them do not count)
members() { ps -e -o pgid=,stat=,args= | awk -v g="$1" '$1 == g && $2 !~ /^Z/'; }

# is $1 still a process group serve_pd.sh started (a vLLM server or the router)?
ours() { members "$1" | grep -qiE 'vllm|kv_push'; }  # vLLM's children: VLLM::EngineCore

group_alive() { [ -n "$(members "$1")" ]; }

stopped=0
# every *.pid in RUN_DIR (what serve_pd.sh checks before it starts): router first, so no new work
# reaches the servers; then decode and prefill; then any other (e.g. from an older layout).
# A PID file whose process is gone or is no longer ours is only removed.
shopt -s nullglob
pidfiles=()
for f in "$RUN_DIR"/router.pid "$RUN_DIR"/decode*.pid "$RUN_DIR"/prefill*.pid "$RUN_DIR"/*.pid; do
  [[ " ${pidfiles[*]-} " == *" $f "* ]] || pidfiles+=("$f")
done
for f in "${pidfiles[@]}"; do
  [ -f "$f" ] || continue
  name=$(basename "$f" .pid)
  pid=$(cat "$f")
  if [[ "$pid" =~ ^[0-9]+$ ]] && ours "$pid"; then
    echo "stopping $name (process group $pid)"
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq $((STOP_TIMEOUT * 10))); do group_alive "$pid" || break; sleep 0.1; done
    if group_alive "$pid"; then
      echo "$name did not stop in ${STOP_TIMEOUT}s: SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    stopped=$((stopped + 1))
  fi
  rm -f "$f"
done
rm -f "$RUN_DIR/router.url"
echo "cleanup: stopped $stopped process group(s); logs kept in $RUN_DIR"
