# Sourced by the scripts/h200_*.sh device scripts (docs/gpu.md): installs the carried wheels
# (.whl/, named in the device call's `carry`) into /tmp/site, builds the kv_push shim over this
# checkout in /tmp/shim, exports PYTHONPATH, and prints the GPU and torch/triton versions.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
rm -rf /tmp/shim && mkdir -p /tmp/shim/kv_push
for d in common gpu_push neuron_push; do ln -s "$PWD/$d" /tmp/shim/kv_push/$d; done
cp kv_push/__init__.py /tmp/shim/kv_push/
export PYTHONPATH=/tmp/shim:/tmp/site PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
