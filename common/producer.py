"""Producer (prefill) role of the transfer thread: registrations meet prefills, WRITEs go out.

Runs only on the transfer thread, which it sees through a ``RoleContext`` (``self.ctx``). The
engine hands it finished prefills with ``prefill_done`` (and failed ones with
``prefill_failed``) through ``TransferThread.submit``; decoders' ``Register`` and ``Cancel``
arrive as notifications. Registrations and prefills meet in the ``Rendezvous`` by (transfer id,
prompt digest), one decoder engine request (``reg_id``) per claim; each pairing is mapped
(``plan_writes``) and posted as a WRITE in bounded chunks, each carrying its ``WriteDone``.

Source blocks (the prefill's blocks on this worker) are released -- reported through
``on_released(key)`` so the engine frees them -- once the rendezvous says the source is done
(every decoder request it serves is resolved, or its time-out passed) and no WRITE reads them.

Safety rules:
* every answer about one attempt of one registration (``CancelAck``, ``TransferFailed``) is
  sent only once no WRITE chunk of that attempt is in flight, and says how many chunks completed
  (``chunks_done``): their notices may still be on the wire, and the decoder waits for them;
* a ``Cancel`` is answered every time it comes (the decoder re-sends it until answered); the
  answer for an attempt already finished is remembered for ``rendezvous_ttl_s``, and a
  ``Register`` older than (or as old as) an attempt already answered is stale -- so a
  registration that arrives after its own cancel is never written;
* a WRITE that cannot be posted, fails, or whose post raised is reported as failed, never as
  done;
* a decoder that falls silent (no heartbeat) is not proven dead: no more chunks are posted to it
  and its registrations are failed, but WRITEs in flight are polled to the end before their
  source is released. A decoder proven dead (lifeline closed, goodbye) is forgotten at once and
  its source blocks may go (nothing alive reads what lands there); WRITE handles still in flight
  are kept until they finish or the transport is closed (NIXL refuses to release them).

Router releases: when an exchange ends without decode output the router sends ``Release``
(``side_channel``) and the worker hands it here (``release``, on this thread). Release means "no
further decoder request will come for this transfer id": every source of that id is closed
(``Rendezvous.close``: it takes no more claims), so a source no decoder has claimed is released
at once (``released``; the engine frees its blocks as for any released source), while one
already paired -- a registration held, a WRITE in flight, a claim not yet complete -- stays on
the normal path (fence, cancel, time-out) and goes when its claims are done
(``release_deferred``). The transfer id is remembered (``released_tids``, at most
``MAX_RELEASED_TIDS``, each for ``rendezvous_ttl_s``): a prefill that finishes later is released
at once (unless a decoder request already waits for it), and a registration of a request not
yet claimed is failed at once (``TransferFailed``; counted ``stale{registration_after_router_
release}``) and never written. A request already claimed keeps its source (its later ranks and
attempts pair as usual); one still waiting for a prefill that asks for nothing (every rank
cancelled or release-only: ``_wants_nothing``) goes with the release, or with the cancel that
leaves it so. After the tombstone expired, a late registration only waits for a
prefill that is gone and is failed at its time-out.

Expired prefills: a prefill no decoder request claimed within ``rendezvous_ttl_s`` (its
decoder request queued longer than that on a loaded D, say) is dropped, and its rendezvous key
is remembered the same way (``expired_keys``, at most ``MAX_RELEASED_TIDS``, each for
``rendezvous_ttl_s``): a registration for it that comes later, of a request not yet claimed,
with no other prefill of that key to take it, is failed at once (``TransferFailed``; counted
``stale{registration_after_expiry}``), so D fails or recomputes the request (its
``kv_load_failure_policy``) at once instead of waiting another ``rendezvous_ttl_s`` for a
prefill that is gone (until 2026-12-05 it waited; a walkthrough's request queued 6 s on D with
a 5 s TTL failed after 11.7 s).

Staged transfers (``staged.py``): with a ``StagedSender``, a registration that carries a slot is
packed into this worker's staging pool and WRITTEN chunk by chunk into the slot; the job is then
the same ``_Job`` (same answers, same ``chunks_done``: a staged chunk is a WRITE chunk) whose
chunks are posted only once packed, and it ends only once no pack still runs (the packs read the
source blocks and write P's room) -- also when its decoder died. Anything the sender cannot
stage takes the region path.

Layer-wise streaming (``layerwise``, a ``StagedSender`` needed): the engine announces a prefill
its current step completes (``prefill_started``) before the step's forward, then reports each
layer written (``layer_saved``, an event after that layer's KV writes) and the forward's end
(``step_saved``). The prefill becomes a source at once, with a ``staged.Stream``: its whole local
sub-slice is packed layer by layer into a room of P's pool, each pack after its layer's event, so
packing rides behind the rest of the prefill. A registration whose slot wants exactly those
bytes (a decoder of the same TP size without a prefix of its own: the usual case) pairs with it
as with any source, and its job posts each chunk (a group of layers) as soon as that group is
packed -- during the prefill, when the registration came first. Any other pairing with a source
whose prefill is not complete yet (no slot, other heads or tokens) is *deferred* to
``prefill_done`` and then started as usual (counted ``layerwise_fallback{layout}``). A stream
source is never released before its prefill is complete (``prefill_done``, or
``prefill_failed`` naming it), and its blocks and room only once no pack of it still runs. A
streamed prefill that ends aborted stays good for what was written already (its KV was computed
when the step ran); deferred and later pairings with it fail.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import timing
from .geometry import GeometryError
from .layout import fragmentation, plan_writes, target_ranks
from .messages import (
    COMPAT_HASH,
    Cancel,
    CancelAck,
    Hello,
    MessageRejected,
    Register,
    TransferFailed,
    Welcome,
    WriteDone,
    geometry_digest,
)
from .metrics import LogLimiter
from .nixl_compat import check_peer_nixl
from .rendezvous import (
    Claim,
    ConflictEvent,
    Pairing,
    RdvKey,
    Registration,
    Rendezvous,
    RequestKey,
    Source,
    StaleEvent,
)
from .transfer_thread import Peer, RoleContext

logger = logging.getLogger(__name__)

#: transfer ids released by the router that a producer remembers at most (the oldest go first)
MAX_RELEASED_TIDS = 1 << 16

#: descriptors per byte, against equal layouts, from which a handshake warns (NHD against HND
#: at block 16 with 8 heads is ~128x; different block sizes alone stay near 1)
FRAGMENTED = 16.0

#: one attempt of one decoder rank of one decoder request
JobKey = tuple[RequestKey, int, int]  # (request, decoder rank, attempt)


def _chunk_bounds(lengths, max_bytes: int, max_regions: int) -> list[tuple[int, int]]:
    """Cut a plan's regions into consecutive chunks of at most ``max_regions`` regions and about
    ``max_bytes`` bytes (a single larger region is a chunk of its own)."""
    ends = np.cumsum(lengths.astype(np.int64))
    bounds, start, base = [], 0, 0
    n = len(lengths)
    while start < n:
        by_bytes = int(np.searchsorted(ends, base + max_bytes, side="right"))
        stop = min(max(by_bytes, start + 1), start + max_regions, n)
        bounds.append((start, stop))
        base = int(ends[stop - 1])
        start = stop
    return bounds


@dataclass
class _Job:
    """One registration attempt's WRITE, posted in bounded chunks, one chunk per loop step (at
    its tick), so that the transfer thread keeps heartbeating and serving other peers during a
    long copy (over UCX's CPU path the whole copy happens inside the post). Each chunk carries
    its own ``WriteDone`` (``chunk`` i of ``chunks``); the decoder counts them all."""

    pairing: Pairing
    started: float
    num_bytes: int
    pending: list  # chunks not yet posted: (src descs, dst descs, WriteDone)
    handles: list = field(default_factory=list)
    stop: str = ""  # why no more chunks are posted: cancel, superseded, a failure, silence
    ack_cancel: bool = False  # a Cancel waits for the chunks in flight
    error: str = ""
    staged: Any = None  # a staged.StagedSend: chunk i is posted once packed
    #: a layer-wise stream's job with nothing in flight, waiting for its next chunk: "layers"
    #: (not all saved yet: the engine's next call wakes the thread) or "packs" (all enqueued,
    #: still running on the device, possibly behind the rest of the prefill: the thread polls
    #: every ``await_poll_s`` rather than spinning through the prefill); "" otherwise
    waits: str = ""

    @property
    def reg(self) -> Registration:
        return self.pairing.registration

    @property
    def posting(self) -> bool:
        return bool(self.pending) and not self.stop and not self.error


@dataclass
class _Answered:
    """What this worker answered for the attempts of one decoder rank of one request."""

    chunks_done: dict[int, int]  # attempt -> WRITE chunks that completed (notices due)
    when: float


def _prefill_failure(failure: str, abandoned: str) -> str:
    """What a decoder is told of a pairing with a prefill that ended with ``failure``."""
    return failure if abandoned else f"prefill failed: {failure}"


def _wants_nothing(claim: Claim) -> bool:
    """Every decoder rank ``claim`` serves is accounted for and none asks for KV: each rank's
    registration was cancelled (or its decoder is gone), or only lets the prefill go (the
    decoder request ended first). Once the router released the transfer, such a claim waiting
    for a prefill waits for nothing: a prefill that comes later is released at once. A rank not
    heard from yet keeps the claim, so that its registration pairs as the module doc says."""
    return (claim.targets <= claim.resolved | set(claim.regs)
            and all(r.release_only for r in claim.regs.values()))



def _note_ordered(seen: "OrderedDict[Any, Any]", key: Any, value: Any) -> None:
    """Set ``key`` (newest last): a record that ``_sweep`` ages out oldest first, up to the
    first entry still within its time-out, instead of scanning it whole."""
    seen[key] = value
    seen.move_to_end(key)


def _note_bounded(seen: "OrderedDict[Any, float]", key: Any, now: float) -> int:
    """``_note_ordered`` in a record bounded at ``MAX_RELEASED_TIDS`` (oldest out). Returns how
    many were dropped to make room (the caller counts them: ``forgotten``)."""
    _note_ordered(seen, key, now)
    dropped = max(0, len(seen) - MAX_RELEASED_TIDS)
    for _ in range(dropped):
        seen.popitem(last=False)
    return dropped


def _sweep(seen: "OrderedDict[Any, Any]", now: float, ttl: float,
           when: Callable[[Any], float] = lambda v: v) -> None:
    """Drop the entries of a ``_note_ordered`` record older than ``ttl``, oldest first."""
    while seen:
        key, value = next(iter(seen.items()))
        if now - when(value) <= ttl:
            return
        del seen[key]


class Producer:
    handles = (Register, Cancel)

    def __init__(self, ctx: RoleContext, *, on_released: Callable[[str], None],
                 side_channel_ports: tuple[int, ...] = (), staged=None):
        """``staged``: a ``staged.StagedSender`` when this worker has a staging pool."""
        self.ctx = ctx
        self.staged = staged
        self.on_released = on_released
        self.side_channel_ports = side_channel_ports
        self.rdv = Rendezvous(ctx.config.rendezvous_ttl_s, clock=ctx.clock)
        self.sources: dict[str, Source] = {}  # key -> source not yet released
        self.jobs: dict[JobKey, _Job] = {}
        self.readers: dict[str, int] = {}  # source key -> jobs reading it
        # (request, d_rank) -> what was answered; requests whose source is gone -> when. Both
        # oldest first (_note_ordered), kept rendezvous_ttl_s: the sweep stops at the first
        # young entry instead of scanning every entry each second
        self.answered: OrderedDict[tuple[RequestKey, int], _Answered] = OrderedDict()
        self.tombstones: OrderedDict[RequestKey, float] = OrderedDict()
        # transfer ids the router released -> when (bounded: MAX_RELEASED_TIDS, rendezvous_ttl_s)
        self.released_tids: OrderedDict[str, float] = OrderedDict()
        # rendezvous keys whose prefill expired unclaimed -> when (bounded as released_tids)
        self.expired_keys: OrderedDict[RdvKey, float] = OrderedDict()
        self.orphans: list[Any] = []  # WRITE handles to dead peers, still in flight
        self._forgot_log = LogLimiter(logger)
        self._fragmentation_told: set[tuple[str, str]] = set()  # (engine, layout) warned about
        self.streams: dict[str, Any] = {}  # source key -> its layer-wise staged.Stream
        self._step_streams: list[str] = []  # streams started for the step now running
        self.deferred: dict[str, list[Pairing]] = {}  # stream key -> pairings waiting for it
        self._ending: dict[str, Any] = {}  # released stream sources whose packs still run
        self._failures = itertools.count()
        self._next_sweep = 0.0  # time-outs are applied at most this often (not every step)

    # -- handshake (called on this thread by the side channel through TransferThread.call) ---
    def accept_hello(self, hello: Hello) -> Welcome:
        if hello.compat_hash != COMPAT_HASH:
            raise MessageRejected(
                "incompatible", f"decoder {hello.engine_id} speaks {hello.compat_hash}, "
                f"we speak {COMPAT_HASH}: install the same kv-push version on P and D")
        if (why := check_peer_nixl(self.ctx.nixl_version, hello.nixl_version)) is not None:
            raise MessageRejected("incompatible", f"decoder {hello.engine_id}: {why}")
        try:
            self.ctx.geometry.compatible_with(hello.geometry,
                                              sides=("on the producer", "on the decoder"))
        except GeometryError as e:
            raise MessageRejected("bad_layout", f"decoder {hello.engine_id}: {e}") from None
        known = self.ctx.peer(hello.agent_name) is not None
        self.ctx.add_peer(hello.agent_metadata, engine_id=hello.engine_id,
                          tp_rank=hello.geometry.tp_rank, geometry=hello.geometry,
                          digest=geometry_digest(hello.geometry), agent_name=hello.agent_name,
                          made_by=hello.nonce)
        try:
            stages = self.staged is not None and self.staged.accept(hello.agent_name,
                                                                    hello.staging)
            if not stages:
                self._warn_if_fragmented(hello)
            welcome = Welcome(engine_id=self.ctx.engine_id, agent_name=self.ctx.agent_name,
                              agent_metadata=self.ctx.metadata(), geometry=self.ctx.geometry,
                              compat_hash=COMPAT_HASH, side_channel_ports=self.side_channel_ports,
                              nixl_version=self.ctx.nixl_version, staging=stages)
        except Exception:
            if not known:  # refused after all: no lifeline will ever drop what was added
                self.ctx.peer_lost(hello.agent_name, "its handshake failed after it was added")
            raise
        self.ctx.counters.inc("handshakes")
        return welcome

    # -- engine events -------------------------------------------------------------------------
    def prefill_done(self, key: str, transfer_id: str, block_ids: tuple[int, ...],
                     num_tokens: int, *, prompt_digest: str = "", capacity: int = 1,
                     ready: Any = None) -> None:
        """Engine request ``key`` finished the prefill of ``transfer_id``'s prompt (digest
        ``prompt_digest``) into ``block_ids``; it may serve ``capacity`` decoder requests.
        ``ready``: an event after the prefill's KV writes (``StagedSender.marker``), which packs
        of this source wait for."""
        if key in self.streams:
            self._complete_stream(key, ready)
            return
        added = self._add_source(key, transfer_id, block_ids, num_tokens, prompt_digest,
                                 capacity)
        if added is None:
            return
        source, pairings = added
        if self.staged is not None:
            self.staged.note_ready(key, ready)
        for pairing in pairings:
            self._start(pairing)
        if transfer_id in self.released_tids:  # the router gave up on it before it finished
            self._close(source.rdv_key)
            return
        self._settle(source.rdv_key)

    def _add_source(self, key, transfer_id, block_ids, num_tokens, prompt_digest, capacity
                    ) -> tuple[Source, list[Pairing]] | None:
        """``key``'s prefill as a rendezvous source (None: reported twice, counted)."""
        source = Source(key, transfer_id, tuple(block_ids), num_tokens, prompt_digest,
                        max(1, int(capacity)))
        try:
            pairings = self.rdv.add_source(source)
        except StaleEvent as e:
            self.ctx.counters.reject("stale", str(e), context="prefill")
            return None
        self.sources[key] = source
        return source, pairings

    # -- layer-wise streaming (see the module doc) -----------------------------------------------
    def prefill_started(self, key: str, transfer_id: str, block_ids: tuple[int, ...],
                        num_tokens: int, *, prompt_digest: str = "", capacity: int = 1) -> None:
        """The step now running completes engine request ``key``'s prefill: stream it (a source
        now, packed as its layers are saved). Without staging room, or for a transfer the
        router released, nothing happens here: ``prefill_done`` takes the usual path."""
        if (self.staged is None or key in self.sources or key in self._ending
                or transfer_id in self.released_tids):
            return
        stream = self.staged.begin_stream(key, block_ids, num_tokens,
                                          make_room=self._evict_streams)
        if stream is None:
            return
        added = self._add_source(key, transfer_id, block_ids, num_tokens, prompt_digest,
                                 capacity)
        if added is None:
            self.staged.end_stream(stream)
            return
        pairings = added[1]
        self.streams[key] = stream
        self._step_streams.append(key)
        self.ctx.counters.inc("layerwise_streams")
        if timing.ENABLED:
            timing.stamp("p_stream_started", transfer_id, key=key)
        for pairing in pairings:
            self._start(pairing)

    def layer_saved(self, layer: int, marker: Any) -> None:
        """Layer ``layer``'s KV writes of the running step are enqueued (``marker``: an event
        after them, None on the host where they are done): pack that layer of its streams."""
        for key in self._step_streams:
            stream = self.streams.get(key)
            if stream is not None:
                self.staged.pack_layers(stream, range(layer, layer + 1), marker)

    def step_saved(self, marker: Any) -> None:
        """The running step's forward enqueued all its KV writes: pack what no ``layer_saved``
        covered (layers vLLM did not report, e.g. inside a CUDA graph)."""
        keys, self._step_streams = self._step_streams, []
        for key in keys:
            stream = self.streams.get(key)
            if stream is not None:
                self.staged.pack_rest(stream, marker)

    def _evict_streams(self, nbytes: int) -> bool:
        """P's pool is full: give back the rooms of streams no one needs now -- prefill
        complete, no WRITE reads them, no pack runs -- oldest first, until ``nbytes`` could
        fit. Their sources stay; a decoder request that comes later takes the post-prefill path
        (packed again from the blocks). Returns whether any room was freed."""
        freed = 0
        for key in list(self.streams):
            if freed >= nbytes:
                break
            stream = self.streams[key]
            if (not stream.complete or stream.failure or key in self.readers
                    or not self.staged.stream_idle(stream)):
                continue
            del self.streams[key]
            self.staged.end_stream(stream)
            self.ctx.counters.inc("layerwise_evicted")
            freed += stream.length
        return freed > 0

    def _in_progress(self, key: str) -> bool:
        """``key`` is a stream source whose prefill is not complete yet."""
        stream = self.streams.get(key)
        return stream is not None and not stream.complete

    def _complete_stream(self, key: str, ready: Any, failure: str = "",
                         abandoned: str = "") -> None:
        """A stream's prefill is complete (``prefill_done``), or ended without output
        (``failure``): pack what is left, start (or fail) the pairings deferred to now."""
        stream = self.streams[key]
        if key in self._step_streams:
            self._step_streams.remove(key)
        stream.complete = True
        self.staged.pack_rest(stream, ready)
        self.staged.note_ready(key, ready)
        src = self.sources[key]
        if failure:
            stream.failure, stream.abandoned = failure, abandoned
            spare = self.rdv.retire(key)
        for pairing in self.deferred.pop(key, []):
            if self._current(pairing.registration):
                self._start(pairing)
        if failure and spare:  # decoder requests that come later hear it at once
            self.prefill_failed(src.transfer_id, failure, prompt_digest=src.prompt_digest,
                                capacity=spare, abandoned=abandoned)
        if src.transfer_id in self.released_tids:
            self._close(src.rdv_key)
            return
        self._settle(src.rdv_key)

    def _current(self, reg: Registration) -> bool:
        """``reg`` is still the registration held for its rank (not cancelled, superseded or
        dropped with its peer while it waited)."""
        claim = self.rdv.claim(reg.request)
        return claim is not None and claim.regs.get(reg.tp_rank) is reg

    def prefill_failed(self, transfer_id: str, reason: str, *, prompt_digest: str = "",
                       capacity: int = 1, key: str | None = None, abandoned: str = "") -> None:
        """A prefill of ``transfer_id``'s prompt will never finish (aborted, errored): the
        decoder requests it would have served are told now, not at their time-out. It takes
        their place in the rendezvous like a source; decoder requests already served by another
        source of the same prompt are not affected.

        ``key``: the engine request, when the engine holds its blocks for us (a streamed
        prefill): its stream ends (what was written stays written) and the blocks are released
        once nothing reads them.

        ``abandoned`` (a value of ``messages.ABANDONED``): the prefill ended because its request
        did (vLLM aborted it), not by a failure: decoders are told as much."""
        if key is not None:
            if self._in_progress(key):
                self._complete_stream(key, None, failure=reason or "aborted",
                                      abandoned=abandoned)
                return
            if key not in self.sources and key not in self._ending:
                self.on_released(key)  # held for a stream that never started: nothing reads it
        source = Source(f"\x00failed-{next(self._failures)}", transfer_id, (), 0, prompt_digest,
                        max(1, int(capacity)), failure=reason or "aborted",
                        abandoned=abandoned)
        for pairing in self.rdv.add_source(source):
            self._start(pairing)
        if transfer_id in self.released_tids:
            self.rdv.close(source.rdv_key)
        self._settle(source.rdv_key)

    def release(self, transfer_ids) -> None:
        """The router released ``transfer_ids`` (see the module doc): free every source of them
        that no decoder has claimed, close the others, and refuse later registrations."""
        now = self.ctx.clock()
        for tid in transfer_ids:
            self._forgot("released_tids", _note_bounded(self.released_tids, tid, now))
            for rdv_key in self.rdv.keys_of(tid):
                self._close(rdv_key)
                # decoder requests that still wait for a prefill but ask for nothing (their
                # registrations cancelled, or release-only) need nothing more: the router's
                # release frees whatever comes. They used to wait out the TTL and count as
                # expired, with a WARNING (a request P rejected and D cancelled)
                self.rdv.drop_waiting(rdv_key, _wants_nothing)

    def _close(self, rdv_key: RdvKey) -> None:
        """Close ``rdv_key``'s sources (no more claims) and release those that are done;
        count which went at once and which wait for a decoder's claims."""
        closed = [s for s in self.rdv.close(rdv_key) if not s.failure]
        self._settle(rdv_key)
        for src in closed:
            if src.key in self.sources:
                self.ctx.counters.inc("release_deferred")
            else:
                self.ctx.counters.inc("released")

    # -- messages ------------------------------------------------------------------------------
    def on_message(self, peer: Peer, msg) -> None:
        if isinstance(msg, Register):
            self._on_register(peer, msg)
        elif isinstance(msg, Cancel):
            self._on_cancel(peer, msg)

    def _targets(self, peer: Peer) -> list[int]:
        g = self.ctx.geometry
        return target_ranks(g.num_kv_heads, g.tp_size, g.tp_rank, peer.geometry.tp_size)

    def _on_register(self, peer: Peer, msg: Register) -> None:
        if msg.engine_id != peer.engine_id or msg.tp_rank != peer.tp_rank:
            raise MessageRejected("spoofed", f"registration names {msg.engine_id}/{msg.tp_rank} "
                                  f"but came from {peer.engine_id}/{peer.tp_rank}")
        reg = Registration(transfer_id=msg.transfer_id, attempt=msg.attempt,
                           peer=peer.agent_name, engine_id=msg.engine_id, tp_rank=msg.tp_rank,
                           block_ids=tuple(msg.block_ids), first_token=msg.first_token,
                           num_tokens=msg.num_tokens, reg_id=msg.reg_id,
                           prompt_digest=msg.prompt_digest, slot=msg.slot)
        seen = self.answered.get((reg.request, reg.tp_rank))
        if seen is not None and reg.attempt <= max(seen.chunks_done):
            # a copy, or a registration that arrives after its own cancel: never write it
            self.ctx.counters.reject("stale", f"registration of {msg.reg_id} attempt "
                                     f"{msg.attempt}: already answered", context="registration")
            return
        if msg.geometry_digest != peer.geometry_digest:
            self._tell_failed(reg, "layout changed since handshake; reconnect", 0)
            raise MessageRejected("bad_layout", f"stale geometry digest from {peer.engine_id}")
        if reg.release_only and (reg.request in self.tombstones
                                 or reg.transfer_id in self.released_tids
                                 or reg.rdv_key in self.expired_keys):
            # a release-only registration (the decoder's request ended before it asked for
            # anything) of a transfer already let go: both sides agree, nothing to answer
            self._remember(reg.request, reg.tp_rank, reg.attempt, 0)
            return
        if reg.request in self.tombstones:
            self._tell_failed(reg, "the producer already released this transfer", 0)
            self.ctx.counters.inc("stale", label="registration_after_release")
            return
        if reg.transfer_id in self.released_tids and self.rdv.claim(reg.request) is None:
            # the router released the transfer (its exchange ended): nothing will pair with
            # this request, and its source may be gone -- say so now, never write
            self._tell_failed(reg, "the router released this transfer (its exchange ended)", 0,
                              abandoned="router_release")
            self.ctx.counters.inc("stale", label="registration_after_router_release")
            return
        if (reg.rdv_key in self.expired_keys and self.rdv.claim(reg.request) is None
                and self.rdv.spare(reg.rdv_key) == 0):
            # its prefill waited rendezvous_ttl_s for a registration and was dropped: nothing
            # will pair with this request -- say so now instead of at its own time-out
            self._tell_failed(reg, "its prefill expired before this registration came (the "
                              "producer holds a prefill rendezvous_ttl_s = "
                              f"{self.ctx.config.rendezvous_ttl_s:g} s for its decoder)", 0)
            self.ctx.counters.inc("stale", label="registration_after_expiry")
            return
        try:
            pairings, superseded = self.rdv.add_registration(reg, self._targets(peer))
        except StaleEvent as e:
            self.ctx.counters.reject("stale", str(e), context="registration")
            return
        except ConflictEvent as e:
            raise MessageRejected("conflict", str(e)) from None
        if superseded is not None:
            self.ctx.counters.inc("stale", label="registration_superseded")
            old = self.jobs.get((reg.request, reg.tp_rank, superseded.attempt))
            if old is not None and not old.stop:
                old.stop = "superseded"  # the decoder fences the old blocks until we answer
        self.ctx.counters.inc("registrations_late" if pairings else "registrations_early")
        for pairing in pairings:
            self._start(pairing)
        self._settle(reg.rdv_key)

    def _on_cancel(self, peer: Peer, msg: Cancel) -> None:
        if msg.engine_id != peer.engine_id or msg.tp_rank != peer.tp_rank:
            raise MessageRejected("spoofed", f"cancel names {msg.engine_id}/{msg.tp_rank} "
                                  f"but came from {peer.engine_id}/{peer.tp_rank}")
        self.ctx.counters.inc("cancels")
        request, rank, attempt = (msg.engine_id, msg.reg_id), msg.tp_rank, msg.attempt
        rdv_key = (msg.transfer_id, msg.prompt_digest)
        job = self.jobs.get((request, rank, attempt))
        seen = self.answered.get((request, rank))
        if job is None and seen is not None and attempt in seen.chunks_done:
            self._ack(peer.agent_name, msg, seen.chunks_done[attempt])  # a re-sent cancel
            return
        released = msg.transfer_id in self.released_tids and self.rdv.claim(request) is None
        if request not in self.tombstones and not released:
            try:
                # drop the registration (or, if it never came, make sure it is never written)
                self.rdv.cancel(request, rank, attempt, rdv_key=rdv_key, engine_id=msg.engine_id,
                                targets=self._targets(peer))
            except StaleEvent:
                pass  # a newer attempt of that rank is registered and stays
            except ConflictEvent as e:
                self.ctx.counters.reject("conflict", str(e), context="cancel")
            if msg.transfer_id in self.released_tids:  # as ``release`` does
                self.rdv.drop_waiting(rdv_key, _wants_nothing)
        if job is not None:
            job.ack_cancel = True  # answered when no chunk of it is in flight any more
            job.stop = job.stop or "cancelled"
            return
        self._remember(request, rank, attempt, 0)
        self._ack(peer.agent_name, msg, 0)
        self._settle(rdv_key)

    def _ack(self, peer: str, about: Cancel | Registration, chunks_done: int) -> None:
        reg_id = about.reg_id if isinstance(about, Cancel) else about.request[1]
        self.ctx.send(peer, CancelAck(transfer_id=about.transfer_id, reg_id=reg_id,
                                      attempt=about.attempt, engine_id=self.ctx.engine_id,
                                      tp_rank=self.ctx.tp_rank, chunks_done=chunks_done))

    def _tell_failed(self, reg: Registration, reason: str, chunks_done: int,
                     abandoned: str = "") -> None:
        """Tell the decoder rank that ``reg``'s attempt will not be (fully) written. Only once no
        chunk of that attempt is in flight: the caller guarantees it. ``abandoned`` (a value of
        ``messages.ABANDONED``): no failure, the request ended first (counted and logged as
        such, at INFO)."""
        if abandoned:
            self.ctx.counters.inc("transfers_abandoned", label=abandoned)
            logger.info("kv_push: transfer %s (%s) attempt %d to %s not made: %s",
                        reg.transfer_id, reg.request[1], reg.attempt, reg.peer, reason)
        else:
            self.ctx.counters.inc("transfers_failed")
            logger.warning("kv_push: transfer %s (%s) attempt %d to %s failed: %s",
                           reg.transfer_id, reg.request[1], reg.attempt, reg.peer, reason)
        self._remember(reg.request, reg.tp_rank, reg.attempt, chunks_done)
        self.ctx.send(reg.peer, TransferFailed(
            transfer_id=reg.transfer_id, reg_id=reg.request[1], attempt=reg.attempt,
            engine_id=self.ctx.engine_id, tp_rank=self.ctx.tp_rank, reason=reason,
            chunks_done=chunks_done, abandoned=abandoned))

    def _remember(self, request: RequestKey, rank: int, attempt: int, chunks_done: int) -> None:
        seen = self.answered.get((request, rank)) or _Answered({}, 0.0)
        seen.chunks_done[attempt] = chunks_done
        seen.when = self.ctx.clock()
        _note_ordered(self.answered, (request, rank), seen)

    def _resolve(self, reg: Registration) -> None:
        """``reg``'s rank is resolved -- if ``reg`` is still that rank's newest attempt."""
        claim = self.rdv.claim(reg.request)
        current = claim.regs.get(reg.tp_rank) if claim is not None else None
        if current is None or current.attempt == reg.attempt:
            self.rdv.resolve(reg.request, reg.tp_rank)

    # -- transfers -----------------------------------------------------------------------------
    def _start(self, pairing: Pairing) -> None:
        src, reg = pairing.source, pairing.registration
        if timing.ENABLED:
            timing.stamp("p_pair", reg.transfer_id, key=src.key, reg=reg.request[1],
                         rank=reg.tp_rank)
        peer = self.ctx.peer(reg.peer)
        if reg.release_only:  # nothing is wanted, nothing to say
            self._remember(reg.request, reg.tp_rank, reg.attempt, 0)
            self._resolve(reg)
            return
        if src.failure:
            self._tell_failed(reg, _prefill_failure(src.failure, src.abandoned), 0,
                              abandoned=src.abandoned)
            self._resolve(reg)
            return
        if peer is None:
            self._resolve(reg)
            return
        if reg.num_tokens > src.num_tokens:
            self._tell_failed(reg, f"decoder wants {reg.num_tokens} tokens, prefill has "
                              f"{src.num_tokens}", 0)
            self._resolve(reg)
            return
        jkey = (reg.request, reg.tp_rank, reg.attempt)
        stream = self.streams.get(src.key)
        if stream is not None and stream.failure:
            self._tell_failed(reg, _prefill_failure(stream.failure, stream.abandoned), 0,
                              abandoned=stream.abandoned)
            self._resolve(reg)
            return
        send = None
        if stream is not None and jkey not in self.jobs:
            send = self.staged.attach(stream, reg, peer)  # its packed bytes, if they fit
            if send is None and self._in_progress(src.key):
                # the usual paths need the complete prefill
                self.ctx.counters.inc("layerwise_fallback", label="layout")
                self.deferred.setdefault(src.key, []).append(pairing)
                return
        if send is None and reg.slot is not None and self.staged is not None \
                and jkey not in self.jobs:
            send = self.staged.start(src, reg, peer)
        if send is not None:
            self.ctx.counters.inc("regions_written", len(send.chunks))
            self._add_job(jkey, _Job(pairing, self.ctx.clock(), send.length,
                                     self.staged.posts(send, reg, peer), staged=send))
            return
        try:
            plan = plan_writes(self.ctx.geometry, src.block_ids, peer.geometry, reg.block_ids,
                               first_token=reg.first_token, num_tokens=reg.num_tokens)
        except GeometryError as e:
            self.ctx.counters.reject("bad_layout", f"transfer {reg.transfer_id}: {e}",
                                     context=f"plan for {reg.peer}")
            self._tell_failed(reg, f"cannot map blocks: {e}", 0)
            self._resolve(reg)
            return
        if plan.num_regions == 0:  # not a writer for that rank, or nothing left to write
            self._remember(reg.request, reg.tp_rank, reg.attempt, 0)
            self._resolve(reg)
            return
        if plan.head_sliced:
            self.ctx.counters.inc("head_sliced_plans")
        g = self.ctx.geometry
        src_d, dst_d = plan.descs("src", g.dev_id), plan.descs("dst", peer.geometry.dev_id)
        cuts = _chunk_bounds(plan.length, self.ctx.config.max_post_bytes,
                             self.ctx.config.max_post_regions)
        pending = []
        for i, (a, b) in enumerate(cuts):
            notif = WriteDone(
                transfer_id=reg.transfer_id, reg_id=reg.request[1], attempt=reg.attempt,
                engine_id=self.ctx.engine_id, tp_rank=self.ctx.tp_rank,
                num_bytes=int(plan.length[a:b].sum()), chunk=i, chunks=len(cuts))
            pending.append((src_d[a:b], dst_d[a:b], notif))
        self.ctx.counters.inc("regions_written", plan.num_regions)
        self._add_job(jkey, _Job(pairing, self.ctx.clock(), plan.total_bytes, pending))

    def _add_job(self, jkey: JobKey, job: _Job) -> None:
        reg, src = job.reg, job.pairing.source
        if jkey in self.jobs:  # cannot happen (the rendezvous drops repeated attempts): be sure
            self.ctx.counters.reject("stale", f"{reg.request[1]} attempt {reg.attempt} is "
                                     "already being written", context="pairing")
            return
        self.jobs[jkey] = job
        self.readers[src.key] = self.readers.get(src.key, 0) + 1
        # the first chunk goes out at this loop step's tick: after the step's queued work and
        # notifications, so a lifeline closed or a Cancel that waited (a stalled thread) is seen
        # before anything is posted

    def _post(self, job: _Job) -> None:
        src_d, dst_d, notice = job.pending.pop(0)
        notif = self.ctx.seal(job.reg.peer, notice)  # numbered when posted (replay window)
        g, peer = self.ctx.geometry, self.ctx.peer(job.reg.peer)
        dst_mem = peer.geometry.mem_type if peer is not None else g.mem_type
        try:
            handle = self.ctx.write(job.reg.peer, src_d, dst_d, g.mem_type, dst_mem, notif)
        except Exception as e:  # the seam must not raise; if it does, the chunk was not posted
            logger.exception("kv_push: posting a WRITE to %s raised", job.reg.peer)
            job.error = f"posting the WRITE raised {type(e).__name__}: {e}"
            return
        job.handles.append(handle)
        self.ctx.counters.inc("writes_posted")
        if timing.ENABLED:
            timing.stamp("p_write_posted", job.reg.transfer_id, chunk=notice.chunk,
                         chunks=notice.chunks, bytes=notice.num_bytes)

    def _poll_job(self, jkey: JobKey) -> None:
        job = self.jobs[jkey]
        if job.posting and self._packed(job):
            self._post(job)
        states = [self.ctx.poll(h) for h in job.handles]
        if "ERR" in states and not job.error:
            job.error = self.ctx.failure_reason(job.handles[states.index("ERR")])
        if job.staged is not None and job.staged.error and not job.error:
            job.error = job.staged.error  # a pack failed: nothing more is posted
        if "PROC" in states or job.posting:
            job.waits = "" if "PROC" in states else self._stream_waits(job)
            return  # in flight, or more to post: no answer and no release yet
        if job.staged is not None and not self.staged.idle(job.staged):
            return  # a pack still reads the source blocks and writes the staging room
        self._end_job(jkey, states.count("DONE"))

    def _stream_waits(self, job: _Job) -> str:
        """What a layer-wise job with nothing in flight waits for (``_Job.waits``)."""
        send = job.staged
        if send is None or send.stream is None or not job.posting:
            return ""
        layers = send.chunks[len(job.handles)].layers
        if any(layer not in send.stream.packs for layer in layers):
            return "layers"
        return "packs"

    def _packed(self, job: _Job) -> bool:
        """Whether ``job``'s next chunk may be posted (staged: its pack completed)."""
        return job.staged is None or self.staged.packed(job.staged, len(job.handles))

    def _end_job(self, jkey: JobKey, chunks_done: int) -> None:
        job = self.jobs.pop(jkey)
        for h in job.handles:
            self.ctx.release(h)
        reg, src = job.reg, job.pairing.source
        self.readers[src.key] -= 1
        if not self.readers[src.key]:
            del self.readers[src.key]
        if job.staged is not None:
            self.staged.finish(job.staged, ok=not job.error and not job.pending)
        alive = self.ctx.peer(reg.peer) is not None
        if job.ack_cancel:
            self._remember(reg.request, reg.tp_rank, reg.attempt, chunks_done)
            if alive:
                self._ack(reg.peer, reg, chunks_done)
        elif job.error or (job.stop and job.stop != "superseded"):
            if alive:
                self._tell_failed(reg, job.error or job.stop, chunks_done)
            else:
                self._remember(reg.request, reg.tp_rank, reg.attempt, chunks_done)
        else:
            self._remember(reg.request, reg.tp_rank, reg.attempt, chunks_done)
            if not job.pending:
                if timing.ENABLED:
                    timing.stamp("p_write_done", reg.transfer_id, key=src.key,
                                 bytes=job.num_bytes)
                self.ctx.counters.inc("transfers_done")
                self.ctx.counters.inc("bytes_written", job.num_bytes)
                self.ctx.counters.inc("transfer_seconds", self.ctx.clock() - job.started)
        self._resolve(reg)
        self._settle(src.rdv_key)

    def _settle(self, rdv_key: RdvKey) -> None:
        """Release every source of ``rdv_key`` that is done and that no WRITE reads (a stream
        source: once its prefill is complete; its blocks go once no pack of it runs)."""
        for src in self.rdv.sources(rdv_key):
            if (src.key in self.readers or self._in_progress(src.key)
                    or not self.rdv.source_done(src.key)):
                continue
            now = self.ctx.clock()
            for claim in self.rdv.remove_source(src.key):
                _note_ordered(self.tombstones, claim.key, now)
            if not src.failure:
                del self.sources[src.key]
                if self.staged is not None:
                    self.staged.forget(src.key)
                stream = self.streams.pop(src.key, None)
                self.deferred.pop(src.key, None)
                if stream is not None and not self.staged.stream_idle(stream):
                    self._ending[src.key] = stream  # released by ``tick`` once idle
                    continue
                if stream is not None:
                    self.staged.end_stream(stream)
                self.on_released(src.key)

    # -- role hooks ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for jkey in list(self.jobs):
            if jkey in self.jobs:
                self._poll_job(jkey)
        for key, stream in list(self._ending.items()):
            if self.staged.stream_idle(stream):
                del self._ending[key]
                self.staged.end_stream(stream)
                self.on_released(key)
        if self.orphans:
            still = []
            for h in self.orphans:
                if self.ctx.poll(h) == "PROC":
                    still.append(h)
                else:
                    self.ctx.release(h)
            self.orphans = still
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(1.0, self.ctx.config.rendezvous_ttl_s / 100)
        claims, sources = self.rdv.expire()
        for claim in claims:
            self.ctx.counters.inc("expired")
            logger.warning("kv_push: request %s of transfer %s found no prefill in time",
                           claim.key[1], claim.rdv_key[0])
            _note_ordered(self.tombstones, claim.key, now)
            for reg in claim.regs.values():
                self._tell_failed(reg, "no prefill arrived in time", 0)
        for src in sources:
            self.ctx.counters.inc("expired")
            self._forgot("expired_keys", _note_bounded(self.expired_keys, src.rdv_key, now))
            if not src.failure:
                logger.warning("kv_push: prefill %s of transfer %s expired (not every decoder "
                               "rank it serves was resolved in time)", src.key, src.transfer_id)
            self._settle(src.rdv_key)
        ttl = self.ctx.config.rendezvous_ttl_s
        for remembered in (self.tombstones, self.released_tids, self.expired_keys):
            _sweep(remembered, now, ttl)
        _sweep(self.answered, now, ttl, when=lambda seen: seen.when)

    def _forgot(self, record: str, dropped: int) -> None:
        """``dropped`` entries of ``record`` (released_tids, expired_keys) made room for newer
        ones before their TTL: counted and said (once a minute), never silent."""
        if dropped:
            self.ctx.counters.inc("forgotten", dropped, label=record)
            self._forgot_log.warn(
                record, "kv_push: more than %d %s within rendezvous_ttl_s (%.0f s): the oldest "
                "are forgotten early, so a prefill of such a transfer that finishes later is "
                "held until its TTL instead of freed at once", MAX_RELEASED_TIDS, record,
                self.ctx.config.rendezvous_ttl_s)

    def _warn_if_fragmented(self, hello: Hello) -> None:
        """Say once per decoder layout when the region path into it needs far more descriptors
        than equal layouts would (NHD against HND: one per token and head): long prompts then
        take seconds and may run past ``transfer_timeout_s``. Staging (CUDA) avoids it."""
        key = (hello.engine_id, geometry_digest(hello.geometry))
        if key in self._fragmentation_told:
            return
        self._fragmentation_told.add(key)
        factor = fragmentation(self.ctx.geometry, hello.geometry)
        if factor >= FRAGMENTED:
            g, h = self.ctx.geometry, hello.geometry
            logger.warning(
                "kv_push: decoder %s's KV layout (%s, block %d, TP %d) needs %.0fx the WRITE "
                "descriptors of equal layouts from this producer's (%s, block %d, TP %d), with "
                "no staging between them: long prompts will transfer slowly and may exceed "
                "transfer_timeout_s. Use the same KV layout on both sides, or staging (cuda).",
                hello.engine_id, h.token_order, h.block_size, h.tp_size, factor,
                g.token_order, g.block_size, g.tp_size)

    def busy(self) -> bool:
        return any(not job.waits for job in self.jobs.values()) or bool(self._ending)

    def holding(self) -> bool:
        """Prefills held (a registration for them may come), registrations waiting for their
        prefill, WRITEs in flight or deferred, staged packs or slots in use: never quiet then
        (``transfer_thread``, ``quiet_poll_s``)."""
        return bool(len(self.rdv) or self.rdv.num_claims or self.sources or self.jobs
                    or self.orphans or self.streams or self.deferred or self._ending
                    or (self.staged is not None and self.staged.live()))

    def expecting(self) -> bool:
        """Prefills held, done, failed or streaming layer by layer: a registration for one
        starts its WRITE (or is refused) at once, so the thread polls every ``idle_poll_s``.
        Registrations waiting for their prefill are not: the prefill's hand-off wakes the
        thread, which then reads any registration that came meanwhile (``transfer_thread``,
        module doc 4.)."""
        return bool(self.sources or self.streams or self.rdv.holds_failed())

    def awaiting(self) -> bool:
        """A layer-wise job waits for packs enqueued behind the prefill: poll every
        ``await_poll_s``."""
        return any(job.waits == "packs" for job in self.jobs.values())

    def writing_to(self, agent_name: str) -> bool:
        return any(job.handles and job.reg.peer == agent_name for job in self.jobs.values())

    def on_peer_silent(self, peer: Peer) -> None:
        """``peer`` stopped heartbeating but is not proven dead: write nothing more to it, fail
        what it registered (it may come back and will then fence as usual), and poll its WRITEs
        in flight to the end before their source goes."""
        for reg in self.rdv.drop_peer(peer.agent_name):
            if (reg.request, reg.tp_rank, reg.attempt) not in self.jobs:
                self._tell_failed(reg, "decoder unresponsive", 0)
            self._settle(reg.rdv_key)
        for job in self.jobs.values():
            if job.reg.peer == peer.agent_name and not job.stop:
                job.stop = "decoder unresponsive"

    def on_peer_dead(self, peer: Peer) -> None:
        touched = {reg.rdv_key for reg in self.rdv.drop_peer(peer.agent_name)}
        if self.staged is not None:
            self.staged.forget_peer(peer.agent_name)
        for jkey, job in list(self.jobs.items()):
            if job.reg.peer != peer.agent_name:
                continue
            # nothing alive reads what lands there: the source may go, but NIXL will not let a
            # handle in flight be released -- keep those until they finish
            for h in job.handles:
                if self.ctx.poll(h) == "PROC":
                    self.orphans.append(h)
                else:
                    self.ctx.release(h)
            job.handles = []
            job.pending = []
            job.stop = job.stop or "decoder dead"
            if job.staged is not None and not self.staged.idle(job.staged):
                continue  # packs still read the source: ``_poll_job`` ends it once they ran
            self.jobs.pop(jkey)
            if job.staged is not None:
                self.staged.finish(job.staged, ok=False)
            src = job.pairing.source
            self.readers[src.key] -= 1
            if not self.readers[src.key]:
                del self.readers[src.key]
            self._resolve(job.reg)
            touched.add(src.rdv_key)
        for rdv_key in touched:
            self._settle(rdv_key)

    def close(self) -> None:
        """The thread stops: release every finished WRITE handle; one still in flight is left to
        the transport's teardown (NIXL refuses to release it)."""
        for h in [h for job in self.jobs.values() for h in job.handles] + self.orphans:
            if self.ctx.poll(h) != "PROC":
                self.ctx.release(h)
        self.jobs.clear()
        self.readers.clear()
        self.orphans = []

    # -- introspection for tests and metrics ----------------------------------------------------
    def live(self) -> dict[str, int]:
        out = {"sources": len(self.sources), "jobs": len(self.jobs),
               "rendezvous": len(self.rdv), "claims": self.rdv.num_claims}
        if self.staged is not None:
            out["staging_rooms"] = self.staged.live()  # P's pool ranges in use
            out["streams"] = len(self.streams) + len(self._ending)
        return out
