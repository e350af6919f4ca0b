"""Tests for kv_push.common.transfer_thread over an in-memory fake transport (no NIXL).

The fake transport is tests/fakes.py's, shared with the role tests.

Synchronisation: ``sync(t)`` makes two ``call``s. A call runs at the top of a loop step, so when
the second returns, the whole step that ran the first -- its notification dispatch, role ticks and
liveness pass -- has finished. Anything put on the wire before ``sync`` has then been dispatched.
Liveness is tested deterministically with an injected clock, plus once in real time.
"""

from __future__ import annotations

import logging
import socket

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kv_push.common import geometry as G
from kv_push.common.auth import NotificationChannel
from kv_push.common.config import PushConfig
from kv_push.common.messages import (
    Cancel,
    Codec,
    Goodbye,
    Heartbeat,
    MessageRejected,
    Refused,
    Register,
    WriteDone,
    geometry_digest,
)
from kv_push.common.metrics import Counters
from kv_push.common.transfer_thread import Peer, RoleContext, TransferThread
from kv_push.common.transport import Transport, TransportError

from fakes import FakeClock, FakeTransport, Wire

GEOM = G.pooled(base=1 << 32, placement="kv_split", num_layers=2, num_kv_heads=2, head_size=8,
                dtype_bytes=2, dtype="bfloat16", block_size=4, num_blocks=8)
DIGEST = geometry_digest(GEOM)
TIMEOUT = 10.0  # for waits that should end at once; only reached when something is broken


# -- the fake transport (tests/fakes.py) ------------------------------------------------------


def test_fake_transport_pair():
    wire = Wire()
    a, b = FakeTransport(wire, "A"), FakeTransport(wire, "B")
    assert not a.send_notif("B", b"x")  # not a peer yet
    assert a.add_peer(b.metadata()) == "B"
    assert a.send_notif("B", b"hello")
    assert b.get_notifs() == [("A", b"hello")] and b.get_notifs() == []
    h = a.write("B", np.zeros(1, np.uint64), np.zeros(1, np.uint64), "DRAM", "DRAM", b"n")
    assert a.poll(h) == "DONE" and b.get_notifs() == [("A", b"n")]
    a.remove_peer("B")
    assert a.poll(a.write("B", None, None, "DRAM", "DRAM", b"")) == "ERR"
    # the knobs the role tests use
    a.add_peer(b.metadata())
    a.hold_writes = True
    held = a.write("B", None, None, "DRAM", "DRAM", b"late")
    assert a.poll(held) == "PROC" and b.get_notifs() == [] and a.in_flight() == [held]
    a.finish(held)
    assert a.poll(held) == "DONE" and b.get_notifs() == [("A", b"late")]
    a.fail_posts.append("no route")
    bad = a.write("B", None, None, "DRAM", "DRAM", b"lost")
    assert a.poll(bad) == "ERR" and a.failure_reason(bad) == "no route" and b.get_notifs() == []


# -- the context roles see ------------------------------------------------------------------------


def test_unstarted_thread_is_a_role_context_driven_by_step():
    """A role needs only ``RoleContext``; the thread provides it without running (``step``)."""
    wire = Wire()
    ta, b = FakeTransport(wire, "A"), FakeTransport(wire, "B")
    clock = FakeClock(5.0)
    role = RecordingRole()
    t = TransferThread(ta, engine_id="A", tp_rank=0, geometry=GEOM,
                       config=PushConfig(heartbeat_interval_s=30.0), clock=clock)
    t.add_role(role)
    ctx: RoleContext = t
    members = [m for m in dir(RoleContext) if not m.startswith("_")]
    assert {"send", "add_peer", "peer", "peer_lost", "write", "poll", "release",
            "failure_reason", "submit", "metadata", "agent_name"} <= set(members)
    assert all(hasattr(t, m) for m in members + list(RoleContext.__annotations__))
    assert (ctx.agent_name, ctx.metadata(), ctx.clock()) == ("A", b"meta:A", 5.0)
    peer = ctx.add_peer(b.metadata(), engine_id="B", tp_rank=0, geometry=GEOM, digest=DIGEST)
    b.add_peer(b"meta:A")
    assert ctx.peer("B") is peer and ctx.peer("C") is None and peer.last_heard == 5.0
    assert ctx.send("B", reg_msg(engine="A"))
    assert [Codec().decode(d) for _, d in b.get_notifs()] == [reg_msg(engine="A")]
    h = ctx.write("B", None, None, "DRAM", "DRAM", ctx.codec.encode(reg_msg("w")))
    assert ctx.poll(h) == "DONE"
    ctx.release(h)
    assert h.released
    ta.fail_posts.append("no route")
    assert ctx.failure_reason(ctx.write("B", None, None, "DRAM", "DRAM", b"")) == "no route"
    # work submitted (from any thread) and notifications run when the test steps the thread
    ran = []
    ctx.submit(lambda: ran.append(threading.get_ident()))
    b.send_notif("A", Codec().encode(reg_msg("t9", engine="B")))
    assert ran == [] and role.messages == []
    t.step()
    assert ran == [threading.get_ident()]
    assert role.messages == [("B", reg_msg("t9", engine="B"))]
    assert role.ticks == 1
    ctx.peer_lost("B", "lifeline closed")
    assert ctx.peer("B") is not None  # dropped on the thread, at its next step
    t.step()
    assert ctx.peer("B") is None and [p.agent_name for p in role.dead] == ["B"]
    assert t.counters.get("peers_dead") == 1 and ta.removed == ["B"]
    t.close()
    assert ta.closed and role.closed == 1


