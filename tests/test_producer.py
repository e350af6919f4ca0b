"""Tests for kv_push.common.producer, in-process: no NIXL, no threads.

The producer runs on a ``TransferThread`` that is never started (``fakes.Node``): the test calls
the engine's entry points (``prefill_done``...) directly, as the thread would run them, and steps
the thread to dispatch notifications and tick. Decoder ranks are ``fakes.RawEnd``s driven by hand:
they introduce themselves through ``accept_hello`` (what the side channel calls), send
``Register``/``Cancel`` and read what the producer sent them. Time is a ``FakeClock``.
"""

from __future__ import annotations

import pytest

from kv_push.common import geometry as G
from kv_push.common.messages import (
    COMPAT_HASH,
    Cancel,
    CancelAck,
    Goodbye,
    Hello,
    MessageRejected,
    Register,
    TransferFailed,
    WriteDone,
    geometry_digest,
)
from kv_push.common.producer import Producer

from fakes import FakeClock, Node, RawEnd, Wire, role_config

SHAPE = dict(num_layers=2, num_kv_heads=2, head_size=8, dtype_bytes=2, dtype="bfloat16",
             block_size=4, num_blocks=8)
BLOCK_BYTES = 4 * 2 * 8 * 2  # one block's K (or V) part with both heads: 128
P_BASE, D_BASE = 1 << 32, 1 << 36
TTL = 120.0


def p_geom(tp: int = 1, rank: int = 0, **kw) -> G.KVGeometry:
    return G.pooled(base=P_BASE, placement="kv_split", tp_size=tp, tp_rank=rank, **{**SHAPE, **kw})


def d_geom(tp: int = 1, rank: int = 0, **kw) -> G.KVGeometry:
    return G.pooled(base=D_BASE + (rank << 24), placement="kv_split", tp_size=tp, tp_rank=rank,
                    **{**SHAPE, **kw})


class Bench:
    """One producer worker (P rank ``p_rank`` of ``p_tp``) and the ranks of one decoder engine
    "D" (TP ``d_tp``), each a hand-driven ``RawEnd`` named D<rank>."""

    def __init__(self, *, p_tp: int = 1, p_rank: int = 0, d_tp: int = 1, connect: bool = True,
                 **config):
        self.wire, self.clock = Wire(), FakeClock()
        self.p = Node(self.wire, self.clock, "P", p_geom(p_tp, p_rank),
                      role_config(rendezvous_ttl_s=TTL, **config))
        self.released: list[str] = []
        self.producer = Producer(self.p.thread, on_released=self.released.append,
                                 side_channel_ports=tuple(5600 + r for r in range(p_tp)))
        self.p.thread.add_role(self.producer)
        self.d_tp = d_tp
        self.d: dict[int, RawEnd] = {}
        if connect:
            for rank in range(d_tp):
                self.connect(rank)
        self.p.step()  # the first liveness pass: heartbeats out at t=0

    def hello(self, rank: int, **kw) -> Hello:
        fields = dict(engine_id="D", agent_name=f"D{rank}", agent_metadata=f"meta:D{rank}".encode(),
                      geometry=d_geom(self.d_tp, rank), compat_hash=COMPAT_HASH)
        return Hello(**{**fields, **kw})

    def connect(self, rank: int) -> RawEnd:
        end = RawEnd(self.wire, f"D{rank}")
        welcome = self.producer.accept_hello(self.hello(rank))
        end.transport.add_peer(welcome.agent_metadata)
        self.d[rank] = end
        return end

    def register(self, tid: str = "t1", rank: int = 0, attempt: int = 0, blocks=(2, 3),
                 first_token: int = 0, num_tokens: int = 8, **kw) -> None:
        fields = dict(transfer_id=tid, attempt=attempt, engine_id="D", tp_rank=rank,
                      block_ids=tuple(blocks), first_token=first_token, num_tokens=num_tokens,
                      geometry_digest=geometry_digest(d_geom(self.d_tp, rank)))
        self.d[rank].send("P", Register(**{**fields, **kw}))
        self.p.step()

    def cancel(self, tid: str = "t1", rank: int = 0, attempt: int = 0, **kw) -> None:
        fields = dict(transfer_id=tid, attempt=attempt, engine_id="D", tp_rank=rank, reason="abort")
        self.d[rank].send("P", Cancel(**{**fields, **kw}))
        self.p.step()

    def prefill(self, key: str = "req-1", tid: str = "t1", blocks=(0, 1), num_tokens: int = 8):
        """The engine's ``prefill_done``, handed to the thread as ``PushWorker`` does."""
        self.p.thread.submit(lambda: self.producer.prefill_done(key, tid, tuple(blocks),
                                                                num_tokens))
        self.p.step()

    def got(self, rank: int = 0) -> list:
        return self.d[rank].received()

    def writes(self):
        return self.p.transport.writes

    def idle(self) -> bool:
        return all(v == 0 for v in self.producer.live().values())


