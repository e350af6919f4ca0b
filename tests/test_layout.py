"""Tests for kv_push.common.layout: write plans checked against a vector-by-vector reference.

Every side's address space is a numpy ``uint8`` array standing in for memory at a non-zero base
(``addr - base`` indexes it). Producer memories hold a known logical KV tensor
``logical[layer, K/V, token, global head]`` at the places their geometry says, and random bytes
elsewhere; the decoder memory starts as a sentinel. Applying all writers' plans must give exactly
what the reference gives by copying each (layer, K/V, token, head) vector on its own, with every
target byte written once, nothing else in D touched and nothing outside the needed vectors read.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_push.common import geometry as G
from kv_push.common.geometry import GeometryError, KVGeometry
from kv_push.common.layout import WritePlan, plan_writes, target_ranks, writer_ranks

SENTINEL = 0xA5
SRC_BASE = 1 << 32  # producer rank r's memory starts at SRC_BASE + r * SRC_RANK_STRIDE
SRC_RANK_STRIDE = 1 << 24
DST_BASE = 1 << 36


# -- helpers ---------------------------------------------------------------------------------


def valid_tps(num_kv_heads: int, limit: int = 16) -> list[int]:
    return [
        t
        for t in range(1, limit + 1)
        if (t <= num_kv_heads and num_kv_heads % t == 0) or (t > num_kv_heads and t % num_kv_heads == 0)
    ]


def make_geo(
    *,
    base: int,
    placement: str,
    order: str,
    layers: int,
    heads: int,
    head_size: int,
    dtype_bytes: int,
    block_size: int,
    num_blocks: int,
    tp: int = 1,
    rank: int = 0,
) -> KVGeometry:
    geo = G.pooled(
        base=base,
        placement=placement,
        num_layers=layers,
        num_kv_heads=heads,
        head_size=head_size,
        dtype_bytes=dtype_bytes,
        dtype=f"int{8 * dtype_bytes}",
        block_size=block_size,
        num_blocks=num_blocks,
        tp_size=tp,
        tp_rank=rank,
        token_order=order,
    )
    geo.validate()
    return geo


def pool_size(geo: KVGeometry) -> int:
    return geo.num_layers * geo.kv_parts * geo.num_blocks * geo.block_bytes


def vec_offset(geo: KVGeometry, base: int, layer: int, kv: int, block: int, tok: int, head: int) -> int:
    """Offset in the side's memory of (layer, K/V, block, token in block, *global* head)."""
    h = head - geo.head_range[0]
    assert 0 <= h < geo.local_heads and 0 <= tok < geo.block_size
    idx = tok * geo.local_heads + h if geo.token_order == "NHD" else h * geo.block_size + tok
    part = geo.part_bases[kv][layer]
    return part + block * geo.block_stride + idx * geo.vec_bytes - base


def apply_plan(
    plan: WritePlan,
    smem: np.ndarray,
    sbase: int,
    dmem: np.ndarray,
    dbase: int,
    reads: np.ndarray,
    writes: np.ndarray,
) -> None:
    """memcpy every region, counting bytes read and written; addresses must stay in memory."""
    assert plan.src.dtype == plan.dst.dtype == plan.length.dtype == np.uint64
    assert plan.src.shape == plan.dst.shape == plan.length.shape
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist()):
        assert n > 0
        s -= sbase
        d -= dbase
        assert 0 <= s and s + n <= smem.shape[0], "source region outside producer memory"
        assert 0 <= d and d + n <= dmem.shape[0], "destination region outside decoder memory"
        dmem[d : d + n] = smem[s : s + n]
        reads[s : s + n] += 1
        writes[d : d + n] += 1


def assert_within_registered_regions(plan: WritePlan, src: KVGeometry, dst: KVGeometry) -> None:
    """Every region lies inside one registered span on each side (NIXL needs that, and a GPU
    region crossing two allocations cannot be mapped)."""
    for side, geo in (("src", src), ("dst", dst)):
        spans = np.array(geo.regions(), dtype=np.int64)
        starts = spans[:, 0]
        addrs = getattr(plan, side).astype(np.int64)
        idx = np.searchsorted(starts, addrs, side="right") - 1
        assert (idx >= 0).all()
        ends = starts[idx] + spans[idx, 1]
        assert (addrs + plan.length.astype(np.int64) <= ends).all(), f"{side} region crosses spans"