def test_fake_transport_stands_in_for_every_member_of_the_seam():
    wire = Wire()
    a = FakeTransport(wire, "A")
    seam = [n for n, v in vars(Transport).items() if not n.startswith("_") and callable(v)]
    assert seam and all(callable(getattr(a, n, None)) for n in seam)
    assert all(hasattr(a, n) for n in Transport.__annotations__)


# -- roles and helpers ---------------------------------------------------------------------------


@dataclass
class RecordingRole:
    handles: tuple[type, ...] = (Register, Cancel)
    messages: list[tuple[str, Any]] = field(default_factory=list)
    threads: set[int] = field(default_factory=set)
    dead: list[Peer] = field(default_factory=list)
    dead_event: threading.Event = field(default_factory=threading.Event)
    dead_at: list[float] = field(default_factory=list)
    silent: list[Peer] = field(default_factory=list)
    silent_event: threading.Event = field(default_factory=threading.Event)
    silent_at: list[float] = field(default_factory=list)
    ticks: int = 0
    closed: int = 0
    raise_on_message: BaseException | None = None
    raise_on_tick: BaseException | None = None
    raise_on_peer_dead: BaseException | None = None

    def on_message(self, peer: Peer, msg) -> None:
        self.threads.add(threading.get_ident())
        self.messages.append((peer.agent_name, msg))
        if self.raise_on_message is not None:
            exc, self.raise_on_message = self.raise_on_message, None
            raise exc

    def tick(self, now: float) -> None:
        self.threads.add(threading.get_ident())
        self.ticks += 1
        if self.raise_on_tick is not None:
            exc, self.raise_on_tick = self.raise_on_tick, None
            raise exc

    def busy(self) -> bool:
        return False

    def on_peer_dead(self, peer: Peer) -> None:
        self.threads.add(threading.get_ident())
        self.dead.append(peer)
        self.dead_at.append(time.monotonic())
        self.dead_event.set()
        if self.raise_on_peer_dead is not None:
            raise self.raise_on_peer_dead

    def on_peer_silent(self, peer: Peer) -> None:
        self.silent.append(peer)
        self.silent_at.append(time.monotonic())
        self.silent_event.set()

    def close(self) -> None:
        self.closed += 1


def sync(t: TransferThread) -> None:
    t.call(lambda: None, TIMEOUT)
    t.call(lambda: None, TIMEOUT)


def wait_until(pred, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.002)
    return pred()


def reg_msg(tid: str = "t1", engine: str = "B", rank: int = 0) -> Register:
    return Register(transfer_id=tid, reg_id=tid, prompt_digest="", attempt=0, engine_id=engine,
                    tp_rank=rank, block_ids=(1, 2), first_token=0, num_tokens=8,
                    geometry_digest=DIGEST)


class Harness:
    """A started TransferThread "A" on a fake transport, and a raw fake transport "B" that the
    test drives by hand (B has no thread: the test is its owner)."""

    def __init__(self, *, interval: float = 30.0, clock=time.monotonic, secret: bytes = b"",
                 roles=None):
        self.wire = Wire()
        self.ta = FakeTransport(self.wire, "A")
        self.b = FakeTransport(self.wire, "B")
        self.config = PushConfig(heartbeat_interval_s=interval, idle_poll_s=0.001, secret=secret)
        self.counters = Counters()
        self.t = TransferThread(self.ta, engine_id="A", tp_rank=0, geometry=GEOM,
                                config=self.config, counters=self.counters, clock=clock)
        self.roles = [RecordingRole()] if roles is None else roles
        for role in self.roles:
            self.t.add_role(role)
        self.codec = Codec(secret or None)
        self.chan_b = NotificationChannel(self.codec, "B")  # B's side: seals for A, opens from A
        self.meta_a = b"meta:A"  # what A's metadata() says; not asked from this thread
        self.t.start()

    @property
    def role(self) -> RecordingRole:
        return self.roles[0]

    def connect_b(self) -> Peer:
        meta = self.b.metadata()
        self.b.add_peer(self.meta_a)
        return self.t.call(lambda: self.t.add_peer(meta, engine_id="B", tp_rank=0, geometry=GEOM,
                                                   digest=DIGEST), TIMEOUT)

    def b_send(self, msg) -> bytes:
        """Send ``msg`` from B to A as B's transfer thread would; returns the frame."""
        frame = self.chan_b.seal("A", msg)
        assert self.b.send_notif("A", frame)
        return frame

    def b_received(self) -> list:
        return [(s, self.chan_b.open(s, d)) for s, d in self.b.get_notifs()]

    def rejected(self, label: str) -> float:
        return self.counters.get("rejected", label=label)

    def close(self) -> None:
        self.t.close()


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.close()
    assert harness.ta.closed
    # the transport contract: one owner thread calls every method
    assert harness.ta.callers == {harness.t._thread.ident}


# -- running work on the owner thread -------------------------------------------------------------


def test_call_and_submit_run_on_owner_thread(h):
    owner = h.t.call(threading.get_ident, TIMEOUT)
    assert owner == h.t._thread.ident != threading.get_ident()
    ran = []
    done = threading.Event()
    for i in range(50):
        h.t.submit(lambda i=i: ran.append((i, threading.get_ident())))
    h.t.submit(done.set)
    assert done.wait(TIMEOUT)
    assert ran == [(i, owner) for i in range(50)]  # in order, on the owner thread
    assert h.t.call(lambda: 6 * 7, TIMEOUT) == 42
    # a call made on the owner thread runs inline instead of deadlocking on its own inbox
    assert h.t.call(lambda: h.t.call(lambda: "inner", TIMEOUT), TIMEOUT) == "inner"
    assert h.counters.get("queue_wait_seconds") > 0  # the inbox waits were summed
    assert h.role.threads <= {owner} and h.role.ticks > 0


