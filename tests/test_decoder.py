"""Tests for kv_push.common.decoder, in-process: no NIXL, no threads.

The decoder runs on a ``TransferThread`` that is never started (``fakes.Node``): the test hands it
``expect``/``cancel`` through ``submit`` (as ``PushWorker`` does) and steps the thread. Its
handshakes run on an ``InlineExecutor`` (at once) or a ``ManualExecutor`` (when the test says),
through a handshake function that stands in for the side channel. Producer ranks are
``fakes.RawEnd``s driven by hand; the last section puts a real ``Producer`` on the other side.
"""

from __future__ import annotations

import logging

import threading

import pytest

from kv_push.common import geometry as G
from kv_push.common.decoder import Decoder, Outcome
from kv_push.common.messages import (
    COMPAT_HASH,
    MAX_ID_CHARS,
    Cancel,
    CancelAck,
    Goodbye,
    MessageRejected,
    Register,
    TransferFailed,
    Welcome,
    WriteDone,
    geometry_digest,
    wire_id,
)
from kv_push.common.producer import Producer
from kv_push.common.side_channel import HandshakeError, HandshakeRefused

from fakes import FakeClock, InlineExecutor, ManualExecutor, Node, RawEnd, Wire, role_config, settle

SHAPE = dict(num_layers=2, num_kv_heads=2, head_size=8, dtype_bytes=2, dtype="bfloat16",
             block_size=4, num_blocks=8)
P_BASE, D_BASE = 1 << 32, 1 << 36
HOST, PORT = "10.0.0.7", 7000  # producer rank r listens on PORT + r
TIMEOUT = 60.0


def p_geom(tp: int = 1, rank: int = 0, **kw) -> G.KVGeometry:
    return G.pooled(base=P_BASE + (rank << 24), placement="kv_split", tp_size=tp, tp_rank=rank,
                    **{**SHAPE, **kw})


def d_geom(tp: int = 1, rank: int = 0, **kw) -> G.KVGeometry:
    return G.pooled(base=D_BASE, placement="kv_split", tp_size=tp, tp_rank=rank, **{**SHAPE, **kw})


class Bench:
    """One decoder worker (D rank ``d_rank`` of ``d_tp``, agent "D") and the ranks of one
    producer engine "P" (TP ``p_tp``), hand-driven ``RawEnd``s named P<rank>."""

    def __init__(self, *, p_tp: int = 1, d_tp: int = 1, d_rank: int = 0, manual: bool = False,
                 **config):
        self.wire, self.clock = Wire(), FakeClock()
        self.d = Node(self.wire, self.clock, "D", d_geom(d_tp, d_rank),
                      role_config(transfer_timeout_s=TIMEOUT, **config))
        self.executor = ManualExecutor() if manual else InlineExecutor()
        self.decoder = Decoder(self.d.thread, handshake_fn=self.handshake, executor=self.executor)
        self.d.thread.add_role(self.decoder)
        self.p_tp, self.d_tp, self.d_rank = p_tp, d_tp, d_rank
        self.p = {r: RawEnd(self.wire, f"P{r}") for r in range(p_tp)}
        self.refuse: dict[int, str | Exception] = {}  # port -> why its handshake fails
        self.welcome_changes: dict[int, dict] = {}  # rank -> Welcome fields to change
        self.handshakes: list[tuple[str, int]] = []
        self.hellos: list = []
        self.lifelines: dict[str, object] = {}  # producer agent -> "its side channel closed"
        self.broken: dict[str, object] = {}  # producer agent -> "it broke without proof"
        self.severed: list[str] = []  # producer agents whose lifeline the decoder closed
        self.close_at_once = False
        self.d.step()

    # the side channel, in-process
    def handshake(self, host, port, hello, codec, timeout, on_closed=None,
                  on_open=None, on_unproven=None) -> Welcome:
        assert codec is self.d.thread.codec and timeout == self.d.thread.config.handshake_timeout_s
        self.handshakes.append((host, port))
        self.hellos.append(hello)
        if port in self.refuse:  # a reason, or the very error the side channel raises
            why = self.refuse[port]
            raise why if isinstance(why, Exception) else HandshakeError(why)
        rank = port - PORT
        end = self.p[rank]
        end.transport.add_peer(hello.agent_metadata)  # what accept_hello does on P
        fields = dict(engine_id="P", agent_name=end.name, agent_metadata=end.transport.metadata(),
                      geometry=p_geom(self.p_tp, rank), compat_hash=COMPAT_HASH,
                      side_channel_ports=tuple(PORT + r for r in range(self.p_tp)))
        welcome = Welcome(**{**fields, **self.welcome_changes.get(rank, {})})
        if on_closed is not None:
            self.lifelines[end.name] = lambda: on_closed(welcome)
        if on_unproven is not None:
            self.broken[end.name] = lambda why="Connection timed out": on_unproven(welcome, why)
        if on_open is not None:
            on_open(lambda: self.severed.append(end.name))
        if self.close_at_once:  # the lifeline closes right after the reply went out
            on_closed(welcome)
        return welcome

    # the engine
    def expect(self, key: str = "req-1", tid: str = "t1", attempt: int = 0, blocks=(2, 3),
               first_token: int = 0, num_tokens: int = 8, digest: str = "") -> None:
        self.d.thread.submit(lambda: self.decoder.expect(
            key, tid, attempt, (HOST, PORT), tuple(blocks), first_token, num_tokens,
            prompt_digest=digest))
        self.d.step()

    def cancel(self, key: str = "req-1") -> None:
        self.d.thread.submit(lambda: self.decoder.cancel(key))
        self.d.step()

    def outcomes(self) -> list[Outcome]:
        out = []
        while not self.decoder.outcomes.empty():
            out.append(self.decoder.outcomes.get_nowait())
        return out

    def verdicts(self) -> list[Outcome]:
        out = []
        while not self.decoder.verdicts.empty():
            out.append(self.decoder.verdicts.get_nowait())
        return out

    # the producer ranks
    def got(self, rank: int = 0) -> list:
        return self.p[rank].received()

    def send(self, rank: int, msg) -> None:
        self.p[rank].send("D", msg)
        self.d.step()

    def write_done(self, rank: int = 0, tid: str = "t1", attempt: int = 0, chunk: int = 0,
                   chunks: int = 1, reg: str = "req-1", **kw) -> None:
        fields = dict(transfer_id=tid, reg_id=reg, attempt=attempt, engine_id="P", tp_rank=rank,
                      num_bytes=64, chunk=chunk, chunks=chunks)
        self.send(rank, WriteDone(**{**fields, **kw}))

    def ack(self, rank: int = 0, tid: str = "t1", attempt: int = 0, reg: str = "req-1",
            chunks_done: int = 0) -> None:
        self.send(rank, CancelAck(transfer_id=tid, reg_id=reg, attempt=attempt, engine_id="P",
                                  tp_rank=rank, chunks_done=chunks_done))

    def failed(self, rank: int = 0, tid: str = "t1", attempt: int = 0, reg: str = "req-1",
               reason: str = "boom", chunks_done: int = 0, abandoned: str = "") -> None:
        self.send(rank, TransferFailed(transfer_id=tid, reg_id=reg, attempt=attempt,
                                       engine_id="P", tp_rank=rank, reason=reason,
                                       chunks_done=chunks_done, abandoned=abandoned))

    def registration(self, tid="t1", attempt=0, blocks=(2, 3), first_token=0, num_tokens=8,
                     reg="req-1", digest=""):
        return Register(transfer_id=tid, reg_id=reg, prompt_digest=digest, attempt=attempt,
                        engine_id="D", tp_rank=self.d_rank, block_ids=tuple(blocks),
                        first_token=first_token, num_tokens=num_tokens,
                        geometry_digest=geometry_digest(d_geom(self.d_tp, self.d_rank)))

    def cancel_msg(self, tid="t1", attempt=0, reason="aborted", reg="req-1", digest=""):
        return Cancel(transfer_id=tid, reg_id=reg, prompt_digest=digest, attempt=attempt,
                      engine_id="D", tp_rank=self.d_rank, reason=reason)

    def wants(self) -> int:
        return self.decoder.live()["wants"]


