"""Tests for kv_push.common.rendezvous: pairing in either order, attempts, displacement, expiry."""

from __future__ import annotations

import pytest

from kv_push.common.rendezvous import Pairing, Registration, Rendezvous, Source, StaleEvent

from fakes import FakeClock


def src(tid: str = "t1", key: str = "req-a", blocks=(1, 2, 3), num_tokens: int = 40) -> Source:
    return Source(key=key, transfer_id=tid, block_ids=tuple(blocks), num_tokens=num_tokens)


def reg(tid: str = "t1", attempt: int = 0, rank: int = 0, peer: str | None = None,
        engine: str = "dec-0", blocks=(10, 11, 12), first_token: int = 0,
        num_tokens: int = 40) -> Registration:
    return Registration(transfer_id=tid, attempt=attempt, peer=peer or f"agent-d{rank}",
                        engine_id=engine, tp_rank=rank, block_ids=tuple(blocks),
                        first_token=first_token, num_tokens=num_tokens)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def rdv(clock) -> Rendezvous:
    return Rendezvous(ttl_s=10.0, clock=clock)


# -- pairing -------------------------------------------------------------------------------------


def test_registration_then_prefill(rdv):
    r = reg()
    assert rdv.add_registration(r) == (None, None)
    assert "t1" in rdv and len(rdv) == 1
    assert rdv.source("t1") is None
    s = src()
    pairings, displaced = rdv.add_source(s)
    assert pairings == [Pairing(s, r)]
    assert displaced is None
    assert rdv.source("t1") == s
    assert rdv.registrations("t1") == [r]


def test_prefill_then_registration(rdv):
    s = src()
    assert rdv.add_source(s) == ([], None)
    assert "t1" in rdv
    r = reg()
    pairing, superseded = rdv.add_registration(r)
    assert pairing == Pairing(s, r)
    assert superseded is None


def test_transfers_are_independent(rdv):
    rdv.add_registration(reg("a"))
    pairings, _ = rdv.add_source(src("b", key="kb"))
    assert pairings == []  # b's source does not pair with a's registration
    assert len(rdv) == 2
    assert rdv.registrations("b") == [] and rdv.source("a") is None
    assert rdv.registrations("missing") == [] and rdv.source("missing") is None
    assert "missing" not in rdv


def test_multiple_decoder_ranks_both_orders(rdv):
    r0, r1 = reg(rank=0), reg(rank=1, blocks=(20, 21))
    rdv.add_registration(r0)
    rdv.add_registration(r1)
    s = src()
    pairings, _ = rdv.add_source(s)
    assert sorted(pairings, key=lambda p: p.registration.tp_rank) == [Pairing(s, r0), Pairing(s, r1)]
    # a third rank arriving after the prefill pairs at once, alone
    r2 = reg(rank=2)
    assert rdv.add_registration(r2) == (Pairing(s, r2), None)
    assert {r.tp_rank for r in rdv.registrations("t1")} == {0, 1, 2}


def test_prefill_first_then_several_ranks(rdv):
    s = src()
    rdv.add_source(s)
    for rank in range(4):
        r = reg(rank=rank, peer=f"agent-{rank}")
        assert rdv.add_registration(r) == (Pairing(s, r), None)


# -- attempts ------------------------------------------------------------------------------------


def test_newer_attempt_supersedes_before_prefill(rdv):
    old, new = reg(attempt=0), reg(attempt=1, blocks=(99,))
    rdv.add_registration(old)
    assert rdv.add_registration(new) == (None, old)
    assert rdv.registrations("t1") == [new]
    pairings, _ = rdv.add_source(src())
    assert [p.registration for p in pairings] == [new]  # only the newest is written


def test_newer_attempt_supersedes_after_pairing(rdv):
    s = src()
    rdv.add_source(s)
    old = reg(attempt=1)
    rdv.add_registration(old)
    new = reg(attempt=5)
    assert rdv.add_registration(new) == (Pairing(s, new), old)
    assert rdv.registrations("t1") == [new]


@pytest.mark.parametrize("attempt", [0, 1, 2])
def test_older_or_equal_attempt_is_stale(rdv, attempt):
    current = reg(attempt=2)
    rdv.add_registration(current)
    with pytest.raises(StaleEvent):
        rdv.add_registration(reg(attempt=attempt, blocks=(5,)))
    assert rdv.registrations("t1") == [current]  # unchanged


def test_stale_attempt_after_pairing_does_not_pair(rdv):
    s = src()
    rdv.add_source(s)
    rdv.add_registration(reg(attempt=3))
    with pytest.raises(StaleEvent):
        rdv.add_registration(reg(attempt=2))
    assert [r.attempt for r in rdv.registrations("t1")] == [3]


def test_attempts_are_per_rank(rdv):
    rdv.add_registration(reg(rank=0, attempt=4))
    # rank 1's first registration at a lower attempt is not stale: it is another rank
    assert rdv.add_registration(reg(rank=1, attempt=0)) == (None, None)


# -- prefill sources -----------------------------------------------------------------------------


def test_second_prefill_source_displaces_first(rdv):
    r = reg()
    rdv.add_registration(r)
    first = src(key="req-a")
    assert rdv.add_source(first) == ([Pairing(first, r)], None)
    second = src(key="req-b", blocks=(7, 8))
    pairings, displaced = rdv.add_source(second)
    assert displaced == first
    assert pairings == [Pairing(second, r)]  # the registration is served by the new source
    assert rdv.source("t1") == second


def test_second_source_before_any_registration(rdv):
    first, second = src(key="a"), src(key="b")
    rdv.add_source(first)
    assert rdv.add_source(second) == ([], first)
    r = reg()
    assert rdv.add_registration(r) == (Pairing(second, r), None)


