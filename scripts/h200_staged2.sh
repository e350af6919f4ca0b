#!/usr/bin/env bash
# Second H200 call: cuda tests of the fused kernels and the staged path's phase breakdown
# (default idle_poll_s and 1e-4). Usage: bash scripts/h200_staged2.sh OUT_DIR
set -uo pipefail
OUT=${1:?out dir}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/shim && mkdir -p /tmp/shim/kv_push
for d in common gpu_push neuron_push; do ln -s "$PWD/$d" /tmp/shim/kv_push/$d; done
cp kv_push/__init__.py /tmp/shim/kv_push/
export PYTHONPATH=/tmp/shim:/tmp/site PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
t0=$(date +%s)
timeout 80 python3 -P -m pytest -q -p no:cacheprovider -m cuda tests/test_gpu_staged.py \
  tests/test_staging_triton.py tests/test_staging.py 2>&1 | tee "$OUT/gpu_staging.pytest.log" | tail -8
echo "pytest: $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/ph
P="--tp 1,8 --block-sizes 16 --no-hetero --modes staged --kernels triton --phases --budget-s 60"
timeout 80 python3 benchmarks/bench_staged_gpu.py $P --out-dir /tmp/ph --name phases_default 2>&1 | grep "tok ("
timeout 80 python3 benchmarks/bench_staged_gpu.py $P --idle-poll-s 0.0001 --out-dir /tmp/ph --name phases_poll1e-4 2>&1 | grep "tok ("
cp /tmp/ph/*.json /tmp/ph/*.md "$OUT"/ 2>/dev/null; ls "$OUT"
echo "phases: $(( $(date +%s) - t0 )) s"
echo "total: $(( $(date +%s) - t0 )) s"