# -- registration and completion -----------------------------------------------------------------


def test_expect_handshakes_registers_and_reports_received():
    b = Bench()
    assert not b.decoder.holding()
    b.expect()
    assert b.decoder.holding()  # the want waits for its WRITE
    assert b.handshakes == [(HOST, PORT)]
    hello = b.hellos[0]
    assert (hello.engine_id, hello.agent_name, hello.agent_metadata, hello.geometry,
            hello.compat_hash) == ("D", "D", b"meta:D", d_geom(), COMPAT_HASH)
    assert b.got() == [b.registration()]
    assert b.d.count("handshakes") == 1 and b.d.count("registrations_sent") == 1
    assert b.outcomes() == []
    b.clock.advance(0.5)
    b.write_done()
    assert b.outcomes() == [Outcome("req-1", "received")]
    assert b.d.count("transfers_done") == 1 and b.d.count("transfer_seconds") == 0.5
    assert b.wants() == 0 and not b.decoder.holding()
    # the next request to the same producer reuses the connection
    b.expect("req-2", "t2", blocks=(4, 5))
    assert len(b.handshakes) == 1
    assert b.got() == [b.registration("t2", blocks=(4, 5), reg="req-2")]


def test_an_engine_request_id_too_long_for_the_wire_registers_under_its_digest():
    """vLLM's engine request id is the client's X-Request-Id plus a prefix and suffixes: from
    about 241 characters of X-Request-Id on it is longer than a registration id may be on the
    wire (P refuses it), so D registers under its digest (``messages.wire_id``) and maps the
    producer's answers back to the engine's key -- such a request keeps its KV transfer (it
    was refused, and D computed the prompt itself). Two long keys sharing their first 256
    characters are still two registrations."""
    b = Bench()
    long_a, long_b = "cmpl-" + "x" * 300 + "-0", "cmpl-" + "x" * 300 + "-1"
    b.expect(long_a, blocks=(2, 3))
    b.expect(long_b, "t2", blocks=(4, 5))
    reg_a, reg_b = wire_id(long_a), wire_id(long_b)
    assert reg_a != reg_b and reg_a.startswith("sha256:") and len(reg_a) <= MAX_ID_CHARS
    assert b.got() == [b.registration(reg=reg_a),
                       b.registration("t2", blocks=(4, 5), reg=reg_b)]
    b.write_done(tid="t2", reg=reg_b)
    b.write_done(reg=reg_a)
    assert b.outcomes() == [Outcome(long_b, "received"), Outcome(long_a, "received")]
    assert b.wants() == 0
    assert wire_id("req-1") == "req-1"  # one that fits is itself


def test_the_engine_is_told_of_an_outcome_or_verdict_as_it_is_put():
    # await_news: what an idle engine step waits on (connector_worker, idle_step_wait_s)
    b = Bench()
    assert b.decoder.await_news(0) is False
    b.expect()
    assert b.decoder.await_news(0) is False  # registered: nothing for the engine yet
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(b.decoder.await_news(30)))
    waiter.start()
    b.write_done()  # the transfer thread puts the outcome: the waiter returns with it
    waiter.join(30)
    assert woke == [True]
    assert b.outcomes() == [Outcome("req-1", "received")]
    assert b.decoder.await_news(0) is False  # each put is news once
    b.expect("req-2", "t2", blocks=(4, 5))
    b.cancel("req-2")
    b.ack(tid="t2", reg="req-2")
    assert b.decoder.await_news(0) is True and [o.key for o in b.outcomes()] == ["req-2"]


def test_nothing_to_transfer_is_received_once_registered():
    b = Bench()
    b.expect(first_token=8, num_tokens=8, blocks=())  # the whole prompt was cached on D
    assert [m.num_tokens - m.first_token for m in b.got()] == [0]
    assert b.outcomes() == [Outcome("req-1", "received")]
    # nothing was transferred: not a transfer done (it skewed transfers_done/transfer_seconds)
    assert b.d.count("transfers_done") == 0 and b.d.count("transfer_seconds") == 0


def test_two_engine_requests_sharing_a_transfer_id_are_told_apart():
    # issue 9 item 1: a prompt list (or n=2) is two engine requests with one transfer id; the
    # decoder keyed wants by transfer id, so request 1's notice completed request 2
    b = Bench()
    b.expect("req-1", blocks=(2, 3), digest="A")
    b.expect("req-2", blocks=(4, 5), digest="B")
    assert b.got() == [b.registration(reg="req-1", digest="A"),
                       b.registration(reg="req-2", digest="B", blocks=(4, 5))]
    b.write_done(reg="req-2")
    assert b.outcomes() == [Outcome("req-2", "received")]
    b.failed(reg="req-1")
    assert b.outcomes() == [Outcome("req-1", "failed", "producer rank 0: boom")]
    assert b.wants() == 0


