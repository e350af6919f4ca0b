"""A randomised model check of the push protocol: real ``Producer`` and ``Decoder`` roles (one
producer engine and one decoder engine, TP 1 or 2 each) over a model network and a model NIXL,
driven by a seeded scheduler through thousands of interleavings.

What the scheduler may do at each step (weighted at random):

* engines: client requests arrive as the router sends them -- one transfer id for a prompt list
  and/or ``n > 1`` (several engine requests on each side, identical prompts included, with or
  without ``fanout``); P finishes or fails prefills; D schedules (with a partial or full local
  prefix hit), aborts before or after scheduling, or re-allocates (a new attempt);
* the router releases a transfer id (``Release``: its exchange ended without decode output) --
  at any moment, even while D still registers, writes or receives it (a superset of when the
  router does it), reaching each P rank or not (a rank it never reaches frees at the TTL);
* the network: every notification (control messages, heartbeats, WRITE notices) is held and
  delivered later in any order, within ``MAX_DELAY_S``; control messages may be lost (each one
  at most ``MAX_LOSSES`` times: the decoder re-sends its cancels) or duplicated;
* model NIXL: a WRITE is posted "in flight" and, at a later step, lands (bytes and notice), or
  completes locally first and lands later (a local DONE does not prove remote delivery, as on
  LIBFABRIC), or fails (before or after some of it landed); every WRITE lands or fails within
  ``MAX_FLIGHT_S`` (the assumption ``fence_timeout_s`` rests on);
* processes: step a worker; freeze one (no steps, no heartbeats: silence) and thaw it (a stall
  lasts at most ``MAX_STALL_S``); kill P or D (their side-channel lifelines close; a dead P's
  WRITEs never land afterwards); mute a producer for longer than the fence bound (every
  notification it sends is lost, its WRITEs still go out) -- the case where a decoder gives up
  on it, closes its lifeline (the close reaches P within ``MAX_DELAY_S``) and drops it;
* time advances (heartbeat time-outs, transfer time-outs, cancel re-sends, fence bound, TTLs).

The timing bounds are the assumptions ``fence_timeout_s`` rests on (see ``decoder.py``): a
decoder gives up on a producer that did not answer its cancels in time and frees the blocks, so
a message must arrive, a stall must end and a WRITE must land well within that bound. Within
them, no interleaving may break an invariant.

Invariants, checked as they happen and at quiescence (after a drain phase with a reliable
network, well past every time-out):

1. no WRITE lands in a decoder block that is not owned, at that moment, by the registration the
   WRITE was for (freed, reused by another request, or another attempt's): per (D rank, block)
   the owner is tracked from allocation to the rank's outcome;
2. exactly one outcome per key and attempt on every live decoder rank, and one for the newest
   attempt of every expected key (an older attempt's outcome, if one went out before the new
   attempt reached the decoder, is dropped as the engine drops it); a "received" request has
   every block written by every producer rank that writes to it, with KV of its own prompt;
3. the producer never frees a source while a WRITE still reads it (unless its decoder is dead),
   and frees every source exactly once;
4. a WRITE handle is never released while in flight;
5. nothing is held at quiescence: sources, jobs, claims, rendezvous entries, orphan handles,
   transfer ids the router released (they expire),
   tombstones on P; wants and parked outcomes on D; every D block free.

Default: ``RUNS`` seeded runs (``KV_PUSH_MODEL_RUNS`` raises it, ``KV_PUSH_MODEL_SEED`` picks the
first seed). A failure names the seed and prints the last actions; rerun that seed with
``KV_PUSH_MODEL_SEED=<seed> KV_PUSH_MODEL_RUNS=1``.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from typing import Callable

import pytest

from kv_push.common import geometry as G
from kv_push.common.config import PushConfig
from kv_push.common.decoder import Decoder
from kv_push.common.layout import writer_ranks
from kv_push.common.messages import Codec, MessageRejected, Welcome, WriteDone
from kv_push.common.metrics import Counters
from kv_push.common.producer import Producer
from kv_push.common.side_channel import HandshakeError
from kv_push.common.transfer_thread import TransferThread

from fakes import FakeClock, FakeHandle, FakeTransport, InlineExecutor, Wire

RUNS = int(os.environ.get("KV_PUSH_MODEL_RUNS", "1600"))
FIRST_SEED = int(os.environ.get("KV_PUSH_MODEL_SEED", "0"))
BATCHES = 8

HEADS, BLOCK, TOKENS = 2, 4, 8  # a prompt: 8 tokens, 2 blocks of 4
BLOCKS_PER_PROMPT = TOKENS // BLOCK
NUM_BLOCKS = 48
PORT = 7000
HB = 2.0  # heartbeat interval: a worker silent for 3 s is unresponsive
MAX_FLIGHT_S = 4.0  # every WRITE lands or fails this long after its post, at the latest
MAX_DELAY_S = 3.0  # every notification arrives (or is lost) this long after it is sent
MAX_STALL_S = 6.0  # a frozen worker thaws by then
MAX_LOSSES = 2  # copies of one control message (same kind, request, attempt, direction) lost
CONFIG = dict(heartbeat_interval_s=HB, transfer_timeout_s=10.0, rendezvous_ttl_s=30.0,
              cancel_retry_s=0.5, fence_timeout_s=20.0, max_post_regions=1, idle_poll_s=0.001)
QUIESCE_S = 120.0  # the drain phase: well past every time-out (give-up 2 x 20 s, TTL 30 s)
RELEASE = "release:"  # key prefix of release-only expects (the connector's, outcome ignored)
CODEC = Codec()


class Violation(AssertionError):
    pass


def geom(side: str, tp: int, rank: int) -> G.KVGeometry:
    base = (1 << 32 if side == "P" else 1 << 36) + (rank << 24)
    return G.pooled(base=base, placement="kv_split", num_layers=1, num_kv_heads=HEADS,
                    head_size=4, dtype_bytes=2, dtype="bfloat16", block_size=BLOCK,
                    num_blocks=NUM_BLOCKS, tp_size=tp, tp_rank=rank)


def blocks_of(g: G.KVGeometry, descs) -> set[int]:
    """The blocks of ``g`` that (addr, len, dev) descriptors touch."""
    out: set[int] = set()
    span = g.num_blocks * g.block_stride
    for addr, length, _ in descs.tolist():
        for bases in g.part_bases:
            for base in bases:
                if base <= addr < base + span:
                    first = (addr - base) // g.block_stride
                    last = (addr + length - 1 - base) // g.block_stride
                    out.update(range(first, last + 1))
    return out


@dataclass
class Msg:
    sender: str
    to: str
    data: bytes
    control: bool  # may be lost or duplicated (a WRITE's notice rides its data: never)
    deadline: float = 0.0


@dataclass
class Flight:
    """One posted WRITE chunk in the model NIXL."""

    handle: FakeHandle
    p_rank: int
    d_rank: int
    src_blocks: set[int]
    dst_blocks: set[int]
    reg: tuple[str, int]  # (reg_id, attempt) it was posted for
    digest: str  # the prompt whose KV it carries (owner of the source blocks at post time)
    deadline: float
    landed: bool = False


class ModelTransport(FakeTransport):
    """The ``Transport`` seam over the model: notifications go to the model network, WRITEs
    become ``Flight``s the scheduler completes."""

    def __init__(self, model: "Model", name: str):
        super().__init__(model.wire, name)
        self.model = model

    def send_notif(self, peer: str, data: bytes) -> bool:
        self._called()
        if peer not in self.peers or peer not in self.wire.queues:
            return False
        if self.model.muted(self.agent_name):
            return True  # posted, and lost
        self.model.network.append(Msg(self.agent_name, peer, bytes(data), control=True,
                                      deadline=self.model.clock.t + MAX_DELAY_S))
        return True

    def write(self, peer, src, dst, src_mem, dst_mem, notif) -> FakeHandle:
        self._called()
        handle = FakeHandle(peer, "PROC", bytes(notif), src, dst)
        self.writes.append(handle)
        if peer not in self.peers:
            handle.state, handle.reason = "ERR", f"unknown peer {peer}"
            return handle
        self.model.posted(self.agent_name, handle)
        return handle

    def release(self, handle: FakeHandle) -> None:
        if handle.state == "PROC":
            raise Violation(f"{self.agent_name} released a WRITE handle in flight")
        super().release(handle)


class Worker:
    def __init__(self, model: "Model", side: str, rank: int, tp: int, config: PushConfig):
        self.side, self.rank = side, rank
        self.name = f"{side}{rank}"
        self.geometry = geom(side, tp, rank)
        self.transport = ModelTransport(model, self.name)
        self.counters = Counters()
        self.thread = TransferThread(self.transport, engine_id=side, tp_rank=rank,
                                     geometry=self.geometry, config=config,
                                     counters=self.counters, clock=model.clock)
        self.dead = False
        self.frozen = False
        self.thaw_at = 0.0


@dataclass
class PReq:
    key: str
    tid: str
    digest: str
    capacity: int
    state: str = "new"  # new | prefilled | failed | released
    blocks: tuple[int, ...] = ()
    released_by: set[int] = field(default_factory=set)  # P ranks that released it


@dataclass
class DReq:
    key: str
    tid: str
    digest: str
    state: str = "new"  # new | expected | done (the engine stopped waiting)
    attempt: int = -1
    first_token: int = 0
    blocks: dict[int, tuple[int, ...]] = field(default_factory=dict)  # attempt -> block ids
    outcomes: dict[int, str] = field(default_factory=dict)  # D rank -> kind
    release_only: bool = False


class Model:
    def __init__(self, seed: int):
        self.seed = seed
        self.rng = random.Random(seed)
        rng = self.rng
        self.clock = FakeClock(1000.0)
        self.wire = Wire()
        self.network: list[Msg] = []
        self.flights: list[Flight] = []
        self.trace: list[str] = []
        self.p_tp, self.d_tp = rng.choice([(1, 1), (1, 2), (2, 1), (2, 2)])
        self.loss = rng.choice([0.0, 0.02, 0.1])
        self.dup = rng.choice([0.0, 0.05])
        cfg = PushConfig(**CONFIG).validate()
        self.P = [Worker(self, "P", r, self.p_tp, cfg) for r in range(self.p_tp)]
        self.D = [Worker(self, "D", r, self.d_tp, cfg) for r in range(self.d_tp)]
        self.released: dict[int, list[str]] = {r: [] for r in range(self.p_tp)}
        self.producers = []
        for w in self.P:
            prod = Producer(w.thread, on_released=self.released[w.rank].append,
                            side_channel_ports=tuple(PORT + r for r in range(self.p_tp)))
            w.thread.add_role(prod)
            self.producers.append(prod)
        self.decoders = []
        for w in self.D:
            dec = Decoder(w.thread, handshake_fn=self._handshake_for(w),
                          executor=InlineExecutor())
            w.thread.add_role(dec)
            self.decoders.append(dec)
        # lifelines: (d_rank, p_rank) -> (welcome, d-side on_closed)
        self.lifelines: dict[tuple[int, int], tuple[Welcome, Callable]] = {}
        # engines
        self.preqs: list[PReq] = []
        self.dreqs: list[DReq] = []
        self.p_free = list(range(NUM_BLOCKS))  # same block ids on every P rank
        self.p_owner: dict[int, str] = {}  # P block -> P request key (all P ranks alike)
        self.d_free = list(range(NUM_BLOCKS))  # same block ids on every D rank
        self.d_owner: dict[tuple[int, int], tuple[str, int] | None] = {}  # (rank, blk) -> reg
        self.d_data: dict[tuple[int, int], dict[int, tuple[str, tuple[str, int]]]] = {}
        self.outcome_count: dict[tuple[int, str, int], int] = {}  # (D rank, key, attempt)
        self.violation: Violation | None = None
        self.losses: dict[tuple, int] = {}
        self.closures: list[tuple[float, int, int]] = []  # (due, p_rank, d_rank)
        # a producer whose notifications are all lost for a while (it still writes): the only
        # way a fence outlives its bound within the model's assumptions
        self.mute_at = rng.uniform(0, 40) if rng.random() < 0.15 else None
        self.mute_for = rng.uniform(25, 45)
        self.kill_p = rng.random() < 0.08
        self.kill_d = rng.random() < 0.05
        self.router_released: set[str] = set()
        self.releases_on = rng.random() < 0.5  # half the runs: the router releases transfers
        self._make_clients()

    # -- setup -------------------------------------------------------------------------------
    def _make_clients(self) -> None:
        rng = self.rng
        for c in range(rng.randint(1, 4)):
            tid = f"t{c}"
            prompts = [rng.choice("AB") for _ in range(rng.randint(1, 2))]
            n = rng.choice([1, 1, 2])
            fanout = n > 1 and rng.random() < 0.5
            for i, prompt in enumerate(prompts):
                digest = f"{prompt}{c}" if rng.random() < 0.5 else prompt  # shared across tids too
                for j in range(1 if fanout else n):
                    self.preqs.append(PReq(f"p-{tid}-{i}-{j}", tid, digest, n if fanout else 1))
                for j in range(n):
                    self.dreqs.append(DReq(f"{j}_d-{tid}-{i}", tid, digest))

    def _handshake_for(self, dw: Worker):
        def handshake(host, port, hello, codec, timeout, on_closed=None, on_open=None, on_unproven=None):
            pw = self.P[port - PORT]
            if pw.dead or pw.frozen:
                raise HandshakeError(f"{host}:{port}: timed out")
            prod = self.producers[pw.rank]
            try:
                welcome = prod.accept_hello(hello)
            except MessageRejected as e:
                raise HandshakeError(f"refused: {e}") from None
            key = (dw.rank, pw.rank)
            self.lifelines[key] = (welcome, on_closed)
            if on_open is not None:
                on_open(lambda: self._close_lifeline(key, "D severed it"))
            return welcome
        return handshake

    def _close_lifeline(self, key: tuple[int, int], why: str) -> None:
        entry = self.lifelines.pop(key, None)
        if entry is None:
            return
        welcome, on_closed = entry
        d_rank, p_rank = key
        self.note(f"lifeline D{d_rank}-P{p_rank} closed ({why})")
        if not self.D[d_rank].dead and on_closed is not None:
            on_closed(welcome)  # D's watcher thread
        # P's side-channel handler sees it once the close reaches P's host
        self.closures.append((self.clock.t + self.rng.uniform(0, MAX_DELAY_S), p_rank, d_rank))

    def close_reaches_p(self, i: int) -> None:
        _, p_rank, d_rank = self.closures.pop(i)
        if not self.P[p_rank].dead:
            self.note(f"P{p_rank} sees D{d_rank}'s lifeline closed")
            self.P[p_rank].thread.peer_lost(f"D{d_rank}", "decoder closed its side channel")

    def muted(self, name: str) -> bool:
        if name != "P0" or self.mute_at is None:
            return False
        since = self.clock.t - 1000 - self.mute_at
        return 0 <= since < self.mute_for

    def note(self, what: str) -> None:
        self.trace.append(f"t={self.clock.t - 1000:.2f} {what}")

    def fail(self, what: str) -> None:
        """Record a violation and raise it. Raised inside a role's call (through the transport)
        the roles' own guards would swallow it, so ``run`` re-raises the first one recorded."""
        if self.violation is None:
            self.violation = Violation(
                f"seed {self.seed}: {what}\n  (P TP {self.p_tp}, D TP {self.d_tp}, "
                f"loss {self.loss}, dup {self.dup})\n  last actions:\n    "
                + "\n    ".join(self.trace[-40:]))
        raise self.violation

    # -- model NIXL ----------------------------------------------------------------------------
    def posted(self, sender: str, handle: FakeHandle) -> None:
        pw = self.P[int(sender[1:])]
        d_rank = int(handle.peer[1:])
        notice = CODEC.decode(handle.notif)
        src = blocks_of(pw.geometry, handle.src)
        owners = {self.p_owner.get(b) for b in src}
        if len(owners) != 1 or None in owners:
            self.fail(f"{sender} posted a WRITE from blocks {sorted(src)} owned by {owners}")
        (owner,) = owners
        preq = next(p for p in self.preqs if p.key == owner)
        dst = blocks_of(self.D[d_rank].geometry, handle.dst)
        self.flights.append(Flight(handle, pw.rank, d_rank, src, dst,
                                   (notice.reg_id, notice.attempt), preq.digest,
                                   self.clock.t + MAX_FLIGHT_S))
        self.note(f"{sender} posts chunk {notice.chunk}/{notice.chunks} of {notice.reg_id}"
                  f"@{notice.attempt} to D{d_rank} blocks {sorted(dst)}")

    def land(self, f: Flight) -> None:
        """The bytes arrive in D's memory (and the notice is on its way)."""
        f.landed = True
        dw = self.D[f.d_rank]
        if dw.dead:
            return
        for b in f.dst_blocks:
            owner = self.d_owner.get((f.d_rank, b))
            if owner != f.reg:
                self.fail(f"WRITE for {f.reg} from P{f.p_rank} landed in D{f.d_rank} block {b}, "
                          f"owned by {owner}")
            self.d_data.setdefault((f.d_rank, b), {})[f.p_rank] = (f.digest, f.reg)
        self.network.append(Msg(f"P{f.p_rank}", f"D{f.d_rank}", f.handle.notif, control=False,
                                deadline=self.clock.t + MAX_DELAY_S))

    def write_event(self, f: Flight, how: str) -> None:
        h = f.handle
        self.note(f"WRITE P{f.p_rank}->D{f.d_rank} {f.reg}: {how}")
        if how == "land":
            if not f.landed:
                self.land(f)
            if h.state == "PROC":
                h.state = "DONE"
        elif how == "local_done":  # DONE on P; the bytes and notice arrive later
            h.state = "DONE"
        elif how == "err":  # failed: some of it may have landed before, never after
            if self.rng.random() < 0.5:
                for b in f.dst_blocks:  # partial bytes, no notice
                    owner = self.d_owner.get((f.d_rank, b))
                    if not self.D[f.d_rank].dead and owner != f.reg:
                        self.fail(f"failed WRITE for {f.reg} touched D{f.d_rank} block {b} "
                                  f"owned by {owner}")
            h.state, h.reason = "ERR", "model: transfer failed"
            f.landed = True
        if f.landed and h.state != "PROC":
            self.flights.remove(f)

    def settle_overdue(self) -> None:
        """Keep the timing assumptions: what is due happens before time moves on."""
        for f in list(self.flights):
            if self.clock.t >= f.deadline:
                self.write_event(f, "land")
        i = 0
        while i < len(self.network):
            if self.clock.t >= self.network[i].deadline:
                self.deliver(i, reliable=True)
            else:
                i += 1
        for w in self.P + self.D:
            if w.frozen and self.clock.t >= w.thaw_at:
                w.frozen = False
                self.note(f"{w.name} awake")
        for i in reversed(range(len(self.closures))):
            if self.clock.t >= self.closures[i][0]:
                self.close_reaches_p(i)

    # -- engines -------------------------------------------------------------------------------
    def p_event(self, preq: PReq) -> None:
        live = [w for w in self.P if not w.dead]
        if self.rng.random() < 0.12:
            preq.state = "failed"
            self.note(f"P engine: prefill {preq.key} ({preq.tid}/{preq.digest}) failed")
            for w in live:
                prod = self.producers[w.rank]
                w.thread.submit(lambda p=prod: p.prefill_failed(
                    preq.tid, "aborted", prompt_digest=preq.digest, capacity=preq.capacity))
            return
        blocks = tuple(self.p_free[:BLOCKS_PER_PROMPT])
        del self.p_free[:BLOCKS_PER_PROMPT]
        for b in blocks:
            self.p_owner[b] = preq.key
        preq.state, preq.blocks = "prefilled", blocks
        self.note(f"P engine: prefill {preq.key} ({preq.tid}/{preq.digest}) done in {blocks}")
        for w in live:
            prod = self.producers[w.rank]
            w.thread.submit(lambda p=prod: p.prefill_done(
                preq.key, preq.tid, blocks, TOKENS, prompt_digest=preq.digest,
                capacity=preq.capacity))

    def _expect_all(self, key, dreq: DReq, attempt, blocks, first, num) -> None:
        for w in self.D:
            if w.dead:
                continue
            dec = self.decoders[w.rank]
            w.thread.submit(lambda d=dec: d.expect(key, dreq.tid, attempt, ("p", PORT), blocks,
                                                   first, num, prompt_digest=dreq.digest))

    def d_event(self, dreq: DReq) -> None:
        rng = self.rng
        if dreq.state == "new":
            if rng.random() < 0.1:  # aborted while queued: a release-only registration
                dreq.state, dreq.release_only = "done", True
                self.note(f"D engine: {dreq.key} aborted before scheduling")
                self._expect_all(RELEASE + dreq.key, dreq, 0, (), 0, 0)
                return
            first = rng.choice([0, 0, 0, BLOCK, TOKENS])
            dreq.first_token = first
            if first == TOKENS:  # a full local hit: tell P to let go, do not wait
                dreq.state, dreq.release_only = "done", True
                self.note(f"D engine: {dreq.key} full local hit")
                self._expect_all(RELEASE + dreq.key, dreq, 0, (), first, first)
                return
            self._allocate(dreq)
            return
        # expected: cancel, or re-allocate (a new attempt)
        if rng.random() < 0.6:
            self.note(f"D engine: cancel {dreq.key}")
            dreq.state = "cancelled"
            for w in self.D:
                if not w.dead:
                    dec = self.decoders[w.rank]
                    w.thread.submit(lambda d=dec: d.cancel(dreq.key, "aborted"))
        else:
            self._allocate(dreq)

    def _allocate(self, dreq: DReq) -> None:
        need = (TOKENS - dreq.first_token) // BLOCK
        if len(self.d_free) < need:
            return
        blocks = tuple(self.d_free[:need])
        del self.d_free[:need]
        dreq.attempt += 1
        dreq.state = "expected"
        dreq.blocks[dreq.attempt] = blocks
        for w in self.D:
            for b in blocks:
                self.d_owner[(w.rank, b)] = (dreq.key, dreq.attempt)
                self.d_data.pop((w.rank, b), None)
        self.note(f"D engine: expect {dreq.key}@{dreq.attempt} ({dreq.tid}/{dreq.digest}) "
                  f"blocks {blocks} from token {dreq.first_token}")
        self._expect_all(dreq.key, dreq, dreq.attempt, blocks, dreq.first_token, TOKENS)

    def drain(self, w: Worker) -> None:
        if w.side == "P":
            for key in self.released[w.rank]:
                self.p_released(w, key)
            self.released[w.rank].clear()
            return
        outcomes = self.decoders[w.rank].outcomes
        while not outcomes.empty():
            self.d_outcome(w, outcomes.get_nowait())

    def p_released(self, w: Worker, key: str) -> None:
        preq = next((p for p in self.preqs if p.key == key), None)
        self.note(f"P{w.rank} releases {key}")
        if preq is None or preq.state != "prefilled":
            self.fail(f"P{w.rank} released {key}, which is {preq and preq.state}")
        for f in self.flights:  # nothing may still read it (unless its decoder is gone)
            if (f.p_rank == w.rank and f.handle.state == "PROC" and f.src_blocks & set(preq.blocks)
                    and not self.D[f.d_rank].dead
                    and w.thread.peer(f"D{f.d_rank}") is not None):
                self.fail(f"P{w.rank} released {key} while a WRITE to a live D{f.d_rank} reads it")
        if w.rank in preq.released_by:
            self.fail(f"P{w.rank} released {key} twice")
        preq.released_by.add(w.rank)
        if preq.released_by >= {p.rank for p in self.P if not p.dead}:
            preq.state = "released"
            for b in preq.blocks:
                del self.p_owner[b]
            self.p_free.extend(preq.blocks)

    def d_outcome(self, w: Worker, o) -> None:
        self.note(f"D{w.rank} outcome {o.key}@{o.attempt}: {o.kind} {o.reason}")
        ident = (w.rank, o.key, o.attempt)
        count = self.outcome_count[ident] = self.outcome_count.get(ident, 0) + 1
        if count > 1:
            self.fail(f"D{w.rank}: a second outcome for {o.key} attempt {o.attempt}")
        if o.key.startswith(RELEASE):
            return
        dreq = next(d for d in self.dreqs if d.key == o.key)
        if o.attempt < dreq.attempt:
            return  # superseded after it went out: the engine waits for the newer one
        if o.kind == "received":
            self.check_received(w.rank, dreq)
        dreq.outcomes[w.rank] = o.kind
        for attempt, blocks in dreq.blocks.items():  # this rank promised: nothing lands now
            for b in blocks:
                self.d_owner[(w.rank, b)] = None
        if set(dreq.outcomes) >= {d.rank for d in self.D if not d.dead}:
            dreq.state = "done"
            for blocks in dreq.blocks.values():
                self.d_free.extend(blocks)
            dreq.blocks = {}

    def check_received(self, d_rank: int, dreq: DReq) -> None:
        blocks = dreq.blocks[dreq.attempt]
        writers = writer_ranks(HEADS, self.p_tp, self.d_tp, d_rank)
        for b in blocks:
            got = self.d_data.get((d_rank, b), {})
            for p in writers:
                if got.get(p) != (dreq.digest, (dreq.key, dreq.attempt)):
                    self.fail(f"D{d_rank} reported {dreq.key}@{dreq.attempt} received, but block "
                              f"{b} holds {got.get(p)} from P{p} (want {dreq.digest})")

    # -- the scheduler -------------------------------------------------------------------------
    def step(self, w: Worker) -> None:
        w.thread.step()
        self.drain(w)

    def deliver(self, i: int, reliable: bool = False) -> None:
        msg = self.network[i]
        if not reliable and msg.control and self.rng.random() < self.dup:
            pass  # a copy stays on the wire
        else:
            self.network.pop(i)
        to = self.P[int(msg.to[1:])] if msg.to[0] == "P" else self.D[int(msg.to[1:])]
        if to.dead:
            return
        if b"\xa2hb" not in msg.data[:40]:  # heartbeats are not worth a line
            self.note(f"deliver {msg.sender}->{msg.to} {_describe(msg.data)}")
        self.wire.inject(msg.to, msg.sender, msg.data)

    def live_workers(self) -> list[Worker]:
        return [w for w in self.P + self.D if not w.dead]

    def kill(self, w: Worker) -> None:
        self.note(f"kill {w.name}")
        w.dead = True
        if w.side == "P":
            for f in [f for f in self.flights if f.p_rank == w.rank]:
                self.flights.remove(f)  # its WRITEs die with it: nothing lands later
        for key in [k for k in self.lifelines if (k[1] if w.side == "P" else k[0]) == w.rank]:
            self._close_lifeline(key, f"{w.name} died")

    def router_release(self, tid: str) -> None:
        """The router's Release of ``tid``: to each live P rank, or lost on the way to it."""
        self.router_released.add(tid)
        told = []
        for w in self.P:
            if w.dead or self.rng.random() < 0.15:
                continue
            prod = self.producers[w.rank]
            w.thread.submit(lambda p=prod: p.release((tid,)))
            told.append(w.name)
        self.note(f"router releases {tid} on {told}")

    def pending_engine(self) -> list[Callable[[], None]]:
        out = []
        for tid in sorted({d.tid for d in self.dreqs} - self.router_released):
            if self.releases_on and self.rng.random() < 0.2:
                out.append(lambda tid=tid: self.router_release(tid))
        for p in self.preqs:
            if p.state == "new":
                out.append(lambda p=p: self.p_event(p))
        for d in self.dreqs:
            if d.state in ("new", "expected") and not d.outcomes and not any(
                    w.dead for w in self.D):
                out.append(lambda d=d: self.d_event(d))
        return out

    def run(self, active_actions: int) -> None:
        rng = self.rng
        for w in self.live_workers():
            self.step(w)
        for _ in range(active_actions):
            if self.violation is not None:
                raise self.violation
            r = rng.random()
            live = self.live_workers()
            if r < 0.30:
                awake = [w for w in live if not w.frozen]
                if awake:
                    self.step(rng.choice(awake))
            elif r < 0.55:
                if self.network:
                    i = rng.randrange(len(self.network))
                    msg = self.network[i]
                    ident = (msg.sender, msg.to, _describe(msg.data))
                    if (msg.control and rng.random() < self.loss
                            and self.losses.get(ident, 0) < MAX_LOSSES):
                        self.losses[ident] = self.losses.get(ident, 0) + 1
                        self.note(f"lost {ident[2]}")
                        self.network.pop(i)
                    else:
                        self.deliver(i)
            elif r < 0.68:
                if self.flights:
                    f = rng.choice(self.flights)
                    how = rng.choices(["land", "local_done", "err"], [6, 3, 1])[0]
                    if f.handle.state != "PROC":  # completed on P: it can only land now
                        how = "land"
                    self.write_event(f, how)
            elif r < 0.70:
                if self.closures:
                    self.close_reaches_p(rng.randrange(len(self.closures)))
            elif r < 0.80:
                events = self.pending_engine()
                if events:
                    rng.choice(events)()
            elif r < 0.93:
                self.clock.advance(rng.choice([0.05, 0.2, 0.5, 1.0, 2.5]))
                self.settle_overdue()
            elif r < 0.97 and live:
                w = rng.choice(live)
                frozen = not w.frozen and rng.random() < 0.5
                if frozen != w.frozen:
                    w.frozen, w.thaw_at = frozen, self.clock.t + MAX_STALL_S
                    self.note(f"{w.name} {'frozen' if w.frozen else 'awake'}")
            elif r >= 0.97:
                if self.kill_p and not self.P[0].dead and rng.random() < 0.3:
                    self.kill(rng.choice(self.P))
                    self.kill_p = False
                elif self.kill_d and not any(d.dead for d in self.D) and rng.random() < 0.3:
                    self.kill(rng.choice(self.D))
                    self.kill_d = False
        self.quiesce()

    def quiesce(self) -> None:
        """A reliable network and awake workers, well past every time-out; then nothing may be
        held and every request must have its one outcome."""
        self.note("-- drain --")
        for w in self.P + self.D:
            w.frozen = False
        self.mute_at = None
        for p in self.preqs:  # the engines finish what they started
            if p.state == "new" and not any(w.dead for w in self.P):
                self.p_event(p)
        start = self.clock.t
        while self.clock.t - start < QUIESCE_S:
            busy = True
            while busy:  # until nothing moves at this instant
                while self.closures:
                    self.close_reaches_p(0)
                for f in list(self.flights):
                    self.write_event(f, "land")
                busy = bool(self.network)
                while self.network:
                    self.deliver(0, reliable=True)
                for w in self.live_workers():
                    self.step(w)
                busy = busy or bool(self.network)
            self.clock.advance(1.0)  # < the 3 s heartbeat time-out: nobody goes silent
            if self.violation is not None:
                raise self.violation
        self.check_quiet()

    def check_quiet(self) -> None:
        for w in self.P + self.D:
            if w.counters.get("rejected", label="internal_error"):
                self.fail(f"{w.name}: a role raised (see the log)")
        if self.flights:
            self.fail(f"WRITEs still in flight at quiescence: {self.flights}")
        for w in self.P:
            if w.dead:
                continue
            prod = self.producers[w.rank]
            held = {k: v for k, v in prod.live().items() if v}
            if (held or prod.orphans or prod.tombstones or prod.answered or prod.readers
                    or prod.released_tids):
                self.fail(f"P{w.rank} holds {held}, orphans {prod.orphans}, tombstones "
                          f"{prod.tombstones}, answered {list(prod.answered)}, released "
                          f"{list(prod.released_tids)}")
        if not any(w.dead for w in self.P):
            for p in self.preqs:
                if p.state == "prefilled":
                    self.fail(f"P request {p.key} was never released")
        for w in self.D:
            if w.dead:
                continue
            dec = self.decoders[w.rank]
            held = {k: v for k, v in dec.live().items() if v}
            if held or dec.wants or dec.superseded:
                self.fail(f"D{w.rank} holds {held} {list(dec.wants)}")
            for d in self.dreqs:
                if d.release_only:
                    key, attempt = RELEASE + d.key, 0
                else:
                    key, attempt = d.key, d.attempt
                expected = 1 if (d.release_only or d.attempt >= 0) else 0
                got = self.outcome_count.get((w.rank, key, attempt), 0)
                if got != expected:
                    self.fail(f"D{w.rank}: {got} outcomes for {key}@{attempt} (expected "
                              f"{expected})")
        if not any(w.dead for w in self.D) and len(self.d_free) != NUM_BLOCKS:
            held = sorted(set(range(NUM_BLOCKS)) - set(self.d_free))
            self.fail(f"D blocks still allocated: {held}")


