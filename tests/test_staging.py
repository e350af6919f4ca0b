"""Tests for the staged path's pure parts: kv_push.common.staging (slot layout, gather/scatter
plans), staging_ops (torch pack/unpack, here on CPU tensors; a ``cuda``-marked case runs the same
on a GPU) and staging_pool (slot allocator).

End to end per case: every producer (P) rank's cache holds a known logical KV tensor
``logical[layer, K/V, token, global head]`` where its geometry says (random bytes elsewhere);
each writer packs its sub-slice chunk by chunk into its own staging buffer, the bytes are copied
into D's slot at the writer's offset (standing in for the NIXL WRITE), and D unpacks every chunk
into its cache. D's cache must then equal the token-by-token reference (test_layout's), every byte
outside the target tokens and heads must still hold the canary, nothing around the staging
buffers may be touched, and -- from the plans alone -- every target byte of D is written exactly
once and every needed byte of P read exactly once.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_push.common.geometry import GeometryError, KVGeometry
from kv_push.common.staging import (
    WRITER_ALIGN, StagingPlan, gather_plan, layers_per_chunk, pack_plan, scatter_plan,
    slot_bytes, slot_layout, unpack_plans,
)
from kv_push.common.staging_ops import CacheViews, DevicePlan, pack, unpack, wrap_memory
from kv_push.common.staging_pool import StagingPool
from test_layout import Case, _case, cases, make_geo, pick_blocks, pool_size, vec_offset

SENTINEL = 0xA5  # D's cache before the transfer
CANARY = 0x3C  # staging buffers and the guards around every buffer
GUARD = 256  # bytes of canary before and after every buffer (keeps 8-byte alignment)
FAKE = 1 << 32  # base address for geometries that only feed index math


# -- memory ----------------------------------------------------------------------------------


class Mem:
    """A byte buffer on ``device`` with GUARD canary bytes on each side."""

    def __init__(self, nbytes: int, fill: int, device: str = "cpu"):
        self.n = nbytes
        self.t = torch.full((nbytes + 2 * GUARD,), CANARY, dtype=torch.uint8, device=device)
        self.body = self.t[GUARD: GUARD + nbytes]
        self.body.fill_(fill)
        self.base = self.body.data_ptr()

    def load(self, arr: np.ndarray) -> None:
        self.body.copy_(torch.from_numpy(arr))

    def host(self) -> np.ndarray:
        return self.body.cpu().numpy().copy()

    def guards_ok(self) -> bool:
        raw = self.t.cpu().numpy()
        return bool((raw[:GUARD] == CANARY).all() and (raw[GUARD + self.n:] == CANARY).all())


def plan_positions(plan: StagingPlan, geo: KVGeometry, base: int) -> np.ndarray:
    """Offsets from ``base`` of the bytes a plan moves, in canonical order (a model of the plan
    that does not use staging_ops)."""
    out = [np.zeros(0, dtype=np.int64)]
    for layer in range(plan.num_layers):
        for p in range(plan.kv_parts):
            pb = geo.part_bases[p][layer] - base
            off = 0
            for seg in plan.segments:
                assert seg.staging_offset == off, "segments do not tile the run in order"
                assert ((seg.rows >= 0) & (seg.rows < seg.view.rows)).all()
                starts = pb + seg.view.offset + seg.rows * seg.view.row_stride
                out.append((starts[:, None] + np.arange(seg.view.row_bytes)).ravel())
                off += seg.nbytes
            assert off == plan.part_bytes
    return np.concatenate(out)


def corrupt_rows(plan: StagingPlan) -> StagingPlan:
    """Swap the first two rows of the longest segment (a plausible off-by-order bug)."""
    segs = list(plan.segments)
    k = max(range(len(segs)), key=lambda i: segs[i].rows.shape[0])
    rows = segs[k].rows.copy()
    rows[[0, 1]] = rows[[1, 0]]
    segs[k] = segs[k]._replace(rows=rows, first_row=-1)
    return dataclasses.replace(plan, segments=tuple(segs))


def duplicate_row(plan: StagingPlan) -> StagingPlan:
    """Move the second row of the longest segment onto the first (one row written twice)."""
    segs = list(plan.segments)
    k = max(range(len(segs)), key=lambda i: segs[i].rows.shape[0])
    rows = segs[k].rows.copy()
    rows[1] = rows[0]
    segs[k] = segs[k]._replace(rows=rows, first_row=-1)
    return dataclasses.replace(plan, segments=tuple(segs))


def shift_staging(plan: StagingPlan) -> StagingPlan:
    """Move the rows by one row within the view (reads / writes the neighbour's bytes)."""
    segs = list(plan.segments)
    seg = segs[0]
    rows = np.minimum(seg.rows + 1, seg.view.rows - 1)
    segs[0] = seg._replace(rows=rows, first_row=-1)
    return dataclasses.replace(plan, segments=tuple(segs))


# -- the end-to-end check ----------------------------------------------------------------------


def _kernels(kernel: str, geo: KVGeometry, device: str, stream):
    """(prepare, pack, unpack) for ``kernel``: ``torch`` (staging_ops; ``prepare`` None when
    plans go in as they are) or ``triton`` (staging_triton's fused kernels)."""
    if kernel == "torch":
        views = CacheViews(geo, device=device)
        return views, (lambda plan: DevicePlan(plan, device, stream=stream)), \
            (lambda *a, **k: pack(views, *a, **k)), (lambda *a, **k: unpack(views, *a, **k))
    from kv_push.common import staging_triton as ST

    cache = ST.FusedCache(geo, device, stream=stream)
    return cache, (lambda plan: ST.FusedPlan(plan, cache, stream=stream)), ST.pack, ST.unpack


def run_staged(c: Case, lpc: int = 1, *, device: str = "cpu", device_plans: bool = False,
               corrupt_gather=None, corrupt_scatter=None, kernel: str = "torch") -> None:
    rng = np.random.default_rng(c.seed)
    vec = c.head_size * c.dtype_bytes
    need_s = -(-c.num_tokens // c.src_bs)
    need_d = -(-(c.num_tokens - c.first_token) // c.dst_bs)
    common = dict(layers=c.layers, heads=c.heads, head_size=c.head_size, dtype_bytes=c.dtype_bytes)
    parts = 1 if c.src_place == "combined" else 2
    logical = rng.integers(0, 256, (c.layers, parts, c.num_tokens, c.heads, vec), dtype=np.uint8)
    cuda = device != "cpu"
    stream = torch.cuda.Stream(device) if cuda else None

    def fence() -> list:  # order the side stream after copies made on the current stream
        if not cuda:
            return []
        ev = torch.cuda.Event()
        ev.record()
        return [ev]

    # D: a sentinel-filled cache and the reference result, vector by vector.
    d_nb = max(1, need_d + c.dst_extra)
    geo_kw = dict(placement=c.dst_place, order=c.dst_order, block_size=c.dst_bs, num_blocks=d_nb,
                  tp=c.dst_tp, rank=c.dst_rank, **common)
    dmem = Mem(pool_size(make_geo(base=FAKE, **geo_kw)), SENTINEL, device)
    dst = make_geo(base=dmem.base, **geo_kw)
    d_ids = pick_blocks(rng, d_nb, need_d + min(c.tail, d_nb - need_d), c.consecutive)
    expect = np.full(dmem.n, SENTINEL, dtype=np.uint8)
    target = np.zeros(dmem.n, dtype=np.int32)
    dlo, dhi = dst.head_range
    for l in range(c.layers):
        for kv in range(parts):
            for t in range(c.first_token, c.num_tokens):
                j, o = divmod(t - c.first_token, c.dst_bs)
                for g in range(dlo, dhi):
                    off = vec_offset(dst, dmem.base, l, kv, d_ids[j], o, g)
                    expect[off: off + vec] = logical[l, kv, t, g]
                    target[off: off + vec] = 1

    slot = slot_layout(dst, c.src_tp, first_token=c.first_token, num_tokens=c.num_tokens)
    assert slot.total_bytes == slot_bytes(dst, c.src_tp, first_token=c.first_token,
                                          num_tokens=c.num_tokens)
    smem_slot = Mem(max(1, slot.total_bytes), CANARY, device)
    written = np.zeros(slot.total_bytes, dtype=np.int32)  # slot bytes written by writers
    end = 0
    for w in slot.writers:  # disjoint, ascending, aligned
        assert w.offset % WRITER_ALIGN == 0 and w.offset >= end
        end = w.offset + w.length
    assert end == slot.total_bytes

    # P ranks: pack, then "WRITE" into the slot.
    s_nb = max(1, need_s + c.src_extra)
    writer_ranks = {w.rank for w in slot.writers}
    src = None
    for r in range(c.src_tp):
        skw = dict(placement=c.src_place, order=c.src_order, block_size=c.src_bs, num_blocks=s_nb,
                   tp=c.src_tp, rank=r, **common)
        smem = Mem(pool_size(make_geo(base=FAKE, **skw)), 0, device)
        src = make_geo(base=smem.base, **skw)
        s_ids = pick_blocks(rng, s_nb, need_s + min(c.tail, s_nb - need_s), c.consecutive)
        plan = pack_plan(src, s_ids, dst, first_token=c.first_token, num_tokens=c.num_tokens)
        if r not in writer_ranks:
            assert plan is None
            continue
        assert plan is not None
        ws = slot.writer(r)
        assert plan.total_bytes == ws.length and plan.part_bytes == ws.part_bytes
        assert plan.heads == ws.heads
        if ws.length == 0:
            continue
        host = rng.integers(0, 256, smem.n, dtype=np.uint8)
        wanted = np.zeros(smem.n, dtype=np.int32)
        slo, shi = src.head_range
        for l in range(c.layers):
            for kv in range(parts):
                for t in range(c.num_tokens):
                    i, o = divmod(t, c.src_bs)
                    for g in range(slo, shi):
                        off = vec_offset(src, smem.base, l, kv, s_ids[i], o, g)
                        host[off: off + vec] = logical[l, kv, t, g]
                        if t >= c.first_token and ws.heads[0] <= g < ws.heads[1]:
                            wanted[off: off + vec] = 1
        smem.load(host)
        # the plan reads every needed byte once and nothing else
        pos = plan_positions(plan, src, smem.base)
        assert pos.shape[0] == plan.total_bytes
        np.testing.assert_array_equal(np.bincount(pos, minlength=smem.n), wanted)
        if corrupt_gather is not None:
            plan = corrupt_gather(plan)
        _, prep, do_pack, _ = _kernels(kernel, src, device, stream)
        use = prep(plan) if device_plans or kernel != "torch" else plan
        pstage = Mem(ws.length, CANARY, device)
        for ch in slot.chunks(r, lpc):
            lo = ch.offset - ws.offset
            assert plan.span(ch.layers) == (lo, ch.length)
            h = do_pack(use, pstage.body[lo: lo + ch.length], ch.layers, stream=stream,
                        wait_for=fence())
            while not h.query():  # what the transfer thread does
                pass
            written[ch.offset: ch.offset + ch.length] += 1
        assert pstage.guards_ok(), "pack wrote outside its staging buffer"
        np.testing.assert_array_equal(smem.host(), host, err_msg="pack changed the P cache")
        smem_slot.body[ws.offset: ws.offset + ws.length].copy_(pstage.body)  # the WRITE

    assert ((written == 1) | (written == 0)).all()
    assert int(written.sum()) == sum(w.length for w in slot.writers)

    # D: unpack every writer's chunks.
    plans = unpack_plans(src, dst, d_ids, first_token=c.first_token, num_tokens=c.num_tokens)
    assert list(plans) == [w.rank for w in slot.writers]
    if corrupt_scatter is not None:
        plans = {r: corrupt_scatter(p) if p.total_bytes else p for r, p in plans.items()}
    _, prep, _, do_unpack = _kernels(kernel, dst, device, stream)
    pos = [plan_positions(p, dst, dmem.base) for p in plans.values()]
    np.testing.assert_array_equal(np.bincount(np.concatenate(pos), minlength=dmem.n), target,
                                  err_msg="a target byte is not written exactly once")
    for rank, plan in plans.items():
        use = prep(plan) if device_plans or kernel != "torch" else plan
        ws = slot.writer(rank)
        for ch in slot.chunks(rank, lpc):
            h = do_unpack(use, smem_slot.body[ch.offset: ch.offset + ch.length], ch.layers,
                          stream=stream, wait_for=fence())
            if cuda:
                h.synchronize()
        assert ws.length == plan.total_bytes
    assert dmem.guards_ok() and smem_slot.guards_ok()
    np.testing.assert_array_equal(dmem.host(), expect,
                                  err_msg="D's cache differs from the reference")


# -- property tests ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(1, 3), st.booleans())
def test_staged_matches_reference(c: Case, lpc: int, device_plans: bool) -> None:
    run_staged(c, lpc, device_plans=device_plans)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(tp_change=True), st.integers(1, 3))
def test_staged_matches_reference_across_tp(c: Case, lpc: int) -> None:
    run_staged(c, lpc)


EXAMPLES = [
    dict(src_tp=4, dst_tp=8, dst_rank=5),
    dict(src_tp=8, dst_tp=4, dst_rank=1),  # two writers into one slot
    dict(src_tp=8, dst_tp=1, dst_rank=0),  # eight writers
    dict(src_tp=16, dst_tp=2, dst_rank=1),  # producer replicates heads
    dict(src_tp=2, dst_tp=16, dst_rank=11),  # decoder replicates heads
    dict(src_tp=16, dst_tp=16, dst_rank=7),  # both replicate
    dict(src_bs=16, dst_bs=24, first_token=48),  # prefix hit, P block cut in the middle
    dict(src_bs=24, dst_bs=16, first_token=32),
    dict(src_bs=128, dst_bs=16, num_tokens=300, first_token=16),
    dict(src_order="NHD", dst_order="HND", src_tp=2, dst_tp=4, dst_rank=3),
    dict(src_order="HND", dst_order="NHD", src_bs=5, dst_bs=7, first_token=14),
    dict(src_order="HND", dst_order="HND", src_tp=4, dst_tp=1, src_place="blocks_first"),
    dict(src_place="blocks_first", dst_place="blocks_first", src_bs=1, dst_bs=32),
    dict(src_order="HND", dst_order="HND", src_bs=1, dst_bs=1, num_tokens=9),
    dict(num_tokens=64, first_token=64),  # nothing left to move
    dict(src_place="combined", dst_place="combined", src_bs=32, dst_bs=32, src_order="HND",
         dst_order="HND", first_token=32),
    dict(src_place="combined", dst_place="combined", src_tp=2, dst_tp=4, dst_rank=1),
    dict(num_tokens=1),
    dict(src_bs=32, dst_bs=32, num_tokens=96),  # whole blocks only, no partial segment
    dict(consecutive=True, src_bs=16, dst_bs=16, num_tokens=96),  # slice copies
    dict(consecutive=True, src_place="blocks_first", dst_place="blocks_first", src_tp=2,
         dst_tp=4, dst_rank=2, src_order="HND", dst_order="HND"),
    dict(head_size=3, dtype_bytes=1),  # 3-byte vectors: byte words
]


@pytest.mark.parametrize("lpc", [1, 2])
@pytest.mark.parametrize("kw", EXAMPLES)
def test_staged_examples(kw, lpc) -> None:
    run_staged(_case(**kw), lpc, device_plans=lpc == 2)


@pytest.mark.parametrize("corrupt", ["gather_rows", "scatter_rows", "gather_shift",
                                     "scatter_shift", "scatter_dup"])
@pytest.mark.parametrize("kw", [dict(), dict(dst_order="HND", src_tp=2, dst_tp=1),
                                dict(src_bs=16, dst_bs=8, src_place="blocks_first")])
def test_corrupted_plans_are_caught(kw, corrupt) -> None:
    """The comparison can fail: a plan with two rows swapped or shifted is detected."""
    side, how = corrupt.split("_")
    fn = {"rows": corrupt_rows, "shift": shift_staging, "dup": duplicate_row}[how]
    c = _case(**kw)
    run_staged(c)  # the uncorrupted case passes
    # swapped rows are caught by the data comparison; a duplicated row by the write counts
    match = {"rows": "differs from the reference", "dup": "exactly once",
             "shift": "exactly once|differs from the reference"}[how]
    with pytest.raises(AssertionError, match=match):
        run_staged(c, **{f"corrupt_{side}": fn})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", EXAMPLES[:12])
def test_staged_examples_cuda(kw) -> None:
    run_staged(_case(**kw), 2, device="cuda:0", device_plans=True)


# -- opaque blocks (vLLM CPU) --------------------------------------------------------------


@pytest.mark.parametrize("first_token,num_tokens", [(0, 70), (32, 70), (32, 64), (0, 1)])
def test_opaque_blocks_move_whole(first_token, num_tokens) -> None:
    kw = dict(placement="combined", order="opaque", layers=2, heads=2, head_size=8,
              dtype_bytes=2, block_size=32, num_blocks=8)
    smem = Mem(pool_size(make_geo(base=FAKE, **kw)), 0)
    smem.load(np.random.default_rng(3).integers(0, 256, smem.n, dtype=np.uint8))
    dmem = Mem(smem.n, SENTINEL)
    src = make_geo(base=smem.base, **kw)
    dst = make_geo(base=dmem.base, **kw)
    s_ids, d_ids = [5, 2, 7], [6, 1, 3]
    plan = pack_plan(src, s_ids, dst, first_token=first_token, num_tokens=num_tokens)
    assert plan.unit == "block" and len(plan.segments) == 1
    slot = slot_layout(dst, 1, first_token=first_token, num_tokens=num_tokens)
    assert slot.total_bytes == plan.total_bytes
    stage = Mem(slot.total_bytes, CANARY)
    pack(CacheViews(src), plan, stage.body)
    (dplan,) = unpack_plans(src, dst, d_ids, first_token=first_token,
                            num_tokens=num_tokens).values()
    unpack(CacheViews(dst), dplan, stage.body)
    expect = np.full(dmem.n, SENTINEL, dtype=np.uint8)
    host = smem.host()
    bb, layer = src.block_bytes, 8 * src.block_bytes
    moved = -(-(num_tokens - first_token) // 32)
    for l in range(2):
        for j in range(moved):  # whole blocks, a partial last one too
            sb, db = s_ids[first_token // 32 + j], d_ids[j]
            expect[l * layer + db * bb: l * layer + (db + 1) * bb] = \
                host[l * layer + sb * bb: l * layer + (sb + 1) * bb]
    np.testing.assert_array_equal(dmem.host(), expect)
    assert stage.guards_ok()


def test_opaque_needs_equal_geometry_and_whole_heads() -> None:
    kw = dict(placement="combined", order="opaque", layers=1, heads=2, head_size=8,
              dtype_bytes=2, block_size=32, num_blocks=8, base=FAKE)
    src = make_geo(**kw)
    with pytest.raises(GeometryError, match="opaque"):
        pack_plan(src, [0], make_geo(**{**kw, "block_size": 16}), first_token=0, num_tokens=10)
    with pytest.raises(GeometryError, match="opaque"):
        slot_layout(src, 2, first_token=0, num_tokens=10)
    with pytest.raises(GeometryError, match="opaque"):
        gather_plan(src, [0], first_token=0, num_tokens=10, heads=(0, 1))
    with pytest.raises(GeometryError, match="opaque"):
        gather_plan(src, [0, 1], first_token=16, num_tokens=40, heads=(0, 2))


# -- slot and chunk arithmetic ---------------------------------------------------------------


def qwen(tp=1, rank=0, block_size=16, order="NHD", placement="kv_split", num_blocks=64):
    return make_geo(base=FAKE, placement=placement, order=order, layers=64, heads=8,
                    head_size=128, dtype_bytes=2, block_size=block_size, num_blocks=num_blocks,
                    tp=tp, rank=rank)


def test_slot_tp1() -> None:
    slot = slot_layout(qwen(), 1, first_token=0, num_tokens=1000)
    (w,) = slot.writers
    assert w == (0, (0, 8), 0, 64 * 2 * 1000 * 8 * 256, 1000 * 8 * 256)
    assert slot.total_bytes == w.length == 64 * 2 * 1000 * 8 * 256
    chunks = slot.chunks(0, 8)
    assert len(chunks) == 8
    assert [c.offset for c in chunks] == [i * 8 * 2 * w.part_bytes for i in range(8)]
    assert sum(c.length for c in chunks) == w.length
    assert chunks[-1].layers == range(56, 64)


def test_slot_tp8_into_tp1_has_eight_disjoint_writers() -> None:
    slot = slot_layout(qwen(), 8, first_token=16, num_tokens=100)
    part = 84 * 1 * 256
    assert [w.rank for w in slot.writers] == list(range(8))
    assert [w.heads for w in slot.writers] == [(h, h + 1) for h in range(8)]
    assert [w.offset for w in slot.writers] == [r * 64 * 2 * part for r in range(8)]
    assert slot.total_bytes == 8 * 64 * 2 * part


def test_slot_tp_down_and_replication() -> None:
    slot = slot_layout(qwen(tp=8, rank=3), 2, first_token=0, num_tokens=10)
    assert [(w.rank, w.heads) for w in slot.writers] == [(0, (3, 4))]
    # producer TP16 over 8 heads (2 replicas each), decoder TP2 rank 1: heads 4..7, replica 1
    slot = slot_layout(qwen(tp=2, rank=1), 16, first_token=0, num_tokens=10)
    assert [(w.rank, w.heads) for w in slot.writers] == [(9, (4, 5)), (11, (5, 6)),
                                                         (13, (6, 7)), (15, (7, 8))]


def test_slot_writers_are_aligned() -> None:
    dst = make_geo(base=FAKE, placement="kv_split", order="NHD", layers=3, heads=4, head_size=3,
                   dtype_bytes=1, block_size=4, num_blocks=8)
    slot = slot_layout(dst, 4, first_token=0, num_tokens=5)
    length = 3 * 2 * 5 * 3
    assert [w.offset for w in slot.writers] == [0, 256, 512, 768]
    assert slot.total_bytes == 768 + length
    slot = slot_layout(dst, 4, first_token=0, num_tokens=5, align=1)
    assert [w.offset for w in slot.writers] == [0, length, 2 * length, 3 * length]


def test_slot_empty_range_and_chunks() -> None:
    slot = slot_layout(qwen(), 2, first_token=32, num_tokens=32)
    assert slot.total_bytes == 0 and slot.chunks(0, 4) == ()
    slot = slot_layout(qwen(), 1, first_token=0, num_tokens=16)
    chunks = slot.chunks(0, 5)
    assert [len(c.layers) for c in chunks] == [5] * 12 + [4]
    assert [c.index for c in chunks] == list(range(13))
    with pytest.raises(GeometryError, match="positive"):
        slot.chunks(0, 0)
    with pytest.raises(GeometryError, match="writes nothing"):
        slot.chunks(1, 4)


def test_layers_per_chunk() -> None:
    mib = 1 << 20
    assert layers_per_chunk(64 * mib, 64, 512 * mib) == 8
    assert layers_per_chunk(64 * mib, 64, 1) == 1
    assert layers_per_chunk(64 * mib, 64, 1 << 50) == 64
    assert layers_per_chunk(0, 64, 512 * mib) == 64
    with pytest.raises(GeometryError):
        layers_per_chunk(mib, 0, mib)


@pytest.mark.parametrize("kw,match", [
    (dict(first_token=8, num_tokens=70), "multiple"),
    (dict(first_token=80, num_tokens=70), "past"),
    (dict(first_token=-16, num_tokens=70), "negative"),
    (dict(first_token=0, num_tokens=1.5), "integer"),
])
def test_slot_rejects_bad_ranges(kw, match) -> None:
    with pytest.raises(GeometryError, match=match):
        slot_layout(qwen(), 1, **kw)


def test_slot_rejects_bad_tp() -> None:
    with pytest.raises(GeometryError):
        slot_layout(qwen(), 3, first_token=0, num_tokens=10)


# -- plan units ----------------------------------------------------------------------------


def test_units_nhd_all_heads_whole_blocks() -> None:
    src = qwen()
    plan = gather_plan(src, [9, 3, 4, 5, 11], first_token=0, num_tokens=64, heads=(0, 8))
    assert plan.unit == "block" and len(plan.segments) == 1
    assert plan.segments[0].rows.tolist() == [9, 3, 4, 5]
    assert plan.num_rows == 4 and plan.word_bytes == 8
    # prefix of 24 (P block cut in the middle) and a partial tail: token rows at both ends
    plan = gather_plan(src, [9, 3, 4, 5, 11], first_token=24, num_tokens=70, heads=(0, 8))
    assert [s.unit for s in plan.segments] == ["token", "block", "token"]
    assert [s.rows.shape[0] for s in plan.segments] == [8, 2, 6]
    assert plan.segments[0].rows.tolist() == [3 * 16 + t for t in range(8, 16)]
    assert plan.segments[1].rows.tolist() == [4, 5]
    assert [s.staging_offset for s in plan.segments] == [0, 8 * 2048, 40 * 2048]
    assert plan.part_bytes == 46 * 2048


def test_units_consecutive_blocks_are_slices() -> None:
    plan = gather_plan(qwen(), [4, 5, 6], first_token=0, num_tokens=48, heads=(0, 8))
    assert plan.segments[0].first_row == 4
    plan = gather_plan(qwen(), [4, 6, 5], first_token=0, num_tokens=48, heads=(0, 8))
    assert plan.segments[0].first_row == -1


def test_units_blocks_first_view_strides() -> None:
    geo = qwen(placement="blocks_first")
    plan = gather_plan(geo, [1, 2], first_token=0, num_tokens=20, heads=(0, 8))
    blk, tok = plan.segments
    assert blk.view.row_stride == 2 * geo.block_bytes and blk.view.row_bytes == geo.block_bytes
    assert tok.view.row_stride == 2048 and tok.rows.tolist() == [2 * 2 * 16 + t for t in range(4)]


def test_units_head_slices() -> None:
    # NHD, half the heads (TP down): token rows of 4 heads
    plan = gather_plan(qwen(), [0, 1], first_token=0, num_tokens=32, heads=(4, 8))
    assert plan.unit == "token" and plan.segments[0].view == (4 * 256, 2048, 4 * 256, 64 * 16)
    # HND, several heads: vectors; one head: blocks
    plan = gather_plan(qwen(order="HND"), [0, 1], first_token=0, num_tokens=32, heads=(0, 8))
    assert plan.unit == "vector" and plan.num_rows == 32 * 8
    plan = gather_plan(qwen(order="HND", tp=8, rank=2), [0, 1], first_token=0, num_tokens=32,
                       heads=(2, 3))
    assert plan.unit == "block" and plan.num_rows == 2
    plan = gather_plan(qwen(order="HND", tp=8, rank=2), [0, 1], first_token=0, num_tokens=30,
                       heads=(2, 3))
    assert [s.unit for s in plan.segments] == ["block", "token"]


def test_scatter_blocks_start_at_first_token() -> None:
    dst = qwen(block_size=32)
    plan = scatter_plan(dst, [7, 2], first_token=32, num_tokens=70, heads=(0, 8))
    assert [s.unit for s in plan.segments] == ["block", "token"]
    assert plan.segments[0].rows.tolist() == [7]
    assert plan.segments[1].rows.tolist() == [2 * 32 + t for t in range(6)]


def _plan_errors():
    geo = qwen()
    ok = dict(first_token=16, num_tokens=70, heads=(0, 8))
    return [
        ("outside", gather_plan, geo, [0, 1, 2, 3, 64], ok),
        ("outside", scatter_plan, geo, [0, -1, 2, 3], ok),
        ("producer blocks", gather_plan, geo, [0, 1, 2, 3], ok),
        ("decoder blocks", scatter_plan, geo, [0, 1, 2], ok),
        ("twice", scatter_plan, geo, [1, 2, 1, 3], ok),
        ("multiple", scatter_plan, geo, [1, 2, 3, 4], dict(ok, first_token=8)),
        ("past", gather_plan, geo, [1, 2, 3, 4, 5], dict(ok, first_token=80)),
        ("negative", gather_plan, geo, [1, 2, 3, 4, 5], dict(ok, num_tokens=-1)),
        ("integer", scatter_plan, geo, [1, 2, 3, 4], dict(ok, first_token=16.0)),
        ("integers", gather_plan, geo, [0.0, 1.0, 2.0, 3.0, 4.0], ok),
        ("heads", gather_plan, geo, range(5), dict(ok, heads=(4, 9))),
        ("heads", gather_plan, qwen(tp=2, rank=1), range(5), dict(ok, heads=(0, 4))),
        ("heads", scatter_plan, geo, range(4), dict(ok, heads=(3, 3))),
        ("positive", gather_plan, msgspec.structs.replace(geo, num_blocks=0), range(5), ok),
    ]


@pytest.mark.parametrize("match,fn,geo,blocks,kw", _plan_errors())
def test_plans_reject_bad_input(match, fn, geo, blocks, kw) -> None:
    with pytest.raises(GeometryError, match=match):
        fn(geo, blocks, **kw)


def test_duplicate_producer_blocks_are_allowed() -> None:
    """Reading a P block twice is harmless (layout.py accepts it too); D's duplicates are not."""
    plan = gather_plan(qwen(), [3, 3], first_token=0, num_tokens=32, heads=(0, 8))
    assert plan.segments[0].rows.tolist() == [3, 3]


def test_pack_plan_incompatible_and_non_writer() -> None:
    with pytest.raises(GeometryError, match="num_layers"):
        pack_plan(make_geo(base=FAKE, placement="kv_split", order="NHD", layers=2, heads=8,
                           head_size=128, dtype_bytes=2, block_size=16, num_blocks=8),
                  [0], qwen(), first_token=0, num_tokens=10)
    assert pack_plan(qwen(tp=8, rank=7), [0], qwen(tp=2, rank=0), first_token=0,
                     num_tokens=10) is None


# -- ops: contracts ------------------------------------------------------------------------


def small_pair(**kw):
    base = dict(placement="kv_split", order="NHD", layers=2, heads=2, head_size=4,
                dtype_bytes=2, block_size=4, num_blocks=4)
    base.update(kw)
    mem = Mem(pool_size(make_geo(base=FAKE, **base)), 0)
    return mem, make_geo(base=mem.base, **base)


def test_wrap_memory_is_zero_copy() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    t = wrap_memory(buf.ctypes.data, 64, device="cpu")
    t[3] = 7
    assert buf[3] == 7 and t.data_ptr() == buf.ctypes.data
    with pytest.raises(ValueError):
        wrap_memory(buf.ctypes.data, 0, device="cpu")
    with pytest.raises(ValueError, match="device"):
        wrap_memory(buf.ctypes.data, 8, device="meta")


def test_pack_checks_its_arguments() -> None:
    mem, geo = small_pair()
    views = CacheViews(geo)
    plan = gather_plan(geo, [1, 2], first_token=0, num_tokens=6, heads=(0, 2))
    good = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    pack(views, plan, good)
    with pytest.raises(GeometryError, match="holds"):
        pack(views, plan, good[:-8])
    with pytest.raises(GeometryError, match="uint8"):
        pack(views, plan, good.view(torch.int16))
    with pytest.raises(GeometryError, match="aligned"):
        pack(views, plan, torch.zeros(plan.total_bytes + 2, dtype=torch.uint8)[2:])
    with pytest.raises(GeometryError, match="layers"):
        pack(views, plan, good, range(1, 3))
    with pytest.raises(GeometryError, match="scatter plan"):
        unpack(views, plan, good)
    with pytest.raises(GeometryError, match="stream"):
        pack(views, plan, good, stream=object())
    _, other = small_pair(layers=3)
    with pytest.raises(GeometryError, match="another geometry"):
        pack(CacheViews(other), plan, good)
    # a chunk of layers takes exactly its span
    off, length = plan.span(range(1, 2))
    assert (off, length) == (plan.layer_bytes, plan.layer_bytes)
    assert pack(views, plan, good[off: off + length], range(1, 2)).query()


def test_pack_of_an_empty_range_does_nothing() -> None:
    mem, geo = small_pair()
    plan = gather_plan(geo, [1, 2], first_token=6, num_tokens=6, heads=(0, 2))
    assert plan.total_bytes == 0 and plan.segments == ()
    assert pack(CacheViews(geo), plan, torch.zeros(0, dtype=torch.uint8)).query()


# -- the pool --------------------------------------------------------------------------------


def test_pool_reserve_release_and_alignment() -> None:
    pool = StagingPool(10 * 4096 + 100)
    assert pool.capacity == 10 * 4096
    a = pool.reserve(1)
    b = pool.reserve(4097)
    c = pool.reserve(4096)
    assert (a, b, c) == ((0, 4096), (4096, 8192), (12288, 4096))
    assert pool.used_bytes == 16384 and pool.free_bytes == 6 * 4096
    assert pool.release(b[0]) == 8192
    assert pool.free_ranges == [(4096, 8192), (16384, 6 * 4096)]
    assert pool.reserve(4096) == (4096, 4096)  # first fit: the hole
    assert pool.reserve(3 * 4096) == (16384, 3 * 4096)  # the hole is too small now
    assert pool.stats()["slots"] == 4


def test_pool_exhaustion_is_counted() -> None:
    pool = StagingPool(4 * 4096)
    assert pool.reserve(3 * 4096) is not None
    assert pool.reserve(2 * 4096) is None
    assert pool.reserve(5 * 4096) is None
    assert (pool.exhausted, pool.too_large) == (2, 1)
    assert pool.reserve(4096) == (3 * 4096, 4096)
    assert pool.reserve(1) is None and pool.exhausted == 3
    assert pool.stats()["peak_bytes"] == 4 * 4096


def test_pool_coalesces_neighbours() -> None:
    pool = StagingPool(4 * 256, align=256)
    offs = [pool.reserve(256)[0] for _ in range(4)]
    assert pool.reserve(256) is None
    pool.release(offs[1])
    pool.release(offs[3])
    assert pool.free_ranges == [(256, 256), (768, 256)]
    assert pool.reserve(512) is None  # fragmented: 512 free, but not in one range
    pool.release(offs[2])  # joins both neighbours
    assert pool.free_ranges == [(256, 768)]
    pool.release(offs[0])
    assert pool.free_ranges == [(0, 1024)] and pool.largest_free == 1024
    assert pool.reserve(1024) == (0, 1024)


def test_pool_rejects_bad_calls() -> None:
    pool = StagingPool(8192)
    with pytest.raises(ValueError):
        pool.reserve(0)
    with pytest.raises(KeyError):
        pool.release(0)
    off, _ = pool.reserve(10)
    pool.release(off)
    with pytest.raises(KeyError):
        pool.release(off)  # double release
    with pytest.raises(ValueError):
        StagingPool(8192, align=3000)
    assert StagingPool(100).reserve(1) is None  # smaller than one aligned unit


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000), st.integers(0, 50)),
                max_size=60))
