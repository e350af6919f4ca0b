"""Tests for kv_push.common.rendezvous: claims and sources meet by (transfer id, prompt digest), in
either order; capacity, pools, attempts, cancels, completion and expiry."""

from __future__ import annotations

import pytest

from kv_push.common.rendezvous import (
    ConflictEvent,
    Pairing,
    Registration,
    Rendezvous,
    Source,
    StaleEvent,
)

from fakes import FakeClock

TARGETS = (0,)


def src(key: str = "p-a", tid: str = "t1", digest: str = "", blocks=(1, 2, 3),
        num_tokens: int = 40, capacity: int = 1, failure: str = "") -> Source:
    return Source(key=key, transfer_id=tid, block_ids=tuple(blocks), num_tokens=num_tokens,
                  prompt_digest=digest, capacity=capacity, failure=failure)


def reg(reg_id: str = "d-1", tid: str = "t1", digest: str = "", attempt: int = 0, rank: int = 0,
        engine: str = "dec-0", blocks=(10, 11, 12), num_tokens: int = 40) -> Registration:
    return Registration(transfer_id=tid, attempt=attempt, peer=f"agent-d{rank}", engine_id=engine,
                        tp_rank=rank, block_ids=tuple(blocks), first_token=0,
                        num_tokens=num_tokens, reg_id=reg_id, prompt_digest=digest)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def rdv(clock) -> Rendezvous:
    return Rendezvous(ttl_s=10.0, clock=clock)


def complete(rdv: Rendezvous, r: Registration) -> None:
    rdv.resolve(r.request, r.tp_rank)


# -- pairing -------------------------------------------------------------------------------------


def test_registration_then_prefill(rdv):
    r = reg()
    assert rdv.add_registration(r, TARGETS) == ([], None)
    assert ("t1", "") in rdv and len(rdv) == 1 and rdv.num_claims == 1
    s = src()
    assert rdv.add_source(s) == [Pairing(s, r)]
    assert rdv.sources(("t1", "")) == [s] and rdv.registrations(("t1", "")) == [r]
    assert rdv.claim(r.request).source == "p-a"


def test_prefill_then_registration(rdv):
    s = src()
    assert rdv.add_source(s) == []
    r = reg()
    assert rdv.add_registration(r, TARGETS) == ([Pairing(s, r)], None)


def test_keys_are_transfer_and_prompt(rdv):
    rdv.add_registration(reg("d-a", digest="A"), TARGETS)
    assert rdv.add_source(src("p-b", digest="B")) == []  # another prompt of the same transfer
    assert rdv.add_source(src("p-x", tid="t2", digest="A")) == []  # another transfer
    a = src("p-a", digest="A")
    assert rdv.add_source(a) == [Pairing(a, reg("d-a", digest="A"))]
    assert len(rdv) == 3


def test_registration_without_an_id_is_named_by_its_transfer(rdv):
    r = reg(reg_id="")
    assert r.request == ("dec-0", "t1")
    rdv.add_registration(r, TARGETS)
    assert rdv.claim(("dec-0", "t1")) is not None


# -- capacity and pools --------------------------------------------------------------------------


def test_a_source_serves_one_claim_by_default_and_claims_wait_in_order(rdv):
    r1, r2, r3 = reg("d-1"), reg("d-2", blocks=(20,)), reg("d-3", blocks=(30,))
    for r in (r1, r2, r3):
        rdv.add_registration(r, TARGETS)
    s1 = src("p-1")
    assert rdv.add_source(s1) == [Pairing(s1, r1)]
    s2 = src("p-2")
    assert rdv.add_source(s2) == [Pairing(s2, r2)]
    assert rdv.claim(r3.request).source is None


def test_a_source_with_capacity_serves_that_many_claims(rdv):
    s = src(capacity=2)
    rdv.add_source(s)
    r1, r2, r3 = reg("d-1"), reg("d-2"), reg("d-3")
    assert rdv.add_registration(r1, TARGETS)[0] == [Pairing(s, r1)]
    assert rdv.add_registration(r2, TARGETS)[0] == [Pairing(s, r2)]
    assert rdv.add_registration(r3, TARGETS)[0] == []  # capacity used up


def test_two_claims_never_share_an_assignment(rdv):
    s1, s2 = src("p-1"), src("p-2")
    rdv.add_source(s1)
    rdv.add_source(s2)
    p1, _ = rdv.add_registration(reg("d-1"), TARGETS)
    p2, _ = rdv.add_registration(reg("d-2"), TARGETS)
    assert [p.source for p in p1 + p2] == [s1, s2]


