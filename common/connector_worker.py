"""Worker half of the vLLM connector: thin glue between vLLM's worker hooks and ``PushWorker``.

Runs in each vLLM worker process (one per TP rank). ``register_kv_caches`` describes the KV
tensors (through the chosen backend) and starts the ``PushWorker``; ``handle`` hands a step's
metadata to the transfer thread (enqueue only); ``on_saved`` (vLLM's ``wait_for_save``) hands it
the step's ``completing`` prefills where the backend's KV is written by then (host), else the
next ``handle`` does (``connector_scheduler``: early announcement); ``get_finished`` drains what
the transfer thread finished:

* ``finished_sending``: producer requests whose blocks may be freed (one announced early at
  this step's ``wait_for_save`` only from the next step on: vLLM frees the blocks of each
  request it is told about, and that request ends only in this step's output);
* ``finished_recving``: decoder requests whose KV arrived -- or failed -- or that were aborted,
  each once no producer can write into its blocks any more; a failure is reported with it (in
  ``failed_recving`` where vLLM has it, else as load errors of its blocks through
  ``get_block_ids_with_load_errors``), and vLLM recomputes or fails the request per
  ``kv_load_failure_policy``;
* a failure decided while the blocks must stay fenced (a producer went silent and may be frozen
  with a WRITE in flight) is reported at once instead, as load errors of the request's blocks:
  vLLM's contract lets a connector report those in any step up to the one that names the
  request in ``finished_recving``, and vLLM (0.29 and 0.32 read here) ends a request that fails
  while it waits for remote KV at once but holds its blocks until ``finished_recving`` names it
  (as for a client's abort). So its client gets the error (``fail``) without waiting out the
  fence; with ``recompute`` the request waits for the fence as before. vLLM takes block-level
  errors only with one KV cache group (``early_failures``).

In a step that runs no model (``StepPlan.idle``: every request there waits for its KV, or for
its blocks to be freed) while a request's KV may still arrive, ``get_finished`` first waits up
to ``idle_step_wait_s`` for an outcome: vLLM steps such an engine about once a millisecond (a
look, then a 1 ms sleep), and an outcome that comes during the wait is reported in that step
instead of at the next look. The engine is blocked meanwhile; it runs no model, so only a
request or an abort that reaches it then waits as long. Only where vLLM runs one step at a time
with one engine (``connector._idle_step_wait``): where it plans the next step first (async
scheduling, pipeline parallelism) the wait would delay what was just reported, and data-parallel
ranks step in lockstep.
"""

from __future__ import annotations

import logging
from typing import Any

from .backend import select_backend
from .config import PushConfig
from . import timing
from .connector_scheduler import RELEASE_KEY_PREFIX, PrefillReady, StepPlan
from .kv_tensors import describe_kv_caches
from .metrics import Counters, LogLimiter, log_key
from .worker import PushWorker

#: what a producer's decoders are told when vLLM aborted its request: the client hung up, or
#: the router closed P's leg (its exchange ended: the client gone, D failed, P's leg timed
#: out); also an engine shut down or paused with abort (counted as abandoned, not failed)
PREFILL_ABORTED = "prefill request aborted by vLLM (its HTTP request or the engine ended it)"

logger = logging.getLogger(__name__)


