"""kv_push: push-based KV-cache transfer for vLLM P/D disaggregation over NIXL.

Subpackages: ``kv_push.common`` (accelerator-agnostic core), ``kv_push.gpu_push`` (CUDA memory),
``kv_push.neuron_push`` (Neuron device memory).
"""
__version__ = "0.1.0"  # the one place; pyproject.toml reads it (tool.setuptools.dynamic)
