"""What differs between the vLLM versions the connector supports, detected once at import.

Supported: vLLM 0.29 and 0.32 (tested end to end here with the CPU build), and the hooks back to
0.24 (the base of the Neuron vLLM plugin), which are feature-detected rather than version-checked:

* ``KVConnectorBase_V1.__init__`` takes ``kv_cache_config`` since 0.2x; older takes two args.
* ``SupportsHMA`` (``request_finished_all_groups``): mixed in when present, so vLLM does not
  demand ``--disable-hybrid-kv-cache-manager``.
* ``KVConnectorTransferResults.failed_recving``: failures reported with ``finished_recving`` go
  there when present, else through ``get_block_ids_with_load_errors`` (which always carries the
  failures reported before the request's blocks are free: ``connector_worker``).
* ``has_pending_push_work``: keeps the producer's engine loop stepping while blocks wait for
  their WRITEs; where absent, vLLM keeps stepping while requests hold delayed-free blocks.
* One batch at a time (``one_batch_at_a_time``): whether the scheduler plans a step only after
  the previous step's output was processed -- no async scheduling (0.32 turns it on by default
  on GPUs, off on CPU), no pipeline parallelism (``max_concurrent_batches`` where present).
  The producer's early prefill announcement relies on it.
* Engine request ids: 0.29 and 0.32 append ``-<8 hex>`` to each unless
  ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set (``request_id_random_suffix``); the upstream
  request form's transfer id must leave it out.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base

KVConnectorBase_V1 = _base.KVConnectorBase_V1
SupportsHMA = getattr(_base, "SupportsHMA", None)
_TransferResults = getattr(_base, "KVConnectorTransferResults", None)
HAS_FAILED_RECVING = _TransferResults is not None and "failed_recving" in getattr(
    _TransferResults, "__dataclass_fields__", {})
_INIT_TAKES_KV_CACHE_CONFIG = "kv_cache_config" in inspect.signature(
    KVConnectorBase_V1.__init__).parameters


def connector_bases() -> tuple[type, ...]:
    return (KVConnectorBase_V1, SupportsHMA) if SupportsHMA is not None else (KVConnectorBase_V1,)


def init_base(sup: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
    if _INIT_TAKES_KV_CACHE_CONFIG:
        sup.__init__(vllm_config, role, kv_cache_config)
    else:  # pragma: no cover - vLLM before the three-argument constructor
        sup.__init__(vllm_config, role)


def transfer_results(sending: set[str], recving: set[str], failed: set[str]) -> Any:
    if HAS_FAILED_RECVING:
        return _TransferResults(finished_sending=sending, finished_recving=recving,
                                failed_recving=failed)
    return _TransferResults(finished_sending=sending, finished_recving=recving)


def tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed.parallel_state import (  # noqa: PLC0415
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def kv_dtype_name(vllm_config: Any) -> str:
    """The KV element type, tagged with the CPU attention ISA where the block layout depends on
    it (vLLM's CPU backend tiles blocks differently for amx / vec / vec16), so that P and D with
    different layouts refuse each other at the handshake instead of exchanging garbage."""
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype and cache_dtype != "auto":
        name = str(cache_dtype)
    else:
        name = str(vllm_config.model_config.dtype).replace("torch.", "")
    tag = _cpu_attn_isa(vllm_config)
    return f"{name}@cpu-{tag}" if tag else name


def _cpu_attn_isa(vllm_config: Any) -> str:
    try:
        from vllm.platforms import current_platform  # noqa: PLC0415

        if not current_platform.is_cpu():
            return ""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415

        mc = vllm_config.model_config
        return str(_get_attn_isa(mc.dtype, vllm_config.cache_config.block_size,
                                 mc.get_head_size()))
    except Exception:  # an older or newer vLLM without that helper: the layout is unknown
        return "unknown"


def new_block_ids(blocks: Any) -> list[int]:
    """The request's newly allocated (not prefix-cached) block ids, single KV cache group."""
    if hasattr(blocks, "get_unhashed_block_ids_all_groups"):
        return single_group(blocks.get_unhashed_block_ids_all_groups())
    return list(blocks.get_unhashed_block_ids())


def single_group(block_ids: Any) -> list[int]:
    groups = [list(g) for g in block_ids]
    if len(groups) > 1 and any(groups[1:]):
        raise NotImplementedError(
            "KVPushConnector handles one KV cache group (attention-only models); this model has "
            f"{len(groups)} groups")
    return groups[0] if groups else []


def kv_cache_groups(kv_cache_config: Any) -> int:
    """KV cache groups of the model (1 where vLLM does not say: older versions, tests)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    return len(groups) if groups is not None else 1


def finished_ok(request: Any) -> bool:
    """True when a producer request finished with its prefill computed (not aborted/errored)."""
    from vllm.v1.request import RequestStatus  # noqa: PLC0415

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def finished_aborted(request: Any) -> bool:
    """True when vLLM aborted the request: its HTTP request ended (a client hung up, a router
    closed the leg) or it was aborted through the engine's API -- not an engine error."""
    from vllm.v1.request import RequestStatus  # noqa: PLC0415

    return request.status == RequestStatus.FINISHED_ABORTED


def request_id_random_suffix() -> bool:
    """Whether this vLLM appends ``-<8 random hex digits>`` to every engine request id
    (``InputProcessor.assign_request_id`` in 0.29 and 0.32, which came with the environment
    variable ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` that turns it off: a vLLM without that
    variable appends nothing). The engine core inherits the API server's environment."""
    from vllm import envs  # noqa: PLC0415

    name = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"
    if name not in getattr(envs, "environment_variables", {}):
        return False
    return not envs.environment_variables[name]()


def one_batch_at_a_time(vllm_config: Any) -> tuple[bool, str]:
    """(True, "") when vLLM runs one engine step at a time -- the scheduler plans step N+1 only
    after step N's output was processed (no async scheduling, no pipeline parallelism): a
    request scheduled to complete its prefill in a step then ends in that step's output, before
    anything else is scheduled. Else (False, why)."""
    sc = getattr(vllm_config, "scheduler_config", None)
    if getattr(sc, "async_scheduling", False):
        return False, "async scheduling is on"
    pp = int(getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1)
             or 1)
    if pp > 1:
        return False, f"pipeline parallel size {pp}"
    try:
        batches = int(getattr(vllm_config, "max_concurrent_batches", 1))
    except Exception:  # a config object without the parts the property reads
        batches = 1
    if batches > 1:
        return False, f"{batches} concurrent batches"
    return True, ""


def full_attention_only(vllm_config: Any) -> tuple[bool, str]:
    """(True, "") when the model keeps every prompt block until the request ends (no sliding
    window: vLLM frees out-of-window blocks before ``request_finished``). Else (False, why)."""
    mc = getattr(vllm_config, "model_config", None)
    get = getattr(mc, "get_sliding_window", None)
    try:
        window = get() if get is not None else None
    except Exception:  # an older config without it: assume the worst
        return False, "sliding window unknown"
    if window:
        return False, f"sliding window {window}"
    return True, ""