def test_call_propagates_exceptions_and_thread_survives(h):
    with pytest.raises(ZeroDivisionError):
        h.t.call(lambda: 1 / 0, TIMEOUT)

    def reject():
        raise MessageRejected("bad_layout", "for the caller")

    with pytest.raises(MessageRejected):
        h.t.call(reject, TIMEOUT)
    assert h.t.alive
    assert h.t.call(lambda: "still here", TIMEOUT) == "still here"
    assert h.rejected("internal_error") == 0  # the caller got it: not counted


def test_a_call_that_timed_out_before_it_started_never_runs(h):
    """The side channel's handshake calls accept_hello on the thread with a time-out. One
    that timed out while the thread was busy (e.g. compiling kernels) still ran later: it added
    a decoder as a peer nobody had been told of, with no lifeline to ever drop it. A call whose
    time-out comes before it started is now cancelled; one already running is waited for (its
    effect happens anyway)."""
    busy, go = threading.Event(), threading.Event()
    h.t.submit(lambda: (busy.set(), go.wait(TIMEOUT)))
    assert busy.wait(TIMEOUT)
    ran = []
    with pytest.raises(TimeoutError):
        h.t.call(lambda: ran.append("late"), 0.05)
    go.set()
    assert h.t.call(lambda: "after", TIMEOUT) == "after"
    assert ran == []
    # started before its time-out ran out: its result is returned, not a time-out
    started, finish, got = threading.Event(), threading.Event(), []
    caller = threading.Thread(target=lambda: got.append(h.t.call(
        lambda: (started.set(), finish.wait(TIMEOUT), "done")[-1], 1.0)))
    caller.start()
    assert started.wait(TIMEOUT)  # (it must start within its 1 s: an idle thread does)
    time.sleep(1.2)  # past the call's time-out, while it runs
    finish.set()
    caller.join(TIMEOUT)
    assert got == ["done"]


def test_failing_submitted_work_is_counted_and_survived(h):
    h.t.submit(lambda: 1 / 0)
    h.t.submit(lambda: (_ for _ in ()).throw(MessageRejected("bad_layout", "from work")))
    sync(h.t)
    assert h.t.alive
    assert h.rejected("internal_error") == 1
    assert h.rejected("bad_layout") == 1
    assert h.t.call(lambda: 1, TIMEOUT) == 1


def test_add_peer(h):
    peer = h.connect_b()
    assert (peer.agent_name, peer.engine_id, peer.tp_rank, peer.geometry_digest) == (
        "B", "B", 0, DIGEST)
    assert h.t.call(lambda: set(h.t.peers), TIMEOUT) == {"B"}
    assert "B" in h.ta.peers
    # the same peer again with the same geometry is fine; with another it is refused
    h.connect_b()
    other = geometry_digest(G.pooled(base=0, placement="kv_split", num_layers=2, num_kv_heads=2,
                                     head_size=8, dtype_bytes=2, dtype="bfloat16", block_size=4,
                                     num_blocks=9))
    meta = h.b.metadata()
    with pytest.raises(MessageRejected) as e:
        h.t.call(lambda: h.t.add_peer(meta, engine_id="B", tp_rank=0, geometry=GEOM,
                                      digest=other), TIMEOUT)
    assert e.value.reason == "layout_changed"
    with pytest.raises(TransportError):
        h.t.call(lambda: h.t.add_peer(b"not metadata", engine_id="C", tp_rank=0, geometry=GEOM,
                                      digest=DIGEST), TIMEOUT)


# -- notification dispatch -----------------------------------------------------------------------


def test_messages_reach_the_role_that_handles_them(h):
    h.connect_b()
    msgs = [reg_msg("t1"), Cancel(transfer_id="t1", reg_id="t1", prompt_digest="", attempt=0,
                                  engine_id="B", tp_rank=0, reason="x"), reg_msg("t2")]
    for m in msgs:
        h.b_send(m)
    sync(h.t)
    assert h.role.messages == [("B", m) for m in msgs]
    assert h.role.threads == {h.t._thread.ident}


def test_message_no_role_handles_is_unexpected(h):
    h.connect_b()
    h.b_send(WriteDone(transfer_id="t", reg_id="t", attempt=0, engine_id="B", tp_rank=0,
                       num_bytes=1))
    h.b_send(Refused(reason="x"))
    sync(h.t)
    assert h.rejected("unexpected") == 2
    assert h.role.messages == []


def test_every_interested_role_sees_a_message():
    second = RecordingRole(handles=(Register,))
    h = Harness(roles=[RecordingRole(), second, RecordingRole(handles=(WriteDone,))])
    try:
        h.connect_b()
        h.b_send(reg_msg())
        sync(h.t)
        assert [len(r.messages) for r in h.roles] == [1, 1, 0]
    finally:
        h.close()


@pytest.mark.parametrize("junk", [b"", b"junk", b"\x93\x01", b"\xff" * 100,
                                  Codec().encode(reg_msg())[:-3]], ids=repr)
def test_malformed_notification_is_counted_and_survived(h, junk):
    h.connect_b()
    h.b.send_notif("A", junk)
    h.wire.inject("A", "stranger", junk)  # malformed from anyone: malformed, whoever sends it
    h.b_send(reg_msg())
    sync(h.t)
    assert h.rejected("malformed") == 2
    assert h.t.alive
    assert h.role.messages == [("B", reg_msg())]  # the good message after the junk still lands