def done(tid="t1", attempt=0, num_bytes=4 * 2 * BLOCK_BYTES, chunk=0, chunks=1, rank=0):
    return WriteDone(transfer_id=tid, attempt=attempt, engine_id="P", tp_rank=rank,
                     num_bytes=num_bytes, chunk=chunk, chunks=chunks)


def failed(b: Bench, rank: int = 0) -> list[TransferFailed]:
    return [m for m in b.got(rank) if isinstance(m, TransferFailed)]


# -- the rendezvous, in both orders --------------------------------------------------------------


@pytest.mark.parametrize("order", ["registration_first", "prefill_first"])
def test_rendezvous_in_either_order_writes_once_and_releases(order):
    b = Bench()
    if order == "registration_first":
        b.register()
        assert b.writes() == [] and b.got() == []
        assert b.p.count("registrations_early") == 1
        b.prefill()
    else:
        b.prefill()
        assert b.writes() == [] and b.released == [] and b.producer.live()["sources"] == 1
        b.register()
        assert b.p.count("registrations_late") == 1
    # one WRITE of prompt blocks 0-1 into D blocks 2-3: per layer, K and V, one merged region
    (w,) = b.writes()
    assert w.peer == "D0" and w.state == "DONE" and w.released
    pg, dg = p_geom(), d_geom()
    assert w.src[:, 0].tolist() == [base for pair in zip(pg.k_bases, pg.v_bases) for base in pair]
    assert w.dst[:, 0].tolist() == [base + 2 * dg.block_stride
                                    for pair in zip(dg.k_bases, dg.v_bases) for base in pair]
    assert w.src[:, 1].tolist() == [2 * BLOCK_BYTES] * 4
    assert b.got() == [done()]
    assert b.released == ["req-1"]
    assert (b.p.count("writes_posted"), b.p.count("transfers_done"), b.p.count("bytes_written"),
            b.p.count("regions_written")) == (1, 1, 8 * BLOCK_BYTES, 4)
    assert b.idle() and b.producer.tombstones == {"t1": 0.0}


@pytest.mark.parametrize("limit,chunks", [(dict(max_post_regions=1), 4),
                                          (dict(max_post_bytes=2 * BLOCK_BYTES), 4)])
def test_a_large_write_goes_out_in_chunks_each_with_its_notice(limit, chunks):
    b = Bench(**limit)
    b.register()
    b.prefill()
    # one chunk when the pair meets and one at the tick of that loop step, then one per step:
    # the thread keeps serving other peers between chunks
    posted = len(b.writes())
    assert posted == 2
    assert b.released == []
    steps = 0
    while b.producer.live()["jobs"] and steps < 20:
        b.p.step()
        steps += 1
        assert len(b.writes()) - posted <= 1  # at most one chunk per loop step
        posted = len(b.writes())
    notices = b.got()
    assert [(m.chunk, m.chunks) for m in notices] == [(i, chunks) for i in range(chunks)]
    assert sum(m.num_bytes for m in notices) == 8 * BLOCK_BYTES
    assert len(b.writes()) == chunks and all(w.released for w in b.writes())
    assert b.p.count("transfers_done") == 1 and b.p.count("writes_posted") == chunks
    assert b.released == ["req-1"] and b.idle()


def test_a_source_is_held_until_every_decoder_rank_it_writes_to_is_served():
    b = Bench(d_tp=2)  # P TP 1 holds both heads; D ranks 0 and 1 hold one each
    b.prefill()
    b.register(rank=0)
    assert [w.peer for w in b.writes()] == ["D0"]
    assert b.got(0) == [done(num_bytes=4 * BLOCK_BYTES)]  # one head of two
    assert b.released == []  # rank 1 will still read the prefill
    b.register(rank=1)
    assert [w.peer for w in b.writes()] == ["D0", "D1"]
    assert b.got(1) == [done(num_bytes=4 * BLOCK_BYTES)]
    assert b.released == ["req-1"] and b.idle()


