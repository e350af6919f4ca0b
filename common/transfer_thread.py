"""The transfer thread: one background thread per worker that owns the NIXL agent.

Everything that touches the agent runs here; everything else only hands work in. The loop:

1. run the callables waiting in the inbox (``submit`` / ``call`` put them there and set the
   wake event);
2. drain NIXL notifications, open each through ``channel`` (``auth.NotificationChannel``: frame,
   MAC bound to sender and receiver, replay window; a rejection is counted and logged once, never
   raised), note the sender as alive, and route the message to the roles that handle its type;
3. let each role ``tick`` (poll in-flight WRITEs, time-outs) and keep liveness: heartbeats go to
   every peer four times per ``heartbeat_interval_s``; a peer silent for ``peer_timeout_s``
   (1.5 intervals) is marked *unresponsive* and each role's ``on_peer_silent`` is told once
   (until it speaks again). Silence is not proof of death -- a frozen process may still hold a
   WRITE in flight -- so the peer stays in the table (still heartbeated, its messages still
   handled). A peer is dropped (removed from the agent, each role's ``on_peer_dead`` told) only
   on proof: its lifeline closed (``peer_lost``), it said goodbye, or a role gave up on it
   (``peer_lost`` too, after the role closed the lifeline itself);
   over a transport whose first call to a peer waits for that peer's own handshake
   (``first_call_waits_for_peer``: NIXL LIBFABRIC from 1.4.0, up to 60 s), heartbeats and
   goodbyes go only to peers heard from, so that wait never lands on this thread for a peer that
   is gone or never loaded us;
4. sleep: spin (yield the GIL briefly) while a role has work in flight -- NIXL over UCX only
   progresses when called, on both sides -- else wait on the wake event up to ``await_poll_s``
   while a role awaits a peer's WRITE (a decoder's registered want: the WRITE into it and its
   notice progress only while it polls; a sleep, not a spin), else up to ``idle_poll_s`` while
   a role holds work a peer's message would move on at once (``expecting``: a producer's
   prefill that a registration may still come for), else up to ``prefill_wait_poll_s`` while
   what is held waits only for a hand-off (``holding``: a registration waiting for its
   prefill, whose hand-off wakes the thread; so a producer does not poll NIXL through its
   engine's prefill on the cores that run it), else up to ``idle_poll_s`` for
   ``quiet_after_s`` after anything but a heartbeat came or was handed in, else (quiet) up to
   ``quiet_poll_s``; never past the next heartbeat. Whatever the engine or the side
   channel hands in sets the wake event, so a new request is never slowed by the back-off: a
   producer learns of its prefill by a hand-off, which wakes it, and reads the registration
   that came meanwhile in the same step. A peer's message to a quiet worker is noticed up to
   ``quiet_poll_s`` later; the ones a peer then waits for are refusals and answers that a
   producer gives from memory after it let go of the request (a registration for a transfer
   it tombstoned or that the router released: ``TransferFailed``; a cancel it already
   answered: ``CancelAck``), and a decoder's ``Cancel`` of a registration whose prefill is
   still running (answered up to ``prefill_wait_poll_s`` later: the decoder's blocks stay
   fenced that much longer) -- failure and preemption paths, not a served request's.

``close()`` stops the loop, lets the WRITEs in flight finish (at most half the close time-out;
their completions are sent as usual), says goodbye to every peer it is no longer writing to, closes
the roles and the transport, and joins the thread. A peer still being written when the drain ends
gets no goodbye: a goodbye is proof of death to it (it frees the blocks at once), while the WRITE
may still land; it learns of the end from the lifeline instead, which closes with this process,
after the transport's teardown. Exceptions from a role's handler are logged with context and counted; they do
not kill the thread (the engine would hang without it), but they do fail the work concerned,
which the role handles.

Roles see the thread only through ``RoleContext``: sending a message, the peer table, the WRITE
operations of the transport, the codec, the geometry, config, counters and clock, and ``submit``.
The thread provides it. Nothing in a role needs the thread to run: an unstarted thread over a
fake transport and a fake clock, advanced with ``step()``, drives roles in-process (the tests do).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .auth import NotificationChannel
from .config import PushConfig
from .geometry import KVGeometry
from .messages import Codec, Goodbye, Heartbeat, Message, MessageRejected
from .metrics import Counters
from .transport import Transport

logger = logging.getLogger(__name__)


@dataclass
class Peer:
    agent_name: str
    engine_id: str
    tp_rank: int
    geometry: KVGeometry
    geometry_digest: str
    last_heard: float
    address: tuple[str, int] | None = None  # a producer's side channel, as the decoder dialled it
    heard: bool = False  # a notification from it has arrived since it was added
    #: (producer) the nonces of the handshakes whose lifelines from this peer are open
    #: (``lifeline_held``); a lifeline closing drops the peer only once none is left
    #: (``peer_lost``): a decoder that gave up on a slow handshake and made another is alive
    #: on the newer one. Kept across ``add_peer`` (a kv_both worker's decoder role adds the
    #: same agent without one)
    lifelines: set = field(default_factory=set)
    #: (producer) the nonce of the handshake whose ``accept_hello`` created this entry (empty:
    #: another role made it): a Welcome that never went out drops only an entry it made
    made_by: bytes = b""
    silent: bool = False  # no message for peer_timeout_s (roles were told); cleared when it speaks


class Role(Protocol):
    """What the thread asks of a role (producer, decoder). Every method runs on the thread."""

    #: the message types ``on_message`` receives
    handles: tuple[type, ...]

    def on_message(self, peer: Peer, msg: Message) -> None:
        """A message of a type in ``handles`` from a known peer. ``MessageRejected`` raised here
        is counted as a rejection; any other exception is logged and counted."""

    def tick(self, now: float) -> None:
        """Once per loop step: poll work in flight, apply time-outs (``now`` is the clock)."""

    def busy(self) -> bool:
        """True while work is in flight that needs the thread to spin rather than sleep."""

    def on_peer_dead(self, peer: Peer) -> None:
        """``peer`` is gone (goodbye, lifeline closed); it is no longer in the table."""

    def on_peer_silent(self, peer: Peer) -> None:
        """``peer`` has been silent for ``peer_timeout_s``: unresponsive, not proven dead. It is
        still in the table and may speak again (then ``peer.silent`` is cleared)."""

    def close(self) -> None:
        """The thread is stopping: release what the role holds in the transport."""

    def writing_to(self, agent_name: str) -> bool:
        """True while a WRITE of this role into ``agent_name``'s memory may be in flight (the
        thread then sends that peer no goodbye at close). Optional: absent means never."""

    def awaiting(self) -> bool:
        """True while the role waits for a peer's WRITE into this worker (the thread then polls
        every ``await_poll_s`` instead of ``idle_poll_s``). Optional: absent means never."""

    def holding(self) -> bool:
        """True while the role holds anything a peer's message may be awaited for (a prefill,
        a registration, a want, a handshake, a WRITE): the thread then does not go quiet
        (``quiet_poll_s``); where nothing of it is ``expecting`` it polls every
        ``prefill_wait_poll_s``. Optional: absent means always."""

    def expecting(self) -> bool:
        """True while the role holds work that a peer's message would move on at once (a
        producer's prefill that a registration may still come for): the thread then polls every
        ``idle_poll_s``. What the role holds beyond that waits for a hand-off, which wakes the
        thread (a registration waiting for its prefill), so the thread backs off meanwhile
        (``prefill_wait_poll_s``). Optional: absent means ``holding``."""


class RoleContext(Protocol):
    """What a role may use of the transfer thread that runs it. ``TransferThread`` provides it.

    Unless said otherwise, call it only on the transfer thread (or, for a thread that was never
    started, on the one thread that steps it).
    """

    engine_id: str
    tp_rank: int
    #: this worker's KV geometry
    geometry: KVGeometry
    config: PushConfig
    counters: Counters
    #: the message codec (with the configured secret); thread-safe, so handshake threads use it
    #: for side-channel frames too
    codec: Codec
    #: ``clock() -> float``: monotonic seconds (injected in tests)
    clock: Callable[[], float]

    @property
    def agent_name(self) -> str:
        """This worker's transport agent name (what peers know it by)."""

    def metadata(self) -> bytes:
        """This worker's transport metadata, for a peer's ``add_peer``."""

    @property
    def nixl_version(self) -> str:
        """The NIXL release under the transport ("" when it is not NIXL); peers compare it at
        the handshake (``nixl_compat.check_peer_nixl``)."""

    # -- messages and peers --
    def send(self, peer: str, msg: Message) -> bool:
        """Encode ``msg`` and send it to agent ``peer``. Returns False if it could not be posted."""

    def seal(self, peer: str, msg: Message) -> bytes:
        """``msg`` framed for ``peer`` (numbered and, with a secret, MAC'd for that receiver):
        the notification that rides a WRITE. Call it when the WRITE is posted, not earlier, so
        sequence numbers follow posting order (the receiver's replay window)."""

    def add_peer(self, metadata: bytes, *, engine_id: str, tp_rank: int, geometry: KVGeometry,
                 digest: str, address: tuple[str, int] | None = None,
                 agent_name: str | None = None, made_by: bytes = b"") -> Peer:
        """Load a peer's transport metadata (once) and track it. Raises ``MessageRejected``
        ("layout_changed") if the agent is known with another geometry, ("name_mismatch") if
        ``agent_name`` (the name the peer gave in its handshake) is not the name the metadata
        carries, ``TransportError`` if the metadata cannot be loaded."""

    def peer(self, agent_name: str) -> Peer | None:
        """The live peer of that agent name, or None (never known, or dropped)."""

    def peer_lost(self, agent_name: str, reason: str, lifeline: bytes | None = None,
                  held: bool = True) -> None:
        """(any thread) The peer is gone (its lifeline closed): drop it soon, on the thread; every
        role's ``on_peer_dead`` is called. ``lifeline``: the handshake whose lifeline closed;
        dropped only once none of its lifelines is open (``held`` False: a Welcome that never
        went out, which drops only an entry that handshake made)."""

    # -- transfers --
    def write(self, peer: str, src: np.ndarray, dst: np.ndarray, src_mem: str, dst_mem: str,
              notif: bytes) -> Any:
        """Post a WRITE of ``src`` descriptors into ``peer``'s ``dst`` descriptors that delivers
        ``notif`` to ``peer`` when done. Returns a handle; a WRITE that cannot be posted is a
        handle that polls "ERR" (it never raises by contract)."""

    def poll(self, handle: Any) -> str:
        """"PROC", "DONE" or "ERR"."""

    def release(self, handle: Any) -> None:
        """Free a handle that is no longer in flight ("DONE" or "ERR")."""

    def failure_reason(self, handle: Any) -> str:
        """Why a handle polled "ERR", in words."""

    # -- work --
    def submit(self, fn: Callable[[], Any]) -> None:
        """(any thread) Run ``fn`` on the transfer thread, soon. Never blocks."""