def test_pool_against_a_model(ops) -> None:
    """Random reserves and releases: ranges never overlap, stay aligned and inside the pool,
    first fit is the lowest free offset that fits, and freeing everything restores one range."""
    pool = StagingPool(64 * 256 + 17, align=256)
    live: dict[int, int] = {}
    for is_reserve, n, pick in ops:
        if is_reserve or not live:
            length = -(-n // 256) * 256
            owner = np.zeros(pool.capacity, dtype=bool)
            for o, ln in live.items():
                owner[o: o + ln] = True
            fits = [s for s in range(0, pool.capacity - length + 1, 256)
                    if not owner[s: s + length].any()]
            got = pool.reserve(n)
            if not fits:
                assert got is None
                continue
            assert got == (fits[0], length)
            live[got[0]] = length
        else:
            off = sorted(live)[pick % len(live)]
            assert pool.release(off) == live.pop(off)
        assert pool.used_bytes == sum(live.values())
        assert pool.reserved == live
        free = pool.free_ranges
        assert all(a + la < b for (a, la), (b, _) in zip(free, free[1:]))  # coalesced
        assert sum(ln for _, ln in free) == pool.free_bytes
    for off in list(live):
        pool.release(off)
    assert pool.free_ranges == [(0, pool.capacity)]