def test_unknown_peer_is_rejected(h):
    h.connect_b()
    h.wire.inject("A", "stranger", Codec().encode(reg_msg()))
    h.wire.inject("A", "stranger", Codec().encode(Heartbeat(engine_id="s", tp_rank=0, seq=1)))
    h.wire.inject("A", "stranger", Codec().encode(Goodbye(engine_id="s", tp_rank=0)))
    sync(h.t)
    assert h.rejected("unknown_peer") == 3
    assert h.role.messages == [] and h.role.dead == []
    assert h.t.call(lambda: set(h.t.peers), TIMEOUT) == {"B"}


def test_role_whose_handler_raises_does_not_kill_the_thread(h):
    h.connect_b()
    h.role.raise_on_message = RuntimeError("handler bug")
    h.b_send(reg_msg("t1"))
    sync(h.t)
    assert h.t.alive
    assert h.rejected("internal_error") == 1
    h.role.raise_on_message = MessageRejected("spoofed", "names another engine")
    h.b_send(reg_msg("t2"))
    h.b_send(reg_msg("t3"))  # the next message is handled normally
    sync(h.t)
    assert h.rejected("spoofed") == 1
    assert [m.transfer_id for _, m in h.role.messages] == ["t1", "t2", "t3"]
    h.role.raise_on_tick = KeyError("tick bug")
    sync(h.t)
    assert h.rejected("internal_error") == 2
    assert h.t.alive and h.t.call(lambda: "ok", TIMEOUT) == "ok"


def test_rejections_with_authentication():
    h = Harness(secret=b"k1")
    try:
        h.connect_b()
        h.b.send_notif("A", Codec().encode(reg_msg("plain")))
        h.b.send_notif("A", Codec(b"other").encode(reg_msg("wrong-key")))
        h.b_send(reg_msg("good"))
        sync(h.t)
        assert h.rejected("unauthenticated") == 1
        assert h.rejected("bad_mac") == 1
        assert [m.transfer_id for _, m in h.role.messages] == ["good"]
    finally:
        h.close()


# -- liveness ------------------------------------------------------------------------------------


def test_heartbeats_keep_a_peer_alive_and_silence_marks_it_unresponsive():
    """Deterministic, with an injected clock. The interval (1/8 s, time-out 3/16 s) is exact in
    binary, so clock arithmetic has no rounding. Silence is not proof of death (issue 9 item 5):
    the peer is marked unresponsive and the roles are told, but it stays in the table."""
    clock = FakeClock()
    iv = 0.125
    h = Harness(interval=iv, clock=clock)
    try:
        sync(h.t)  # the first heartbeat slot (no peers yet) passed at t=0
        h.connect_b()  # last heard at t=0
        seqs = []
        for step in range(1, 11):
            clock.t = step * iv
            sync(h.t)
            got = h.b_received()
            assert [(s, type(m)) for s, m in got] == [("A", Heartbeat)], step
            assert got[0][1].engine_id == "A" and got[0][1].tp_rank == 0
            seqs.append(got[0][1].seq)
            h.b_send(Heartbeat(engine_id="B", tp_rank=0, seq=step))  # B answers
            sync(h.t)
            assert h.b_received() == []  # one heartbeat per interval, not per loop step
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert h.role.silent == [] and h.role.dead == []  # never silent for longer than one
        # B falls silent; last heard at t=1.25
        clock.t = 1.25 + 1.5 * iv  # exactly the time-out: not yet
        sync(h.t)
        assert h.role.silent == [] and h.counters.get("peers_silent") == 0
        assert [type(m) for _, m in h.b_received()] == [Heartbeat]  # the one due at 1.375
        clock.t = 1.25 + 1.5 * iv + 1e-6
        sync(h.t)
        assert [p.agent_name for p in h.role.silent] == ["B"]
        assert h.counters.get("peers_silent") == 1
        # not taken for dead: still a peer, still heartbeated, no goodbye, nothing removed
        assert h.role.dead == [] and h.counters.get("peers_dead") == 0
        assert h.t.call(lambda: h.t.peers["B"].silent, TIMEOUT) is True
        assert h.ta.removed == []
        clock.t = 3.0
        sync(h.t)
        assert set(type(m) for _, m in h.b_received()) == {Heartbeat}
        assert len(h.role.silent) == 1  # told once
        # it speaks again: no longer silent, and a new silence is told again
        h.b_send(Heartbeat(engine_id="B", tp_rank=0, seq=99))
        sync(h.t)
        assert h.t.call(lambda: h.t.peers["B"].silent, TIMEOUT) is False
        clock.t = 4.0
        sync(h.t)
        assert len(h.role.silent) == 2
        # only proof drops it: its lifeline closing
        h.t.peer_lost("B", "its side channel closed")
        sync(h.t)
        assert [p.agent_name for p in h.role.dead] == ["B"]
        assert h.counters.get("peers_dead") == 1 and h.ta.removed == ["B"]
        assert h.t.call(lambda: set(h.t.peers), TIMEOUT) == set()
    finally:
        h.close()


