"""``KVPushConnector``: the vLLM KV connector users load (a thin facade).

Load it by path::

    --kv-transfer-config '{"kv_connector": "KVPushConnector",
                           "kv_connector_module_path": "kv_push.common.connector",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {...}}'

or by name alone (``"kv_connector": "KVPushConnector"``): the ``vllm.general_plugins`` entry
point registers it with vLLM's connector factory on import (``vllm_plugin.py``).

vLLM creates one instance in the scheduler process (role SCHEDULER) and one in every worker
(role WORKER). The scheduler half is ``connector_scheduler.PushScheduler``, the worker half
``connector_worker.PushConnectorWorker``; this class only adapts vLLM's hooks to them. Hooks that
differ between vLLM versions are feature-detected in ``vllm_compat``.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from . import vllm_compat as compat
from .config import ConfigError, PushConfig
from .connector_scheduler import PushScheduler, StepPlan, upstream_reply
from .connector_stats import KVPushPromMetrics, KVPushStats
from .logging_setup import follow_vllm_logging
from .metrics import Counters

logger = logging.getLogger(__name__)
follow_vllm_logging()  # in each vLLM process that loads the connector


def _hostport(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _step_safe(vllm_config: Any) -> str:
    """Why a prefill may not be handed on while its step runs ("" when it may): a request
    whose prefill a step completes must end in that step's output, with nothing scheduled in
    between (``connector_scheduler``'s conditions). With async scheduling or pipeline
    parallelism vLLM plans the next step first, and may preempt the request there and give its
    blocks -- not held by any ``request_finished`` yet -- to a step that writes into them."""
    for check in (compat.one_batch_at_a_time, compat.full_attention_only):
        ok, why = check(vllm_config)
        if not ok:
            return why
    return ""


def _early_prefill_done(config: PushConfig, vllm_config: Any) -> bool:
    """Whether the producer announces prefills when their step ran (``early_prefill_done``:
    ``auto`` where ``connector_scheduler``'s conditions hold), said once at start-up."""
    if config.early_prefill_done == "off":
        logger.info("kv_push: early prefill announcement off (early_prefill_done=off)")
        return False
    if why := _step_safe(vllm_config):
        logger.info("kv_push: early prefill announcement off: %s (prefills are announced "
                    "at request_finished, one engine step later)", why)
        return False
    logger.info("kv_push: early prefill announcement on")
    return True


def _idle_step_wait(config: PushConfig, vllm_config: Any, role: str) -> float:
    """How long a decoder worker waits in an engine step that runs no model
    (``idle_step_wait_s``): only where vLLM runs one step at a time with one engine. With async
    scheduling or pipeline parallelism the next step is planned before this one's output is
    processed, so the wait would delay a request just reported (or a new one) instead of
    speeding it up; with data parallelism every rank's step waits for the slowest rank's."""
    if role == "producer" or config.idle_step_wait_s == 0:
        return 0.0
    ok, why = compat.one_batch_at_a_time(vllm_config)
    dp = int(getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_size", 1) or 1)
    if ok and dp > 1:
        ok, why = False, f"data parallel size {dp}"
    if not ok:
        logger.info("kv_push: idle-step wait off: %s (KV that arrives is reported at the "
                    "next step's look)", why)
        return 0.0
    return config.idle_step_wait_s


def _layerwise(config: PushConfig, vllm_config: Any) -> bool:
    """Whether the producer streams prefills layer by layer while their step runs
    (``layerwise``: ``auto`` under the same conditions as the early announcement: a stream
    reads the request's blocks while the step runs and WRITEs them at once, so a preemption
    in a step planned before this one's output would let another request's KV into what is
    being sent). Where the producer has no staging pool it never streams anyway
    (``PushWorker.streams``)."""
    if config.layerwise == "off":
        return False
    if why := _step_safe(vllm_config):
        logger.info("kv_push: layer-wise streaming off: %s (staged prefills are packed after "
                    "their request_finished; start P with --no-async-scheduling to stream)",
                    why)
        return False
    return True


class PushConnectorMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan):
        self.plan = plan


class KVPushConnector(*compat.connector_bases()):  # type: ignore[misc]
    """Push-mode P/D connector over NIXL (see the package README)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        compat.init_base(super(), vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        # parsed once, here: a bad key or value stops the server at start-up
        self.push_config = PushConfig.from_sources(ktc.kv_connector_extra_config or {})
        self.kv_role = {"kv_producer": "producer", "kv_consumer": "decoder",
                        "kv_both": "both"}.get(ktc.kv_role)
        if self.kv_role is None:
            raise ValueError(f"KVPushConnector needs kv_role kv_producer, kv_consumer or "
                             f"kv_both, got {ktc.kv_role!r}")
        if self.kv_role != "decoder" and self.push_config.side_channel_port == 0:
            # port 0 would listen on a port nobody is told: decoders and the router's kv=
            # must name it
            raise ConfigError("side_channel_port 0 (any free port) cannot be used by a "
                              "producer in vLLM: decoders and the router's kv= must know the "
                              "port; set one (default 5600)")
        block_size = vllm_config.cache_config.block_size
        self._scheduler: PushScheduler | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            pc = self.push_config
            parallel = getattr(vllm_config, "parallel_config", None)
            reply = upstream_reply(
                engine_id=str(ktc.engine_id), side_channel_host=pc.side_channel_host,
                side_channel_port=pc.side_channel_port,
                tp_size=int(getattr(parallel, "tensor_parallel_size", 1)),
                pp_size=int(getattr(parallel, "pipeline_parallel_size", 1)))
            is_producer = self.kv_role in ("producer", "both")
            self._scheduler = PushScheduler(is_producer=is_producer,
                                            is_decoder=self.kv_role in ("decoder", "both"),
                                            block_size=block_size, counters=Counters(),
                                            secret=pc.secret,
                                            random_suffix=compat.request_id_random_suffix(),
                                            upstream_reply=reply,
                                            side_channel=_hostport(pc.side_channel_host,
                                                                   pc.side_channel_port),
                                            early_prefill_done=is_producer and _early_prefill_done(
                                                pc, vllm_config),
                                            layerwise=is_producer and _layerwise(pc, vllm_config))
        else:
            from .connector_worker import PushConnectorWorker  # noqa: PLC0415

            tp_rank, tp_size = compat.tp_rank_and_size()
            mc = vllm_config.model_config
            self._worker = PushConnectorWorker(
                config=self.push_config, role=self.kv_role,
                engine_id=str(ktc.engine_id), tp_rank=tp_rank, tp_size=tp_size,
                num_kv_heads=mc.get_total_num_kv_heads(), head_size=mc.get_head_size(),
                block_size=block_size, dtype=compat.kv_dtype_name(vllm_config),
                load_failure_policy=str(getattr(ktc, "kv_load_failure_policy", "fail")),
                failed_recving=compat.HAS_FAILED_RECVING,
                early_failures=compat.kv_cache_groups(kv_cache_config) <= 1,
                idle_step_wait_s=_idle_step_wait(self.push_config, vllm_config, self.kv_role))
            check_model = getattr(self._worker.backend, "check_model", None)
            if check_model is not None:  # a backend that cannot serve this model says so now
                check_model(sliding_window=getattr(mc, "get_sliding_window", lambda: None)(),
                            tp_size=tp_size)

    # ---------------------------------------------------------------------------------------
    # worker side
    # ---------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, PushConnectorMetadata):
            self._worker.handle(connector_metadata.plan)  # enqueue only

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # the producer pushes; nothing to pull

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker.on_layer_saved(layer_name)  # layer-wise streaming: enqueue only

    def wait_for_save(self) -> None:
        self._worker.on_saved()  # host backend: the step's completing prefills go now

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _failed = self._worker.get_finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        sending, recving, failed = self._worker.get_finished()
        return compat.transfer_results(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self):
        """This half's counters since the last call (then reset). vLLM calls it on the worker
        half (the transfer thread's counters travel to the scheduler with the step's output)
        and on the scheduler half (``PushScheduler``'s own counters), and sums the two."""
        if self._worker is not None:
            data = self._worker.stats()
        else:
            data = self._scheduler.counters.snapshot(reset=True)
        return KVPushStats(data=data) if data else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---------------------------------------------------------------------------------------
    # scheduler side
    # ---------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        block_ids = compat.new_block_ids(blocks) if num_external_tokens > 0 else []
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return PushConnectorMetadata(self._scheduler.take_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.on_step_output()
        self._scheduler.on_send_finished(connector_output.finished_sending or ())
        self._scheduler.on_recv_finished(connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]):
        return self._scheduler.request_finished(request, block_ids, compat.finished_ok(request),
                                                aborted=compat.finished_aborted(request))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        return self.request_finished(request, compat.single_group(block_ids))

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # ---------------------------------------------------------------------------------------
    # metrics
    # ---------------------------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KVPushStats(data=dict(data)) if data is not None else KVPushStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
