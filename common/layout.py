"""Which bytes a producer (P) rank writes into a decoder (D) rank: the write plan.

Pure numpy: no torch, no NIXL. Both sides are described by a :class:`KVGeometry` (see
``geometry.py`` for the memory model); this module maps one side onto the other.

Heads
-----
D rank ``d`` holds the global KV heads ``head_range(H, dst_tp, d)``. :func:`writer_ranks` names, for
every such head, exactly one P rank holding it; the P rank writes the heads of that set it holds, a
contiguous range ``[lo, hi)``. When P replicates heads (``src_tp > H``) each head lives on
``src_tp // H`` P ranks and D rank ``d`` takes replica ``d % replicas``, so the D ranks that hold
the same head (consecutive ranks when D replicates too) are fed by different P ranks.
:func:`target_ranks` is the inverse: the D ranks one P rank writes into.

Tokens
------
``src_blocks[i]`` holds prompt tokens ``[i*Bs, (i+1)*Bs)``; ``dst_blocks[j]`` holds tokens
``[first_token + j*Bd, ...)``. The plan covers tokens ``[first_token, num_tokens)``. That range is
cut at every P block boundary and every D block boundary into *runs*: maximal token ranges that
lie inside one P block and one D block (about ``T/Bs + T/Bd`` runs; exactly ``T/B`` when both
block sizes are ``B``).

Pieces
------
Inside a block part, the (token ``t``, local head ``h``) vector sits at vector index
``t*ts + h*hs`` with ``(ts, hs) = (local_heads, 1)`` for NHD and ``(1, block_size)`` for HND. For
each run we pick the coarsest cut into pieces that are contiguous on *both* sides:

* whole   -- the run's tokens x written heads in one piece (same order contiguous on both sides:
             e.g. NHD with all local heads, or HND with a whole block or a single head);
* token   -- one piece per token, all written heads (heads adjacent on both sides: NHD, or 1 head);
* head    -- one piece per written head, all the run's tokens (tokens adjacent on both: HND);
* vector  -- one piece per (token, head) (e.g. NHD on one side, HND on the other).

Each piece is one (layer, K/V, token-run, head-run) copy; ``WritePlan.unmerged`` counts them.
Piece offsets are computed once (relative to layer 0's K base) and broadcast over layers and K/V.

Merging
-------
Pieces are emitted per layer, and in an order chosen for merging: K's pieces then V's when either
side keeps K and V apart (``kv_split``), or K then V of every piece when both sides keep a block's V
right after its K (``blocks_first``), so whole blocks merge K+V. A piece is then merged into the
previous one when both its source and its destination start where the previous one ends. With the
same layout on both sides and consecutive block ids, a whole layer's K (or K+V) becomes one
region. Regions never cross from one layer (or, for kv_split, one part) to the next: those are
registered separately because adjacent tensors are still separate device allocations.

Validation
----------
Bad input raises :class:`GeometryError`: invalid or incompatible geometries, block ids outside
``[0, num_blocks)``, too few blocks for the token range, a D block listed twice in the range (two
tokens would land on the same bytes), ``first_token`` not a multiple of the D block size,
``first_token > num_tokens`` or negative counts. Every produced region lies inside one of the
listed blocks' K or V part on each side, within the written tokens and heads.
"""

from __future__ import annotations

import math
import operator
import threading
from typing import NamedTuple, Sequence

import numpy as np

from .geometry import GeometryError, KVGeometry, check_head_split, head_range, local_heads

__all__ = ["WritePlan", "writer_ranks", "target_ranks", "plan_writes", "fragmentation"]

_MAX_ADDR = 1 << 63  # addresses are computed in int64, then handed out as uint64

# Per-run piece shapes (see module docstring).
_WHOLE, _TOKEN, _HEAD, _VECTOR = 0, 1, 2, 3


class WritePlan(NamedTuple):
    """Regions to copy from P's memory (``src``) to D's memory (``dst``), after merging."""

    src: np.ndarray  # uint64 absolute source addresses (in P's geometry)
    dst: np.ndarray  # uint64 absolute destination addresses (in D's geometry)
    length: np.ndarray  # uint64 lengths in bytes
    unmerged: int  # number of (layer, K/V, token-run, head-run) pieces before merging
    head_sliced: bool  # a head slice was cut out of a token-major (NHD) block: per-token regions

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum(dtype=np.uint64))

    @property
    def num_regions(self) -> int:
        return int(self.length.shape[0])

    def descs(self, side: str, dev_id: int) -> np.ndarray:
        """``(N, 3)`` uint64 array ``[addr, len, dev_id]`` of ``side`` ("src" or "dst")."""
        if side == "src":
            addr = self.src
        elif side == "dst":
            addr = self.dst
        else:
            raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
        out = np.empty((addr.shape[0], 3), dtype=np.uint64)
        out[:, 0] = addr
        out[:, 1] = self.length
        out[:, 2] = operator.index(dev_id)
        return out


