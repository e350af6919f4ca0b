"""The core data path through real NIXL (UCX) agents in separate OS processes, bytes verified.

Every test drives producer (P) and decoder (D) ``PushWorker``s, each in its own spawned process
over a synthetic host pool (``LocalPeer``), through the real push path: handshake over the side
channel, registration as a NIXL notification, rendezvous with the prefill, WRITE with the
``WriteDone`` notification, release of P's source blocks. D's bytes are then compared with the
logical KV the producer ranks were filled from (``verify`` checks that D rank's heads only).

Processes are module-scoped and reused (each test uses fresh transfer ids); after every test no
producer may hold sources, jobs, rendezvous entries or transfers and no decoder may hold wants.
"""

from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest

from kv_push.common.layout import writer_ranks
from kv_push.common.testing.block_ids import fragmented_blocks
from kv_push.common.testing.peer_process import PeerSpec

try:
    from conftest import (NamedPeers, assert_no_leaks, close_peers, counter, free_port_pair,
                          no_leaks_around, start_peers, wait_counter)
except ModuleNotFoundError:  # imported as a package module
    from tests.conftest import (NamedPeers, assert_no_leaks, close_peers, counter,
                                free_port_pair, no_leaks_around, start_peers, wait_counter)

pytestmark = pytest.mark.nixl

CANARY = 0xA5
HEADS = 4  # model KV heads on every peer here (TP 1, 2 and 4 all split them evenly)
_ids = itertools.count()


