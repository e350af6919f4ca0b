"""Scheduler half of the vLLM connector: decides what each worker hands to its transfer thread.

It runs in vLLM's scheduler (engine-core) process and never touches NIXL. Each step it packs a
``PushConnectorMetadata`` that every worker receives:

* producer (``kv_producer``): when a request whose ``kv_transfer_params`` carry
  ``do_remote_decode`` finishes its prefill, ``request_finished`` keeps its blocks (delay free)
  and stages a ``PrefillReady``; the workers hand it to the rendezvous. The blocks are freed when
  every worker reports the request in ``finished_sending``. A request that ends without a
  usable prefill (aborted, error) stages ``prefill_aborts`` so decoders hear at once.
* decoder (``kv_consumer``): ``get_num_new_matched_tokens`` claims the prompt tokens the
  decoder does not have locally, asynchronously; ``update_state_after_alloc`` stages an
  ``Expect`` with the freshly allocated block ids; the workers register them with the producer.
  A request aborted while waiting stages a cancel; vLLM keeps its blocks until the workers report
  it in ``finished_recving``, which they do only once no producer can still write into them.
  A full local prefix hit (nothing to receive) still tells the producer, so it frees its blocks.
  A request that ends before it was ever staged tells the producer to let go (a release-only
  registration), unless this scheduler already told a producer about that transfer id: vLLM's
  API server submits a pre-aborted copy of a request's ``kv_transfer_params`` when its handler
  fails or is cancelled (``notify_kv_transfer_request_rejected``, vLLM 0.29 and 0.32) -- also
  when the request itself did reach the engine, e.g. a client that hung up mid-request. A second
  registration of the same transfer id then displaced the live request's want on the decoder,
  whose ``CancelAck`` was dropped as stale: its blocks stayed fenced for good.

The request-level parameters come from the router (see ``TransferParams``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)

#: Prefix of decoder keys whose outcome no vLLM request waits for (release-only registrations).
RELEASE_KEY_PREFIX = "release:"
#: how long (and how many) transfer ids the decoder scheduler remembers having told a producer
#: about; far longer than any producer keeps a transfer (its rendezvous time-out)
TOLD_TTL_S = 3600.0
TOLD_MAX = 1 << 16


class TransferParamsError(ValueError):
    pass


@dataclass(frozen=True)
class TransferParams:
    """What the router puts in a request's ``kv_transfer_params``.

    Producer leg: ``{"transfer_id": tid, "do_remote_decode": true}``.
    Decoder leg:  ``{"transfer_id": tid, "do_remote_prefill": true, "remote_host": h,
    "remote_port": p}`` where ``h:p`` is the producer's handshake side channel (rank 0).
    """

    transfer_id: str
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str = ""
    remote_port: int = 0

    @classmethod
    def parse(cls, raw: Any) -> "TransferParams | None":
        """None when the request is not ours; TransferParamsError when it is but is malformed."""
        if not isinstance(raw, dict) or "transfer_id" not in raw:
            return None
        tid = raw.get("transfer_id")
        if not isinstance(tid, str) or not tid or len(tid) > 256:
            raise TransferParamsError(f"transfer_id must be a non-empty string, got {tid!r}")
        decode, prefill = bool(raw.get("do_remote_decode")), bool(raw.get("do_remote_prefill"))
        if decode == prefill:
            raise TransferParamsError("exactly one of do_remote_decode / do_remote_prefill")
        host, port = raw.get("remote_host", ""), raw.get("remote_port", 0)
        if prefill:
            if not isinstance(host, str) or not host:
                raise TransferParamsError(f"remote_host must be a host name, got {host!r}")
            try:
                port = int(port)
            except (TypeError, ValueError):
                raise TransferParamsError(f"remote_port must be a port, got {port!r}") from None
            if not 0 < port < 65536:
                raise TransferParamsError(f"remote_port must be a port, got {port!r}")
        return cls(tid, decode, prefill, host or "", int(port or 0))


@dataclass(frozen=True)
class PrefillReady:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class Expect:
    key: str  # the vLLM request id, or RELEASE_KEY_PREFIX + id for release-only
    transfer_id: str
    attempt: int
    host: str
    port: int
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int


@dataclass
class StepPlan:
    """The per-step payload; the connector wraps it in vLLM's metadata class."""

    prefills: list[PrefillReady] = field(default_factory=list)
    prefill_aborts: list[str] = field(default_factory=list)
    expects: list[Expect] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.prefill_aborts or self.expects or self.cancels)


@dataclass
class _Waiting:
    params: TransferParams
    local_tokens: int = 0
    staged: bool = False  # an Expect went out for the current attempt
    attempt: int = -1