def test_one_notice_per_writer_rank():
    b = Bench(p_tp=2)  # two producer ranks each hold one of D's two heads
    b.expect()
    assert b.handshakes == [(HOST, PORT), (HOST, PORT + 1)]
    assert b.got(0) == [b.registration()] and b.got(1) == [b.registration()]
    b.write_done(0)
    b.write_done(0)  # again: still only one rank of two
    assert b.outcomes() == []
    b.write_done(1)
    assert b.outcomes() == [Outcome("req-1", "received")]


def test_one_notice_per_chunk():
    b = Bench()
    b.expect()
    for chunk in (0, 2, 2):
        b.write_done(chunk=chunk, chunks=3)
    assert b.outcomes() == []
    b.write_done(chunk=1, chunks=3)
    assert b.outcomes() == [Outcome("req-1", "received")]


@pytest.mark.parametrize("d_rank,told,writers", [(0, [0, 1], [0]), (1, [1], [1])])
def test_rank_zero_registers_with_every_producer_rank_others_with_their_writers(
        d_rank, told, writers):
    b = Bench(p_tp=2, d_tp=2, d_rank=d_rank)  # P rank r writes only D rank r's head
    b.expect()
    assert b.handshakes == [(HOST, PORT), (HOST, PORT + 1)]  # rank 0 first: it names the TP
    assert [r for r in range(2) if b.got(r) == [b.registration()]] == told
    for r in writers:
        b.write_done(r)
    assert b.outcomes() == [Outcome("req-1", "received")]


def test_a_notice_from_a_producer_rank_that_does_not_write_to_us_is_rejected():
    b = Bench(p_tp=2, d_tp=2, d_rank=0)  # told P1 (rank 0 tells all) but only P0 writes here
    b.expect()
    b.write_done(1)
    assert b.d.count("rejected", label="unexpected") == 1
    assert b.outcomes() == []
    b.write_done(0)
    assert b.outcomes() == [Outcome("req-1", "received")]


@pytest.mark.parametrize("sender,claims", [(0, 0), (0, 1)])
def test_a_notice_from_a_producer_we_did_not_tell_is_spoofed(sender, claims):
    b = Bench(p_tp=2, d_tp=2, d_rank=1)  # told only P1; P0 is known from the first handshake
    b.expect()
    b.write_done(sender, tp_rank=claims)
    assert b.d.count("rejected", label="spoofed") == 1
    assert b.outcomes() == []


def test_notices_for_another_attempt_or_transfer_are_stale():
    b = Bench()
    b.expect()
    b.write_done(attempt=1)
    b.write_done(tid="t-unknown")
    b.write_done(reg="req-unknown")
    b.failed(attempt=3)
    assert b.d.count("stale") == 4
    assert b.outcomes() == []
    b.write_done()
    assert b.outcomes() == [Outcome("req-1", "received")]


# -- cancel and fencing --------------------------------------------------------------------------


def test_cancel_fences_until_every_told_producer_acks():
    b = Bench(p_tp=2)
    b.expect()
    b.got(0), b.got(1)  # the registrations
    b.write_done(1)  # rank 1 already wrote: nothing to fence there
    b.cancel()
    assert b.got(0) == [b.cancel_msg()] and b.got(1) == []
    assert b.d.count("cancels") == 1
    assert b.outcomes() == []  # P0 may still be writing into the blocks
    b.ack(0)
    assert b.outcomes() == [Outcome("req-1", "released", "aborted")]
    assert b.wants() == 0


def test_a_second_want_for_a_transfer_id_does_not_orphan_the_live_one():
    """The e2e abort-storm leak (issue 9 item 9): vLLM's API server submits a pre-aborted copy
    of a request's kv_transfer_params (``notify_kv_transfer_request_rejected``, vLLM 0.29 and
    0.32) when the handler is cancelled -- also when the real request reached the engine, as
    when a client hangs up. The copy's release-only registration shares the live request's
    transfer id; when wants were indexed by transfer id alone it displaced the live want's
    index, whose CancelAck was then dropped as stale, and the blocks stayed fenced for good."""
    b = Bench()
    b.expect()  # req-1, t1: registered
    b.expect(key="release:x", blocks=(), first_token=0, num_tokens=0)  # same t1, release-only
    b.got()
    b.cancel()
    b.ack()
    assert Outcome("req-1", "released", "aborted") in b.outcomes()
    assert b.wants() == 0


def test_a_cancel_after_the_outcome_does_nothing():
    b = Bench()
    b.expect()
    b.write_done()
    b.cancel()
    assert b.outcomes() == [Outcome("req-1", "received")]
    assert [type(m) for m in b.got()] == [Register] and b.d.count("cancels") == 0


def test_cancel_while_connecting_releases_at_once_then_a_release_only_registration():
    b = Bench(manual=True)
    b.expect()
    assert b.got() == [] and len(b.executor.jobs) == 1  # the handshake is in progress
    b.cancel()
    assert b.outcomes() == [Outcome("req-1", "released", "aborted")]  # nothing was advertised
    b.executor.run()
    b.d.step()
    # the producer is told nothing is wanted, so it frees the prefill now, not at its time-out
    assert b.got() == [b.registration(blocks=(), first_token=0, num_tokens=0)]
    assert b.outcomes() == []  # exactly one outcome per expect
    assert b.wants() == 0


def test_an_unanswered_cancel_is_sent_again_with_back_off():
    # issue 9 item 4: one lost CancelAck held the blocks until the producer died
    b = Bench(cancel_retry_s=1.0, fence_timeout_s=100.0)
    b.expect()
    b.got()  # the registration
    b.cancel()
    sent_at = [b.clock.t] if b.got() == [b.cancel_msg()] else []
    for _ in range(200):
        b.clock.advance(0.25)
        b.d.step()
        sent_at += [b.clock.t] * len(b.got())
        if b.clock.t >= 40:
            break
    assert sent_at[:6] == [0, 1, 3, 7, 15, 23]  # doubling, at most 8 retry periods apart
    assert b.d.count("cancels_resent") == len(sent_at) - 1
    assert b.outcomes() == []  # never released on a guess
    b.ack()
    assert b.outcomes() == [Outcome("req-1", "released", "aborted")]


