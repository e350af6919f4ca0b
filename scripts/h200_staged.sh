#!/usr/bin/env bash
# One device call on an H200 (docs/gpu.md): install the carried wheels, the cuda-marked staging
# tests, then bench_staged_gpu.py over the full matrix. Usage (from this checkout's root):
#   bash scripts/h200_staged.sh OUT_DIR [PYTEST_TIMEOUT_S] [BENCH_BUDGET_S] [BENCH_TIMEOUT_S] [BENCH ARGS...]
set -uo pipefail
OUT=${1:?out dir}; PT=${2:-130}; BUDGET=${3:-320}; BT=${4:-430}; shift 4 || shift $#
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/shim && mkdir -p /tmp/shim/kv_push
for d in common gpu_push neuron_push; do ln -s "$PWD/$d" /tmp/shim/kv_push/$d; done
cp kv_push/__init__.py /tmp/shim/kv_push/
export PYTHONPATH=/tmp/shim:/tmp/site PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
timeout "$PT" python3 -P -m pytest -q -p no:cacheprovider -m cuda tests/test_gpu_staged.py tests/test_staging_triton.py \
  tests/test_staging.py 2>&1 | tee "$OUT/gpu_staging.pytest.log" | tail -40
echo "pytest: $(( $(date +%s) - t0 )) s"
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y timeout "$BT" python3 benchmarks/bench_staged_gpu.py \
  --budget-s "$BUDGET" --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/gpu_staged.log" | grep -v "^20..-..-.. .*dropping peer" | tail -70
echo "total: $(( $(date +%s) - t0 )) s"