def pick_blocks(rng: np.random.Generator, num_blocks: int, count: int, consecutive: bool) -> list[int]:
    if consecutive:
        first = int(rng.integers(0, num_blocks - count + 1))
        return list(range(first, first + count))
    return rng.permutation(num_blocks)[:count].tolist()


@dataclass(frozen=True)
class Case:
    layers: int
    heads: int
    head_size: int
    dtype_bytes: int
    src_bs: int
    dst_bs: int
    src_place: str
    dst_place: str
    src_order: str
    dst_order: str
    src_tp: int
    dst_tp: int
    dst_rank: int
    num_tokens: int
    first_token: int
    src_extra: int  # spare blocks in each producer pool
    dst_extra: int
    tail: int  # unused block ids passed after the needed ones (both sides)
    consecutive: bool  # block ids ascending by one (lets regions merge) instead of shuffled
    seed: int


def run_case(c: Case) -> list[WritePlan]:
    """Plan every producer rank for one decoder rank, apply, compare with the reference."""
    rng = np.random.default_rng(c.seed)
    vec = c.head_size * c.dtype_bytes
    need_s = -(-c.num_tokens // c.src_bs)
    need_d = -(-(c.num_tokens - c.first_token) // c.dst_bs)
    common = dict(layers=c.layers, heads=c.heads, head_size=c.head_size, dtype_bytes=c.dtype_bytes)
    parts = 1 if c.src_place == "combined" else 2
    logical = rng.integers(0, 256, (c.layers, parts, c.num_tokens, c.heads, vec), dtype=np.uint8)

    # Decoder side: fragmented distinct block ids.
    d_nb = max(1, need_d + c.dst_extra)
    dst = make_geo(base=DST_BASE, placement=c.dst_place, order=c.dst_order, block_size=c.dst_bs,
                   num_blocks=d_nb, tp=c.dst_tp, rank=c.dst_rank, **common)
    d_ids = pick_blocks(rng, d_nb, need_d + min(c.tail, d_nb - need_d), c.consecutive)
    dmem = np.full(pool_size(dst), SENTINEL, dtype=np.uint8)
    writes = np.zeros(dmem.shape[0], dtype=np.int32)

    # Reference: copy vector by vector from the logical tensor.
    expect = dmem.copy()
    target = np.zeros(dmem.shape[0], dtype=bool)
    dlo, dhi = dst.head_range
    for l in range(c.layers):
        for kv in range(parts):
            for t in range(c.first_token, c.num_tokens):
                j, o = divmod(t - c.first_token, c.dst_bs)
                for g in range(dlo, dhi):
                    off = vec_offset(dst, DST_BASE, l, kv, d_ids[j], o, g)
                    expect[off : off + vec] = logical[l, kv, t, g]
                    target[off : off + vec] = True

    writers = writer_ranks(c.heads, c.src_tp, c.dst_tp, c.dst_rank)
    s_nb = max(1, need_s + c.src_extra)
    plans = []
    for r in range(c.src_tp):
        sbase = SRC_BASE + r * SRC_RANK_STRIDE
        src = make_geo(base=sbase, placement=c.src_place, order=c.src_order, block_size=c.src_bs,
                       num_blocks=s_nb, tp=c.src_tp, rank=r, **common)
        s_ids = pick_blocks(rng, s_nb, need_s + min(c.tail, s_nb - need_s), c.consecutive)
        plan = plan_writes(src, s_ids, dst, d_ids, first_token=c.first_token, num_tokens=c.num_tokens)
        # planned again with the pair's checks and bases kept from the first time (layout._pair)
        again = plan_writes(src, s_ids, dst, d_ids, first_token=c.first_token,
                            num_tokens=c.num_tokens)
        assert all(np.array_equal(a, b) for a, b in zip(plan, again)) and plan[3:] == again[3:]
        assert plan.num_regions <= plan.unmerged
        if r not in writers or c.num_tokens == c.first_token:
            assert plan.num_regions == 0 and plan.total_bytes == 0
            continue
        plans.append(plan)
        assert_within_registered_regions(plan, src, dst)
        # Producer memory: the logical vectors where the geometry puts them, noise elsewhere.
        smem = rng.integers(0, 256, pool_size(src), dtype=np.uint8)
        wanted = np.zeros(smem.shape[0], dtype=np.int32)  # bytes this writer must read
        slo, shi = src.head_range
        wlo, whi = writers[r]
        assert slo <= wlo < whi <= shi
        for l in range(c.layers):
            for kv in range(parts):
                for t in range(c.num_tokens):
                    i, o = divmod(t, c.src_bs)
                    for g in range(slo, shi):
                        off = vec_offset(src, sbase, l, kv, s_ids[i], o, g)
                        smem[off : off + vec] = logical[l, kv, t, g]
                        if t >= c.first_token and wlo <= g < whi:
                            wanted[off : off + vec] = 1
        reads = np.zeros(smem.shape[0], dtype=np.int32)
        apply_plan(plan, smem, sbase, dmem, DST_BASE, reads, writes)
        np.testing.assert_array_equal(reads, wanted, err_msg="read outside the needed vectors")
        assert plan.total_bytes == int(wanted.sum())
        descs = plan.descs("dst", 3)
        assert descs.shape == (plan.num_regions, 3) and descs.dtype == np.uint64
        assert (descs[:, 0] == plan.dst).all() and (descs[:, 1] == plan.length).all()
        assert (descs[:, 2] == 3).all()
        assert (plan.descs("src", 0)[:, 0] == plan.src).all()

    # Every target byte written exactly once, nothing else touched, contents as the reference.
    np.testing.assert_array_equal(writes, target.astype(np.int32), err_msg="bytes written != once")
    np.testing.assert_array_equal(dmem, expect)
    return plans


# -- property tests ----------------------------------------------------------------------------


@st.composite
def cases(draw, tp_change: bool = False) -> Case:
    """A random scenario; with ``tp_change`` the two sides always differ in TP."""
    heads = draw(st.integers(1, 8))
    tps = valid_tps(heads)
    src_tp = draw(st.sampled_from(tps))
    dst_tp = draw(st.sampled_from([t for t in tps if t != src_tp] if tp_change else tps))
    src_bs = draw(st.integers(1, 32))
    dst_bs = draw(st.integers(1, 32))
    num_tokens = draw(st.integers(0, 80))
    first_token = dst_bs * draw(st.integers(0, num_tokens // dst_bs))
    places = ["kv_split", "blocks_first"]
    src_place, dst_place = draw(st.sampled_from(places)), draw(st.sampled_from(places))
    if draw(st.integers(0, 5)) == 0:  # one combined [K|V] part per block (vLLM CPU), both sides
        src_place = dst_place = "combined"
    return Case(
        layers=draw(st.integers(1, 3)),
        heads=heads,
        head_size=draw(st.integers(2, 8)),
        dtype_bytes=draw(st.sampled_from([1, 2, 4])),
        src_bs=src_bs,
        dst_bs=dst_bs,
        src_place=src_place,
        dst_place=dst_place,
        src_order=draw(st.sampled_from(["NHD", "HND"])),
        dst_order=draw(st.sampled_from(["NHD", "HND"])),
        src_tp=src_tp,
        dst_tp=dst_tp,
        dst_rank=draw(st.integers(0, dst_tp - 1)),
        num_tokens=num_tokens,
        first_token=first_token,
        src_extra=draw(st.integers(0, 6)),
        dst_extra=draw(st.integers(0, 6)),
        tail=draw(st.integers(0, 2)),
        consecutive=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plans_match_reference(c: Case) -> None:
    run_case(c)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(tp_change=True))
def test_plans_match_reference_across_tp(c: Case) -> None:
    run_case(c)


def _case(**kw) -> Case:
    base = dict(layers=2, heads=8, head_size=4, dtype_bytes=2, src_bs=16, dst_bs=16,
                src_place="kv_split", dst_place="kv_split", src_order="NHD", dst_order="NHD",
                src_tp=1, dst_tp=1, dst_rank=0, num_tokens=70, first_token=0,
                src_extra=3, dst_extra=3, tail=1, consecutive=False, seed=1)
    base.update(kw)
    return Case(**base)


@pytest.mark.parametrize(
    "kw",
    [
        dict(src_tp=4, dst_tp=8, dst_rank=5),
        dict(src_tp=8, dst_tp=4, dst_rank=1),
        dict(src_tp=16, dst_tp=2, dst_rank=1),  # producer replicates heads
        dict(src_tp=2, dst_tp=16, dst_rank=11),  # decoder replicates heads
        dict(src_tp=16, dst_tp=16, dst_rank=7),  # both replicate
        dict(src_bs=16, dst_bs=24, first_token=48),
        dict(src_bs=24, dst_bs=16, first_token=32),
        dict(src_order="NHD", dst_order="HND", src_tp=2, dst_tp=4, dst_rank=3),
        dict(src_order="HND", dst_order="NHD", src_bs=5, dst_bs=7, first_token=14),
        dict(src_order="HND", dst_order="HND", src_tp=4, dst_tp=1, src_place="blocks_first"),
        dict(src_place="blocks_first", dst_place="blocks_first", src_bs=1, dst_bs=32),
        dict(num_tokens=64, first_token=64),  # nothing left to write
        dict(src_place="combined", dst_place="combined", src_bs=32, dst_bs=32, src_order="HND",
             dst_order="HND", first_token=32),  # vLLM CPU layout on both sides
        dict(src_place="combined", dst_place="combined", src_tp=2, dst_tp=4, dst_rank=1),
        dict(num_tokens=1),
        dict(src_bs=32, dst_bs=32, src_tp=2, dst_tp=2, dst_rank=1),
        dict(src_bs=32, dst_bs=32, src_order="HND", dst_order="HND", num_tokens=96),
        dict(consecutive=True, src_bs=16, dst_bs=24, first_token=24),
        dict(consecutive=True, src_place="blocks_first", dst_place="blocks_first", src_tp=2,
             dst_tp=4, dst_rank=2, src_order="HND", dst_order="HND"),
    ],
)
def test_examples_match_reference(kw) -> None:
    run_case(_case(**kw))


def test_a_pair_kept_from_earlier_plans_plans_as_a_fresh_one() -> None:
    """Plans reuse what they worked out of a pair of geometries (``layout._pair``, by the
    objects' identity): many requests between the same two ranks, each with its own blocks and
    token range, plan as they do with fresh copies of both geometries; a pair that fails its
    checks fails every time; the kept pairs are bounded."""
    from kv_push.common import layout

    common = dict(layers=3, heads=4, head_size=8, dtype_bytes=2)
    src = make_geo(base=SRC_BASE, placement="kv_split", order="NHD", block_size=16,
                   num_blocks=40, tp=1, rank=0, **common)
    dst = make_geo(base=DST_BASE, placement="blocks_first", order="HND", block_size=8,
                   num_blocks=80, tp=2, rank=1, **common)
    rng = np.random.default_rng(3)
    for _ in range(50):
        num_tokens = int(rng.integers(1, 300))
        first = int(rng.integers(0, num_tokens // 8 + 1)) * 8
        s_ids = rng.permutation(40)[: -(-num_tokens // 16)].tolist()
        d_ids = rng.permutation(80)[: -(-(num_tokens - first) // 8)].tolist()
        kept = plan_writes(src, s_ids, dst, d_ids, first_token=first, num_tokens=num_tokens)
        fresh = plan_writes(msgspec.structs.replace(src), s_ids, msgspec.structs.replace(dst),
                            d_ids, first_token=first, num_tokens=num_tokens)
        assert all(np.array_equal(a, b) for a, b in zip(kept, fresh)) and kept[3:] == fresh[3:]
    assert layout._pair(src, dst) is layout._pair(src, dst)  # kept, not worked out again
    bad = msgspec.structs.replace(dst, head_size=4)  # incompatible with src
    for _ in range(2):
        with pytest.raises(GeometryError, match="head_size differs"):
            plan_writes(src, [0], bad, [0], first_token=0, num_tokens=1)
    for _ in range(layout._MAX_PAIRS + 10):
        plan_writes(msgspec.structs.replace(src), [0], dst, [0], first_token=0, num_tokens=1)
    assert len(layout._PAIRS) <= layout._MAX_PAIRS


# -- heads -----------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 8])
def test_writer_and_target_ranks_are_inverse(heads: int) -> None:
    for src_tp in valid_tps(heads):
        for dst_tp in valid_tps(heads):
            writers = {d: writer_ranks(heads, src_tp, dst_tp, d) for d in range(dst_tp)}
            for d, w in writers.items():
                lo, hi = G.head_range(heads, dst_tp, d)
                covered = []
                for s, (a, b) in w.items():
                    slo, shi = G.head_range(heads, src_tp, s)
                    assert slo <= a < b <= shi, "writer does not hold the heads it writes"
                    covered.extend(range(a, b))
                assert sorted(covered) == list(range(lo, hi)), "each dst head exactly once"
            for s in range(src_tp):
                expect = [d for d in range(dst_tp) if s in writers[d]]
                assert target_ranks(heads, src_tp, s, dst_tp) == expect


def test_writer_ranks_examples() -> None:
    assert writer_ranks(8, 4, 8, 5) == {2: (5, 6)}
    assert writer_ranks(8, 8, 4, 1) == {2: (2, 3), 3: (3, 4)}
    assert writer_ranks(8, 1, 2, 1) == {0: (4, 8)}
    # 2 heads, producer TP 8 (4 replicas each), decoder TP 4 (2 replicas each): spread.
    assert [writer_ranks(2, 8, 4, d) for d in range(4)] == [
        {0: (0, 1)}, {1: (0, 1)}, {6: (1, 2)}, {7: (1, 2)}
    ]
    assert target_ranks(2, 8, 6, 4) == [2]
    assert target_ranks(2, 8, 2, 4) == []


def test_replicas_spread_over_decoder_ranks() -> None:
    heads, src_tp, dst_tp = 2, 8, 8  # 4 producer replicas, 4 decoder replicas per head
    used = [next(iter(writer_ranks(heads, src_tp, dst_tp, d))) for d in range(dst_tp)]
    assert sorted(used) == list(range(src_tp))  # every producer replica feeds one decoder rank


def test_writer_ranks_rejects_bad_tp() -> None:
    with pytest.raises(GeometryError):
        writer_ranks(8, 3, 1, 0)
    with pytest.raises(GeometryError):
        writer_ranks(4, 1, 6, 0)
    with pytest.raises(GeometryError):
        writer_ranks(4, 1, 2, 2)
    with pytest.raises(GeometryError):
        target_ranks(4, 2, 2, 1)


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 8])
def test_one_tp_split_rule_for_geometries_and_plans(heads) -> None:
    """A geometry validates, and writer_ranks accepts a TP size, for exactly the same pairs."""
    for tp in range(1, 17):
        geo = G.pooled(base=SRC_BASE, placement="kv_split", num_layers=1, num_kv_heads=heads,
                       head_size=4, dtype_bytes=2, dtype="bfloat16", block_size=4, num_blocks=2,
                       tp_size=tp)
        try:
            geo.validate()
            valid = True
        except GeometryError as e:
            assert "TP" in str(e), e
            valid = False
        assert valid == (tp in valid_tps(heads)), (heads, tp)
        for side_of in ((tp, 1, 0), (1, tp, 0)):  # as the producer's TP, then the decoder's
            if valid:
                writer_ranks(heads, *side_of)
            else:
                with pytest.raises(GeometryError, match="producer" if side_of[0] == tp else
                                   "decoder"):
                    writer_ranks(heads, *side_of)
        assert geo.local_heads == G.local_heads(heads, tp) == max(1, heads // tp)


# -- merging and flags ----------------------------------------------------------------------


def pair(*, src_place="kv_split", dst_place="kv_split", src_order="NHD", dst_order="NHD",
         layers=3, heads=4, head_size=8, dtype_bytes=2, src_bs=16, dst_bs=16, num_blocks=20,
         src_tp=1, src_rank=0, dst_tp=1, dst_rank=0):
    common = dict(layers=layers, heads=heads, head_size=head_size, dtype_bytes=dtype_bytes,
                  num_blocks=num_blocks)
    src = make_geo(base=SRC_BASE, placement=src_place, order=src_order, block_size=src_bs,
                   tp=src_tp, rank=src_rank, **common)
    dst = make_geo(base=DST_BASE, placement=dst_place, order=dst_order, block_size=dst_bs,
                   tp=dst_tp, rank=dst_rank, **common)
    return src, dst


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("num_tokens", [80, 75])
def test_identical_layouts_merge_per_layer_and_kv(order: str, num_tokens: int) -> None:
    src, dst = pair(src_order=order, dst_order=order)
    blocks = list(range(3, 8))
    plan = plan_writes(src, blocks, dst, blocks, first_token=0, num_tokens=num_tokens)
    assert not plan.head_sliced
    if order == "NHD" or num_tokens == 80:
        assert plan.unmerged == 3 * 2 * 5
        assert plan.num_regions == 3 * 2
        assert set(plan.length.tolist()) == {num_tokens * 4 * 16}
    else:  # HND partial tail block: the tail's head 0 joins the run, heads 1..3 stand alone
        assert plan.unmerged == 3 * 2 * (4 + 4)  # 4 whole blocks, then the tail head by head
        assert plan.num_regions == 3 * 2 * 4
    assert plan.total_bytes == 3 * 2 * num_tokens * 4 * 16


def test_blocks_first_merges_k_and_v() -> None:
    src, dst = pair(src_place="blocks_first", dst_place="blocks_first")
    blocks = list(range(3, 8))
    bb = src.block_bytes
    plan = plan_writes(src, blocks, dst, blocks, first_token=0, num_tokens=80)
    assert plan.num_regions == 3 and set(plan.length.tolist()) == {2 * 5 * bb}
    assert plan.src.tolist() == [src.k_bases[l] + 3 * src.block_stride for l in range(3)]
    # A partial last block: its K continues the run, its V stands alone.
    plan = plan_writes(src, blocks, dst, blocks, first_token=0, num_tokens=75)
    part = 11 * bb // 16
    assert plan.length.tolist() == [2 * 4 * bb + part, part] * 3


def test_split_vs_blocks_first_does_not_merge_across_blocks() -> None:
    src, dst = pair(src_place="kv_split", dst_place="blocks_first")
    blocks = list(range(3, 8))
    plan = plan_writes(src, blocks, dst, blocks, first_token=0, num_tokens=80)
    assert plan.num_regions == plan.unmerged == 3 * 2 * 5


def test_mixed_block_sizes_merge_with_consecutive_blocks() -> None:
    src, dst = pair(src_bs=16, dst_bs=24, num_blocks=40)
    plan = plan_writes(src, list(range(2, 12)), dst, list(range(5, 11)), first_token=24,
                       num_tokens=150)
    assert plan.unmerged > plan.num_regions == 3 * 2
    assert set(plan.length.tolist()) == {(150 - 24) * 4 * 16}


@pytest.mark.parametrize("src_tp,dst_tp,dst_rank", [(1, 2, 1), (2, 1, 0), (4, 2, 1)])
def test_head_sliced_nhd_with_tp_change(src_tp, dst_tp, dst_rank) -> None:
    total = 0
    for s in writer_ranks(4, src_tp, dst_tp, dst_rank):
        src, dst = pair(src_tp=src_tp, src_rank=s, dst_tp=dst_tp, dst_rank=dst_rank)
        plan = plan_writes(src, range(5), dst, range(5, 10), first_token=0, num_tokens=70)
        assert plan.head_sliced
        assert plan.num_regions == plan.unmerged == 3 * 2 * 70  # one region per token
        total += plan.total_bytes
    assert total == 3 * 2 * 70 * (4 // dst_tp) * 16


def test_hnd_with_tp_change_is_not_head_sliced() -> None:
    src, dst = pair(src_order="HND", dst_order="HND", dst_tp=2, dst_rank=1)
    plan = plan_writes(src, range(5), dst, range(5), first_token=0, num_tokens=80)
    assert not plan.head_sliced
    assert plan.num_regions == 3 * 2 * 5  # one region per whole block (a head slice of it)
    src, dst = pair(dst_tp=1)
    assert not plan_writes(src, range(5), dst, range(5), first_token=0, num_tokens=80).head_sliced


def test_non_writer_gets_empty_plan() -> None:
    src, dst = pair(heads=8, src_tp=8, src_rank=7, dst_tp=2, dst_rank=0)
    plan = plan_writes(src, range(5), dst, range(5), first_token=0, num_tokens=70)
    assert plan.num_regions == 0 and plan.total_bytes == 0 and plan.unmerged == 0
    assert plan.descs("src", 0).shape == (0, 3)


def test_descs_rejects_bad_side() -> None:
    src, dst = pair()
    plan = plan_writes(src, range(5), dst, range(5), first_token=0, num_tokens=70)
    with pytest.raises(ValueError):
        plan.descs("both", 0)


# -- errors ----------------------------------------------------------------------------------


def _errors():
    src, dst = pair()
    other, _ = pair(layers=2)
    fp8, _ = pair(dtype_bytes=1)
    ok = dict(first_token=16, num_tokens=70)
    return [
        ("num_layers", other, range(5), dst, range(4), ok),
        ("dtype_bytes", fp8, range(5), dst, range(4), ok),
        ("outside", src, [0, 1, 2, 3, 20], dst, range(4), ok),
        ("outside", src, range(5), dst, [0, -1, 2, 3], ok),
        ("producer blocks", src, range(4), dst, range(4), ok),
        ("decoder blocks", src, range(5), dst, range(3), ok),
        ("multiple", src, range(5), dst, range(4), dict(first_token=8, num_tokens=70)),
        ("past", src, range(5), dst, range(4), dict(first_token=80, num_tokens=70)),
        ("negative", src, range(5), dst, range(4), dict(first_token=-16, num_tokens=70)),
        ("negative", src, range(5), dst, range(4), dict(first_token=0, num_tokens=-1)),
        ("integer", src, range(5), dst, range(4), dict(first_token=16.0, num_tokens=70)),
        ("twice", src, range(5), dst, [1, 2, 1, 3], ok),
        ("integers", src, [0.0, 1.0, 2.0, 3.0, 4.0], dst, range(4), ok),
        ("positive", msgspec.structs.replace(src, num_blocks=0), range(5), dst, range(4), ok),
    ]


@pytest.mark.parametrize("match,src,sblocks,dst,dblocks,kw", _errors())
def test_bad_input_raises(match, src, sblocks, dst, dblocks, kw) -> None:
    with pytest.raises(GeometryError, match=match):
        plan_writes(src, sblocks, dst, dblocks, **kw)


# -- a realistic size (its speed is measured in benchmarks/, not asserted here) ----------------


def test_planning_16k_tokens_covers_every_byte() -> None:
    """16k tokens, 64 layers, 8 heads x 128 bf16, block 16, TP1->TP1, fragmented blocks."""
    kw = dict(placement="kv_split", order="NHD", layers=64, heads=8, head_size=128,
              dtype_bytes=2, block_size=16, num_blocks=4096)
    src = make_geo(base=SRC_BASE, **kw)
    dst = make_geo(base=DST_BASE, **kw)
    rng = np.random.default_rng(0)
    sb = rng.permutation(4096)[:1024].tolist()
    db = rng.permutation(4096)[:1024].tolist()
    plan = plan_writes(src, sb, dst, db, first_token=0, num_tokens=16384)
    assert plan.total_bytes == 16384 * 64 * 2 * 8 * 128 * 2
    assert plan.num_regions <= 64 * 2 * 1024


# -- opaque block interiors (vLLM CPU) -------------------------------------------------------


def test_opaque_blocks_are_copied_whole_including_a_partial_last_block() -> None:
    kw = dict(placement="combined", order="opaque", layers=2, heads=2, head_size=8,
              dtype_bytes=2, block_size=32, num_blocks=16)
    src = make_geo(base=SRC_BASE, **kw)
    dst = make_geo(base=DST_BASE, **kw)
    plan = plan_writes(src, [5, 2, 9], dst, [7, 1], first_token=32, num_tokens=70)
    bb = src.block_bytes
    got = sorted(zip((plan.src - SRC_BASE).tolist(), (plan.dst - DST_BASE).tolist(),
                     plan.length.tolist()))
    layer = 16 * bb
    want = sorted((l * layer + sb * bb, l * layer + db * bb, bb)
                  for l in range(2) for sb, db in ((2, 7), (9, 1)))
    assert got == want  # blocks 2->7 and 9->1 whole, though only 6 tokens of block 9 are used


@pytest.mark.parametrize("change", [dict(block_size=16), dict(tp=2, heads=2)])
def test_opaque_blocks_need_identical_geometry(change) -> None:
    kw = dict(placement="combined", order="opaque", layers=1, heads=2, head_size=8,
              dtype_bytes=2, block_size=32, num_blocks=8)
    src = make_geo(base=SRC_BASE, **kw)
    dst = make_geo(base=DST_BASE, **{**kw, **change})
    with pytest.raises(GeometryError, match="opaque"):
        plan_writes(src, [0], dst, [0], first_token=0, num_tokens=10)


@pytest.mark.parametrize("placement", ["kv_split", "blocks_first", "combined"])
def test_regions_never_cross_layers_even_when_memory_is_contiguous(placement) -> None:
    """A pool using every block in order is one contiguous range, yet layers (and kv_split
    parts) are registered, and so must be written, separately: adjacent tensors are distinct
    device allocations."""
    kw = dict(placement=placement, order="NHD", layers=3, heads=2, head_size=4, dtype_bytes=2,
              block_size=4, num_blocks=4)
    src = make_geo(base=SRC_BASE, **kw)
    dst = make_geo(base=DST_BASE, **kw)
    plan = plan_writes(src, [0, 1, 2, 3], dst, [0, 1, 2, 3], first_token=0, num_tokens=16)
    spans = 3 if placement != "kv_split" else 6
    assert plan.num_regions == spans == len(src.regions())
    assert_within_registered_regions(plan, src, dst)


def test_fragmentation_tells_a_transposing_pair_from_a_matching_one() -> None:
    from kv_push.common.layout import fragmentation

    assert fragmentation(*pair()) == 1.0
    assert fragmentation(*pair(src_place="blocks_first")) == 1.0
    assert fragmentation(*pair(src_bs=32)) == 1.0  # a P block fills two D blocks whole
    assert fragmentation(*pair(dst_bs=32)) == 2.0  # two P blocks per D block
    # head-major blocks of another size: one region per head and P block
    assert fragmentation(*pair(src_order="HND", dst_order="HND", dst_bs=32)) == 4 * 2
    # NHD against HND: one region per (token, head) where equal layouts need one per block part
    assert fragmentation(*pair(src_order="NHD", dst_order="HND")) == 16 * 4
    assert fragmentation(*pair(src_order="HND", dst_order="NHD")) == 16 * 4
    # a TP split out of token-major blocks: per-token head slices; head-major ones split whole
    assert fragmentation(*pair(dst_tp=2)) == 16
    assert fragmentation(*pair(src_order="HND", dst_order="HND", dst_tp=2)) == 1.0
