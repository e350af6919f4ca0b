# Sourced by the scripts/h200_*.sh device scripts (docs/gpu.md): installs the carried wheels
# (.whl/, named in the device call's `carry`) into /tmp/site, builds the kv_push shim over this
# checkout in /tmp/shim, exports PYTHONPATH, and prints the GPU and torch/triton versions.
# .whl/ holds the wheels, or site.tar.xz: those wheels installed with --target and packed
# without nixl_ep_cu13 and UCX's perftest (docs/gpu.md: the carry limit is 64 MiB in all)
if [ -f .whl/site.tar.xz ]; then
  rm -rf /tmp/site && mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz || exit 1
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
rm -rf /tmp/shim && mkdir -p /tmp/shim/kv_push
for d in common gpu_push neuron_push; do ln -s "$PWD/$d" /tmp/shim/kv_push/$d; done
cp kv_push/__init__.py /tmp/shim/kv_push/
export PYTHONPATH=/tmp/shim:/tmp/site PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
