"""The staged push path through real NIXL (UCX) agents in separate OS processes, bytes verified.

Like ``test_nixl_integration.py`` (whose ``push`` helper drives every transfer here), but every
peer owns a host staging pool (``HostBackend.alloc_staging``, registered with its NIXL agent):
the decoder reserves a slot when it registers, the producer packs its KV (torch ops on host
memory) chunk by chunk into its own pool and WRITEs each chunk into the slot, the decoder
unpacks each chunk into its blocks. Chunks are small (``staging_chunk_bytes`` 4 KiB) so every
transfer is several chunks. D's pool is filled with a canary before each transfer and every
block outside the target tokens must still hold it afterwards; D's target bytes are compared
with the logical KV the producer ranks were filled from. Counters prove which path ran.
"""

from __future__ import annotations

import numpy as np
import pytest

from kv_push.common.testing.block_ids import fragmented_blocks
from kv_push.common.testing.peer_process import PeerSpec

try:
    from conftest import (NamedPeers, assert_no_leaks, close_peers, counter, free_port_pair,
                          no_leaks_around, start_peers, wait_counter)
    from test_nixl_integration import blocks_for, push
except ModuleNotFoundError:  # imported as a package module
    from tests.conftest import (NamedPeers, assert_no_leaks, close_peers, counter,
                                free_port_pair, no_leaks_around, start_peers,
                                wait_counter)
    from tests.test_nixl_integration import blocks_for, push

pytestmark = pytest.mark.nixl

CANARY = 0x5C
HEADS = 4
STAGED = {"producer_staging_bytes": 1 << 20, "decoder_staging_bytes": 1 << 20,
          "staging_chunk_bytes": 4096}


def _producer(placement, order, block_size, *, config=None, **kw):
    cfg = {"side_channel_port": 0, **STAGED, **(config or {})}
    return PeerSpec(role="producer", placement=placement, token_order=order,
                    block_size=block_size, num_kv_heads=HEADS, config=cfg, **kw)


def _decoder(placement, order, block_size, *, config=None, **kw):
    return PeerSpec(role="decoder", placement=placement, token_order=order,
                    block_size=block_size, num_kv_heads=HEADS, config={**STAGED, **(config or {})},
                    **kw)


class Peers(NamedPeers):
    def __init__(self):
        base = free_port_pair(2)
        specs = {
            "P16": _producer("kv_split", "NHD", 16),
            "D8": _decoder("blocks_first", "HND", 8, num_blocks=512),
            "D24": _decoder("kv_split", "NHD", 24),
            "PT0": _producer("kv_split", "NHD", 16, tp_size=2, tp_rank=0, engine_id="sp-tp2",
                             config={"side_channel_port": base}),
            "PT1": _producer("kv_split", "NHD", 16, tp_size=2, tp_rank=1, engine_id="sp-tp2",
                             config={"side_channel_port": base}),
            "DT0": _decoder("blocks_first", "HND", 8, tp_size=2, tp_rank=0, engine_id="sd-tp2"),
            "DT1": _decoder("blocks_first", "HND", 8, tp_size=2, tp_rank=1, engine_id="sd-tp2"),
        }
        super().__init__(specs)


@pytest.fixture(scope="module")
def peers():
    p = Peers()
    yield p
    p.close()


@pytest.fixture(autouse=True)
def no_leaks(peers):
    yield from no_leaks_around(peers)


COUNTED = ("staged_transfers", "staged_chunks", "staged_bytes", "staged_fallback",
           "writes_posted", "bytes_written", "layerwise_streams", "layerwise_transfers",
           "layerwise_fallback")


def snap(*peers_) -> list[dict[str, float]]:
    out = []
    for p in peers_:
        c = p.call("counters")
        out.append({k: c.get(k, 0.0) for k in COUNTED} | {
            k: v for k, v in c.items() if k.startswith(("staged_fallback{",
                                                        "layerwise_fallback{"))})
    return out


def delta(before, after) -> list[dict[str, float]]:
    return [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)
             if a.get(k, 0.0) != b.get(k, 0.0)} for b, a in zip(before, after)]