def uid(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def _producer(placement, order, block_size, **kw):
    kw.setdefault("config", {"side_channel_port": 0})
    return PeerSpec(role="producer", placement=placement, token_order=order,
                    block_size=block_size, num_kv_heads=HEADS, **kw)


def _decoder(placement, order, block_size, **kw):
    return PeerSpec(role="decoder", placement=placement, token_order=order,
                    block_size=block_size, num_kv_heads=HEADS, **kw)


class Peers(NamedPeers):
    """The module's processes, by name; ``ptp``/``dtp`` are TP groups (rank order)."""

    def __init__(self):
        base = free_port_pair(2)
        specs = {
            "P16": _producer("kv_split", "NHD", 16),
            "P8": _producer("blocks_first", "HND", 8),
            "Pc": _producer("combined", "NHD", 16),
            "D8": _decoder("blocks_first", "HND", 8, num_blocks=512),
            "D24": _decoder("kv_split", "NHD", 24),
            "Dc": _decoder("combined", "HND", 8),
            # producer TP 2: one engine, rank r listens on base + r
            "PT0": _producer("kv_split", "NHD", 16, tp_size=2, tp_rank=0, engine_id="ptp2-engine",
                             config={"side_channel_port": base}),
            "PT1": _producer("kv_split", "NHD", 16, tp_size=2, tp_rank=1, engine_id="ptp2-engine",
                             config={"side_channel_port": base}),
            # decoder TP 2: one engine, two ranks
            "DT0": _decoder("blocks_first", "HND", 8, tp_size=2, tp_rank=0,
                             engine_id="dtp2-engine"),
            "DT1": _decoder("blocks_first", "HND", 8, tp_size=2, tp_rank=1,
                             engine_id="dtp2-engine"),
        }
        super().__init__(specs)
        self.ptp = [self.PT0, self.PT1]
        self.dtp = [self.DT0, self.DT1]


@pytest.fixture(scope="module")
def peers():
    p = Peers()
    yield p
    p.close()


@pytest.fixture(autouse=True)
def no_leaks(peers):
    yield from no_leaks_around(peers)


def registers_with(p_tp: int, d_tp: int, d: int) -> list[int]:
    """Producer ranks decoder rank ``d`` registers with (rank 0: all of them, so that ranks
    that write nothing still hear of the transfer; others: the ranks that write to them)."""
    return list(range(p_tp)) if d == 0 else sorted(writer_ranks(HEADS, p_tp, d_tp, d))


def registrations_expected(p_tp: int, d_tp: int, ranks=None) -> list[int]:
    """Registrations each producer rank receives from decoder ``ranks`` (default: all)."""
    out = [0] * p_tp
    for d in range(d_tp) if ranks is None else ranks:
        for r in registers_with(p_tp, d_tp, d):
            out[r] += 1
    return out


def push(producers, decoders, *, num_tokens: int, pblocks, dblocks, first_token: int = 0,
         order: str = "reg_first", seed: int | None = None, check_order: bool = True,
         last_rank_first: bool = False, stream: bool = False) -> dict:
    """One transfer through the real path from a producer TP group to a decoder TP group.

    ``order``: "reg_first" (every registration reaches P before its prefill is done) or
    "prefill_first". ``last_rank_first`` (with "reg_first"): decoder ranks register one after
    the other from the last, so producers pair the registrations in that order. Checks every
    decoder rank's outcome and bytes, that every producer rank released its source, and the
    producers' early/late registration counters. ``stream``: the prefill is streamed layer by
    layer (``PeerServer.stream_prefill``: each layer's bytes appear right before it is
    reported) instead of handed over whole."""
    prefill = "stream_prefill" if stream else "prefill_done"
    seed = random.randrange(1 << 30) if seed is None else seed
    tid, pkey, dkey = uid("t"), uid("p"), uid("d")
    addr = producers[0].call("address")
    for p in producers:
        p.call("fill", seed, num_tokens, pblocks)
    want = registrations_expected(len(producers), len(decoders))
    name = "registrations_early" if order == "reg_first" else "registrations_late"
    before = [counter(p, name) for p in producers]
    t0 = time.monotonic()
    if order == "reg_first":
        ranks = list(range(len(decoders)))
        steps = [ranks[::-1][: i + 1] for i in ranks] if last_rank_first else [ranks]
        for step in steps:  # one rank at a time (and waited for), or all at once
            for d in step[-1:] if last_rank_first else step:
                decoders[d].call("expect", dkey, tid, 0, addr, dblocks, first_token, num_tokens)
            got = registrations_expected(len(producers), len(decoders), step)
            for p, b, w in zip(producers, before, got):
                if wait_counter(p, name, b + w) < b + w:
                    raise AssertionError(
                        f"registrations did not reach P: {[counter(q, name) for q in producers]}"
                        f" from {before}, want +{got}; decoders' outcomes so far: "
                        f"{[d.call('poll_outcomes') for d in decoders]}")
        for p in producers:
            p.call(prefill, pkey, tid, pblocks, num_tokens)
    else:
        for p in producers:
            p.call(prefill, pkey, tid, pblocks, num_tokens)
            p.call("live")  # a barrier: the transfer thread has taken the prefill in
        for d in decoders:
            d.call("expect", dkey, tid, 0, addr, dblocks, first_token, num_tokens)
    outcomes = [d.call("wait_outcome", dkey, 15) for d in decoders]
    latency = time.monotonic() - t0
    assert all(o is not None and o[0] == "received" for o in outcomes), outcomes
    for rank, d in enumerate(decoders):
        bad = d.call("verify", seed, num_tokens, dblocks, first_token)
        assert bad == 0, f"decoder rank {rank}: {bad} bytes differ"
    for rank, p in enumerate(producers):
        assert p.call("wait_released", [pkey], 5) == [pkey], f"P rank {rank} kept its source"
    if check_order:
        after = [counter(p, name) for p in producers]
        assert [a - b for a, b in zip(after, before)] == want, (name, before, after, want)
    return {"tid": tid, "latency": latency, "seed": seed}


def blocks_for(tokens: int, block_size: int, start: int = 0) -> list[int]:
    return list(range(start, start + -(-tokens // block_size)))


# -- ordering ----------------------------------------------------------------------------------


def test_registration_before_prefill(peers):
    push([peers.P16], [peers.D8], num_tokens=77, pblocks=blocks_for(77, 16, 10),
         dblocks=blocks_for(77, 8, 40), order="reg_first")


def test_prefill_before_registration(peers):
    before = counter(peers.P16, "registrations_early")
    push([peers.P16], [peers.D8], num_tokens=77, pblocks=blocks_for(77, 16, 10),
         dblocks=blocks_for(77, 8, 40), order="prefill_first")
    assert counter(peers.P16, "registrations_early") == before


# -- geometry: block sizes, placements, token orders --------------------------------------------


@pytest.mark.parametrize("order", ["reg_first", "prefill_first"])
@pytest.mark.parametrize("p_name,d_name,num_tokens", [
    ("P16", "D8", 61),    # kv_split NHD bs16 -> blocks_first HND bs8 (P larger)
    ("P8", "D24", 61),    # blocks_first HND bs8 -> kv_split NHD bs24 (P smaller)
    ("P16", "D24", 100),  # kv_split -> kv_split, NHD -> NHD, 16 -> 24
    ("P8", "D8", 64),     # blocks_first HND -> blocks_first HND, same block size (merged runs)
    ("Pc", "Dc", 53),     # combined [K|V] NHD bs16 -> combined [K|V] HND bs8 (vLLM CPU)
])
def test_geometry_pairs(peers, p_name, d_name, num_tokens, order):
    P, D = getattr(peers, p_name), getattr(peers, d_name)
    pg, dg = P.call("geometry"), D.call("geometry")
    rng = np.random.default_rng(num_tokens)
    pblocks = fragmented_blocks(rng, pg.num_blocks, -(-num_tokens // pg.block_size))
    dblocks = fragmented_blocks(rng, dg.num_blocks, -(-num_tokens // dg.block_size))
    push([P], [D], num_tokens=num_tokens, pblocks=pblocks, dblocks=dblocks, order=order)


# -- decoder prefix-cache hits -----------------------------------------------------------------


def test_prefix_hit_writes_only_the_tail(peers):
    P, D = peers.P16, peers.D8
    n, first = 77, 24  # D already has tokens [0, 24): three of its 8-token blocks
    head = [300, 301, 302]  # where D keeps those tokens; P never hears of them
    tail = [310, 312, 314, 316, 318, 320, 322]  # tokens 24..76 (53 tokens, 7 blocks)
    D.call("fill_byte", CANARY)
    written_before = counter(P, "bytes_written")
    push([P], [D], num_tokens=n, pblocks=blocks_for(n, 16, 100), dblocks=tail, first_token=first)
    assert D.call("block_bytes_equal", head, CANARY), "a prefix-cached block on D was written"
    # only the tail crossed: (77 - 24) tokens x heads x vec x K/V x layers
    g = D.call("geometry")
    tail_bytes = (n - first) * HEADS * g.vec_bytes * 2 * g.num_layers
    assert counter(P, "bytes_written") - written_before == tail_bytes


@pytest.mark.parametrize("order", ["reg_first", "prefill_first"])
def test_full_prefix_hit_releases_at_once(peers, order):
    """D has every token: nothing is written, D gets 'received' and P releases at once."""
    P, D = peers.P16, peers.D8
    D.call("fill_byte", CANARY)
    writes_before = counter(P, "writes_posted")
    push([P], [D], num_tokens=64, pblocks=blocks_for(64, 16, 120), dblocks=[], first_token=64,
         order=order, check_order=False)
    assert counter(P, "writes_posted") == writes_before
    assert D.call("block_bytes_equal", list(range(512)), CANARY)


# -- tensor parallelism ------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["reg_first", "prefill_first"])
def test_producer_tp2_to_decoder_tp1(peers, order):
    push(peers.ptp, [peers.D8], num_tokens=90, pblocks=blocks_for(90, 16, 30),
         dblocks=fragmented_blocks(np.random.default_rng(7), 512, 12), order=order)


@pytest.mark.parametrize("order", ["reg_first", "prefill_first"])
def test_producer_tp1_to_decoder_tp2(peers, order):
    push([peers.P16], peers.dtp, num_tokens=90, pblocks=blocks_for(90, 16, 50),
         dblocks=blocks_for(90, 8, 60), order=order)


@pytest.mark.parametrize("last_rank_first", [False, True])
def test_producer_tp2_to_decoder_tp2(peers, last_rank_first):
    """P rank 1 hears from D rank 0 (to which it writes nothing) and D rank 1. With D rank 1's
    registration paired first, P rank 1's only WRITE can finish at its first poll and retire the
    transfer before D rank 0's pairing is looked at (that once re-created the transfer: a leak)."""
    for _ in range(3 if last_rank_first else 1):
        push(peers.ptp, peers.dtp, num_tokens=45, pblocks=blocks_for(45, 16, 70),
             dblocks=blocks_for(45, 8, 80), last_rank_first=last_rank_first)
        assert_no_leaks(peers.ptp, peers.dtp)


def test_producer_tp2_to_decoder_tp4(peers, figures):
    """P rank 1 writes nothing to D ranks 0 and 1 (they hold heads 0 and 1 of P rank 0) yet
    hears from D rank 0, and must still release its source once D ranks 2 and 3 are written."""
    t0 = time.monotonic()
    dtp4 = start_peers(*[_decoder("kv_split", "NHD", 16, tp_size=4, tp_rank=r,
                                   engine_id="dtp4-engine") for r in range(4)])
    figures("integration", "start 4 decoder processes (TP 4)", time.monotonic() - t0)
    try:
        for order in ("reg_first", "prefill_first"):
            push(peers.ptp, dtp4, num_tokens=70, pblocks=blocks_for(70, 16, 90),
                 dblocks=blocks_for(70, 16, 20), order=order)
        assert_no_leaks(peers.ptp, dtp4)
    finally:
        close_peers(*dtp4)


# -- attempts ----------------------------------------------------------------------------------


def test_reissued_attempt_gets_data_and_old_attempt_is_stale(peers):
    P, D = peers.P16, peers.D8
    d_engine, p_engine = D.call("engine_id"), P.call("engine_id")
    addr = P.call("address")
    n, seed = 50, 4242
    tid, key, pkey = uid("t"), uid("d"), uid("p")
    old_blocks = [200, 201, 202, 203, 204, 205, 206]
    new_blocks = [210, 212, 214, 216, 218, 220, 222]
    P.call("fill", seed, n, blocks_for(n, 16, 140))
    D.call("fill_blocks", old_blocks + new_blocks, CANARY)

    early = counter(P, "registrations_early")
    D.call("expect", key, tid, 0, addr, old_blocks, 0, n)
    assert wait_counter(P, "registrations_early", early + 1) == early + 1
    D.call("cancel", key)
    kind, reason, _ = D.call("wait_outcome", key, 5)
    assert kind == "released", reason

    # the re-issued request: attempt 1, other blocks, same transfer id
    D.call("expect", key, tid, 1, addr, new_blocks, 0, n)
    assert wait_counter(P, "registrations_early", early + 2) == early + 2
    # a late WriteDone for attempt 0 (as if its WRITE had been in flight): stale, not delivered
    stale_d = counter(D, "stale{WriteDone}")
    assert P.call("inject", "WriteDone", {"transfer_id": tid, "reg_id": key, "attempt": 0,
                                          "num_bytes": 1}, to_engine=d_engine) == 1
    assert wait_counter(D, "stale{WriteDone}", stale_d + 1) == stale_d + 1
    assert D.call("wait_outcome", key, 0.3) is None, "a stale WriteDone completed the request"
    # a late registration for attempt 0 reaching P after attempt 1: stale, dropped
    stale_p = counter(P, "rejected{stale}")
    assert D.call("inject", "Register", {
        "transfer_id": tid, "reg_id": key, "attempt": 0, "block_ids": old_blocks, "first_token": 0,
        "num_tokens": n}, to_engine=p_engine) == 1
    assert wait_counter(P, "rejected{stale}", stale_p + 1) == stale_p + 1

    P.call("prefill_done", pkey, tid, blocks_for(n, 16, 140), n)
    kind, reason, _ = D.call("wait_outcome", key, 10)
    assert kind == "received", reason
    assert D.call("verify", seed, n, new_blocks, 0) == 0
    assert D.call("block_bytes_equal", old_blocks, CANARY), "attempt 0's blocks were written"
    assert P.call("wait_released", [pkey], 5) == [pkey]
    assert counter(P, "writes_posted") >= 1


# -- many at once --------------------------------------------------------------------------------


def test_many_concurrent_fragmented(peers, figures):
    """32 requests in flight together, fragmented block ids on both sides, mixed orders."""
    P, D = peers.P16, peers.D8
    rng = np.random.default_rng(2024)
    count = 32
    sizes = [int(rng.integers(1, 64)) for _ in range(count)]
    pall = fragmented_blocks(rng, 256, sum(-(-n // 16) for n in sizes))
    dall = fragmented_blocks(rng, 512, sum(-(-n // 8) for n in sizes))
    addr = P.call("address")
    reqs = []
    pi = di = 0
    for i, n in enumerate(sizes):
        pb = pall[pi: pi + -(-n // 16)]
        db = dall[di: di + -(-n // 8)]
        pi, di = pi + len(pb), di + len(db)
        seed = 1000 + i
        P.call("fill", seed, n, pb)
        reqs.append((uid("t"), uid("p"), uid("d"), n, pb, db, seed))
    order = list(range(count))
    random.Random(5).shuffle(order)
    t0 = time.monotonic()
    # interleave: even requests register first, odd ones have their prefill done first
    for i in order:
        tid, pkey, dkey, n, pb, db, _ = reqs[i]
        if i % 2:
            P.call("prefill_done", pkey, tid, pb, n)
        else:
            D.call("expect", dkey, tid, 0, addr, db, 0, n)
    for i in order:
        tid, pkey, dkey, n, pb, db, _ = reqs[i]
        if i % 2:
            D.call("expect", dkey, tid, 0, addr, db, 0, n)
        else:
            P.call("prefill_done", pkey, tid, pb, n)
    outcomes = {r[2]: D.call("wait_outcome", r[2], 20) for r in reqs}
    elapsed = time.monotonic() - t0
    assert all(o is not None and o[0] == "received" for o in outcomes.values()), outcomes
    bad = {r[2]: D.call("verify", r[6], r[3], r[5], 0) for r in reqs}
    assert not any(bad.values()), bad
    assert sorted(P.call("wait_released", [r[1] for r in reqs], 10)) == sorted(r[1] for r in reqs)
    figures("integration", f"{count} concurrent fragmented requests, all verified", elapsed,
            f"{sum(sizes)} tokens")


def test_cancel_during_first_handshake_still_frees_the_producer(peers):
    """D cancels before its handshake with a new producer finished: D is released at once (it
    advertised no blocks) and P, once the handshake ends, still learns that nothing is wanted and
    frees its prefill blocks without waiting for its rendezvous time-out (120 s)."""
    (fresh,) = start_peers(_producer("kv_split", "NHD", 16))
    try:
        d = peers.D24
        tid, key = uid("t-hs-cancel"), uid("r")
        dblocks = blocks_for(64, 24)
        d.call("expect", key, tid, 0, fresh.call("address"), dblocks, 0, 64)
        d.call("cancel", key)  # same inbox drain: the handshake is still running
        kind, _, _ = d.call("wait_outcome", key, 10)
        assert kind == "released"
        pblocks = blocks_for(64, 16)
        fresh.call("prefill_done", "src-" + key, tid, pblocks, 64)
        released = fresh.call("wait_released", ["src-" + key], 10)
        assert released == ["src-" + key], "producer kept its blocks after the decoder let go"
        assert fresh.call("counters").get("bytes_written", 0) == 0
        assert_no_leaks([fresh], [d])
    finally:
        close_peers(fresh)


def test_long_write_is_posted_in_chunks_and_counted_whole(peers):
    """With tiny chunk limits one transfer becomes many WRITEs, each with its own notice; D has
    the KV only when all of them arrived, bytes verified."""
    (chunky,) = start_peers(_producer("kv_split", "NHD", 16,
                                      config={"side_channel_port": 0, "max_post_regions": 3,
                                              "max_post_bytes": 4096}))
    try:
        d = peers.D24
        n, tid, key = 200, uid("t-chunks"), uid("r")
        pblocks = fragmented_blocks(np.random.default_rng(5), 256, -(-n // 16))
        dblocks = blocks_for(n, 24)
        chunky.call("fill", 77, n, pblocks)
        d.call("expect", key, tid, 0, chunky.call("address"), dblocks, 0, n)
        chunky.call("prefill_done", "src-" + key, tid, pblocks, n)
        kind, reason, _ = d.call("wait_outcome", key, 30)
        assert kind == "received", reason
        assert d.call("verify", 77, n, dblocks, 0) == 0
        c = chunky.call("counters")
        assert c["writes_posted"] > 5 and c["transfers_done"] == 1
        assert chunky.call("wait_released", ["src-" + key], 10) == ["src-" + key]
        assert_no_leaks([chunky], [d])
    finally:
        close_peers(chunky)


@pytest.mark.parametrize("direction", ["neuron_to_cuda", "cuda_to_neuron"])
def test_cross_vendor_layouts(direction):
    """Neuron's KV (K and V as separate regions, head-major, vllm-neuron's block size 32) into a
    CUDA decoder's (FlashInfer-style blocks-first, token-major, block size 16), and the reverse:
    the two vendors' layouts in host memory, over real NIXL, bytes verified."""
    neuron = dict(placement="kv_split", order="HND", block_size=32)
    cuda = dict(placement="blocks_first", order="NHD", block_size=16)
    p_kw, d_kw = (neuron, cuda) if direction == "neuron_to_cuda" else (cuda, neuron)
    p, d = start_peers(_producer(**p_kw), _decoder(**d_kw))
    try:
        n = 333
        rng = np.random.default_rng(11)
        push([p], [d], num_tokens=n,
             pblocks=fragmented_blocks(rng, 256, -(-n // p_kw["block_size"])),
             dblocks=fragmented_blocks(rng, 256, -(-n // d_kw["block_size"])))
        assert_no_leaks([p], [d])
    finally:
        close_peers(p, d)
