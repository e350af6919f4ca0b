"""Worker half of the vLLM connector: thin glue between vLLM's worker hooks and ``PushWorker``.

Runs in each vLLM worker process (one per TP rank). ``register_kv_caches`` describes the KV
tensors (through the chosen backend) and starts the ``PushWorker``; ``handle`` hands a step's
metadata to the transfer thread (enqueue only); ``get_finished`` drains what the transfer thread
finished:

* ``finished_sending``: producer requests whose blocks may be freed;
* ``finished_recving``: decoder requests whose KV arrived -- or failed (their block ids are
  reported once through ``get_block_ids_with_load_errors``, and vLLM recomputes or fails them
  per ``kv_load_failure_policy``) -- or that were aborted and are now safe to free.
"""

from __future__ import annotations

import logging
from typing import Any

from .backend import select_backend
from .config import PushConfig
from .connector_scheduler import RELEASE_KEY_PREFIX, StepPlan
from .kv_tensors import describe_kv_caches
from .metrics import Counters, LogLimiter
from .worker import PushWorker

logger = logging.getLogger(__name__)


class PushConnectorWorker:
    def __init__(self, *, config: PushConfig, role: str, engine_id: str, tp_rank: int,
                 tp_size: int, num_kv_heads: int, head_size: int, block_size: int, dtype: str,
                 load_failure_policy: str = "fail"):
        """``load_failure_policy``: vLLM's ``kv_load_failure_policy`` (``recompute`` or
        ``fail``), only to label the ``load_failures`` counter: vLLM applies it."""
        self.config = config
        self.load_failure_policy = load_failure_policy
        self._log = LogLimiter(logger)
        self.role = role
        self.engine_id = engine_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self.block_size, self.dtype = block_size, dtype
        self.backend = select_backend(config.backend or None)
        self.counters = Counters()
        self.worker: PushWorker | None = None
        self._blocks: dict[str, tuple[int, ...]] = {}  # decoder key -> its block ids
        self._load_errors: set[int] = set()
        self._abandoned: set[str] = set()  # decoder keys whose outcome vLLM no longer expects
        self._attempts: dict[str, int] = {}  # decoder key -> the attempt vLLM waits for

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        tensors, seen = [], set()
        for name, t in kv_caches.items():
            ptr = int(t.data_ptr())
            if ptr in seen:  # layers sharing one cache (cross-layer KV sharing)
                logger.info("kv_push: layer %s shares its KV cache; registered once", name)
                continue
            seen.add(ptr)
            tensors.append(t)
        geometry = describe_kv_caches(
            tensors, backend=self.backend, num_kv_heads=self.num_kv_heads,
            head_size=self.head_size, block_size=self.block_size, tp_size=self.tp_size,
            tp_rank=self.tp_rank, dtype=self.dtype)
        self.worker = PushWorker(geometry=geometry, role=self.role, config=self.config,
                                 engine_id=self.engine_id, backend=self.backend,
                                 counters=self.counters).start()
        logger.info("kv_push: %s rank %d/%d ready: %d layers, %d blocks of %d tokens, %s %s, "
                    "backend %s%s", self.role, self.tp_rank, self.tp_size, geometry.num_layers,
                    geometry.num_blocks, geometry.block_size, geometry.token_order,
                    "split K/V" if geometry.kv_parts == 2 else "combined K|V", self.backend.name,
                    f", handshakes on {self.worker.side_channel_address}"
                    if self.worker.side_channel else "")

    def handle(self, plan: StepPlan) -> None:
        """Hand one step's work to the transfer thread. Enqueue only."""
        w = self.worker
        if w is None or not plan:
            return
        for p in plan.prefills:
            w.prefill_done(p.req_id, p.transfer_id, p.block_ids, p.num_tokens,
                           prompt_digest=p.prompt_digest, capacity=p.capacity)
        for a in plan.prefill_aborts:
            w.prefill_failed(a.transfer_id, "prefill request ended without output",
                             prompt_digest=a.prompt_digest, capacity=a.capacity)
        for e in plan.expects:
            if not e.key.startswith(RELEASE_KEY_PREFIX):
                self._blocks[e.key] = e.block_ids
                self._attempts[e.key] = e.attempt
                self._abandoned.discard(e.key)
            w.expect(e.key, e.transfer_id, e.attempt, (e.host, e.port), e.block_ids,
                     e.first_token, e.num_tokens, prompt_digest=e.prompt_digest)
        for key in plan.cancels:
            w.cancel(key, "request finished before its KV arrived")
        for key in plan.abandons:
            self._abandoned.add(key)
            w.cancel(key, "request re-scheduled to compute locally")

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving); failed ids are also in recving."""
        w = self.worker
        if w is None:
            return set(), set(), set()
        sending = set(w.drain_released()) if w.producer else set()
        recving: set[str] = set()
        failed: set[str] = set()
        if w.decoder:
            for o in w.drain_outcomes():
                if o.key.startswith(RELEASE_KEY_PREFIX):
                    continue
                if o.attempt < self._attempts.get(o.key, o.attempt):
                    continue  # a superseded attempt's: vLLM waits for the newer one's
                self._attempts.pop(o.key, None)
                if o.key in self._abandoned:
                    self._abandoned.discard(o.key)
                    self._blocks.pop(o.key, None)
                    continue
                blocks = self._blocks.pop(o.key, ())
                if o.kind == "failed":
                    self.counters.inc("load_failures", label=self.load_failure_policy)
                    self._log.warn(f"failed {o.reason}", "kv_push: KV for request %s failed "
                                   "(kv_load_failure_policy=%s): %s", o.key,
                                   self.load_failure_policy, o.reason)
                    self._load_errors.update(blocks)
                    failed.add(o.key)
                recving.add(o.key)
        return sending, recving, failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> dict[str, float]:
        return self.counters.snapshot(reset=True)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