def test_every_rank_and_attempt_of_a_claim_pairs_with_its_source(rdv):
    s1, s2 = src("p-1"), src("p-2")
    rdv.add_source(s1)
    rdv.add_source(s2)
    rdv.add_registration(reg("d-2", rank=0), (0, 1))
    rdv.add_registration(reg("d-1", rank=0), (0, 1))
    assert rdv.add_registration(reg("d-1", rank=1), (0, 1))[0][0].source == s2
    assert rdv.add_registration(reg("d-2", rank=1), (0, 1))[0][0].source == s1
    new, old = rdv.add_registration(reg("d-2", rank=1, attempt=1, blocks=(9,)), (0, 1))
    assert new[0].source == s1 and old == reg("d-2", rank=1)


def test_waiting_ranks_of_a_claim_all_pair_when_its_source_comes(rdv):
    r0, r1 = reg(rank=0), reg(rank=1, blocks=(20, 21))
    rdv.add_registration(r0, (0, 1))
    rdv.add_registration(r1, (0, 1))
    s = src()
    assert sorted(rdv.add_source(s), key=lambda p: p.registration.tp_rank) == [
        Pairing(s, r0), Pairing(s, r1)]


# -- attempts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("attempt", [0, 1, 2])
def test_older_or_equal_attempt_is_stale(rdv, attempt):
    current = reg(attempt=2)
    rdv.add_registration(current, TARGETS)
    with pytest.raises(StaleEvent):
        rdv.add_registration(reg(attempt=attempt, blocks=(5,)), TARGETS)
    assert rdv.registrations(("t1", "")) == [current]


def test_a_newer_attempt_unresolves_its_rank(rdv):
    s = src()
    rdv.add_source(s)
    r = reg()
    rdv.add_registration(r, TARGETS)
    complete(rdv, r)
    assert rdv.claim(r.request).complete
    rdv.add_registration(reg(attempt=1), TARGETS)
    assert not rdv.claim(r.request).complete and not rdv.source_done("p-a")


def test_same_source_twice_is_stale(rdv):
    rdv.add_source(src())
    with pytest.raises(StaleEvent):
        rdv.add_source(src(blocks=(9,)))


def test_a_claim_cannot_move_to_another_key(rdv):
    rdv.add_registration(reg(digest="A"), TARGETS)
    with pytest.raises(ConflictEvent):
        rdv.add_registration(reg(digest="B", rank=1), TARGETS)


def test_a_key_belongs_to_one_decoder_engine(rdv):
    rdv.add_registration(reg(), TARGETS)
    with pytest.raises(ConflictEvent):
        rdv.add_registration(reg("e-1", engine="dec-1"), TARGETS)


# -- cancel and peers ----------------------------------------------------------------------------


def test_cancel_drops_the_registration_and_resolves_the_rank(rdv):
    r = reg(attempt=1)
    rdv.add_registration(r, TARGETS)
    with pytest.raises(StaleEvent):
        rdv.cancel(r.request, 0, 0, rdv_key=r.rdv_key, engine_id="dec-0", targets=TARGETS)
    assert rdv.registrations(r.rdv_key) == [r]
    assert rdv.cancel(r.request, 0, 1, rdv_key=r.rdv_key, engine_id="dec-0",
                      targets=TARGETS) == r
    assert rdv.registrations(r.rdv_key) == [] and rdv.claim(r.request).complete
    s = src()
    assert rdv.add_source(s) == []  # takes the cancelled claim's share, writes nothing
    assert rdv.source_done("p-a")


def test_a_cancel_for_a_request_never_seen_still_takes_its_share(rdv):
    # its registration was lost or is still on the wire: the source must still be released
    s = src()
    rdv.add_source(s)
    key = ("dec-0", "d-9")
    assert rdv.cancel(key, 0, 0, rdv_key=("t1", ""), engine_id="dec-0", targets=TARGETS) is None
    assert rdv.claim(key).source == "p-a" and rdv.source_done("p-a")


def test_drop_peer_resolves_its_ranks(rdv):
    r0, r1 = reg(rank=0), reg(rank=1)
    rdv.add_registration(r0, (0, 1))
    rdv.add_registration(r1, (0, 1))
    assert rdv.drop_peer("agent-d1") == [r1]
    assert rdv.registrations(("t1", "")) == [r0]
    assert rdv.claim(r0.request).resolved == {1}


# -- completion ----------------------------------------------------------------------------------


def test_a_source_is_done_when_its_capacity_went_to_complete_claims(rdv):
    s = src(capacity=2)
    rdv.add_source(s)
    r1, r2 = reg("d-1"), reg("d-2")
    rdv.add_registration(r1, TARGETS)
    complete(rdv, r1)
    assert not rdv.source_done("p-a")  # one unit of capacity left
    rdv.add_registration(r2, TARGETS)
    assert not rdv.source_done("p-a")
    complete(rdv, r2)
    assert rdv.source_done("p-a")
    gone = rdv.remove_source("p-a")
    assert [c.key for c in gone] == [r1.request, r2.request]
    assert len(rdv) == 0 and rdv.num_claims == 0 and rdv.source("p-a") is None


