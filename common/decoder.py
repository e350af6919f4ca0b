"""Decoder role of the transfer thread: register, count completions, fence on abort.

Runs only on the transfer thread, which it sees through a ``RoleContext`` (``self.ctx``). The
engine hands it ``expect`` (a request whose prompt KV a producer will push into these blocks) and
``cancel`` (the request is gone). Results leave through ``outcomes``, a thread-safe queue of
``Outcome`` the engine drains:

* ``received`` -- every producer rank that writes to this rank has delivered every chunk's
  ``WriteDone``;
* ``failed``   -- the transfer cannot complete (handshake failed, a producer reported failure,
  went silent or died, time-out); emitted only once no producer WRITE can still land in the
  blocks;
* ``released`` -- after ``cancel``: the blocks may be freed or reused; emitted only once the
  same holds.

With ``early_verdicts``, a failure decided while the blocks must stay fenced (a producer went
silent, failed or timed out with its registration in hand) is also put at once, as an
``Outcome`` of kind ``failed``, into ``verdicts``: the engine may fail the request now (vLLM holds the blocks of a request that
ends while it waits for remote KV until the outcome reports them free), so its client does not
wait out the fence. The outcome itself still comes only once the fence ends.

Exactly one outcome per engine key and attempt, whatever arrives twice or late: every path to an
outcome goes through ``_finish``, which acts once. A ``cancel`` after the outcome does nothing.
An attempt superseded before its outcome has none; one superseded after (the engine re-allocated
while the outcome was on its way) had one, which the engine drops as stale (``Outcome.attempt``
is older than the attempt it waits for) -- either way the newest attempt has exactly one.

Identity: a want is the engine's key (its request id); on the wire it is ``reg_id`` (the same
id) and ``attempt``, so two engine requests that share a transfer id (a prompt list, ``n > 1``)
never see each other's notices. The registration carries the prompt's digest: the producer
pairs it with a prefill of the same prompt. ``expect`` again for a key with a higher attempt (the
engine re-allocated) supersedes the old want: the old one stays fenced, without an outcome of its
own, and the key's outcome waits until it is.

Who registers where: decoder rank 0 registers with every producer rank (so producer ranks that
write nothing to anyone still learn the decoder's TP and can release their blocks); other ranks
register with the producer ranks that write to them (``writer_ranks``).

The fence. A want that ends early (cancel, failure, time-out) sends ``Cancel`` to every producer
rank that may still write, re-sends it with back-off (``cancel_retry_s``, doubling up to 8x),
and keeps the blocks until each such rank is *quiet*: it answered (``CancelAck`` or
``TransferFailed``) and the ``chunks_done`` notices it announced have arrived (a local DONE on
the producer does not prove remote delivery), or it delivered every chunk, or it is dead. Dead
means proven: its side-channel lifeline closed, it said goodbye, or -- after ``fence_timeout_s``
without an answer -- this decoder gave up on it: it closes the lifeline itself (so a live
producer drops us and posts nothing more) and drops the producer another ``fence_timeout_s``
later, once WRITEs posted before the producer noticed can no longer land. Heartbeat silence
alone fails the transfers that wait for that producer but keeps their blocks fenced
(``on_peer_silent``).

The bound rests on timing assumptions (checked by ``tests/test_protocol_model.py``): a
notification arrives, a stalled producer resumes and a posted WRITE lands (or fails) well within
``fence_timeout_s``; a producer stalled longer than that may write into blocks already freed.

Handshakes run on a small thread pool (or the ``executor`` given) with a time-out, so a producer
that hangs delays only the requests that need it; their results come back through
``RoleContext.submit``.

Staged transfers (``staged.py``): with a ``StagedReceiver`` the Hello announces the staging
region, a registration carries a slot when one fits, staged notices are unpacked as they arrive
(counted in ``seen`` like region notices, so ``chunks_done`` covers them), and a writer rank
that sent staged notices has *arrived* only once all its chunks are unpacked. The slot is held
exactly as long as the want's blocks are: it is released in ``_finish``, and a fenced want
finishes only once no unpack of it still runs (chunks that arrive while fenced are counted, not
unpacked).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from . import timing
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
    wire_id,
)
from .metrics import LogLimiter, log_key
from .nixl_compat import check_peer_nixl
from .side_channel import HandshakeError, HandshakeRefused, handshake
from .transfer_thread import Peer, RoleContext

logger = logging.getLogger(__name__)

Address = tuple[str, int]

#: key prefix of internal release-only notices (a cancel that came before the handshake ended)
RELEASE_NOTICE = "\x00release:"

#: the longest wait between two copies of an unanswered Cancel, in units of cancel_retry_s
MAX_BACKOFF = 8


@dataclass(frozen=True)
class Outcome:
    key: str
    kind: str  # "received" | "failed" | "released"
    reason: str = ""
    attempt: int = 0  # the attempt it is the outcome of (see ``expect``)


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
class _Told:
    """One producer rank a want's registration went to, and what it owes."""

    agent: str
    writes: bool  # it writes into these blocks
    seen: set[int] = field(default_factory=set)  # WriteDone chunk numbers
    chunks: int = 0  # chunks of its WRITE, from its notices (0: none seen yet)
    due: int | None = None  # it answered: this many chunks completed (notices due)
    dead: bool = False
    staged: bool = False  # its notices are staged: its chunks land in the slot, then unpack
    unpacked: bool = False  # staged: every chunk arrived and none is still unpacking

    @property
    def arrived(self) -> bool:
        return (self.writes and self.chunks > 0 and len(self.seen) >= self.chunks
                and (not self.staged or self.unpacked))

    @property
    def quiet(self) -> bool:
        """Nothing of it can land in the blocks any more."""
        return (not self.writes or self.dead or self.arrived
                or (self.due is not None and len(self.seen) >= self.due))


