"""Decoder role of the transfer thread: register, count completions, fence on abort.

Runs only on the transfer thread, which it sees through a ``RoleContext`` (``self.ctx``). The
engine hands it ``expect`` (a request whose prompt KV a producer will push into these blocks) and
``cancel`` (the request is gone). Results leave through ``outcomes``, a thread-safe queue of
``Outcome`` the engine drains:

* ``received`` -- every producer rank that writes to this rank has reported ``WriteDone``;
* ``failed``   -- the transfer cannot complete (handshake failed, a producer reported failure or
  died, time-out); emitted only once no producer WRITE can still land in the blocks;
* ``released`` -- after ``cancel``: the blocks may be freed or reused; emitted only once every
  producer that was told about them confirmed the cancel (``CancelAck``) or was declared dead.

Exactly one outcome per ``expect``: a ``cancel`` that arrives after the outcome went out does
nothing.

Who registers where: decoder rank 0 registers with every producer rank (so producer ranks that
write nothing to anyone still learn the decoder's TP and can release their blocks); other ranks
register with the producer ranks that write to them (``writer_ranks``). A rank expects one
``WriteDone`` per writer rank.

Handshakes run on a small thread pool (or the ``executor`` given) with a time-out, so a producer
that hangs delays only the requests that need it; their results come back through
``RoleContext.submit``.
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .geometry import GeometryError
from .layout import writer_ranks
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
from .side_channel import HandshakeError, HandshakeRefused, handshake
from .transfer_thread import Peer, RoleContext

logger = logging.getLogger(__name__)

Address = tuple[str, int]

#: key prefix of internal release-only notices (a cancel that came before the handshake ended)
RELEASE_NOTICE = "\x00release:"


@dataclass(frozen=True)
class Outcome:
    key: str
    kind: str  # "received" | "failed" | "released"
    reason: str = ""


@dataclass
class _Remote:
    """One producer engine, known by the address of its rank-0 side channel."""

    address: Address
    engine_id: str | None = None
    tp_size: int | None = None
    ports: tuple[int, ...] = ()
    rank_peers: dict[int, str] = field(default_factory=dict)  # producer rank -> agent name
    connecting: set[int] = field(default_factory=set)


@dataclass
class _Want:
    key: str
    transfer_id: str
    attempt: int
    address: Address
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    deadline: float
    started: float
    state: str = "connecting"  # connecting | registered | fencing
    sent: dict[int, str] = field(default_factory=dict)  # producer rank -> agent name told
    expected: set[int] = field(default_factory=set)  # producer ranks that write to us
    resolved: set[int] = field(default_factory=set)  # ranks that can no longer write
    arrived: set[int] = field(default_factory=set)
    chunks_seen: dict[int, set[int]] = field(default_factory=dict)  # rank -> WriteDone chunks
    outcome: str = ""
    reason: str = ""
    silent: bool = False  # a release-only notice: no outcome goes to the engine


class Decoder:
    handles = (WriteDone, CancelAck, TransferFailed)

    def __init__(self, ctx: RoleContext, *, max_handshakes: int = 8,
                 handshake_fn: Callable[..., Welcome] = handshake,
                 executor: Executor | None = None):
        """``handshake_fn`` has the signature of ``side_channel.handshake``; it runs on
        ``executor`` (default: a pool of ``max_handshakes`` threads, shut down by ``close``)."""
        self.ctx = ctx
        self.outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self.remotes: dict[Address, _Remote] = {}
        self.wants: dict[str, _Want] = {}  # key -> want
        self.by_tid: dict[str, str] = {}  # transfer id -> key
        self._pool = executor or ThreadPoolExecutor(max_handshakes,
                                                    thread_name_prefix="kv-push-handshake")
        self._handshake = handshake_fn
        self._hello: Hello | None = None
        self.digest = geometry_digest(ctx.geometry)  # sent with every registration
        # a refused pair fails every request for it: say so once per pair and reason, not
        # once per request
        self._log = LogLimiter(logger)

    def _my_hello(self) -> Hello:
        if self._hello is None:
            self._hello = Hello(engine_id=self.ctx.engine_id, agent_name=self.ctx.agent_name,
                                agent_metadata=self.ctx.metadata(),
                                geometry=self.ctx.geometry, compat_hash=COMPAT_HASH,
                                nixl_version=self.ctx.nixl_version)
        return self._hello

    # -- engine events -------------------------------------------------------------------------
    def expect(self, key: str, transfer_id: str, attempt: int, address: Address,
               block_ids: tuple[int, ...], first_token: int, num_tokens: int) -> None:
        old = self.wants.get(key)
        if old is not None:
            self._fence(old, "released", "superseded by a new attempt")
        now = self.ctx.clock()
        want = _Want(key, transfer_id, attempt, (address[0], int(address[1])), tuple(block_ids),
                     first_token, num_tokens, now + self.ctx.config.transfer_timeout_s, now)
        self.wants[key] = want
        self.by_tid[transfer_id] = key
        self._advance(want)

    def cancel(self, key: str, reason: str = "aborted") -> None:
        want = self.wants.get(key)
        if want is None:
            # Its outcome already went out (expect and cancel reach this thread in order), and
            # the engine must hear about a request exactly once.
            return
        self.ctx.counters.inc("cancels")
        self._fence(want, "released", reason)

    # -- connection and registration -----------------------------------------------------------
    def _advance(self, want: _Want) -> None:
        if want.state != "connecting":
            return
        remote = self.remotes.get(want.address)
        if remote is None:
            remote = self.remotes[want.address] = _Remote(want.address)
        if remote.tp_size is None:
            self._connect(remote, 0, want.address[1])
            return
        g = self.ctx.geometry
        writers = writer_ranks(g.num_kv_heads, remote.tp_size, g.tp_size, g.tp_rank)
        needed = set(range(remote.tp_size)) if g.tp_rank == 0 else set(writers)
        missing = needed - set(remote.rank_peers)
        if missing:
            for rank in missing:
                self._connect(remote, rank, remote.ports[rank])
            return
        want.expected = set(writers) if want.num_tokens > want.first_token else set()
        for rank in sorted(needed):
            peer = remote.rank_peers[rank]
            reg = Register(transfer_id=want.transfer_id, attempt=want.attempt,
                           engine_id=self.ctx.engine_id, tp_rank=g.tp_rank,
                           block_ids=want.block_ids, first_token=want.first_token,
                           num_tokens=want.num_tokens, geometry_digest=self.digest)
            if not self.ctx.send(peer, reg):
                self._fail(want, f"could not notify producer rank {rank}")
                return
            want.sent[rank] = peer
            self.ctx.counters.inc("registrations_sent")
        want.resolved |= set(want.sent) - want.expected  # non-writers never write to us
        want.state = "registered"
        self._check(want)

    def _connect(self, remote: _Remote, rank: int, port: int) -> None:
        if rank in remote.connecting:
            return
        remote.connecting.add(rank)
        hello = self._my_hello()
        host = remote.address[0]
        timeout = self.ctx.config.handshake_timeout_s
        codec = self.ctx.codec

        def job() -> None:
            try:
                welcome = self._handshake(host, port, hello, codec, timeout,
                                          on_closed=self._lifeline_closed)
            except (HandshakeError, OSError) as e:
                reason = str(e)  # ``e`` is unbound once the except block ends
                refused = e.reason if isinstance(e, HandshakeRefused) else None
                self.ctx.submit(lambda: self._on_handshake_failed(remote, rank, reason, refused))
                return
            self.ctx.submit(lambda: self._on_welcome(remote, rank, welcome))

        self._pool.submit(job)

    def _lifeline_closed(self, welcome: Welcome) -> None:
        """(lifeline thread) The producer's side channel closed: it is gone."""
        self.ctx.peer_lost(welcome.agent_name, "producer closed its side channel")

    def _on_welcome(self, remote: _Remote, rank: int, welcome: Welcome) -> None:
        remote.connecting.discard(rank)
        try:
            if welcome.compat_hash != COMPAT_HASH:
                raise MessageRejected("incompatible", f"producer {welcome.engine_id} speaks "
                                      f"{welcome.compat_hash}, we speak {COMPAT_HASH}")
            if (why := check_peer_nixl(self.ctx.nixl_version, welcome.nixl_version)) is not None:
                raise MessageRejected("incompatible", f"producer {welcome.engine_id}: {why}")
            try:
                welcome.geometry.compatible_with(self.ctx.geometry,
                                                 sides=("on the producer", "on the decoder"))
            except GeometryError as e:
                raise MessageRejected("bad_layout", f"producer {welcome.engine_id}: {e}") from None
            if welcome.geometry.tp_rank != rank:
                raise MessageRejected("invalid", f"port for rank {rank} answered as rank "
                                      f"{welcome.geometry.tp_rank}")
            if remote.engine_id not in (None, welcome.engine_id):
                raise MessageRejected("conflict", f"{remote.address} was {remote.engine_id}, "
                                      f"now {welcome.engine_id}")
            peer = self.ctx.add_peer(welcome.agent_metadata, engine_id=welcome.engine_id,
                                     tp_rank=rank, geometry=welcome.geometry,
                                     digest=geometry_digest(welcome.geometry),
                                     address=remote.address)
        except MessageRejected as e:
            self.ctx.counters.reject(e.reason, e.detail, context=f"handshake {remote.address}")
            refused = str(e) if e.reason in ("incompatible", "bad_layout") else None
            self._on_handshake_failed(remote, rank, str(e), refused)
            return
        self.ctx.counters.inc("handshakes")
        remote.engine_id = welcome.engine_id
        remote.rank_peers[rank] = peer.agent_name
        if rank == 0:
            remote.tp_size = welcome.geometry.tp_size
            ports = tuple(welcome.side_channel_ports) or (remote.address[1],)
            if len(ports) != remote.tp_size:
                ports = tuple(remote.address[1] + r for r in range(remote.tp_size))
            remote.ports = ports
        for want in list(self.wants.values()):
            if want.address == remote.address:
                self._advance(want)

    def _on_handshake_failed(self, remote: _Remote, rank: int, reason: str,
                             refused: str | None = None) -> None:
        """``refused``: the incompatibility, when one side refused the other (counted in
        ``handshake_refusals`` labelled with the producer's address, which the router reads)."""
        remote.connecting.discard(rank)
        self.ctx.counters.inc("handshake_failures")
        host, port = remote.address
        rank_port = remote.ports[rank] if rank < len(remote.ports) else port
        if refused is not None:
            self.ctx.counters.inc("handshake_refusals", label=f"{host}:{port} {refused}")
            self._log.warn(f"refused {host}:{port} {rank} {refused}",
                           "kv_push: producer %s:%d (rank %d) and this decoder are incompatible, "
                           "every request between them fails until one is reconfigured: %s",
                           host, rank_port, rank, refused)
        else:
            self._log.warn(f"handshake {host}:{port} {rank} {reason}",
                           "kv_push: handshake with %s:%d (producer rank %d) failed: %s",
                           host, rank_port, rank, reason)
        if rank == 0 and remote.tp_size is None:
            self.remotes.pop(remote.address, None)  # retry from scratch next time
        for want in list(self.wants.values()):
            if want.address == remote.address and want.state == "connecting":
                self._fail(want, f"handshake with producer rank {rank} failed: {reason}")

    # -- messages ------------------------------------------------------------------------------
    def _want_for(self, peer: Peer, msg) -> _Want | None:
        key = self.by_tid.get(msg.transfer_id)
        want = self.wants.get(key) if key is not None else None
        if want is None or want.attempt != msg.attempt:
            self.ctx.counters.inc("stale", label=type(msg).__name__)
            return None
        if want.sent.get(msg.tp_rank) != peer.agent_name or msg.engine_id != peer.engine_id:
            raise MessageRejected("spoofed", f"{type(msg).__name__} for {msg.transfer_id} from "
                                  f"{peer.engine_id} rank {peer.tp_rank}, not a producer we told")
        return want

    def on_message(self, peer: Peer, msg) -> None:
        want = self._want_for(peer, msg)
        if want is None:
            return
        rank = msg.tp_rank
        if isinstance(msg, WriteDone):
            if rank not in want.expected:
                raise MessageRejected("unexpected", f"WriteDone from non-writer rank {rank}")
            seen = want.chunks_seen.setdefault(rank, set())
            seen.add(msg.chunk)
            if len(seen) == msg.chunks:
                want.arrived.add(rank)
                want.resolved.add(rank)
        elif isinstance(msg, CancelAck):
            want.resolved.add(rank)
        elif isinstance(msg, TransferFailed):
            want.resolved.add(rank)
            if want.state == "registered":
                self._fail(want, f"producer rank {rank}: {msg.reason}")
        self._check(want)

    # -- state changes -------------------------------------------------------------------------
    def _fail(self, want: _Want, reason: str) -> None:
        self.ctx.counters.inc("transfers_failed")
        self._log.warn(f"fail {reason}", "kv_push: transfer %s (%s) failed: %s",
                       want.transfer_id, want.key, reason)
        self._fence(want, "failed", reason)

    def _fence(self, want: _Want, outcome: str, reason: str) -> None:
        """No producer may write into ``want``'s blocks any more; emit ``outcome`` once safe."""
        if want.state == "fencing":
            if outcome == "released":
                want.outcome = outcome  # the engine let go: a pending failure no longer matters
            return
        want.outcome, want.reason = outcome, reason
        if want.state == "connecting":
            # Nothing was advertised, so nothing can be written: done now. The producer may
            # still hold the prefill for this transfer; once connected, tell it that nothing is
            # wanted (a registration with no blocks) so it frees them without waiting for its
            # rendezvous time-out.
            self._finish(want, outcome, reason)
            if not want.silent and outcome == "released":
                notice = _Want(RELEASE_NOTICE + want.key, want.transfer_id, want.attempt,
                               want.address, (), want.first_token, want.first_token,
                               want.deadline, want.started, silent=True)
                self.wants[notice.key] = notice
                self.by_tid[notice.transfer_id] = notice.key
                self._advance(notice)
            return
        want.state = "fencing"
        for rank in sorted(want.expected - want.resolved):
            peer = want.sent.get(rank)
            if peer is None or self.ctx.peer(peer) is None:
                want.resolved.add(rank)
                continue
            self.ctx.send(peer, Cancel(transfer_id=want.transfer_id, attempt=want.attempt,
                                       engine_id=self.ctx.engine_id,
                                       tp_rank=self.ctx.geometry.tp_rank, reason=reason))
        self._check(want)

    def _check(self, want: _Want) -> None:
        if want.state == "registered" and want.expected <= want.arrived:
            self.ctx.counters.inc("transfers_done")
            self.ctx.counters.inc("transfer_seconds", self.ctx.clock() - want.started)
            self._finish(want, "received", "")
        elif want.state == "fencing" and want.expected <= want.resolved:
            self._finish(want, want.outcome, want.reason)

    def _finish(self, want: _Want, kind: str, reason: str) -> None:
        self.wants.pop(want.key, None)
        if self.by_tid.get(want.transfer_id) == want.key:
            del self.by_tid[want.transfer_id]
        if not want.silent:
            self.outcomes.put(Outcome(want.key, kind, reason))

    # -- role hooks ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for want in list(self.wants.values()):
            if want.state != "fencing" and now > want.deadline:
                self.ctx.counters.inc("expired")
                self._fail(want, f"no KV within {self.ctx.config.transfer_timeout_s:.0f}s")

    def busy(self) -> bool:
        # Waiting for WriteDone needs NIXL progress on this side, but polling every
        # idle_poll_s gives it: spinning here took a core from the producer's copy on small
        # hosts (benchmarks/results/transfer.md: push* vs push) for at most idle_poll_s less
        # latency.
        return False

    def on_peer_dead(self, peer: Peer) -> None:
        for remote in list(self.remotes.values()):
            for rank, name in list(remote.rank_peers.items()):
                if name == peer.agent_name:
                    del remote.rank_peers[rank]
            if not remote.rank_peers:
                self.remotes.pop(remote.address, None)
        for want in list(self.wants.values()):
            dead = {r for r, name in want.sent.items() if name == peer.agent_name}
            if not dead:
                continue
            want.resolved |= dead
            if want.state == "registered" and dead & (want.expected - want.arrived):
                self._fail(want, f"producer {peer.engine_id} rank {peer.tp_rank} is dead")
            else:
                self._check(want)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def live(self) -> dict[str, int]:
        return {"wants": len(self.wants)}