def test_a_fence_that_outlives_its_bound_closes_the_lifeline_and_drops_the_producer():
    # issue 9 item 4: after the bound the producer is treated as dead -- never just released
    b = Bench(cancel_retry_s=1.0, fence_timeout_s=20.0)
    b.expect("req-1")
    b.expect("req-2", "t2", blocks=(4, 5))  # another request the same producer writes
    b.cancel("req-1")
    b.clock.advance(19)
    b.d.step()
    assert b.outcomes() == [] and b.severed == []
    b.clock.advance(2)
    b.d.step()  # gives up: closes the lifeline, so a live producer drops us and posts no more
    assert b.severed == ["P0"] and b.d.count("fence_timeouts") == 1
    b.lifelines["P0"]()  # our own closing, seen by the lifeline's watcher: not proof of death
    b.d.step(2)
    assert b.d.thread.peer("P0") is not None and b.outcomes() == []
    # WRITEs it posted before it noticed may still land: the blocks stay fenced for another
    # fence_timeout_s, then the producer is dropped
    b.clock.advance(19)
    b.d.step(2)
    assert b.outcomes() == [] and b.d.thread.peer("P0") is not None
    b.clock.advance(2)
    b.d.step(3)
    assert b.d.thread.peer("P0") is None and b.d.transport.removed == ["P0"]
    assert sorted(b.outcomes(), key=lambda o: o.key) == [
        Outcome("req-1", "released", "aborted"),
        Outcome("req-2", "failed", "producer P rank 0 is dead")]
    assert b.wants() == 0


def test_a_lifeline_broken_without_proof_is_not_taken_for_death():
    """The side channel to a producer broke with a time-out (TCP keepalive: its host stopped
    answering): no proof it is gone -- it may be alive with WRITEs in flight over another path.
    The blocks it was told about stay fenced for fence_timeout_s, new requests do not register
    with it, and then it is dropped. A closed connection (end of stream) is proof at once."""
    b = Bench(cancel_retry_s=1.0, fence_timeout_s=20.0)
    b.expect("req-1")
    b.broken["P0"]()
    b.d.step(2)
    assert b.d.thread.peer("P0") is not None and b.outcomes() == []
    assert b.d.count("lifelines_broken") == 1
    b.expect("req-2", "t2", blocks=(4, 5))  # a new request for the same producer: fails now
    b.d.step()
    assert [o.key for o in b.outcomes()] == ["req-2"]
    assert b.got() == [b.registration()]  # nothing sent for req-2
    b.clock.advance(19)
    b.d.step(2)
    assert b.outcomes() == [] and b.d.thread.peer("P0") is not None  # req-1 still fenced
    b.clock.advance(2)
    b.d.step(3)
    assert b.d.thread.peer("P0") is None
    assert b.outcomes() == [Outcome("req-1", "failed", "producer P rank 0 is dead")]
    b.lifelines["P0"]()  # the lifeline's own end, later: nothing more
    b.d.step(2)
    assert b.outcomes() == [] and b.wants() == 0


def test_a_lifeline_closed_is_proof_at_once():
    b = Bench(fence_timeout_s=20.0)
    b.expect("req-1")
    b.lifelines["P0"]()
    b.d.step(3)
    assert b.d.thread.peer("P0") is None
    assert b.outcomes() == [Outcome("req-1", "failed", "producer P rank 0 is dead")]


def test_an_answer_after_the_bound_still_ends_the_fence():
    b = Bench(cancel_retry_s=1.0, fence_timeout_s=20.0)
    b.expect()
    b.cancel()
    b.clock.advance(21)
    b.d.step()
    assert b.severed == ["P0"]
    b.ack()
    assert b.outcomes() == [Outcome("req-1", "released", "aborted")]


def test_a_cancel_ack_waits_for_the_chunks_it_announces():
    # issue 9 item 6: on LIBFABRIC a local DONE does not prove remote delivery, so the ack may
    # overtake the WRITEs' notices (and data)
    b = Bench()
    b.expect()
    b.write_done(chunk=0, chunks=4)
    b.cancel()
    b.ack(chunks_done=3)  # chunks 1 and 2 completed on P but have not landed here yet
    assert b.outcomes() == []
    b.write_done(chunk=2, chunks=4)
    assert b.outcomes() == []
    b.write_done(chunk=1, chunks=4)
    assert b.outcomes() == [Outcome("req-1", "released", "aborted")]


def test_a_transfer_failed_waits_for_the_chunks_it_announces():
    b = Bench()
    b.expect()
    b.failed(chunks_done=1)  # one chunk completed before the failure; its notice is late
    assert b.outcomes() == []
    b.failed(chunks_done=1)  # a copy: still one outcome, later
    b.write_done(chunk=0, chunks=2)
    assert b.outcomes() == [Outcome("req-1", "failed", "producer rank 0: boom")]
    b.write_done(chunk=1, chunks=2)
    b.ack()
    assert b.outcomes() == [] and b.d.count("stale") == 2


def test_a_partly_sent_registration_is_fenced_not_forgotten():
    # issue 9 item 7: rank 0 was told, rank 1 could not be; the decoder treated it as "nothing
    # advertised" and freed blocks producer rank 0 may write. A send that failed may still
    # have gone out (the agent raised after posting it), so rank 1 is fenced too: the blocks
    # are freed once both answered the cancel, or once the decoder gave up on rank 1
    b = Bench(p_tp=2, manual=True, cancel_retry_s=1.0, fence_timeout_s=20.0)
    b.expect()
    b.executor.run()  # rank 0's handshake
    b.d.step()
    b.executor.run()  # rank 1's
    queue = b.wire.queues.pop("P1")  # its notifications can no longer be posted
    b.d.step()
    assert b.got(0) == [b.registration(), b.cancel_msg(
        reason="could not notify producer rank 1")]
    assert b.outcomes() == []
    b.ack(0)
    assert b.outcomes() == []  # rank 1 has not answered
    b.wire.queues["P1"] = queue  # it can be reached again: the re-sent cancel gets there
    b.clock.advance(1.5)
    b.d.step()
    assert b.got(1) == [b.cancel_msg(reason="could not notify producer rank 1")]
    b.ack(1)
    assert b.outcomes() == [Outcome("req-1", "failed", "could not notify producer rank 1")]


def test_a_registration_that_could_not_be_sent_to_an_unreachable_rank_is_given_up_on():
    b = Bench(p_tp=2, manual=True, cancel_retry_s=1.0, fence_timeout_s=20.0)
    b.expect()
    b.executor.run()
    b.d.step()
    b.executor.run()
    del b.wire.queues["P1"]
    b.d.step()
    b.ack(0)
    b.clock.advance(21)
    b.d.step()  # gives up on rank 1: closes its lifeline
    assert b.severed == ["P1"] and b.outcomes() == []
    b.clock.advance(21)
    b.d.step(3)  # dropped: no WRITE of it can land any more
    assert b.outcomes() == [Outcome("req-1", "failed", "could not notify producer rank 1")]


