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

Identity: vLLM splits a client request with a prompt list or ``n > 1`` into several engine
requests that share ``kv_transfer_params``. Both halves therefore name a request's prompt by
``prompt_digest`` (a digest of its token ids, the same on P and D) and the decoder registers
under its own engine request id, so each decoder request gets the KV of its own prompt.

The request-level parameters come from the router (see ``TransferParams``). With a secret they
count only when the router signed them (``auth.verify_transfer_params``): otherwise the request
is served without KV transfer (a decoder prefills locally, a producer frees its blocks as usual),
counted as ``rejected{<reason>}`` and logged once per request -- a decoder never dials a host a
client chose, a producer never holds blocks a client asked it to.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .auth import SIG_KEY, ParamsSignatureError, verify_transfer_params
from .messages import prompt_digest
from .metrics import Counters

logger = logging.getLogger(__name__)

#: Prefix of decoder keys whose outcome no vLLM request waits for (release-only registrations).
RELEASE_KEY_PREFIX = "release:"


#: the most decoder requests one prefill may serve (``fanout``)
MAX_FANOUT = 1024


class TransferParamsError(ValueError):
    """``reason``: the metrics label (``bad_transfer_params``, or a signature problem:
    ``unsigned_transfer_params``, ``bad_transfer_params_signature``,
    ``expired_transfer_params``)."""

    def __init__(self, message: str, reason: str = "bad_transfer_params"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TransferParams:
    """What the router puts in a request's ``kv_transfer_params``.

    Producer leg: ``{"transfer_id": tid, "do_remote_decode": true}``, optionally with
    ``"fanout": n``: each prefill of this leg serves ``n`` decoder requests of the same prompt
    (the router sends P one sample while D samples ``n``; default 1).
    Decoder leg:  ``{"transfer_id": tid, "do_remote_prefill": true, "remote_host": h,
    "remote_port": p}`` where ``h:p`` is the producer's handshake side channel (rank 0).
    With a secret, both also carry the router's signature under ``kv_push_sig``.
    """

    transfer_id: str
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str = ""
    remote_port: int = 0
    fanout: int = 1

    @classmethod
    def parse(cls, raw: Any, secret: bytes = b"", now: float | None = None
              ) -> "TransferParams | None":
        """None when the request is not ours; TransferParamsError when it is but is malformed
        or (with ``secret``) not validly signed by the router at ``now`` (default: the time)."""
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
        fanout = raw.get("fanout", 1)
        if isinstance(fanout, bool) or not isinstance(fanout, int) or not (
                1 <= fanout <= MAX_FANOUT):
            raise TransferParamsError(f"fanout must be an integer in [1, {MAX_FANOUT}], "
                                      f"got {fanout!r}")
        params = cls(tid, decode, prefill, host or "", int(port or 0), fanout)
        if secret:
            # the signature covers what makes a server dial or hold blocks (``fanout``: how
            # many decoder requests a prefill's blocks wait for)
            try:
                verify_transfer_params(
                    raw.get(SIG_KEY), secret, transfer_id=params.transfer_id,
                    do_remote_decode=decode, do_remote_prefill=prefill,
                    remote_host=params.remote_host, remote_port=params.remote_port,
                    fanout=params.fanout, now=time.time() if now is None else now)
            except ParamsSignatureError as e:
                raise TransferParamsError(str(e), reason=e.reason) from None
        return params


@dataclass(frozen=True)
class PrefillReady:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prompt_digest: str = ""
    capacity: int = 1  # decoder requests it serves (the P leg's fanout)


@dataclass(frozen=True)
class PrefillAborted:
    """A producer request that ended without a usable prefill."""

    req_id: str
    transfer_id: str
    prompt_digest: str = ""
    capacity: int = 1


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
    prompt_digest: str = ""


@dataclass
class StepPlan:
    """The per-step payload; the connector wraps it in vLLM's metadata class."""

    prefills: list[PrefillReady] = field(default_factory=list)
    prefill_aborts: list[PrefillAborted] = field(default_factory=list)
    expects: list[Expect] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    #: decoder requests vLLM no longer waits for (re-scheduled to compute locally): fence and
    #: release their blocks, but report nothing
    abandons: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.prefill_aborts or self.expects or self.cancels
                    or self.abandons)


@dataclass
class _Waiting:
    params: TransferParams
    local_tokens: int = 0
    staged: bool = False  # an Expect went out for the current allocation
    attempt: int = -1  # the newest attempt staged (-1: none yet)