def test_a_producer_rank_that_writes_nothing_to_a_decoder_rank_still_releases():
    # P TP 2 rank 1 holds head 1; D TP 2 rank 0 holds head 0 (rank 0 registers with every P rank)
    b = Bench(p_tp=2, p_rank=1, d_tp=2)
    b.prefill()
    b.register(rank=0)
    assert b.writes() == [] and b.got(0) == [] and b.released == []
    b.register(rank=1)
    assert [w.peer for w in b.writes()] == ["D1"]
    assert b.got(1) == [done(rank=1, num_bytes=4 * BLOCK_BYTES)]
    assert b.released == ["req-1"] and b.idle()


def test_a_new_attempt_supersedes_the_old_registration():
    b = Bench()
    b.register(attempt=0, blocks=(2, 3))
    b.register(attempt=1, blocks=(4, 5))
    assert b.p.count("stale", label="registration_superseded") == 1
    b.register(attempt=0, blocks=(6, 7))  # older than the newest: dropped
    assert b.p.count("rejected", label="stale") == 1
    b.prefill()
    (w,) = b.writes()
    assert w.dst[0, 0] == d_geom().k_bases[0] + 4 * d_geom().block_stride
    assert b.got() == [done(attempt=1)]
    assert b.released == ["req-1"] and b.idle()


def test_a_reissued_prefill_displaces_the_first_source():
    b = Bench()
    b.prefill("req-a", blocks=(0, 1))
    b.prefill("req-b", blocks=(4, 5))
    assert b.released == ["req-a"] and b.p.count("stale", label="prefill_superseded") == 1
    b.register()
    (w,) = b.writes()
    assert w.src[0, 0] == p_geom().k_bases[0] + 4 * p_geom().block_stride
    assert b.released == ["req-a", "req-b"] and b.idle()


# -- cancel --------------------------------------------------------------------------------------


def test_cancel_before_the_prefill_is_acked_at_once_and_nothing_is_written():
    b = Bench()
    b.register()
    b.cancel()
    assert b.got() == [CancelAck(transfer_id="t1", attempt=0, engine_id="P", tp_rank=0)]
    assert b.p.count("cancels") == 1
    b.prefill()
    assert b.writes() == [] and b.got() == []
    assert b.released == ["req-1"] and b.idle()


def test_cancel_while_the_write_is_in_flight_is_acked_only_after_it_is_done():
    b = Bench()
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    (w,) = b.writes()
    b.cancel()
    b.p.step(5)
    assert b.got() == []  # no ack: the decoder must keep its blocks fenced
    assert b.released == [] and not w.released
    b.p.transport.finish(w)
    b.p.step()
    assert b.got() == [done(), CancelAck(transfer_id="t1", attempt=0, engine_id="P", tp_rank=0)]
    assert w.released and w.released_state == "DONE"
    assert b.released == ["req-1"] and b.idle()


def test_cancel_between_chunks_stops_posting_and_acks_after_the_posted_ones():
    b = Bench(max_post_regions=1)
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    b.cancel()
    posted = list(b.writes())
    assert 1 <= len(posted) < 4
    b.p.step(5)
    assert b.writes() == posted  # no further chunk after the cancel
    assert b.got() == []
    for w in posted:
        b.p.transport.finish(w)
    b.p.step()
    got = b.got()
    assert got[-1] == CancelAck(transfer_id="t1", attempt=0, engine_id="P", tp_rank=0)
    assert [m.chunk for m in got[:-1]] == list(range(len(posted)))  # what was posted landed
    assert b.p.count("transfers_done") == 0  # a cut-short write is not a transfer done
    assert all(w.released_state == "DONE" for w in posted)
    assert b.released == ["req-1"] and b.idle()


def test_cancel_of_an_older_attempt_is_acked_but_keeps_the_newer_registration():
    b = Bench()
    b.register(attempt=1)
    b.cancel(attempt=0)
    assert b.got() == [CancelAck(transfer_id="t1", attempt=0, engine_id="P", tp_rank=0)]
    b.prefill()
    assert b.got() == [done(attempt=1)]
    assert b.released == ["req-1"] and b.idle()


# -- failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["post", "in_flight"])
def test_a_failed_write_is_reported_to_the_decoder(when):
    b = Bench()
    if when == "post":
        b.p.transport.fail_posts.append("no route to D0")
    else:
        b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    if when == "in_flight":
        assert b.got() == [] and b.released == []
        b.p.transport.finish(b.writes()[0], error="no route to D0")
        b.p.step()
    assert b.got() == [TransferFailed(transfer_id="t1", attempt=0, engine_id="P", tp_rank=0,
                                      reason="no route to D0")]
    assert b.p.count("transfers_failed") == 1 and b.p.count("transfers_done") == 0
    assert b.writes()[0].released
    assert b.released == ["req-1"] and b.idle()