def staged_push(producers, decoders, *, num_tokens, pblocks, dblocks, first_token=0,
                order="reg_first", stream=False):
    """``push`` with canaries: every D block not written must keep its canary."""
    for d in decoders:
        d.call("fill_byte", CANARY)
    before = snap(*producers, *decoders)
    push(producers, decoders, num_tokens=num_tokens, pblocks=pblocks, dblocks=dblocks,
         first_token=first_token, order=order, stream=stream)
    n = -(-(num_tokens - first_token) // decoders[0].call("geometry").block_size)
    for rank, d in enumerate(decoders):
        g = d.call("geometry")
        others = sorted(set(range(g.num_blocks)) - set(dblocks[:n]))
        assert d.call("block_bytes_equal", others, CANARY), f"D rank {rank}: a canary was hit"
    return delta(before, snap(*producers, *decoders))


def assert_all_staged(changes, n_producer_targets, n_decoder_writers):
    """Every producer rank staged ``n_producer_targets[i]`` sub-slices, every decoder rank
    unpacked ``n_decoder_writers[j]`` writers' sub-slices, nothing fell back."""
    counts = [c.get("staged_transfers", 0) for c in changes]
    assert counts == list(n_producer_targets) + list(n_decoder_writers), changes
    assert not any(c.get("staged_fallback", 0) for c in changes), changes
    # each WRITE is one staged chunk: the producers' WRITE counts are the decoders' chunk counts
    np_ = len(n_producer_targets)
    assert sum(c.get("writes_posted", 0) for c in changes[:np_]) == \
        sum(c.get("staged_chunks", 0) for c in changes[np_:]) > len(changes) - np_


# -- geometry ------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["reg_first", "prefill_first"])
@pytest.mark.parametrize("d_name,num_tokens", [
    ("D8", 61),   # kv_split NHD bs16 -> blocks_first HND bs8 (P larger; NHD into HND)
    ("D24", 100),  # kv_split NHD bs16 -> kv_split NHD bs24 (P smaller)
])
def test_staged_between_block_sizes_and_token_orders(peers, d_name, num_tokens, order):
    P, D = peers.P16, getattr(peers, d_name)
    pg, dg = P.call("geometry"), D.call("geometry")
    rng = np.random.default_rng(num_tokens)
    changes = staged_push(
        [P], [D], num_tokens=num_tokens, order=order,
        pblocks=fragmented_blocks(rng, pg.num_blocks, -(-num_tokens // pg.block_size)),
        dblocks=fragmented_blocks(rng, dg.num_blocks, -(-num_tokens // dg.block_size)))
    assert_all_staged(changes, [1], [1])
    tokens_bytes = num_tokens * HEADS * dg.vec_bytes * 2 * dg.num_layers
    assert changes[0]["staged_bytes"] == changes[1]["staged_bytes"] == tokens_bytes


def test_staged_prefix_hit_writes_only_the_tail(peers):
    P, D = peers.P16, peers.D8
    n, first = 77, 24
    tail = [310, 312, 314, 316, 318, 320, 322]
    changes = staged_push([P], [D], num_tokens=n, pblocks=blocks_for(n, 16, 100), dblocks=tail,
                          first_token=first)
    assert_all_staged(changes, [1], [1])
    g = D.call("geometry")
    assert changes[1]["staged_bytes"] == (n - first) * HEADS * g.vec_bytes * 2 * g.num_layers


# -- tensor parallelism -------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["reg_first", "prefill_first"])
def test_staged_producer_tp2_to_decoder_tp1(peers, order):
    """Two producer ranks write disjoint sub-slices of one slot of D."""
    changes = staged_push([peers.PT0, peers.PT1], [peers.D8], num_tokens=90, order=order,
                          pblocks=blocks_for(90, 16, 30),
                          dblocks=fragmented_blocks(np.random.default_rng(7), 512, 12))
    assert_all_staged(changes, [1, 1], [2])


@pytest.mark.parametrize("order", ["reg_first", "prefill_first"])
def test_staged_producer_tp1_to_decoder_tp2(peers, order):
    """One producer rank packs a sub-slice for each decoder rank (its heads for that rank)."""
    changes = staged_push([peers.P16], [peers.DT0, peers.DT1], num_tokens=90, order=order,
                          pblocks=blocks_for(90, 16, 50), dblocks=blocks_for(90, 8, 60))
    assert_all_staged(changes, [2], [1, 1])


def test_staged_producer_tp2_to_decoder_tp2(peers):
    changes = staged_push([peers.PT0, peers.PT1], [peers.DT0, peers.DT1], num_tokens=45,
                          pblocks=blocks_for(45, 16, 70), dblocks=blocks_for(45, 8, 80))
    assert_all_staged(changes, [1, 1], [1, 1])


# -- layer-wise streaming ------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["reg_first", "prefill_first"])
@pytest.mark.parametrize("d_name,num_tokens", [("D8", 61), ("D24", 100)])
def test_layerwise_stream_between_block_sizes_and_token_orders(peers, d_name, num_tokens, order):
    """The producer's blocks of each layer hold zeros until right before that layer is reported
    (``stream_prefill``): D's bytes prove every chunk was packed after its layers were
    written, and from the stream (no pack after the prefill)."""
    P, D = peers.P16, getattr(peers, d_name)
    pg, dg = P.call("geometry"), D.call("geometry")
    rng = np.random.default_rng(num_tokens + 1)
    changes = staged_push(
        [P], [D], num_tokens=num_tokens, order=order, stream=True,
        pblocks=fragmented_blocks(rng, pg.num_blocks, -(-num_tokens // pg.block_size)),
        dblocks=fragmented_blocks(rng, dg.num_blocks, -(-num_tokens // dg.block_size)))
    assert_all_staged(changes, [1], [1])
    assert changes[0]["layerwise_streams"] == changes[0]["layerwise_transfers"] == 1


def test_layerwise_stream_with_a_decoder_prefix_waits_for_the_prefill(peers):
    P, D = peers.P16, peers.D8
    n, first = 77, 24
    changes = staged_push([P], [D], num_tokens=n, pblocks=blocks_for(n, 16, 140),
                          dblocks=[330, 332, 334, 336, 338, 340, 342], first_token=first,
                          stream=True)
    assert changes[0]["layerwise_streams"] == 1 and "layerwise_transfers" not in changes[0]
    assert changes[0]["layerwise_fallback{layout}"] == 1
    assert changes[0]["staged_transfers"] == changes[1]["staged_transfers"] == 1


@pytest.mark.parametrize("order", ["reg_first", "prefill_first"])
def test_layerwise_stream_producer_tp2_to_decoder_tp1(peers, order):
    changes = staged_push([peers.PT0, peers.PT1], [peers.D8], num_tokens=90, order=order,
                          pblocks=blocks_for(90, 16, 150), stream=True,
                          dblocks=fragmented_blocks(np.random.default_rng(9), 512, 12))
    assert_all_staged(changes, [1, 1], [2])
    assert [c["layerwise_transfers"] for c in changes[:2]] == [1, 1]


def test_layerwise_stream_producer_tp1_to_decoder_tp2_falls_back_per_rank(peers):
    changes = staged_push([peers.P16], [peers.DT0, peers.DT1], num_tokens=90, stream=True,
                          pblocks=blocks_for(90, 16, 160), dblocks=blocks_for(90, 8, 100))
    assert_all_staged(changes, [2], [1, 1])
    assert changes[0]["layerwise_fallback{layout}"] == 2


# -- opaque blocks (vLLM's CPU tiles) --------------------------------------------------------------


def test_staged_opaque_blocks_move_whole():
    """Combined [K|V] blocks with an opaque interior, equal geometry: packed as whole blocks."""
    p, d = start_peers(_producer("combined", "opaque", 16), _decoder("combined", "opaque", 16))
    try:
        rng = np.random.default_rng(3)
        changes = staged_push([p], [d], num_tokens=70,
                              pblocks=fragmented_blocks(rng, 256, 5),
                              dblocks=fragmented_blocks(rng, 256, 5))
        assert_all_staged(changes, [1], [1])
        g = d.call("geometry")
        assert changes[1]["staged_bytes"] == 5 * g.block_bytes * g.num_layers  # whole blocks
        changes = staged_push([p], [d], num_tokens=70, stream=True,
                              pblocks=fragmented_blocks(rng, 256, 5),
                              dblocks=fragmented_blocks(rng, 256, 5))
        assert_all_staged(changes, [1], [1])
        assert changes[0]["layerwise_transfers"] == 1
        assert_no_leaks([p], [d])
    finally:
        close_peers(p, d)


# -- fallbacks -------------------------------------------------------------------------------------


def test_decoder_pool_exhausted_falls_back_to_regions(peers):
    """A decoder whose pool cannot hold the request registers without a slot: the region path,
    counted, bytes still verified."""
    (small,) = start_peers(_decoder("kv_split", "NHD", 24,
                                    config={"decoder_staging_bytes": 8192}))
    try:
        rng = np.random.default_rng(5)
        changes = staged_push([peers.P16], [small], num_tokens=100,
                              pblocks=fragmented_blocks(rng, 256, 7),
                              dblocks=fragmented_blocks(rng, 256, 5))
        assert changes[1].get("staged_fallback{no_slot}") == 1, changes
        assert not changes[0].get("staged_transfers") and not changes[1].get("staged_transfers")
        assert changes[0]["writes_posted"] >= 1
        assert_no_leaks([peers.P16], [small])
    finally:
        close_peers(small)


def test_producer_pool_exhausted_writes_regions_into_the_blocks(peers):
    """D offers a slot, P has no room: P writes regions into D's blocks, D unpacks nothing."""
    (small,) = start_peers(_producer("kv_split", "NHD", 16,
                                     config={"producer_staging_bytes": 4096}))
    try:
        changes = staged_push([small], [peers.D24], num_tokens=100,
                              pblocks=blocks_for(100, 16, 3), dblocks=blocks_for(100, 24, 9))
        assert changes[0].get("staged_fallback{producer_pool}") == 1, changes
        assert not changes[1].get("staged_transfers") and not changes[1].get("staged_chunks")
        assert_no_leaks([small], [peers.D24])
    finally:
        close_peers(small)


def test_producer_without_staging_gets_the_region_path(peers):
    (plain,) = start_peers(_producer("kv_split", "NHD", 16, config={"staged": "off"}))
    try:
        changes = staged_push([plain], [peers.D8], num_tokens=61,
                              pblocks=blocks_for(61, 16, 3), dblocks=blocks_for(61, 8, 100))
        assert changes[1].get("staged_fallback{peer}") == 1, changes
        assert not changes[0].get("staged_transfers")
        assert_no_leaks([plain], [peers.D8])
    finally:
        close_peers(plain)


def test_slots_are_reused_after_release(peers):
    """Many requests through a pool that holds only a few slots at once: each request either
    stages or falls back, all verified, and the pool is empty afterwards (no slot leaked)."""
    P, D = peers.P16, peers.D24
    for i in range(6):
        rng = np.random.default_rng(100 + i)
        n = int(rng.integers(20, 120))
        staged_push([P], [D], num_tokens=n, pblocks=fragmented_blocks(rng, 256, -(-n // 16)),
                    dblocks=fragmented_blocks(rng, 256, -(-n // 24)))
    assert D.call("live")["staging_slots"] == 0 and P.call("live")["staging_rooms"] == 0
    assert counter(D, "staged_transfers") >= 6


def test_concurrent_requests_share_the_pools(peers):
    """Ten requests registered at once, then their prefills in another order: their slots sit
    side by side in D's pool (and their rooms in P's), each lands in its own blocks, verified;
    requests that do not fit any more take the region path (counted). Nothing leaks."""
    P, D = peers.P16, peers.D8
    D.call("fill_byte", CANARY)
    rng = np.random.default_rng(99)
    sizes = [int(rng.integers(40, 120)) for _ in range(10)]
    pall = fragmented_blocks(rng, 256, sum(-(-n // 16) for n in sizes))
    dall = fragmented_blocks(rng, 512, sum(-(-n // 8) for n in sizes))
    addr = P.call("address")
    before = snap(P, D)
    reqs, pi, di = [], 0, 0
    for i, n in enumerate(sizes):
        pb, db = pall[pi: pi + -(-n // 16)], dall[di: di + -(-n // 8)]
        pi, di = pi + len(pb), di + len(db)
        P.call("fill", 500 + i, n, pb)
        reqs.append((f"cc-t{i}", f"cc-p{i}", f"cc-d{i}", n, pb, db, 500 + i))
    early = counter(P, "registrations_early")
    for tid, _, dkey, n, _, db, _ in reqs:
        D.call("expect", dkey, tid, 0, addr, db, 0, n)
    assert wait_counter(P, "registrations_early", early + 10) == early + 10
    assert D.call("live")["staging_slots"] >= 2  # several slots reserved at once
    for tid, pkey, _, n, pb, _, _ in reversed(reqs):
        P.call("prefill_done", pkey, tid, pb, n)
    for tid, pkey, dkey, n, pb, db, seed in reqs:
        kind, reason, _ = D.call("wait_outcome", dkey, 20)
        assert kind == "received", reason
        assert D.call("verify", seed, n, db, 0) == 0, tid
    assert sorted(P.call("wait_released", [r[1] for r in reqs], 10)) == sorted(r[1] for r in reqs)
    used = set(dall[:di])
    assert D.call("block_bytes_equal", sorted(set(range(512)) - used), CANARY)
    d = delta(before, snap(P, D))
    assert d[1].get("staged_transfers", 0) + d[1].get("staged_fallback{no_slot}", 0) == 10, d
    assert d[1].get("staged_transfers", 0) >= 2, d
