"""Producer (prefill) role of the transfer thread: registrations meet prefills, WRITEs go out.

Runs only on the transfer thread, which it sees through a ``RoleContext`` (``self.ctx``). The
engine hands it finished prefills with ``prefill_done`` (through ``TransferThread.submit``);
decoders' ``Register`` and ``Cancel`` arrive as notifications. When a registration and its
prefill meet (``Rendezvous``) the producer maps the blocks (``plan_writes``) and posts one WRITE
per decoder rank, carrying the ``WriteDone`` notice.

Source blocks (the prefill's blocks on this worker) are released -- reported through
``on_released(key)`` so the engine frees them -- once every decoder rank this worker writes to
is resolved (written, failed, cancelled, or its decoder is dead) and nothing reads them, or when
no registration came within the rendezvous time-out.

Safety rules:
* a ``Cancel`` is acknowledged only when no WRITE for that registration is in flight (an
  in-flight one is acknowledged when NIXL reports it finished), so the decoder can keep the
  blocks fenced until then;
* a WRITE that cannot be posted or fails is reported to the decoder at once (``TransferFailed``);
* a registration for a transfer this worker already released is answered with
  ``TransferFailed`` at once, not left to the decoder's time-out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .geometry import GeometryError
from .layout import plan_writes, target_ranks
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
from .nixl_compat import check_peer_nixl
from .rendezvous import Pairing, Registration, Rendezvous, Source, StaleEvent
from .transfer_thread import Peer, RoleContext

logger = logging.getLogger(__name__)


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
    """One registration's WRITE, posted in bounded chunks, one chunk per loop step, so that the
    transfer thread keeps heartbeating and serving other peers during a long copy (over UCX's
    CPU path the whole copy happens inside the post). Each chunk carries its own ``WriteDone``
    (``chunk`` i of ``chunks``); the decoder counts them all."""

    pairing: Pairing
    peer: str
    started: float
    num_bytes: int
    pending: list  # chunks not yet posted: (src descs, dst descs, notification)
    handles: list = field(default_factory=list)
    ack_cancel: bool = False
    error: str = ""


@dataclass
class _Transfer:
    """What this worker owes one transfer id."""

    targets: set[int] | None = None  # decoder ranks this worker writes to (known at 1st reg.)
    resolved: set[int] = field(default_factory=set)
    decoder_engine: str | None = None


class Producer:
    handles = (Register, Cancel)

    def __init__(self, ctx: RoleContext, *, on_released: Callable[[str], None],
                 side_channel_ports: tuple[int, ...] = ()):
        self.ctx = ctx
        self.on_released = on_released
        self.side_channel_ports = side_channel_ports
        self.rdv = Rendezvous(ctx.config.rendezvous_ttl_s, clock=ctx.clock)
        self.transfers: dict[str, _Transfer] = {}
        self.sources: dict[str, Source] = {}  # key -> source not yet released
        self.jobs: dict[tuple[str, int, int], _Job] = {}  # (tid, d_rank, attempt)
        self.tombstones: dict[str, float] = {}  # released transfer ids -> when

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
        self.ctx.add_peer(hello.agent_metadata, engine_id=hello.engine_id,
                          tp_rank=hello.geometry.tp_rank, geometry=hello.geometry,
                          digest=geometry_digest(hello.geometry))
        self.ctx.counters.inc("handshakes")
        return Welcome(engine_id=self.ctx.engine_id, agent_name=self.ctx.agent_name,
                       agent_metadata=self.ctx.metadata(), geometry=self.ctx.geometry,
                       compat_hash=COMPAT_HASH, side_channel_ports=self.side_channel_ports,
                       nixl_version=self.ctx.nixl_version)

    # -- engine events -------------------------------------------------------------------------
    def prefill_done(self, key: str, transfer_id: str, block_ids: tuple[int, ...],
                     num_tokens: int) -> None:
        if transfer_id in self.tombstones:
            # a re-issued prefill for a transfer already served: nothing will read it
            self.ctx.counters.inc("stale", label="prefill_after_release")
            self.on_released(key)
            return
        source = Source(key, transfer_id, tuple(block_ids), num_tokens)
        try:
            pairings, displaced = self.rdv.add_source(source)
        except StaleEvent as e:
            self.ctx.counters.reject("stale", str(e), context="prefill")
            return
        self.sources[key] = source
        if displaced is not None:
            self.ctx.counters.inc("stale", label="prefill_superseded")
            self._maybe_release_source(displaced)
        for pairing in pairings:
            self._start(pairing)
        self._maybe_finish(transfer_id)

    def prefill_failed(self, transfer_id: str, reason: str) -> None:
        """The prefill will never finish (aborted, errored): tell decoders now, not at time-out."""
        for reg in self.rdv.registrations(transfer_id):
            self._fail(reg.peer, transfer_id, reg.attempt, f"prefill failed: {reason}")
        self._retire(transfer_id, self.rdv.source(transfer_id))

    # -- messages ------------------------------------------------------------------------------
    def on_message(self, peer: Peer, msg) -> None:
        if isinstance(msg, Register):
            self._on_register(peer, msg)
        elif isinstance(msg, Cancel):
            self._on_cancel(peer, msg)

    def _on_register(self, peer: Peer, msg: Register) -> None:
        if msg.engine_id != peer.engine_id or msg.tp_rank != peer.tp_rank:
            raise MessageRejected("spoofed", f"registration names {msg.engine_id}/{msg.tp_rank} "
                                  f"but came from {peer.engine_id}/{peer.tp_rank}")
        if msg.geometry_digest != peer.geometry_digest:
            self._fail(peer.agent_name, msg.transfer_id, msg.attempt, "layout changed since "
                       "handshake; reconnect")
            raise MessageRejected("bad_layout", f"stale geometry digest from {peer.engine_id}")
        if msg.transfer_id in self.tombstones:
            self._fail(peer.agent_name, msg.transfer_id, msg.attempt,
                       "the producer already released this transfer")
            self.ctx.counters.inc("stale", label="registration_after_release")
            return
        reg = Registration(msg.transfer_id, msg.attempt, peer.agent_name, msg.engine_id,
                           msg.tp_rank, tuple(msg.block_ids), msg.first_token, msg.num_tokens)
        tr = self.transfers.setdefault(msg.transfer_id, _Transfer())
        if tr.decoder_engine not in (None, msg.engine_id):
            raise MessageRejected("conflict", f"{msg.transfer_id} registered by "
                                  f"{tr.decoder_engine} and {msg.engine_id}")
        tr.decoder_engine = msg.engine_id
        if tr.targets is None:
            g = self.ctx.geometry
            tr.targets = set(target_ranks(g.num_kv_heads, g.tp_size, g.tp_rank,
                                          peer.geometry.tp_size))
        try:
            pairing, superseded = self.rdv.add_registration(reg)
        except StaleEvent as e:
            self.ctx.counters.reject("stale", str(e), context="registration")
            return
        if superseded is not None:
            self.ctx.counters.inc("stale", label="registration_superseded")
        tr.resolved.discard(msg.tp_rank)
        if pairing is None:
            self.ctx.counters.inc("registrations_early")
        else:
            self.ctx.counters.inc("registrations_late")
            self._start(pairing)
        self._maybe_finish(msg.transfer_id)

    def _on_cancel(self, peer: Peer, msg: Cancel) -> None:
        if msg.engine_id != peer.engine_id or msg.tp_rank != peer.tp_rank:
            raise MessageRejected("spoofed", f"cancel names {msg.engine_id}/{msg.tp_rank} "
                                  f"but came from {peer.engine_id}/{peer.tp_rank}")
        self.ctx.counters.inc("cancels")
        try:
            current = self.rdv.cancel(msg.transfer_id, msg.tp_rank, msg.attempt)
        except StaleEvent:
            current = None  # an older attempt: its job (if any) is still acked below
        tr = self.transfers.get(msg.transfer_id)
        if current is not None and tr is not None:
            tr.resolved.add(msg.tp_rank)
        job = self.jobs.get((msg.transfer_id, msg.tp_rank, msg.attempt))
        if job is not None:
            job.ack_cancel = True  # acknowledged when NIXL says the WRITE is finished
        else:
            self._ack(peer.agent_name, msg.transfer_id, msg.tp_rank, msg.attempt)
        self._maybe_finish(msg.transfer_id)

    def _ack(self, peer: str, tid: str, d_rank: int, attempt: int) -> None:
        self.ctx.send(peer, CancelAck(transfer_id=tid, attempt=attempt,
                                      engine_id=self.ctx.engine_id, tp_rank=self.ctx.tp_rank))

    def _fail(self, peer: str, tid: str, attempt: int, reason: str) -> None:
        self.ctx.counters.inc("transfers_failed")
        logger.warning("kv_push: transfer %s attempt %d to %s failed: %s", tid, attempt, peer,
                       reason)
        self.ctx.send(peer, TransferFailed(transfer_id=tid, attempt=attempt,
                                           engine_id=self.ctx.engine_id,
                                           tp_rank=self.ctx.tp_rank, reason=reason))

    # -- transfers -----------------------------------------------------------------------------
    def _start(self, pairing: Pairing) -> None:
        started = self.ctx.clock()
        src, reg = pairing.source, pairing.registration
        peer = self.ctx.peer(reg.peer)
        tr = self.transfers.get(src.transfer_id)
        if tr is None:
            # Retired while an earlier pairing of the same prefill was started (its WRITE was
            # DONE at the first poll and no target rank was left): this pairing is a decoder
            # rank we do not write to. Re-creating the entry here would leak it.
            return
        if peer is None:
            tr.resolved.add(reg.tp_rank)
            return
        if reg.num_tokens > src.num_tokens:
            self._fail(reg.peer, reg.transfer_id, reg.attempt,
                       f"decoder wants {reg.num_tokens} tokens, prefill has {src.num_tokens}")
            tr.resolved.add(reg.tp_rank)
            return
        try:
            plan = plan_writes(self.ctx.geometry, src.block_ids, peer.geometry, reg.block_ids,
                               first_token=reg.first_token, num_tokens=reg.num_tokens)
        except GeometryError as e:
            self.ctx.counters.reject("bad_layout", str(e), context=f"plan for {reg.transfer_id}")
            self._fail(reg.peer, reg.transfer_id, reg.attempt, f"cannot map blocks: {e}")
            tr.resolved.add(reg.tp_rank)
            return
        if plan.num_regions == 0:
            tr.resolved.add(reg.tp_rank)  # not a writer for that rank, or nothing left to write
            return
        if plan.head_sliced:
            self.ctx.counters.inc("head_sliced_plans")
        g = self.ctx.geometry
        src_d, dst_d = plan.descs("src", g.dev_id), plan.descs("dst", peer.geometry.dev_id)
        cuts = _chunk_bounds(plan.length, self.ctx.config.max_post_bytes,
                             self.ctx.config.max_post_regions)
        pending = []
        for i, (a, b) in enumerate(cuts):
            notif = self.ctx.codec.encode(WriteDone(
                transfer_id=reg.transfer_id, attempt=reg.attempt, engine_id=self.ctx.engine_id,
                tp_rank=self.ctx.tp_rank, num_bytes=int(plan.length[a:b].sum()), chunk=i,
                chunks=len(cuts)))
            pending.append((src_d[a:b], dst_d[a:b], notif))
        self.ctx.counters.inc("regions_written", plan.num_regions)
        jkey = (reg.transfer_id, reg.tp_rank, reg.attempt)
        self.jobs[jkey] = _Job(pairing, reg.peer, started, plan.total_bytes, pending)
        self._poll_job(jkey)

    def _poll_job(self, jkey: tuple[str, int, int]) -> None:
        job = self.jobs[jkey]
        if job.pending and not job.error and not job.ack_cancel:
            src_d, dst_d, notif = job.pending.pop(0)
            g, peer = self.ctx.geometry, self.ctx.peer(job.peer)
            dst_mem = peer.geometry.mem_type if peer is not None else g.mem_type
            job.handles.append(self.ctx.write(job.peer, src_d, dst_d, g.mem_type, dst_mem,
                                              notif))
            self.ctx.counters.inc("writes_posted")
        states = [self.ctx.poll(h) for h in job.handles]
        if "ERR" in states and not job.error:
            bad = job.handles[states.index("ERR")]
            job.error = self.ctx.failure_reason(bad)
        if "PROC" in states or (job.pending and not job.error and not job.ack_cancel):
            return  # in flight, or more to post: nothing may be released yet
        del self.jobs[jkey]
        tid, d_rank, attempt = jkey
        reg = job.pairing.registration
        for h in job.handles:
            self.ctx.release(h)
        if job.error:
            self._fail(job.peer, tid, attempt, job.error)
        elif not job.pending:
            self.ctx.counters.inc("transfers_done")
            self.ctx.counters.inc("bytes_written", job.num_bytes)
            self.ctx.counters.inc("transfer_seconds", self.ctx.clock() - job.started)
        if job.ack_cancel and self.ctx.peer(job.peer) is not None:
            self._ack(job.peer, tid, d_rank, attempt)
        tr = self.transfers.get(tid)
        current = {r.tp_rank: r for r in self.rdv.registrations(tid)}.get(d_rank)
        if tr is not None and (current is None or current.attempt == reg.attempt):
            tr.resolved.add(d_rank)
        self._maybe_release_source(job.pairing.source)
        self._maybe_finish(tid)

    def _source_in_use(self, source: Source) -> bool:
        return any(j.pairing.source.key == source.key for j in self.jobs.values())

    def _maybe_release_source(self, source: Source) -> None:
        if source.key not in self.sources or self._source_in_use(source):
            return
        if self.rdv.source(source.transfer_id) is source and source.transfer_id in self.rdv:
            return  # still the live source of its transfer
        del self.sources[source.key]
        self.on_released(source.key)

    def _maybe_finish(self, tid: str) -> None:
        tr = self.transfers.get(tid)
        src = self.rdv.source(tid)
        if tr is None or src is None or tr.targets is None:
            return
        if not tr.targets <= tr.resolved:
            return
        if any(k[0] == tid for k in self.jobs):
            return
        self._retire(tid, src)

    def _retire(self, tid: str, source: Source | None) -> None:
        """Forget transfer ``tid`` for good (done, failed or expired): drop its rendezvous entry
        and what this worker owed, remember it in ``tombstones`` for ``rendezvous_ttl_s`` (late
        registrations and re-issued prefills for it are answered at once), and release
        ``source`` (its prefill, if any) unless something still reads it."""
        self.rdv.drop(tid)
        self.transfers.pop(tid, None)
        self.tombstones[tid] = self.ctx.clock()
        if source is not None:
            self._maybe_release_source(source)

    # -- role hooks ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for jkey in list(self.jobs):
            if jkey in self.jobs:
                self._poll_job(jkey)
        for tid, source, regs in self.rdv.expire():
            self.ctx.counters.inc("expired")
            logger.warning("kv_push: transfer %s expired unpaired (prefill %s, %d registration(s))",
                           tid, "done" if source else "missing", len(regs))
            for reg in regs:
                self._fail(reg.peer, tid, reg.attempt, "no prefill arrived in time")
            self._retire(tid, source)
        ttl = self.ctx.config.rendezvous_ttl_s
        for tid, when in list(self.tombstones.items()):
            if now - when > ttl:
                del self.tombstones[tid]

    def busy(self) -> bool:
        return bool(self.jobs)

    def on_peer_dead(self, peer: Peer) -> None:
        for reg in self.rdv.drop_peer(peer.agent_name):
            tr = self.transfers.get(reg.transfer_id)
            if tr is not None:
                tr.resolved.add(reg.tp_rank)
        for jkey, job in list(self.jobs.items()):
            if job.peer == peer.agent_name:
                # its memory is gone with it; stop tracking and let the source go
                del self.jobs[jkey]
                for h in job.handles:
                    self.ctx.release(h)
                tr = self.transfers.get(jkey[0])
                if tr is not None:
                    tr.resolved.add(jkey[1])
                self._maybe_release_source(job.pairing.source)
        for tid in list(self.transfers):
            self._maybe_finish(tid)

    def close(self) -> None:
        for job in self.jobs.values():
            for h in job.handles:
                self.ctx.release(h)
        self.jobs.clear()

    # -- introspection for tests and metrics ----------------------------------------------------
    def live(self) -> dict[str, int]:
        return {"sources": len(self.sources), "jobs": len(self.jobs),
                "rendezvous": len(self.rdv), "transfers": len(self.transfers)}
