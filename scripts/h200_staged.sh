#!/usr/bin/env bash
# One device call on an H200 (docs/gpu.md): install the carried wheels, the cuda-marked staging
# tests, then bench_staged_gpu.py over the full matrix. Usage (from this checkout's root):
#   bash scripts/h200_staged.sh OUT_DIR [PYTEST_TIMEOUT_S] [BENCH_BUDGET_S] [BENCH_TIMEOUT_S] [BENCH ARGS...]
set -uo pipefail
OUT=${1:?out dir}; PT=${2:-130}; BUDGET=${3:-320}; BT=${4:-430}; shift 4 || shift $#
source scripts/h200_env.sh  # wheels, shim, PYTHONPATH, GPU info
t0=$(date +%s)
timeout "$PT" python3 -P -m pytest -q -p no:cacheprovider -m cuda tests/test_gpu_staged.py tests/test_staging_triton.py \
  tests/test_staging.py 2>&1 | tee "$OUT/gpu_staging.pytest.log" | tail -40
echo "pytest: $(( $(date +%s) - t0 )) s"
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y timeout "$BT" python3 benchmarks/bench_staged_gpu.py \
  --budget-s "$BUDGET" --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/gpu_staged.log" | grep -v "^20..-..-.. .*dropping peer" | tail -70
echo "total: $(( $(date +%s) - t0 )) s"
