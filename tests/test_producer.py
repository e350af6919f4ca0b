"""Tests for kv_push.common.producer, in-process: no NIXL, no threads.

The producer runs on a ``TransferThread`` that is never started (``fakes.Node``): the test calls
the engine's entry points (``prefill_done``...) directly, as the thread would run them, and steps
the thread to dispatch notifications and tick. Decoder ranks are ``fakes.RawEnd``s driven by hand:
they introduce themselves through ``accept_hello`` (what the side channel calls), send
``Register``/``Cancel`` and read what the producer sent them. Time is a ``FakeClock``.
"""

from __future__ import annotations

import logging

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
from kv_push.common import producer as producer_module
from kv_push.common.connector_worker import PREFILL_ABORTED
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
                 first_token: int = 0, num_tokens: int = 8, reg: str = "d-1", digest: str = "",
                 **kw) -> None:
        fields = dict(transfer_id=tid, reg_id=reg, prompt_digest=digest, attempt=attempt,
                      engine_id="D", tp_rank=rank, block_ids=tuple(blocks),
                      first_token=first_token, num_tokens=num_tokens,
                      geometry_digest=geometry_digest(d_geom(self.d_tp, rank)))
        self.d[rank].send("P", Register(**{**fields, **kw}))
        self.p.step()

    def cancel(self, tid: str = "t1", rank: int = 0, attempt: int = 0, reg: str = "d-1",
               digest: str = "", **kw) -> None:
        fields = dict(transfer_id=tid, reg_id=reg, prompt_digest=digest, attempt=attempt,
                      engine_id="D", tp_rank=rank, reason="abort")
        self.d[rank].send("P", Cancel(**{**fields, **kw}))
        self.p.step()

    def prefill(self, key: str = "req-1", tid: str = "t1", blocks=(0, 1), num_tokens: int = 8,
                digest: str = "", capacity: int = 1):
        """The engine's ``prefill_done``, handed to the thread as ``PushWorker`` does."""
        self.p.thread.submit(lambda: self.producer.prefill_done(
            key, tid, tuple(blocks), num_tokens, prompt_digest=digest, capacity=capacity))
        self.p.step()

    def prefill_failed(self, tid: str = "t1", reason: str = "aborted", digest: str = "",
                       capacity: int = 1, abandoned: str = ""):
        self.p.thread.submit(lambda: self.producer.prefill_failed(
            tid, reason, prompt_digest=digest, capacity=capacity, abandoned=abandoned))
        self.p.step()

    def release(self, *tids: str) -> None:
        """The router's Release, handed to the thread as ``PushWorker`` does."""
        self.p.thread.submit(lambda: self.producer.release(tids or ("t1",)))
        self.p.step()

    def got(self, rank: int = 0) -> list:
        return self.d[rank].received()

    def writes(self):
        return self.p.transport.writes

    def idle(self) -> bool:
        return all(v == 0 for v in self.producer.live().values())


def done(tid="t1", attempt=0, num_bytes=4 * 2 * BLOCK_BYTES, chunk=0, chunks=1, rank=0,
         reg="d-1"):
    return WriteDone(transfer_id=tid, reg_id=reg, attempt=attempt, engine_id="P", tp_rank=rank,
                     num_bytes=num_bytes, chunk=chunk, chunks=chunks)


def ack(tid="t1", attempt=0, chunks_done=0, reg="d-1"):
    return CancelAck(transfer_id=tid, reg_id=reg, attempt=attempt, engine_id="P", tp_rank=0,
                     chunks_done=chunks_done)


def fail(reason, tid="t1", attempt=0, chunks_done=0, reg="d-1", abandoned=""):
    return TransferFailed(transfer_id=tid, reg_id=reg, attempt=attempt, engine_id="P",
                          tp_rank=0, reason=reason, chunks_done=chunks_done, abandoned=abandoned)


def failed(b: Bench, rank: int = 0) -> list[TransferFailed]:
    return [m for m in b.got(rank) if isinstance(m, TransferFailed)]


# -- the rendezvous, in both orders --------------------------------------------------------------


@pytest.mark.parametrize("order", ["registration_first", "prefill_first"])
def test_rendezvous_in_either_order_writes_once_and_releases(order):
    b = Bench()
    assert not b.producer.holding()  # nothing a peer's message could be awaited for
    if order == "registration_first":
        b.register()
        assert b.writes() == [] and b.got() == []
        assert b.p.count("registrations_early") == 1
        assert b.producer.holding()  # the registration waits for its prefill
        assert not b.producer.expecting()  # ... whose hand-off wakes the thread
        b.prefill()
    else:
        b.prefill()
        assert b.writes() == [] and b.released == [] and b.producer.live()["sources"] == 1
        assert b.producer.holding()  # the prefill waits for its registration
        assert b.producer.expecting()  # ... which would start the WRITE at once
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
    assert b.idle() and b.producer.tombstones == {("D", "d-1"): 0.0}
    assert not b.producer.holding()  # tombstones are not waited on
    assert not b.producer.expecting()


