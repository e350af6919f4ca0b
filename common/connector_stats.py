"""Connector statistics through vLLM's connector-stats path, into vLLM's Prometheus /metrics.

Each worker's transfer thread keeps ``Counters``, and so does the scheduler half
(``PushScheduler``: what it rejects before any worker sees a request). Every step vLLM asks both
halves for ``get_kv_connector_stats`` (a snapshot, then reset): the workers' ride to the
scheduler process with the step's output, vLLM adds the scheduler half's to them
(``KVPushStats.aggregate``), and the API server calls ``KVPushPromMetrics.observe``, which adds
the deltas to counters named ``vllm:kv_push_<counter>_total`` (labelled counters keep their label
as ``reason``). A counter counted by reason is exported by reason only: its series without a
reason carries just what was counted without one, so ``sum()`` over a family never counts twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .metrics import COUNTERS


@dataclass
class KVPushStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVPushStats":
        merged = dict(self.data)
        for key, value in (other.data or {}).items():
            merged[key] = merged.get(key, 0.0) + value
        return KVPushStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 6) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _split(key: str) -> tuple[str, str | None]:
    if key.endswith("}") and "{" in key:
        name, _, label = key[:-1].partition("{")
        return name, label
    return key, None


class KVPushPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = {}
        for name, doc in COUNTERS.items():
            self._metrics[name] = self._counter_cls(
                name=f"vllm:kv_push_{name}", documentation=doc,
                labelnames=[*labelnames, "reason"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        by_reason: dict[str, float] = {}  # per counter, what its labelled keys already carry
        for key, value in transfer_stats_data.items():
            name, label = _split(key)
            if label is not None:
                by_reason[name] = by_reason.get(name, 0.0) + value
        for key, value in transfer_stats_data.items():
            name, label = _split(key)
            metric = self._metrics.get(name)
            if label is None:  # Counters.snapshot gives the total beside the labelled keys
                value -= by_reason.get(name, 0.0)
            if metric is None or value <= 1e-9:
                continue
            metric.labels(*engine_labels, label or "").inc(value)