def test_a_new_attempt_keeps_the_old_one_fenced_and_reports_once():
    # issue 9 item 7: expect on an existing key overwrote a want that was still fencing
    b = Bench()
    b.expect(attempt=0, blocks=(2, 3))
    b.expect(attempt=1, blocks=(4, 5))
    assert b.got() == [b.registration(), b.cancel_msg(reason="superseded by attempt 1"),
                       b.registration(attempt=1, blocks=(4, 5))]
    b.write_done(attempt=1)
    assert b.outcomes() == []  # the old blocks may still be written
    b.expect(attempt=1)  # the same attempt again: ignored
    b.ack(attempt=0)
    assert b.outcomes() == [Outcome("req-1", "received", attempt=1)]
    assert b.wants() == 0 and b.decoder.live()["parked"] == 0


def test_an_attempt_superseded_after_its_outcome_went_out_is_told_apart():
    # the engine re-allocated while the old attempt's outcome was on its way: the newest
    # attempt still gets exactly one outcome, and the old one is marked as the old attempt's
    b = Bench()
    b.expect(attempt=0)
    b.write_done()
    b.expect(attempt=1, blocks=(4, 5))
    b.write_done(attempt=1)
    assert b.outcomes() == [Outcome("req-1", "received", attempt=0),
                            Outcome("req-1", "received", attempt=1)]


# -- handshakes ----------------------------------------------------------------------------------


def test_a_failed_handshake_fails_the_request_and_the_next_one_retries():
    b = Bench()
    b.refuse[PORT] = "connection refused"
    b.expect()
    assert b.outcomes() == [Outcome("req-1", "failed",
                                    "handshake with producer rank 0 failed: connection refused")]
    assert b.d.count("handshake_failures") == 1 and b.d.count("transfers_failed") == 1
    assert b.wants() == 0
    del b.refuse[PORT]
    b.expect("req-2", "t2")
    assert len(b.handshakes) == 2
    assert b.got() == [b.registration("t2", reg="req-2")]


@pytest.mark.parametrize("error", [UnicodeError("label empty or too long"),
                                   OverflowError("port must be 0-65535")])
def test_a_handshake_that_raises_something_unexpected_fails_and_is_dialled_again(error, caplog):
    """An error the handshake does not expect -- the IDNA codec refusing a host name such as
    'p..host' (an empty label; the router's kv= parser accepts it), a port out of range -- left
    the address "connecting" for good: no log, never dialled again, every request to it waiting
    transfer_timeout_s. Now it fails its requests at once, is logged with its traceback, and the
    next request dials again."""
    b = Bench()
    b.refuse[PORT] = error
    with caplog.at_level(logging.WARNING):
        b.expect()
    assert b.outcomes() == [Outcome("req-1", "failed", "handshake with producer rank 0 failed: "
                                    f"{type(error).__name__}: {error}")]
    assert any("raised" in r.getMessage() and r.exc_info for r in caplog.records)
    assert b.d.count("handshake_failures") == 1 and b.wants() == 0
    assert not b.decoder.holding()  # its thread may go quiet again
    del b.refuse[PORT]
    b.expect("req-2", "t2")
    assert len(b.handshakes) == 2
    assert b.got() == [b.registration("t2", reg="req-2")]


def test_a_closing_decoder_closes_its_lifelines():
    """Closed while its process lives on (server_watch), a decoder kept its lifelines -- and
    their threads, and the producers' handler threads and connection slots -- open until its
    process ended: the producers never learnt it was gone."""
    b = Bench(p_tp=2)
    b.expect()
    assert b.severed == []
    b.decoder.close()
    assert sorted(b.severed) == ["P0", "P1"]


def test_a_handshake_that_ends_after_the_decoder_closed_closes_its_lifeline():
    """A handshake still running when the decoder closes (the pool's shutdown cancels only
    the jobs not started) opens its lifeline afterwards; its welcome is never handled (the
    transfer thread is gone), so the lifeline stayed open until the process ended. It is
    closed at once now -- and so is one whose handshake ended just before the close, with its
    welcome not yet handled."""
    b = Bench(manual=True, p_tp=2)
    b.expect()
    assert len(b.executor.jobs) == 1  # rank 0's handshake, running
    b.executor.run()  # it ends: its lifeline opens, its welcome is queued, not handled
    assert b.severed == []
    b.decoder.close()
    assert b.severed == ["P0"]
    b2 = Bench(manual=True)
    b2.expect()
    b2.decoder.close()  # while the handshake runs
    b2.executor.run()  # it ends afterwards
    assert b2.severed == ["P0"]


def test_all_requests_waiting_for_a_handshake_fail_with_it():
    b = Bench(manual=True)
    b.expect("req-1", "t1")
    b.expect("req-2", "t2")
    assert len(b.executor.jobs) == 1  # one handshake per producer rank, shared
    b.refuse[PORT] = "timed out"
    b.executor.run()
    b.d.step()
    assert sorted(o.key for o in b.outcomes() if o.kind == "failed") == ["req-1", "req-2"]


@pytest.mark.parametrize("rank,change,reason", [
    (0, dict(compat_hash="0" * 16), "incompatible"),
    (0, dict(geometry=p_geom(head_size=16)), "bad_layout"),
    (0, dict(geometry=p_geom(2, 1)), "invalid"),  # the port for rank 0 answered as rank 1
    (1, dict(engine_id="Q"), "conflict"),  # rank 1's port is another engine than rank 0's
])
def test_a_welcome_that_does_not_fit_is_refused(rank, change, reason):
    b = Bench(p_tp=2)
    b.welcome_changes[rank] = {"engine_id": "engine-of-this-start", **change}
    b.expect()
    assert b.d.count("rejected", label=reason) == 1
    # a refusal's label names no engine id (vLLM makes one per start: a series per restart)
    labels = [k for k in b.d.thread.counters.snapshot() if k.startswith("handshake_refusals{")]
    assert labels == ([] if reason not in ("incompatible", "bad_layout") else
                      [f"handshake_refusals{{{HOST}:{PORT} {reason}: the producer"
                       + labels[0].split("the producer", 1)[1]]), labels
    assert not [k for k in labels if "engine-of-this-start" in k], labels
    (outcome,) = b.outcomes()
    assert outcome.kind == "failed" and f"producer rank {rank} failed" in outcome.reason
    assert b.d.count("handshake_failures") == 1
    assert b.got(0) == [] and b.got(1) == []  # nobody was told anything
    assert b.wants() == 0