def _empty_plan() -> WritePlan:
    empty = np.zeros(0, dtype=np.uint64)
    return WritePlan(src=empty, dst=empty.copy(), length=empty.copy(), unmerged=0, head_sliced=False)


# -- heads -----------------------------------------------------------------------------------


def writer_ranks(
    num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int
) -> dict[int, tuple[int, int]]:
    """Which producer ranks write into decoder rank ``dst_rank``, and which global KV heads
    ``[lo, hi)`` each writes.

    Every head that ``dst_rank`` holds is written by exactly one producer rank. When the producer
    replicates heads (``src_tp > num_kv_heads``), head ``g`` lives on P ranks
    ``g*replicas ... g*replicas + replicas - 1`` and ``dst_rank`` takes replica
    ``dst_rank % replicas``. Keys are in increasing rank order.
    """
    check_head_split(num_kv_heads, src_tp, "producer")
    check_head_split(num_kv_heads, dst_tp, "decoder")
    if not 0 <= dst_rank < dst_tp:
        raise GeometryError(f"decoder rank {dst_rank} outside TP {dst_tp}")
    lo, hi = head_range(num_kv_heads, dst_tp, dst_rank)
    out: dict[int, tuple[int, int]] = {}
    if src_tp <= num_kv_heads:
        per = local_heads(num_kv_heads, src_tp)
        for rank in range(lo // per, (hi - 1) // per + 1):
            out[rank] = (max(lo, rank * per), min(hi, (rank + 1) * per))
    else:
        replicas = src_tp // num_kv_heads
        pick = dst_rank % replicas
        for g in range(lo, hi):
            out[g * replicas + pick] = (g, g + 1)
    return out


def target_ranks(num_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int) -> list[int]:
    """Decoder ranks that producer rank ``src_rank`` writes into (inverse of :func:`writer_ranks`)."""
    check_head_split(num_kv_heads, src_tp, "producer")
    if not 0 <= src_rank < src_tp:
        raise GeometryError(f"producer rank {src_rank} outside TP {src_tp}")
    return [d for d in range(dst_tp) if src_rank in writer_ranks(num_kv_heads, src_tp, dst_tp, d)]


# -- validation helpers ------------------------------------------------------------------------


def _as_count(value: int, name: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise GeometryError(f"{name} must be an integer, got {value!r}") from None
    if value < 0:
        raise GeometryError(f"{name} must not be negative, got {value}")
    return value


def _block_ids(blocks: Sequence[int], geo: KVGeometry, side: str) -> np.ndarray:
    arr = np.asarray(blocks)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise GeometryError(f"{side} block ids must be a flat sequence of integers")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= geo.num_blocks:
        bad = lo if lo < 0 else hi
        raise GeometryError(f"{side} block id {bad} outside [0, {geo.num_blocks})")
    return arr.astype(np.int64, copy=False)


def _check_addresses(geo: KVGeometry, side: str) -> None:
    bases = tuple(b for part in geo.part_bases for b in part)
    if min(bases) < 0:
        raise GeometryError(f"{side} geometry has a negative base address")
    if max(bases) + geo.num_blocks * geo.block_stride >= _MAX_ADDR:
        raise GeometryError(f"{side} geometry reaches past 2**63")


def _order(geo: KVGeometry) -> tuple[int, int]:
    """``(ts, hs)``: vector-index step per token and per head inside one block part."""
    if geo.token_order == "NHD":
        return geo.local_heads, 1
    return 1, geo.block_size


def _kv_adjacent(geo: KVGeometry) -> bool:
    """True when every block's V part starts right where its K part ends (``blocks_first``).

    The stride matters too: in a one-block ``kv_split`` pool V's region also starts where K's
    block ends, but K and V are two registered spans there and a region must not cross them."""
    return geo.kv_parts == 2 and geo.block_stride == 2 * geo.block_bytes and all(
        v - k == geo.block_bytes for k, v in zip(geo.k_bases, geo.v_bases))


# -- the plan ------------------------------------------------------------------------------------


def plan_writes(
    src: KVGeometry,
    src_blocks: Sequence[int],
    dst: KVGeometry,
    dst_blocks: Sequence[int],
    *,
    first_token: int,
    num_tokens: int,
) -> WritePlan:
    """Regions P rank ``src`` must write into D rank ``dst`` for tokens ``[first_token, num_tokens)``.

    ``src_blocks[i]`` holds tokens ``[i*src.block_size, (i+1)*src.block_size)``;
    ``dst_blocks[j]`` holds tokens ``[first_token + j*dst.block_size, ...)``. All layers, K and V,
    for the heads :func:`writer_ranks` assigns to ``src.tp_rank`` (an empty plan when it assigns
    none). Raises :class:`GeometryError` on bad input.
    """
    pair = _pair(src, dst)
    first_token = _as_count(first_token, "first_token")
    num_tokens = _as_count(num_tokens, "num_tokens")
    bs, bd = src.block_size, dst.block_size
    if first_token % bd:
        raise GeometryError(
            f"first_token {first_token} is not a multiple of the decoder block size {bd}"
        )
    if first_token > num_tokens:
        raise GeometryError(f"first_token {first_token} is past num_tokens {num_tokens}")
    sblk = _block_ids(src_blocks, src, "producer")
    dblk = _block_ids(dst_blocks, dst, "decoder")
    if num_tokens == first_token:
        return _empty_plan()
    need_s = -(-num_tokens // bs)
    need_d = -(-(num_tokens - first_token) // bd)
    if sblk.shape[0] < need_s:
        raise GeometryError(
            f"tokens [0, {num_tokens}) need {need_s} producer blocks of {bs}, got {sblk.shape[0]}"
        )
    if dblk.shape[0] < need_d:
        raise GeometryError(
            f"tokens [{first_token}, {num_tokens}) need {need_d} decoder blocks of {bd}, "
            f"got {dblk.shape[0]}"
        )
    if len(set(dblk[:need_d].tolist())) != need_d:
        raise GeometryError("a decoder block id appears twice among the blocks being written")

    if pair.heads is None:
        return _empty_plan()
    if src.token_order == "opaque":
        # Block interiors are opaque (e.g. vLLM CPU's ISA-specific tiles): whole blocks only.
        # compatible_with guaranteed equal block sizes, TP and block bytes on both sides.
        s_off = sblk[first_token // bs: need_s] * src.block_stride
        d_off = dblk[:need_d] * dst.block_stride
        plen = np.full(need_d, src.block_bytes, dtype=np.int64)
        return _broadcast_and_merge(pair, s_off, d_off, plen, False)
    nh, h0s, h0d, vec = pair.nh, pair.h0s, pair.h0d, pair.vec
    ts_s, hs_s, ts_d, hs_d = pair.ts_s, pair.hs_s, pair.ts_d, pair.hs_d
    head_sliced = pair.head_sliced

    # Runs: cut [first_token, num_tokens) at every P and every D block boundary.
    if bs == bd:  # first_token is then block-aligned on both sides: the D blocks' starts
        start = np.arange(first_token, num_tokens, bd, dtype=np.int64)
    else:
        start = np.unique(np.concatenate((
            np.array([first_token], dtype=np.int64),
            np.arange((first_token // bs + 1) * bs, num_tokens, bs, dtype=np.int64),
            np.arange(first_token + bd, num_tokens, bd, dtype=np.int64),
        )))
    n = np.diff(np.append(start, num_tokens))
    sbi = start // bs
    s_tok = start - sbi * bs  # token offset inside the P block
    rel = start - first_token
    dbi = rel // bd
    d_tok = rel - dbi * bd  # token offset inside the D block
    s_blk_off = sblk[sbi] * src.block_stride
    d_blk_off = dblk[dbi] * dst.block_stride

    # Coarsest piece shape contiguous on both sides, per run.
    if pair.token_rows:  # tokens outer, heads inner, contiguous on both sides: any run whole
        whole = None
    else:
        one = n == 1

        def tok_outer(ts: int, hs: int) -> np.ndarray:  # tokens outer, heads inner, contiguous
            if nh > 1 and hs != 1:
                return np.zeros_like(one)
            return one | (ts == 1 + (nh - 1) * hs)

        def head_outer(ts: int, hs: int) -> np.ndarray:  # heads outer, tokens inner, contiguous
            ok = one | (ts == 1)
            return ok if nh == 1 else ok & (hs == 1 + (n - 1) * ts)

        whole = (tok_outer(ts_s, hs_s) & tok_outer(ts_d, hs_d)) | (
            head_outer(ts_s, hs_s) & head_outer(ts_d, hs_d)
        )
    if whole is None or whole.all():
        mode = None
    else:
        mode = np.full(n.shape, _VECTOR, dtype=np.int8)
        count = n * nh
        if ts_s == 1 and ts_d == 1:  # one piece per head holds all the run's tokens
            use = nh < count
            mode[use], count[use] = _HEAD, nh
        if nh == 1 or (hs_s == 1 and hs_d == 1):  # one piece per token holds all heads
            use = n <= count
            mode[use], count[use] = _TOKEN, n[use]
        mode[whole], count[whole] = _WHOLE, 1

    # Pieces, as offsets from layer 0's K base on each side.
    if mode is None:
        s_off = s_blk_off + (s_tok * ts_s + h0s * hs_s) * vec
        d_off = d_blk_off + (d_tok * ts_d + h0d * hs_d) * vec
        plen = n * (nh * vec)
    else:
        tlen = np.where((mode == _WHOLE) | (mode == _HEAD), n, 1)
        hlen = np.where((mode == _WHOLE) | (mode == _TOKEN), nh, 1)
        hcols = np.where((mode == _HEAD) | (mode == _VECTOR), nh, 1)  # head pieces per token row
        run = np.repeat(np.arange(n.shape[0]), count)
        first = np.cumsum(count) - count
        i = np.arange(run.shape[0], dtype=np.int64) - first[run]
        hc = hcols[run]
        t = i // hc
        h = i - t * hc
        s_off = s_blk_off[run] + ((s_tok[run] + t) * ts_s + (h0s + h) * hs_s) * vec
        d_off = d_blk_off[run] + ((d_tok[run] + t) * ts_d + (h0d + h) * hs_d) * vec
        plen = (tlen * hlen)[run] * vec
    return _broadcast_and_merge(pair, s_off, d_off, plen, head_sliced)


class _Pair(NamedTuple):
    """What a plan from ``src`` into ``dst`` needs of the two geometries alone, checked and
    worked out once per pair (:func:`_pair`): every transfer between the same two ranks plans
    with the same two geometry objects, and these checks and conversions were most of a small
    plan's time (on P's core, beside the engine's step)."""

    src: KVGeometry
    dst: KVGeometry
    heads: tuple[int, int] | None  # global heads [lo, hi) src writes into dst (None: none)
    nh: int  # heads written
    h0s: int  # first written head's local index on each side
    h0d: int
    vec: int  # bytes of one (token, head) vector
    ts_s: int  # vector-index steps per token and per head, each side (``_order``)
    hs_s: int
    ts_d: int
    hs_d: int
    head_sliced: bool
    s_base: np.ndarray  # (layers, parts) int64 base addresses
    d_base: np.ndarray
    adjacent: bool  # both sides keep each block's V right after its K
    token_rows: bool  # a run's written heads of a token, token after token, are contiguous on
    # both sides (e.g. NHD with every head written): every run is one piece, whatever its length


#: (id(src), id(dst)) -> its _Pair; the entry holds both geometries, so neither id is reused
#: while it is here, and a hit is checked by identity
_PAIRS: dict[tuple[int, int], _Pair] = {}
_PAIRS_LOCK = threading.Lock()
_MAX_PAIRS = 256


def _pair(src: KVGeometry, dst: KVGeometry) -> _Pair:
    """The checked :class:`_Pair` of ``src`` and ``dst`` (GeometryError as :func:`plan_writes`
    documents; a pair that fails is not kept, so it fails the same way every time)."""
    hit = _PAIRS.get((id(src), id(dst)))
    if hit is not None and hit.src is src and hit.dst is dst:
        return hit
    src.validate()
    dst.validate()
    src.compatible_with(dst)
    _check_addresses(src, "producer")
    _check_addresses(dst, "decoder")
    heads = writer_ranks(src.num_kv_heads, src.tp_size, dst.tp_size, dst.tp_rank).get(src.tp_rank)
    nh = h0s = h0d = 0
    head_sliced = False
    if heads is not None:
        nh = heads[1] - heads[0]
        h0s, h0d = heads[0] - src.head_range[0], heads[0] - dst.head_range[0]
        head_sliced = (src.token_order == "NHD" and nh < src.local_heads) or (
            dst.token_order == "NHD" and nh < dst.local_heads)
    ts_s, hs_s = _order(src)
    ts_d, hs_d = _order(dst)

    def rows(ts: int, hs: int) -> bool:  # plan_writes' tok_outer, for runs of any length
        return (nh <= 1 or hs == 1) and ts == 1 + (nh - 1) * hs

    pair = _Pair(src, dst, heads, nh, h0s, h0d, src.vec_bytes, ts_s, hs_s, ts_d, hs_d,
                 head_sliced, np.array(src.part_bases, dtype=np.int64).T,
                 np.array(dst.part_bases, dtype=np.int64).T,
                 _kv_adjacent(src) and _kv_adjacent(dst),
                 heads is not None and rows(ts_s, hs_s) and rows(ts_d, hs_d))
    with _PAIRS_LOCK:  # (planners on several threads: one eviction at a time)
        while len(_PAIRS) >= _MAX_PAIRS:  # (a worker meets few pairs: its rank and its peers')
            _PAIRS.pop(next(iter(_PAIRS)))
        _PAIRS[(id(src), id(dst))] = pair
    return pair


def _broadcast_and_merge(pair: _Pair, s_off: np.ndarray, d_off: np.ndarray,
                         plen: np.ndarray, head_sliced: bool) -> WritePlan:
    """Repeat per-piece offsets over layers and K/V parts, then merge contiguous regions."""
    pieces = s_off.shape[0]

    # Broadcast over layers and K/V: (layer, K/V, piece) or, when both sides keep V right after
    # K in every block, (layer, piece, K/V) so that K+V of whole blocks merge.
    # With kv_parts == 1 (one combined part per block) there is a single "K/V" slot.
    s_base, d_base = pair.s_base, pair.d_base  # (layers, parts)
    layers, parts = s_base.shape
    if pair.adjacent:
        s_all = (s_base[:, None, :] + s_off[None, :, None]).ravel()
        d_all = (d_base[:, None, :] + d_off[None, :, None]).ravel()
        l_all = np.broadcast_to(plen[None, :, None], (layers, pieces, parts)).ravel()
        # K and V of one block share an allocation: the unit a region may not leave is a layer
        span = pieces * parts
    else:
        s_all = (s_base[:, :, None] + s_off[None, None, :]).ravel()
        d_all = (d_base[:, :, None] + d_off[None, None, :]).ravel()
        l_all = np.broadcast_to(plen[None, None, :], (layers, parts, pieces)).ravel()
        span = pieces  # one (layer, part) span

    # Merge: a piece continues the previous one when both its ends line up.
    s_end = s_all[:-1] + l_all[:-1]
    new = np.empty(s_all.shape[0], dtype=bool)
    np.not_equal(s_end, s_all[1:], out=new[1:])
    new[1:] |= (d_all[:-1] + l_all[:-1]) != d_all[1:]
    # never across a layer's (or part's) span: each is registered as its own region, since
    # adjacent tensors are still separate device allocations (the first piece of each starts one)
    new[::span] = True
    heads_at = np.flatnonzero(new)
    return WritePlan(
        src=s_all[heads_at].astype(np.uint64),
        dst=d_all[heads_at].astype(np.uint64),
        length=np.add.reduceat(l_all, heads_at).astype(np.uint64),
        unmerged=int(s_all.shape[0]),
        head_sliced=bool(head_sliced),
    )


def fragmentation(src: KVGeometry, dst: KVGeometry) -> float:
    """How many times more WRITE descriptors the region path needs from ``src`` into ``dst`` than
    between two equal layouts, per byte (blocks not merged, as with fragmented block ids).

    1.0 when the layouts line up block for block; about ``block_size x heads`` when one side is
    token-major (NHD) and the other head-major (HND), since every (token, head) vector is then a
    region of its own. Measured on one run of ``lcm(block sizes)`` tokens (at least one block of
    each side), with the writer rank of ``dst``'s first head, so it costs a few small plans."""
    n = math.lcm(src.block_size, dst.block_size)
    n = max(n, src.block_size, dst.block_size)
    if n // src.block_size > src.num_blocks or n // dst.block_size > dst.num_blocks:
        return 1.0  # too few blocks to tell (only in tiny test geometries)
    writers = writer_ranks(src.num_kv_heads, src.tp_size, dst.tp_size, dst.tp_rank)
    if src.tp_rank not in writers:
        return 1.0
    here = plan_writes(src, range(n // src.block_size), dst, range(n // dst.block_size),
                       first_token=0, num_tokens=n)
    alike = plan_writes(dst, range(n // dst.block_size), dst, range(n // dst.block_size),
                        first_token=0, num_tokens=n)
    if not here.unmerged or not alike.unmerged:
        return 1.0
    return (here.unmerged / here.total_bytes) / (alike.unmerged / alike.total_bytes)