def _peek(data: bytes):
    try:
        return CODEC.decode(data)
    except MessageRejected:
        return None


def _describe(data: bytes) -> str:
    m = _peek(data)
    if m is None:
        return "?"
    who = getattr(m, "reg_id", "")
    extra = f" chunk {m.chunk}/{m.chunks}" if isinstance(m, WriteDone) else ""
    if hasattr(m, "chunks_done"):
        extra = f" chunks_done {m.chunks_done}"
    return f"{type(m).__name__}({who}@{getattr(m, 'attempt', '')}{extra})"


def run_seed(seed: int) -> Model:
    model = Model(seed)
    model.run(active_actions=model.rng.randint(200, 600))
    return model


@pytest.fixture(autouse=True)
def quiet_logs():
    """The runs fail transfers on purpose, thousands of times: keep the log for what matters."""
    log = logging.getLogger("kv_push")
    level = log.level
    log.setLevel(logging.ERROR)
    yield
    log.setLevel(level)


@pytest.mark.parametrize("batch", range(BATCHES))
def test_random_interleavings_keep_every_invariant(batch):
    seeds = range(FIRST_SEED + batch, FIRST_SEED + RUNS, BATCHES)
    for seed in seeds:
        run_seed(seed)


def test_the_model_sees_the_hazards_it_is_built_for():
    """The model is not vacuous: across the runs of one batch, WRITEs land after a local DONE,
    cancels race WRITEs, messages are lost and duplicated, requests share transfer ids, and every
    kind of outcome happens."""
    seen: dict[str, int] = {}
    for seed in range(FIRST_SEED, FIRST_SEED + 60):
        m = run_seed(seed)
        text = "\n".join(m.trace)
        for what in ("local_done", "lost ", "CancelAck", "TransferFailed", ": received",
                     ": failed", ": released", "frozen", "kill ", "@1 ", "D severed",
                     "lifeline closed"):
            seen[what] = seen.get(what, 0) + text.count(what)
        shared = {d.tid for d in m.dreqs}
        seen["shared tid"] = seen.get("shared tid", 0) + (len(m.dreqs) > len(shared))
        seen["router releases"] = seen.get("router releases", 0) + text.count("router releases")
        for key, counter, label in (
                ("freed by a release", "released", None),
                ("deferred by a release", "release_deferred", None),
                ("registration after a release", "stale", "registration_after_router_release")):
            seen[key] = seen.get(key, 0) + sum(w.counters.get(counter, label=label) for w in m.P)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in seen.items()))
    assert all(v > 0 for v in seen.values()), seen
