#!/usr/bin/env bash
# One device call on an H200 (docs/gpu.md): install the carried wheels, run the cuda-marked
# staging tests (the layer-wise two-process test is in tests/test_gpu_staged.py), then the
# layer-wise benchmark (benchmarks/bench_layerwise_gpu.py: 16k and 4k tokens, 512 MiB chunks,
# `late`, the one-chunk-alone reference; layer_saved after the attention, where vLLM calls
# save_kv_layer) and a second, shorter run at 16k with layer_saved after the whole layer (the
# hook placement of the first H200 run, 2026-12-04: no MLP left to hide the last group behind).
# Usage (from this checkout's root; the wheels in .whl/, named in the call's `carry`):
#   bash scripts/h200_layerwise.sh OUT_DIR [BUDGET_S] [TIMEOUT_S] [BENCH ARGS...]
# BUDGET_S (default 240) stops the first benchmark starting cases, TIMEOUT_S (330) kills it.
# Environment: SKIP_TESTS=1 skips the tests, PYTEST_TIMEOUT_S (120) bounds them, LAYER_END=0
# skips the second run. Worst case ~20 s install + 120 + 330 + 120 s: under the 600 s limit of
# one command; typically ~4 min. $OUT gets 8 files (the most that come back): the pytest log,
# gpu_layerwise.{json,md,meta.json}, gpu_layerwise_layerend.{json,md,meta.json} and one log of
# both benchmark runs (gpu_layerwise.log).
set -uo pipefail
OUT=${1:?out dir}; BUDGET=${2:-240}; BT=${3:-330}; shift 3 || shift $#
source scripts/h200_env.sh  # wheels, shim, PYTHONPATH, GPU info
t0=$(date +%s)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${PYTEST_TIMEOUT_S:-120}" python3 -P -m pytest -q -p no:cacheprovider -m cuda \
    tests/test_gpu_staged.py tests/test_staging_triton.py tests/test_staging.py 2>&1 \
    | tee "$OUT/gpu_layerwise.pytest.log" | tail -15
  echo "pytest: $(( $(date +%s) - t0 )) s"
fi
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y timeout "$BT" python3 -P benchmarks/bench_layerwise_gpu.py \
  --reps 5 --budget-s "$BUDGET" --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/gpu_layerwise.log" \
  | grep -v "dropping peer" | tail -40
echo "benchmark: $(( $(date +%s) - t0 )) s"
if [ "${LAYER_END:-1}" != 0 ]; then
  UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y timeout 120 python3 -P benchmarks/bench_layerwise_gpu.py \
    --tokens 16384 --no-late --save-after layer --reps 3 --budget-s 60 --out-dir "$OUT" \
    --name gpu_layerwise_layerend 2>&1 | tee -a "$OUT/gpu_layerwise.log" \
    | grep -v "dropping peer" | tail -14
fi
echo "total: $(( $(date +%s) - t0 )) s"