def test_same_source_key_twice_is_stale(rdv):
    s = src()
    rdv.add_source(s)
    with pytest.raises(StaleEvent):
        rdv.add_source(src(blocks=(4, 5)))  # same key, same transfer
    assert rdv.source("t1") == s


# -- cancel and peers ----------------------------------------------------------------------------


def test_cancel_current_attempt_removes_it(rdv):
    r = reg(attempt=2)
    rdv.add_registration(r)
    assert rdv.cancel("t1", 0, 2) == r
    assert rdv.registrations("t1") == []
    pairings, _ = rdv.add_source(src())
    assert pairings == []  # nothing left to write to
    # cancelling again, or an unknown rank / transfer, is a no-op
    assert rdv.cancel("t1", 0, 2) is None
    assert rdv.cancel("t1", 7, 0) is None
    assert rdv.cancel("nope", 0, 0) is None


def test_cancel_newer_attempt_than_current_removes_current(rdv):
    r = reg(attempt=1)
    rdv.add_registration(r)
    assert rdv.cancel("t1", 0, 3) == r
    assert rdv.registrations("t1") == []


def test_cancel_older_attempt_is_stale(rdv):
    current = reg(attempt=3)
    rdv.add_registration(current)
    with pytest.raises(StaleEvent):
        rdv.cancel("t1", 0, 2)
    assert rdv.registrations("t1") == [current]


def test_cancel_leaves_other_ranks(rdv):
    r0, r1 = reg(rank=0), reg(rank=1)
    rdv.add_registration(r0)
    rdv.add_registration(r1)
    rdv.cancel("t1", 0, 0)
    assert rdv.registrations("t1") == [r1]


def test_reregister_after_cancel(rdv):
    rdv.add_registration(reg(attempt=1))
    rdv.cancel("t1", 0, 1)
    again = reg(attempt=2)
    assert rdv.add_registration(again) == (None, None)


def test_drop_peer(rdv):
    a0 = reg("t1", rank=0, peer="A")
    a1 = reg("t2", rank=0, peer="A")
    b = reg("t1", rank=1, peer="B")
    for r in (a0, a1, b):
        rdv.add_registration(r)
    rdv.add_source(src("t2", key="k2"))
    dropped = rdv.drop_peer("A")
    assert sorted(dropped, key=lambda r: r.transfer_id) == [a0, a1]
    assert rdv.registrations("t1") == [b]
    assert rdv.registrations("t2") == []
    assert rdv.source("t2") is not None  # the source stays; only the peer's registrations go
    assert rdv.drop_peer("A") == []
    assert rdv.drop_peer("unknown") == []


def test_drop(rdv):
    rdv.add_registration(reg())
    rdv.add_source(src())
    rdv.drop("t1")
    assert "t1" not in rdv and len(rdv) == 0
    rdv.drop("t1")  # idempotent
    # the transfer id can be used afresh
    assert rdv.add_registration(reg()) == (None, None)


# -- expiry --------------------------------------------------------------------------------------


def test_unpaired_entries_expire(rdv, clock):
    r = reg("only-reg")
    rdv.add_registration(r)
    s = src("only-src", key="k")
    rdv.add_source(s)
    clock.advance(9.99)
    assert rdv.expire() == []
    assert len(rdv) == 2
    clock.advance(0.01)  # exactly ttl
    expired = sorted(rdv.expire())
    assert expired == [("only-reg", None, [r]), ("only-src", s, [])]
    assert len(rdv) == 0
    assert rdv.expire() == []


def test_paired_entries_do_not_expire(rdv, clock):
    s = src()
    rdv.add_registration(reg())
    rdv.add_source(s)
    s2 = src("t2", key="k2")
    rdv.add_source(s2)
    rdv.add_registration(reg("t2"))
    clock.advance(1e6)
    assert rdv.expire() == []
    assert "t1" in rdv and "t2" in rdv


def test_expiry_counts_from_creation(rdv, clock):
    rdv.add_registration(reg(rank=0))
    clock.advance(6)
    r1 = reg(rank=1)
    rdv.add_registration(r1)  # a second half-entry does not restart the clock
    clock.advance(4)
    (tid, source, regs), = rdv.expire()
    assert tid == "t1" and source is None and sorted(r.tp_rank for r in regs) == [0, 1]


def test_entry_whose_pairing_was_cancelled_expires(rdv, clock):
    s = src()
    rdv.add_source(s)
    rdv.add_registration(reg(attempt=0))
    rdv.cancel("t1", 0, 0)
    clock.advance(10)
    assert rdv.expire() == [("t1", s, [])]


def test_entry_whose_peer_died_expires(rdv, clock):
    s = src()
    rdv.add_source(s)
    rdv.add_registration(reg(peer="A"))
    rdv.drop_peer("A")
    clock.advance(10)
    assert rdv.expire() == [("t1", s, [])]


def test_late_pair_within_ttl_keeps_entry(rdv, clock):
    r = reg()
    rdv.add_registration(r)
    clock.advance(9)
    rdv.add_source(src())
    clock.advance(100)
    assert rdv.expire() == []


def test_expired_entry_can_be_recreated(rdv, clock):
    rdv.add_registration(reg(attempt=4))
    clock.advance(10)
    rdv.expire()
    # a fresh entry, without memory of the old attempt
    assert rdv.add_registration(reg(attempt=0)) == (None, None)


@pytest.mark.parametrize("ttl", [0, -1, -0.5])
def test_ttl_must_be_positive(ttl):
    with pytest.raises(ValueError):
        Rendezvous(ttl_s=ttl)


def test_default_clock_is_monotonic():
    r = Rendezvous(ttl_s=1000)
    r.add_registration(reg())
    assert r.expire() == []
    assert len(r) == 1