def _never() -> bool:
    return False


def _always() -> bool:
    return True


class TransferThread:
    def __init__(
        self,
        transport: Transport,
        *,
        engine_id: str,
        tp_rank: int,
        geometry: KVGeometry,
        config: PushConfig,
        counters: Counters | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "kv-push-transfer",
    ):
        self.transport = transport
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.geometry = geometry
        self.config = config
        self.codec = Codec(config.secret or None)
        # numbers, MACs and replay-checks every notification (auth.py)
        self.channel = NotificationChannel(self.codec, transport.agent_name)
        self.counters = counters or Counters()
        self.clock = clock
        self.peers: dict[str, Peer] = {}
        self.roles: list[Role] = []
        self._inbox: queue.SimpleQueue[tuple[float, Callable[[], Any], Future | None]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._hb_seq = 0
        self._next_hb = 0.0
        self._stirred = clock()  # the last time work or a message came, or a role was busy,
        # awaiting or expecting (_sleep_s)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._drain_s = 0.0  # close(): how long WRITEs in flight may take to finish
        #: peers closed on with a WRITE to them still in flight (no goodbye): their lifelines
        #: must end with the process, not with this worker (``PushWorker.close``)
        self.withheld: set[str] = set()
        #: unsolicited messages (heartbeat, goodbye) wait until the peer has spoken
        self._hold_until_heard = bool(transport.first_call_waits_for_peer)

    # -- engine-facing: hand work in ---------------------------------------------------------
    def add_role(self, role: Role) -> None:
        self.roles.append(role)

    def start(self) -> None:
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the transfer thread, soon. Never blocks."""
        self._inbox.put((time.monotonic(), fn, None))
        self._wake.set()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn`` on the transfer thread and wait for its result (not for the engine loop)."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._closed or (self._thread.ident is not None and not self._thread.is_alive()):
            # nothing would ever run it: fail now rather than after ``timeout``
            raise RuntimeError("kv_push transfer thread closed")
        fut: Future = Future()
        self._inbox.put((time.monotonic(), fn, fut))
        self._wake.set()
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout:
            if fut.cancel():  # not started: it never runs (a late accept_hello would add a
                raise         # peer nobody was told of, with no lifeline to ever drop it)
            return fut.result()  # running now: its effect happens anyway, so its result

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._drain_s = timeout / 2
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("kv_push: transfer thread did not stop within %.1fs", timeout)
        else:
            self._shutdown()

    # -- RoleContext: what roles use (on this thread unless said otherwise) --------------------
    @property
    def agent_name(self) -> str:
        return self.transport.agent_name

    def metadata(self) -> bytes:
        return self.transport.metadata()

    @property
    def nixl_version(self) -> str:
        return self.transport.nixl_version

    def send(self, peer: str, msg: Message) -> bool:
        return self.transport.send_notif(peer, self.channel.seal(peer, msg))

    def seal(self, peer: str, msg: Message) -> bytes:
        """``msg`` framed for ``peer`` (a notification that rides a WRITE)."""
        return self.channel.seal(peer, msg)

    def peer(self, agent_name: str) -> Peer | None:
        return self.peers.get(agent_name)

    def write(self, peer: str, src: np.ndarray, dst: np.ndarray, src_mem: str, dst_mem: str,
              notif: bytes) -> Any:
        return self.transport.write(peer, src, dst, src_mem, dst_mem, notif)

    def poll(self, handle: Any) -> str:
        return self.transport.poll(handle)

    def release(self, handle: Any) -> None:
        self.transport.release(handle)

    def failure_reason(self, handle: Any) -> str:
        return self.transport.failure_reason(handle)

    def add_peer(self, metadata: bytes, *, engine_id: str, tp_rank: int, geometry: KVGeometry,
                 digest: str, address: tuple[str, int] | None = None,
                 agent_name: str | None = None, made_by: bytes = b"") -> Peer:
        """Load a peer's agent metadata (once) and start tracking its liveness.

        ``agent_name``: the name the peer gave in its handshake; it must be the name NIXL reports
        for the metadata (its lifeline is known by that name: a peer must not name another)."""
        name = self.transport.add_peer(metadata)
        if agent_name is not None and name != agent_name:
            if name not in self.peers:
                self.transport.remove_peer(name)
            raise MessageRejected("name_mismatch", f"handshake names agent {agent_name!r} but "
                                  f"its NIXL metadata is agent {name!r}")
        old = self.peers.get(name)
        if old is not None and old.geometry_digest != digest:
            raise MessageRejected("layout_changed", f"peer {name} changed its KV geometry")
        peer = Peer(name, engine_id, tp_rank, geometry, digest, self.clock(), address,
                    heard=old is not None and old.heard,
                    lifelines=set(old.lifelines) if old is not None else set(),
                    made_by=old.made_by if old is not None else made_by)
        self.peers[name] = peer
        return peer

    def lifeline_held(self, agent_name: str, lifeline: bytes) -> None:
        """(any thread) The producer's side channel holds a lifeline from ``agent_name`` (the
        handshake ``lifeline``, its Hello's nonce), after its Welcome went out."""
        def note() -> None:
            if (peer := self.peers.get(agent_name)) is not None:
                peer.lifelines.add(lifeline)
        if not self._closed:
            self.submit(note)

    def peer_lost(self, agent_name: str, reason: str, lifeline: bytes | None = None,
                  held: bool = True) -> None:
        """(any thread) A peer's lifeline closed: drop it on the transfer thread, now.
        ``lifeline`` (the producer's side: the nonce of the handshake whose lifeline closed, or
        whose Welcome could not be sent): dropped only once no lifeline of it is left open -- a
        decoder that gave up on a slow handshake and made another is alive on the newer one,
        and a decoder gives up on a producer by closing all of its own."""
        def drop() -> None:
            peer = self.peers.get(agent_name)
            if peer is not None and lifeline is not None:
                peer.lifelines.discard(lifeline)
                if not held and peer.made_by != lifeline:
                    return  # another handshake or role made it: not this one's to drop
                if peer.lifelines:
                    logger.info("kv_push: a lifeline of %s closed; it is kept on another one "
                                "(a newer handshake)", agent_name)
                    return
            if peer is not None:
                self.counters.inc("peers_dead")
                self.drop_peer(peer, reason)
        if not self._closed:
            self.submit(drop)

    def drop_peer(self, peer: Peer, reason: str) -> None:
        if self.peers.pop(peer.agent_name, None) is None:
            return
        logger.warning("kv_push: dropping peer %s (engine %s rank %d): %s",
                       peer.agent_name, peer.engine_id, peer.tp_rank, reason)
        for role in self.roles:
            self._guard(role.on_peer_dead, peer, context=f"peer {peer.agent_name} dead")
        self.transport.remove_peer(peer.agent_name)

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.step()
                    busy = any(role.busy() for role in self.roles)
                except Exception:  # e.g. NIXL failing to poll: keep the thread, back off
                    logger.exception("kv_push: transfer thread step failed")
                    self.counters.inc("rejected", label="internal_error")
                    busy = False
                if busy:
                    self._stirred = self.clock()
                    time.sleep(0)  # in flight: keep NIXL progressing, but let others run
                    continue
                self._wake.wait(self._sleep_s())
                self._wake.clear()
        finally:
            self._shutdown()

    def step(self) -> None:
        """One pass of the loop: run queued work, dispatch notifications, tick the roles, keep
        liveness. The started thread calls it; a thread that was never started may be driven by
        calling it from one thread (in-process tests with a fake transport and clock)."""
        while True:
            try:
                queued_at, fn, fut = self._inbox.get_nowait()
            except queue.Empty:
                break
            self.counters.inc("queue_wait_seconds", time.monotonic() - queued_at)
            self._stirred = self.clock()
            if fut is not None:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # handed back to the caller
                        fut.set_exception(e)
            else:
                self._guard(fn, context="submitted work")
        for sender, data in self.transport.get_notifs():
            self._dispatch(sender, data)
        now = self.clock()
        for role in self.roles:
            self._guard(role.tick, now, context="tick")
        self._liveness(now)

    def _dispatch(self, sender: str, data: bytes) -> None:
        try:
            msg = self.channel.open(sender, data)
        except MessageRejected as e:
            self.counters.reject(e.reason, e.detail, context=f"from {sender}")
            return
        peer = self.peers.get(sender)
        if peer is None:
            self.counters.reject("unknown_peer", f"{type(msg).__name__} from agent {sender}",
                                 context=sender)
            return
        peer.last_heard = self.clock()
        peer.heard = True
        if peer.silent:
            peer.silent = False
            logger.warning("kv_push: peer %s (engine %s rank %d) speaks again", peer.agent_name,
                           peer.engine_id, peer.tp_rank)
        if isinstance(msg, Heartbeat):
            return
        self._stirred = self.clock()
        if isinstance(msg, Goodbye):
            self.drop_peer(peer, "said goodbye")
            return
        handled = False
        for role in self.roles:
            if isinstance(msg, role.handles):
                handled = True
                self._guard(role.on_message, peer, msg,
                            context=f"{type(msg).__name__} from {peer.engine_id}")
        if not handled:
            self.counters.reject("unexpected", f"{type(msg).__name__} not handled by this worker",
                                 context=sender)

    def _liveness(self, now: float) -> None:
        if now >= self._next_hb:
            # four beats per interval: a peer is declared dead after 1.5 intervals of silence,
            # so a stall of up to ~1.25 intervals is tolerated and a death is seen within 2
            self._next_hb = now + self.config.heartbeat_interval_s / 4
            self._hb_seq += 1
            hb = Heartbeat(engine_id=self.engine_id, tp_rank=self.tp_rank, seq=self._hb_seq)
            for name, peer in list(self.peers.items()):
                if self._may_call(peer):
                    self.send(name, hb)
        timeout = self.config.peer_timeout_s
        for peer in list(self.peers.values()):
            if not peer.silent and now - peer.last_heard > timeout:
                peer.silent = True
                self.counters.inc("peers_silent")
                logger.warning("kv_push: peer %s (engine %s rank %d) silent for %.2fs: "
                               "unresponsive (not taken for dead until its lifeline closes)",
                               peer.agent_name, peer.engine_id, peer.tp_rank,
                               now - peer.last_heard)
                for role in self.roles:
                    self._guard(role.on_peer_silent, peer, context=f"peer {peer.agent_name} silent")

    def _sleep_s(self) -> float:
        """How long the loop may sleep now (module doc, 4.)."""
        now = self.clock()
        if self._awaiting():
            self._stirred = now
            return self.config.await_poll_s
        if self._expecting():  # never quiet, whatever quiet_after_s is (0 included)
            self._stirred = now
            return self.config.idle_poll_s
        if self._holding():  # only what a hand-off moves on (a registration waiting for
            # its prefill): back off, never past the next heartbeat
            pause = self.config.prefill_wait_poll_s
        elif now - self._stirred < self.config.quiet_after_s:
            return self.config.idle_poll_s
        else:
            pause = self.config.quiet_poll_s
        return max(self.config.idle_poll_s, min(pause, self._next_hb - now))

    def _holding(self) -> bool:
        try:
            return any(getattr(role, "holding", _always)() for role in self.roles)
        except Exception:  # as for awaiting(): never let bookkeeping stop the loop
            logger.exception("kv_push: holding() failed")
            return True

    def _expecting(self) -> bool:
        """A role holds work that a peer's message would move on at once (``Role.expecting``;
        a role without it: whatever it holds)."""
        try:
            return any(getattr(role, "expecting", getattr(role, "holding", _always))()
                       for role in self.roles)
        except Exception:  # as for holding(): never let bookkeeping stop the loop
            logger.exception("kv_push: expecting() failed")
            return True

    def _awaiting(self) -> bool:
        """A role waits for a peer's WRITE (``Role.awaiting``, optional): poll more often."""
        try:
            return any(getattr(role, "awaiting", _never)() for role in self.roles)
        except Exception:  # a role's bookkeeping must not stop the loop: poll as when idle
            logger.exception("kv_push: awaiting() failed")
            return False

    def _may_call(self, peer: Peer) -> bool:
        """May an unsolicited message go to ``peer`` now without waiting on its handshake?"""
        return peer.heard or not self._hold_until_heard

    def _guard(self, fn: Callable, *args: Any, context: str) -> None:
        try:
            fn(*args)
        except MessageRejected as e:
            self.counters.reject(e.reason, e.detail, context=context)
        except Exception:
            logger.exception("kv_push: error in transfer thread (%s)", context)
            self.counters.inc("rejected", label="internal_error")

    def _shutdown(self) -> None:
        deadline = time.monotonic() + self._drain_s
        while time.monotonic() < deadline and any(role.busy() for role in self.roles):
            try:
                self.step()  # WRITE completions go out as in the loop
            except Exception:
                logger.exception("kv_push: transfer thread step failed while closing")
                break
            time.sleep(0)
        bye = Goodbye(engine_id=self.engine_id, tp_rank=self.tp_rank)
        for name, peer in list(self.peers.items()):
            writing = [role for role in self.roles
                       if getattr(role, "writing_to", None) and role.writing_to(name)]
            if writing:
                self.withheld.add(name)  # its lifeline must stay open (PushWorker.close)
                logger.warning("kv_push: closing with a WRITE to %s (engine %s rank %d) still in "
                               "flight: no goodbye (its lifeline ends with this process)",
                               name, peer.engine_id, peer.tp_rank)
            elif self._may_call(peer):
                self.send(name, bye)
        # let the goodbyes leave: notifications only go out while the agent is polled
        deadline = time.monotonic() + 0.05
        while self.peers and time.monotonic() < deadline:
            self.transport.get_notifs()
        for role in self.roles:
            self._guard(role.close, context="close")
        self.transport.close()
        # wake anyone still waiting on a call()
        while True:
            try:
                _, _, fut = self._inbox.get_nowait()
            except queue.Empty:
                break
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError("kv_push transfer thread closed"))