@pytest.mark.parametrize("limit,chunks", [(dict(max_post_regions=1), 4),
                                          (dict(max_post_bytes=2 * BLOCK_BYTES), 4)])
def test_a_large_write_goes_out_in_chunks_each_with_its_notice(limit, chunks):
    b = Bench(**limit)
    b.register()
    b.prefill()
    # one chunk per loop step, from the step in which the pair meets (at its tick): the thread
    # keeps serving other peers between chunks
    posted = len(b.writes())
    assert posted == 1
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


# -- one transfer id, several engine requests (issue 9 item 1) ------------------------------------


def test_a_prompt_list_pairs_each_decoder_request_with_its_own_prompts_prefill():
    # vLLM splits a list of two prompts into two engine requests on P and on D, all with the
    # same transfer id; the prompt digest and the registration id keep them apart
    b = Bench()
    b.prefill("p-a", blocks=(0, 1), digest="A")
    b.prefill("p-b", blocks=(4, 5), digest="B")
    b.register(reg="d-b", digest="B", blocks=(6, 7))
    b.register(reg="d-a", digest="A", blocks=(2, 3))
    w_b, w_a = b.writes()
    pg, dg = p_geom(), d_geom()
    assert w_b.src[0, 0] == pg.k_bases[0] + 4 * pg.block_stride  # B's prompt...
    assert w_b.dst[0, 0] == dg.k_bases[0] + 6 * dg.block_stride  # ...into B's blocks
    assert w_a.src[0, 0] == pg.k_bases[0] and w_a.dst[0, 0] == dg.k_bases[0] + 2 * dg.block_stride
    assert b.got() == [done(reg="d-b"), done(reg="d-a")]
    assert sorted(b.released) == ["p-a", "p-b"] and b.idle()


def test_identical_prompts_form_a_pool_each_prefill_serves_one_decoder_request():
    # n=2 sent to both legs (or a list repeating one prompt): two prefills of one prompt, two
    # decoder requests; each decoder request gets one prefill, never both the same blocks
    b = Bench()
    b.register(reg="d-1", blocks=(2, 3))
    b.prefill("p-1", blocks=(0, 1))
    b.register(reg="d-2", blocks=(4, 5))  # no spare capacity: waits for the next prefill
    assert len(b.writes()) == 1 and b.released == ["p-1"]
    b.prefill("p-2", blocks=(6, 7))
    w1, w2 = b.writes()
    dg, pg = d_geom(), p_geom()
    assert (w1.src[0, 0], w1.dst[0, 0]) == (pg.k_bases[0], dg.k_bases[0] + 2 * dg.block_stride)
    assert (w2.src[0, 0], w2.dst[0, 0]) == (pg.k_bases[0] + 6 * pg.block_stride,
                                            dg.k_bases[0] + 4 * dg.block_stride)
    assert b.got() == [done(reg="d-1"), done(reg="d-2")]
    assert b.released == ["p-1", "p-2"] and b.idle()


def test_a_prefill_with_fanout_serves_that_many_decoder_requests_then_goes():
    b = Bench()
    b.prefill("p-1", capacity=2)
    b.register(reg="d-1", blocks=(2, 3))
    assert b.released == []  # one more decoder request may come for it
    b.register(reg="d-2", blocks=(4, 5))
    assert [w.dst[0, 0] for w in b.writes()] == [d_geom().k_bases[0] + k * d_geom().block_stride
                                                 for k in (2, 4)]
    assert b.got() == [done(reg="d-1"), done(reg="d-2")]
    assert b.released == ["p-1"] and b.idle()
    b.register(reg="d-3", blocks=(6, 7))  # a third: no source left for it; it waits
    assert b.writes()[2:] == [] and b.producer.live()["claims"] == 1


