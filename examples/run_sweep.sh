#!/usr/bin/env bash
# Run the serving benchmark (push vs pull vs upstream push on real vLLM P/D servers), then plot.
#
#   examples/run_sweep.sh                 # full sweep, A B C C B A (~20-25 min on 2 CPU cores)
#   QUICK=1 examples/run_sweep.sh         # a few minutes
#   RATES=1,4,8 LENGTHS=128,512 REQUESTS=40 examples/run_sweep.sh
#
# Variables (empty: bench_serving.py's default):
#   PYTHON        [.venv/bin/python]       MODEL      [tiny model in .work/tiny-model]
#   QUICK         1: --quick               SYSTEMS    [push,pull,upstream-push]
#   ORDER         abccba | abc             RATES      req/s of the rate sweep
#   RATE_PROMPT_LEN  prompt tokens of the rate sweep   LENGTHS  prompt tokens of the length sweep
#   LENGTH_RATE   req/s of the length sweep            REQUESTS requests per point per system
#   OUTPUT_LEN    output tokens [16]       P_CPU D_CPU  cores of P and D [0 1]
#   UPSTREAM_MODE auto | concurrent | serial           BUDGET_S total time budget, seconds
#   OUT           [benchmarks/results/serving.json]    PLOT     [OUT with .png]
#   LOG_DIR       server logs [a temp dir]             EXTRA_ARGS more bench_serving.py arguments
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
OUT=${OUT:-$REPO/benchmarks/results/serving.json}
PLOT=${PLOT:-${OUT%.json}.png}

args=(--out "$OUT" --plot "$PLOT" --no-plot --python "$PYTHON")
[ "${QUICK:-0}" = 1 ] && args+=(--quick)
opt() { if [ -n "${2:-}" ]; then args+=("$1" "$2"); fi; }
opt --model "${MODEL:-}"
opt --systems "${SYSTEMS:-}"
opt --order "${ORDER:-}"
opt --rates "${RATES:-}"
opt --rate-prompt-len "${RATE_PROMPT_LEN:-}"
opt --lengths "${LENGTHS:-}"
opt --length-rate "${LENGTH_RATE:-}"
opt --requests "${REQUESTS:-}"
opt --output-len "${OUTPUT_LEN:-}"
opt --p-cpu "${P_CPU:-}"
opt --d-cpu "${D_CPU:-}"
opt --upstream-mode "${UPSTREAM_MODE:-}"
opt --budget-s "${BUDGET_S:-}"
opt --log-dir "${LOG_DIR:-}"
# shellcheck disable=SC2086
"$PYTHON" "$REPO/benchmarks/bench_serving.py" "${args[@]}" ${EXTRA_ARGS:-}
"$PYTHON" "$REPO/examples/plot_push_vs_pull.py" "$OUT" -o "$PLOT"