def test_a_decoder_is_dropped_once_none_of_its_lifelines_is_open(h):
    """A decoder gave up on a slow handshake (H1) and made another (H2): H1's lifeline closing
    (or its Welcome failing to go out) dropped the peer H2 had made -- a live decoder the
    producer then no longer knew. A peer is dropped once none of its lifelines is open; a kv_both
    worker's decoder role adding the same agent keeps them; a handshake whose Welcome never went
    out, with no lifeline open, drops it (no zombie)."""
    meta = h.b.metadata()
    h.b.add_peer(h.meta_a)

    def add(made_by: bytes = b"") -> None:  # (a producer's accept_hello, or a decoder role)
        h.t.call(lambda: h.t.add_peer(meta, engine_id="B", tp_rank=0, geometry=GEOM,
                                      digest=DIGEST, made_by=made_by), TIMEOUT)

    def peers() -> set:
        return h.t.call(lambda: set(h.t.peers), TIMEOUT)

    add()
    h.t.lifeline_held("B", b"h1")
    add()  # H2's accept_hello, then the decoder role's own add: the held lifelines stay
    h.t.lifeline_held("B", b"h2")
    add()
    h.t.peer_lost("B", "its side channel closed", lifeline=b"h1")
    sync(h.t)
    assert h.role.dead == [] and peers() == {"B"}
    h.t.peer_lost("B", "its side channel closed", lifeline=b"h2")
    sync(h.t)
    assert [p.agent_name for p in h.role.dead] == ["B"] and peers() == set()
    # a Welcome that never went out: the entry another role made (kv_both) stays; the entry
    # its own accept_hello made, with nothing else of it open, goes (no zombie)
    add()
    h.t.peer_lost("B", "its Welcome could not be sent", lifeline=b"h3", held=False)
    sync(h.t)
    assert len(h.role.dead) == 1 and peers() == {"B"}
    h.t.call(lambda: h.t.drop_peer(h.t.peers["B"], "test"), TIMEOUT)
    add(made_by=b"h4")
    h.t.peer_lost("B", "its Welcome could not be sent", lifeline=b"h4", held=False)
    sync(h.t)
    assert len(h.role.dead) == 3 and peers() == set()


def test_a_closing_producer_worker_ends_its_lifelines_only_after_its_thread(monkeypatch):
    """Its decoders free their fenced blocks when its lifeline closes: closing the lifelines
    before the transfer thread drained its WRITEs let a WRITE land in freed blocks (a cold
    review's finding on the first version of closing them)."""
    from kv_push.common.side_channel import SideChannelServer
    from kv_push.common.worker import PushWorker

    order: list[str] = []
    for name in ("stop_listening", "close_lifelines"):
        real = getattr(SideChannelServer, name)
        monkeypatch.setattr(SideChannelServer, name,
                            lambda self, *a, _r=real, _n=name, **k: (order.append(_n),
                                                                     _r(self, *a, **k))[1])
    real_close = TransferThread.close
    monkeypatch.setattr(TransferThread, "close", lambda self, *a, **k: (
        order.append(f"thread alive={self.alive}"), real_close(self, *a, **k))[1])
    w = PushWorker(geometry=GEOM, role="producer", engine_id="E",
                   config=PushConfig(side_channel_port=0),
                   transport_factory=lambda: FakeTransport(Wire(), "E"))
    w.start()
    w.close()
    assert order == ["stop_listening", "thread alive=True", "close_lifelines"], order
    # a worker closed without having started does not hang in the listener's shutdown
    PushWorker(geometry=GEOM, role="producer", engine_id="F",
               config=PushConfig(side_channel_port=0),
               transport_factory=lambda: FakeTransport(Wire(), "F")).close()


def test_any_message_counts_as_a_sign_of_life():
    clock = FakeClock()
    h = Harness(interval=0.1, clock=clock)
    try:
        h.connect_b()
        for step in range(1, 6):
            clock.t = step * 0.1
            h.b_send(reg_msg(f"t{step}"))
            sync(h.t)
        assert h.role.dead == []
        assert len(h.role.messages) == 5
    finally:
        h.close()


def test_silent_peer_found_unresponsive_in_real_time():
    interval = 0.5
    h = Harness(interval=interval)
    try:
        t0 = time.monotonic()  # before B is added, so elapsed >= B's actual silence
        h.connect_b()
        assert h.role.silent_event.wait(TIMEOUT), "a silent peer was never noticed"
        elapsed = h.role.silent_at[0] - t0
        print(f"\nsilent peer found unresponsive after {elapsed:.3f}s "
              f"(time-out {1.5 * interval:.2f}s)")
        assert elapsed > 1.5 * interval  # never before the time-out
        assert [p.agent_name for p in h.role.silent] == ["B"]
        assert h.counters.get("peers_silent") == 1
        assert h.role.dead == [] and h.ta.removed == []  # silence alone is not death
        received = [type(m) for _, m in h.b_received()]
        assert set(received) <= {Heartbeat}
    finally:
        h.close()


def test_heartbeats_sent_to_every_peer_in_real_time():
    # a heartbeat every 0.5 s; a peer is dead after 3 s of silence, which a loaded box never
    # stretches the answers below to (with 0.05 s, load ~10 made live peers look dead)
    interval = 2.0
    h = Harness(interval=interval)
    wire = h.wire
    c = FakeTransport(wire, "C")
    try:
        h.connect_b()
        c.add_peer(h.meta_a)
        meta = c.metadata()
        h.t.call(lambda: h.t.add_peer(meta, engine_id="C", tp_rank=1, geometry=GEOM,
                                      digest=DIGEST), TIMEOUT)
        got: dict[str, list] = {"B": [], "C": []}

        def pump() -> bool:
            for name, tr in (("B", h.b), ("C", c)):
                for sender, data in tr.get_notifs():
                    got[name].append(Codec().decode(data))
                    # answer so that A keeps us
                    tr.send_notif("A", Codec().encode(Heartbeat(engine_id=name, tp_rank=0, seq=1)))
            return all(sum(isinstance(m, Heartbeat) for m in v) >= 2 for v in got.values())

        assert wait_until(pump), got
        for msgs in got.values():
            seqs = [m.seq for m in msgs if isinstance(m, Heartbeat)]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert h.role.dead == []  # both answered: neither was taken for dead
    finally:
        h.close()


