#!/usr/bin/env bash
# One device call on any single-GPU kind (docs/gpu.md): the CUDA tests, then the staged-vs-region-
# vs-pull benchmark, results into OUT_DIR. Usage (this checkout's root, wheels in .whl/ carried):
#   bash scripts/gpu_check.sh OUT_DIR NAME      # NAME: result files' stem, e.g. gpu_staged.h100
set -uo pipefail
OUT=${1:?out dir}; NAME=${2:?name}
source scripts/h200_env.sh || exit 1
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
t0=$(date +%s)
timeout 150 python3 -P -m pytest -q -p no:cacheprovider -m cuda tests/test_backends.py \
  tests/test_gpu_push.py tests/test_gpu_staged.py tests/test_staging.py \
  tests/test_staging_triton.py 2>&1 | tee "$OUT/$NAME.pytest.log" | tail -5
echo "pytest: $(( $(date +%s) - t0 )) s"
timeout 400 python3 benchmarks/bench_staged_gpu.py --budget-s 280 --out-dir "$OUT" --name "$NAME" \
  > "$OUT/$NAME.log" 2>&1; echo "bench rc $?"
tail -3 "$OUT/$NAME.log"
echo "total: $(( $(date +%s) - t0 )) s"
