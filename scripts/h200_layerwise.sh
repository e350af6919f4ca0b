#!/usr/bin/env bash
# One device call on an H200 (docs/gpu.md): install the carried wheels, then the layer-wise
# benchmark (benchmarks/bench_layerwise_gpu.py). Usage (from this checkout's root):
#   bash scripts/h200_layerwise.sh OUT_DIR [BUDGET_S] [TIMEOUT_S] [BENCH ARGS...]
set -uo pipefail
OUT=${1:?out dir}; BUDGET=${2:-300}; BT=${3:-480}; shift 3 || shift $#
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/shim && mkdir -p /tmp/shim/kv_push
for d in common gpu_push neuron_push; do ln -s "$PWD/$d" /tmp/shim/kv_push/$d; done
cp kv_push/__init__.py /tmp/shim/kv_push/
export PYTHONPATH=/tmp/shim:/tmp/site PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$(date +%s)
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y timeout "$BT" python3 -P benchmarks/bench_layerwise_gpu.py \
  --budget-s "$BUDGET" --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/gpu_layerwise.log" \
  | grep -v "dropping peer" | tail -60
echo "total: $(( $(date +%s) - t0 )) s"