def test_goodbye_drops_the_peer_at_once(h):
    # the fixture's heartbeat interval is 30 s: only the Goodbye can drop B here
    h.connect_b()
    h.b_send(Goodbye(engine_id="B", tp_rank=0))
    sync(h.t)
    assert [p.agent_name for p in h.role.dead] == ["B"]
    assert h.counters.get("peers_dead") == 0  # an orderly leave is not a death
    assert h.t.call(lambda: set(h.t.peers), TIMEOUT) == set()
    assert h.ta.removed == ["B"]
    h.b.add_peer(h.meta_a)
    h.b_send(reg_msg())
    sync(h.t)
    assert h.role.messages == [] and h.rejected("unknown_peer") == 1
    # it can come back through a new handshake
    h.connect_b()
    h.b_send(reg_msg())
    sync(h.t)
    assert h.role.messages == [("B", reg_msg())]


def test_on_peer_dead_raising_still_removes_the_peer(h):
    h.connect_b()
    h.role.raise_on_peer_dead = RuntimeError("cleanup bug")
    h.b_send(Goodbye(engine_id="B", tp_rank=0))
    sync(h.t)
    assert h.t.alive
    assert h.rejected("internal_error") == 1
    assert h.ta.removed == ["B"]
    assert h.t.call(lambda: set(h.t.peers), TIMEOUT) == set()


# -- two threads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("secret_a,secret_b,outcome", [
    (b"", b"", "handled"),
    (b"s", b"s", "handled"),
    (b"s", b"", "secret_mismatch"),  # a secret on one side only is refused, both ways
    (b"", b"s", "unauthenticated"),
    (b"s", b"t", "bad_mac"),
])
def test_two_threads_talk(secret_a, secret_b, outcome):
    wire = Wire()
    ta, tb = FakeTransport(wire, "A"), FakeTransport(wire, "B")
    role_b = RecordingRole()
    threads = {}
    for name, tr, secret, role in (("A", ta, secret_a, RecordingRole()), ("B", tb, secret_b,
                                                                            role_b)):
        t = TransferThread(tr, engine_id=name, tp_rank=0, geometry=GEOM,
                           config=PushConfig(heartbeat_interval_s=30.0, secret=secret))
        t.add_role(role)
        t.start()
        threads[name] = t
    a, b = threads["A"], threads["B"]
    try:
        meta_a, meta_b = a.call(ta.metadata, TIMEOUT), b.call(tb.metadata, TIMEOUT)
        a.call(lambda: a.add_peer(meta_b, engine_id="B", tp_rank=0, geometry=GEOM,
                                  digest=DIGEST), TIMEOUT)
        b.call(lambda: b.add_peer(meta_a, engine_id="A", tp_rank=0, geometry=GEOM,
                                  digest=DIGEST), TIMEOUT)
        assert a.call(lambda: a.send("B", reg_msg(engine="A")), TIMEOUT) is True
        assert a.call(lambda: a.send("nobody", reg_msg()), TIMEOUT) is False
        sync(b)
        if outcome == "handled":
            assert role_b.messages == [("A", reg_msg(engine="A"))]
        else:
            assert role_b.messages == []
            assert b.counters.get("rejected", label=outcome) >= 1
        # A closes: B hears the goodbye (if it can authenticate it) and forgets A
        a.close()
        sync(b)
        if outcome == "handled":
            assert [p.agent_name for p in role_b.dead] == ["A"]
            assert b.call(lambda: set(b.peers), TIMEOUT) == set()
    finally:
        a.close()
        b.close()
    assert ta.closed and tb.closed and not a.alive and not b.alive


# -- closing -------------------------------------------------------------------------------------


def test_close_joins_says_goodbye_and_closes_transport():
    h = Harness()
    h.connect_b()
    thread = h.t._thread
    h.t.close()
    assert not thread.is_alive() and not h.t.alive
    assert h.ta.closed
    assert h.role.closed == 1
    assert [(s, type(m)) for s, m in h.b_received()] == [("A", Goodbye)]
    h.t.close()  # idempotent
    assert h.role.closed == 1
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        h.t.call(lambda: 1, timeout=60.0)
    # it raised at once (no time-out: that would be TimeoutError), long before the 60 s
    assert time.monotonic() - started < 30, "call() after close waited for its time-out"
    h.t.submit(lambda: None)  # never blocks, never raises


def test_close_before_start():
    wire = Wire()
    tr = FakeTransport(wire, "A")
    role = RecordingRole()
    t = TransferThread(tr, engine_id="A", tp_rank=0, geometry=GEOM, config=PushConfig())
    t.add_role(role)
    t.close()
    assert tr.closed and role.closed == 1 and not t.alive


def test_role_close_raising_still_closes_transport():
    h = Harness()
    h.role.close = lambda: (_ for _ in ()).throw(RuntimeError("close bug"))  # type: ignore
    h.t.close()
    assert h.ta.closed and not h.t.alive
    assert h.counters.get("rejected", label="internal_error") == 1


# -- log limiting ----------------------------------------------------------------------------------


def test_log_limiter_logs_once_then_once_per_period_with_a_count(caplog):
    from kv_push.common.metrics import LogLimiter

    clock = FakeClock()
    lim = LogLimiter(logging.getLogger("kv_push.test"), every_s=60.0, max_keys=2, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="kv_push.test"):
        assert lim.warn("a", "event %s", 1)
        assert not lim.warn("a", "event %s", 2)
        assert not lim.warn("a", "event %s", 3)
        assert lim.warn("b", "other")  # another key is not suppressed
        clock.t = 60.0
        assert lim.warn("a", "event %s", 4)
    loud = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert loud == ["event 1", "other", "event 4 (2 more like this since, logged at DEBUG)"]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        "event 2", "event 3"]
    assert lim.warn("c", "third key")  # over max_keys: it starts afresh (memory stays bounded)
    assert lim.warn("a", "event %s", 5)  # so "a" is new again


