"""Neuron (Trainium) memory backend (``KV_PUSH_BACKEND=neuron``): how to describe, register and
check KV in Neuron HBM over NIXL LIBFABRIC. No protocol code lives here; see docs/neuron.md."""