@pytest.mark.xfail(strict=True, reason="issue 9 item 3: a WRITE whose post raised counts as done")
def test_a_write_whose_post_raises_is_reported_as_failed():
    b = Bench()
    b.p.transport.raise_on_write = RuntimeError("bindings blew up")
    b.register()
    b.prefill()
    b.p.step(3)
    assert b.p.count("transfers_done") == 0
    assert [type(m) for m in b.got()] == [TransferFailed]


@pytest.mark.parametrize("reg,why", [
    (dict(blocks=(2, 99)), "cannot map blocks"),  # outside D's 8 blocks
    (dict(num_tokens=16, blocks=(2, 3, 4, 5)), "decoder wants 16 tokens, prefill has 8"),
])
def test_a_registration_that_cannot_be_planned_fails_at_once(reg, why):
    b = Bench()
    b.prefill()
    b.register(**reg)
    (msg,) = b.got()
    assert isinstance(msg, TransferFailed) and why in msg.reason
    assert b.writes() == []
    assert b.released == ["req-1"] and b.idle()
    if why == "cannot map blocks":
        assert b.p.count("rejected", label="bad_layout") == 1


def test_prefill_failed_tells_registered_decoders_and_releases():
    b = Bench()
    b.register()
    b.p.thread.submit(lambda: b.producer.prefill_failed("t1", "aborted"))
    b.p.step()
    assert b.got() == [TransferFailed(transfer_id="t1", attempt=0, engine_id="P", tp_rank=0,
                                      reason="prefill failed: aborted")]
    assert b.idle() and "t1" in b.producer.tombstones


# -- after release: tombstones -------------------------------------------------------------------


def test_a_registration_after_release_is_refused_at_once_until_the_tombstone_expires():
    b = Bench()
    b.register()
    b.prefill()
    assert b.got() == [done()]
    b.register(attempt=1)
    assert failed(b) == [TransferFailed(transfer_id="t1", attempt=1, engine_id="P", tp_rank=0,
                                        reason="the producer already released this transfer")]
    assert b.p.count("stale", label="registration_after_release") == 1
    b.prefill("req-again")  # a re-issued prefill of a served transfer: nothing will read it
    assert b.released == ["req-1", "req-again"]
    assert b.p.count("stale", label="prefill_after_release") == 1
    assert b.writes()[1:] == [] and b.idle()
    b.clock.advance(TTL + 1)
    b.p.step()
    assert b.producer.tombstones == {}
    b.register(attempt=2)  # forgotten: an ordinary early registration again
    assert b.got() == [] and b.p.count("registrations_early") == 2


# -- time-outs -----------------------------------------------------------------------------------


def test_an_unpaired_prefill_expires_after_the_ttl():
    b = Bench()
    b.prefill()
    b.clock.advance(TTL - 1)
    b.p.step()
    assert b.released == []
    b.clock.advance(2)
    b.p.step()
    assert b.released == ["req-1"] and b.p.count("expired") == 1 and b.idle()


def test_an_unpaired_registration_expires_and_the_decoder_is_told():
    b = Bench()
    b.register()
    b.clock.advance(TTL + 1)
    b.p.step()
    assert b.got() == [TransferFailed(transfer_id="t1", attempt=0, engine_id="P", tp_rank=0,
                                      reason="no prefill arrived in time")]
    assert b.p.count("expired") == 1 and b.idle()


@pytest.mark.xfail(strict=True, reason="issue 9 item 7: a paired entry never expires, so a "
                                       "decoder rank that never registers holds the source")
def test_a_decoder_rank_that_never_registers_does_not_hold_the_source_forever():
    b = Bench(d_tp=2)
    b.prefill()
    b.register(rank=0)  # rank 1 never does
    b.clock.advance(10 * TTL)
    b.p.step()
    assert b.released == ["req-1"]


# -- peers ---------------------------------------------------------------------------------------


def test_decoder_death_with_a_write_in_flight_lets_the_source_go():
    b = Bench()
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    (w,) = b.writes()
    b.p.thread.peer_lost("D0", "decoder closed its side channel")  # the lifeline: proven death
    assert b.released == []
    b.p.step()
    assert b.p.thread.peer("D0") is None and b.p.transport.removed == ["D0"]
    assert w.released
    assert b.released == ["req-1"] and b.idle()