# -- failures, deaths and time-outs --------------------------------------------------------------


def test_a_producer_failure_fences_the_other_writers_before_failing():
    b = Bench(p_tp=2)
    b.expect()
    b.got(0), b.got(1)  # the registrations
    b.failed(0)
    assert b.got(1) == [b.cancel_msg(reason="producer rank 0: boom")]
    assert b.got(0) == []  # it failed: it writes nothing more
    assert b.outcomes() == []
    b.ack(1)
    assert b.outcomes() == [Outcome("req-1", "failed", "producer rank 0: boom")]
    assert b.d.count("transfers_failed") == 1 and b.wants() == 0


def test_a_transfer_the_producer_abandoned_fails_the_request_but_is_no_failure(caplog):
    b = Bench()
    b.expect()
    b.got()
    with caplog.at_level(logging.INFO, logger="kv_push"):
        b.failed(reason="prefill aborted", abandoned="prefill_aborted")
    # the request still cannot be served from P's KV: vLLM hears it failed
    assert b.outcomes() == [Outcome("req-1", "failed", "producer rank 0: prefill aborted")]
    assert b.d.count("transfers_abandoned", label="prefill_aborted") == 1
    assert b.d.count("transfers_failed") == 0 and b.wants() == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("not made: producer rank 0: prefill aborted" in r.getMessage()
               for r in caplog.records)


def test_a_producer_failure_fails_the_request():
    b = Bench()
    b.expect()
    b.failed(0)
    assert set(b.outcomes()) == {Outcome("req-1", "failed", "producer rank 0: boom")}
    assert b.wants() == 0


def test_a_producer_failure_emits_exactly_one_outcome():
    # issue 9 item 2: _fail -> _fence -> _check -> _finish, then _check again
    b = Bench()
    b.expect()
    b.failed(0)
    assert b.outcomes() == [Outcome("req-1", "failed", "producer rank 0: boom")]


@pytest.mark.parametrize("how", ["lifeline", "goodbye"])
def test_producer_death_fails_a_registered_request(how):
    b = Bench()
    b.expect()
    if how == "lifeline":
        b.lifelines["P0"]()  # the producer's side channel closed (from the lifeline thread)
        b.d.step()
    else:
        b.send(0, Goodbye(engine_id="P", tp_rank=0))
    assert b.outcomes() == [Outcome("req-1", "failed", "producer P rank 0 is dead")]
    assert b.d.thread.peer("P0") is None and b.d.transport.removed == ["P0"]
    assert b.wants() == 0
    b.expect("req-2", "t2")  # a new request connects afresh
    assert len(b.handshakes) == 2


def test_producer_death_while_fencing_releases():
    b = Bench()
    b.expect()
    b.cancel()
    assert b.outcomes() == []
    b.lifelines["P0"]()
    b.d.step()
    assert b.outcomes() == [Outcome("req-1", "released", "aborted")]


def test_a_request_times_out_but_stays_fenced_until_the_producer_acks():
    b = Bench()
    b.expect()
    b.got()  # the registration
    b.clock.advance(TIMEOUT - 1)
    b.d.step()
    assert b.outcomes() == [] and b.d.count("expired") == 0
    b.clock.advance(2)
    b.d.step()
    assert b.d.count("expired") == 1
    assert [type(m) for m in b.got()] == [Cancel]
    assert b.outcomes() == []
    b.ack()
    assert b.outcomes() == [Outcome("req-1", "failed", f"no KV within {TIMEOUT:.0f}s")]


def test_a_request_whose_handshake_never_ends_times_out_at_once():
    b = Bench(manual=True)
    b.expect()
    b.clock.advance(TIMEOUT + 1)
    b.d.step()
    assert b.outcomes() == [Outcome("req-1", "failed", f"no KV within {TIMEOUT:.0f}s")]
    assert b.wants() == 0


def test_a_lifeline_that_closes_before_the_welcome_is_handled_fails_the_handshake():
    # the lifeline closed after handshake() returned but before _on_welcome ran: peer_lost
    # found no peer, and the decoder went on to register with a dead producer
    b = Bench()
    b.close_at_once = True
    b.expect()
    b.d.step(2)
    (outcome,) = b.outcomes()
    assert outcome.kind == "failed" and "closed its side channel" in outcome.reason
    assert b.d.thread.peer("P0") is None and b.got() == []
    assert b.d.count("rejected", label="lifeline_closed") == 1
    b.close_at_once = False
    b.expect("req-2", "t2")  # the next request connects afresh
    assert b.got() == [b.registration("t2", reg="req-2")]


def test_a_silent_producer_fails_the_request_but_keeps_the_blocks_fenced():
    # issue 9 item 5: heartbeat silence is not proof of death (a frozen producer may still
    # have a WRITE in flight)
    b = Bench(heartbeat_interval_s=10.0, fence_timeout_s=1000.0)
    b.expect()
    b.got()
    b.clock.advance(16)
    b.d.step()
    assert b.d.count("peers_silent") == 1 and b.d.thread.peer("P0") is not None
    assert b.got() == [b.cancel_msg(reason="producer P rank 0 is unresponsive")]
    b.clock.advance(100)
    b.d.step()
    assert b.outcomes() == []  # still fenced
    b.expect("req-2", "t2")  # a new request is not registered with a silent producer
    assert b.outcomes() == [Outcome("req-2", "failed", "producer rank 0 is unresponsive")]
    assert not any(isinstance(m, Register) for m in b.got())
    b.lifelines["P0"]()  # only its death frees the blocks
    b.d.step(2)
    assert b.outcomes() == [Outcome("req-1", "failed", "producer P rank 0 is unresponsive")]