def test_reasons_that_differ_only_in_figures_share_a_log_key():
    """A failure reason with a request's figures in it ("wants 300 tokens, has 256") was a new
    LogLimiter key per request: logged every time, the limit defeated."""
    from kv_push.common.metrics import log_key

    assert log_key("decoder wants 300 tokens, prefill has 256") == \
        log_key("decoder wants 512 tokens, prefill has 384")
    assert log_key("transfer 3f23f96cdcfc4261aaa28f93af82f0fa expired") == \
        log_key("transfer 0123456789abcdef0123456789abcdef expired")
    assert log_key("no KV within 60s") != log_key("handshake failed: timed out")


# -- what a worker holds (diagnostics) ------------------------------------------------------------


def test_worker_describes_what_it_holds_and_logs_it_when_asked(monkeypatch, caplog):
    from kv_push.common.worker import STATE_LOG_ENV, PushWorker

    monkeypatch.setenv(STATE_LOG_ENV, "0.05")
    w = PushWorker(geometry=GEOM, role="both", engine_id="E",
                   config=PushConfig(side_channel_port=0, heartbeat_interval_s=30.0),
                   transport_factory=lambda: FakeTransport(Wire(), "A"))
    try:
        with caplog.at_level(logging.WARNING, logger="kv_push"):
            w.start()
            idle = w.describe()
            assert not any(idle["counts"].values()), idle
            assert {k: idle[k] for k in ("peers", "wants", "parked", "sources", "jobs",
                                         "rendezvous", "claims", "orphans")} == {
                "peers": [], "wants": [], "parked": 0, "sources": [], "jobs": [],
                "rendezvous": 0, "claims": 0, "orphans": 0}
            w.prefill_done("p1", "t1", (0, 1), 8)  # no decoder registered: held
            assert wait_until(lambda: w.describe()["sources"] == [("p1", "t1")])
            assert w.describe()["rendezvous"] == 1
            assert wait_until(lambda: any("kv_push state" in r.getMessage()
                                          and "'p1'" in r.getMessage()
                                          for r in caplog.records))
            with socket.socket() as hung:  # a "producer" that never answers the handshake
                hung.bind(("127.0.0.1", 0))
                hung.listen(1)
                w.expect("d1", "t2", 0, hung.getsockname()[:2], (2, 3), 0, 8)
                assert wait_until(lambda: w.describe()["wants"] != [])
                (want,) = w.describe()["wants"]
                assert (want["key"], want["tid"], want["state"]) == ("d1", "t2", "connecting")
    finally:
        w.close()


@dataclass
class SwitchedRole(RecordingRole):
    """A role whose ``holding``/``awaiting``/``busy`` answers the test sets (``polls``: how
    often the loop asked ``busy``)."""
    held: bool = False
    awaits: bool = False
    spinning: bool = False
    polls: int = 0

    def holding(self) -> bool:
        return self.held

    def awaiting(self) -> bool:
        return self.awaits

    def busy(self) -> bool:
        self.polls += 1
        return self.spinning


def test_a_quiet_thread_backs_off_and_anything_but_a_heartbeat_stirs_it():
    """The loop's sleep (``_sleep_s``, module doc 4.): ``idle_poll_s`` while a role holds
    something or for ``quiet_after_s`` after the last work or message, then ``quiet_poll_s``
    (never past the next heartbeat); ``await_poll_s`` while a role awaits a WRITE. A role
    without ``holding`` is taken to hold something (never quiet). Unstarted thread, fake clock."""
    wire = Wire()
    ta, b = FakeTransport(wire, "A"), FakeTransport(wire, "B")
    clock = FakeClock(100.0)
    cfg = PushConfig(heartbeat_interval_s=4.0, idle_poll_s=0.001, await_poll_s=0.0002,
                     quiet_poll_s=0.05, quiet_after_s=1.0)

    role = SwitchedRole()
    t = TransferThread(ta, engine_id="A", tp_rank=0, geometry=GEOM, config=cfg, clock=clock)
    t.add_role(role)
    t.add_peer(b.metadata(), engine_id="B", tp_rank=0, geometry=GEOM, digest=DIGEST)
    b.add_peer(b"meta:A")
    t.step()  # the first heartbeat: the next is due at 101.0
    assert t._sleep_s() == 0.001  # just started: not quiet yet
    clock.t = 100.999
    assert t._sleep_s() == 0.001
    clock.t = 101.0005  # quiet for 1 s, but the heartbeat is due: at least idle_poll_s
    assert t._sleep_s() == 0.001
    t.step()  # heartbeat sent; next due at 102.0005
    assert t._sleep_s() == 0.05
    clock.t = 101.98
    assert t._sleep_s() == pytest.approx(0.0205)  # up to the next heartbeat
    # a heartbeat from the peer does not stir it
    b.send_notif("A", Codec().encode(Heartbeat(engine_id="B", tp_rank=0, seq=1)))
    t.step()
    assert t._sleep_s() == pytest.approx(0.0205)
    # any other message does, for quiet_after_s
    b.send_notif("A", Codec().encode(reg_msg("t1")))
    t.step()
    assert role.messages and t._sleep_s() == 0.001
    clock.t = 102.9805
    t.step()
    assert t._sleep_s() == 0.05
    # so does work handed in (the engine, the side channel)
    t.submit(lambda: None)
    t.step()
    assert t._sleep_s() == 0.001
    # a role holding something keeps it at idle_poll_s however long nothing comes ...
    role.held = True
    clock.t = 200.0
    t.step()
    assert t._sleep_s() == 0.001
    clock.t = 300.0
    assert t._sleep_s() == 0.001
    # ... and for quiet_after_s after it let go
    role.held = False
    clock.t = 300.9
    assert t._sleep_s() == 0.001
    clock.t = 301.1
    assert t._sleep_s() == 0.001  # a heartbeat is overdue
    t.step()
    assert t._sleep_s() == 0.05
    # awaiting a WRITE: await_poll_s, quiet or not; then quiet_after_s of grace, however
    # long it awaited
    role.awaits = True
    assert t._sleep_s() == 0.0002
    clock.t = 305.0
    assert t._sleep_s() == 0.0002
    role.awaits = False
    assert t._sleep_s() == 0.001
    clock.t = 306.1
    t.step()
    assert t._sleep_s() == 0.05
    # a role without holding(): never quiet
    t.add_role(RecordingRole())
    clock.t = 400.0
    assert t._sleep_s() == 0.001
    t.close()