class PushScheduler:
    """Pure bookkeeping over duck-typed vLLM requests; unit-testable without vLLM."""

    def __init__(self, *, is_producer: bool, is_decoder: bool, block_size: int,
                 counters=None, clock: Callable[[], float] = time.monotonic):
        self.is_producer = is_producer
        self.is_decoder = is_decoder
        self.block_size = block_size
        self.counters = counters
        self._plan = StepPlan()
        self._waiting: dict[str, _Waiting] = {}  # decoder requests we claimed tokens for
        self._received: set[str] = set()  # decoder requests whose KV already arrived once
        self._held: set[str] = set()  # producer requests whose blocks we keep
        self._clock = clock
        # decoder: transfer id -> when an Expect (real or release) for it went out
        self._told: OrderedDict[str, float] = OrderedDict()

    def _tell(self, expect: "Expect") -> None:
        self._plan.expects.append(expect)
        self._told[expect.transfer_id] = self._clock()
        self._told.move_to_end(expect.transfer_id)
        while len(self._told) > TOLD_MAX:
            self._told.popitem(last=False)

    def _told_before(self, transfer_id: str) -> bool:
        now = self._clock()
        while self._told and now - next(iter(self._told.values())) > TOLD_TTL_S:
            self._told.popitem(last=False)
        return transfer_id in self._told

    def _release(self, rid: str, p: TransferParams, attempt: int, first: int) -> None:
        """Let the producer free its prefill for ``p`` (nothing will be received for it), once
        per transfer id (see the module docstring)."""
        if self._told_before(p.transfer_id):
            logger.debug("kv_push: request %s ended unseen; transfer %s was already handled "
                         "(vLLM's rejection notice, or a request sharing it): no release",
                         rid, p.transfer_id)
            return
        self._tell(Expect(RELEASE_KEY_PREFIX + rid, p.transfer_id, attempt, p.remote_host,
                          p.remote_port, (), first, first))

    # -- helpers -------------------------------------------------------------------------------
    def _params(self, request) -> TransferParams | None:
        try:
            return TransferParams.parse(getattr(request, "kv_transfer_params", None))
        except TransferParamsError as e:
            logger.warning("kv_push: request %s has bad kv_transfer_params (%s); "
                           "serving it without KV transfer", request.request_id, e)
            if self.counters is not None:
                self.counters.inc("rejected", label="bad_transfer_params")
            return None

    # -- decoder ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.is_decoder:
            return 0, False
        params = self._params(request)
        if params is None or not params.do_remote_prefill or request.request_id in self._received:
            return 0, False
        prompt = len(request.prompt_token_ids or ())
        count = prompt - num_computed_tokens
        w = self._waiting.setdefault(request.request_id, _Waiting(params))
        w.local_tokens = num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(self, request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """``block_ids``: the request's newly allocated (not prefix-cached) block ids."""
        w = self._waiting.get(request.request_id)
        if w is None or w.staged:
            return
        p = w.params
        w.staged = True
        w.attempt += 1
        if num_external_tokens <= 0:
            # nothing to receive (full local hit): let the producer free its blocks now
            self._release(request.request_id, p, w.attempt, w.local_tokens)
            self._waiting.pop(request.request_id, None)
            self._received.add(request.request_id)
            return
        first = w.local_tokens
        need = -(-num_external_tokens // self.block_size)
        if first % self.block_size or len(block_ids) < need:
            raise RuntimeError(
                f"kv_push: request {request.request_id}: {len(block_ids)} new blocks from token "
                f"{first} cannot hold {num_external_tokens} tokens (block size {self.block_size})")
        self._tell(Expect(
            request.request_id, p.transfer_id, w.attempt, p.remote_host, p.remote_port,
            tuple(block_ids[:need]), first, first + num_external_tokens))

    def on_recv_finished(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            if self._waiting.pop(rid, None) is not None:
                self._received.add(rid)

    # -- both ------------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int], finished_ok: bool
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        was_received = rid in self._received
        self._received.discard(rid)
        w = self._waiting.pop(rid, None)
        if w is None and self.is_decoder and not was_received:
            # a decoder request that ends before the scheduler ever looked at it (aborted while
            # queued): the producer may hold its prefill for it, so still tell it to let go
            params = self._params(request)
            if params is not None and params.do_remote_prefill:
                w = _Waiting(params)
        if w is not None:
            # a decoder request that ends before its KV arrived
            if w.staged:
                self._plan.cancels.append(rid)  # vLLM holds the blocks until we report it
            else:  # never allocated: still let the producer free its blocks
                self._release(rid, w.params, 0, 0)
            return False, None
        if not self.is_producer:
            return False, None
        params = self._params(request)
        if params is None or not params.do_remote_decode:
            return False, None
        if not finished_ok or not block_ids:
            self._plan.prefill_aborts.append(params.transfer_id)
            return False, None
        self._plan.prefills.append(PrefillReady(rid, params.transfer_id, tuple(block_ids),
                                                int(request.num_computed_tokens)))
        self._held.add(rid)
        return True, {"transfer_id": params.transfer_id}

    def on_send_finished(self, req_ids: Iterable[str]) -> None:
        self._held.difference_update(req_ids)

    def has_pending_work(self) -> bool:
        return bool(self._held) or bool(self._plan)

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan
