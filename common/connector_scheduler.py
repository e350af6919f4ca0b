"""Scheduler half of the vLLM connector: decides what each worker hands to its transfer thread.

It runs in vLLM's scheduler (engine-core) process and never touches NIXL. Each step it packs a
``PushConnectorMetadata`` that every worker receives:

* producer (``kv_producer``): when a request whose ``kv_transfer_params`` carry
  ``do_remote_decode`` finishes its prefill, ``request_finished`` keeps its blocks (delay free)
  and stages a ``PrefillReady``; the workers hand it to the rendezvous. The blocks are freed when
  every worker reports the request in ``finished_sending``. A request that ends without a
  usable prefill (aborted, error) stages ``prefill_aborts`` so decoders hear at once.

  **Early announcement** (``early_prefill_done``): ``request_finished`` runs in the step *after*
  the prefill step's output, one engine step late. So when the plan of a step is built
  (``take_plan(scheduler_output)``, at the end of vLLM's ``schedule``, after every preemption
  of that step), each producer request that this step completes is put in
  ``StepPlan.completing``: a new request (first scheduled now) with ``max_tokens == 1`` whose
  scheduled tokens reach the end of its prompt. The workers hand those to the rendezvous once
  the step's KV is written (host backend: at ``wait_for_save``; accelerators: at the next
  step's bind, when the host has synchronised on the step's sampled tokens).
  ``request_finished`` then holds the blocks and stages nothing. Why this is safe, where the
  connector enables it (``one_batch_at_a_time`` and full attention; see ``vllm_compat``):
  - the request is in the step's output (vLLM builds the plan after its preemptions), so its
    prefill runs and its blocks are those of ``NewRequestData``; a request preempted, aborted or
    still queued before the plan was built is not announced;
  - with ``max_tokens == 1`` the step's output ends the request (one token sampled), so
    nothing is scheduled between the announcement and ``request_finished`` (one batch at a
    time: nothing else is planned before that output was processed), and no later step
    writes into the prompt's blocks;
  - whatever ``request_finished`` then says -- also an abort that arrived while the step ran,
    or an error status -- the blocks are held (delay free) until the workers report the
    request in ``finished_sending``: the source may already be in a WRITE, and its KV is
    complete (the step ran). A client that went away is freed by the router's ``Release`` or
    ``rendezvous_ttl_s``, as for any prefill. No ``PrefillReady`` and no ``PrefillAborted`` is
    staged for it: one announcement per request;
  - a prompt prefilled in several chunks, a resumed request, ``max_tokens > 1``, a model whose
    block ids come in several groups: not announced early (``request_finished`` as before).

  **Layer-wise streaming** (``layerwise``): the same requests -- found the same way, whether or
  not early announcement is on -- are also put in ``StepPlan.streaming``: the workers start
  packing their KV layer by layer during the step (``producer.py``). A streamed request's
  blocks are held at ``request_finished`` whatever its status (a pack may read them); one that
  ends aborted or in error without having been announced early stages a ``PrefillAborted``
  that names it (``req_id``), and the workers report it in ``finished_sending`` once nothing
  reads its blocks.
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

The request-level parameters come in one of two forms (see ``TransferParams``): ours, from our
router, with a ``transfer_id``; or the **upstream form** that vLLM's own ``NixlPushConnector``
reads (``do_remote_decode`` / ``do_remote_prefill`` + ``remote_host`` / ``remote_port``, no
transfer id), which routers built for it send to both legs at once under one ``X-Request-Id``.
For that form the transfer id is the client's ``X-Request-Id``, recovered from the engine
request id the same way on P and D (``upstream_transfer_id``).

With a secret the parameters count only when the router signed them
(``auth.verify_transfer_params``): otherwise the request is served without KV transfer (a
decoder prefills locally, a producer frees its blocks as usual), counted as ``rejected{<reason>}``
and logged -- once per request, or for the upstream form (which no router signs) once, then at
most once a minute with a count -- a decoder never dials a host a client chose, a producer never
holds blocks a client asked it to.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import timing
from .auth import SIG_KEY, ParamsSignatureError, verify_transfer_params
from .messages import MAX_ID_CHARS, prompt_digest, wire_id
from .metrics import Counters, LogLimiter

logger = logging.getLogger(__name__)

#: Prefix of decoder keys whose outcome no vLLM request waits for (release-only registrations).
RELEASE_KEY_PREFIX = "release:"


#: the most decoder requests one prefill may serve (``fanout``)
MAX_FANOUT = 1024


#: ``rejected{}`` label of upstream-form parameters without a signature on a server with a secret
UNSIGNED_UPSTREAM = "unsigned_upstream_transfer_params"


class TransferParamsError(ValueError):
    """``reason``: the metrics label (``bad_transfer_params``, or a signature problem:
    ``unsigned_transfer_params``, ``unsigned_upstream_transfer_params``,
    ``bad_transfer_params_signature``, ``expired_transfer_params``)."""

    def __init__(self, message: str, reason: str = "bad_transfer_params"):
        super().__init__(message)
        self.reason = reason


#: vLLM's engine request ids, by endpoint, before the random suffix (the same in 0.29 and 0.32):
#: completions ``cmpl-{X-Request-Id}-{prompt index}``, chat ``chatcmpl-{X-Request-Id}`` (with
#: ``_{i}`` appended when one chat request makes several engine requests: kept, both legs make
#: the same), and ``{sample}_`` in front for each sample of ``n > 1``
_COMPLETION_ID = re.compile(r"cmpl-(.*)-\d+", re.DOTALL)
_CHAT_ID = re.compile(r"chatcmpl-(.*)", re.DOTALL)
_SAMPLE_PREFIX = re.compile(r"\d+_(?=(?:chat)?cmpl-)")
#: what vLLM 0.29 and 0.32 append to every engine request id (``-{random_uuid():.8}``)
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}")
RANDOM_SUFFIX_CHARS = 9


def upstream_transfer_id(request_id: str, *, random_suffix: bool) -> str:
    """The transfer id of an upstream-form request: the client's ``X-Request-Id`` as recovered
    from the engine request id ``request_id``. ``random_suffix``: this vLLM appended its
    ``-<8 hex>`` to the id (``vllm_compat.request_id_random_suffix``); only then is one cut
    off, so an ``X-Request-Id`` that itself ends in 8 hex digits survives where it does not
    (``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``, older vLLM), and P and D agree even when only
    one of them suffixes.

    P and D derive the same id for their legs of one client request when both legs carried the
    same ``X-Request-Id`` to the same endpoint; the engine requests of a prompt list or of
    ``n > 1`` all get that one id and are told apart by their prompt digests (as with ours). An
    id of another shape (another endpoint, the offline API) is used as it is, less the suffix.
    """
    rid = request_id
    if random_suffix and _RANDOM_SUFFIX.fullmatch(rid, len(rid) - RANDOM_SUFFIX_CHARS):
        rid = rid[:-RANDOM_SUFFIX_CHARS]
    if m := _SAMPLE_PREFIX.match(rid):
        rid = rid[m.end():]
    for shape in (_COMPLETION_ID, _CHAT_ID):
        if m := shape.fullmatch(rid):
            return m.group(1)
    return rid


@dataclass(frozen=True)
class TransferParams:
    """What the router puts in a request's ``kv_transfer_params``, in one of two forms.

    **Ours.** Producer leg: ``{"transfer_id": tid, "do_remote_decode": true}``, optionally with
    ``"fanout": n``: each prefill of this leg serves ``n`` decoder requests of the same prompt
    (the router sends P one sample while D samples ``n``; default 1).
    Decoder leg:  ``{"transfer_id": tid, "do_remote_prefill": true, "remote_host": h,
    "remote_port": p}`` where ``h:p`` is the producer's handshake side channel (rank 0).
    With a secret, both also carry the router's signature under ``kv_push_sig``.

    **Upstream** (``upstream``; what vLLM's ``NixlPushConnector`` reads): no ``transfer_id``;
    producer leg ``{"do_remote_decode": true, ...}``, decoder leg ``{"do_remote_prefill": true,
    "remote_host": h, "remote_port": p, "remote_engine_id": ..., "tp_size": ..., ...}``. The
    transfer id is derived from the engine request id (``upstream_transfer_id``); the other keys
    (``remote_engine_id``, ``tp_size``, ``pp_size``, ``remote_request_id``,
    ``remote_block_ids``) are not needed: D learns P's identity and layout at the handshake.
    With a secret it counts only when signed like ours (over the derived transfer id).
    """

    transfer_id: str
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str = ""
    remote_port: int = 0
    fanout: int = 1
    upstream: bool = False

    @classmethod
    def parse(cls, raw: Any, secret: bytes = b"", now: float | None = None, *,
              request_id: str = "", random_suffix: bool = False) -> "TransferParams | None":
        """None when the request is not for a KV transfer; TransferParamsError when it is but
        is malformed or (with ``secret``) not validly signed by the router at ``now`` (default:
        the time). ``request_id`` (the engine request id) and ``random_suffix`` name an
        upstream-form request's transfer (``upstream_transfer_id``)."""
        if not isinstance(raw, dict):
            return None
        upstream = "transfer_id" not in raw
        if upstream:
            if raw.get("do_remote_decode") is not True and raw.get("do_remote_prefill") is not True:
                return None  # neither leg of a transfer (e.g. all flags false)
            tid = upstream_transfer_id(request_id, random_suffix=random_suffix)
            if not tid:
                raise TransferParamsError(
                    f"upstream-form kv_transfer_params: request id {request_id!r} names no "
                    f"transfer (send both legs with one non-empty X-Request-Id)")
            tid = wire_id(tid)  # a long X-Request-Id: its digest, on both legs alike
        else:
            tid = raw.get("transfer_id")
        if not isinstance(tid, str) or not tid or len(tid) > MAX_ID_CHARS:
            raise TransferParamsError(f"transfer_id must be a non-empty string of at most "
                                      f"{MAX_ID_CHARS} characters, got {tid!r}")
        decode, prefill = bool(raw.get("do_remote_decode")), bool(raw.get("do_remote_prefill"))
        if decode == prefill:
            raise TransferParamsError("exactly one of do_remote_decode / do_remote_prefill")
        host, port = "", 0  # a producer leg dials nobody: whatever it names is ignored
        if prefill:
            host, port = raw.get("remote_host", ""), raw.get("remote_port", 0)
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
        params = cls(tid, decode, prefill, host, port, fanout, upstream)
        if secret:
            if upstream and raw.get(SIG_KEY) is None:
                raise TransferParamsError(
                    "upstream-form kv_transfer_params are unsigned, and with a secret set only "
                    "router-signed ones are acted on", reason=UNSIGNED_UPSTREAM)
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


def upstream_reply(*, engine_id: str, side_channel_host: str, side_channel_port: int,
                   tp_size: int, pp_size: int) -> dict[str, Any]:
    """The keys vLLM's ``NixlPushConnector`` producer answers a prefill with that name the
    producer (``kv_transfer_params`` of its response): a router that learns P's engine id and
    sizes from there (ours in ``upstream-push`` mode), or forwards them to D as they are, gets
    a decoder leg this connector serves. ``remote_host`` / ``remote_port`` (the handshake side
    channel) only when the host is an address a decoder can dial, not a wildcard."""
    reply: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False,
                             "remote_engine_id": engine_id, "tp_size": tp_size,
                             "pp_size": pp_size, "transfer_mode": "push"}
    if side_channel_host not in ("", "0.0.0.0", "::"):
        reply.update(remote_host=side_channel_host, remote_port=side_channel_port)
    return reply


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
    #: its blocks are held (a streamed request): the workers report ``req_id`` in
    #: ``finished_sending`` once nothing reads them
    held: bool = False
    #: vLLM aborted it (its HTTP request ended): decoders are told, but it is no failure
    aborted: bool = False


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
    #: producer requests whose prefill this step completes (early announcement, see the module
    #: doc): the workers hand them to the rendezvous once the step's KV is written
    completing: list[PrefillReady] = field(default_factory=list)
    #: producer requests whose prefill this step completes, to be packed layer by layer while
    #: the step runs (layer-wise streaming, see the module doc); found like ``completing``
    streaming: list[PrefillReady] = field(default_factory=list)
    #: the step runs no model (no token scheduled: every request there waits for its KV, or
    #: for its blocks to be freed); a decoder worker may wait in it for an outcome
    #: (``idle_step_wait_s``)
    idle: bool = False

    def __bool__(self) -> bool:
        return bool(self.prefills or self.prefill_aborts or self.expects or self.cancels
                    or self.abandons or self.completing or self.streaming)


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
    ``random_suffix``: this vLLM appends a random suffix to engine request ids (read by
    ``upstream_transfer_id``; ``vllm_compat.request_id_random_suffix``). ``upstream_reply``:
    what a producer adds to its answer to an upstream-form leg besides the transfer id -- the
    keys vLLM's own producer answers with, by which routers built for it learn how to address
    the decoder leg (``upstream_reply``). ``early_prefill_done``: announce producer requests
    in ``StepPlan.completing`` (see the module doc); the connector decides where it is safe.
    ``layerwise``: put the same requests in ``StepPlan.streaming`` (layer-wise streaming).
    """

    def __init__(self, *, is_producer: bool, is_decoder: bool, block_size: int,
                 counters: Counters | None = None, secret: bytes = b"",
                 random_suffix: bool = False, upstream_reply: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.time, early_prefill_done: bool = False,
                 layerwise: bool = False, side_channel: str = ""):
        """``side_channel``: (producer) ``HOST:PORT`` its rank 0 listens on, named in its
        answers so that a router can check its ``kv=`` for this server."""
        self._side_channel = side_channel
        self.is_producer = is_producer
        self.is_decoder = is_decoder
        self.block_size = block_size
        self.counters = counters if counters is not None else Counters()
        self._secret = secret
        self._random_suffix = random_suffix
        self._upstream_reply = dict(upstream_reply or {})
        self._clock = clock
        self._log = LogLimiter(logger)
        # request id -> its params as judged at the first look (a signature's expiry is checked
        # once, when the request arrives, not again after it queued or was preempted)
        self._verdicts: dict[str, TransferParams | None] = {}
        self._plan = StepPlan()
        self._waiting: dict[str, _Waiting] = {}  # decoder requests we claimed tokens for
        self._received: set[str] = set()  # decoder requests whose KV already arrived once
        self._held: set[str] = set()  # producer requests whose blocks we keep
        self.early_prefill_done = early_prefill_done and is_producer
        self.layerwise = layerwise and is_producer
        # producer requests put in a step's ``streaming`` whose request_finished is due
        self._streamed: dict[str, PrefillReady] = {}
        # producer requests announced in a step's ``completing`` whose request_finished is due
        self._announced: dict[str, PrefillReady] = {}
        # timing lines only: decoder requests received (-> transfer id) not yet planned, and
        # those planned in the step whose output comes next
        self._recv_tids: dict[str, str] = {}
        # timing lines only: requests planned into the step whose output comes next, with the
        # stage to stamp when it does (D: its first step after the KV; P: its prefill's step)
        self._stamp_at_output: dict[str, tuple[str, str]] = {}

    # -- helpers -------------------------------------------------------------------------------
    def _params(self, request) -> TransferParams | None:
        rid = request.request_id
        if rid in self._verdicts:
            return self._verdicts[rid]
        try:
            params = TransferParams.parse(getattr(request, "kv_transfer_params", None),
                                          self._secret, self._clock(), request_id=rid,
                                          random_suffix=self._random_suffix)
        except TransferParamsError as e:
            self.counters.inc("rejected", label=e.reason)
            if e.reason == UNSIGNED_UPSTREAM:  # a client's convention, not one bad request
                self._log.warn(e.reason, "kv_push: request %s: %s; it and every later one like "
                               "it are served without KV transfer (counted in "
                               "rejected{%s})", rid, e, e.reason)
            else:
                logger.warning("kv_push: request %s: kv_transfer_params refused (%s: %s); "
                               "serving it without KV transfer", rid, e.reason, e)
            params = None
        if params is not None and ((params.do_remote_prefill and not self.is_decoder)
                                   or (params.do_remote_decode and not self.is_producer)):
            # a router that sends the legs to the wrong servers (--prefill / --decode swapped):
            # served, but visibly
            leg = "decode (do_remote_prefill)" if params.do_remote_prefill \
                else "prefill (do_remote_decode)"
            self.counters.inc("rejected", label="wrong_role")
            self._log.warn("wrong_role", "kv_push: request %s is a %s leg, but this server's "
                           "kv_role is %s: served without KV transfer (counted in "
                           "rejected{wrong_role}; are the router's prefill and decode servers "
                           "swapped?)", rid, leg,
                           "kv_producer" if self.is_producer else "kv_consumer")
            params = None
        self._verdicts[rid] = params
        if timing.ENABLED and params is not None:
            timing.stamp("d_sched" if params.do_remote_prefill else "p_sched",
                         params.transfer_id, key=rid)
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
        if _computes_its_prompt(request):
            # the request wants its prompt's logprobs (vLLM sets this for prompt_logprobs and
            # echo with logprobs): vLLM computes such a prompt itself -- 0.32 ignores a
            # connector's tokens for it, and 0.29 takes them but its API server then dies
            # decoding the prompt logprobs of tokens it did not compute (OverflowError in
            # convert_ids_list_to_tokens, seen 2026-12-05). So nothing is loaded: the request
            # is computed here, and the producer is told to let go (update_state_after_alloc)
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
            # nothing to receive (a full local hit, or a request computed here: prompt
            # logprobs): let the producer free its blocks now
            if _computes_its_prompt(request):
                self.counters.inc("local_prefills", label="prompt_logprobs")
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
            w = self._waiting.pop(rid, None)
            if w is not None:
                self._received.add(rid)
                if timing.ENABLED:
                    self._recv_tids[rid] = w.params.transfer_id

    def on_step_output(self) -> None:
        """vLLM processed a step's output (``update_connector_output``): timing lines only."""
        if timing.ENABLED and self._stamp_at_output:
            for rid, (stage, tid) in self._stamp_at_output.items():
                timing.stamp(stage, tid, key=rid)
            self._stamp_at_output.clear()

    # -- both ------------------------------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int], finished_ok: bool,
                         aborted: bool = False) -> tuple[bool, dict[str, Any] | None]:
        """``aborted``: vLLM aborted the request (its client hung up, the router closed the
        leg), as opposed to an error: a producer's decoders are told it will not come either
        way, but it is counted as abandoned, not failed."""
        try:
            return self._request_finished(request, block_ids, finished_ok, aborted)
        finally:
            self._verdicts.pop(request.request_id, None)

    def _request_finished(self, request, block_ids: list[int], finished_ok: bool,
                          aborted: bool) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if timing.ENABLED:
            self._recv_tids.pop(rid, None)
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
        streamed = self._streamed.pop(rid, None)
        early = self._announced.pop(rid, None)
        if early is not None:
            # announced when its step ran: hold the blocks whatever the status says (the KV is
            # complete and a WRITE may already read it); announce nothing again
            missing = set(early.block_ids) - set(block_ids)
            if missing:  # cannot happen with full attention; say so loudly if it does
                logger.error("kv_push: request %s ends without blocks %s it was announced with; "
                             "they stay held by vLLM only as long as the request's own",
                             rid, sorted(missing))
            self._held.add(rid)
            return True, self._reply(params, rid)
        digest = prompt_digest(getattr(request, "prompt_token_ids", None))
        if streamed is not None and finished_ok and set(streamed.block_ids) - set(block_ids):
            # blocks taken away after the step was planned (cannot happen one batch at a time;
            # with async scheduling only if vLLM preempted it before its output): the stream
            # may have read reused blocks -- never hand it over as a good prefill
            logger.error("kv_push: streamed request %s ends without blocks %s it was streamed "
                         "from; its transfer is failed", rid,
                         sorted(set(streamed.block_ids) - set(block_ids)))
            finished_ok = False
        if streamed is not None and not (finished_ok and block_ids):
            # its step ran and packs may read its blocks: hold them until the workers say
            # nothing does (they report it in finished_sending); decoders hear it failed
            self._plan.prefill_aborts.append(
                PrefillAborted(rid, streamed.transfer_id, streamed.prompt_digest,
                               streamed.capacity, held=True, aborted=aborted))
            self._held.add(rid)
            return True, None
        if not finished_ok or not block_ids:
            self._plan.prefill_aborts.append(
                PrefillAborted(rid, params.transfer_id, digest, params.fanout,
                               aborted=aborted))
            return False, None
        self._plan.prefills.append(PrefillReady(rid, params.transfer_id, tuple(block_ids),
                                                int(request.num_computed_tokens), digest,
                                                params.fanout))
        self._held.add(rid)
        return True, self._reply(params, rid)

    def _reply(self, params: TransferParams, rid: str) -> dict[str, Any]:
        """What a producer answers (``kv_transfer_params`` of its output) for a held prefill."""
        reply: dict[str, Any] = {"transfer_id": params.transfer_id}
        if self._side_channel:
            reply["side_channel"] = self._side_channel
        if params.upstream:
            reply.update(self._upstream_reply, remote_request_id=rid)
        return reply

    def on_send_finished(self, req_ids: Iterable[str]) -> None:
        self._held.difference_update(req_ids)

    def has_pending_work(self) -> bool:
        return (bool(self._held) or bool(self._plan) or bool(self._announced)
                or bool(self._streamed))

    def take_plan(self, scheduler_output: Any = None) -> StepPlan:
        """The step's plan. ``scheduler_output``: vLLM's ``SchedulerOutput`` of the step, from
        which the producer's ``completing`` requests are found (early announcement)."""
        if (self.early_prefill_done or self.layerwise or (timing.ENABLED and self.is_producer)) \
                and scheduler_output is not None:
            self._find_completing(scheduler_output)
        if timing.ENABLED and self._recv_tids and scheduler_output is not None:
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            for rid in [r for r in self._recv_tids if r in scheduled]:
                tid = self._recv_tids.pop(rid)
                timing.stamp("d_scheduled", tid, key=rid)
                self._stamp_at_output[rid] = ("d_first_step_done", tid)
        plan, self._plan = self._plan, StepPlan()
        if scheduler_output is not None:
            plan.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        return plan

    def _find_completing(self, out: Any) -> None:
        """Put in the plan (``completing`` and/or ``streaming``) each producer request that
        this step completes (module doc)."""
        scheduled = getattr(out, "num_scheduled_tokens", None) or {}
        for new in getattr(out, "scheduled_new_reqs", None) or ():
            rid = getattr(new, "req_id", None)
            if (rid is None or rid in self._announced or rid in self._streamed
                    or rid not in self._verdicts):
                continue
            params = self._verdicts[rid]
            if params is None or not params.do_remote_decode:
                continue
            sp = getattr(new, "sampling_params", None)
            if sp is None or getattr(sp, "max_tokens", None) != 1:
                continue
            prompt = getattr(new, "prompt_token_ids", None)
            if not prompt:
                continue
            n = len(prompt)
            if int(getattr(new, "num_computed_tokens", 0)) + int(scheduled.get(rid, 0)) < n:
                continue  # a chunk, not the end of the prompt
            blocks = _single_group(getattr(new, "block_ids", ()))
            need = -(-n // self.block_size)
            if blocks is None or len(blocks) < need:
                continue
            ready = PrefillReady(rid, params.transfer_id, tuple(int(b) for b in blocks[:need]),
                                 n, prompt_digest(prompt), params.fanout)
            if timing.ENABLED and rid not in self._stamp_at_output:
                self._stamp_at_output[rid] = ("p_step_output", params.transfer_id)
            if self.early_prefill_done:
                self._announced[rid] = ready
                self._plan.completing.append(ready)
                self.counters.inc("prefills_announced_early")
            if self.layerwise:
                self._streamed[rid] = ready
                self._plan.streaming.append(ready)
                self.counters.inc("prefills_streamed")


def _computes_its_prompt(request: Any) -> bool:
    """vLLM computes this request's prompt itself, whatever a connector offers: it wants the
    prompt's logprobs (``skip_reading_prefix_cache``: prompt_logprobs, echo with logprobs)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def _single_group(block_ids: Any) -> list[int] | None:
    """The block ids of a request's only KV cache group (``NewRequestData.block_ids``: one list
    per group; older vLLM: one list), or None when there are several groups in use."""
    ids = list(block_ids or ())
    if ids and isinstance(ids[0], (list, tuple)):
        if any(ids[1:]):
            return None
        return list(ids[0])
    return ids