def test_a_failure_decided_while_fenced_is_a_verdict_at_once_and_an_outcome_when_safe():
    # the engine may fail the request at once (vLLM holds its blocks until the outcome), so a
    # frozen producer does not keep the client waiting for the fence
    b = Bench(heartbeat_interval_s=10.0, fence_timeout_s=1000.0)
    b.decoder.early_verdicts = True
    b.expect()
    b.expect("req-2", "t2")
    b.got()
    b.clock.advance(16)
    b.d.step()
    assert b.verdicts() == [Outcome("req-1", "failed", "producer P rank 0 is unresponsive"),
                            Outcome("req-2", "failed", "producer P rank 0 is unresponsive")]
    assert b.outcomes() == []  # still fenced
    b.cancel()  # the engine ended req-1 on the verdict: it still waits for the outcome
    b.ack()  # P answers req-1's cancel: nothing more can land there
    assert b.outcomes() == [Outcome("req-1", "released", "producer P rank 0 is unresponsive")]
    b.clock.advance(100)
    b.d.step()
    assert b.verdicts() == [] and b.outcomes() == []  # one verdict per want, req-2 fenced
    b.lifelines["P0"]()
    b.d.step(2)
    assert b.outcomes() == [Outcome("req-2", "failed", "producer P rank 0 is unresponsive")]
    assert b.verdicts() == []


def test_a_time_out_or_a_failure_with_notices_still_due_is_a_verdict_too():
    b = Bench(fence_timeout_s=1000.0)
    b.decoder.early_verdicts = True
    b.expect()
    b.got()
    b.clock.advance(TIMEOUT + 1)  # no KV within transfer_timeout_s; P never answers
    b.d.step()
    assert b.verdicts() == [Outcome("req-1", "failed", "no KV within 60s")]
    assert b.outcomes() == []
    b.expect("req-2", "t2")
    b.failed(tid="t2", reg="req-2", chunks_done=2)  # two chunks landed, their notices not yet
    assert b.verdicts() == [Outcome("req-2", "failed", "producer rank 0: boom")]
    assert b.outcomes() == []
    b.write_done(tid="t2", reg="req-2", chunk=0, chunks=4)
    b.write_done(tid="t2", reg="req-2", chunk=1, chunks=4)
    assert b.outcomes() == [Outcome("req-2", "failed", "producer rank 0: boom")]
    assert b.verdicts() == []


def test_no_verdict_where_the_outcome_itself_comes_at_once_or_the_engine_let_go():
    b = Bench(heartbeat_interval_s=10.0, fence_timeout_s=1000.0)
    b.decoder.early_verdicts = True
    b.refuse[PORT] = "connection refused"
    b.expect()  # nothing advertised: nothing to fence, the outcome is immediate
    assert [o.kind for o in b.outcomes()] == ["failed"] and b.verdicts() == []
    del b.refuse[PORT]
    b.expect("req-2", "t2")
    b.failed(tid="t2", reg="req-2", chunks_done=0)  # P answered: quiet, no fence to wait out
    assert [o.kind for o in b.outcomes()] == ["failed"] and b.verdicts() == []
    b.expect("req-3", "t3")
    b.cancel("req-3")  # the engine let go: it needs no verdict
    b.expect("req-4", "t4")
    b.expect("req-4", "t4", attempt=1)  # attempt 0 superseded: no outcome, no verdict of its own
    b.clock.advance(16)
    b.d.step()
    assert b.verdicts() == [Outcome("req-4", "failed", "producer P rank 0 is unresponsive",
                                    attempt=1)]
    off = Bench(heartbeat_interval_s=10.0, fence_timeout_s=1000.0)  # the default: none at all
    off.expect()
    off.clock.advance(16)
    off.d.step()
    assert off.verdicts() == [] and off.outcomes() == []


def test_a_silent_producer_that_speaks_again_can_answer():
    b = Bench(heartbeat_interval_s=10.0, fence_timeout_s=1000.0)
    b.expect()
    b.clock.advance(16)
    b.d.step()
    b.ack()
    assert b.d.thread.peer("P0").silent is False
    assert b.outcomes() == [Outcome("req-1", "failed", "producer P rank 0 is unresponsive")]


# -- with a real producer ------------------------------------------------------------------------


class Pair:
    """A real producer worker "P" and a real decoder worker "D" (TP 1 each) in-process, the
    side channel replaced by a direct call of ``accept_hello`` (a refusal becomes the
    ``HandshakeRefused`` the side channel raises)."""

    def __init__(self, *, manual: bool = False, d_geometry: G.KVGeometry | None = None,
                 **config):
        self.wire, self.clock = Wire(), FakeClock()
        cfg = role_config(**config)
        self.p = Node(self.wire, self.clock, "P", p_geom(), cfg)
        self.d = Node(self.wire, self.clock, "D", d_geometry or d_geom(), cfg)
        self.released: list[str] = []
        self.producer = Producer(self.p.thread, on_released=self.released.append,
                                 side_channel_ports=(PORT,))
        self.executor = ManualExecutor() if manual else InlineExecutor()
        self.decoder = Decoder(self.d.thread, handshake_fn=self.handshake, executor=self.executor)
        self.p.thread.add_role(self.producer)
        self.d.thread.add_role(self.decoder)

    def handshake(self, host, port, hello, codec, timeout, on_closed=None,
                  on_open=None, on_unproven=None) -> Welcome:
        try:
            return self.producer.accept_hello(hello)
        except MessageRejected as e:
            raise HandshakeRefused(f"{host}:{port} refused the handshake: {e}", str(e)) from None

    def settle(self) -> None:
        settle(self.p, self.d, wire=self.wire)

    def expect(self, key="d-1", tid="t1", blocks=(2, 3)) -> None:
        self.d.thread.submit(lambda: self.decoder.expect(key, tid, 0, (HOST, PORT), blocks, 0, 8))

    def prefill(self, key="p-1", tid="t1") -> None:
        self.p.thread.submit(lambda: self.producer.prefill_done(key, tid, (0, 1), 8))

    def outcomes(self) -> list[Outcome]:
        out = []
        while not self.decoder.outcomes.empty():
            out.append(self.decoder.outcomes.get_nowait())
        return out

    def idle(self) -> bool:
        return (all(v == 0 for v in self.producer.live().values())
                and self.decoder.live()["wants"] == 0)


@pytest.mark.parametrize("decoder_first", [True, False])
def test_with_a_real_producer_either_side_may_come_first(decoder_first):
    pair = Pair()
    first, second = (pair.expect, pair.prefill) if decoder_first else (pair.prefill, pair.expect)
    first()
    pair.settle()
    assert pair.outcomes() == [] and pair.released == []
    second()
    pair.settle()
    assert pair.outcomes() == [Outcome("d-1", "received")]
    assert pair.released == ["p-1"] and pair.idle()
    label = "registrations_early" if decoder_first else "registrations_late"
    assert pair.p.count(label) == 1 and pair.p.count("transfers_done") == 1