def test_decoder_death_before_the_prefill_releases_it_when_it_arrives():
    b = Bench()
    b.register()
    b.p.thread.peer_lost("D0", "decoder closed its side channel")
    b.p.step()
    b.prefill()
    assert b.writes() == [] and b.released == ["req-1"] and b.idle()


def test_a_decoder_that_says_goodbye_is_dropped_and_its_registration_with_it():
    b = Bench(d_tp=2)
    b.register(rank=0)
    b.register(rank=1)
    b.d[1].send("P", Goodbye(engine_id="D", tp_rank=1))
    b.p.step()
    assert b.p.thread.peer("D1") is None and b.p.count("peers_dead") == 0
    b.prefill()
    assert [w.peer for w in b.writes()] == ["D0"]
    assert b.released == ["req-1"] and b.idle()


# -- handshakes and hostile registrations --------------------------------------------------------


def test_accept_hello_welcomes_a_compatible_decoder():
    b = Bench(connect=False, p_tp=2)
    welcome = b.producer.accept_hello(b.hello(0))
    assert (welcome.engine_id, welcome.agent_name, welcome.agent_metadata) == ("P", "P", b"meta:P")
    assert welcome.geometry == p_geom(2) and welcome.compat_hash == COMPAT_HASH
    assert welcome.side_channel_ports == (5600, 5601)
    peer = b.p.thread.peer("D0")
    assert (peer.engine_id, peer.tp_rank, peer.geometry_digest) == (
        "D", 0, geometry_digest(d_geom()))
    assert "D0" in b.p.transport.peers and b.p.count("handshakes") == 1
    # the same decoder again: fine; with another geometry: refused
    b.producer.accept_hello(b.hello(0))
    with pytest.raises(MessageRejected) as e:
        b.producer.accept_hello(b.hello(0, geometry=d_geom(num_blocks=9)))
    assert e.value.reason == "layout_changed"


@pytest.mark.parametrize("change,reason", [
    (dict(compat_hash="0" * 16), "incompatible"),
    (dict(geometry=d_geom(head_size=16)), "bad_layout"),
    (dict(geometry=d_geom(dtype="float16")), "bad_layout"),
])
def test_accept_hello_refuses_an_incompatible_decoder(change, reason):
    b = Bench(connect=False)
    with pytest.raises(MessageRejected) as e:
        b.producer.accept_hello(b.hello(0, **change))
    assert e.value.reason == reason
    assert b.p.thread.peer("D0") is None and b.p.transport.peers == set()
    assert b.p.count("handshakes") == 0


@pytest.mark.parametrize("kw,reason", [
    (dict(engine_id="E"), "spoofed"),
    (dict(tp_rank=1), "spoofed"),
    (dict(geometry_digest="0" * 16), "bad_layout"),
])
def test_a_registration_that_does_not_match_its_sender_is_rejected(kw, reason):
    b = Bench()
    b.register(**kw)
    assert b.p.count("rejected", label=reason) == 1
    got = b.got()
    if reason == "bad_layout":  # the decoder learns it must reconnect
        assert [m.reason for m in got] == ["layout changed since handshake; reconnect"]
    else:
        assert got == []
    b.prefill()
    assert b.writes() == [] and b.released == []  # nothing registered: waits for the TTL


def test_a_cancel_from_another_engine_is_rejected():
    b = Bench()
    b.register()
    b.cancel(engine_id="E")
    assert b.p.count("rejected", label="spoofed") == 1 and b.got() == []
    b.prefill()
    assert b.got() == [done()]


def test_a_transfer_id_claimed_by_two_decoder_engines_is_a_conflict():
    b = Bench()
    b.register()
    other = RawEnd(b.wire, "E0")
    other.transport.add_peer(
        b.producer.accept_hello(b.hello(0, engine_id="E", agent_name="E0",
                                        agent_metadata=b"meta:E0")).agent_metadata)
    other.send("P", Register(transfer_id="t1", attempt=0, engine_id="E", tp_rank=0,
                             block_ids=(4, 5), first_token=0, num_tokens=8,
                             geometry_digest=geometry_digest(d_geom())))
    b.p.step()
    assert b.p.count("rejected", label="conflict") == 1
    b.prefill()
    assert [w.peer for w in b.writes()] == ["D0"] and other.received() == []


def test_close_releases_handles_in_flight():
    b = Bench()
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    (w,) = b.writes()
    b.p.thread.close()  # never started: closes roles and transport at once
    assert w.released and b.p.transport.closed
    assert b.producer.live()["jobs"] == 0