class PushConnectorWorker:
    def __init__(self, *, config: PushConfig, role: str, engine_id: str, tp_rank: int,
                 tp_size: int, num_kv_heads: int, head_size: int, block_size: int, dtype: str,
                 load_failure_policy: str = "fail", failed_recving: bool = False,
                 early_failures: bool = True, idle_step_wait_s: float | None = None):
        """``load_failure_policy``: vLLM's ``kv_load_failure_policy`` (``recompute`` or
        ``fail``), only to label the ``load_failures`` counter: vLLM applies it.
        ``failed_recving``: vLLM takes a failure together with the request's
        ``finished_recving`` in ``failed_recving`` (block ids with load errors are then reported
        only for failures reported before that). ``early_failures``: report a failure decided
        while the blocks stay fenced at once, as load errors of its blocks (module docstring);
        vLLM takes those only with one KV cache group. ``idle_step_wait_s``: how long
        ``get_finished`` may wait in a step that runs no model (module docstring; None:
        ``config``'s; the connector turns it off where vLLM plans steps ahead)."""
        self.config = config
        self.idle_step_wait_s = (config.idle_step_wait_s if idle_step_wait_s is None
                                 else idle_step_wait_s)
        self.load_failure_policy = load_failure_policy
        self.failed_recving = failed_recving
        self.early_failures = early_failures
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
        self._failed_early: set[str] = set()  # decoder keys reported failed, blocks still fenced
        self._ended: set[str] = set()  # decoder keys vLLM ended (cancelled) before their outcome
        self._attempts: dict[str, int] = {}  # decoder key -> the attempt vLLM waits for
        #: the KV a step computes is in memory when ``wait_for_save`` runs (host: the forward
        #: ran synchronously); else it is ordered before the next step's bind
        self.kv_ready_at_save = bool(getattr(self.backend, "kv_ready_at_save", False))
        self._completing: list[PrefillReady] = []  # this step's, not yet announced
        self._saved_now: set[str] = set()  # announced at this step's save: report from the next
        self._held_back: list[str] = []  # released keys of _saved_now, for the next step
        self._reportable: list[str] = []  # held back in an earlier step: reported at the next call
        self._tids: dict[str, str] = {}  # decoder key -> transfer id (timing lines only)
        self._layers: dict[str, int] = {}  # layer name -> its index in the registered geometry
        self._streaming = False  # this step streams prefills (layer-wise): report its layers
        self._idle_step = False  # this step runs no model (``StepPlan.idle``)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        tensors, seen = [], set()
        for name, t in kv_caches.items():
            ptr = int(t.data_ptr())
            if ptr in seen:  # layers sharing one cache (cross-layer KV sharing)
                logger.info("kv_push: layer %s shares its KV cache; registered once", name)
                continue
            seen.add(ptr)
            self._layers[name] = len(tensors)
            tensors.append(t)
        geometry = describe_kv_caches(
            tensors, backend=self.backend, num_kv_heads=self.num_kv_heads,
            head_size=self.head_size, block_size=self.block_size, tp_size=self.tp_size,
            tp_rank=self.tp_rank, dtype=self.dtype)
        self.worker = PushWorker(geometry=geometry, role=self.role, config=self.config,
                                 engine_id=self.engine_id, backend=self.backend,
                                 counters=self.counters,
                                 early_verdicts=self.early_failures).start()
        logger.info("kv_push: %s rank %d/%d ready: %d layers, %d blocks of %d tokens, %s %s, "
                    "backend %s%s", self.role, self.tp_rank, self.tp_size, geometry.num_layers,
                    geometry.num_blocks, geometry.block_size, geometry.token_order,
                    "split K/V" if geometry.kv_parts == 2 else "combined K|V", self.backend.name,
                    f", handshakes on {self.worker.side_channel_address}"
                    if self.worker.side_channel else "")

    def handle(self, plan: StepPlan) -> None:
        """Hand one step's work to the transfer thread. Enqueue only."""
        w = self.worker
        # the previous step's work is ordered before this bind: its completing prefills go now
        # (accelerators; or a step whose wait_for_save did not come), and what was announced
        # at its save may be reported released from this step on
        pending, self._completing = self._completing, list(plan.completing)
        self._idle_step = plan.idle
        if self._streaming and self.worker is not None:  # a step whose wait_for_save did not come
            self._streaming = False
            self.worker.step_saved()
        for p in pending:
            self._prefill_done(p, "early_bind")
        self._saved_now.clear()
        self._reportable += self._held_back
        self._held_back = []
        if w is None or not plan:
            return
        for p in plan.prefills:
            self._prefill_done(p, "request_finished")
        for a in plan.prefill_aborts:
            w.prefill_failed(a.transfer_id, PREFILL_ABORTED if a.aborted else
                             "prefill request ended without output",
                             abandoned="prefill_aborted" if a.aborted else "",
                             prompt_digest=a.prompt_digest, capacity=a.capacity,
                             key=a.req_id if a.held else None)
        self._streaming = bool(plan.streaming) and w.streams
        for p in plan.streaming:
            w.prefill_started(p.req_id, p.transfer_id, p.block_ids, p.num_tokens,
                              prompt_digest=p.prompt_digest, capacity=p.capacity)
        for e in plan.expects:
            if not e.key.startswith(RELEASE_KEY_PREFIX):
                self._blocks[e.key] = e.block_ids
                self._attempts[e.key] = e.attempt
                self._abandoned.discard(e.key)
                self._failed_early.discard(e.key)
                self._ended.discard(e.key)
            w.expect(e.key, e.transfer_id, e.attempt, (e.host, e.port), e.block_ids,
                     e.first_token, e.num_tokens, prompt_digest=e.prompt_digest)
        for key in plan.cancels:
            if key in self._blocks:  # its outcome is still to come
                self._ended.add(key)
            w.cancel(key, "request finished before its KV arrived")
        for key in plan.abandons:
            self._abandoned.add(key)
            w.cancel(key, "request re-scheduled to compute locally")
        if timing.ENABLED:
            for e in plan.expects:
                self._tids[e.key] = e.transfer_id
                timing.stamp("d_expect", e.transfer_id, key=e.key)

    def on_layer_saved(self, layer_name: str) -> None:
        """vLLM's ``save_kv_layer``: the layer's KV writes of this step are enqueued. When the
        step streams prefills, the worker packs that layer of them (enqueue only)."""
        if self._streaming:
            layer = self._layers.get(layer_name)
            if layer is not None:
                self.worker.layer_saved(layer)

    def on_saved(self) -> None:
        """vLLM's ``wait_for_save``: the step's forward ran. Streamed prefills pack what is left;
        where the step's KV is in memory now (host backend), its completing prefills go to the
        rendezvous."""
        if self._streaming:
            self._streaming = False
            self.worker.step_saved()
        if self.kv_ready_at_save and self._completing:
            done, self._completing = self._completing, []
            for p in done:
                self._prefill_done(p, "early_save")
            self._saved_now.update(p.req_id for p in done)

    def _prefill_done(self, p: PrefillReady, how: str) -> None:
        if self.worker is None:
            return
        if timing.ENABLED:
            timing.stamp("p_prefill_done", p.transfer_id, key=p.req_id, how=how)
        self.worker.prefill_done(p.req_id, p.transfer_id, p.block_ids, p.num_tokens,
                                 prompt_digest=p.prompt_digest, capacity=p.capacity)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving); a failed id is in recving in
        the same call -- unless it was reported early (load errors only), then it is in recving
        alone, once its blocks are no longer fenced."""
        w = self.worker
        if w is None:
            return set(), set(), set()
        sending: set[str] = set()
        if w.producer:
            sending.update(self._reportable)
            self._reportable = []
            for key in w.drain_released():
                if key in self._saved_now:  # vLLM ends that request in this step's output
                    self._held_back.append(key)
                else:
                    sending.add(key)
        recving: set[str] = set()
        failed: set[str] = set()
        if w.decoder:
            # in a step that runs no model, with KV awaited, an outcome that comes within
            # idle_step_wait_s is reported now instead of at the next step's look
            wait = self.idle_step_wait_s if self._idle_step and self._awaited() else 0.0
            self._idle_step = False  # this step's: a call without a bind before it never waits
            w.await_outcomes(wait)
            for o in w.drain_outcomes():
                if o.key.startswith(RELEASE_KEY_PREFIX):
                    continue
                if o.attempt < self._attempts.get(o.key, o.attempt):
                    continue  # a superseded attempt's: vLLM waits for the newer one's
                self._attempts.pop(o.key, None)
                self._ended.discard(o.key)
                if o.key in self._abandoned:
                    self._abandoned.discard(o.key)
                    self._failed_early.discard(o.key)
                    self._blocks.pop(o.key, None)
                    self._tids.pop(o.key, None)
                    continue
                blocks = self._blocks.pop(o.key, ())
                if o.key in self._failed_early:  # reported failed already; now it may be freed
                    self._failed_early.discard(o.key)
                elif o.kind == "failed":
                    self._report_failed(o, blocks, failed, early=False)
                recving.add(o.key)
                if timing.ENABLED:
                    timing.stamp("d_recv_reported", self._tids.pop(o.key, ""), key=o.key,
                                 outcome=o.kind)
            # after the outcomes: a verdict whose outcome was just reported finds no blocks
            for v in w.drain_verdicts():
                if (v.key not in self._blocks or v.key in self._abandoned
                        or v.key in self._ended or v.key in self._failed_early
                        or v.attempt < self._attempts.get(v.key, v.attempt)):
                    # its outcome came first, vLLM ended or gave up the request (it would
                    # ignore the report), or a superseded attempt's
                    continue
                self._report_failed(v, self._blocks[v.key], failed, early=True)
                self._failed_early.add(v.key)
                self.counters.inc("load_failures_before_fence_end")
        return sending, recving, failed

    def _awaited(self) -> bool:
        """A request vLLM waits for whose KV may still arrive (not one reported failed while
        fenced, ended by vLLM or given up: their outcome only ends a fence)."""
        gone = (self._failed_early, self._ended, self._abandoned)
        return any(not any(k in g for g in gone) for k in self._blocks)

    def _report_failed(self, o, blocks, failed: set[str], *, early: bool) -> None:
        self.counters.inc("load_failures", label=self.load_failure_policy)
        self._log.warn(f"failed {log_key(o.reason)}", "kv_push: KV for request %s failed "
                       "(kv_load_failure_policy=%s)%s: %s", o.key, self.load_failure_policy,
                       "; its blocks stay held until no WRITE can land in them" if early else "",
                       o.reason)
        if early or not self.failed_recving:
            self._load_errors.update(blocks)
        if not early:
            failed.add(o.key)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> dict[str, float]:
        return self.counters.snapshot(reset=True)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