@dataclass
class _Want:
    key: str  # the engine's key
    reg_id: str  # on the wire
    transfer_id: str
    prompt_digest: str
    attempt: int
    address: Address
    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    deadline: float
    started: float
    state: str = "connecting"  # connecting | registered | fencing | done
    told: dict[int, _Told] = field(default_factory=dict)  # producer rank -> what it owes
    outcome: str = ""
    reason: str = ""
    emits: bool = True  # False: no outcome goes to the engine (release notice, superseded)
    superseded: bool = False
    fence_deadline: float = 0.0
    next_cancel: float = 0.0
    backoff: float = 0.0


class Decoder:
    handles = (WriteDone, CancelAck, TransferFailed)

    def __init__(self, ctx: RoleContext, *, max_handshakes: int = 8,
                 handshake_fn: Callable[..., Welcome] = handshake,
                 executor: Executor | None = None, staged=None, early_verdicts: bool = False):
        """``handshake_fn`` has the signature of ``side_channel.handshake``; it runs on
        ``executor`` (default: a pool of ``max_handshakes`` threads, shut down by ``close``).
        ``staged``: a ``staged.StagedReceiver`` when this worker has a staging pool.
        ``early_verdicts``: put early failures into ``verdicts`` (whoever sets it drains it)."""
        self.early_verdicts = early_verdicts
        self.ctx = ctx
        self.staged = staged
        self.outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        #: early ``failed`` verdicts of wants whose blocks stay fenced (module docstring)
        self.verdicts: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        #: set whenever an outcome or a verdict is put (``await_news``)
        self.news = threading.Event()
        self.remotes: dict[Address, _Remote] = {}
        self.wants: dict[str, _Want] = {}  # engine key -> its current want
        self.by_reg: dict[tuple[str, int], _Want] = {}  # (reg_id, attempt) -> every want not done
        self.superseded: dict[str, int] = {}  # engine key -> older attempts still fencing
        # outcomes (with their attempt) waiting for older attempts' fences
        self.parked: dict[str, tuple[int, Outcome]] = {}
        self._pool = executor or ThreadPoolExecutor(max_handshakes,
                                                    thread_name_prefix="kv-push-handshake")
        self._handshake = handshake_fn
        self._hello: Hello | None = None
        self.digest = geometry_digest(ctx.geometry)  # sent with every registration
        # a refused pair fails every request for it: say so once per pair and reason, not
        # once per request
        self._log = LogLimiter(logger)
        # lifelines: one token per handshake, so a lifeline that closes before its welcome is
        # handled, or an old lifeline of a reconnected producer, is told apart
        self._tokens = itertools.count()
        self._handshaking: set[int] = set()
        self._closed_early: set[int] = set()
        self._lifeline: dict[str, int] = {}  # producer agent -> token of its current lifeline
        # producer agent -> close each of its lifelines (one per handshake that reached it:
        # two addresses of one producer make two); giving up on it closes them all
        self._severs: dict[str, list[Callable[[], None]]] = {}
        # lifelines a handshake job opened whose welcome the transfer thread has not handled
        # yet: ``close`` closes them too (a job still running then would otherwise leave its
        # lifeline open until the process ends); ``_sever_lock`` orders the two threads
        self._unhandled: set[Callable[[], None]] = set()
        self._sever_lock = threading.Lock()
        self._closed = False
        # producer agents we gave up on -> when they count as dead (their lifeline is closed,
        # but WRITEs they posted before they noticed may still land until then)
        self._giving_up: dict[str, float] = {}
        # producers whose last handshake with this decoder ended in a refusal -> (its reason,
        # when), until one succeeds: a registration only so such a producer lets go is not
        # sent for heartbeat_interval_s after the refusal
        self._refused: dict[Address, tuple[str, float]] = {}

    def _my_hello(self) -> Hello:
        if self._hello is None:
            self._hello = Hello(engine_id=self.ctx.engine_id, agent_name=self.ctx.agent_name,
                                agent_metadata=self.ctx.metadata(),
                                geometry=self.ctx.geometry, compat_hash=COMPAT_HASH,
                                nixl_version=self.ctx.nixl_version,
                                staging=self.staged.region() if self.staged else None)
        return self._hello

    # -- engine events -------------------------------------------------------------------------
    def expect(self, key: str, transfer_id: str, attempt: int, address: Address,
               block_ids: tuple[int, ...], first_token: int, num_tokens: int, *,
               prompt_digest: str = "") -> None:
        old = self.wants.get(key)
        newest = old.attempt if old is not None else (
            self.parked[key][0] if key in self.parked else -1)
        if attempt <= newest:
            self.ctx.counters.reject("stale", f"expect {key} attempt {attempt}: attempt "
                                     f"{newest} is current", context="expect")
            return
        self.parked.pop(key, None)  # the engine re-allocated before hearing the outcome
        if old is not None:
            # the old blocks stay fenced; the key's outcome is the new attempt's
            del self.wants[key]
            old.emits, old.superseded = False, True
            self.superseded[key] = self.superseded.get(key, 0) + 1
            self._fence(old, "released", f"superseded by attempt {attempt}")
        now = self.ctx.clock()
        want = _Want(key, wire_id(key), transfer_id, prompt_digest, attempt,
                     (address[0], int(address[1])), tuple(block_ids), first_token, num_tokens,
                     now + self.ctx.config.transfer_timeout_s, now)
        self.wants[key] = want
        self.by_reg[(want.reg_id, attempt)] = want
        self._advance(want)

    def cancel(self, key: str, reason: str = "aborted") -> None:
        want = self.wants.get(key)
        if want is None:
            # Its outcome already went out or waits for an older attempt's fence (expect and
            # cancel reach this thread in order), and the engine hears of a request once.
            return
        self.ctx.counters.inc("cancels")
        self._fence(want, "released", reason)

    # -- connection and registration -----------------------------------------------------------
    def _advance(self, want: _Want) -> None:
        if want.state != "connecting":
            return
        refused = self._refused.get(want.address)
        if want.num_tokens <= want.first_token and refused is not None \
                and self.ctx.clock() - refused[1] < self.ctx.config.heartbeat_interval_s:
            # nothing wanted, only that the producer let go -- of a prefill this decoder could
            # not have taken: the producer refused this decoder just now, and another handshake
            # would only be refused (and counted) again, e.g. for the request whose failure
            # that refusal was, which vLLM ends as a request that never asked (the router reads
            # the count). The router's Release or the producer's time-out frees that prefill.
            # (Bounded in time: a producer fixed at the same address gets releases again.)
            self._finish(want, "released", f"the producer refused this decoder: {refused[0]}")
            return
        remote = self.remotes.get(want.address)
        if remote is None:
            remote = self.remotes[want.address] = _Remote(want.address)
        if remote.tp_size is None:
            self._connect(remote, 0, want.address[1])
            return
        g = self.ctx.geometry
        writers = set(writer_ranks(g.num_kv_heads, remote.tp_size, g.tp_size, g.tp_rank))
        needed = set(range(remote.tp_size)) if g.tp_rank == 0 else writers
        missing = needed - set(remote.rank_peers)
        if missing:
            for rank in missing:
                self._connect(remote, rank, remote.ports[rank])
            return
        for rank in sorted(needed):
            agent = remote.rank_peers[rank]
            if agent in self._giving_up:
                # its lifeline is gone: a live producer has dropped us (or will) and would
                # never answer; nothing advertised yet, so fail now instead of at the time-out
                self._fail(want, f"producer rank {rank} is being given up on")
                return
            peer = self.ctx.peer(agent)
            if peer is not None and peer.silent and rank in writers:
                # nothing advertised yet: fail now rather than register blocks with a producer
                # that may be frozen
                self._fail(want, f"producer rank {rank} is unresponsive")
                return
        if want.num_tokens <= want.first_token:
            writers = set()  # nothing to receive: a registration only so the producer lets go
        want.state = "registered"  # from the first registration on, blocks may be written
        slot = self._reserve_slot(want, remote, writers)  # released in ``_finish``
        for rank in sorted(needed):
            peer = remote.rank_peers[rank]
            reg = Register(transfer_id=want.transfer_id, reg_id=want.reg_id,
                           prompt_digest=want.prompt_digest, attempt=want.attempt,
                           engine_id=self.ctx.engine_id, tp_rank=g.tp_rank,
                           block_ids=want.block_ids, first_token=want.first_token,
                           num_tokens=want.num_tokens, geometry_digest=self.digest, slot=slot)
            # told before the send: a notification whose send failed may still have gone out
            # (the agent raised after queueing it), so that rank is fenced (cancelled and
            # answered) like the others before the blocks may be freed
            want.told[rank] = _Told(peer, writes=rank in writers)
            if not self.ctx.send(peer, reg):
                self._fail(want, f"could not notify producer rank {rank}")  # fences those told
                return
            self.ctx.counters.inc("registrations_sent")
            if timing.ENABLED:
                timing.stamp("d_register_sent", want.transfer_id, key=want.key, rank=rank)
        self._check(want)

    def _reserve_slot(self, want: _Want, remote: _Remote, writers: set[int]):
        """A staging slot for ``want`` (its writers all connected), or None: the region path."""
        if self.staged is None or not writers:
            return None
        agents = [remote.rank_peers[r] for r in sorted(writers)]
        peer = self.ctx.peer(agents[0])
        if peer is None:
            return None
        return self.staged.reserve(self._wid(want), agents, peer.geometry, want.block_ids,
                                   want.first_token, want.num_tokens)

    @staticmethod
    def _wid(want: _Want) -> tuple[str, int]:
        return (want.reg_id, want.attempt)  # what ``by_reg`` knows it by

    def _connect(self, remote: _Remote, rank: int, port: int) -> None:
        if rank in remote.connecting:
            return
        remote.connecting.add(rank)
        hello = self._my_hello()
        host = remote.address[0]
        timeout = self.ctx.config.handshake_timeout_s
        codec = self.ctx.codec
        token = next(self._tokens)
        self._handshaking.add(token)

        def on_closed(welcome: Welcome) -> None:  # on the lifeline's thread
            self.ctx.submit(lambda: self._on_lifeline_closed(token, welcome.agent_name))

        def on_unproven(welcome: Welcome, why: str) -> None:  # on the lifeline's thread
            self.ctx.submit(lambda: self._on_lifeline_broken(token, welcome.agent_name, why))

        severs: list[Callable[[], None]] = []

        def on_open(sever: Callable[[], None]) -> None:  # on the job's thread
            severs.append(sever)
            with self._sever_lock:
                if not self._closed:
                    self._unhandled.add(sever)
                    return
            with contextlib.suppress(OSError):
                sever()  # the decoder closed while this handshake ran

        def job() -> None:
            try:
                welcome = self._handshake(host, port, hello, codec, timeout,
                                          on_closed=on_closed, on_open=on_open,
                                          on_unproven=on_unproven)
            except (HandshakeError, OSError) as e:
                reason = str(e)  # ``e`` is unbound once the except block ends
                refused = e.reason if isinstance(e, HandshakeRefused) else None
                rejected = e.rejected if isinstance(e, HandshakeRefused) else None
                self.ctx.submit(lambda: self._on_handshake_failed(remote, rank, reason, token,
                                                                  refused, rejected))
                return
            except Exception as e:  # noqa: BLE001 -- never left "connecting" for good
                # what the handshake did not expect: a host name IDNA refuses (an empty or
                # 64-character label), a port out of range in the producer's Welcome, a bug.
                # Uncaught here it stayed in the pool's future: no log, and the address was
                # never dialled again (every request to it waited transfer_timeout_s)
                logger.warning("kv_push: handshake with %s:%d (producer rank %d) raised",
                               host, port, rank, exc_info=True)
                for sever in severs:
                    self._handled(sever)
                    sever()
                reason = f"{type(e).__name__}: {e}"
                self.ctx.submit(lambda: self._on_handshake_failed(remote, rank, reason, token))
                return
            sever = severs[0] if severs else None
            self.ctx.submit(lambda: self._on_welcome(remote, rank, welcome, token, sever))

        self._pool.submit(job)

    def _on_lifeline_closed(self, token: int, agent: str) -> None:
        """The producer's side channel closed: it is gone (or we closed it, giving up)."""
        if token in self._handshaking:
            self._closed_early.add(token)  # before its welcome was handled: refused there
        elif self._lifeline.get(agent) == token:
            self.ctx.peer_lost(agent, "producer closed its side channel")

    def _on_lifeline_broken(self, token: int, agent: str, why: str) -> None:
        """The lifeline broke without proof that the producer is gone: its host stopped
        answering (``side_channel.UNPROVEN_ERRNOS``). It may be alive with WRITEs in flight over
        another path, so it is not dropped now but given up on, as after an unanswered cancel
        (``_give_up``): dropped -- and the blocks it was told about freed -- only
        ``fence_timeout_s`` later. A live producer drops us once its own end of the lifeline
        breaks, and posts nothing more; an answer that comes meanwhile still ends a fence."""
        if token in self._handshaking:
            self._closed_early.add(token)
            return
        if self._lifeline.get(agent) != token:
            return
        del self._lifeline[agent]
        self.ctx.counters.inc("lifelines_broken")
        logger.error("kv_push: the side channel to producer %s broke (%s): no proof it is gone;"
                     " dropping it in %.0fs, once WRITEs it may have posted can no longer land",
                     agent, why, self.ctx.config.fence_timeout_s)
        self._giving_up.setdefault(agent, self.ctx.clock() + self.ctx.config.fence_timeout_s)

    def _handled(self, sever: Callable[[], None] | None) -> None:
        """A lifeline's handshake was handled: it is kept (``_severs``) or closed now."""
        if sever is not None:
            with self._sever_lock:
                self._unhandled.discard(sever)

    def _on_welcome(self, remote: _Remote, rank: int, welcome: Welcome, token: int,
                    sever: Callable[[], None] | None) -> None:
        self._handled(sever)
        self._handshaking.discard(token)
        remote.connecting.discard(rank)
        try:
            if token in self._closed_early:
                self._closed_early.discard(token)
                raise MessageRejected("lifeline_closed", f"producer {welcome.engine_id} closed "
                                      "its side channel right after the handshake")
            # (an incompatibility's text names no engine id: it becomes the handshake_refusals
            # label, and vLLM makes a new engine id at every start -- a new series each time)
            if welcome.compat_hash != COMPAT_HASH:
                raise MessageRejected("incompatible", f"the producer speaks "
                                      f"{welcome.compat_hash}, we speak {COMPAT_HASH}")
            if (why := check_peer_nixl(self.ctx.nixl_version, welcome.nixl_version)) is not None:
                raise MessageRejected("incompatible", f"the producer: {why}")
            try:
                welcome.geometry.compatible_with(self.ctx.geometry,
                                                 sides=("on the producer", "on the decoder"))
            except GeometryError as e:
                raise MessageRejected("bad_layout", f"the producer: {e}") from None
            if welcome.geometry.tp_rank != rank:
                raise MessageRejected("invalid", f"port for rank {rank} answered as rank "
                                      f"{welcome.geometry.tp_rank}")
            if remote.engine_id not in (None, welcome.engine_id):
                raise MessageRejected("conflict", f"{remote.address} was {remote.engine_id}, "
                                      f"now {welcome.engine_id}")
            peer = self.ctx.add_peer(welcome.agent_metadata, engine_id=welcome.engine_id,
                                     tp_rank=rank, geometry=welcome.geometry,
                                     digest=geometry_digest(welcome.geometry),
                                     address=remote.address, agent_name=welcome.agent_name)
        except MessageRejected as e:
            if sever is not None:
                sever()  # we will not use it: do not keep the connection open
            self.ctx.counters.reject(e.reason, f"{e.detail} (producer engine {welcome.engine_id})",
                                     context=f"handshake {remote.address}")
            refused = str(e) if e.reason in ("incompatible", "bad_layout") else None
            self._on_handshake_failed(remote, rank, str(e), refused=refused)
            return
        self.ctx.counters.inc("handshakes")
        if self.staged is not None:
            self.staged.note_producer(peer.agent_name, welcome.staging)
        self._lifeline[peer.agent_name] = token
        if sever is not None:
            self._severs.setdefault(peer.agent_name, []).append(sever)
        remote.engine_id = welcome.engine_id
        remote.rank_peers[rank] = peer.agent_name
        self._refused.pop(remote.address, None)
        if rank == 0:
            remote.tp_size = welcome.geometry.tp_size
            ports = tuple(welcome.side_channel_ports) or (remote.address[1],)
            if len(ports) != remote.tp_size:
                ports = tuple(remote.address[1] + r for r in range(remote.tp_size))
            remote.ports = ports
        for want in list(self.by_reg.values()):
            if want.address == remote.address:
                self._advance(want)

    def _on_handshake_failed(self, remote: _Remote, rank: int, reason: str,
                             token: int | None = None, refused: str | None = None,
                             rejected: str | None = None) -> None:
        """``refused``: the incompatibility, when one side refused the other (counted in
        ``handshake_refusals`` labelled with the producer's address, which the router reads).
        ``rejected``: the label when the side channel refused the producer's frame here (a
        secret on one side only, another protocol), counted in ``rejected`` as a refusal
        decided in ``_on_welcome`` is."""
        if rejected is not None:
            self.ctx.counters.reject(rejected, reason, context=f"handshake {remote.address}")
        if token is not None:
            self._handshaking.discard(token)
            self._closed_early.discard(token)
        remote.connecting.discard(rank)
        self.ctx.counters.inc("handshake_failures")
        host, port = remote.address
        rank_port = remote.ports[rank] if rank < len(remote.ports) else port
        if refused is not None:
            self._refused[remote.address] = (refused, self.ctx.clock())
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
        for want in list(self.by_reg.values()):
            if want.address == remote.address and want.state == "connecting":
                self._fail(want, f"handshake with producer rank {rank} failed: {reason}")

    # -- messages ------------------------------------------------------------------------------
    def _want_for(self, peer: Peer, msg) -> tuple[_Want, _Told] | None:
        want = self.by_reg.get((msg.reg_id, msg.attempt))
        if want is None or want.transfer_id != msg.transfer_id:
            self.ctx.counters.inc("stale", label=type(msg).__name__)
            return None
        told = want.told.get(msg.tp_rank)
        if told is None or told.agent != peer.agent_name or msg.engine_id != peer.engine_id:
            raise MessageRejected("spoofed", f"{type(msg).__name__} for {msg.transfer_id} from "
                                  f"{peer.engine_id} rank {peer.tp_rank}, not a producer we told")
        return want, told

    def on_message(self, peer: Peer, msg) -> None:
        found = self._want_for(peer, msg)
        if found is None:
            return
        want, told = found
        if isinstance(msg, WriteDone):
            if not told.writes:
                raise MessageRejected("unexpected", f"WriteDone from non-writer rank {msg.tp_rank}")
            # its WRITE landed, whatever we make of it: the fence counts it (``chunks_done``)
            first = not told.seen
            told.seen.add(msg.chunk)
            told.chunks = msg.chunks
            if msg.staged or told.staged:
                self._on_staged_chunk(want, told, msg, first)
                return
        else:  # CancelAck or TransferFailed: it writes nothing more; chunks_done may be on the way
            told.due = max(told.due or 0, msg.chunks_done)
            if want.state == "registered" and told.writes and not told.arrived:
                why = msg.reason if isinstance(msg, TransferFailed) else "cancelled"
                self._fail(want, f"producer rank {msg.tp_rank}: {why}",
                           abandoned=msg.abandoned if isinstance(msg, TransferFailed) else "")
        self._check(want)

    def _on_staged_chunk(self, want: _Want, told: _Told, msg: WriteDone, first: bool) -> None:
        """A staged notice (or a plain one from a rank that sent staged ones): unpack it."""
        try:
            if self.staged is None:
                raise MessageRejected("unexpected", "staged notice, but this decoder has no "
                                      "staging pool")
            if not msg.staged or not (first or told.staged):
                raise MessageRejected("invalid", f"producer rank {msg.tp_rank} mixes staged and "
                                      "region notices")
            told.staged = True
            self.staged.on_chunk(self._wid(want), msg.tp_rank, msg,
                                 unpack=want.state == "registered")
        except MessageRejected as e:
            self._fail(want, f"producer rank {msg.tp_rank}: {e}")  # only while registered
            self._check(want)
            raise
        self._staged_progress()
        self._check(want)

    def _staged_progress(self) -> None:
        """Writer ranks whose staged chunks are all unpacked have arrived; fenced wants whose
        last unpack ended may finish."""
        for wid, ranks in self.staged.poll():
            want = self.by_reg.get(wid)
            if want is None:
                continue
            for rank in ranks:
                told = want.told.get(rank)
                if told is not None:
                    told.unpacked = True
            self._check(want)

    def _unpacking(self, want: _Want) -> bool:
        return self.staged is not None and self.staged.unpacking(self._wid(want))

    # -- state changes -------------------------------------------------------------------------
    def _fail(self, want: _Want, reason: str, abandoned: str = "") -> None:
        """``abandoned`` (``TransferFailed.abandoned``): the producer's request ended first
        (counted and logged as such, at INFO); the request still fails here."""
        if want.state in ("fencing", "done"):
            return
        if abandoned:
            self.ctx.counters.inc("transfers_abandoned", label=abandoned)
            logger.info("kv_push: transfer %s (%s) not made: %s", want.transfer_id, want.key,
                        reason)
        else:
            self.ctx.counters.inc("transfers_failed")
            self._log.warn(f"fail {log_key(reason)}", "kv_push: transfer %s (%s) failed: %s",
                           want.transfer_id, want.key, reason)
        self._fence(want, "failed", reason)

    def _fence(self, want: _Want, outcome: str, reason: str) -> None:
        """No producer may write into ``want``'s blocks any more; emit ``outcome`` once safe."""
        if want.state == "done":
            return
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
            if want.emits and outcome == "released":
                notice = _Want(RELEASE_NOTICE + want.key, want.reg_id, want.transfer_id,
                               want.prompt_digest, want.attempt, want.address, (),
                               want.first_token, want.first_token, want.deadline, want.started,
                               emits=False)
                self.by_reg[(notice.reg_id, notice.attempt)] = notice
                self._advance(notice)
            return
        want.state = "fencing"
        now = self.ctx.clock()
        want.fence_deadline = now + self.ctx.config.fence_timeout_s
        want.backoff = self.ctx.config.cancel_retry_s
        want.next_cancel = now + want.backoff
        self._send_cancels(want)
        self._check(want)
        if outcome == "failed" and want.state == "fencing" and want.emits and self.early_verdicts:
            self._emit(self.verdicts, Outcome(want.key, "failed", reason, want.attempt))

    def _send_cancels(self, want: _Want) -> None:
        for rank, told in sorted(want.told.items()):
            if told.quiet or told.due is not None:
                continue  # nothing can come from it, or it answered and notices are on the way
            if self.ctx.peer(told.agent) is None:
                told.dead = True  # dropped: proven gone
                continue
            self.ctx.send(told.agent, Cancel(
                transfer_id=want.transfer_id, reg_id=want.reg_id,
                prompt_digest=want.prompt_digest, attempt=want.attempt,
                engine_id=self.ctx.engine_id, tp_rank=self.ctx.geometry.tp_rank,
                reason=want.reason))

    def _check(self, want: _Want) -> None:
        if want.state == "registered":
            writers = [t for t in want.told.values() if t.writes]
            if all(t.arrived for t in writers):
                if writers and want.emits:  # a release-only registration transfers nothing
                    if timing.ENABLED:
                        timing.stamp("d_write_done", want.transfer_id, key=want.key)
                    self.ctx.counters.inc("transfers_done")
                    self.ctx.counters.inc("transfer_seconds", self.ctx.clock() - want.started)
                self._finish(want, "received", "")
        elif want.state == "fencing":
            if all(t.quiet for t in want.told.values()) and not self._unpacking(want):
                self._finish(want, want.outcome, want.reason)

    def _finish(self, want: _Want, kind: str, reason: str) -> None:
        """The one way a want ends: acts once, however often it is reached."""
        if want.state == "done":
            return
        want.state = "done"
        if self.by_reg.get((want.reg_id, want.attempt)) is want:
            del self.by_reg[(want.reg_id, want.attempt)]
            if self.staged is not None:
                self.staged.release(self._wid(want))  # its blocks are no longer fenced
        if want.superseded:
            left = self.superseded[want.key] - 1
            if left:
                self.superseded[want.key] = left
            else:
                del self.superseded[want.key]
                if want.key in self.parked and want.key not in self.wants:
                    self._emit(self.outcomes, self.parked.pop(want.key)[1])
            return
        if self.wants.get(want.key) is want:
            del self.wants[want.key]
        if not want.emits:
            return
        out = Outcome(want.key, kind, reason, want.attempt)
        if self.superseded.get(want.key):
            self.parked[want.key] = (want.attempt, out)  # older attempts' blocks may be written
        else:
            self._emit(self.outcomes, out)

    def _emit(self, results: queue.SimpleQueue, out: Outcome) -> None:
        results.put(out)
        self.news.set()

    def await_news(self, timeout: float) -> bool:
        """(engine thread) Wait up to ``timeout`` seconds until an outcome or a verdict has
        been put since the last call; True if one has. Drain the queues after it: what comes
        after the call is seen by the next one."""
        got = self.news.wait(timeout) if timeout > 0 else self.news.is_set()
        self.news.clear()
        return got

    # -- role hooks ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self.staged is not None:
            self._staged_progress()
        for agent, when in list(self._giving_up.items()):
            if now >= when:
                del self._giving_up[agent]
                self.ctx.peer_lost(agent, "given up on (no answer to a cancel in time, or its "
                                   "side channel broke)")
        for want in list(self.by_reg.values()):
            if want.state in ("connecting", "registered"):
                if now > want.deadline:
                    self.ctx.counters.inc("expired")
                    self._fail(want, f"no KV within {self.ctx.config.transfer_timeout_s:.0f}s")
            elif want.state == "fencing":
                if now >= want.fence_deadline:
                    self._give_up(want)
                    want.fence_deadline = float("inf")  # once
                elif now >= want.next_cancel:
                    self.ctx.counters.inc("cancels_resent")
                    self._send_cancels(want)
                    want.backoff = min(2 * want.backoff,
                                       MAX_BACKOFF * self.ctx.config.cancel_retry_s)
                    want.next_cancel = now + want.backoff

    def _give_up(self, want: _Want) -> None:
        """The fence outlived ``fence_timeout_s``: every producer that still owes an answer is
        treated as dead. Its lifeline is closed now -- a live producer then drops us and posts
        nothing more -- but it is dropped (and the blocks it was told about freed) only another
        ``fence_timeout_s`` later: WRITEs it posted before it noticed may land until then. An
        answer that comes meanwhile still ends a fence the usual way."""
        now = self.ctx.clock()
        for told in want.told.values():
            if told.quiet or told.agent in self._giving_up:
                continue
            if self.ctx.peer(told.agent) is None:
                told.dead = True
                continue
            self._giving_up[told.agent] = now + self.ctx.config.fence_timeout_s
            self.ctx.counters.inc("fence_timeouts")
            logger.error("kv_push: producer %s did not answer the cancel of %s (%s) within %.0fs:"
                         " closing its lifeline; dropping it once its WRITEs can no longer land",
                         told.agent, want.key, want.transfer_id, self.ctx.config.fence_timeout_s)
            self._lifeline.pop(told.agent, None)  # its closing is ours, not proof of its death
            self._sever_all(told.agent)
        self._check(want)

    def busy(self) -> bool:
        # Waiting for WriteDone needs NIXL progress on this side, but polling every
        # idle_poll_s gives it: spinning here took a core from the producer's copy on small
        # hosts (benchmarks/results/transfer.md: push* vs push) for at most idle_poll_s less
        # latency. Unpacks running on the device are polled by spinning, though: the request
        # waits for them and no peer needs to make progress for them.
        return self.staged is not None and self.staged.busy()

    def holding(self) -> bool:
        """Wants not done, fences, handshakes under way, staged slots in use: never quiet then
        (``transfer_thread``, ``quiet_poll_s``)."""
        return bool(self.wants or self.by_reg or self.superseded or self.parked
                    or self._handshaking or self._giving_up
                    or any(r.connecting for r in self.remotes.values())
                    or (self.staged is not None and self.staged.live()))

    def awaiting(self) -> bool:
        """A registered want waits for WRITEs: the thread polls every ``await_poll_s`` (not
        ``idle_poll_s``) until they arrive -- NIXL over UCX progresses the WRITE into us and
        delivers its notice only while we poll, and both are on the request's first token."""
        return any(w.state == "registered" for w in self.by_reg.values())

    def on_peer_silent(self, peer: Peer) -> None:
        """A producer stopped heartbeating: fail what waits for its WRITE, but keep the blocks
        fenced -- it may be frozen with a WRITE in flight."""
        for want in list(self.by_reg.values()):
            if want.state != "registered":
                continue
            for rank, told in want.told.items():
                if told.agent == peer.agent_name and told.writes and not told.arrived:
                    self._fail(want, f"producer {peer.engine_id} rank {rank} is unresponsive")
                    break

    def on_peer_dead(self, peer: Peer) -> None:
        name = peer.agent_name
        if self.staged is not None:
            self.staged.forget_producer(name)
        self._lifeline.pop(name, None)
        self._sever_all(name)  # (closed already when its closing told us; else they wait)
        self._giving_up.pop(name, None)
        for remote in list(self.remotes.values()):
            for rank, agent in list(remote.rank_peers.items()):
                if agent == name:
                    del remote.rank_peers[rank]
            if not remote.rank_peers and not remote.connecting:
                self.remotes.pop(remote.address, None)
        for want in list(self.by_reg.values()):
            hit = [t for t in want.told.values() if t.agent == name]
            if not hit:
                continue
            for told in hit:
                told.dead = True
            if want.state == "registered" and any(t.writes and not t.arrived for t in hit):
                self._fail(want, f"producer {peer.engine_id} rank {peer.tp_rank} is dead")
            else:
                self._check(want)

    def close(self) -> None:
        """Stop dialling, and close every lifeline to a producer: each learns at once that
        this decoder is gone (instead of when its process exits)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._sever_lock:  # a job still running closes what it opens from now on
            self._closed = True
            unhandled, self._unhandled = self._unhandled, set()
        for sever in unhandled:
            with contextlib.suppress(OSError):
                sever()
        for agent in list(self._severs):
            self._sever_all(agent)

    def _sever_all(self, agent: str) -> None:
        """Close every lifeline to producer ``agent``: it drops us once none is left open."""
        for sever in self._severs.pop(agent, ()):
            with contextlib.suppress(OSError):
                sever()

    def live(self) -> dict[str, int]:
        out = {"wants": len(self.by_reg), "parked": len(self.parked)}
        if self.staged is not None:
            out["staging_slots"] = self.staged.live()
        return out
