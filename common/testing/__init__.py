"""Test, benchmark and demo harness -- NOT public API.

Installed with the package only so that ``kv-push-demo``, the benchmarks and the tests (and the
child processes they spawn) can import it; anything here may change without notice. Nothing in
the product (``kv_push.common`` outside this package, ``gpu_push``, ``neuron_push``) imports it
except ``kv_push.common.demo``, the demo's command line.

* ``peer_process`` -- ``LocalPeer``: a peer server in a spawned child, driven over a pipe;
  ``PeerSpec``, ``start_pair``.
* ``peer_server`` -- ``PeerServer``: a ``PushWorker`` over a pluggable KV memory, its commands
  (hand-offs, stamped outcomes, releases) and test hooks (hostile or stale input).
* ``host_pool`` -- ``HostPool`` (a KV pool in a numpy buffer), ``logical_kv``, ``HostMemory``.
* ``pattern`` -- a fast exact byte pattern for ``HostPool`` (fill / count wrong bytes).
* ``torch_pool`` -- ``TorchMemory``: per-layer torch KV tensors on a device (cuda or cpu) with an
  on-device pattern and canaries (torch is imported only when one is built).
* ``block_ids`` -- ``fragmented_blocks``: block ids as a busy server hands them out.
* ``pull_peer`` -- a second NIXL agent per peer and vLLM-NixlConnector-style pull (benchmarks).
* ``bench_peer_server`` -- ``BenchPeerServer``: the benchmarks' peer server (push, pull, bare
  NIXL transfers, push-path instrumentation) over either memory.
* ``vllm_servers`` -- real ``vllm serve`` processes (CPU build) and our router, for the
  end-to-end tests and the serving benchmark; ``build_tiny_model``.
* ``tiny_model`` -- builds the tiny random Llama model they serve (needs torch, transformers).
"""