def test_a_claim_is_complete_only_when_every_target_rank_is_resolved(rdv):
    rdv.add_source(src())
    r0 = reg(rank=0)
    rdv.add_registration(r0, (0, 1))
    complete(rdv, r0)
    assert not rdv.source_done("p-a")
    rdv.resolve(r0.request, 1)
    assert rdv.source_done("p-a")


def test_a_failed_prefill_pairs_like_a_source(rdv):
    f = src("x", failure="aborted", blocks=())
    r = reg()
    rdv.add_registration(r, TARGETS)
    assert rdv.add_source(f) == [Pairing(f, r)]


# -- closed by the router's release ---------------------------------------------------------------


def test_keys_of_a_transfer_follow_its_entries(rdv, clock):
    assert rdv.keys_of("t1") == []
    rdv.add_source(src("p-a", digest="A"))
    rdv.add_registration(reg("d-b", digest="B"), TARGETS)
    rdv.add_source(src("p-x", tid="t2"))
    assert sorted(rdv.keys_of("t1")) == [("t1", "A"), ("t1", "B")]
    assert rdv.keys_of("t2") == [("t2", "")]
    rdv.remove_source("p-x")
    assert rdv.keys_of("t2") == []
    clock.advance(10.0)
    rdv.expire()  # the waiting claim of B expires; A's source is marked expired
    assert rdv.keys_of("t1") == [("t1", "A")]
    rdv.remove_source("p-a")
    assert rdv.keys_of("t1") == [] and len(rdv) == 0


def test_a_closed_source_takes_no_more_claims_and_is_done_once_its_claims_are(rdv):
    s = src(capacity=3)
    rdv.add_source(s)
    r = reg()
    assert rdv.add_registration(r, TARGETS) == ([Pairing(s, r)], None)
    assert rdv.close(("t1", "")) == [s]
    assert rdv.close(("t1", "")) == []  # closed once
    assert not rdv.source_done("p-a")  # its claim is not complete
    late = reg("d-2")
    assert rdv.add_registration(late, TARGETS) == ([], None)  # waits: no spare capacity
    complete(rdv, r)
    assert rdv.source_done("p-a")
    assert [c.key for c in rdv.remove_source("p-a")] == [r.request]
    assert rdv.claim(late.request).source is None  # still waiting (it expires at the TTL)


def test_a_closed_source_without_claims_is_done_at_once(rdv):
    rdv.add_source(src())
    assert not rdv.source_done("p-a")
    rdv.close(("t1", ""))
    assert rdv.source_done("p-a")
    assert rdv.close(("t-unknown", "")) == []


def test_unknown_source_is_never_done(rdv):
    assert not rdv.source_done("nope")


# -- expiry --------------------------------------------------------------------------------------


def test_an_unassigned_claim_expires(rdv, clock):
    r = reg()
    rdv.add_registration(r, TARGETS)
    clock.advance(9.9)
    assert rdv.expire() == ([], [])
    clock.advance(0.2)
    claims, sources = rdv.expire()
    assert [c.key for c in claims] == [r.request] and sources == []
    assert len(rdv) == 0 and rdv.num_claims == 0


def test_a_source_expires_even_when_paired(rdv, clock):
    # a decoder rank that never registers must not hold the prefill forever
    s = src()
    rdv.add_source(s)
    rdv.add_registration(reg(rank=0), (0, 1))  # rank 1 never registers
    clock.advance(10)
    assert rdv.expire() == ([], [s])
    assert rdv.source_done("p-a")
    assert rdv.expire() == ([], [])  # returned once
    rdv.add_registration(reg("d-2"), TARGETS)  # an expired source takes no more claims
    assert rdv.claim(("dec-0", "d-2")).source is None


def test_an_assigned_claim_does_not_expire_on_its_own(rdv, clock):
    rdv.add_registration(reg(), TARGETS)
    clock.advance(5)
    rdv.add_source(src())
    clock.advance(6)  # the claim is 11 s old but has its source, which is 6 s old
    assert rdv.expire() == ([], [])


@pytest.mark.parametrize("ttl", [0, -1])
def test_ttl_must_be_positive(ttl):
    with pytest.raises(ValueError):
        Rendezvous(ttl_s=ttl)


def test_capacity_must_be_positive(rdv):
    with pytest.raises(ValueError):
        rdv.add_source(src(capacity=0))


def test_default_clock_is_monotonic():
    r = Rendezvous(ttl_s=1.0)
    r.add_registration(reg(), TARGETS)
    assert r.expire() == ([], [])
