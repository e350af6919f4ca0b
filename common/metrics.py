"""Counters kv-push keeps (the transfer thread's, and the connector's scheduler half's),
readable from any thread.

In vLLM both halves' figures leave through vLLM's connector-stats path (``snapshot(reset=True)``
per step, see ``connector_stats``) and become Prometheus metrics ``vllm:kv_push_<name>_total``
on the API server; standalone users (demo, benchmarks, tests) read ``get`` or ``snapshot()``
directly. Names are stable: they are documented in the README.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import defaultdict
from typing import Callable

logger = logging.getLogger("kv_push")

# name -> help text; every counter the core increments is listed here.
COUNTERS = {
    "bytes_written": "KV bytes written by this producer",
    "writes_posted": "NIXL WRITE requests posted",
    "regions_written": "descriptor regions in posted WRITEs",
    "transfers_done": "transfers completed (producer: writes done; decoder: all ranks arrived)",
    "transfers_failed": "transfers that failed",
    "transfers_abandoned": "transfers not made because the request ended first, by reason: "
                           "prefill_aborted (P's request aborted: a client hang-up, the router "
                           "closing P's leg), router_release (the router ended the exchange); "
                           "not failures",
    "transfer_seconds": "sum of seconds from pairing to WRITE done (producer) / registration to last completion (decoder)",
    "queue_wait_seconds": "sum of seconds work waited in the transfer thread's inbox",
    "registrations_early": "registrations that arrived before the prefill finished",
    "registrations_late": "registrations that arrived after the prefill finished",
    "prefills_announced_early": "producer prefills announced when their step ran, not one step "
                                "later at request_finished (early_prefill_done)",
    "prefills_streamed": "producer prefills put up for layer-wise streaming by the scheduler "
                         "(layerwise); a worker without a staging pool (the host backend's "
                         "default) ignores them: layerwise_streams counts what was streamed",
    "layerwise_streams": "prefills this producer worker packed layer by layer while their step ran",
    "layerwise_transfers": "staged transfers written from a layer-wise stream (no pack after the "
                           "prefill)",
    "layerwise_evicted": "layer-wise streams whose room was given back to make room for a new "
                         "one (prefill complete, nothing reading it; later decoder requests "
                         "take the post-prefill path)",
    "layerwise_fallback": "layer-wise streaming not used, by reason: producer_pool (no room for "
                          "the stream), layout (a registration wanting other bytes: other "
                          "heads, a prefix, no slot; it waited for the complete prefill), error",
    "registrations_sent": "registrations sent by this decoder",
    "local_prefills": "decoder requests with a remote prefill that this decoder computes "
                      "itself, by reason (prompt_logprobs: vLLM computes the prompt of a "
                      "request that wants its logprobs; the producer is told to let go)",
    "cancels": "cancels sent (decoder) or honoured (producer)",
    "cancels_resent": "unanswered cancels sent again (decoder)",
    "fence_timeouts": "producers given up on after fence_timeout_s without answering a cancel",
    "lifelines_broken": "producers given up on because their side channel broke without proof "
                        "that they are gone (TCP keepalive timed out, no route); dropped "
                        "fence_timeout_s later",
    "expired": "rendezvous entries or transfers dropped after their time-out",
    "stale": "events for a superseded attempt, dropped",
    "rejected": "messages rejected (malformed, unauthenticated, replayed, unknown peer, bad "
                "layout), side-channel connections over the cap, unsigned kv_transfer_params",
    "peers_dead": "peers proven dead (lifeline closed) or given up on",
    "peers_silent": "peers found silent for 1.5 heartbeat intervals (unresponsive, not dead)",
    "handshakes": "handshakes completed",
    "handshake_failures": "handshakes that failed or timed out",
    "head_sliced_plans": "plans that had to cut head slices out of token-major blocks",
    "handshake_refusals": "handshakes refused for incompatibility (label: the producer's side "
                          "channel HOST:PORT, then the reason)",
    "load_failures": "KV loads that failed and went to vLLM's kv_load_failure_policy "
                     "(label: recompute or fail)",
    "load_failures_before_fence_end": "of load_failures, those reported to vLLM while their "
                                      "blocks stayed fenced (a producer silent or failing with "
                                      "a WRITE possibly in flight): the request fails at once, "
                                      "vLLM frees its blocks when the fence ends",
    "staged_transfers": "staged transfers: sub-slices packed and written (producer) / unpacked (decoder)",
    "staged_chunks": "staged chunks written (producer) / unpacked (decoder)",
    "staged_bytes": "bytes moved through staging (producer: written; decoder: unpacked)",
    "staging_launches": "kernel launches of staged pack/unpack (label: the kernels, triton = "
                        "one fused launch per chunk, torch = one op per layer, part and segment)",
    "staged_fallback": "registrations that took the region path although staging was on, by reason",
    "side_channel_probes": "side-channel connections that read the challenge and closed "
                           "without a frame (the router's /health?probe), not handshakes",
    "released": "prefills freed at once by a router Release (no decoder had claimed them)",
    "release_deferred": "prefills of a released transfer left to their decoder's fence/cancel "
                        "path (already claimed); freed when those claims are done",
    "release_rejected": "router Releases refused by this producer (label: the reason: bad_mac, "
                        "unauthenticated, replayed, ...)",
    "forgotten": "transfer ids the router released (label released_tids) or prefills that "
                 "expired unclaimed (expired_keys) forgotten before rendezvous_ttl_s, because "
                 "more than 65,536 came within it: a prefill of such a transfer that finishes "
                 "later is held until its TTL instead of freed at once",
}


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = defaultdict(float)
        self._labelled: dict[tuple[str, str], float] = defaultdict(float)
        # rejections are logged per (counter, reason, context): once, then at most once a
        # minute with a count; bounded (a set of every context ever seen grew with the peers
        # and transfers named in contexts)
        self._reject_log = LogLimiter(logger, max_keys=1024)

    def inc(self, name: str, amount: float = 1.0, label: str | None = None) -> None:
        if name not in COUNTERS:
            raise KeyError(f"undeclared counter {name}")
        with self._lock:
            self._values[name] += amount
            if label is not None:
                self._labelled[(name, label)] += amount

    def reject(self, reason: str, detail: str, context: str = "",
               counter: str = "rejected") -> None:
        """Count a rejected message in ``counter`` (labelled ``reason``) and log it: once per
        (counter, reason, context), then at most once a minute with a count (``LogLimiter``).
        ``context`` names where (a peer, a message kind), never a request or transfer."""
        self.inc(counter, label=reason)
        self._reject_log.warn(f"{counter}:{reason} {context}",
                              "kv_push: rejected message (%s) %s%s", reason, detail,
                              f" [{context}]" if context else "")

    def get(self, name: str, label: str | None = None) -> float:
        with self._lock:
            if label is None:
                return self._values.get(name, 0.0)
            return self._labelled.get((name, label), 0.0)

    def snapshot(self, reset: bool = False) -> dict[str, float]:
        with self._lock:
            out = dict(self._values)
            out.update({f"{n}{{{l}}}": v for (n, l), v in self._labelled.items()})
            if reset:
                self._values.clear()
                self._labelled.clear()
        return out


def log_key(text: str) -> str:
    """``text`` (a free-text reason) as a ``LogLimiter`` key: numbers and long hex ids made
    one, so reasons that differ only in a request's figures ("wants 300 tokens, has 256")
    share a key instead of each being logged as new."""
    return _FIGURES.sub("#", text)


_FIGURES = re.compile(r"\b[0-9a-f]{8,}\b|\d+")


class LogLimiter:
    """Log a repeated warning once, then at most once per ``every_s`` with a count.

    ``warn(key, msg, *args)`` logs at WARNING the first time ``key`` is seen and then whenever
    ``every_s`` has passed since the last time it did (adding how many were suppressed); in
    between at DEBUG. ``key`` names the kind of event (a reason, a peer pair), never a request.
    At most ``max_keys`` keys are remembered (then it starts afresh), so unbounded keys cannot
    grow memory. Thread-safe.
    """

    def __init__(self, log: logging.Logger, every_s: float = 60.0, max_keys: int = 256,
                 clock: Callable[[], float] = time.monotonic):
        self.log, self.every_s, self.max_keys, self.clock = log, every_s, max_keys, clock
        self._lock = threading.Lock()
        self._seen: dict[str, list] = {}  # key -> [last logged at, suppressed since]

    def warn(self, key: str, msg: str, *args) -> bool:
        """Returns True when this call logged at WARNING."""
        now = self.clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is None:
                if len(self._seen) >= self.max_keys:
                    self._seen.clear()
                self._seen[key] = [now, 0]
                suppressed, loud = 0, True
            elif now - entry[0] >= self.every_s:
                suppressed, entry[0], entry[1], loud = entry[1], now, 0, True
            else:
                entry[1] += 1
                suppressed, loud = 0, False
        if loud:
            tail = f" ({suppressed} more like this since, logged at DEBUG)" if suppressed else ""
            self.log.warning(msg + tail, *args)
        else:
            self.log.debug(msg, *args)
        return loud