@dataclass
class ExpectingRole(SwitchedRole):
    """A ``SwitchedRole`` that also says whether what it holds is ``expecting``."""
    expects: bool = False

    def expecting(self) -> bool:
        return self.expects


def test_holding_only_what_a_hand_off_moves_on_backs_off_at_once():
    """A role that holds something but expects no peer's message to move it on (a producer's
    registration waiting for its prefill: the prefill's hand-off wakes the thread) does not
    keep the thread at ``idle_poll_s``: it backs off to ``prefill_wait_poll_s`` at once, even
    right after work came, never past the next heartbeat. Expecting work keeps it at
    ``idle_poll_s``; awaiting a WRITE at ``await_poll_s``."""
    role = ExpectingRole()
    t, clock = _quiet_thread(role, quiet_after_s=1.0, await_poll_s=0.0002,
                             prefill_wait_poll_s=0.03, heartbeat_interval_s=4.0)
    t.step()  # first heartbeats (none: no peer); just started, stirred
    assert t._sleep_s() == 0.001  # nothing held, stirred: idle_poll_s for quiet_after_s
    role.held = True  # a registration came; its prefill is running
    assert t._sleep_s() == 0.03  # backs off at once although just stirred
    clock.t = 150.0
    t.step()  # (a heartbeat was due)
    assert t._sleep_s() == 0.03
    clock.t = 150.99
    assert t._sleep_s() == pytest.approx(0.01)  # never past the next heartbeat
    role.expects = True  # the prefill was handed in: its registration may come any moment
    assert t._sleep_s() == 0.001
    role.awaits = True
    assert t._sleep_s() == 0.0002
    role.awaits = role.expects = role.held = False  # written and released
    clock.t = 150.995
    t.step()
    assert t._sleep_s() == 0.001  # quiet_after_s of grace after expecting work
    clock.t = 152.0
    t.step()
    assert t._sleep_s() == 0.05  # quiet
    # a role without expecting() expects whatever it holds (as before the rule existed)
    plain = SwitchedRole(held=True)
    t.add_role(plain)
    assert t._sleep_s() == 0.001
    plain.held = False
    role.held = True
    assert t._sleep_s() == 0.03
    t.close()


def _quiet_thread(role, **cfg) -> tuple[TransferThread, FakeClock]:
    """An unstarted thread with ``role`` on a fake clock at 100 s (idle 1 ms, quiet 50 ms)."""
    clock = FakeClock(100.0)
    config = PushConfig(idle_poll_s=0.001, quiet_poll_s=0.05, **cfg)
    t = TransferThread(FakeTransport(Wire(), "A"), engine_id="A", tp_rank=0, geometry=GEOM,
                       config=config, clock=clock)
    t.add_role(role)
    return t, clock


def test_holding_never_backs_off_even_with_no_grace():
    """``quiet_after_s = 0`` (allowed: back off as soon as nothing is held) still never lets a
    thread whose role holds something sleep ``quiet_poll_s``: a decoder registering with a
    producer that already holds the prefill would otherwise wait up to that long."""
    role = SwitchedRole(held=True)
    t, clock = _quiet_thread(role, quiet_after_s=0.0, heartbeat_interval_s=60.0)
    b = FakeTransport(t.transport.wire, "B")
    t.add_peer(b.metadata(), engine_id="B", tp_rank=0, geometry=GEOM, digest=DIGEST)
    b.add_peer(b"meta:A")
    t.step()  # the first heartbeat: the next is due at 115
    clock.t = 110.0
    assert t._sleep_s() == 0.001
    role.held = False
    assert t._sleep_s() == 0.05
    t.close()


def test_the_running_loop_counts_busy_time_as_activity():
    """The loop itself (not only ``_sleep_s``): while a role is busy (WRITEs in flight) the
    thread spins; once it is not, it keeps ``idle_poll_s`` for ``quiet_after_s`` counted from
    the end of the busy spell, not from the last message before it."""
    role = SwitchedRole(spinning=True)
    t, clock = _quiet_thread(role, quiet_after_s=1.0, heartbeat_interval_s=600.0)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while role.polls < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        clock.t = 200.0  # a long busy spell: nothing came in meanwhile
        seen = role.polls
        while role.polls < seen + 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        role.spinning = False
        seen = role.polls
        while role.polls < seen + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert role.polls >= seen + 3
        clock.t = 200.5  # half a second after the spell ended: not quiet yet
        assert t._sleep_s() == 0.001
        clock.t = 201.5
        assert t._sleep_s() == 0.05
    finally:
        t.close()