def test_a_decoder_request_keeps_its_prefill_across_ranks_and_attempts():
    b = Bench(d_tp=2)  # both D ranks of one request must read the same prefill
    b.prefill("p-1", blocks=(0, 1))
    b.prefill("p-2", blocks=(4, 5))
    b.register(reg="d-1", rank=0)
    b.register(reg="d-2", rank=0)
    b.register(reg="d-2", rank=1)
    b.register(reg="d-1", rank=1)
    pg = p_geom()
    by_peer = [(w.peer, (w.src[0, 0] - pg.k_bases[0]) // pg.block_stride) for w in b.writes()]
    assert by_peer == [("D0", 0), ("D0", 4), ("D1", 4), ("D1", 0)]
    assert sorted(b.released) == ["p-1", "p-2"] and b.idle()


# -- cancel --------------------------------------------------------------------------------------


def test_cancel_before_the_prefill_is_acked_at_once_and_nothing_is_written():
    b = Bench()
    b.register()
    b.cancel()
    assert b.got() == [ack(attempt=0)]
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
    assert b.got() == [done(), ack(chunks_done=1)]  # D waits for that one notice too
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
    assert got[-1] == ack(chunks_done=len(posted))
    assert [m.chunk for m in got[:-1]] == list(range(len(posted)))  # what was posted landed
    assert b.p.count("transfers_done") == 0  # a cut-short write is not a transfer done
    assert all(w.released_state == "DONE" for w in posted)
    assert b.released == ["req-1"] and b.idle()


def test_cancel_of_an_older_attempt_is_acked_but_keeps_the_newer_registration():
    b = Bench()
    b.register(attempt=1)
    b.cancel(attempt=0)
    assert b.got() == [ack(attempt=0)]
    b.prefill()
    assert b.got() == [done(attempt=1)]
    assert b.released == ["req-1"] and b.idle()


def test_a_cancel_is_answered_every_time_it_comes_with_the_same_count():
    b = Bench()
    b.register()
    b.prefill()
    assert b.got() == [done()]
    b.cancel()  # the decoder had given up before the notice arrived, and re-sends
    b.cancel()
    assert b.got() == [ack(chunks_done=1), ack(chunks_done=1)]
    assert b.p.count("cancels") == 2 and b.idle()


def test_a_registration_that_arrives_after_its_cancel_is_never_written():
    # notifications may be reordered (or the registration lost): the cancel comes first, is
    # answered at once -- and the decoder frees the blocks -- so the registration must be dead
    b = Bench()
    b.cancel()
    assert b.got() == [ack()]
    b.register()
    assert b.p.count("rejected", label="stale") == 1
    b.prefill()
    assert b.writes() == [] and b.got() == []
    assert b.released == ["req-1"] and b.idle()  # the cancel took the request's share


def test_a_new_attempt_stops_posting_the_old_attempts_chunks():
    b = Bench(max_post_regions=1)
    b.p.transport.hold_writes = True
    b.register(attempt=0, blocks=(2, 3))
    b.prefill()
    old = list(b.writes())
    b.register(attempt=1, blocks=(4, 5))
    new = b.writes()[len(old):]
    b.p.step(5)
    assert all(w.dst[0, 0] >= d_geom().k_bases[0] + 4 * d_geom().block_stride
               for w in b.writes()[len(old) + len(new):])  # only attempt 1 is posted now
    b.cancel(attempt=0)  # the decoder fences the old blocks
    for w in b.p.transport.in_flight():
        b.p.transport.finish(w)
    b.p.step(10)
    for w in b.p.transport.in_flight():
        b.p.transport.finish(w)
        b.p.step()
    got = b.got()
    assert ack(attempt=0, chunks_done=len(old)) in got
    new_chunks = sorted(m.chunk for m in got if isinstance(m, WriteDone) and m.attempt == 1)
    assert new_chunks == [0, 1, 2, 3]
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
    assert b.got() == [fail(attempt=0, reason="no route to D0")]
    assert b.p.count("transfers_failed") == 1 and b.p.count("transfers_done") == 0
    assert b.writes()[0].released
    assert b.released == ["req-1"] and b.idle()


def test_a_write_whose_post_raises_is_reported_as_failed():
    # issue 9 item 3: the chunk was popped, the post raised, and the next poll saw nothing
    # pending and counted the transfer as done
    b = Bench(max_post_regions=1)
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()  # chunk 0 posted
    b.p.step()  # chunk 1 posted (both in flight)
    b.p.transport.raise_on_write = RuntimeError("bindings blew up")
    b.p.step(3)  # chunk 2 raises: no more chunks, and no answer while 0 and 1 are in flight
    assert len(b.writes()) == 2 and b.got() == [] and b.released == []
    for w in b.writes():
        b.p.transport.finish(w)
    b.p.step()
    assert b.p.count("transfers_done") == 0
    part = dict(chunks=4, num_bytes=BLOCK_BYTES * 2)
    assert b.got() == [done(chunk=0, **part), done(chunk=1, **part),
                       fail("posting the WRITE raised RuntimeError: bindings blew up",
                            chunks_done=2)]
    assert b.released == ["req-1"] and b.idle()


def test_a_write_whose_first_post_raises_fails_at_once():
    b = Bench()
    b.p.transport.raise_on_write = RuntimeError("bindings blew up")
    b.register()
    b.prefill()
    assert b.got() == [fail("posting the WRITE raised RuntimeError: bindings blew up")]
    assert b.p.count("transfers_done") == 0 and b.released == ["req-1"] and b.idle()


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
    b.prefill_failed()
    assert b.got() == [fail(attempt=0, reason="prefill failed: aborted")]
    assert b.idle() and ("D", "d-1") in b.producer.tombstones
    b.register(attempt=1)  # that request again: told at once
    assert b.got() == [fail(attempt=1, reason="the producer already released this transfer")]


def test_an_aborted_prefill_tells_its_decoders_as_abandoned_not_failed(caplog):
    """vLLM aborted P's request (its client hung up, the router closed P's leg): decoders hear
    at once, as for a failure, but it is counted and logged as abandoned."""
    b = Bench()
    b.register()
    with caplog.at_level(logging.INFO, logger="kv_push"):
        b.prefill_failed(reason=PREFILL_ABORTED, abandoned="prefill_aborted")
    assert b.got() == [fail(reason=PREFILL_ABORTED, abandoned="prefill_aborted")]
    assert b.p.count("transfers_abandoned", label="prefill_aborted") == 1
    assert b.p.count("transfers_failed") == 0 and b.idle()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("not made: " + PREFILL_ABORTED in r.getMessage() for r in caplog.records)
    b.prefill_failed(tid="t2", reason=PREFILL_ABORTED)  # not said abandoned: a failure
    b.register(tid="t2", reg="d-2")
    assert b.got() == [fail(tid="t2", reg="d-2", reason="prefill failed: " + PREFILL_ABORTED)]
    assert b.p.count("transfers_failed") == 1


def test_a_failed_prefill_fails_the_next_registration_of_its_prompt():
    b = Bench()
    b.prefill_failed(digest="A")
    # the failed prefill waits for the registrations it refuses: answered at once, so the
    # thread keeps polling every idle_poll_s (transfer_thread, expecting)
    assert b.producer.expecting()
    b.register(reg="d-b", digest="B")  # another prompt of the list: not affected
    b.register(reg="d-a", digest="A")
    assert b.got() == [fail(reg="d-a", reason="prefill failed: aborted")]
    b.prefill("p-b", digest="B")
    assert b.got() == [done(reg="d-b")] and b.released == ["p-b"] and b.idle()


def test_prefill_failed_never_overtakes_a_write_in_flight():
    # a failed prefill of the same prompt (another engine request of the pool) while a WRITE
    # for that transfer is in flight: the decoder must not be told "failed" (it would free the
    # blocks the WRITE lands in); the served request is not affected at all
    b = Bench()
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    (w,) = b.writes()
    b.prefill_failed()
    b.p.step(3)
    assert b.got() == [] and not w.released
    b.p.transport.finish(w)
    b.p.step()
    assert b.got() == [done()]
    assert b.released == ["req-1"] and b.producer.live()["sources"] == 0


# -- after release: tombstones -------------------------------------------------------------------


def test_a_registration_after_release_is_refused_at_once_until_the_tombstone_expires():
    b = Bench()
    b.register()
    b.prefill()
    assert b.got() == [done()]
    b.register()  # a copy of the registration served: dropped, not refused
    assert b.got() == [] and b.p.count("rejected", label="stale") == 1
    b.register(attempt=1)  # a new attempt of the same request: its prefill is gone
    assert failed(b) == [fail(attempt=1, reason="the producer already released this transfer")]
    assert b.p.count("stale", label="registration_after_release") == 1
    assert b.writes()[1:] == [] and b.idle()
    b.clock.advance(TTL + 1)
    b.p.step()
    assert b.producer.tombstones == {} and b.producer.answered == {}
    b.register(attempt=2)  # forgotten: an ordinary early registration again
    assert b.got() == [] and b.p.count("registrations_early") == 2


# -- the router's release ------------------------------------------------------------------------
# The router sends Release(tid) when an exchange ended without decode output: D's engine may never
# have seen the request, so nobody else would free the prefill before the TTL.

RELEASED = "the router released this transfer (its exchange ended)"


def test_a_release_frees_an_unclaimed_prefill_at_once():
    b = Bench()
    b.prefill()
    b.prefill("req-2", tid="t2")
    assert b.released == []
    b.release("t1")
    assert b.released == ["req-1"]  # at once, not at the TTL; the other transfer stays
    assert b.p.count("released") == 1 and b.p.count("expired") == 0
    assert b.producer.live()["sources"] == 1 and b.writes() == [] and b.got() == []
    b.release("t2", "never-seen")
    assert b.released == ["req-1", "req-2"] and b.idle()
    assert list(b.producer.released_tids) == ["t1", "t2", "never-seen"]


def test_a_release_frees_every_prefill_of_the_transfer():
    b = Bench()
    b.prefill("p-a", digest="A")  # a prompt list: one transfer id, several prompts
    b.prefill("p-b", digest="B")
    b.prefill("p-b2", digest="B")
    b.release()
    assert sorted(b.released) == ["p-a", "p-b", "p-b2"] and b.idle()
    assert b.p.count("released") == 3


def test_a_release_leaves_a_write_in_flight_to_its_decoder():
    b = Bench()
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    (w,) = b.writes()
    b.release()
    b.p.step(3)
    assert b.released == [] and not w.released  # never freed under a WRITE
    assert b.p.count("release_deferred") == 1 and b.p.count("released") == 0
    b.p.transport.finish(w)
    b.p.step()
    assert b.got() == [done()] and b.released == ["req-1"] and b.idle()


def test_a_release_leaves_a_claimed_prefill_until_every_decoder_rank_is_served():
    b = Bench(d_tp=2)  # P TP 1 writes both D ranks
    b.prefill()
    b.register(rank=0)
    assert b.got(0) == [done(num_bytes=4 * BLOCK_BYTES)]
    b.release()
    assert b.released == [] and b.p.count("release_deferred") == 1
    b.register(rank=1)  # the claimed request's other rank still pairs and is written
    assert b.got(1) == [done(num_bytes=4 * BLOCK_BYTES, rank=0)]
    assert b.released == ["req-1"] and b.idle()


def test_a_release_frees_a_fanout_prefill_once_its_claims_are_done():
    b = Bench()
    b.prefill(capacity=2)
    b.register(reg="d-1")
    assert b.got() == [done()] and b.released == []  # one more decoder request could come
    b.release()
    assert b.released == ["req-1"] and b.p.count("released") == 1 and b.idle()


def test_a_registration_after_a_release_fails_at_once_and_is_never_written():
    b = Bench()
    b.prefill()
    b.release()
    b.register()
    assert failed(b) == [fail(RELEASED, abandoned="router_release")]  # at once, not at the TTL
    assert b.writes() == []
    assert b.p.count("stale", label="registration_after_router_release") == 1
    # the exchange ended: no failure of the transfer path
    assert b.p.count("transfers_abandoned", label="router_release") == 1
    assert b.p.count("transfers_failed") == 0
    b.register(rank=0, attempt=0)  # a copy: already answered
    assert b.got() == [] and b.writes() == [] and b.idle()
    b.register(tid="t2", reg="d-2")  # other transfers are not affected
    assert b.got() == [] and b.p.count("registrations_early") == 1


def test_a_release_only_registration_of_a_released_transfer_is_not_a_failure():
    """D's engine ended a request it never asked anything for (vLLM rejected it, a client
    gone while it queued) and tells P to let go -- after the router's release or after P freed
    the prefill: nothing is answered and nothing counts as failed or stale (client errors must
    not move failure counters)."""
    b = Bench()
    b.prefill()
    b.release()
    b.register(blocks=(), num_tokens=0)
    assert b.got() == [] and b.writes() == [] and b.idle()
    assert b.p.count("transfers_failed") == 0 and b.p.count("stale") == 0
    b.prefill(key="req-2", tid="t2")
    b.register(tid="t2", reg="d-2")
    assert b.got() == [done(tid="t2", reg="d-2")]
    b.register(tid="t2", reg="d-2", attempt=1, blocks=(), num_tokens=0)  # after the tombstone
    assert b.got() == [] and b.p.count("transfers_failed") == 0 and b.p.count("stale") == 0
    b.prefill(key="req-3", tid="t3")
    b.register(tid="t3", reg="d-3", blocks=(), num_tokens=0)  # the usual release: quiet too
    assert b.got() == [] and b.released[-1] == "req-3"


def test_a_release_only_registration_waiting_for_a_prefill_goes_with_the_routers_release():
    """D let go of a request whose prefill P's engine never ran (the router aborted P's leg
    first): its release-only registration waits for nothing once the router releases the
    transfer -- it used to wait out the TTL and count as expired."""
    b = Bench()
    b.register(blocks=(), num_tokens=0)
    b.register(tid="t2", reg="d-2")  # a real request of another transfer stays
    assert b.producer.rdv.num_claims == 2
    b.release()
    assert b.producer.rdv.num_claims == 1 and b.got() == []
    b.clock.advance(TTL + 1)
    b.p.step()
    assert b.p.count("expired") == 1  # only the other transfer's registration


def test_a_registration_after_a_release_of_a_prefill_still_running_fails_at_once():
    """The Release may overtake the prefill (P's engine reports it a step later): the
    registration is failed at once, and the prefill is freed as soon as it is reported."""
    b = Bench()
    b.release()
    b.register()
    assert failed(b) == [fail(RELEASED, abandoned="router_release")]
    b.prefill()
    assert b.released == ["req-1"] and b.writes() == [] and b.idle()
    assert b.p.count("released") == 1


def test_a_prefill_after_a_release_still_serves_a_decoder_that_registered_before():
    b = Bench()
    b.register()  # D registered first: its claim waits for the prefill
    b.release()
    b.prefill()
    assert b.got() == [done()] and b.released == ["req-1"] and b.idle()
    assert b.p.count("release_deferred") == 1


def test_a_failed_prefill_after_a_release_leaves_nothing():
    b = Bench()
    b.release()
    b.prefill_failed()
    assert b.idle() and b.got() == []


def test_a_cancel_after_a_release_is_acked_and_holds_nothing():
    b = Bench()
    b.prefill()
    b.release()
    b.cancel()  # D's engine saw the request after all, and aborted it before registering
    assert b.got() == [ack()]
    assert b.idle() and b.producer.rdv.num_claims == 0
    b.register()  # its registration, overtaken by the cancel
    assert b.got() == [] and b.writes() == [] and b.idle()


@pytest.mark.parametrize("order", ["cancel_then_release", "release_then_cancel"])
def test_a_cancelled_registration_waiting_for_a_prefill_goes_with_the_release(order):
    """P's engine refused the request (P's HTTP 400: a prompt over P's max_model_len but not
    D's), so no prefill ever comes; D registered, then cancelled when the router closed its leg,
    and the router released the transfer. Whatever the order of the cancel and the release, the
    claim waits for nothing: it goes at once (a walkthrough saw it wait out the TTL, then log
    "found no prefill in time" and count as expired), and a prefill that comes after all is
    freed unwritten."""
    b = Bench()
    b.register()
    b.register(tid="t2", reg="d-2")  # another transfer's request: it stays
    if order == "cancel_then_release":
        b.cancel()
        assert b.producer.rdv.num_claims == 2  # (before the release a prefill may still come)
        b.release()
    else:
        b.release()
        assert b.producer.rdv.num_claims == 2  # its registration still asks for the KV
        b.cancel()
    assert b.got() == [ack()]
    assert b.producer.rdv.num_claims == 1
    b.prefill()  # (P's engine ran it after all)
    assert b.released == ["req-1"] and b.writes() == [] and b.got() == []
    assert b.p.count("transfers_failed") == 0
    b.clock.advance(TTL + 1)
    b.p.step()
    assert b.p.count("expired") == 1  # the other transfer's registration only


def test_a_release_keeps_a_claim_whose_other_rank_still_asks():
    """A two-rank decoder request of which one rank cancelled and the other still waits for the
    prefill is kept by the release (the prefill may still come and be written to that rank)."""
    b = Bench(d_tp=2)
    b.register(rank=0)
    b.register(rank=1)
    b.cancel(rank=0)
    b.release()
    assert b.producer.rdv.num_claims == 1
    b.prefill()
    assert [type(m).__name__ for m in b.got(rank=1)] == ["WriteDone"] and b.writes() != []


def test_a_release_keeps_a_claim_with_a_rank_not_heard_from_until_it_cancels():
    """Two decoder ranks: rank 0 registered and cancelled, rank 1 not heard from yet when the
    router releases. The claim stays (rank 1's registration pairs as any later rank does, it is
    not failed); when rank 1 cancels too the claim goes, and nothing expires at the TTL."""
    b = Bench(d_tp=2)
    b.register(rank=0)
    b.cancel(rank=0)
    b.release()
    assert b.producer.rdv.num_claims == 1
    b.register(rank=1)
    assert failed(b, rank=1) == [] and b.p.count("transfers_failed") == 0
    b.cancel(rank=1)
    assert b.got(rank=1) == [ack()] and b.producer.rdv.num_claims == 0
    b.clock.advance(TTL + 1)
    b.p.step()
    assert b.p.count("expired") == 0 and b.idle()


def test_a_release_drops_a_claim_made_by_a_cancel_alone():
    """D cancelled a request whose registration P never saw (lost or late): the claim the
    cancel made asks for nothing and goes with the release; its registration, if it comes
    after all, is stale (already answered) and never written."""
    b = Bench()
    b.cancel()
    assert b.got() == [ack()] and b.producer.rdv.num_claims == 1
    b.release()
    assert b.producer.rdv.num_claims == 0
    b.register()
    b.prefill()
    assert b.writes() == [] and b.released == ["req-1"]


def test_a_fanout_prefill_serves_its_other_sample_when_one_is_cancelled_and_released():
    """n=2 from one prefill (capacity 2): one sample's request cancelled, the router released
    the transfer (its exchange ended without that sample); the other sample, registered, is
    still written and the prefill freed after it."""
    b = Bench()
    b.register(reg="d-1")
    b.register(reg="d-2")
    b.cancel(reg="d-1")
    b.release()
    b.prefill(capacity=2)
    kinds = [type(m).__name__ for m in b.got()]
    assert kinds.count("WriteDone") == 1 and b.released == ["req-1"] and b.idle()


def test_released_transfer_ids_are_bounded_and_expire(monkeypatch):
    monkeypatch.setattr(producer_module, "MAX_RELEASED_TIDS", 3)
    b = Bench()
    b.release("a", "b", "c", "d")
    assert list(b.producer.released_tids) == ["b", "c", "d"]  # the oldest went first
    b.clock.advance(TTL / 2)
    b.release("b")  # released again: remembered from now
    b.clock.advance(TTL / 2 + 1)
    b.p.step()
    assert list(b.producer.released_tids) == ["b"]
    b.clock.advance(TTL)
    b.p.step()
    assert not b.producer.released_tids
    b.register(tid="d")  # forgotten: an ordinary early registration (it fails at the TTL)
    assert b.got() == [] and b.p.count("registrations_early") == 1


def test_transfer_ids_forgotten_before_their_ttl_are_counted_and_said(monkeypatch, caplog):
    """More releases within rendezvous_ttl_s than the record holds: the oldest are dropped
    early -- a late prefill of such a transfer is then held until its TTL. That was silent."""
    monkeypatch.setattr(producer_module, "MAX_RELEASED_TIDS", 3)
    b = Bench()
    with caplog.at_level(logging.WARNING):
        b.release("a", "b", "c", "d", "e")
    assert b.p.count("forgotten", label="released_tids") == 2
    said = [r.getMessage() for r in caplog.records if "forgotten early" in r.getMessage()]
    assert len(said) == 1 and "released_tids" in said[0], said  # once a minute, not per drop


def test_the_producers_records_are_swept_oldest_first_and_kept_while_renewed():
    """answered and tombstones are swept from the oldest entry up to the first one still within
    rendezvous_ttl_s (not scanned whole every second); an entry renewed meanwhile moves to the
    end and stays."""
    b = Bench()
    b.register(reg="d-1")
    b.prefill(key="req-1")
    b.register(reg="d-2", tid="t2")
    b.prefill(key="req-2", tid="t2")
    assert [k[0][1] for k in b.producer.answered] == ["d-1", "d-2"]
    b.clock.advance(TTL / 2)
    b.register(reg="d-1", attempt=1)  # d-1 answered again (its prefill is gone): renewed
    assert [k[0][1] for k in b.producer.answered] == ["d-2", "d-1"]
    b.clock.advance(TTL / 2 + 1)
    b.p.step()
    assert [k[0][1] for k in b.producer.answered] == ["d-1"]
    assert list(b.producer.tombstones) == []  # both older than the TTL
    b.clock.advance(TTL)
    b.p.step()
    assert not b.producer.answered


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
    assert b.got() == [fail(attempt=0, reason="no prefill arrived in time")]
    assert b.p.count("expired") == 1 and b.idle()


def test_a_registration_after_its_prefill_expired_fails_at_once():
    """A walkthrough's case: D queued the request longer than the TTL, P dropped the prefill,
    and D's registration then waited a second TTL for it before failing. Now it is told at
    once, and never written; a prefill of the same key that comes later still pairs."""
    b = Bench()
    b.prefill()
    b.clock.advance(TTL + 1)
    b.p.step()
    assert b.released == ["req-1"] and b.p.count("expired") == 1
    b.register()
    (msg,) = failed(b)
    assert "expired" in msg.reason and b.writes() == []
    assert b.p.count("stale", label="registration_after_expiry") == 1 and b.idle()
    b.register(tid="t2", reg="d-2")  # other transfers are not affected
    assert b.got() == [] and b.p.count("registrations_early") == 1
    # a decoder request that only lets go (release-only) is no failure: dropped quietly
    b.register(reg="d-4", blocks=(), num_tokens=0)
    assert b.got() == [] and b.p.count("stale", label="registration_after_expiry") == 1
    # a prefill of the expired key that comes later (preempted and run again) takes a request
    b.prefill(key="req-2")
    b.register(reg="d-3")
    assert b.got() == [done(reg="d-3")]
    # forgotten after a TTL: a late registration waits for a prefill as any early one does
    b.clock.advance(TTL + 1)
    b.p.step()
    assert not b.producer.expired_keys


def test_a_decoder_rank_that_never_registers_does_not_hold_the_source_forever():
    # issue 9 item 7: a paired entry never expired
    b = Bench(d_tp=2)
    b.prefill()
    b.register(rank=0)  # rank 1 never does
    b.clock.advance(TTL - 1)
    b.p.step()
    assert b.released == []
    b.clock.advance(2)
    b.p.step()
    assert b.released == ["req-1"] and b.p.count("expired") == 1 and b.idle()
    b.register(rank=1)  # too late: told at once
    assert failed(b, 1) == [TransferFailed(transfer_id="t1", reg_id="d-1", attempt=0,
                                           engine_id="P", tp_rank=0, chunks_done=0,
                                           reason="the producer already released this transfer")]


# -- peers ---------------------------------------------------------------------------------------


def test_decoder_death_with_a_write_in_flight_lets_the_source_go_but_keeps_the_handle():
    b = Bench()
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    (w,) = b.writes()
    b.p.thread.peer_lost("D0", "decoder closed its side channel")  # the lifeline: proven death
    assert b.released == []
    b.p.step()
    assert b.p.thread.peer("D0") is None and b.p.transport.removed == ["D0"]
    assert b.released == ["req-1"] and b.idle()  # nothing alive reads what lands there
    assert not w.released  # but NIXL refuses to release a handle in flight (it would leak)
    b.p.transport.finish(w)
    b.p.step()
    assert w.released and w.released_state == "DONE" and b.producer.orphans == []


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


def test_a_silent_decoder_gets_no_more_chunks_and_its_source_waits_for_the_write():
    # issue 9 item 5: silence is not proof of death; a frozen decoder's WRITE may still be read
    b = Bench(max_post_regions=1, heartbeat_interval_s=10.0)
    b.p.transport.hold_writes = True
    b.register()
    b.register(tid="t2", reg="d-2", blocks=(6, 7))  # waits for its prefill
    b.prefill()
    b.clock.advance(16)  # D silent for > 1.5 intervals
    b.p.step()
    assert b.p.count("peers_silent") == 1 and b.p.thread.peer("D0") is not None
    posted = list(b.writes())
    assert len(posted) < 4
    assert failed(b) == [fail("decoder unresponsive", tid="t2", reg="d-2")]
    b.p.step(5)
    assert b.writes() == posted  # nothing more is posted to it
    assert b.released == []  # a WRITE in flight still reads the prefill
    for w in posted:
        b.p.transport.finish(w)
    b.p.step()
    assert failed(b) == [fail("decoder unresponsive", chunks_done=len(posted))]
    assert b.released == ["req-1"] and b.producer.live()["sources"] == 0
    # t2's request stays accounted for (its prefill may still come and must then be freed)
    assert b.producer.live()["claims"] == 1
    b.prefill("req-2", tid="t2")
    assert b.writes() == posted and b.released == ["req-1", "req-2"] and b.idle()


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
    other.send("P", Register(transfer_id="t1", reg_id="e-1", prompt_digest="", attempt=0,
                             engine_id="E", tp_rank=0, block_ids=(4, 5), first_token=0,
                             num_tokens=8,
                             geometry_digest=geometry_digest(d_geom())))
    b.p.step()
    assert b.p.count("rejected", label="conflict") == 1
    b.prefill()
    assert [w.peer for w in b.writes()] == ["D0"] and other.received() == []


def test_close_releases_finished_handles_and_leaves_those_in_flight_to_the_transport():
    b = Bench(max_post_regions=1)
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    b.p.step()
    first, second = b.writes()
    b.p.transport.finish(first)
    b.p.thread.close()  # never started: closes roles and transport at once
    assert first.released and not second.released  # NIXL refuses to release one in flight
    assert b.p.transport.closed and b.producer.live()["jobs"] == 0


def test_close_lets_writes_in_flight_finish_before_the_goodbye():
    """A goodbye is proof of death to the decoder (it frees the blocks at once): it must come
    after the chunks' completions, never while one may still land."""
    b = Bench(max_post_regions=1)
    b.register()
    b.prefill()  # two chunks, one posted per step: the second still waits
    b.p.thread.close(timeout=10)  # never started: drains, then closes at once
    *dones, bye = b.got()
    assert isinstance(bye, Goodbye) and len(dones) > 1
    assert [(m.chunk, m.chunks) for m in dones] == [(i, len(dones)) for i in range(len(dones))]
    assert b.p.transport.closed and b.producer.live()["jobs"] == 0


def test_close_sends_no_goodbye_to_a_decoder_whose_write_is_still_in_flight(caplog):
    b = Bench(max_post_regions=1)
    b.p.transport.hold_writes = True
    b.register()
    b.prefill()
    b.p.thread.close(timeout=0.2)  # the drain ends with the WRITE still in flight
    assert not any(isinstance(m, Goodbye) for m in b.got())
    assert "still in flight: no goodbye" in caplog.text
    assert b.p.transport.closed


def test_a_decoder_layout_that_fragments_every_write_is_told_once_at_the_handshake(
        caplog, monkeypatch):
    """NHD on P, HND on D, no staging: every (token, head) vector is a descriptor of its own.
    The operator hears it at the first handshake, once per decoder layout, not per request."""
    import kv_push.common.producer as producer_module

    # this geometry's blocks hold 4 tokens of 2 heads: NHD against HND is 8x (16 x 8 in Qwen3)
    monkeypatch.setattr(producer_module, "FRAGMENTED", 8.0)
    b = Bench(connect=False)
    b.hello = lambda rank, **kw: Hello(  # type: ignore[method-assign]
        engine_id="D", agent_name=f"D{rank}", agent_metadata=f"meta:D{rank}".encode(),
        geometry=d_geom(1, rank, token_order="HND"), compat_hash=COMPAT_HASH)
    b.connect(0)
    b.connect(0)  # the same rank again (a reconnect): not told twice
    warned = [r for r in caplog.records if "WRITE descriptors" in r.getMessage()]
    assert len(warned) == 1 and "HND" in warned[0].getMessage()
    caplog.clear()
    Bench()  # equal layouts: nothing to say
    assert not [r for r in caplog.records if "WRITE descriptors" in r.getMessage()]