class PushScheduler:
    """Pure bookkeeping over duck-typed vLLM requests; unit-testable without vLLM.

    ``counters``: where it counts what it rejects (``rejected{bad_transfer_params}``); a fresh
    ``Counters`` when not given. The connector hands their snapshot to vLLM's stats each step.
    """

    def __init__(self, *, is_producer: bool, is_decoder: bool, block_size: int,
                 counters: Counters | None = None, secret: bytes = b"",
                 clock: Callable[[], float] = time.time):
        self.is_producer = is_producer
        self.is_decoder = is_decoder
        self.block_size = block_size
        self.counters = counters if counters is not None else Counters()
        self._secret = secret
        self._clock = clock
        # request id -> its params as judged at the first look (a signature's expiry is checked
        # once, when the request arrives, not again after it queued or was preempted)
        self._verdicts: dict[str, TransferParams | None] = {}
        self._plan = StepPlan()
        self._waiting: dict[str, _Waiting] = {}  # decoder requests we claimed tokens for
        self._received: set[str] = set()  # decoder requests whose KV already arrived once
        self._held: set[str] = set()  # producer requests whose blocks we keep

    # -- helpers -------------------------------------------------------------------------------
    def _params(self, request) -> TransferParams | None:
        rid = request.request_id
        if rid in self._verdicts:
            return self._verdicts[rid]
        try:
            params = TransferParams.parse(getattr(request, "kv_transfer_params", None),
                                          self._secret, self._clock())
        except TransferParamsError as e:
            logger.warning("kv_push: request %s: kv_transfer_params refused (%s: %s); serving it "
                           "without KV transfer", rid, e.reason, e)
            self.counters.inc("rejected", label=e.reason)
            params = None
        self._verdicts[rid] = params
        return params

    # -- decoder ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._params(request)  # the verdict is taken here, at the first look
        if not self.is_decoder:
            return 0, False
        if params is None or not params.do_remote_prefill or request.request_id in self._received:
            return 0, False
        prompt = len(request.prompt_token_ids or ())
        count = prompt - num_computed_tokens
        w = self._waiting.setdefault(request.request_id, _Waiting(params))
        if w.staged:
            # Asked again while an attempt is out: vLLM dropped that allocation (preemption,
            # reset). The decoder keeps the old blocks fenced; the next allocation is the next
            # attempt under the same request id, and the request hears one outcome.
            w.staged = False
            if count <= 0:
                # nothing left to receive: stop waiting for the old attempt, whose outcome no
                # longer concerns vLLM (the request now runs on its local prefix)
                self._plan.abandons.append(request.request_id)
                self._waiting.pop(request.request_id, None)
                self._received.add(request.request_id)
                return 0, False
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
        digest = prompt_digest(getattr(request, "prompt_token_ids", None))
        if num_external_tokens <= 0:
            # nothing to receive (full local hit): let the producer free its blocks now
            self._plan.expects.append(Expect(
                RELEASE_KEY_PREFIX + request.request_id, p.transfer_id, w.attempt, p.remote_host,
                p.remote_port, (), w.local_tokens, w.local_tokens, digest))
            self._waiting.pop(request.request_id, None)
            self._received.add(request.request_id)
            return
        first = w.local_tokens
        need = -(-num_external_tokens // self.block_size)
        if first % self.block_size or len(block_ids) < need:
            raise RuntimeError(
                f"kv_push: request {request.request_id}: {len(block_ids)} new blocks from token "
                f"{first} cannot hold {num_external_tokens} tokens (block size {self.block_size})")
        self._plan.expects.append(Expect(
            request.request_id, p.transfer_id, w.attempt, p.remote_host, p.remote_port,
            tuple(block_ids[:need]), first, first + num_external_tokens, digest))

    def on_recv_finished(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            if self._waiting.pop(rid, None) is not None:
                self._received.add(rid)

    # -- both ------------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int], finished_ok: bool
                         ) -> tuple[bool, dict[str, Any] | None]:
        try:
            return self._request_finished(request, block_ids, finished_ok)
        finally:
            self._verdicts.pop(request.request_id, None)

    def _request_finished(self, request, block_ids: list[int], finished_ok: bool
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
            if w.attempt >= 0:
                self._plan.cancels.append(rid)  # vLLM holds the blocks until we report it
            else:
                p = w.params  # never allocated: still let the producer free its blocks
                self._plan.expects.append(Expect(
                    RELEASE_KEY_PREFIX + rid, p.transfer_id, 0, p.remote_host, p.remote_port,
                    (), 0, 0, prompt_digest(getattr(request, "prompt_token_ids", None))))
            return False, None
        if not self.is_producer:
            return False, None
        params = self._params(request)
        if params is None or not params.do_remote_decode:
            return False, None
        digest = prompt_digest(getattr(request, "prompt_token_ids", None))
        if not finished_ok or not block_ids:
            self._plan.prefill_aborts.append(
                PrefillAborted(rid, params.transfer_id, digest, params.fanout))
            return False, None
        self._plan.prefills.append(PrefillReady(rid, params.transfer_id, tuple(block_ids),
                                                int(request.num_computed_tokens), digest,
                                                params.fanout))
        self._held.add(rid)
        return True, {"transfer_id": params.transfer_id}

    def on_send_finished(self, req_ids: Iterable[str]) -> None:
        self._held.difference_update(req_ids)

    def has_pending_work(self) -> bool:
        return bool(self._held) or bool(self._plan)

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan
