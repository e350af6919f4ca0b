"""CUDA memory backend (``KV_PUSH_BACKEND=cuda``): how to describe, register and check KV in GPU
memory. No protocol code lives here; that is all in ``kv_push.common``."""