def test_with_a_real_producer_an_abort_mid_write_waits_for_the_write():
    pair = Pair()
    pair.p.transport.hold_writes = True
    pair.expect()
    pair.prefill()
    pair.settle()
    (w,) = pair.p.transport.writes
    pair.d.thread.submit(lambda: pair.decoder.cancel("d-1"))
    pair.settle()
    assert pair.outcomes() == [] and pair.released == []  # the WRITE may still land
    pair.p.transport.finish(w)
    pair.settle()
    assert pair.outcomes() == [Outcome("d-1", "released", "aborted")]
    assert pair.released == ["p-1"] and pair.idle()


def test_with_a_real_producer_an_abort_before_the_handshake_frees_the_prefill_at_once():
    pair = Pair(manual=True)
    pair.prefill()
    pair.expect()
    pair.settle()
    pair.d.thread.submit(lambda: pair.decoder.cancel("d-1"))
    pair.settle()
    assert pair.outcomes() == [Outcome("d-1", "released", "aborted")]
    assert pair.released == []
    pair.executor.run()
    pair.settle()
    assert pair.released == ["p-1"] and pair.idle()  # not after the rendezvous time-out
    assert pair.p.transport.writes == [] and pair.outcomes() == []


def test_with_a_real_producer_a_refused_handshake_fails_the_request():
    pair = Pair(d_geometry=d_geom(head_size=16))  # D serves another model
    pair.expect()
    pair.settle()
    (outcome,) = pair.outcomes()
    assert outcome.kind == "failed" and "refused the handshake" in outcome.reason
    assert "head_size differs" in outcome.reason
    assert pair.p.count("handshakes") == 0 and pair.p.thread.peer("D") is None


def test_a_refused_pair_is_counted_per_producer_and_logged_once(caplog):
    """Every request for an incompatible producer fails (each tries the handshake again, the
    producer may have been reconfigured), but the operator reads the reason once, and the
    refusals are counted under the producer's address (what the router reads)."""
    pair = Pair(d_geometry=d_geom(head_size=16))
    with caplog.at_level(logging.WARNING, logger="kv_push"):
        for i in range(3):
            pair.expect(key=f"d-{i}", tid=f"t{i}")
            pair.settle()
    assert [o.kind for o in pair.outcomes()] == ["failed"] * 3
    reason = "bad_layout: decoder D: head_size differs: 8 on the producer, 16 on the decoder"
    assert pair.d.count("handshake_refusals", label=f"{HOST}:{PORT} {reason}") == 3
    assert pair.d.count("handshake_failures") == 3
    incompatible = [r for r in caplog.records if "incompatible" in r.getMessage()]
    assert len(incompatible) == 1 and reason in incompatible[0].getMessage()
    failed = [r for r in caplog.records if "failed" in r.getMessage()
              and r.name == "kv_push.common.decoder"]
    assert len(failed) == 1, [r.getMessage() for r in failed]  # one per reason, not per request


def test_a_refusing_producer_is_not_dialled_again_only_to_let_go():
    """After a refusal fails a request, vLLM ends a request of that transfer that never asked
    for anything, and the connector asks the producer to let go of its prefill (a registration
    with no blocks). That took a second handshake, refused and counted again: a walkthrough saw
    D's refusal count go up by two per failed request, the second with D's next engine step
    (so a router restarted in between took it for a new refusal). A request that wants KV still
    tries again: the producer may have been reconfigured."""
    pair = Pair(d_geometry=d_geom(head_size=16))
    pair.expect()
    pair.settle()
    assert [o.kind for o in pair.outcomes()] == ["failed"]
    pair.d.thread.submit(lambda: pair.decoder.expect("release:x", "t1", 0, (HOST, PORT), (),
                                                     0, 0))
    pair.settle()
    # one handshake, not two
    assert pair.d.count("handshake_refusals") == 1 and pair.d.count("handshake_failures") == 1
    assert pair.decoder.wants == {} and pair.idle()
    # not for long: a producer fixed at the same address is asked to let go again
    pair.clock.advance(pair.decoder.ctx.config.heartbeat_interval_s)
    pair.d.thread.submit(lambda: pair.decoder.expect("release:y", "t1", 0, (HOST, PORT), (),
                                                     0, 0))
    pair.settle()
    assert pair.d.count("handshake_refusals") == 2
    pair.expect(key="d-2", tid="t2")
    pair.settle()
    assert [o.kind for o in pair.outcomes()] == ["released", "failed", "failed"]
    assert pair.d.count("handshake_refusals") == 3


def test_a_handshake_that_fails_for_other_reasons_is_not_a_refusal():
    b = Bench()
    b.refuse[PORT] = "side channel 10.0.0.7:7000: [Errno 111] Connection refused"
    b.expect()
    (outcome,) = b.outcomes()
    assert outcome.kind == "failed"
    assert b.d.count("handshake_failures") == 1 and b.d.count("handshake_refusals") == 0


def test_a_refusal_decided_here_is_counted_as_rejected_and_as_a_refusal():
    """The side channel rejected the producer's frame here (a secret on P only): counted like a
    refusal ``_on_welcome`` decides -- ``rejected{label}`` and ``handshake_refusals``."""
    b = Bench()
    reason = (f"secret_mismatch: the producer at {HOST}:{PORT} uses a shared secret but this "
              "decoder has none")
    b.refuse[PORT] = HandshakeRefused(f"handshake with {HOST}:{PORT} refused here: {reason}",
                                      reason, rejected="secret_mismatch")
    b.expect()
    (outcome,) = b.outcomes()
    assert outcome.kind == "failed" and reason in outcome.reason
    assert b.d.count("rejected", label="secret_mismatch") == 1
    assert b.d.count("handshake_refusals", label=f"{HOST}:{PORT} {reason}") == 1
    assert b.d.count("handshake_failures") == 1


def test_it_awaits_only_while_a_registered_want_waits_for_its_writes():
    """The transfer thread polls every await_poll_s (not idle_poll_s) only then: over UCX the
    WRITE into D and its notice progress only while D polls (issue 12 item 4)."""
    b = Bench()
    assert not b.decoder.awaiting() and not b.d.thread._awaiting()
    b.expect()
    assert b.decoder.awaiting() and b.d.thread._awaiting()
    b.write_done()
    assert b.outcomes() == [Outcome("req-1", "received")]
    assert not b.decoder.awaiting()
    b.expect("req-2", "t2", blocks=(4, 5))
    b.cancel("req-2")  # fencing: waits for the producer's answer, not for a WRITE
    assert not b.decoder.awaiting()
